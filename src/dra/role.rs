//! `gpushare dra-plugin`: the DRA kubelet plugin role. It serves the node agent's GPUs on the
//! DRA path: opens the path's gate ([`crate::node::path_gate`]: a GPU another path serves, or
//! whose memory the extender path's pods still hold, is left out of the slice until it is
//! free; MIG-excluded GPUs never reach the agent), starts the plugin's gRPC side ([`super::plugin`])
//! with the CDI [`super::prepare::CdiPreparer`], and keeps the node's ResourceSlice published
//! ([`super::publish`]) on every change: a GPU's health (the agent's health view: taint and
//! `NodeWatchResources`) and the memory allocated on each GPU (a watch of the ResourceClaims
//! allocated on this node's pool), which orders the devices by `--gpu-policy`, and what the
//! gate offers. The node agent's other device kinds (`[devices]`: RDMA HCAs, generic devices)
//! are published in the same slice after the GPUs ([`super::kinds`]) and handed over by the
//! same preparer. It serves `/healthz`, `/readyz` (ready once kubelet accepted the
//! registration and, with MPS, while the daemon serves) and `/metrics` (its own and the
//! node's, [`super::metrics`], [`crate::node::monitor`]) on `dra.admin_address`. The fatal
//! Xids are kept beside the checkpoint ([`FATAL_XIDS_FILE`]). Stopping closes the gate (the GPU
//! locks let go), stops serving and removes the sockets; the slices stay (a restarted plugin
//! takes them over; kubelet removes a plugin's slices when it is gone for good).
//!
//! What it does not do: build the node agent (`cli` has [`crate::node::run_role`] do it, as
//! for the device plugin), decide the container edits (the node contract, through the
//! preparer), or rewrite pods (the webhook).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::kinds::{KindDevice, kind_devices};
use super::metrics::DraMetrics;
use super::plugin::{PluginConfig, PluginHooks, Reconciled, RunningPlugin, Served};
use super::prepare::CdiPreparer;
use super::slices::{Pool, SliceGpu, device_name};
use crate::admin::AdminState;
use crate::config::{Config, DraConfig, FlagOverrides};
use crate::core::{GpuPolicy, MemoryUnit};
use crate::kubelet_api::pluginregistration::RegistrationStatus;
use crate::node::enforcement::report::{ContainerMemory, LimitState};
use crate::node::health::HealthView;
use crate::node::monitor::{NodeMetrics, NodeMonitor, NodeRole};
use crate::node::path_gate::{GateSettings, Offer, PathGate};
use crate::node::paths::ServingPath;
use crate::node::{NodeAgent, NodeAgentHandle, NodeArgs, PreparedAgent};
use crate::shutdown::Shutdown;

/// The checkpoint's file name in the state directory (`dra.state_dir`).
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// The record of fatal Xids in the state directory, beside the checkpoint.
pub const FATAL_XIDS_FILE: &str = "fatal-xids.json";
/// The wait before a failed slice publication is tried again.
const REPUBLISH_AFTER: Duration = Duration::from_secs(2);
/// The wait before a publication the API server refused for certain (a 4xx: an invalid slice,
/// a forbidden write) is tried again: the same slices would be refused the same way, so only
/// a change (of health, of use) or a slow retry can help.
const REPUBLISH_REFUSED_AFTER: Duration = Duration::from_secs(60);

