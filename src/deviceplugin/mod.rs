//! `gpushare device-plugin`: the kubelet device plugin, a drop-in for Aliyun's
//! gpushare-device-plugin (reference spec §5) without its known failures.
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
//! - tracks GPU health from XID events with recovery ([`health`]) and publishes
//!   `aliyun.com/gpu-count`, `gpushare.io/devices` and `gpushare.io/memory-unit` on the node
//!   ([`node`]);
//! - serves `/healthz`, `/readyz`, `/metrics` on `device_plugin.admin_address` ([`crate::admin::serve`]);
//! - with `--mps`, runs and supervises the CUDA MPS control daemon ([`mps`]): ready and
//!   answering Allocate only while the daemon answers.
//!
//! It does not choose GPUs (the extender does) and does not isolate memory unless `--mps`.
//!
//! [`start`] is the in-process entry used by `run`, the integration tests and `gpushare demo`.
// Off unix the socket code is left out (see no_unix_sockets), so much of the rest is unused.
#![cfg_attr(not(unix), allow(dead_code))]

pub mod allocate;
pub mod api;
pub mod devices;
pub mod handover;
pub mod health;
pub mod matching;
pub mod metrics;
mod mps;
#[cfg(not(unix))]
mod no_unix_sockets;
pub mod node;
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
mod service;
mod unit_change;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::admin::AdminState;
use crate::config::{
    AllocateFailure, Config, DeviceListStrategies, DeviceListStrategy, DevicePluginConfig,
    FlagOverrides, VisibleDevices,
};
use crate::core::MemoryUnit;
use crate::core::wire::{DEVICE_PLUGIN_COMPONENT, PLUGIN_SOCKET};
use crate::gpu::GpuBackend;
use crate::k8s::events::Events;
use crate::kubelet_api::deviceplugin::ListAndWatchResponse;
use crate::shutdown::Shutdown;

use devices::ServedGpu;
use health::HealthTracker;
use metrics::Metrics;
use pods::PodStore;
use records::Records;

