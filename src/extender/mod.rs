//! `gpushare extender`: the HTTP scheduler extender (filter / prioritize / bind / inspect) with
//! its per-GPU ledger, wire-compatible with Aliyun's gpushare-scheduler-extender.
//!
//! Layout: [`wire`] (the extender API JSON), [`cache`] (the ledger), [`sync`] (watches that
//! feed it), [`filter`], [`prioritize`], [`bind`], [`inspect`] (the verbs), [`routes`] (HTTP),
//! [`metrics`], [`state`] (shared state and the readiness gate), [`leader`] (Lease election
//! and the fence of binds), [`forward`] (standbys hand the verbs to the leader),
//! `reservations` (a bind's reservation written on the pod, counted by any successor).
//!
//! [`start`] is the in-process entry point (tests, `gpushare demo`); [`run`] is the
//! subcommand.

pub mod bind;
mod bind_error;
mod bind_owners;
pub mod cache;
#[cfg(test)]
mod cache_props;
pub(crate) mod filter;
pub(crate) mod forward;
pub mod inspect;
pub mod leader;
pub mod metrics;
pub(crate) mod prioritize;
pub(crate) mod reservations;
pub mod routes;
pub mod state;
pub mod sync;
pub(crate) mod verb_error;
pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::config::{Config, FlagOverrides};
use crate::core::{GpuPolicy, NodePolicy};
use crate::shutdown::{self, Shutdown, Trigger};
pub use state::ExtenderState;

/// Flags of `gpushare extender`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {
    /// Address to listen on [config: extender.bind_address; default 0.0.0.0]
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<IpAddr>,
    /// Port to listen on; the upstream manifests use 12345 [env: PORT; config: extender.port;
    /// default 39999]
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// URL prefix of filter / prioritize / bind / inspect, as in the scheduler's `urlPrefix`
    /// [config: extender.url_prefix; default /gpushare-scheduler]
    #[arg(long, value_name = "PATH")]
    pub url_prefix: Option<String>,
    /// prioritize: `binpack` prefers fuller nodes (keeps whole GPUs free for big jobs),
    /// `spread` prefers emptier ones [config: extender.node_policy; default binpack]
    #[arg(long, value_name = "POLICY")]
    pub node_policy: Option<NodePolicy>,
    /// bind: `binpack` puts the pod on the fullest GPU that fits (upstream rule), `spread` on
    /// the emptiest [config: extender.gpu_policy; default binpack]
    #[arg(long, value_name = "POLICY")]
    pub gpu_policy: Option<GpuPolicy>,
    /// PEM certificate chain; with --tls-key the extender serves HTTPS (scheduler config
    /// `enableHTTPS: true`) [config: extender.tls_cert]
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert [config: extender.tls_key]
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA: filter / prioritize / bind / inspect then need a client certificate it signed
    /// (kube-scheduler's extender `tlsConfig`); /healthz, /readyz, /version and /metrics stay
    /// open. Re-read when the file changes [config: extender.tls_client_ca]
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Run several replicas: compete for a Lease; the leader serves the scheduling verbs and
    /// the others forward them to it, so every replica is Ready (`--leader-elect=false` turns
    /// it off) [config: extender.leader_elect]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub leader_elect: Option<bool>,
    /// HOST[:PORT] where the other replicas reach this one when it leads (the port defaults
    /// to --port) [config: extender.advertise_address; default: $POD_IP and the serving port]
    #[arg(long, value_name = "HOST[:PORT]")]
    pub advertise_address: Option<String>,
    /// Name of the Lease for --leader-elect [config: extender.lease_name;
    /// default gpushare-schd-extender]
    #[arg(long, value_name = "NAME")]
    pub lease_name: Option<String>,
    /// Namespace of the Lease [config: extender.lease_namespace; default kube-system]
    #[arg(long, value_name = "NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Do not run the control-plane preflight (doctor) before starting [config: doctor.skip]
    #[arg(long)]
    pub skip_doctor: bool,
}