/// Flags of `gpushare dra-plugin`: the node agent's ([`NodeArgs`], three of them worded for
/// the DRA path) and the DRA side's (each overrides its `[dra]`, `[node]`, `[gpu]`,
/// `[devices]` or `[doctor]` key).
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
#[command(
    mut_arg("node_name", |a| a.help("This node's name (the pool's name) [env: NODE_NAME]")),
    mut_arg("visible_devices", |a| a
        .help("The GPU's name given to the container (NVIDIA_VISIBLE_DEVICES) [default: index]")
        .visible_alias(None)),
    mut_arg("health_check", |a| a.help("Watch XID errors and taint unhealthy GPUs [default: true]")),
)]
pub struct Args {
    /// The node agent's flags.
    #[command(flatten)]
    #[serde(skip)]
    pub node: NodeArgs,
    /// The DRA driver name [default: gpushare.io]
    #[arg(long, value_name = "NAME")]
    pub driver_name: Option<String>,
    /// kubelet's plugin registry directory (<driver>-reg.sock)
    /// [default: /var/lib/kubelet/plugins_registry]
    #[arg(long, value_name = "DIR")]
    pub registry_dir: Option<PathBuf>,
    /// The plugin's directory (dra.sock) [default: /var/lib/kubelet/plugins/<driver>]
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Where the checkpoint of prepared claims is kept; keep it as short-lived as --cdi-dir
    /// [default: /var/run/gpushare/<driver>]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Where each prepared claim's CDI spec is written [default: /var/run/cdi]
    #[arg(long, value_name = "DIR")]
    pub cdi_dir: Option<PathBuf>,
    /// Device order in the slice: binpack (least free memory first: best fit) or spread (most
    /// free first) [default: binpack]
    #[arg(long, value_enum)]
    pub gpu_policy: Option<GpuPolicy>,
    /// Address of /healthz, /readyz and /metrics; empty disables them [default: 0.0.0.0:9102]
    #[arg(long, value_name = "ADDR")]
    pub admin_address: Option<String>,
    /// Do not run the node preflight (doctor) before starting
    #[arg(long)]
    #[serde(rename = "doctor.skip", skip_serializing_if = "std::ops::Not::not")]
    pub skip_doctor: bool,
}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, flags: &mut FlagOverrides) {
        self.node.overrides(flags);
        flags.args("dra", self);
    }
}

/// Runs the DRA plugin on `agent` until `shutdown` (SIGTERM/SIGINT). The dispatcher has run the
/// preflight and started the agent.
pub async fn run(
    _args: Args,
    config: &Config,
    agent: Arc<NodeAgent>,
    shutdown: Shutdown,
) -> anyhow::Result<ExitCode> {
    let handle = serve(config, agent, shutdown.clone()).await?;
    tracing::info!(socket = %handle.service_socket().display(), "DRA plugin serving");
    shutdown.wait().await;
    handle.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// What the publisher knows of each GPU apart from health and use.
#[derive(Clone, Debug)]
struct GpuFacts {
    gpus: Vec<SliceGpu>,
    driver_version: Option<String>,
    /// The devices of the other kinds, published after the GPUs.
    others: Vec<KindDevice>,
}

/// The role's state shared by its tasks.
struct Role {
    dra: DraConfig,
    node: String,
    unit: MemoryUnit,
    client: kube::Client,
    facts: GpuFacts,
    served: watch::Sender<Served>,
    generation: watch::Sender<i64>,
    events: crate::node::publish::NodeEvents,
    metrics: DraMetrics,
}

impl Role {
    /// What the plugin serves now: every GPU (those held back named so), the other kinds.
    fn served_now(&self, gpus: &[SliceGpu], offer: &Offer) -> Served {
        let mut served = Served::from_gpus(gpus, self.unit).with_kinds(&self.facts.others);
        for g in gpus {
            if let Some(why) = offer.held_back.get(&g.index) {
                served.held_back.insert(device_name(g), why.clone());
            }
        }
        served
    }

    /// The GPUs as the slice shows them now (all of them, held back ones included; the slice
    /// leaves those out).
    fn slice_gpus(&self, view: &HealthView, allocated: &BTreeMap<String, u64>) -> Vec<SliceGpu> {
        self.facts
            .gpus
            .iter()
            .map(|g| {
                let mut g = g.clone();
                // The taint's value and the health message: `xid-79`, `gpu-lost` (a GPU the
                // view does not know is down as `unknown`).
                g.unhealthy = (!view.is_healthy(&g.uuid))
                    .then(|| view.reason(&g.uuid).unwrap_or("unknown").to_string());
                g.allocated_bytes = allocated.get(&device_name(&g)).copied().unwrap_or(0);
                g
            })
            .collect()
    }
}

/// A running DRA plugin.
pub struct DraPluginHandle {
    role: Arc<Role>,
    agent: Arc<NodeAgent>,
    gate: Option<PathGate>,
    plugin: Option<RunningPlugin>,
    stop: crate::shutdown::Trigger,
    tasks: Vec<JoinHandle<()>>,
    admin_addr: Option<std::net::SocketAddr>,
    admin: Arc<AdminState>,
    metrics: DraMetrics,
    node: Arc<NodeMonitor>,
    sockets: [PathBuf; 2],
    own_agent: Option<NodeAgentHandle>,
}

impl std::fmt::Debug for DraPluginHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraPluginHandle")
            .field("node", &self.role.node)
            .field("sockets", &self.sockets)
            .finish_non_exhaustive()
    }
}

