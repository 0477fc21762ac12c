//! `gpushare inspect` (also `kubectl inspect gpushare`): where the GPU memory of the cluster
//! went, per node and per GPU, and why a pod does not fit.
//!
//! Data comes from the API server (Nodes and Pods, read-only, like upstream
//! `kubectl-inspect-gpushare`, plus the DRA path's ResourceSlices and ResourceClaims when the
//! server has `resource.k8s.io/v1`: [`dra`]) or, with `--from-extender URL`, from the extender's
//! `/gpushare-scheduler/inspect` answer (what the scheduler believes). Either way it becomes
//! one [`report::Report`], rendered by [`render`]:
//!
//! - `table` (default) and `-d`: the upstream layout, byte for byte (reference spec §6), with
//!   rows sorted (nodes by name, pods by namespace/name);
//! - `wide`: per GPU a bar, health and pods; per node the largest request that still fits on
//!   one healthy GPU (`fits: 7 GiB`);
//! - `json` / `yaml`: the report model, a stable schema with camelCase keys:
//!
//! ```text
//! { "source": "api" | "extender",
//!   "unit": "GiB",                       // label of the cluster totals (first node's unit)
//!   "nodes": [ { "name", "address", "unit",
//!                "gpus": [ { "index", "total", "used", "healthy",
//!                            "pods": [ { "namespace", "name", "uid", "memory", "state" } ] } ],
//!                "pending": [ <pod as above> ],
//!                "total", "used", "largestFit" } ],
//!   "total", "used",
//!   "notes": [ "..." ] }
//! ```
//!
//! Amounts are integers in the node's unit. `state` is one of `assigned`, `assumed`,
//! `bound`, `allocation-annotation`, `dra-claim` (on a GPU), `no-index`, `index-out-of-range`
//! (pending), or whatever the extender reports. New keys may be added; existing keys keep their meaning.
//!
//! This module never writes to the cluster.

pub mod dra;
pub(crate) mod render;
pub mod report;

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use tracing::instrument::WithSubscriber as _;
use tracing::subscriber::NoSubscriber;

use crate::config::{Config, FlagOverrides, LogLevel};
use crate::core::wire::EXTENDER_URL_PREFIX;
use crate::failure;
use crate::k8s::describe;
use crate::outbound::{self, Identity, TlsOptions, Trust};
use report::{ExtenderInspect, Report};

/// Timeout of each request to the API server or the extender.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The upstream summary table (`-d`: the upstream details view).
    #[default]
    Table,
    /// Per GPU: a usage bar, health and pods; per node: the largest request that fits.
    Wide,
    /// The report as JSON.
    Json,
    /// The report as YAML.
    Yaml,
}

/// Flags of `gpushare inspect` / `kubectl inspect gpushare`.
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
pub struct Args {
    /// Show only this node.
    #[arg(value_name = "NODE")]
    #[serde(skip)]
    pub node: Option<String>,
    /// Per node, one row per pod (the upstream details view of the table format).
    #[arg(short = 'd', long)]
    #[serde(skip)]
    pub details: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Format::Table)]
    #[serde(skip)]
    pub output: Format,
    /// Kubeconfig context to use.
    #[arg(long, value_name = "CONTEXT")]
    #[serde(skip)]
    pub context: Option<String>,
    /// Read the extender's view (`<URL>/gpushare-scheduler/inspect`) instead of the API server.
    #[arg(long, value_name = "URL")]
    #[serde(skip)]
    pub from_extender: Option<String>,
    /// With an https:// --from-extender: the PEM CA that signed the extender's serving
    /// certificate (required for https).
    #[arg(long, value_name = "PATH")]
    #[serde(skip)]
    pub extender_ca: Option<PathBuf>,
    /// With an https:// --from-extender: a PEM client certificate, for an extender that
    /// checks client certificates (`--tls-client-ca`).
    #[arg(long, value_name = "PATH", requires = "extender_key")]
    #[serde(skip)]
    pub extender_cert: Option<PathBuf>,
    /// The PEM private key of --extender-cert.
    #[arg(long, value_name = "PATH", requires = "extender_cert")]
    #[serde(skip)]
    pub extender_key: Option<PathBuf>,
    /// The name to check the extender's serving certificate against, when it differs from
    /// the URL's host (e.g. through `kubectl port-forward`).
    #[arg(long, value_name = "NAME")]
    #[serde(skip)]
    pub extender_server_name: Option<String>,
    /// The DRA driver whose ResourceSlices and claims are read (the chart's dra.driverName)
    /// [config: dra.driver_name; default gpushare.io]
    #[arg(long, value_name = "NAME")]
    #[serde(rename = "dra.driver_name")]
    pub driver_name: Option<String>,
}

