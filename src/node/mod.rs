//! The GPU node agent: what a GPU node does whichever kubelet path offers its GPUs. It is
//! infrastructure, not a role: `cli` builds ONE agent per process and hands it to the node
//! role(s) it starts (today the device plugin; a DRA kubelet plugin can take the same agent), so
//! one process serves every path with one MPS daemon and one health view.
//!
//! What it holds:
//! - the served GPUs ([`gpus`]) and the memory unit they are counted in, decided against the
//!   unit the node last published ([`unit_change`]);
//! - which path offers each GPU: one path at a time, in this process ([`paths`]) and across
//!   the node's processes ([`gpu_locks`]: a lock file per GPU), checked at start and
//!   continuously by each role's gate ([`path_gate`]), which also waits until the other
//!   path's pods or claims hold no memory on a GPU;
//! - health: the Xid tracker and its task ([`health`]), published as a watchable per-GPU
//!   [`health::HealthView`], with the node's device annotations and `GpuUnhealthy` Events;
//!   fatal Xids kept across restarts where the role gives a record ([`fatal_xids`]);
//! - with MPS, the daemon's supervisor ([`mps`]), given the node's Event sink and reporting to
//!   [`mps::MpsStatus`], whose state the roles follow for their readiness;
//! - node publishing ([`publish`]): `aliyun.com/gpu-count`, `gpushare.io/devices`,
//!   `gpushare.io/memory-unit`, `gpushare.io/excluded-gpus` (on the device-plugin path only:
//!   [`NodeWrites`]), Warning Events;
//! - the device kinds beside the GPUs ([`kinds`]): RDMA HCAs and generic devices, each one
//!   extended resource, with the GPUs' PCI places (read with [`PreparedAgent::with_devices`]);
//! - the container contract ([`contract`]): (GPU, units, strategy) → envs, mounts, device
//!   nodes, CDI names. Pure.
//! - GPU memory enforcement ([`enforcement`]): which mechanism each path's containers get
//!   (the driver's per-cgroup limits through a CDI hook, MPS, none), and the readback of every
//!   served container's limit.
//!
//! - what every role serves of it ([`monitor`]): the node metrics under the role's names,
//!   the readiness that follows the MPS daemon, and the refusal while the daemon is down.
//!
//! It does not speak any kubelet protocol (registration, ListAndWatch, Allocate, DRA gRPC:
//! those are the roles'), match pods to containers, or serve HTTP (the roles' admin servers
//! serve its metrics).
//!
//! Start-up is two steps so a role can refuse what it cannot serve before anything is
//! published: [`NodeAgent::prepare`] reads the node, the GPUs and decides the unit;
//! [`PreparedAgent::start`] publishes and starts the health task and the MPS supervisor.
//! [`serve_on_own_agent`] runs both with the role's check between them and starts the role on
//! the agent, in-process or as the process ([`run_role`], called by `cli`). The node roles'
//! shared flags are [`NodeArgs`].

mod agent_error;
pub mod api;
mod args;
pub mod contract;
pub mod enforcement;
pub mod fatal_xids;
pub mod gpu_locks;
pub mod gpus;
pub mod health;
pub mod kinds;
pub mod monitor;
pub mod mps;
pub mod path_gate;
pub mod paths;
pub mod publish;
mod unit_change;

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, NodeConfig};
use crate::core::MemoryUnit;
use crate::core::wire::DEVICE_PLUGIN_COMPONENT;
use crate::gpu::{GpuBackend, Inventory};
use crate::k8s::events::Events;
use crate::shutdown::Shutdown;

pub use agent_error::AgentError;
pub use args::NodeArgs;
use contract::NodeTraits;
use gpus::ServedGpu;
use health::{HealthTracker, HealthView};
use mps::{MpsSettings, MpsStatus, Supervisor};
use paths::{Assignments, PathConflict, ServingPath};
use publish::{NodeEvents, NodeFacts};