impl DraPluginHandle {
    /// `<registry_dir>/<driver>-reg.sock`.
    pub fn registration_socket(&self) -> &Path {
        &self.sockets[0]
    }

    /// `<plugin_dir>/dra.sock`.
    pub fn service_socket(&self) -> &Path {
        &self.sockets[1]
    }

    /// The admin server's address, when it runs.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin_addr
    }

    /// Whether `/readyz` answers ready (kubelet accepted the registration and, with MPS, the
    /// daemon serves).
    pub fn is_ready(&self) -> bool {
        self.admin.is_ready()
    }

    /// The metrics of the kubelet side.
    pub fn metrics(&self) -> &DraMetrics {
        &self.metrics
    }

    /// The node metrics (health, the memory-unit refusal, MPS).
    pub fn node_metrics(&self) -> &NodeMetrics {
        self.node.metrics()
    }

    /// The metrics in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        self.admin.render_metrics()
    }

    /// Settles the checkpoint against the API and the CDI directory now (a start does it once
    /// in the background).
    pub async fn reconcile(&self) -> Reconciled {
        match &self.plugin {
            Some(p) => p.reconcile().await,
            None => Reconciled::default(),
        }
    }

    /// The devices served now (names, health) as the plugin checks claims against them.
    pub fn served(&self) -> watch::Receiver<Served> {
        self.role.served.subscribe()
    }

    /// The pool generation of the last publication that landed (0 before the first).
    pub fn published_generation(&self) -> watch::Receiver<i64> {
        self.role.generation.subscribe()
    }

    /// The node agent it serves.
    pub fn agent(&self) -> &Arc<NodeAgent> {
        &self.agent
    }

    /// What the path's gate offers now, and every change after (the slice publishes the GPUs
    /// offered).
    pub fn offer(&self) -> Option<watch::Receiver<Offer>> {
        self.gate.as_ref().map(PathGate::offer)
    }

    /// Stops serving, removes the sockets, gives the GPUs back to the agent (and stops the
    /// agent when [`start`] built it). The slices stay.
    pub async fn stop(mut self) {
        self.stop.trigger();
        for task in std::mem::take(&mut self.tasks) {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        drop(self.plugin.take());
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
        if let Some(gate) = self.gate.take() {
            gate.close().await;
        }
        self.agent.withdraw(ServingPath::Dra);
        if let Some(agent) = self.own_agent.take() {
            agent.stop().await;
        }
    }
}