/// How `--from-extender` reaches an https:// extender.
#[derive(Clone, Debug, Default)]
pub struct ExtenderTls {
    /// The CA of the extender's serving certificate.
    pub ca: Option<PathBuf>,
    /// Client certificate and key.
    pub client: Option<(PathBuf, PathBuf)>,
    /// Server name to verify instead of the URL's host.
    pub server_name: Option<String>,
}

impl ExtenderTls {
    /// From the flags.
    pub fn from_args(args: &Args) -> ExtenderTls {
        ExtenderTls {
            ca: args.extender_ca.clone(),
            client: args.extender_cert.clone().zip(args.extender_key.clone()),
            server_name: args.extender_server_name.clone(),
        }
    }

    /// The outbound client for an https:// extender.
    fn client(&self) -> anyhow::Result<outbound::Client> {
        let ca = self.ca.as_ref().ok_or_else(|| {
            failure::usage(anyhow!(
                "an https:// extender needs --extender-ca (the CA that signed its serving certificate)"
            ))
        })?;
        let identity = match &self.client {
            None => Identity::None,
            Some((cert, key)) => Identity::Files {
                cert: cert.clone(),
                key: key.clone(),
            },
        };
        outbound::Client::new(TlsOptions {
            trust: Trust::CaFile(ca.clone()),
            identity,
            server_name: self.server_name.clone(),
        })
        .map_err(failure::usage)
    }
}

impl Args {
    /// The flags as configuration overrides (none: `--kubeconfig` is a global flag).
    pub(crate) fn overrides(&self, flags: &mut FlagOverrides) {
        flags.args("inspect", self);
    }
}

/// Renders `report` in the chosen format.
pub fn render_report(report: &Report, output: Format, details: bool) -> String {
    match output {
        Format::Table if details => render::details(report),
        Format::Table => render::table(report),
        Format::Wide => render::wide(report),
        Format::Json => render::json(report),
        Format::Yaml => render::yaml(report),
    }
}

/// Runs inspect: prints the report, or one line on stderr and exit status 1.
pub async fn run(args: Args, config: Config) -> anyhow::Result<ExitCode> {
    let fetch = async {
        match &args.from_extender {
            Some(url) => {
                from_extender_with(url, args.node.as_deref(), &ExtenderTls::from_args(&args)).await
            }
            None => from_api(&args, &config).await,
        }
    };
    // A command-line report: the clients' own logs (kube logs every failed request at ERROR)
    // are noise next to the one-line error, unless debugging was asked for.
    let report = if matches!(config.log.level, LogLevel::Debug | LogLevel::Trace) {
        fetch.await
    } else {
        fetch.with_subscriber(NoSubscriber::default()).await
    };
    match report {
        Ok(report) => {
            let text = render_report(&report, args.output, args.details);
            // A closed stdout (`| head`) is not an error worth a panic.
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("gpushare inspect: {}", failure::one_line(e.as_ref()));
            Ok(ExitCode::from(failure::status(&e)))
        }
    }
}

/// The kubeconfig to read explicitly; `None` lets kube infer it (`$KUBECONFIG`, several
/// paths merged, then `~/.kube/config`, then in-cluster). The configuration carries
/// `$KUBECONFIG` verbatim when only the environment set it; that case is inferred too, so a
/// list of paths works.
fn explicit_kubeconfig(config: &Config) -> Option<&str> {
    let path = config.cluster.kubeconfig.as_str();
    let from_env = std::env::var("KUBECONFIG").ok();
    if path.is_empty() || from_env.as_deref() == Some(path) {
        None
    } else {
        Some(path)
    }
}