/// Flags of `gpushare device-plugin` (each overrides its `[device_plugin]`, `[gpu]` or
/// `[doctor]` key). Upstream's flags are accepted: `--memory-unit`, `--health-check`, `--mps`
/// work; the glog flags (`-logtostderr`, `--v=5`, …) and `--query-kubelet` family are
/// accepted and ignored, so upstream manifests keep working.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {
    /// This node's name [env: NODE_NAME]
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// kubelet's device-plugin directory [default: /var/lib/kubelet/device-plugins]
    #[arg(long, value_name = "DIR")]
    pub device_plugin_dir: Option<PathBuf>,
    /// kubelet's pod-resources socket, used when it exists
    /// [default: /var/lib/kubelet/pod-resources/kubelet.sock]
    #[arg(long, value_name = "PATH")]
    pub pod_resources_socket: Option<PathBuf>,
    /// Size of one unit of aliyun.com/gpu-mem: GiB, MiB or a multiple such as 256MiB [default: GiB]
    #[arg(long, value_name = "UNIT")]
    pub memory_unit: Option<MemoryUnit>,
    /// The GPU's name given to the container (NVIDIA_VISIBLE_DEVICES, mount paths, CDI device
    /// names) [default: index]
    #[arg(
        long = "device-id-strategy",
        visible_alias = "visible-devices",
        value_enum
    )]
    pub visible_devices: Option<VisibleDevices>,
    /// How the container gets its GPU; several may be combined (comma-separated or repeated)
    /// [default: envvar]
    #[arg(long, value_enum, value_delimiter = ',', value_name = "STRATEGY")]
    pub device_list_strategy: Vec<DeviceListStrategy>,
    /// CDI kind of the GPUs in the node's CDI specs [default: nvidia.com/gpu]
    #[arg(long, value_name = "VENDOR/CLASS")]
    pub cdi_kind: Option<String>,
    /// Prefix of the CDI annotation key (cdi-annotations) [default: cdi.k8s.io/]
    #[arg(long, value_name = "PREFIX")]
    pub cdi_annotation_prefix: Option<String>,
    /// Directories of the node's CDI specs, comma-separated [default: /etc/cdi,/var/run/cdi]
    #[arg(long, value_delimiter = ',', value_name = "DIR")]
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// Also answer DeviceSpecs for /dev/nvidia<minor>, /dev/nvidiactl, /dev/nvidia-uvm and
    /// /dev/nvidia-uvm-tools (runtimes without the NVIDIA hook)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub pass_device_specs: Option<bool>,
    /// Answer when no pod matches an Allocate: the upstream env convention, or a gRPC error
    /// [default: env]
    #[arg(long, value_enum)]
    pub allocate_failure: Option<AllocateFailure>,
    /// Watch XID errors and report unhealthy GPUs [default: true]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub health_check: Option<bool>,
    /// Seconds without new errors after which a GPU with a transient XID is healthy again
    /// [default: 300]
    #[arg(long, value_name = "SECS")]
    pub health_recovery: Option<u64>,
    /// Memory isolation through CUDA MPS (per-container pinned memory limit)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub mps: Option<bool>,
    /// MPS pipe directory on the host, mounted into containers [default: /tmp/nvidia-mps]
    #[arg(long, value_name = "DIR")]
    pub mps_pipe_dir: Option<PathBuf>,
    /// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for MPS clients and the daemon's default; 0 leaves
    /// it unset
    #[arg(long, value_name = "PERCENT", value_parser = clap::value_parser!(u8).range(0..=100))]
    pub mps_active_thread_percentage: Option<u8>,
    /// The MPS control program the plugin runs [default: nvidia-cuda-mps-control on PATH]
    #[arg(long, value_name = "PATH")]
    pub mps_control: Option<String>,
    /// CUDA_MPS_LOG_DIRECTORY of the daemon [default: /var/log/nvidia-mps]
    #[arg(long, value_name = "DIR")]
    pub mps_log_dir: Option<PathBuf>,
    /// Host directory that is the daemon's /dev/shm, mounted at /dev/shm into MPS clients;
    /// empty: none [default: empty]
    #[arg(long, value_name = "DIR")]
    pub mps_shm_dir: Option<PathBuf>,
    /// The daemon's default pinned memory limit per GPU in MiB, for clients that drop their
    /// own; 0: each GPU's whole memory [default: 0]
    #[arg(long, value_name = "MIB")]
    pub mps_pinned_mem_limit_mib: Option<u64>,
    /// How often the daemon is asked get_server_list, in milliseconds [default: 5000]
    #[arg(long, value_name = "MS")]
    pub mps_check_interval_ms: Option<u64>,
    /// Longest wait between restarts of a failing daemon, in seconds [default: 60]
    #[arg(long, value_name = "SECS")]
    pub mps_restart_backoff_max_secs: Option<u64>,
    /// Address of /healthz, /readyz and /metrics; empty disables them [default: 0.0.0.0:9101]
    #[arg(long, value_name = "ADDR")]
    pub admin_address: Option<String>,
    /// GPU access.
    #[command(flatten)]
    pub gpu: crate::gpu::GpuArgs,
    /// Do not run the node preflight (doctor) before starting
    #[arg(long)]
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
    pub legacy_values: Vec<String>,
}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, flags: &mut FlagOverrides) {
        let dp = |k: &str| format!("device_plugin.{k}");
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        flags.set(&dp("node_name"), self.node_name.clone());
        flags.set(&dp("device_plugin_dir"), path(&self.device_plugin_dir));
        flags.set(
            &dp("pod_resources_socket"),
            path(&self.pod_resources_socket),
        );
        flags.set(&dp("memory_unit"), self.memory_unit);
        flags.set(&dp("device_id_strategy"), self.visible_devices);
        if !self.device_list_strategy.is_empty() {
            let list = DeviceListStrategies::new(self.device_list_strategy.iter().copied());
            flags.set(&dp("device_list_strategy"), Some(list.to_string()));
        }
        flags.set(&dp("cdi_kind"), self.cdi_kind.clone());
        flags.set(
            &dp("cdi_annotation_prefix"),
            self.cdi_annotation_prefix.clone(),
        );
        if !self.cdi_spec_dirs.is_empty() {
            let dirs: Vec<String> = self
                .cdi_spec_dirs
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            flags.set(&dp("cdi_spec_dirs"), Some(dirs));
        }
        flags.set(&dp("pass_device_specs"), self.pass_device_specs);
        flags.set(&dp("allocate_failure"), self.allocate_failure);
        flags.set(&dp("health_check"), self.health_check);
        flags.set(&dp("health_recovery_secs"), self.health_recovery);
        flags.set(&dp("mps"), self.mps);
        flags.set(&dp("mps_pipe_dir"), path(&self.mps_pipe_dir));
        flags.set(
            &dp("mps_active_thread_percentage"),
            self.mps_active_thread_percentage,
        );
        flags.set(&dp("mps_control"), self.mps_control.clone());
        flags.set(&dp("mps_log_dir"), path(&self.mps_log_dir));
        flags.set(&dp("mps_shm_dir"), path(&self.mps_shm_dir));
        flags.set(
            &dp("mps_pinned_mem_limit_mib"),
            self.mps_pinned_mem_limit_mib,
        );
        flags.set(&dp("mps_check_interval_ms"), self.mps_check_interval_ms);
        flags.set(
            &dp("mps_restart_backoff_max_secs"),
            self.mps_restart_backoff_max_secs,
        );
        flags.set(&dp("admin_address"), self.admin_address.clone());
        self.gpu.overrides(flags);
        flags.set_flag("doctor.skip", self.skip_doctor);
    }
}