impl Args {
    /// The flags as configuration overrides.
    pub(crate) fn overrides(&self, flags: &mut FlagOverrides) {
        let Args {
            bind_address,
            port,
            url_prefix,
            node_policy,
            gpu_policy,
            tls_cert,
            tls_key,
            tls_client_ca,
            leader_elect,
            advertise_address,
            lease_name,
            lease_namespace,
            skip_doctor,
        } = self;
        flags.set("extender.bind_address", bind_address.map(|a| a.to_string()));
        flags.set("extender.port", *port);
        flags.set("extender.url_prefix", url_prefix.clone());
        flags.set("extender.node_policy", *node_policy);
        flags.set("extender.gpu_policy", *gpu_policy);
        flags.set(
            "extender.tls_cert",
            tls_cert.as_ref().map(|p| p.display().to_string()),
        );
        flags.set(
            "extender.tls_key",
            tls_key.as_ref().map(|p| p.display().to_string()),
        );
        flags.set(
            "extender.tls_client_ca",
            tls_client_ca.as_ref().map(|p| p.display().to_string()),
        );
        flags.set("extender.leader_elect", *leader_elect);
        flags.set("extender.advertise_address", advertise_address.clone());
        flags.set("extender.lease_name", lease_name.clone());
        flags.set("extender.lease_namespace", lease_namespace.clone());
        flags.set_flag("doctor.skip", *skip_doctor);
    }
}

/// A running extender (in-process).
#[derive(Debug)]
pub struct ExtenderHandle {
    /// The address it listens on.
    pub addr: SocketAddr,
    state: Arc<ExtenderState>,
    stop: Trigger,
    server: JoinHandle<()>,
    watches: Vec<JoinHandle<()>>,
    election: Option<leader::Election>,
}

impl ExtenderHandle {
    /// The shared state (ledger, readiness gate, metrics).
    pub fn state(&self) -> Arc<ExtenderState> {
        self.state.clone()
    }

    /// Resolves once the ledger is synced and the replica serves (at most 60 s).
    pub async fn wait_ready(&self) -> anyhow::Result<()> {
        let mut rx = self.state.ready_watch();
        tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|r| *r))
            .await
            .context("the extender did not become ready within 60 s")?
            .context("the extender stopped before it became ready")?;
        Ok(())
    }

    /// Stops serving, drains open connections and stops the watches.
    pub async fn stop(self) {
        self.stop.trigger();
        let _ = self.server.await;
        // After the drain no bind of ours runs any more: the lease may go.
        if let Some(election) = self.election {
            election.resign().await;
        }
        for w in &self.watches {
            w.abort();
        }
        for w in self.watches {
            let _ = w.await;
        }
    }
}

/// What an in-process start may set besides the configuration (tests).
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    /// The clock of the election and the fence; the machine's when `None`.
    pub clock: Option<Arc<dyn leader::Clock>>,
    /// The replica's identity; [`leader::identity`] when `None`.
    pub identity: Option<String>,
    /// How often the TLS files are looked at for changes; [`crate::tls::DEFAULT_REFRESH`]
    /// when `None`.
    pub tls_refresh: Option<Duration>,
}

/// Starts the extender in-process: binds the listener first (a port conflict fails at once),
/// then starts the watches and the server. Stops on `shutdown` or [`ExtenderHandle::stop`].
pub async fn start(
    config: &Config,
    client: kube::Client,
    shutdown: Shutdown,
) -> anyhow::Result<ExtenderHandle> {
    start_with(config, client, shutdown, StartOptions::default()).await
}