/// The API server URL the client would use, for error messages.
async fn api_server_url(kubeconfig: Option<&str>, context: Option<&str>) -> Option<String> {
    let opts = KubeConfigOptions {
        context: context.map(str::to_string),
        ..KubeConfigOptions::default()
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).ok()?;
            kube::Config::from_custom_kubeconfig(kc, &opts).await.ok()?
        }
        None => match kube::Config::from_kubeconfig(&opts).await {
            Ok(c) => c,
            Err(_) => kube::Config::incluster().ok()?,
        },
    };
    Some(
        config
            .cluster_url
            .to_string()
            .trim_end_matches('/')
            .to_string(),
    )
}

async fn from_api(args: &Args, config: &Config) -> anyhow::Result<Report> {
    let kubeconfig = explicit_kubeconfig(config);
    let client = crate::k8s::client(&crate::k8s::ClientOptions {
        kubeconfig,
        context: args.context.as_deref(),
        timeout: Some(REQUEST_TIMEOUT),
        ..Default::default()
    })
    .await?;
    let listed = list_cluster(client.clone(), args.node.as_deref()).await;
    match listed {
        Ok((nodes, pods)) => {
            let dra = list_dra(client).await?.with_driver(&config.dra.driver_name);
            Ok(Report::from_cluster_with_dra(
                &nodes,
                &pods,
                &dra,
                args.node.as_deref(),
            ))
        }
        Err(e) => {
            let api_answered = e.chain().any(|c| {
                c.downcast_ref::<ApiCall>()
                    .is_some_and(|call| matches!(call.error, kube::Error::Api(_)))
                    || c.downcast_ref::<NodeNotFound>().is_some()
            });
            if api_answered {
                return Err(e);
            }
            let url = api_server_url(kubeconfig, args.context.as_deref())
                .await
                .unwrap_or_else(|| "(unknown)".to_string());
            Err(e.context(format!("cannot reach the API server at {url}")))
        }
    }
}

/// The node named on the command line is not in the API (the API answered: no such node).
#[derive(Debug, thiserror::Error)]
#[error("node {0:?} not found (kubectl get nodes lists them)")]
struct NodeNotFound(String);

/// A failed read of the API, said in words ([`crate::k8s::describe`]).
#[derive(Debug, thiserror::Error)]
#[error("{what}: {}", describe(error))]
struct ApiCall {
    what: &'static str,
    error: kube::Error,
}

impl ApiCall {
    fn new(what: &'static str, error: kube::Error) -> ApiCall {
        ApiCall { what, error }
    }
}

async fn list_cluster(
    client: kube::Client,
    only: Option<&str>,
) -> anyhow::Result<(Vec<Node>, Vec<Pod>)> {
    let nodes_api: Api<Node> = Api::all(client.clone());
    let pods_api: Api<Pod> = Api::all(client);
    let nodes = match only {
        Some(name) => match nodes_api
            .get_opt(name)
            .await
            .map_err(|error| ApiCall::new("reading the node", error))?
        {
            Some(node) => vec![node],
            None => return Err(NodeNotFound(name.to_string()).into()),
        },
        None => {
            nodes_api
                .list(&ListParams::default())
                .await
                .map_err(|error| ApiCall::new("listing nodes", error))?
                .items
        }
    };
    let mut params = ListParams::default();
    if let Some(name) = only {
        params = params.fields(&format!("spec.nodeName={name}"));
    }
    // Nodes and phases are filtered again in the report, whatever the server did.
    let pods = pods_api
        .list(&params)
        .await
        .map_err(|error| ApiCall::new("listing pods", error))?
        .items;
    Ok((nodes, pods))
}

