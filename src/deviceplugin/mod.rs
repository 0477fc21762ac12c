//! `gpushare device-plugin`: the kubelet device plugin, a drop-in for Aliyun's
//! gpushare-device-plugin (reference spec §5) without its known failures.
//!
//! It is the kubelet protocol only: what a GPU node does whichever path serves it (the GPUs,
//! the unit, health, MPS, node annotations and Events, the container contract) is the node
//! agent's ([`crate::node`]), handed in by `cli` (or built by [`start`]).
//!
//! What it does:
//! - serves the device plugin API v1beta1 on `<dir>/aliyungpushare.sock` and registers
//!   `aliyun.com/gpu-mem` with `<dir>/kubelet.sock` (GetPreferredAllocation available); when
//!   kubelet restarts (its socket recreated, ours removed) it serves again and re-registers
//!   ([`registration`]);
//! - advertises one fake device `<UUID>-_-<n>` per memory unit of EACH GPU, refusing to start
//!   when the list would not fit kubelet's 4 MiB message limit ([`devices`]);
//! - answers Allocate per container with the GPU the extender chose, matched from a watch of
//!   this node's pods ([`matching`], [`allocate`], [`pods`]), and cross-checks against the
//!   kubelet PodResources API, correcting swaps ([`reconcile`]);
//! - follows the agent's health view into ListAndWatch (an unhealthy GPU's devices are
//!   `Unhealthy`) and its metrics;
//! - serves each device kind the agent holds (RDMA HCAs, generic devices) as an extended
//!   resource of its own, on its own socket ([`kinds`]);
//! - serves `/healthz`, `/readyz`, `/metrics` on `device_plugin.admin_address` ([`crate::admin::serve`]);
//! - with `--mps`, follows the agent's MPS daemon: ready and answering Allocate only while the
//!   daemon serves.
//!
//! It does not choose GPUs (the extender does) and does not isolate memory unless `--mps`.
//!
//! [`start`] is the in-process entry used by `run`, the integration tests and `gpushare demo`.
// Off unix the socket code is left out (see no_unix_sockets), so much of the rest is unused.
#![cfg_attr(not(unix), allow(dead_code))]

pub mod allocate;
pub mod devices;
pub(crate) mod journal;
#[cfg(unix)]
pub mod kinds;
mod limiter;
pub mod matching;
pub mod metrics;
#[cfg(not(unix))]
mod no_unix_sockets;
mod pending;
mod plugin;
pub mod pods;
#[cfg(not(unix))]
use no_unix_sockets as reconcile;
#[cfg(not(unix))]
use no_unix_sockets as registration;
#[cfg(unix)]
pub mod reconcile;
pub mod records;
#[cfg(unix)]
pub mod registration;
mod reported;
mod service;
pub(crate) mod writeback;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::admin::AdminState;
use crate::config::{AllocateFailure, Config, FlagOverrides};
use crate::gpu::GpuBackend;
use crate::node::gpus::ServedGpu;
use crate::node::health::HealthView;
use crate::node::monitor::{NodeMetrics, NodeMonitor, NodeRole};
use crate::node::path_gate::{GateSettings, Offer, PathGate};
use crate::node::paths::ServingPath;
use crate::node::{NodeAgent, NodeAgentHandle, NodeArgs, PreparedAgent};
use crate::shutdown::Shutdown;

use metrics::Metrics;
use pending::Writeback;
pub use plugin::AllocationRecord;
pub(crate) use plugin::Plugin;
use pods::PodStore;