/// The settings without which node role `role` (`device-plugin`, `dra-plugin`) cannot start
/// (the node name), checked before the preflight so the message names the missing setting.
pub fn check_required(config: &Config, role: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !config.node.node_name.trim().is_empty(),
        "{role}: the node name is required: pass --node-name or set NODE_NAME \
         (in a DaemonSet: env NODE_NAME from fieldRef spec.nodeName)"
    );
    Ok(())
}

/// Opens the GPU backend and the API client of a node role, and waits for the API server.
pub async fn connect(
    config: &Config,
    role: &str,
) -> anyhow::Result<(kube::Client, Arc<dyn GpuBackend>)> {
    let backend = crate::gpu::open_off_runtime(&config.gpu)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the GPUs: {e} (on a GPU node: is the nvidia runtime the default \
             container runtime and the driver installed? without GPUs: --gpu-backend fake)"
            )
        })?;
    let client = crate::k8s::client(&crate::k8s::ClientOptions {
        kubeconfig: Some(config.cluster.kubeconfig.as_str()),
        ..Default::default()
    })
    .await?;
    let wait = Duration::from_secs(config.cluster.api_wait_secs);
    crate::k8s::reachable::wait_for_api(&config.cluster.kubeconfig, wait, role).await?;
    Ok((client, backend))
}

/// What the node agent writes on its Node object, by the path its role serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeWrites {
    /// The device-plugin path: `aliyun.com/gpu-count` in the status and the annotations
    /// `gpushare.io/devices`, `gpushare.io/memory-unit` and `gpushare.io/excluded-gpus` (what
    /// the extender and inspect read), the unit decided against the one the node recorded
    /// ([`unit_change`], which lists the node's pods when it changes).
    Published,
    /// The DRA path: none of that. The ResourceSlices carry the GPUs, their unit and their
    /// health, and allocations are in bytes; the Node is read (its uid names it in Events) and
    /// carries only the path's own annotation ([`path_gate`]) and the enforcement readback's.
    ReadOnly,
}

/// Starts a node role on an agent of its own: [`NodeAgent::prepare`], then `admit` (the role
/// reads what more it serves and refuses what it cannot, before anything is published), then
/// [`PreparedAgent::start`], then `serve` on the agent. The agent is stopped when `serve`
/// fails, and otherwise comes back beside the role's handle, to be stopped after the role.
/// [`run_role`] runs a role so as the process; the roles' in-process `start` (the integration
/// tests, `gpushare demo`) call it directly.
pub async fn serve_on_own_agent<H, Fut>(
    config: &Config,
    writes: NodeWrites,
    client: kube::Client,
    backend: Arc<dyn GpuBackend>,
    shutdown: Shutdown,
    admit: impl FnOnce(PreparedAgent) -> anyhow::Result<PreparedAgent>,
    serve: impl FnOnce(Arc<NodeAgent>, Shutdown) -> Fut,
) -> anyhow::Result<(H, NodeAgentHandle)>
where
    Fut: Future<Output = anyhow::Result<H>>,
{
    let prepared = admit(NodeAgent::prepare(&config.node, writes, client, backend).await?)?;
    let agent = prepared.start(shutdown.clone()).await?;
    match serve(agent.agent().clone(), shutdown).await {
        Ok(handle) => Ok((handle, agent)),
        Err(e) => {
            agent.stop().await;
            Err(e)
        }
    }
}

/// Runs node role `role` as the process until SIGTERM/SIGINT: opens the GPUs and the API
/// client ([`connect`]), starts the process's one agent and the role on it
/// ([`serve_on_own_agent`]) and stops the agent after the role.
pub async fn run_role<Fut>(
    config: &Config,
    role: &str,
    writes: NodeWrites,
    admit: impl FnOnce(PreparedAgent) -> anyhow::Result<PreparedAgent>,
    run: impl FnOnce(Arc<NodeAgent>, Shutdown) -> Fut,
) -> anyhow::Result<ExitCode>
where
    Fut: Future<Output = anyhow::Result<ExitCode>>,
{
    let (trigger, _) = crate::shutdown::channel();
    let shutdown = crate::shutdown::on_signals(trigger);
    let (client, backend) = connect(config, role).await?;
    let (code, agent) =
        serve_on_own_agent(config, writes, client, backend, shutdown, admit, run).await?;
    agent.stop().await;
    Ok(code)
}