/// The DRA path's slices and claims; none from an API server without `resource.k8s.io/v1`
/// (404).
async fn list_dra(client: kube::Client) -> anyhow::Result<dra::DraCluster> {
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    let not_served = |e: &kube::Error| matches!(e, kube::Error::Api(s) if s.code == 404);
    let slices_api: Api<ResourceSlice> = Api::all(client.clone());
    let slices = match slices_api.list(&ListParams::default()).await {
        Ok(l) => l.items,
        Err(e) if not_served(&e) => return Ok(dra::DraCluster::default()),
        Err(error) => return Err(ApiCall::new("listing ResourceSlices", error).into()),
    };
    let claims_api: Api<ResourceClaim> = Api::all(client);
    let claims = match claims_api.list(&ListParams::default()).await {
        Ok(l) => l.items,
        Err(e) if not_served(&e) => Vec::new(),
        Err(error) => return Err(ApiCall::new("listing ResourceClaims", error).into()),
    };
    Ok(dra::DraCluster {
        slices,
        claims,
        ..dra::DraCluster::default()
    })
}

/// The URL of the extender's inspect endpoint for `base` (and `node`).
///
/// `base` may be the extender's root (`http://host:12345`), its URL prefix
/// (`…/gpushare-scheduler`) or the inspect endpoint itself (`…/inspect`).
pub(crate) fn extender_inspect_url(base: &str, node: Option<&str>) -> anyhow::Result<http::Uri> {
    let base = base.trim().trim_end_matches('/');
    if !base.starts_with("http://") && !base.starts_with("https://") {
        return Err(anyhow!(
            "--from-extender {base}: expected an http:// or https:// URL"
        ));
    }
    let mut url = if base.ends_with("/inspect") {
        base.to_string()
    } else if base.ends_with(EXTENDER_URL_PREFIX) {
        format!("{base}/inspect")
    } else {
        format!("{base}{EXTENDER_URL_PREFIX}/inspect")
    };
    if let Some(node) = node {
        if node.is_empty()
            || !node
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        {
            return Err(anyhow!("{node:?} is not a node name"));
        }
        url.push('/');
        url.push_str(node);
    }
    url.parse()
        .with_context(|| format!("--from-extender {base}: not a valid URL"))
}

/// Fetches and decodes the extender's inspect answer (plain HTTP).
pub async fn from_extender(base: &str, node: Option<&str>) -> anyhow::Result<Report> {
    from_extender_with(base, node, &ExtenderTls::default()).await
}

/// Fetches and decodes the extender's inspect answer, over HTTPS per `tls` for an https:// URL.
pub async fn from_extender_with(
    base: &str,
    node: Option<&str>,
    tls: &ExtenderTls,
) -> anyhow::Result<Report> {
    let url = extender_inspect_url(base, node).map_err(failure::usage)?;
    let client = if url.scheme_str() == Some("https") {
        tls.client()?
    } else {
        outbound::Client::plain()
    };
    let url = url.to_string();
    let answer = client
        .get(&url, REQUEST_TIMEOUT)
        .await
        .with_context(|| format!("cannot reach the extender at {url}"))?;
    if !answer.status.is_success() {
        return Err(anyhow!(
            "the extender at {url} answered {}: {}",
            answer.status,
            answer.body_excerpt(300)
        ));
    }
    let answer: ExtenderInspect = serde_json::from_slice(&answer.body).with_context(|| {
        format!("the extender at {url} answered something that is not inspect JSON")
    })?;
    if let Some(error) = answer.error.as_deref().filter(|e| !e.is_empty()) {
        return Err(anyhow!("the extender at {url} reports: {error}"));
    }
    Ok(Report::from_extender(&answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extender_urls() {
        let u = |b: &str, n: Option<&str>| extender_inspect_url(b, n).map(|u| u.to_string());
        assert_eq!(
            u("http://h:12345", None).unwrap(),
            "http://h:12345/gpushare-scheduler/inspect"
        );
        assert_eq!(
            u("http://h:12345/", Some("n1")).unwrap(),
            "http://h:12345/gpushare-scheduler/inspect/n1"
        );
        assert_eq!(
            u("http://h/gpushare-scheduler", None).unwrap(),
            "http://h/gpushare-scheduler/inspect"
        );
        assert_eq!(
            u("http://h/x/inspect", Some("n")).unwrap(),
            "http://h/x/inspect/n"
        );
        assert_eq!(
            u("https://h:1", None).unwrap(),
            "https://h:1/gpushare-scheduler/inspect"
        );
        assert!(u("h:1", None).is_err());
        assert!(u("http://h", Some("a/b")).is_err());
    }
}
