//! `gpushare doctor`: finds the set-up mistakes behind most GPU-sharing trouble (wrong default
//! container runtime, NVML out of reach, node not labelled, scheduler configuration not
//! applied, extender unreachable, a memory unit too fine for ListAndWatch) and says how to fix
//! each one. With a CDI `--device-list-strategy` it checks the CDI specs and the runtime's CDI
//! settings instead of asking for nvidia as the default runtime ([`cdi`]).
//!
//! Each check has a stable id, a status (ok / warn / fail / skip), what it saw and a fix
//! ([`report`]). Node checks read host files under `--root` ([`host`], [`runtime`]) and ask
//! the GPU backend ([`gpus`]); control-plane checks ask the API server ([`cluster`]), read
//! the kube-scheduler configuration ([`scheduler`]) and, on managed clusters, check the
//! dedicated scheduler and the webhook ([`managed`]), and name what an Aliyun installation
//! left in the chart's way ([`migration`]); with `--mps`, the MPS set-up ([`mps`]); with
//! `--rdma`, the RDMA stack ([`rdma`]); with `--dra`, what the DRA path needs on the node and in
//! the API server ([`dra`]); on a node, which mechanism enforces each GPU's memory shares and
//! what the driver's per-cgroup limits need ([`enforcement`]).
//! `extender` and `device-plugin` run [`preflight`] before they start, `dra-plugin`
//! [`preflight_dra`] (the `--dra` node checks instead of the device plugin's). Doctor only reads: it
//! changes nothing on the host or in the cluster, and every probe has a short deadline (the
//! MPS probe runs the control program as a client; it never starts or stops the daemon).

pub mod cdi;
pub mod cluster;
pub mod dra;
pub mod enforcement;
pub mod gpus;
pub mod host;
pub mod managed;
pub mod migration;
pub mod mps;
pub mod rdma;
pub mod report;
pub mod runtime;
pub mod scheduler;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::{Config, FlagOverrides, GpuBackendKind};
use crate::core::MemoryUnit;
use cluster::{ApiState, DEVICE_PLUGIN_PERMISSIONS, DRA_PLUGIN_PERMISSIONS, EXTENDER_PERMISSIONS};
use host::HostRoot;
use report::{Check, Report, Status};

/// Output format of `gpushare doctor`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// A checklist for people.
    #[default]
    Text,
    /// `{"role", "checks": [{"id", "title", "status", "detail", "hint"}], "summary"}`.
    Json,
}