/// The node agent, shared by the roles of the process.
pub struct NodeAgent {
    /// `[node]`, with `memory_unit` the unit served (it may differ from the configured one).
    config: NodeConfig,
    node: String,
    traits: NodeTraits,
    client: kube::Client,
    events: NodeEvents,
    backend: Arc<dyn GpuBackend>,
    gpus: Vec<ServedGpu>,
    paths: Mutex<Assignments>,
    /// The GPU lock directory ([`gpu_locks`]); a private one with the fake backend and no
    /// `gpu_lock_dir` (fake GPUs are shared by no other process).
    lock_dir: PathBuf,
    _private_locks: Option<tempfile::TempDir>,
    /// GPUs the device-plugin path holds back (published unhealthy for the extender).
    withheld: Mutex<std::collections::BTreeSet<String>>,
    health: watch::Sender<Arc<HealthView>>,
    mps: Option<Arc<MpsStatus>>,
    unit_refused: Option<String>,
    kinds: kinds::DeviceKinds,
    writes: NodeWrites,
    enforcement: Arc<enforcement::Enforcer>,
}

impl std::fmt::Debug for NodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAgent")
            .field("node", &self.node)
            .field("gpus", &self.gpus)
            .field("unit", &self.config.memory_unit)
            .finish_non_exhaustive()
    }
}

/// What [`NodeAgent::prepare`] read: enough for a role to check that it can serve the GPUs
/// before anything is published.
pub struct PreparedAgent {
    config: NodeConfig,
    node: String,
    facts: NodeFacts,
    client: kube::Client,
    backend: Arc<dyn GpuBackend>,
    inventory: Inventory,
    unit_refused: Option<String>,
    kinds: kinds::DeviceKinds,
    writes: NodeWrites,
    enforcement: Arc<enforcement::Enforcer>,
    fatal_xids: Option<PathBuf>,
}

impl std::fmt::Debug for PreparedAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedAgent")
            .field("node", &self.node)
            .field("inventory", &self.inventory)
            .field("unit", &self.config.memory_unit)
            .finish_non_exhaustive()
    }
}

impl NodeAgent {
    /// Reads the GPUs (at least one must be offered) and the node (it must exist), and
    /// decides the memory unit: the configured one, unless (with [`NodeWrites::Published`])
    /// pods placed under the unit the node published still run.
    pub async fn prepare(
        config: &NodeConfig,
        writes: NodeWrites,
        client: kube::Client,
        backend: Arc<dyn GpuBackend>,
    ) -> Result<PreparedAgent, AgentError> {
        let mut config = config.clone();
        let node = config.node_name.trim().to_string();
        if node.is_empty() {
            return Err(AgentError::NoNodeName);
        }
        let inventory = crate::gpu::inventory_off_runtime(&backend)
            .await
            .map_err(AgentError::Gpus)?;
        for g in &inventory.excluded {
            tracing::warn!(index = g.index, uuid = %g.uuid, reason = %g.reason, "GPU not offered");
        }
        if inventory.devices.is_empty() {
            return Err(AgentError::NoGpu {
                backend: inventory.backend,
                excluded: inventory
                    .excluded
                    .iter()
                    .map(|g| format!("; GPU {} {}: {}", g.index, g.uuid, g.reason))
                    .collect(),
            });
        }
        let facts = publish::read_node(&client, &node).await?;
        let unit_refused = match writes {
            NodeWrites::Published => {
                let unit = unit_change::decide(
                    &client,
                    &node,
                    facts.memory_unit.as_deref(),
                    config.memory_unit,
                )
                .await?;
                config.memory_unit = unit.unit;
                unit.refused
            }
            NodeWrites::ReadOnly => None,
        };
        let enforcement = Arc::new(
            enforcement::Enforcer::prepare_off_runtime(&config, &backend, &inventory).await,
        );
        Ok(PreparedAgent {
            config,
            node,
            facts,
            client,
            backend,
            inventory,
            unit_refused,
            kinds: kinds::DeviceKinds::default(),
            writes,
            enforcement,
            fatal_xids: None,
        })
    }