/// Starts the DRA plugin in-process with a node agent of its own (the integration tests,
/// `gpushare demo --dra`); the agent stops with the plugin.
pub async fn start(
    config: &Config,
    client: kube::Client,
    backend: Arc<dyn crate::gpu::GpuBackend>,
    shutdown: Shutdown,
) -> anyhow::Result<DraPluginHandle> {
    let (mut handle, agent) = crate::node::serve_on_own_agent(
        config,
        crate::node::NodeWrites::ReadOnly,
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

/// What the DRA plugin reads before the agent publishes anything: the device kinds beside
/// the GPUs that `[devices]` enables (RDMA HCAs, generic devices), published after them.
pub fn admit(config: &Config, prepared: PreparedAgent) -> anyhow::Result<PreparedAgent> {
    prepared
        .enforcement()
        .admit(ServingPath::Dra)
        .map_err(crate::failure::config)?;
    Ok(prepared
        .with_devices(&config.devices)
        .with_fatal_xid_record(config.dra.state_dir().join(FATAL_XIDS_FILE)))
}

/// Serves the agent's GPUs on the DRA path (see the module docs). Returns once the sockets are
/// served and the first slice publication was tried.
pub async fn serve(
    config: &Config,
    agent: Arc<NodeAgent>,
    shutdown: Shutdown,
) -> anyhow::Result<DraPluginHandle> {
    let dra = config.dra.clone();
    let gate = agent
        .open_path(
            ServingPath::Dra,
            GateSettings {
                dra_driver: dra.driver_name.clone(),
            },
            shutdown.clone(),
        )
        .await;
    let gpus = agent.gpus().to_vec();
    match serve_gated(config, dra, agent.clone(), gpus, &gate, shutdown).await {
        Ok(mut handle) => {
            handle.gate = Some(gate);
            Ok(handle)
        }
        Err(e) => {
            gate.close().await;
            agent.withdraw(ServingPath::Dra);
            Err(e)
        }
    }
}

/// What the slices publish of the node's served `gpus`: each with the inventory's name,
/// memory and PCIe place; a GPU too small for the memory unit is left out, with an error
/// logged and a Warning Event.
async fn gpu_facts(
    config: &Config,
    agent: &NodeAgent,
    gpus: &[crate::node::gpus::ServedGpu],
) -> anyhow::Result<GpuFacts> {
    let inventory = crate::gpu::inventory_off_runtime(agent.backend()).await?;
    let unit = agent.unit();
    let (slice_gpus, too_small): (Vec<SliceGpu>, Vec<SliceGpu>) = gpus
        .iter()
        .map(|g| {
            let found = inventory.devices.iter().find(|d| d.uuid == g.uuid);
            SliceGpu {
                index: g.index,
                uuid: g.uuid.clone(),
                product_name: found.map(|d| d.name.clone()).unwrap_or_default(),
                memory_bytes: found.map_or(unit.to_bytes(g.units), |d| d.memory_bytes),
                place: found.filter(|d| !d.pci_bus_id.is_empty()).and_then(|d| {
                    crate::pcie::PciLocation::of_bus_id(&config.devices.sysfs_root, &d.pci_bus_id)
                        .ok()
                }),
                unhealthy: None,
                allocated_bytes: 0,
            }
        })
        .partition(|g| super::slices::holds_enough_units(g.memory_bytes, unit));
    for g in &too_small {
        let message = format!(
            "GPU {} ({}) holds {} MiB, fewer than {} units of {unit}: the API server would refuse \
             the node's slice (min + step <= value), so it is not published; pick a finer \
             --memory-unit (gpushare doctor --dra names one that fits)",
            g.index,
            g.uuid,
            g.memory_bytes >> 20,
            crate::core::wire::DRA_MIN_UNITS_PER_GPU
        );
        tracing::error!("{message}");
        agent
            .events()
            .warn("Publish", "GpuShareGpuTooSmall", &message)
            .await;
    }
    Ok(GpuFacts {
        gpus: slice_gpus,
        driver_version: (!inventory.driver_version.is_empty())
            .then(|| inventory.driver_version.clone()),
        others: kind_devices(agent.device_kinds()),
    })
}

async fn serve_gated(
    config: &Config,
    dra: DraConfig,
    agent: Arc<NodeAgent>,
    gpus: Vec<crate::node::gpus::ServedGpu>,
    gate: &PathGate,
    shutdown: Shutdown,
) -> anyhow::Result<DraPluginHandle> {
    let facts = gpu_facts(config, &agent, &gpus).await?;
    let unit = agent.unit();
    let mut health = agent.health();
    let view = health.borrow_and_update().clone();
    let mut offer = gate.offer();
    let offered = offer.borrow_and_update().clone();
    let (served, served_rx) = watch::channel(Served::default());
    let admin = AdminState::new();
    let metrics = DraMetrics::new(&admin);
    let role = Arc::new(Role {
        node: agent.node_name().to_string(),
        unit,
        client: agent.client().clone(),
        facts,
        served,
        generation: watch::Sender::new(0),
        dra: dra.clone(),
        events: agent.events().clone(),
        metrics: metrics.clone(),
    });
    role.served
        .send_replace(role.served_now(&role.slice_gpus(&view, &BTreeMap::new()), &offered));

    let (stop_trigger, stop) = shutdown.child();
    let plugin_config = PluginConfig {
        driver: dra.driver_name.clone(),
        node: role.node.clone(),
        registry_dir: dra.registry_dir.clone(),
        plugin_dir: dra.plugin_dir(),
        checkpoint: dra.state_dir().join(CHECKPOINT_FILE),
        unit,
    };
    let sockets = [
        plugin_config.registration_socket(),
        plugin_config.service_socket(),
    ];
    reconcile_limiter(&agent, &plugin_config.checkpoint).await;
    let preparer = cdi_preparer(&agent, &dra, gpus);
    let node = NodeMonitor::new(agent.clone(), admin.clone(), NodeRole::DraPlugin);
    let hooks = PluginHooks {
        metrics: Some(metrics.clone()),
        node: Some(node.clone()),
    };
    let plugin = match super::plugin::start_with(
        plugin_config,
        role.client.clone(),
        served_rx,
        Arc::new(preparer),
        hooks,
        stop.clone(),
    ) {
        Ok(p) => p,
        Err(e) => {
            stop_trigger.trigger();
            return Err(e.into());
        }
    };
    agent.enforcement().status().register(&admin);
    let registration = plugin.registration();
    let (allocated_tx, allocated_rx) = watch::channel(BTreeMap::new());
    let mut tasks = vec![
        node.follow(stop.clone()),
        follow_registration(registration, node.clone(), metrics.clone(), stop.clone()),
        tokio::spawn(watch_claims(role.clone(), allocated_tx, stop.clone())),
    ];
    tasks.push(tokio::spawn(publish_loop(
        role.clone(),
        health,
        allocated_rx,
        offer,
        agent.enforcement().status().watch(),
        stop.clone(),
    )));
    let admin_addr = match crate::admin::serve(
        &dra.admin_address,
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
            stop_trigger.trigger();
            return Err(e);
        }
    };
    Ok(DraPluginHandle {
        role,
        agent,
        gate: None,
        plugin: Some(plugin),
        stop: stop_trigger,
        tasks,
        admin_addr,
        admin,
        metrics,
        node,
        sockets,
        own_agent: None,
    })
}

/// What makes a claim's shares reach its containers on the DRA path: one CDI spec per claim
/// over the node agent's container contract, for the served `gpus` and the device kinds.
fn cdi_preparer(
    agent: &NodeAgent,
    dra: &DraConfig,
    gpus: Vec<crate::node::gpus::ServedGpu>,
) -> CdiPreparer {
    CdiPreparer::new(
        agent.config().clone(),
        agent.traits(),
        gpus,
        &dra.driver_name,
        &dra.cdi_dir,
    )
    .with_kinds(agent.device_kinds().clone())
    .with_enforcement(agent.enforcement().clone())
}

/// Follows kubelet's answers to the registration: the `registered` gauge and the node
/// monitor's readiness of the role, until `stop`.
fn follow_registration(
    mut registration: watch::Receiver<Option<RegistrationStatus>>,
    node: Arc<NodeMonitor>,
    metrics: DraMetrics,
    stop: Shutdown,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let stop_fut = stop.wait();
        tokio::pin!(stop_fut);
        loop {
            let ok = registration
                .borrow_and_update()
                .as_ref()
                .is_some_and(|s| s.plugin_registered);
            metrics.registered.set(i64::from(ok));
            node.set_role_ready(ok);
            tokio::select! {
                _ = &mut stop_fut => return,
                r = registration.changed() => if r.is_err() { return },
            }
        }
    })
}