/// Flags of `gpushare doctor`.
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
pub struct Args {
    /// Which checks to run
    #[arg(long, value_enum, default_value_t = Role::All)]
    #[serde(skip)]
    pub role: Role,
    /// Output format
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    #[serde(skip)]
    pub output: OutputFormat,
    /// Read every host file under DIR (e.g. /host in a pod that mounts the host's root)
    #[arg(long, value_name = "DIR", default_value = "/")]
    #[serde(skip)]
    pub root: PathBuf,
    /// Exit 1 on warnings too
    #[arg(long)]
    #[serde(skip)]
    pub strict: bool,
    /// kube-scheduler configuration file [default: found through
    /// /etc/kubernetes/manifests/kube-scheduler.yaml]
    #[arg(long, value_name = "PATH")]
    #[serde(skip)]
    pub scheduler_config: Option<PathBuf>,
    /// Extender URL to probe [default: the urlPrefix of the scheduler configuration]
    #[arg(long, value_name = "URL")]
    #[serde(skip)]
    pub extender_url: Option<String>,
    /// gpushare webhook URL to probe (managed clusters), e.g. https://127.0.0.1:9443 through
    /// `kubectl port-forward` [default: https://<webhook.service_name>.<webhook.namespace>.svc]
    #[arg(long, value_name = "URL")]
    #[serde(skip)]
    pub webhook_url: Option<String>,
    /// Do not contact the API server (its checks are skipped)
    #[arg(long)]
    #[serde(skip)]
    pub no_cluster: bool,
    /// This node's name [env: NODE_NAME; default: the host's /etc/hostname]
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Check the CUDA MPS set-up: the control program, its directories and user, and that
    /// the daemon answers (node.mps)
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub mps: bool,
    /// The MPS control program (node.mps_control)
    #[arg(long, value_name = "PATH")]
    pub mps_control: Option<String>,
    /// MPS pipe directory (node.mps_pipe_dir)
    #[arg(long, value_name = "DIR")]
    pub mps_pipe_dir: Option<PathBuf>,
    /// MPS log directory (node.mps_log_dir)
    #[arg(long, value_name = "DIR")]
    pub mps_log_dir: Option<PathBuf>,
    /// kubelet's device-plugin directory (device_plugin.device_plugin_dir)
    #[arg(long, value_name = "DIR")]
    #[serde(rename = "device_plugin.device_plugin_dir")]
    pub device_plugin_dir: Option<PathBuf>,
    /// Size of one unit of aliyun.com/gpu-mem: GiB, MiB or e.g. 256MiB (node.memory_unit)
    #[arg(long, value_name = "UNIT")]
    pub memory_unit: Option<MemoryUnit>,
    /// How the plugin hands GPUs over (node.device_list_strategy); a CDI strategy
    /// adds the cdi-specs and cdi-runtime checks
    #[arg(long, value_enum, value_delimiter = ',', value_name = "STRATEGY")]
    pub device_list_strategy: Vec<crate::config::DeviceListStrategy>,
    /// index | uuid: the GPU names the CDI specs must have (node.device_id_strategy)
    #[arg(long, value_enum)]
    pub device_id_strategy: Option<crate::config::VisibleDevices>,
    /// CDI kind of the GPUs (node.cdi_kind)
    #[arg(long, value_name = "VENDOR/CLASS")]
    pub cdi_kind: Option<String>,
    /// CDI spec directories, comma-separated (node.cdi_spec_dirs)
    #[arg(long, value_delimiter = ',', value_name = "DIR")]
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// auto | driver | mps | none: the enforcement to check for (node.enforcement)
    #[arg(long, value_enum)]
    pub enforcement: Option<crate::config::enforcement::Enforcement>,
    /// The same GPU access as the device plugin.
    #[command(flatten)]
    #[serde(skip)]
    pub gpu: crate::gpu::GpuArgs,
    /// The RDMA checks ([`rdma`]).
    #[command(flatten)]
    #[serde(skip)]
    pub rdma: rdma::RdmaArgs,
    /// The DRA checks ([`dra`]).
    #[command(flatten)]
    #[serde(skip)]
    pub dra: dra::DraArgs,
}

impl Args {
    /// The flags as configuration overrides.
    pub(crate) fn overrides(&self, flags: &mut FlagOverrides) {
        flags.args("node", self);
        self.gpu.overrides(flags);
    }
}

/// Which checks to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// GPU node checks (driver, runtime, kubelet, device plugin).
    Node,
    /// Control-plane checks (API, RBAC, scheduler configuration, extender).
    ControlPlane,
    /// Both.
    #[default]
    All,
}

impl Role {
    /// `node`, `control-plane` or `all`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::ControlPlane => "control-plane",
            Role::All => "all",
        }
    }

    fn node(self) -> bool {
        matches!(self, Role::Node | Role::All)
    }

    fn control_plane(self) -> bool {
        matches!(self, Role::ControlPlane | Role::All)
    }
}

/// What one doctor run looks at, beyond the configuration.
#[derive(Clone, Debug)]
pub struct Options {
    /// Which checks.
    pub role: Role,
    /// Host files are read under this directory.
    pub root: PathBuf,
    /// Running before a role starts: only the checks that matter to it, as that process
    /// sees the host.
    pub preflight: bool,
    /// Skip the API server.
    pub no_cluster: bool,
    /// `--scheduler-config`.
    pub scheduler_config: Option<PathBuf>,
    /// `--extender-url`.
    pub extender_url: Option<String>,
    /// `--webhook-url`.
    pub webhook_url: Option<String>,
    /// `--dra` and its flags: the DRA checks run when set.
    pub dra: Option<dra::DraArgs>,
}

