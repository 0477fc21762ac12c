//! `gpushare webhook`: the admission webhook of managed clusters (EKS, GKE, AKS, ACK), where
//! the default kube-scheduler cannot be given our extender. `POST /mutate` sends every pod
//! that asks for `aliyun.com/gpu-mem` to our own kube-scheduler (`gpushare-scheduler`);
//! `POST /validate` refuses malformed gpu-mem requests with a message that says what to write.
//!
//! Layout: [`admission`] (the reviews and the two decisions, pure; what would switch off the
//! CUDA memory limiter: [`limiter_guard`]), [`dra_mode`] (which path a
//! gpu-mem pod takes, and on the DRA path its claim template made to exist), [`dra_rewrite`]
//! (the DRA policy, pure: one claim per pod, the GPU shared by its containers, HCAs aligned,
//! which resources move), [`routes`] (HTTP on the
//! shared [`crate::http_server`], over TLS), [`certs`] (rcgen / x509-parser / the swappable
//! served certificate), [`bootstrap`] (`--self-signed`: the Secret shared by all replicas and
//! the `caBundle` of both webhook configurations).
//!
//! It does not schedule, bind or touch GPUs; it never changes a pod that does not ask for
//! gpu-mem, and never one that already names a scheduler other than the default one.

pub(crate) mod admission;
pub mod bootstrap;
pub mod certs;
pub mod dra_mode;
pub mod dra_rewrite;
pub mod limiter_guard;
pub(crate) mod routes;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::admin::AdminState;
use crate::config::{Config, FlagOverrides};
use crate::shutdown::{self, Shutdown, Trigger};
pub use certs::DEFAULT_REFRESH;
use certs::ServingCert;
use routes::WebhookState;