/// The settings without which the device plugin cannot start (the node name), checked before
/// the preflight so the message names the missing setting.
pub fn check_required(config: &Config) -> anyhow::Result<()> {
    anyhow::ensure!(
        !config.device_plugin.node_name.trim().is_empty(),
        "device-plugin: the node name is required: pass --node-name or set NODE_NAME \
         (in a DaemonSet: env NODE_NAME from fieldRef spec.nodeName)"
    );
    Ok(())
}

/// Runs the device plugin until SIGTERM/SIGINT. The dispatcher has run the preflight.
pub async fn run(_args: Args, config: Config) -> anyhow::Result<ExitCode> {
    check_required(&config)?;
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
    let (trigger, _) = crate::shutdown::channel();
    let shutdown = crate::shutdown::on_signals(trigger);
    let handle = start(&config, client, backend, shutdown.clone()).await?;
    tracing::info!(socket = %handle.socket_path().display(), "device plugin serving");
    shutdown.wait().await;
    handle.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// One container allocation the plugin answered: which device IDs kubelet passed, which GPU
/// the container was given (its `NVIDIA_VISIBLE_DEVICES`), and the pod it was matched to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationRecord {
    /// UID of the pod matched.
    pub uid: String,
    /// The device IDs of the Allocate container request.
    pub device_ids: Vec<String>,
    /// The GPU handed out.
    pub gpu_index: u32,
    /// Namespace of the pod matched.
    pub namespace: String,
    /// Name of the pod matched.
    pub name: String,
    /// Container matched.
    pub container: String,
}

