//! The command line: the `Command` enum and the only dispatch to the roles.
//!
//! Global flags (`--config`, `--log-level`, `--log-format`, `--kubeconfig`) work before or
//! after the subcommand. When the executable is named `kubectl-inspect-gpushare` (a symlink on
//! PATH) it behaves as `gpushare inspect`, so `kubectl inspect gpushare` works.

use std::ffi::OsString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::buildinfo::{
    KREW_PLUGIN_NAME, KUBECTL_PLUGIN_COMMAND, KUBECTL_PLUGIN_NAME, version_text,
};
use crate::config::{self, Config, FlagOverrides, LogFormat, LogLevel, Section};
#[cfg(feature = "demo")]
use crate::demo;
#[cfg(unix)]
use crate::dra;
use crate::node::{NodeAgent, NodeWrites, PreparedAgent};
use crate::shutdown::Shutdown;
use crate::{cdi_hook, deviceplugin, doctor, extender, failure, inspect, webhook};

/// The heading `--help` shows the global flags under, apart from each role's own.
pub(crate) const GLOBAL_HEADING: &str = "Global options (every command)";

/// Flags every subcommand takes.
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
pub(crate) struct GlobalArgs {
    /// Configuration file [default: /etc/gpushare/gpushare.toml when it exists]
    #[arg(long, global = true, value_name = "PATH", help_heading = GLOBAL_HEADING)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Log level: trace, debug, info, warn, error [env: LOG_LEVEL; config: log.level; RUST_LOG
    /// wins when set]
    #[arg(long, global = true, value_enum, help_heading = GLOBAL_HEADING)]
    #[serde(rename = "level")]
    pub log_level: Option<LogLevel>,
    /// Log format; text is coloured only when stderr is a terminal and NO_COLOR is unset [config:
    /// log.format]
    #[arg(long, global = true, value_enum, help_heading = GLOBAL_HEADING)]
    #[serde(rename = "format")]
    pub log_format: Option<LogFormat>,
    /// Kubeconfig file. Without it: `[cluster] kubeconfig` of the configuration file or
    /// GPUSHARE_CLUSTER__KUBECONFIG, else $KUBECONFIG (several paths, merged), else
    /// ~/.kube/config, else the in-cluster service account
    /// (/var/run/secrets/kubernetes.io/serviceaccount)
    #[arg(long, global = true, value_name = "PATH", help_heading = GLOBAL_HEADING)]
    #[serde(rename = "cluster.kubeconfig")]
    pub kubeconfig: Option<PathBuf>,
}

impl GlobalArgs {
    fn overrides(&self, flags: &mut FlagOverrides) {
        flags.args("log", self);
    }
}

/// GPU memory sharing: extender, device plugin, DRA plugin, webhook, inspect, doctor, CDI hook.
///
/// A drop-in successor of Aliyun's gpushare: pods ask for `aliyun.com/gpu-mem` (GiB by
/// default), the extender picks one GPU with room, the device plugin hands it to the
/// container; on the DRA path (Kubernetes 1.34+) the webhook turns the request into a
/// ResourceClaim and the DRA plugin hands the GPU over through CDI. Run `gpushare <command>
/// --help` for each role.
#[derive(Debug, Parser)]
#[command(
    name = "gpushare",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub(crate) struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// The roles.