    /// `[node]` as served: `memory_unit` is the unit the GPUs are counted in.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The unit the GPUs are counted in.
    pub fn unit(&self) -> MemoryUnit {
        self.config.memory_unit
    }

    /// Why the configured unit is not served, when it is not.
    pub fn unit_refused(&self) -> Option<&str> {
        self.unit_refused.as_deref()
    }

    /// This node's name.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// What every container on this node is told about it.
    pub fn traits(&self) -> NodeTraits {
        self.traits
    }

    /// The API client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The node's Warning Events.
    pub fn events(&self) -> &NodeEvents {
        &self.events
    }

    /// Every GPU served, in index order.
    pub fn gpus(&self) -> &[ServedGpu] {
        &self.gpus
    }

    /// GPU `index`, when served.
    pub fn gpu_by_index(&self, index: u32) -> Option<&ServedGpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// GPU `uuid`, when served.
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<&ServedGpu> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// The GPU backend (a role reads what the served GPUs do not carry: product names, PCI
    /// addresses, the driver version).
    pub fn backend(&self) -> &Arc<dyn GpuBackend> {
        &self.backend
    }

    /// The health of every GPU now, and every change after.
    pub fn health(&self) -> watch::Receiver<Arc<HealthView>> {
        self.health.subscribe()
    }

    /// The device kinds beside the GPUs (none unless [`PreparedAgent::with_devices`]).
    pub fn device_kinds(&self) -> &kinds::DeviceKinds {
        &self.kinds
    }

    /// With MPS: the daemon's live state.
    pub fn mps(&self) -> Option<&Arc<MpsStatus>> {
        self.mps.as_ref()
    }

    /// GPU memory enforcement: each path's mechanism, the hook, the readback's state.
    pub fn enforcement(&self) -> &Arc<enforcement::Enforcer> {
        &self.enforcement
    }

    /// Offers GPUs `indices` on `path`; refused (none offered) when another path offers any
    /// of them. Returns the GPUs offered.
    pub fn offer(
        &self,
        path: ServingPath,
        indices: impl IntoIterator<Item = u32>,
    ) -> Result<Vec<ServedGpu>, PathConflict> {
        let indices: Vec<u32> = indices
            .into_iter()
            .filter(|i| self.gpu_by_index(*i).is_some())
            .collect();
        let mut paths = self.paths.lock().unwrap_or_else(|p| p.into_inner());
        paths.offer(path, indices.iter().copied())?;
        Ok(self
            .gpus
            .iter()
            .filter(|g| indices.contains(&g.index))
            .cloned()
            .collect())
    }

    /// Takes back GPU `index` from `path` (its lock was not taken).
    pub fn withdraw_one(&self, path: ServingPath, index: u32) {
        self.paths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .withdraw_one(path, index);
    }

    /// The locks of this node's GPUs ([`gpu_locks`]).
    pub fn gpu_locks(&self) -> gpu_locks::GpuLocks {
        gpu_locks::GpuLocks::new(&self.lock_dir, &self.node)
    }

    /// Publishes `gpushare.io/devices` as health and the device-plugin path's offer say: a GPU
    /// is healthy for the extender when its health is, and the device plugin offers it.
    pub async fn publish_device_annotations(&self) {
        if self.writes != NodeWrites::Published {
            return;
        }
        let view = self.health.borrow().clone();
        let withheld = self
            .withheld
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let annotations = publish::device_annotations(&self.gpus, self.config.memory_unit, |u| {
            view.is_healthy(u) && !withheld.contains(u)
        });
        if let Err(e) = publish::publish_devices(&self.client, &self.node, &annotations).await {
            tracing::warn!(error = %e, "could not publish GPU health on the node");
        }
    }