/// State shared by the gRPC service, the health task, the reconciler and the serve loop.
pub(crate) struct Plugin {
    pub(crate) config: DevicePluginConfig,
    pub(crate) node: String,
    pub(crate) node_uid: String,
    pub(crate) cgpu_disable: bool,
    pub(crate) client: kube::Client,
    /// The Event publisher (events.k8s.io/v1, repeats aggregated).
    pub(crate) events: Events,
    pub(crate) backend: Arc<dyn GpuBackend>,
    pub(crate) gpus: Vec<ServedGpu>,
    pub(crate) health: std::sync::Mutex<HealthTracker>,
    pub(crate) devices_tx: watch::Sender<Arc<ListAndWatchResponse>>,
    pub(crate) pods: PodStore,
    /// The allocations answered, by pod UID. Held for in-memory steps only, never across an
    /// await.
    pub(crate) records: std::sync::Mutex<Records>,
    /// One lock per pod, held across that pod's annotation PATCH (Allocate and the reconcile
    /// never write the same pod at once; other pods are not held up).
    pub(crate) pod_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(crate) reconcile_now: Notify,
    /// What the reconciler has reported already.
    pub(crate) reported: std::sync::Mutex<reconcile::Reported>,
    pub(crate) metrics: Metrics,
    pub(crate) admin: Arc<AdminState>,
    /// With `--mps`: whether the MPS control daemon serves (kept by [`mps::Supervisor`]).
    pub(crate) mps: Option<Arc<mps::MpsStatus>>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("node", &self.node)
            .field("gpus", &self.gpus)
            .field("socket", &self.socket_path())
            .finish_non_exhaustive()
    }
}

impl Plugin {
    pub(crate) fn records(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock of pod `uid`'s annotation writes.
    pub(crate) fn pod_lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.pod_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(uid.to_string()).or_default().clone()
    }

    /// Forgets the locks of pods that have no records and that nobody holds.
    pub(crate) fn prune_pod_locks(&self) {
        let records = self.records();
        let mut locks = self.pod_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.retain(|uid, lock| records.pod(uid).is_some() || Arc::strong_count(lock) > 1);
    }

    /// Every allocation answered, oldest first.
    pub(crate) fn allocation_records(&self) -> Vec<AllocationRecord> {
        let records = self.records();
        let mut out: Vec<(u64, AllocationRecord)> = records
            .pods()
            .flat_map(|(uid, pod)| {
                pod.containers.iter().map(move |c| {
                    (
                        c.seq,
                        AllocationRecord {
                            uid: uid.clone(),
                            device_ids: c.device_ids.clone(),
                            gpu_index: c.gpu_index,
                            namespace: pod.namespace.clone(),
                            name: pod.name.clone(),
                            container: c.container.clone(),
                        },
                    )
                })
            })
            .collect();
        out.sort_by_key(|(seq, _)| *seq);
        out.into_iter().map(|(_, r)| r).collect()
    }

    pub(crate) fn gpu_by_index(&self, index: u32) -> Option<&ServedGpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    pub(crate) fn gpu_by_uuid(&self, uuid: &str) -> Option<&ServedGpu> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// Re-sends the device list (after a health change).
    pub(crate) fn refresh_devices(&self) {
        let tracker = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let msg = devices::list_and_watch_response(&self.gpus, |u| tracker.is_healthy(u));
        self.metrics
            .unhealthy_gpus
            .set(i64::try_from(tracker.unhealthy().len()).unwrap_or(i64::MAX));
        drop(tracker);
        self.devices_tx.send_replace(Arc::new(msg));
    }

    pub(crate) fn socket_path(&self) -> PathBuf {
        self.config.device_plugin_dir.join(PLUGIN_SOCKET)
    }

    /// Ready while registered with kubelet and, with `--mps`, while the MPS daemon serves.
    pub(crate) fn update_ready(&self) {
        let registered = self.metrics.registered.get() == 1;
        let mps = self.mps.as_ref().is_none_or(|m| m.serving());
        self.admin.set_ready(registered && mps);
    }
}

/// A running device plugin.
#[derive(Debug)]
pub struct DevicePluginHandle {
    plugin: Arc<Plugin>,
    stop: Arc<crate::shutdown::Trigger>,
    tasks: Vec<JoinHandle<()>>,
    admin_addr: Option<std::net::SocketAddr>,
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

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.plugin.metrics
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

    /// Stops serving, ends the ListAndWatch streams and removes the socket.
    pub async fn stop(self) {
        self.stop.trigger();
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        let _ = std::fs::remove_file(self.plugin.socket_path());
    }
}