/// Follows the ResourceClaims allocated on this node's pool for the driver
/// ([`super::claim_watch`]), each device's whole memory as the slice publishes it.
async fn watch_claims(
    role: Arc<Role>,
    allocated: watch::Sender<BTreeMap<String, u64>>,
    stop: Shutdown,
) {
    let whole: BTreeMap<String, u64> = role
        .facts
        .gpus
        .iter()
        .map(|g| {
            (
                device_name(g),
                super::slices::published_memory(g.memory_bytes, role.unit),
            )
        })
        .collect();
    let pool = super::claim_watch::Pool {
        client: role.client.clone(),
        driver: role.dra.driver_name.clone(),
        node: role.node.clone(),
        whole,
    };
    super::claim_watch::watch_allocated(pool, allocated, stop).await;
}

/// The health notes of the served GPUs: for each, the containers whose GPU memory limit the
/// readback found not in force.
fn limit_notes(served: &Served, rows: &[ContainerMemory]) -> BTreeMap<String, String> {
    let mut notes: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.state != LimitState::Enforced) {
        if let Some((name, _)) = served.devices.iter().find(|(_, d)| d.uuid == row.gpu) {
            notes.entry(name.clone()).or_default().push(format!(
                "GPU memory limit {} for {}/{} container {}: {}",
                row.state.as_str(),
                row.namespace,
                row.pod,
                row.container,
                row.detail
            ));
        }
    }
    notes.into_iter().map(|(k, v)| (k, v.join("; "))).collect()
}