    /// The GPUs (UUIDs) the device-plugin path holds back now; republishes the device
    /// annotations when that changes.
    pub(crate) async fn set_withheld(&self, uuids: std::collections::BTreeSet<String>) {
        let changed = {
            let mut have = self.withheld.lock().unwrap_or_else(|p| p.into_inner());
            let changed = *have != uuids;
            *have = uuids;
            changed
        };
        if changed {
            self.publish_device_annotations().await;
        }
    }

    /// Takes back every GPU `path` offers (its role stopped).
    pub fn withdraw(&self, path: ServingPath) {
        self.paths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .withdraw(path);
    }

    /// The path that offers GPU `index`, if any.
    pub fn path_of(&self, index: u32) -> Option<ServingPath> {
        self.paths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .path_of(index)
    }
}

impl PreparedAgent {
    /// Reads the device kinds `[devices]` enables (RDMA HCAs, generic devices) and the PCI
    /// place of each GPU found, for the agent to hold beside its GPUs.
    pub fn with_devices(mut self, config: &crate::config::devices::DevicesConfig) -> Self {
        self.kinds = kinds::discover(config, &self.inventory.devices);
        self
    }

    /// Keeps the fatal Xids in `path` ([`fatal_xids`]): a GPU one took down stays down across
    /// restarts until the node reboots or the GPU leaves.
    pub fn with_fatal_xid_record(mut self, path: PathBuf) -> Self {
        self.fatal_xids = Some(path);
        self
    }

    /// The GPUs read (those offered and those left out).
    pub fn found_gpus(&self) -> &Inventory {
        &self.inventory
    }

    /// The unit decided.
    pub fn unit(&self) -> MemoryUnit {
        self.config.memory_unit
    }

    /// GPU memory enforcement as found on this node (a role's admit asks what its path gets,
    /// [`enforcement::Enforcer::admit`]).
    pub fn enforcement(&self) -> &Arc<enforcement::Enforcer> {
        &self.enforcement
    }

    /// Publishes the node facts (gpu-count, device annotations, excluded GPUs, the unit
    /// refusal's Event) and starts the MPS supervisor (the daemon answers, or is known not
    /// to, before this returns) and the health task, until `shutdown` or
    /// [`NodeAgentHandle::stop`].
    pub async fn start(self, shutdown: Shutdown) -> Result<NodeAgentHandle, AgentError> {
        let PreparedAgent {
            config,
            node,
            facts,
            client,
            backend,
            inventory,
            unit_refused,
            kinds,
            writes,
            enforcement,
            fatal_xids,
        } = self;
        let unit = config.memory_unit;
        let gpus = gpus::served_gpus(&inventory, unit);
        let mut tracker = HealthTracker::new(
            gpus.iter().map(|g| g.uuid.clone()),
            Duration::from_secs(config.health_recovery_secs),
        );
        let record = fatal_xids.map(|path| restore_fatal_xids(path, &gpus, &mut tracker));
        if writes == NodeWrites::Published {
            publish::publish_gpu_count(&client, &node, gpus.len()).await?;
            publish::publish_devices(
                &client,
                &node,
                &publish::device_annotations(&gpus, unit, |u| tracker.is_healthy(u)),
            )
            .await?;
            publish::publish_devices(
                &client,
                &node,
                &publish::excluded_annotation(&inventory.excluded),
            )
            .await?;
        }
        let events = NodeEvents::new(
            Events::new(client.clone(), DEVICE_PLUGIN_COMPONENT, &node),
            &node,
            &facts.uid,
        );
        if let Some(refused) = &unit_refused {
            tracing::error!("{refused}");
            events
                .warn("Start", "GpuShareMemoryUnitChangeRefused", refused)
                .await;
        }
        let health = watch::Sender::new(Arc::new(HealthView::of(&tracker, 0)));
        let (lock_dir, private_locks) = gpu_lock_dir(&config, inventory.backend);
        let mps = config.mps.then(|| {
            let mut control = crate::gpu::mps::MpsControl::new(
                &config.mps_control,
                &config.mps_pipe_dir,
                &config.mps_log_dir,
            );
            // The daemon gets the GPUs this node serves (not, say, a MIG GPU left out).
            control.visible_devices = gpus.iter().map(|g| g.uuid.clone()).collect();
            Arc::new(MpsStatus::new(control))
        });
        let agent = Arc::new(NodeAgent {
            traits: NodeTraits {
                cgpu_disable: facts.cgpu_disable,
            },
            node,
            client,
            events,
            backend: backend.clone(),
            gpus,
            paths: Mutex::default(),
            lock_dir,
            _private_locks: private_locks,
            withheld: Mutex::default(),
            health,
            mps,
            unit_refused,
            kinds,
            writes,
            enforcement,
            config,
        });
        let (stop_trigger, stop) = shutdown.child();
        let mut tasks = Vec::new();
        // The MPS daemon answers (or is known not to) before a role can hand out a GPU.
        if let Some(status) = &agent.mps {
            tasks.push(supervise_mps(&agent, status.clone(), unit, stop.clone()).await);
        }
        tasks.push(tokio::spawn(enforcement::readback::run(
            agent.enforcement.clone(),
            agent.client.clone(),
            enforcement::readback::Scope {
                node: agent.node.clone(),
                gpus: agent.gpus.clone(),
                unit,
            },
            stop.clone(),
        )));
        if agent.config.health_check {
            match backend.watch_health() {
                Ok(rx) => tasks.push(tokio::spawn(health_task(
                    agent.clone(),
                    tracker,
                    record,
                    rx,
                    stop.clone(),
                ))),
                Err(e) => {
                    tracing::warn!(error = %e, "GPU health events unavailable; health check off")
                }
            }
        }
        Ok(NodeAgentHandle {
            agent,
            stop: stop_trigger,
            tasks,
        })
    }
}