/// Flags of `gpushare device-plugin`: the node agent's ([`NodeArgs`]) and the kubelet side's
/// (each overrides its `[device_plugin]`, `[node]`, `[gpu]`, `[devices]` or `[doctor]` key).
/// Upstream's flags are accepted: `--memory-unit`, `--health-check`, `--mps` work; the glog
/// flags (`-logtostderr`, `--v=5`, …) and `--query-kubelet` family are accepted and ignored, so
/// upstream manifests keep working.
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
pub struct Args {
    /// The node agent's flags.
    #[command(flatten)]
    #[serde(skip)]
    pub node: NodeArgs,
    /// kubelet's device-plugin directory [default: /var/lib/kubelet/device-plugins]
    #[arg(long, value_name = "DIR")]
    pub device_plugin_dir: Option<PathBuf>,
    /// kubelet's pod-resources socket, used when it exists
    /// [default: /var/lib/kubelet/pod-resources/kubelet.sock]
    #[arg(long, value_name = "PATH")]
    pub pod_resources_socket: Option<PathBuf>,
    /// Answer when no pod matches an Allocate: the upstream env convention, or a gRPC error
    /// [default: env]
    #[arg(long, value_enum)]
    pub allocate_failure: Option<AllocateFailure>,
    /// Address of /healthz, /readyz and /metrics; empty disables them [default: 0.0.0.0:9101]
    #[arg(long, value_name = "ADDR")]
    pub admin_address: Option<String>,
    /// Where Allocate's answers are kept until the pods' annotations say so (tmpfs)
    /// [default: /var/run/gpushare/device-plugin]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Do not run the node preflight (doctor) before starting
    #[arg(long)]
    #[serde(rename = "doctor.skip", skip_serializing_if = "std::ops::Not::not")]
    pub skip_doctor: bool,
    /// Upstream switches, accepted and ignored: the glog `--logtostderr`,
    /// `--alsologtostderr` and `--query-kubelet` (pods come from a watch).
    #[arg(
        long = "logtostderr",
        aliases = ["alsologtostderr", "query-kubelet"],
        hide = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Append
    )]
    #[serde(skip)]
    pub legacy_switches: Vec<String>,
    /// Upstream flags with a value, accepted and ignored: glog `--v` (use --log-level) and the
    /// kubelet client flags `--kubelet-address`, `--kubelet-port`, `--client-cert`,
    /// `--client-key`, `--token`, `--timeout`.
    #[arg(
        long = "v",
        aliases = ["kubelet-address", "kubelet-port", "client-cert", "client-key", "token", "timeout"],
        hide = true,
        action = clap::ArgAction::Append
    )]
    #[serde(skip)]
    pub legacy_values: Vec<String>,
}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, flags: &mut FlagOverrides) {
        self.node.overrides(flags);
        flags.args("device_plugin", self);
    }
}

/// What the device plugin reads and refuses before the agent publishes anything: the device
/// kinds `[devices]` enables, and GPUs whose fake devices would not fit kubelet's 4 MiB
/// ListAndWatch message in the unit decided.
pub fn admit(config: &Config, prepared: PreparedAgent) -> anyhow::Result<PreparedAgent> {
    let prepared = prepared.with_devices(&config.devices);
    devices::check_message_size(prepared.found_gpus(), prepared.unit())?;
    prepared
        .enforcement()
        .admit(crate::node::paths::ServingPath::DevicePlugin)
        .map_err(crate::failure::config)?;
    Ok(prepared)
}

/// This node's pods, listed from the process's start on (the dispatcher starts it beside the
/// node preflight): the plugin registers with kubelet as soon as both are done, instead of
/// listing only once the preflight has passed and the agent has started.
#[derive(Debug)]
pub struct EarlyPods {
    store: PodStore,
    stop: crate::shutdown::Trigger,
    task: JoinHandle<()>,
}

impl EarlyPods {
    /// Starts the watch of `config`'s node's pods with a client of its own. Nothing is written;
    /// an API server that does not answer yet is retried (the fast backoff).
    pub async fn start(config: &Config) -> anyhow::Result<EarlyPods> {
        let client = crate::k8s::client(&crate::k8s::ClientOptions {
            kubeconfig: Some(config.cluster.kubeconfig.as_str()),
            ..Default::default()
        })
        .await?;
        let store = PodStore::default();
        let (stop, shutdown) = crate::shutdown::channel();
        let task = tokio::spawn(
            store
                .clone()
                .run(client, config.node.node_name.clone(), shutdown),
        );
        Ok(EarlyPods { store, stop, task })
    }
}