impl Options {
    /// The preflight of `dra-plugin`: the DRA node's checks with the plugin's directories
    /// and driver (`[dra]`), not the device plugin's.
    pub fn preflight_dra(dra: &crate::config::DraConfig) -> Options {
        Options {
            dra: Some(dra::DraArgs::of_plugin(dra)),
            ..Options::preflight(Role::Node)
        }
    }

    /// The preflight of `role`.
    pub fn preflight(role: Role) -> Options {
        Options {
            role,
            root: PathBuf::from("/"),
            preflight: true,
            no_cluster: false,
            scheduler_config: None,
            extender_url: None,
            webhook_url: None,
            dra: None,
        }
    }
}

/// Runs the checks `opts` selects and returns the report (never fails, never hangs).
pub async fn diagnose(opts: &Options, config: &Config) -> Report {
    let role = opts.role;
    let host = HostRoot::new(&opts.root);
    let dp = &config.device_plugin;
    let node_cfg = &config.node;
    let probe_gpus = async {
        if role.node() {
            Some(gpus::probe(&config.gpu).await)
        } else {
            None
        }
    };
    let (probe, api) = tokio::join!(probe_gpus, cluster::connect(config, opts.no_cluster));
    let mut checks: Vec<Check> = Vec::new();
    // With --dra the node is a DRA node: its checks replace the device plugin's (its kubelet
    // socket, the ListAndWatch limit, the gpushare=true label, its RBAC).
    let dra_node = opts.dra.is_some();
    if let Some(probe) = &probe {
        checks.extend(gpu_node_checks(&host, opts, config, probe, dra_node).await);
    }
    checks.push(cluster::api_server(&api, config, opts.preflight));
    if role.node() {
        let name = cluster::node_name(config, &host);
        // Who holds this node's GPU locks now (the node roles' one path per GPU).
        let locks = name
            .as_ref()
            .map(|(n, _)| {
                crate::node::gpu_locks::GpuLocks::new(&host.path(node_cfg.gpu_lock_dir()), n)
                    .holders()
            })
            .unwrap_or_default();
        let node = match (&api, &name) {
            (ApiState::Up { .. }, Some((n, _))) => cluster::get_node(&api, n).await,
            _ => Err(cluster::ApiError::NotAsked),
        };
        if !dra_node {
            if !opts.preflight {
                checks.push(cluster::node_label(&api, name.as_ref(), &node));
            }
            checks.push(plugin_conflict(&host, dp, opts.preflight, &node, &locks));
        }
        if let Some(d) = &opts.dra {
            checks.extend(dra::node_checks(
                &host,
                d,
                &dp.device_plugin_dir,
                &node,
                &locks,
            ));
        }
    }
    let mut sets: Vec<(&str, &[cluster::Permission])> = Vec::new();
    if role.control_plane() {
        sets.push(("extender", EXTENDER_PERMISSIONS));
    }
    if role.node() && dra_node {
        sets.push(("DRA plugin", DRA_PLUGIN_PERMISSIONS));
    } else if role.node() {
        sets.push(("device plugin", DEVICE_PLUGIN_PERMISSIONS));
    }
    checks.push(cluster::rbac(&api, &sets, config).await);
    if role.control_plane() {
        checks.push(host::open_files(config.http.max_connections));
    }
    if role.control_plane() && !opts.preflight {
        let minor = match &api {
            ApiState::Up { minor, .. } => *minor,
            _ => None,
        };
        let (check, url) =
            scheduler::scheduler_config(&host, opts.scheduler_config.as_deref(), minor);
        checks.push(check);
        let (target, from_flag) = match &opts.extender_url {
            Some(u) => (Some(u.clone()), true),
            None => (url, false),
        };
        checks.push(scheduler::extender_reachable(target.as_deref(), from_flag).await);
        checks.extend(managed::checks(&api, &config.webhook, opts.webhook_url.as_deref()).await);
        checks.push(migration::aliyun_leftovers(&api).await);
    }
    if role.control_plane()
        && let Some(d) = &opts.dra
    {
        checks.extend(dra::control_plane_checks(&api, d).await);
    }
    if let Some(check) = deprecated_keys(&config.deprecated) {
        checks.insert(0, check);
    }
    Report::new(role.name(), checks)
}