/// The fatal Xid record at `path` for the served `gpus` (a record of another boot is
/// dropped): each GPU it names is down in `tracker` from the start; saved back.
fn restore_fatal_xids(
    path: PathBuf,
    gpus: &[ServedGpu],
    tracker: &mut HealthTracker,
) -> (PathBuf, fatal_xids::FatalXids) {
    let present: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    let record = fatal_xids::FatalXids::load(&path, &fatal_xids::boot_id(), &present);
    for (uuid, xid) in &record.gpus {
        tracing::warn!(
            uuid,
            xid,
            "GPU down since a fatal Xid before this start (recorded)"
        );
        tracker.apply(
            &crate::gpu::HealthEvent::Xid {
                uuid: Some(uuid.clone()),
                xid: *xid,
            },
            tokio::time::Instant::now(),
        );
    }
    if let Err(e) = record.save(&path) {
        tracing::warn!(error = %e, "cannot write the fatal Xid record");
    }
    (path, record)
}

/// The directory of the GPU locks: the configured one; with fake GPUs and none configured,
/// a private temporary one (kept alive by the returned guard); else the default.
fn gpu_lock_dir(config: &NodeConfig, backend: &str) -> (PathBuf, Option<tempfile::TempDir>) {
    match (&config.gpu_lock_dir, backend) {
        (dir, _) if !dir.as_os_str().is_empty() => (dir.clone(), None),
        (_, "fake") => match tempfile::Builder::new().prefix("gpushare-gpus").tempdir() {
            Ok(d) => (d.path().to_path_buf(), Some(d)),
            Err(_) => (PathBuf::from(crate::config::DEFAULT_GPU_LOCK_DIR), None),
        },
        _ => (PathBuf::from(crate::config::DEFAULT_GPU_LOCK_DIR), None),
    }
}

/// Starts the MPS supervisor of `agent` over `status`: the daemon answers (or is known not
/// to) before this returns; its task runs until `stop`.
async fn supervise_mps(
    agent: &NodeAgent,
    status: Arc<MpsStatus>,
    unit: MemoryUnit,
    stop: Shutdown,
) -> JoinHandle<()> {
    let settings = MpsSettings {
        interval: Duration::from_millis(agent.config.mps_check_interval_ms),
        backoff_max: Duration::from_secs(agent.config.mps_restart_backoff_max_secs),
        active_thread_percentage: agent.config.mps_active_thread_percentage,
        limits: mps::default_limits(&agent.gpus, unit, agent.config.mps_pinned_mem_limit_mib),
    };
    let mut supervisor = Supervisor::new(status, settings, agent.events.clone());
    supervisor.first_contact().await;
    tokio::spawn(supervisor.run(stop))
}