/// Publishes the slice on every change of health or use (and the served devices with it);
/// a publication that fails is tried again after [`REPUBLISH_AFTER`]. The slice publishes the
/// GPUs the path's gate offers (`offer`); the served devices carry the enforcement readback's
/// notes (`limits`) into the health messages.
async fn publish_loop(
    role: Arc<Role>,
    mut health: watch::Receiver<Arc<HealthView>>,
    mut allocated: watch::Receiver<BTreeMap<String, u64>>,
    mut offer: watch::Receiver<Offer>,
    mut limits: watch::Receiver<Arc<Vec<ContainerMemory>>>,
    stop: Shutdown,
) {
    let stop_fut = stop.wait();
    tokio::pin!(stop_fut);
    let mut pool = Pool::new();
    let mut pending = None;
    let mut retry_after = REPUBLISH_AFTER;
    let mut last_refusal: Option<String> = None;
    let others: Vec<_> = role
        .facts
        .others
        .iter()
        .map(KindDevice::to_device)
        .collect();
    loop {
        let view = health.borrow_and_update().clone();
        let used = allocated.borrow_and_update().clone();
        let offered = offer.borrow_and_update().clone();
        let all = role.slice_gpus(&view, &used);
        let rows = limits.borrow_and_update().clone();
        role.metrics
            .gpus_held_back
            .set(i64::try_from(offered.held_back.len()).unwrap_or(i64::MAX));
        role.served.send_if_modified(|s| {
            let mut next = role.served_now(&all, &offered);
            next.notes = limit_notes(&next, &rows);
            if *s == next {
                false
            } else {
                *s = next;
                true
            }
        });
        // The slice publishes the GPUs the gate offers only.
        let gpus: Vec<SliceGpu> = all
            .into_iter()
            .filter(|g| offered.is_offered(g.index))
            .collect();
        if let Some(slices) = pool.update(
            &role.node,
            &role.dra.driver_name,
            role.facts.driver_version.as_deref(),
            role.unit,
            role.dra.gpu_policy,
            &gpus,
            &others,
        ) {
            pending = Some((pool.generation(), slices));
        }
        if let Some((generation, slices)) = &pending {
            match super::publish::sync_slices(
                &role.client,
                &role.node,
                &role.dra.driver_name,
                slices,
            )
            .await
            {
                Ok(done) => {
                    tracing::debug!(generation, ?done, "ResourceSlice published");
                    role.generation.send_replace(*generation);
                    pending = None;
                    last_refusal = None;
                }
                Err(crate::node::api::ApiCallError::Kube(ref e))
                    if crate::k8s::write::refused_for_certain(e) =>
                {
                    let message = format!(
                        "the API server refused the ResourceSlices of node {} (pool generation \
                         {generation}): {e}",
                        role.node
                    );
                    if last_refusal.as_deref() != Some(message.as_str()) {
                        tracing::error!("{message}");
                        role.events
                            .warn("Publish", "GpuShareSliceRefused", &message)
                            .await;
                        last_refusal = Some(message);
                    }
                    retry_after = REPUBLISH_REFUSED_AFTER;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot publish the ResourceSlice (retrying)");
                    retry_after = REPUBLISH_AFTER;
                }
            }
        }
        let retry = async {
            if pending.is_some() {
                tokio::time::sleep(retry_after).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = &mut stop_fut => return,
            r = health.changed() => if r.is_err() { return },
            r = allocated.changed() => if r.is_err() { return },
            r = offer.changed() => if r.is_err() { return },
            r = limits.changed() => if r.is_err() { return },
            _ = retry => {}
        }
    }
}

/// Before the plugin serves: the CUDA memory limiter's files of claims the checkpoint does not
/// hold (unprepared while no plugin ran) are removed.
async fn reconcile_limiter(agent: &Arc<NodeAgent>, checkpoint: &std::path::Path) {
    let (agent, checkpoint) = (agent.clone(), checkpoint.to_path_buf());
    let done = tokio::task::spawn_blocking(move || {
        let prepared = super::checkpoint::Checkpoint::load(&checkpoint).ok()?;
        let keep = prepared.claims.keys().cloned().collect();
        Some(agent.enforcement().limiter().release_claims_except(&keep))
    })
    .await;
    match done {
        Ok(Some(Ok(n))) if n > 0 => {
            tracing::info!(
                shares = n,
                "removed the limiter files of claims no longer prepared"
            )
        }
        Ok(Some(Err(e))) => {
            tracing::warn!(error = %e, "could not remove the limiter files of claims no longer prepared")
        }
        _ => {}
    }
}