/// Starts the device plugin in-process: reads the node and the GPUs, checks the message size,
/// publishes the node facts, starts the pod watch, the gRPC server (with kubelet registration
/// and restart handling), the health task, the reconciler and the admin server. Returns once
/// the socket is served; registration continues in the background until it succeeds.
pub async fn start(
    config: &Config,
    client: kube::Client,
    backend: Arc<dyn GpuBackend>,
    shutdown: Shutdown,
) -> anyhow::Result<DevicePluginHandle> {
    let mut dp = config.device_plugin.clone();
    let node = dp.node_name.trim().to_string();
    anyhow::ensure!(
        !node.is_empty(),
        "the node name is required (--node-name or NODE_NAME)"
    );
    let inventory = crate::gpu::inventory_off_runtime(&backend)
        .await
        .map_err(|e| anyhow::anyhow!("reading the GPUs: {e}"))?;
    for g in &inventory.excluded {
        tracing::warn!(index = g.index, uuid = %g.uuid, reason = %g.reason, "GPU not offered");
    }
    anyhow::ensure!(
        !inventory.devices.is_empty(),
        "the {} backend found no GPU to share on this node{}",
        inventory.backend,
        inventory
            .excluded
            .iter()
            .map(|g| format!("; GPU {} {}: {}", g.index, g.uuid, g.reason))
            .collect::<String>()
    );
    let facts = node::read_node(&client, &node).await?;
    let unit =
        unit_change::decide(&client, &node, facts.memory_unit.as_deref(), dp.memory_unit).await?;
    dp.memory_unit = unit.unit;
    devices::check_message_size(&inventory, dp.memory_unit)?;
    let gpus = devices::served_gpus(&inventory, dp.memory_unit);
    node::publish_gpu_count(&client, &node, gpus.len()).await?;
    node::publish_devices(
        &client,
        &node,
        &node::device_annotations(&gpus, dp.memory_unit, |_| true),
    )
    .await?;
    node::publish_devices(
        &client,
        &node,
        &node::excluded_annotation(&inventory.excluded),
    )
    .await?;

    let admin = AdminState::new();
    let metrics = Metrics::new(&admin);
    let tracker = HealthTracker::new(
        gpus.iter().map(|g| g.uuid.clone()),
        Duration::from_secs(dp.health_recovery_secs),
    );
    let mps = dp.mps.then(|| {
        let mut control =
            crate::gpu::mps::MpsControl::new(&dp.mps_control, &dp.mps_pipe_dir, &dp.mps_log_dir);
        // The daemon gets the GPUs this plugin serves (not, say, a MIG GPU left out).
        control.visible_devices = gpus.iter().map(|g| g.uuid.clone()).collect();
        Arc::new(mps::MpsStatus::new(control))
    });
    let first = devices::list_and_watch_response(&gpus, |_| true);
    let (devices_tx, _) = watch::channel(Arc::new(first));
    let plugin = Arc::new(Plugin {
        config: dp.clone(),
        node: node.clone(),
        node_uid: facts.uid,
        cgpu_disable: facts.cgpu_disable,
        client: client.clone(),
        events: Events::new(client.clone(), DEVICE_PLUGIN_COMPONENT, &node),
        backend: backend.clone(),
        gpus,
        health: std::sync::Mutex::new(tracker),
        devices_tx,
        pods: PodStore::default(),
        records: std::sync::Mutex::default(),
        pod_locks: std::sync::Mutex::default(),
        reconcile_now: Notify::new(),
        reported: std::sync::Mutex::default(),
        metrics,
        admin: admin.clone(),
        mps,
    });

    if let Some(refused) = &unit.refused {
        tracing::error!("{refused}");
        plugin.metrics.memory_unit_change_refused.set(1);
        node::warn_event(
            &plugin.events,
            &node,
            &plugin.node_uid,
            "Start",
            "GpuShareMemoryUnitChangeRefused",
            refused,
        )
        .await;
    }

    // One internal stop that fires on the caller's shutdown or on `stop()`.
    let (stop_trigger, stop) = shutdown.child();
    let stop_trigger = Arc::new(stop_trigger);
    let mut tasks = Vec::new();
    // The MPS daemon answers (or is known not to) before kubelet can call Allocate.
    if let Some(status) = &plugin.mps {
        let mut supervisor = mps::Supervisor::new(plugin.clone(), status.clone());
        supervisor.first_contact().await;
        tasks.push(tokio::spawn(supervisor.run(stop.clone())));
    }
    tasks.push(tokio::spawn(plugin.pods.clone().run(
        client.clone(),
        node.clone(),
        stop.clone(),
    )));
    let served = match registration::serve(plugin.clone(), stop.clone()).await {
        Ok(task) => task,
        Err(e) => {
            stop_trigger.trigger();
            return Err(e);
        }
    };
    tasks.push(served);
    if dp.health_check {
        match backend.watch_health() {
            Ok(rx) => tasks.push(tokio::spawn(health_task(plugin.clone(), rx, stop.clone()))),
            Err(e) => tracing::warn!(error = %e, "GPU health events unavailable; health check off"),
        }
    }
    tasks.push(tokio::spawn(reconcile::run(plugin.clone(), stop.clone())));
    let admin_addr = if dp.admin_address.trim().is_empty() {
        None
    } else {
        match crate::admin::serve(
            dp.admin_address.trim(),
            admin.clone(),
            "not registered with kubelet, or (with --mps) the MPS control daemon does not answer",
            crate::http_server::Limits::from_config(&config.http),
            stop.clone(),
        )
        .await
        {
            Ok((addr, task)) => {
                tasks.push(task);
                Some(addr)
            }
            Err(e) => {
                // Stops the tasks started so far (and removes the plugin socket).
                stop_trigger.trigger();
                return Err(e);
            }
        }
    };
    Ok(DevicePluginHandle {
        plugin,
        stop: stop_trigger,
        tasks,
        admin_addr,
    })
}