/// Flags of `gpushare webhook`.
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
pub struct Args {
    /// Address to listen on [config: webhook.bind_address; default 0.0.0.0]
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<IpAddr>,
    /// HTTPS port [config: webhook.port; default 9443]
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// The scheduler gpu-mem pods are sent to; empty: pods keep their scheduler (the default
    /// kube-scheduler calls the extender, and only the DRA path changes pods) [config:
    /// webhook.scheduler_name; default gpushare-scheduler]
    #[arg(long, value_name = "NAME")]
    pub scheduler_name: Option<String>,
    /// Largest aliyun.com/gpu-mem one pod may ask for, in units [config: webhook.max_gpu_mem;
    /// default 81920]
    #[arg(long, value_name = "UNITS")]
    pub max_gpu_mem: Option<u64>,
    /// PEM certificate chain (e.g. from cert-manager), re-read when it changes
    /// [config: webhook.tls_cert]
    #[arg(
        long,
        value_name = "PATH",
        requires = "tls_key",
        conflicts_with = "self_signed"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert [config: webhook.tls_key]
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Keep our own CA and serving certificate in a Secret (shared by all replicas, renewed
    /// before expiry) and write the CA into the webhook configurations [config:
    /// webhook.self_signed]
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub self_signed: bool,
    /// The Secret of --self-signed [config: webhook.tls_secret; default gpushare-webhook-tls]
    #[arg(long, value_name = "NAME")]
    pub tls_secret: Option<String>,
    /// Namespace of the Secret and the Service [config: webhook.namespace; default
    /// kube-system]
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// The Service in front of the webhook, named by the serving certificate
    /// [config: webhook.service_name; default gpushare-webhook]
    #[arg(long, value_name = "NAME")]
    pub service_name: Option<String>,
    /// The Mutating- and ValidatingWebhookConfiguration whose caBundle --self-signed writes
    /// [config: webhook.webhook_config; default gpushare-webhook]
    #[arg(long, value_name = "NAME")]
    pub webhook_config: Option<String>,
    /// The path of aliyun.com/gpu-mem pods in namespaces without the gpushare.io/gpu-mem-path
    /// label: extender (sent to --scheduler-name) or dra (rewritten into one ResourceClaim)
    /// [config: webhook.gpu_mem_path; default extender]
    #[arg(long, value_name = "PATH")]
    pub gpu_mem_path: Option<crate::config::GpuMemPath>,
    /// Size of one unit of aliyun.com/gpu-mem on the DRA path, as the DRA plugins count it:
    /// GiB, MiB or e.g. 256MiB [config: node.memory_unit; default GiB]
    #[arg(long, value_name = "UNIT")]
    #[serde(rename = "node.memory_unit")]
    pub memory_unit: Option<crate::core::MemoryUnit>,
    /// The DRA driver of the claims' devices, as the DRA plugins publish them (their
    /// <driver>/uuid keeps a pod on one GPU) [config: dra.driver_name; default gpushare.io]
    #[arg(long, value_name = "NAME")]
    #[serde(rename = "dra.driver_name")]
    pub driver_name: Option<String>,
}

impl Args {
    /// The flags as configuration overrides.
    pub(crate) fn overrides(&self, flags: &mut FlagOverrides) {
        flags.args("webhook", self);
    }
}

/// A running webhook (in-process).
#[derive(Debug)]
pub struct WebhookHandle {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The certificate it presents.
    pub serving: Arc<ServingCert>,
    /// The CA bundle to trust (only known with `--self-signed`).
    pub ca_bundle: Option<String>,
    stop: Trigger,
    tasks: Vec<JoinHandle<()>>,
}

impl WebhookHandle {
    /// Stops serving and the refresh loop.
    pub async fn stop(self) {
        self.stop.trigger();
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Waits `d` or until `stop`; returns false when stopped.
async fn pause(d: Duration, stop: &Shutdown) -> bool {
    tokio::select! {
        _ = stop.clone().wait() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// With `--self-signed`: the certificate bootstrap (the Secret and the caBundles; a few
/// attempts, then an error), and the task that renews it every `refresh` (pushed to `tasks`).
/// The serving certificate and the CA to trust.
async fn self_signed(
    config: &Config,
    client: Option<kube::Client>,
    refresh: Duration,
    combined: &Shutdown,
    tasks: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<(Arc<ServingCert>, String)> {
    let w = &config.webhook;
    let client = client.context("--self-signed needs the API server (kubeconfig)")?;
    let boot =
        bootstrap::Bootstrap::new(client, w).retaining((3 * refresh).max(3 * DEFAULT_REFRESH));
    let mut attempt = 0u32;
    let (material, missing) = loop {
        match boot.reconcile(None).await {
            Ok(done) => break done,
            Err(e) if attempt < 5 => {
                attempt += 1;
                tracing::warn!(error = %e, attempt, "webhook certificate bootstrap failed; retrying");
                if !pause(Duration::from_millis(200 << attempt), combined).await {
                    anyhow::bail!("stopped during the certificate bootstrap");
                }
            }
            Err(e) => return Err(e).context("webhook certificate bootstrap (--self-signed)"),
        }
    };
    for m in &missing {
        tracing::warn!(config = %m, "webhook configuration not found; its caBundle will be written once it exists");
    }
    let serving = ServingCert::new(&material.serving)?;
    let ca = material.ca.cert.clone();
    let keep = serving.clone();
    let stop = combined.clone();
    tasks.push(tokio::spawn(async move {
        let mut last = material;
        while pause(refresh, &stop).await {
            match boot.reconcile(Some(&last)).await {
                Ok((m, _)) if m != last => {
                    match keep.set(&m.serving) {
                        Ok(()) => tracing::info!("serving the renewed webhook certificate"),
                        Err(e) => tracing::warn!(error = %e, "renewed certificate unusable"),
                    }
                    last = m;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "webhook certificate refresh failed; will retry")
                }
            }
        }
    }));
    Ok((serving, ca))
}

/// Starts the webhook: TLS material first (with `--self-signed`, the Secret and caBundles;
/// a few attempts, then an error), then the listener. `refresh` is the certificate check
/// period ([`DEFAULT_REFRESH`]).
pub async fn start(
    config: &Config,
    client: Option<kube::Client>,
    refresh: Duration,
    shutdown: Shutdown,
) -> anyhow::Result<WebhookHandle> {
    let w = &config.webhook;
    let (stop, stopped) = shutdown::channel();
    let combined = {
        let (t, s) = shutdown::channel();
        let mine = stopped.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.wait() => {}
                _ = mine.wait() => {}
            }
            t.trigger();
        });
        s
    };
    let mut tasks = Vec::new();
    let (serving, ca_bundle) = if w.self_signed {
        let (serving, ca) =
            self_signed(config, client.clone(), refresh, &combined, &mut tasks).await?;
        (serving, Some(ca))
    } else if !w.tls_cert.is_empty() {
        let files = certs::CertFiles {
            cert: PathBuf::from(&w.tls_cert),
            key: PathBuf::from(&w.tls_key),
        };
        // The one re-read-on-change mechanism (crate::tls), as the extender uses it.
        let material = Arc::new(crate::tls::ServerTls::load(files, None)?);
        tasks.push(tokio::spawn(
            material.clone().keep_fresh(refresh, combined.clone()),
        ));
        let serving = material.serving();
        (serving, None)
    } else {
        return Err(crate::failure::config(anyhow::anyhow!(
            "gpushare webhook serves HTTPS only: give --tls-cert and --tls-key (e.g. from \
             cert-manager) or --self-signed"
        )));
    };
    // With the API, the path of each gpu-mem pod is its namespace's label (else
    // webhook.gpu_mem_path); without it, every pod takes the extender path.
    let dra = match (&client, w.gpu_mem_path) {
        (Some(c), path) => Some(
            dra_mode::DraMode::new(
                c.clone(),
                path,
                config.node.memory_unit,
                &config.dra.driver_name,
            )
            .with_kinds(dra_rewrite::kind_requests(&config.devices)),
        ),
        (None, crate::config::GpuMemPath::Extender) => None,
        (None, crate::config::GpuMemPath::Dra) => {
            return Err(crate::failure::config(anyhow::anyhow!(
                "webhook.gpu_mem_path dra needs the API server (kubeconfig or in-cluster)"
            )));
        }
    };
    let addr = SocketAddr::new(w.bind_address, w.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (webhook.bind_address / --port)"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let admin = AdminState::new();
    let state = WebhookState::new(
        admin.clone(),
        w.scheduler_name.clone(),
        w.max_gpu_mem,
        Duration::from_millis(config.http.body_read_timeout_ms),
        dra,
        limiter_guard::LimiterGuard::of(&config.node),
    );
    let metrics = admin.with_registry(crate::http_server::ServerMetrics::register);
    let acceptor = serving.acceptor()?;
    admin.set_ready(true);
    let handler = move |req| routes::handle(state.clone(), req);
    tasks.push(tokio::spawn(crate::http_server::serve(
        "webhook",
        listener,
        Some(acceptor),
        crate::http_server::Limits::from_config(&config.http),
        metrics,
        handler,
        combined,
    )));
    tracing::info!(%addr, scheduler = %w.scheduler_name, self_signed = w.self_signed, "webhook listening (HTTPS)");
    Ok(WebhookHandle {
        addr,
        serving,
        ca_bundle,
        stop,
        tasks,
    })
}

/// The webhook's API client. kube's own quiet retry of 429 / 503 / 504 is off: on an
/// admission's path the webhook retries a read itself, a bounded number of times within the
/// admission's deadline, and a storm of such answers is not multiplied into a long hang.
pub async fn api_client(config: &Config) -> anyhow::Result<kube::Client> {
    crate::k8s::client(&crate::k8s::ClientOptions {
        kubeconfig: Some(config.cluster.kubeconfig.as_str()),
        without_kube_retry: true,
        ..Default::default()
    })
    .await
}

/// Runs `gpushare webhook` until SIGTERM/SIGINT.
pub async fn run(_args: Args, config: Config) -> anyhow::Result<ExitCode> {
    // The API serves --self-signed and the DRA mode (namespace labels, claim templates).
    // Without --self-signed and with the extender path cluster-wide, a webhook that cannot
    // build a client still serves, without reading namespace labels.
    let needed =
        config.webhook.self_signed || config.webhook.gpu_mem_path == crate::config::GpuMemPath::Dra;
    let built = api_client(&config).await;
    let client = match built {
        Ok(c) => Some(c),
        Err(e) if !needed => {
            tracing::warn!(error = %e, "no API client: namespace labels gpushare.io/gpu-mem-path are not read");
            None
        }
        Err(e) => return Err(e),
    };
    if needed {
        let wait = std::time::Duration::from_secs(config.cluster.api_wait_secs);
        crate::k8s::reachable::wait_for_api(&config.cluster.kubeconfig, wait, "webhook").await?;
    }
    if let Some(soft) = crate::fd_limit::raise_soft_to_hard()
        && let Some(why) = crate::fd_limit::cap_warning(config.http.max_connections, soft)
    {
        tracing::warn!("{why}");
    }
    let (trigger, _) = shutdown::channel();
    let shutdown = shutdown::on_signals(trigger);
    let handle = start(&config, client, DEFAULT_REFRESH, shutdown.clone()).await?;
    shutdown.wait().await;
    tracing::info!("draining");
    handle.stop().await;
    Ok(ExitCode::SUCCESS)
}