// Parsed once per process: the variants' sizes do not matter (and without the unix-only DRA
// plugin the device plugin's flags stand out).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP scheduler extender (filter / prioritize / bind) beside kube-scheduler.
    Extender(extender::Args),
    /// Run the kubelet device plugin on a GPU node.
    DevicePlugin(deviceplugin::Args),
    /// Run the DRA kubelet plugin on a GPU node (resource.k8s.io/v1 ResourceSlices, CDI).
    #[cfg(unix)]
    DraPlugin(dra::role::Args),
    /// Show GPU memory allocation per node and GPU (also `kubectl inspect gpushare`).
    Inspect(inspect::Args),
    /// Check a node or control plane for everything gpushare needs.
    Doctor(doctor::Args),
    /// Run the admission webhook of managed clusters: routes gpu-mem pods to
    /// gpushare-scheduler and refuses malformed gpu-mem requests (HTTPS).
    Webhook(webhook::Args),
    /// A CDI hook the container runtime runs (driver enforcement: `memory-limit` sets a
    /// container's GPU memory limit on its own cgroup).
    CdiHook(cdi_hook::Args),
    /// Run a self-contained demo: sandbox cluster, extender and device plugin with fake GPUs.
    #[cfg(feature = "demo")]
    Demo(demo::Args),
    /// Print version, git commit, target and linkage.
    Version,
}

/// Show GPU memory allocation per node and GPU: what each pod holds, what is free, and
/// which GPUs are unhealthy (`gpushare inspect` as a kubectl plugin).
///
/// Reads Nodes and Pods from the cluster kubectl points at (--kubeconfig / KUBECONFIG), or the
/// extender's view with --from-extender. Flags go after `kubectl inspect gpushare`: kubectl
/// refuses flags placed before a plugin's name.
#[derive(Debug, Parser)]
#[command(
    name = KUBECTL_PLUGIN_NAME,
    bin_name = KUBECTL_PLUGIN_COMMAND,
    override_usage = "kubectl inspect gpushare [flags] [NODE]",
    version,
    max_term_width = 100
)]
struct InspectCli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(flatten)]
    inspect: inspect::Args,
}

/// Go-style single-dash long flags that upstream manifests pass (`-logtostderr --v=5`);
/// rewritten to their double-dash form before parsing so those manifests keep working.
const GO_STYLE_FLAGS: &[&str] = &[
    "logtostderr",
    "alsologtostderr",
    "v",
    "query-kubelet",
    "kubelet-address",
    "kubelet-port",
    "client-cert",
    "client-key",
    "token",
    "timeout",
    "memory-unit",
    "health-check",
    "mps",
];

fn normalize_go_flags(args: Vec<OsString>) -> Vec<OsString> {
    args.into_iter()
        .enumerate()
        .map(|(i, arg)| {
            let Some(text) = arg.to_str().filter(|_| i > 0) else {
                return arg;
            };
            match text.strip_prefix('-') {
                Some(rest) if !rest.starts_with('-') => {
                    let name = rest.split_once('=').map_or(rest, |(n, _)| n);
                    if GO_STYLE_FLAGS.contains(&name) {
                        OsString::from(format!("-{text}"))
                    } else {
                        arg
                    }
                }
                _ => arg,
            }
        })
        .collect()
}

/// Parses `args` (argv[0] included) and runs the chosen role. Never panics on bad input.
pub fn main_with_args(args: Vec<OsString>) -> ExitCode {
    let args = normalize_go_flags(args);
    let invoked_as = args
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // krew links plugins whose names hold a dash as `kubectl-inspect_gpushare`.
    let as_plugin =
        invoked_as.starts_with(KUBECTL_PLUGIN_NAME) || invoked_as.starts_with(KREW_PLUGIN_NAME);
    let (global, command) = if as_plugin {
        match InspectCli::try_parse_from(&args) {
            Ok(cli) => (cli.global, Command::Inspect(cli.inspect)),
            Err(e) => return clap_exit(e),
        }
    } else {
        match Cli::try_parse_from(&args) {
            Ok(cli) => (cli.global, cli.command),
            Err(e) => return clap_exit(e),
        }
    };
    if let Command::Version = command {
        print!("{}", version_text());
        return ExitCode::SUCCESS;
    }
    let mut flags = FlagOverrides::new();
    global.overrides(&mut flags);
    match &command {
        Command::Extender(a) => a.overrides(&mut flags),
        Command::DevicePlugin(a) => a.overrides(&mut flags),
        #[cfg(unix)]
        Command::DraPlugin(a) => a.overrides(&mut flags),
        Command::Inspect(a) => a.overrides(&mut flags),
        Command::Doctor(a) => a.overrides(&mut flags),
        Command::Webhook(a) => a.overrides(&mut flags),
        #[cfg(feature = "demo")]
        Command::Demo(_) => {}
        Command::Version | Command::CdiHook(_) => {}
    }
    // The hook reads no configuration file: a host's gpushare.toml cannot stop a container.
    let loaded = if matches!(command, Command::CdiHook(_)) {
        Ok(Config::default())
    } else {
        config::load_for(global.config.as_deref(), flags, sections(&command))
    };
    let config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpushare: {e}");
            return ExitCode::from(failure::CONFIG);
        }
    };
    #[cfg(feature = "demo")]
    let config = quiet_demo(&command, &global, config);
    crate::telemetry::init(&config.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpushare: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(dispatch(command, config));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpushare: {}", failure::one_line(e.as_ref()));
            ExitCode::from(failure::status(&e))
        }
    }
}