/// Runs the device plugin on `agent` until `shutdown` (SIGTERM/SIGINT), with the pod watch
/// `early` started (when the dispatcher started one). The dispatcher has run the preflight and
/// started the agent.
pub async fn run(
    _args: Args,
    config: &Config,
    agent: Arc<NodeAgent>,
    shutdown: Shutdown,
    early: Option<EarlyPods>,
) -> anyhow::Result<ExitCode> {
    let handle = serve_with(config, agent, shutdown.clone(), early).await?;
    tracing::info!(socket = %handle.socket_path().display(), "device plugin serving");
    shutdown.wait().await;
    handle.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// A running device plugin.
#[derive(Debug)]
pub struct DevicePluginHandle {
    plugin: Arc<Plugin>,
    gate: Option<PathGate>,
    stop: Arc<crate::shutdown::Trigger>,
    tasks: Vec<JoinHandle<()>>,
    admin_addr: Option<std::net::SocketAddr>,
    /// The agent, when [`start`] built it for this plugin alone (stopped with it).
    own_agent: Option<NodeAgentHandle>,
}

impl DevicePluginHandle {
    /// Path of the plugin's socket.
    pub fn socket_path(&self) -> PathBuf {
        self.plugin.socket_path()
    }

    /// The admin server's address, when it runs.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin_addr
    }

    /// The metrics of the kubelet side.
    pub fn metrics(&self) -> &Metrics {
        &self.plugin.metrics
    }

    /// The node metrics (health, the memory-unit refusal, MPS).
    pub fn node_metrics(&self) -> &NodeMetrics {
        self.plugin.node.metrics()
    }

    /// The metrics in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        self.plugin.admin.render_metrics()
    }

    /// The GPUs served, with their unit counts.
    pub fn gpus(&self) -> &[ServedGpu] {
        &self.plugin.gpus
    }

    /// The allocations answered and still held (most recent last): pods that are gone and
    /// containers whose device IDs kubelet gave to another are dropped.
    pub async fn allocations(&self) -> Vec<AllocationRecord> {
        self.plugin.allocation_records()
    }

    /// How many pods have Allocate answers not yet written to their annotations.
    pub fn pending_writes(&self) -> usize {
        self.plugin.writeback.pending()
    }

    /// Resolves once every Allocate answer so far is written to its pod (or the pod is gone).
    pub async fn writes_settled(&self) {
        self.plugin.writeback.settled().await
    }

    /// Resolves once every Allocate answer so far for pod `namespace/name` is written to it
    /// (or the pod is gone).
    pub async fn write_settled(&self, namespace: &str, name: &str) {
        self.plugin.writeback.settled_pod(namespace, name).await
    }

    /// Asks the PodResources reconciler to run now.
    pub fn reconcile_now(&self) {
        self.plugin.reconcile_now.notify_one();
    }

    /// Runs one PodResources reconcile pass now and waits for it (its corrections included).
    pub async fn reconcile(&self) -> anyhow::Result<()> {
        reconcile::reconcile_once(&self.plugin).await.map(|_| ())
    }

    /// Whether the pod store has completed its first list of this node's pods.
    pub fn pods_synced(&self) -> bool {
        self.plugin.pods.is_synced()
    }

    /// The gpushare annotations of pod `namespace/name` as the pod watch last saw them (what
    /// matching and the device kinds' preferences read); `None` when the watch has not seen it.
    pub fn watched_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<crate::core::PodGpuAnnotations> {
        self.plugin.pods.get(namespace, name).map(|p| p.annotations)
    }

    /// The extended resources of the device kinds served beside the GPU's.
    pub fn kind_resources(&self) -> Vec<String> {
        self.plugin
            .agent
            .device_kinds()
            .kinds
            .iter()
            .map(|k| k.resource.clone())
            .collect()
    }

    /// The node agent it serves.
    pub fn agent(&self) -> &Arc<NodeAgent> {
        &self.plugin.agent
    }

    /// What the path's gate offers now, and every change after.
    pub fn offer(&self) -> watch::Receiver<Offer> {
        self.plugin.offer.clone()
    }

    /// Stops serving, ends the ListAndWatch streams, removes the socket and gives the GPUs
    /// back to the agent (and stops the agent when [`start`] built it).
    pub async fn stop(mut self) {
        self.stop.trigger();
        for task in std::mem::take(&mut self.tasks) {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        let _ = std::fs::remove_file(self.plugin.socket_path());
        if let Some(gate) = self.gate.take() {
            gate.close().await;
        }
        self.plugin.agent.withdraw(ServingPath::DevicePlugin);
        if let Some(agent) = self.own_agent {
            agent.stop().await;
        }
    }
}