/// The checks of a node with GPUs (`probe`): driver, libraries, runtime, CDI, the device
/// plugin's or (`dra_node`) the DRA plugin's side, MPS, enforcement.
async fn gpu_node_checks(
    host: &HostRoot,
    opts: &Options,
    config: &Config,
    probe: &gpus::Probe,
    dra_node: bool,
) -> Vec<Check> {
    let dp = &config.device_plugin;
    let node_cfg = &config.node;
    let mut checks = Vec::new();
    let fake = config.gpu.backend == GpuBackendKind::Fake;
    checks.push(gpus::driver_version(host, probe));
    checks.push(gpus::gpu_access(probe, &config.gpu));
    let strategies = &node_cfg.device_list_strategy;
    if !opts.preflight {
        checks.push(host::nvml_library(host, &config.gpu.nvml_library, fake));
        // Only CDI, or the DRA path (CDI too): the NVIDIA runtime need not be the default.
        if !strategies.only_cdi() && opts.dra.is_none() {
            checks.push(runtime::check(host));
        }
        checks.push(host::nvidia_toolkit(host));
        let envvar = strategies
            .as_slice()
            .contains(&crate::config::DeviceListStrategy::Envvar);
        checks.push(host::nvidia_envvar(host, envvar));
    }
    if strategies.any_cdi() && !dra_node {
        checks.push(cdi::specs(host, node_cfg, probe.devices(), opts.preflight));
        if !opts.preflight {
            checks.push(cdi::runtime(host, node_cfg));
        }
    }
    if dra_node {
        checks.push(dra::memory_unit(node_cfg.memory_unit, probe.devices()));
    } else {
        checks.push(host::device_plugin_dir(host, &dp.device_plugin_dir));
        checks.push(host::kubelet_socket(
            host,
            &dp.device_plugin_dir,
            !opts.preflight,
        ));
        checks.push(gpus::memory_unit(node_cfg.memory_unit, probe.devices()));
    }
    checks.extend(mps::checks(host, node_cfg, opts.preflight).await);
    checks.push(enforcement::check(host, config, probe, opts.dra.is_some()).await);
    checks
}

/// `config-deprecated-keys`, only when the configuration uses an old key name: each one with
/// its new name (the old names still work).
fn deprecated_keys(keys: &[crate::config::DeprecatedKey]) -> Option<Check> {
    if keys.is_empty() {
        return None;
    }
    let lines: Vec<String> = keys.iter().map(ToString::to_string).collect();
    Some(
        Check::new(
            "config-deprecated-keys",
            "configuration keys under their current names",
            Status::Warn,
            lines.join("\n"),
        )
        .hint(
            "the node settings moved from [device_plugin] to [node]: rename each key as shown \
             (the old names are still read, but a later release may drop them)",
        ),
    )
}

/// `plugin-conflict`: another plugin serves `aliyun.com/gpu-mem`, or NVIDIA's plugin serves
/// the same GPUs (both would hand out the same memory).
fn plugin_conflict(
    host: &HostRoot,
    dp: &crate::config::DevicePluginConfig,
    preflight: bool,
    node: &Result<Option<k8s_openapi::api::core::v1::Node>, cluster::ApiError>,
    locks: &[(String, crate::node::gpu_locks::Holder)],
) -> Check {
    const ID: &str = "plugin-conflict";
    const TITLE: &str = "no other device plugin on these GPUs";
    let (mut conflicts, notes) = host::plugin_conflicts(host, &dp.device_plugin_dir, preflight);
    for (uuid, holder) in locks {
        if holder.path == "dra" {
            conflicts.push(format!(
                "GPU {uuid} is served by {holder} (its lock is held; the device plugin offers \
                 it only once the DRA plugin stops, its slice is removed and its claims are gone)"
            ));
        }
    }
    if let Ok(Some(n)) = node
        && let Some(count) = cluster::capacity(n, "nvidia.com/gpu").filter(|c| c != "0")
    {
        conflicts.push(format!(
            "the node advertises nvidia.com/gpu: {count}: NVIDIA's device plugin hands out whole GPUs gpushare shares"
        ));
    }
    let mut lines = conflicts.clone();
    lines.extend(notes);
    if conflicts.is_empty() {
        if lines.is_empty() {
            lines.push("no NVIDIA device plugin or second gpu-mem plugin seen".to_string());
        }
        return Check::new(ID, TITLE, Status::Ok, lines.join("\n"));
    }
    Check::new(ID, TITLE, Status::Warn, lines.join("\n")).hint(
        "run one device plugin per GPU: keep NVIDIA's device plugin off gpushare nodes (e.g. node affinity\n\
         gpushare NotIn [true] on its DaemonSet) and remove Aliyun's gpushare-device-plugin before starting this one",
    )
}