/// A running node agent.
#[derive(Debug)]
pub struct NodeAgentHandle {
    agent: Arc<NodeAgent>,
    stop: crate::shutdown::Trigger,
    tasks: Vec<JoinHandle<()>>,
}

impl NodeAgentHandle {
    /// The agent, to hand to the roles.
    pub fn agent(&self) -> &Arc<NodeAgent> {
        &self.agent
    }

    /// Stops the health task and the MPS supervisor (which stops a daemon it started).
    pub async fn stop(self) {
        self.stop.trigger();
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// Applies health events and recoveries until `stop`; publishes each change as the health
/// view, on the node's annotations and (going down) as a `GpuUnhealthy` Event.
async fn health_task(
    agent: Arc<NodeAgent>,
    mut tracker: HealthTracker,
    mut record: Option<(PathBuf, fatal_xids::FatalXids)>,
    mut events: tokio::sync::mpsc::Receiver<crate::gpu::HealthEvent>,
    stop: Shutdown,
) {
    let stop_fut = stop.wait();
    tokio::pin!(stop_fut);
    let mut events_open = true;
    let mut unattributed: u64 = 0;
    loop {
        let next = tracker.next_recovery();
        let wake = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let changes = tokio::select! {
            _ = &mut stop_fut => return,
            ev = events.recv(), if events_open => match ev {
                Some(crate::gpu::HealthEvent::Unattributed { pci, xid }) => {
                    tracing::warn!(pci = %pci, xid, "XID at a PCI address that is none of the served GPUs (NVSwitch/NVLink?): no GPU marked");
                    unattributed = unattributed.saturating_add(1);
                    agent.health.send_replace(Arc::new(HealthView::of(&tracker, unattributed)));
                    Vec::new()
                }
                Some(ev) => {
                    tracing::info!(event = ?ev, "GPU health event");
                    tracker.apply(&ev, tokio::time::Instant::now())
                }
                None => { events_open = false; Vec::new() }
            },
            _ = wake => {
                let present: Vec<String> = crate::gpu::inventory_off_runtime(&agent.backend)
                    .await
                    .map(|inv| inv.devices.into_iter().map(|d| d.uuid).collect())
                    .unwrap_or_default();
                tracker.recover(tokio::time::Instant::now(), |u| present.iter().any(|p| p == u))
            }
        };
        if changes.is_empty() {
            continue;
        }
        if let Some((path, kept)) = record.as_mut() {
            let fatal = tracker.fatal_xids();
            if fatal != kept.gpus {
                kept.gpus = fatal;
                if let Err(e) = kept.save(path) {
                    tracing::warn!(error = %e, "cannot record a fatal Xid: a restart would forget it");
                }
            }
        }
        let view = Arc::new(HealthView::of(&tracker, unattributed));
        agent.health.send_replace(view.clone());
        agent.publish_device_annotations().await;
        for change in changes {
            let index = agent
                .gpu_by_uuid(&change.uuid)
                .map(|g| g.index.to_string())
                .unwrap_or_default();
            if change.healthy {
                tracing::info!(
                    gpu = index,
                    uuid = change.uuid,
                    reason = change.reason,
                    "GPU healthy again"
                );
            } else {
                tracing::warn!(
                    gpu = index,
                    uuid = change.uuid,
                    reason = change.reason,
                    "GPU unhealthy"
                );
                agent
                    .events
                    .warn(
                        "HealthCheck",
                        "GpuUnhealthy",
                        &format!(
                            "GPU {index} ({}) is unhealthy: {}",
                            change.uuid, change.reason
                        ),
                    )
                    .await;
            }
        }
    }
}