/// The configuration sections `command` runs, the ones its configuration is checked for: a
/// section a role never reads cannot stop it (doctor and the demo check every one). The
/// extender reads no `devices` (other device kinds are the node roles' and the webhook's);
/// the device plugin reads `dra` for the path gate (which driver may hold its GPUs); the
/// webhook reads `node` and `dra` for the request rewrite (unit, driver name).
fn sections(command: &Command) -> &'static [Section] {
    use Section::*;
    match command {
        Command::Extender(_) => &[Extender, Http],
        Command::DevicePlugin(_) => &[Http, Devices, Node, DevicePlugin, Dra],
        #[cfg(unix)]
        Command::DraPlugin(_) => &[Http, Devices, Node, Dra],
        Command::Webhook(_) => &[Http, Devices, Webhook, Node, Dra],
        Command::Inspect(_) => &[Dra],
        Command::Doctor(_) => Section::ALL,
        #[cfg(feature = "demo")]
        Command::Demo(_) => Section::ALL,
        Command::Version | Command::CdiHook(_) => &[],
    }
}

/// The demo prints its own walkthrough: keep logs to warnings unless a level was asked for.
#[cfg(feature = "demo")]
fn quiet_demo(command: &Command, global: &GlobalArgs, mut config: Config) -> Config {
    let level_asked = global.log_level.is_some()
        || ["LOG_LEVEL", "GPUSHARE_LOG__LEVEL", "RUST_LOG"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
    if matches!(command, Command::Demo(_)) && !level_asked {
        config.log.level = LogLevel::Warn;
    }
    config
}

/// Runs the role. The server roles get their doctor preflight here, before they start, so
/// that no role needs to import another.
async fn dispatch(command: Command, config: Config) -> anyhow::Result<ExitCode> {
    match command {
        Command::Extender(args) => {
            crate::buildinfo::ensure_server_platform("extender")?;
            preflight(doctor::Role::ControlPlane, &config).await?;
            extender::run(args, config).await
        }
        Command::DevicePlugin(args) => {
            run_node_role(
                NodeRole::DevicePlugin,
                &config,
                // The first list of the node's pods runs beside the preflight: the plugin
                // registers as soon as both are done.
                || deviceplugin::EarlyPods::start(&config),
                |prepared| deviceplugin::admit(&config, prepared),
                |early, agent, shutdown| {
                    deviceplugin::run(args, &config, agent, shutdown, Some(early))
                },
            )
            .await
        }
        #[cfg(unix)]
        Command::DraPlugin(args) => {
            run_node_role(
                NodeRole::DraPlugin,
                &config,
                || async { Ok(()) },
                |prepared| dra::role::admit(&config, prepared),
                |(), agent, shutdown| dra::role::run(args, &config, agent, shutdown),
            )
            .await
        }
        Command::Inspect(args) => inspect::run(args, config).await,
        Command::Doctor(args) => doctor::run(args, config).await,
        Command::Webhook(args) => webhook::run(args, config).await,
        Command::CdiHook(args) => cdi_hook::run(args).await,
        #[cfg(feature = "demo")]
        Command::Demo(args) => demo::run(args, config).await,
        Command::Version => Ok(ExitCode::SUCCESS),
    }
}

/// The node roles, and what differs in their start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeRole {
    /// `device-plugin`: the device plugin's preflight; the agent publishes on the Node.
    DevicePlugin,
    /// `dra-plugin`: the DRA node's preflight (`doctor --dra`); the agent only reads the Node.
    #[cfg_attr(not(unix), allow(dead_code))]
    DraPlugin,
}