/// The preflight `extender` (ControlPlane) and `device-plugin` (Node) run before they start:
/// prints the report on stderr and fails when a check failed. Callers skip it when
/// `config.doctor.skip`.
///
/// A set-up mistake (driver, runtime, socket, RBAC, a refused identity) refuses at once. When
/// the only failure is an API server that does not answer, that is not a set-up mistake: the
/// preflight waits for it ([`crate::k8s::reachable`], `cluster.api_wait_secs`), then checks
/// again, so a short control-plane outage never turns into CrashLoopBackOff.
pub async fn preflight(role: Role, config: &Config) -> anyhow::Result<()> {
    preflight_with(Options::preflight(role), config).await
}

/// The preflight `dra-plugin` runs before it starts ([`Options::preflight_dra`]), as
/// [`preflight`] runs it.
pub async fn preflight_dra(config: &Config) -> anyhow::Result<()> {
    preflight_with(Options::preflight_dra(&config.dra), config).await
}

async fn preflight_with(opts: Options, config: &Config) -> anyhow::Result<()> {
    let mut report = diagnose(&opts, config).await;
    let mut waited = None;
    if report.ids_with(Status::Fail) == [cluster::API_SERVER] {
        match wait_for_api(config).await {
            Ok(()) => report = diagnose(&opts, config).await,
            Err(e) => waited = Some(e),
        }
    }
    eprint!(
        "{}",
        report.to_text(crate::telemetry::colour(std::io::stderr().is_terminal()))
    );
    if report.failed(false) {
        let failed = report.ids_with(Status::Fail).join(", ");
        match waited {
            Some(e) => anyhow::bail!(
                "preflight failed: {failed}: {e:#} (fix them, or start with --skip-doctor)"
            ),
            None => {
                anyhow::bail!("preflight failed: {failed} (fix them, or start with --skip-doctor)")
            }
        }
    }
    Ok(())
}

/// Waits for the API server the preflight could not reach.
async fn wait_for_api(config: &Config) -> anyhow::Result<()> {
    let wait = std::time::Duration::from_secs(config.cluster.api_wait_secs);
    crate::k8s::reachable::wait_for_api(&config.cluster.kubeconfig, wait, "preflight").await?;
    Ok(())
}

/// Runs doctor: prints the report, exits 1 when a check failed (`--strict`: or warned).
pub async fn run(args: Args, config: Config) -> anyhow::Result<ExitCode> {
    let opts = Options {
        role: args.role,
        root: args.root.clone(),
        preflight: false,
        no_cluster: args.no_cluster,
        scheduler_config: args.scheduler_config.clone(),
        extender_url: args.extender_url.clone(),
        webhook_url: args.webhook_url.clone(),
        dra: args.dra.dra.then(|| args.dra.clone()),
    };
    let mut report = diagnose(&opts, &config).await;
    if args.rdma.rdma {
        let mut checks = report.checks;
        let modules = HostRoot::new(&args.root).path("/proc/modules");
        checks.extend(rdma::checks(&args.rdma.roots(&args.root), &modules));
        report = Report::new(args.role.name(), checks);
    }
    let text = match args.output {
        OutputFormat::Text => {
            report.to_text(crate::telemetry::colour(std::io::stdout().is_terminal()))
        }
        OutputFormat::Json => report.to_json(),
    };
    print!("{text}");
    Ok(if report.failed(args.strict) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