/// Starts the device plugin in-process with a node agent of its own (the integration tests,
/// `gpushare demo`): the agent is started after [`admit`], then [`serve`]s. The agent stops
/// with the plugin.
pub async fn start(
    config: &Config,
    client: kube::Client,
    backend: Arc<dyn GpuBackend>,
    shutdown: Shutdown,
) -> anyhow::Result<DevicePluginHandle> {
    let (mut handle, agent) = crate::node::serve_on_own_agent(
        config,
        crate::node::NodeWrites::Published,
        client,
        backend,
        shutdown,
        |prepared| admit(config, prepared),
        |agent, shutdown| serve(config, agent, shutdown),
    )
    .await?;
    handle.own_agent = Some(agent);
    Ok(handle)
}

/// Serves the agent's GPUs as the device plugin: offers them on [`ServingPath::DevicePlugin`]
/// (refused when another path offers any), starts the pod watch, the gRPC server (with kubelet
/// registration and restart handling), the followers of the agent's health and MPS state, the
/// reconciler and the admin server. Returns once the socket is served; registration continues
/// in the background until it succeeds.
pub async fn serve(
    config: &Config,
    agent: Arc<NodeAgent>,
    shutdown: Shutdown,
) -> anyhow::Result<DevicePluginHandle> {
    serve_with(config, agent, shutdown, None).await
}

/// [`serve`] with the pod watch `early` already running (its store is the plugin's, its task
/// stops with the plugin), or a watch of its own when `None`.
async fn serve_with(
    config: &Config,
    agent: Arc<NodeAgent>,
    shutdown: Shutdown,
    early: Option<EarlyPods>,
) -> anyhow::Result<DevicePluginHandle> {
    let dp = config.device_plugin.clone();
    let (pods, early_watch) = match early {
        Some(e) => (e.store, Some((e.stop, e.task))),
        None => (PodStore::default(), None),
    };
    let gate = agent
        .open_path(
            ServingPath::DevicePlugin,
            GateSettings {
                dra_driver: config.dra.driver_name.clone(),
            },
            shutdown.clone(),
        )
        .await;
    let gpus = agent.gpus().to_vec();
    let admin = AdminState::new();
    let metrics = Metrics::new(&admin);
    agent.enforcement().status().register(&admin);
    let node = NodeMonitor::new(agent.clone(), admin.clone(), NodeRole::DevicePlugin);
    let mut health = agent.health();
    let view = health.borrow_and_update().clone();
    let first = devices::list_and_watch_response(&gpus, |u| view.is_healthy(u));
    let (devices_tx, _) = watch::channel(Arc::new(first));
    // One internal stop that fires on the caller's shutdown or on `stop()`.
    let (stop_trigger, stop) = shutdown.child();
    let stop_trigger = Arc::new(stop_trigger);
    let plugin = Arc::new(Plugin {
        config: dp.clone(),
        agent: agent.clone(),
        gpus,
        offer: gate.offer(),
        devices_tx,
        pods,
        records: std::sync::Mutex::default(),
        pod_locks: std::sync::Mutex::default(),
        reconcile_now: Notify::new(),
        reported: std::sync::Mutex::default(),
        metrics,
        node: node.clone(),
        admin: admin.clone(),
        writeback: Writeback::open(&dp.state_dir),
        stopping: stop.clone(),
    });
    plugin.refresh_devices(&view);
    // The answers of an earlier run that are not on the pods yet count as answered before
    // kubelet can call Allocate (registration comes later), and their writes are finished.
    if plugin.writeback.replay(&plugin) > 0 {
        plugin.reconcile_now.notify_one();
    }
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(follow_health(
        plugin.clone(),
        health,
        gate.offer(),
        stop.clone(),
    )));
    // The node metrics and the readiness (MPS) follow the agent.
    tasks.push(node.follow(stop.clone()));
    tasks.extend(pod_watch(&plugin, early_watch, &stop));
    match serve_sockets(&plugin, &stop).await {
        Ok(served) => tasks.extend(served),
        Err(e) => {
            stop_trigger.trigger();
            agent.withdraw(ServingPath::DevicePlugin);
            return Err(e);
        }
    }
    tasks.push(tokio::spawn(reconcile::run(plugin.clone(), stop.clone())));
    let admin_addr = match crate::admin::serve(
        &dp.admin_address,
        admin.clone(),
        "not registered with kubelet, or (with --mps) the MPS control daemon does not answer",
        crate::http_server::Limits::from_config(&config.http),
        stop.clone(),
    )
    .await
    {
        Ok(served) => served.map(|(addr, task)| {
            tasks.push(task);
            addr
        }),
        Err(e) => {
            // Stops the tasks started so far (and removes the plugin socket).
            stop_trigger.trigger();
            agent.withdraw(ServingPath::DevicePlugin);
            return Err(e);
        }
    };
    Ok(DevicePluginHandle {
        plugin,
        gate: Some(gate),
        stop: stop_trigger,
        tasks,
        admin_addr,
        own_agent: None,
    })
}