/// [`start`] with [`StartOptions`].
pub async fn start_with(
    config: &Config,
    client: kube::Client,
    shutdown: Shutdown,
    options: StartOptions,
) -> anyhow::Result<ExtenderHandle> {
    let ext = &config.extender;
    let addr = SocketAddr::new(ext.bind_address, ext.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (extender.bind_address / --port)"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let tls = match (ext.tls_cert.is_empty(), ext.tls_key.is_empty()) {
        (true, true) if ext.tls_client_ca.is_empty() => None,
        (false, false) => {
            let files = crate::tls::CertFiles {
                cert: PathBuf::from(&ext.tls_cert),
                key: PathBuf::from(&ext.tls_key),
            };
            let ca = (!ext.tls_client_ca.is_empty()).then(|| Path::new(&ext.tls_client_ca));
            Some(Arc::new(
                crate::tls::ServerTls::load(files, ca).context("extender TLS")?,
            ))
        }
        _ => anyhow::bail!(
            "extender.tls_cert and extender.tls_key must be given together (and \
             extender.tls_client_ca needs both)"
        ),
    };
    let clock = options
        .clock
        .unwrap_or_else(|| Arc::new(leader::SystemClock) as Arc<dyn leader::Clock>);
    let identity = leader::identity(options.identity.as_deref());
    let fence = if ext.leader_elect {
        leader::Fence::elected(identity, clock, leader::LeaseTiming::from_config(ext)?)
    } else {
        leader::Fence::unelected(identity, clock)
    };
    // Either the caller's shutdown or our own stop ends everything.
    let (stop, combined) = shutdown.child();
    let state = ExtenderState::new(ext.clone(), client, fence, combined.clone());
    let mut watches = sync::spawn(state.clone(), combined.clone());
    let election = if ext.leader_elect {
        // The election owns the watches: it restarts them (a fresh list) on every win.
        let taken = std::mem::take(&mut watches);
        let pod_ip = std::env::var("POD_IP").ok();
        let address = leader::advertise_url(
            &ext.advertise_address,
            pod_ip.as_deref(),
            ext.bind_address,
            addr.port(),
            tls.is_some(),
        );
        if address.is_none() {
            tracing::warn!(
                "no address to advertise (set --advertise-address or POD_IP): while this replica \
                 leads, the others cannot forward to it"
            );
        }
        Some(leader::Election::start(
            state.clone(),
            taken,
            address,
            combined.clone(),
        )?)
    } else {
        None
    };
    let forwarder =
        forward::Forwarder::new(state.fence().identity(), tls.as_ref().map(|t| t.serving()))?;
    let acceptor = match &tls {
        Some(t) => {
            tokio::spawn(t.clone().keep_fresh(
                options.tls_refresh.unwrap_or(crate::tls::DEFAULT_REFRESH),
                combined.clone(),
            ));
            Some((t.acceptor().context("extender TLS")?, t.clone()))
        }
        None => None,
    };
    let server = tokio::spawn(routes::serve(
        listener,
        acceptor,
        forwarder,
        state.clone(),
        crate::http_server::Limits::from_config(&config.http),
        combined,
    ));
    tracing::info!(
        %addr,
        prefix = %ext.url_prefix,
        tls = !ext.tls_cert.is_empty(),
        client_certificates = !ext.tls_client_ca.is_empty(),
        node_policy = %ext.node_policy,
        gpu_policy = %ext.gpu_policy,
        "extender listening; waiting for the ledger to sync"
    );
    Ok(ExtenderHandle {
        addr,
        state,
        stop,
        server,
        watches,
        election,
    })
}

/// Runs `gpushare extender` until SIGTERM/SIGINT.
pub async fn run(_args: Args, config: Config) -> anyhow::Result<ExitCode> {
    let client = crate::k8s::client(&crate::k8s::ClientOptions {
        kubeconfig: Some(config.cluster.kubeconfig.as_str()),
        ..Default::default()
    })
    .await?;
    let wait = Duration::from_secs(config.cluster.api_wait_secs);
    crate::k8s::reachable::wait_for_api(&config.cluster.kubeconfig, wait, "extender").await?;
    if let Some(soft) = crate::fd_limit::raise_soft_to_hard()
        && let Some(why) = crate::fd_limit::cap_warning(config.http.max_connections, soft)
    {
        tracing::warn!("{why}");
    }
    let (trigger, _) = shutdown::channel();
    let shutdown = shutdown::on_signals(trigger);
    let handle = start(&config, client, shutdown.clone()).await?;
    shutdown.wait().await;
    tracing::info!("draining");
    handle.stop().await;
    Ok(ExitCode::SUCCESS)
}