/// Applies health events and recoveries until `stop`.
async fn health_task(
    plugin: Arc<Plugin>,
    mut events: tokio::sync::mpsc::Receiver<crate::gpu::HealthEvent>,
    stop: Shutdown,
) {
    let stop_fut = stop.wait();
    tokio::pin!(stop_fut);
    let mut events_open = true;
    loop {
        let next = plugin
            .health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .next_recovery();
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
                    plugin.metrics.unattributed_xids.inc();
                    Vec::new()
                }
                Some(ev) => {
                    tracing::info!(event = ?ev, "GPU health event");
                    plugin.health.lock().unwrap_or_else(|p| p.into_inner())
                        .apply(&ev, tokio::time::Instant::now())
                }
                None => { events_open = false; Vec::new() }
            },
            _ = wake => {
                let present: Vec<String> = crate::gpu::inventory_off_runtime(&plugin.backend)
                    .await
                    .map(|inv| inv.devices.into_iter().map(|d| d.uuid).collect())
                    .unwrap_or_default();
                plugin.health.lock().unwrap_or_else(|p| p.into_inner())
                    .recover(tokio::time::Instant::now(), |u| present.iter().any(|p| p == u))
            }
        };
        if changes.is_empty() {
            continue;
        }
        plugin.refresh_devices();
        let annotations = {
            let tracker = plugin.health.lock().unwrap_or_else(|p| p.into_inner());
            node::device_annotations(&plugin.gpus, plugin.config.memory_unit, |u| {
                tracker.is_healthy(u)
            })
        };
        if let Err(e) = node::publish_devices(&plugin.client, &plugin.node, &annotations).await {
            tracing::warn!(error = %e, "could not publish GPU health on the node");
        }
        for change in changes {
            let index = plugin
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
                node::warn_event(
                    &plugin.events,
                    &plugin.node,
                    &plugin.node_uid,
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