/// The tasks of the plugin's pod watch: the early watch (its task, and its stop tied to
/// `stop`), or a watch of the plugin's own store.
fn pod_watch(
    plugin: &Arc<Plugin>,
    early_watch: Option<(crate::shutdown::Trigger, JoinHandle<()>)>,
    stop: &Shutdown,
) -> Vec<JoinHandle<()>> {
    match early_watch {
        Some((early_stop, task)) => {
            // The early watch stops with the plugin.
            let stopped = stop.clone();
            vec![
                task,
                tokio::spawn(async move {
                    stopped.wait().await;
                    early_stop.trigger();
                }),
            ]
        }
        None => vec![tokio::spawn(plugin.pods.clone().run(
            plugin.agent.client().clone(),
            plugin.agent.node_name().to_string(),
            stop.clone(),
        ))],
    }
}

/// Serves the plugin's socket and one per device kind (registered with kubelet): their tasks,
/// or the first error (the caller stops what was started).
async fn serve_sockets(
    plugin: &Arc<Plugin>,
    stop: &Shutdown,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    // The device kinds are served on unix only (elsewhere the list stays as it is).
    #[cfg_attr(not(unix), allow(unused_mut))]
    let mut tasks = vec![registration::serve(plugin.clone(), stop.clone()).await?];
    #[cfg(unix)]
    for kind in &plugin.agent.device_kinds().kinds {
        let kp = Arc::new(kinds::KindPlugin::new(plugin.clone(), kind.clone()));
        tasks.push(registration::serve(kp, stop.clone()).await?);
    }
    Ok(tasks)
}

/// Follows the agent's health view and the gate's offer into ListAndWatch until `stop`.
async fn follow_health(
    plugin: Arc<Plugin>,
    mut health: watch::Receiver<Arc<HealthView>>,
    mut offer: watch::Receiver<Offer>,
    stop: Shutdown,
) {
    loop {
        tokio::select! {
            _ = stop.clone().wait() => return,
            changed = health.changed() => if changed.is_err() { return },
            changed = offer.changed() => if changed.is_err() { return },
        }
        let view = health.borrow_and_update().clone();
        offer.borrow_and_update();
        plugin.refresh_devices(&view);
    }
}