impl NodeRole {
    fn name(self) -> &'static str {
        match self {
            NodeRole::DevicePlugin => "device-plugin",
            NodeRole::DraPlugin => "dra-plugin",
        }
    }

    fn writes(self) -> NodeWrites {
        match self {
            NodeRole::DevicePlugin => NodeWrites::Published,
            NodeRole::DraPlugin => NodeWrites::ReadOnly,
        }
    }

    /// Its doctor preflight, unless `doctor.skip` (`--skip-doctor`).
    async fn preflight(self, config: &Config) -> anyhow::Result<()> {
        match self {
            NodeRole::DevicePlugin => preflight(doctor::Role::Node, config).await,
            NodeRole::DraPlugin if config.doctor.skip => Ok(()),
            NodeRole::DraPlugin => doctor::preflight_dra(config).await,
        }
    }
}

/// The start-up of node role `role` (the device plugin, the DRA plugin): the platform, the
/// settings no node role starts without, what the role reads before the preflight ends
/// (`early`: nothing is written, so a failed preflight still leaves the node untouched), the
/// role's preflight, then the role on the process's one node agent
/// ([`crate::node::run_role`]) until SIGTERM/SIGINT.
async fn run_node_role<E, EarlyFut, Fut>(
    node_role: NodeRole,
    config: &Config,
    early: impl FnOnce() -> EarlyFut,
    admit: impl FnOnce(PreparedAgent) -> anyhow::Result<PreparedAgent>,
    run: impl FnOnce(E, Arc<NodeAgent>, Shutdown) -> Fut,
) -> anyhow::Result<ExitCode>
where
    EarlyFut: Future<Output = anyhow::Result<E>>,
    Fut: Future<Output = anyhow::Result<ExitCode>>,
{
    let role = node_role.name();
    crate::buildinfo::ensure_server_platform(role)?;
    crate::node::check_required(config, role).map_err(failure::config)?;
    crate::gpu::check_config(&config.gpu).map_err(failure::config)?;
    let early = early().await?;
    node_role.preflight(config).await?;
    crate::node::run_role(
        config,
        role,
        node_role.writes(),
        admit,
        |agent, shutdown| run(early, agent, shutdown),
    )
    .await
}

/// The doctor preflight of a server role, unless `doctor.skip` (`--skip-doctor`).
async fn preflight(role: doctor::Role, config: &Config) -> anyhow::Result<()> {
    if config.doctor.skip {
        return Ok(());
    }
    doctor::preflight(role, config).await
}

fn clap_exit(e: clap::Error) -> ExitCode {
    let _ = e.print();
    match e.kind() {
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
            ExitCode::SUCCESS
        }
        _ => ExitCode::from(failure::USAGE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn go_style_single_dash_flags_are_rewritten() {
        let args = [
            "gpushare",
            "device-plugin",
            "-logtostderr",
            "-v=5",
            "--memory-unit=GiB",
            "-d",
            "-x",
        ]
        .map(OsString::from)
        .to_vec();
        let out: Vec<String> = normalize_go_flags(args)
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            out,
            [
                "gpushare",
                "device-plugin",
                "--logtostderr",
                "--v=5",
                "--memory-unit=GiB",
                "-d",
                "-x"
            ]
        );
    }

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
        InspectCli::command().debug_assert();
    }
}
