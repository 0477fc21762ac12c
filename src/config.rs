//! Configuration: built-in defaults < TOML file < `GPUSHARE_*` environment < command-line flags.
//!
//! The file is `--config PATH`, else `/etc/gpushare/gpushare.toml` when it exists. Environment
//! variables are `GPUSHARE_<SECTION>__<KEY>` (double underscore between section and key, e.g.
//! `GPUSHARE_EXTENDER__PORT=12345`). The upstream knobs keep working and sit just above the
//! defaults: `PORT` (extender.port), `LOG_LEVEL` (log.level), `NODE_NAME`
//! (device_plugin.node_name), `KUBECONFIG` (cluster.kubeconfig).
//!
//! [`Config`] is the validated, typed result; every section denies unknown keys so a typo is an
//! error, not a silently ignored setting. An error names the key, the source it came from and
//! what is allowed; `main` turns it into exit status 78 (EX_CONFIG).
//!
//! `packaging/gpushare.toml` holds every key with its default; a test keeps it in step.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};

use crate::core::{GpuPolicy, MemoryUnit, NodePolicy};

pub mod devices;
pub mod enforcement;

/// Default configuration file, read when it exists and `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/gpushare/gpushare.toml";
/// Exit status for configuration errors (sysexits EX_CONFIG).
pub const EXIT_CONFIG: u8 = 78;

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Logging.
    pub log: LogConfig,
    /// How to reach the API server.
    pub cluster: ClusterConfig,
    /// `gpushare extender`.
    pub extender: ExtenderConfig,
    /// `gpushare device-plugin` (the kubelet protocol).
    pub device_plugin: DevicePluginConfig,
    /// The GPU node agent: node name, memory unit, hand-over, health, MPS.
    pub node: NodeConfig,
    /// GPU access (device plugin and doctor).
    pub gpu: GpuConfig,
    /// The preflight run before the server roles.
    pub doctor: DoctorConfig,
    /// Deadlines and caps of every HTTP server (extender, admin endpoints).
    pub http: HttpConfig,
    /// `gpushare webhook`.
    pub webhook: WebhookConfig,
    /// Device kinds beside the GPU: RDMA HCAs and generic devices (`[devices]`).
    pub devices: devices::DevicesConfig,
    /// `gpushare dra-plugin` (the DRA kubelet plugin).
    pub dra: DraConfig,
    /// Keys this configuration was given under their old names (not a key itself).
    #[serde(skip)]
    pub deprecated: Vec<DeprecatedKey>,
}

/// Log verbosity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Everything.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    #[default]
    Info,
    /// Problems only.
    Warn,
    /// Failures only.
    Error,
}

/// Log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[log]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// trace | debug | info | warn | error (`RUST_LOG`, when set, wins).
    pub level: LogLevel,
    /// text | json.
    pub format: LogFormat,
}

/// `[cluster]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Kubeconfig file; empty means `KUBECONFIG`, then the in-cluster service account.
    pub kubeconfig: String,
    /// How long a role starting up waits for an unreachable API server (no connection,
    /// timeout, 429, 5xx), in seconds, before it gives up; 0 gives up at once. A refusal
    /// (401, 403) or a broken kubeconfig is never waited for.
    pub api_wait_secs: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            kubeconfig: String::new(),
            api_wait_secs: 300,
        }
    }
}

/// `[extender]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExtenderConfig {
    /// Address to listen on.
    pub bind_address: IpAddr,
    /// Port to listen on (upstream env `PORT`; the upstream manifests use 12345).
    pub port: u16,
    /// URL prefix of the scheduling verbs.
    pub url_prefix: String,
    /// Node scoring in prioritize: binpack | spread.
    pub node_policy: NodePolicy,
    /// GPU choice in bind: binpack (upstream) | spread.
    pub gpu_policy: GpuPolicy,
    /// PEM certificate for HTTPS; empty serves plain HTTP.
    pub tls_cert: String,
    /// PEM private key for HTTPS.
    pub tls_key: String,
    /// PEM CA certificate(s); when set, filter / prioritize / bind / inspect need a client
    /// certificate signed by it (the scheduler's `tlsConfig.certFile`); health, readiness,
    /// version and metrics stay open. Needs `tls_cert`. Re-read when it changes.
    pub tls_client_ca: String,
    /// Largest request body accepted, in bytes (larger gets 413).
    pub max_body_bytes: u64,
    /// Time budget of one bind including retries, in milliseconds (keep it under the
    /// scheduler's `httpTimeout`).
    pub bind_timeout_ms: u64,
    /// How long a Binding whose outcome is unknown (timeout, lost answer) may still land, in
    /// milliseconds: its reservation is kept, and the bind finished, until the API shows the
    /// pod bound, gone or bound elsewhere, or it stays unbound this long (default 60 000, the
    /// API server's own request timeout).
    pub bind_settle_ms: u64,
    /// A watch that keeps failing this long, in milliseconds, makes the ledger stale: the
    /// scheduling verbs and `/readyz` answer 503 until it recovers (default 30 000).
    pub watch_stale_after_ms: u64,
    /// Compete for a Lease; the leader serves the scheduling verbs, the other replicas
    /// forward them to it.
    pub leader_elect: bool,
    /// `HOST[:PORT]` where the other replicas reach this one when it leads; empty means the
    /// `POD_IP` environment variable (else the bind address, when it is not 0.0.0.0) and the
    /// serving port.
    pub advertise_address: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// Namespace of the Lease.
    pub lease_namespace: String,
    /// How long a lease is valid without renewal, in seconds.
    pub lease_duration_secs: u64,
    /// How long the leader keeps trying to renew before it stops serving, in seconds.
    pub renew_deadline_secs: u64,
    /// How often to try to acquire or renew, in seconds.
    pub retry_period_secs: u64,
}

impl Default for ExtenderConfig {
    fn default() -> Self {
        ExtenderConfig {
            bind_address: IpAddr::from([0, 0, 0, 0]),
            port: 39999,
            url_prefix: crate::core::wire::EXTENDER_URL_PREFIX.to_string(),
            node_policy: NodePolicy::Binpack,
            gpu_policy: GpuPolicy::Binpack,
            tls_cert: String::new(),
            tls_key: String::new(),
            tls_client_ca: String::new(),
            max_body_bytes: 32 * 1024 * 1024,
            bind_timeout_ms: 4000,
            bind_settle_ms: 60_000,
            watch_stale_after_ms: 30_000,
            leader_elect: false,
            advertise_address: String::new(),
            lease_name: "gpushare-schd-extender".to_string(),
            lease_namespace: "kube-system".to_string(),
            lease_duration_secs: 15,
            renew_deadline_secs: 10,
            retry_period_secs: 2,
        }
    }
}

/// Which name of a GPU the container is handed (`--device-id-strategy`, formerly
/// `--visible-devices`): in `NVIDIA_VISIBLE_DEVICES`, in the volume-mount paths and in the CDI
/// device name (`nvidia.com/gpu=<UUID>` or `=<index>`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum VisibleDevices {
    /// The NVML index (upstream since AliyunContainerService/gpushare-device-plugin#50).
    #[default]
    Index,
    /// The GPU UUID.
    Uuid,
}

/// The path an `aliyun.com/gpu-mem` pod is served by (`webhook.gpu_mem_path`, and per namespace
/// the label `gpushare.io/gpu-mem-path`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GpuMemPath {
    /// The scheduler extender and the device plugin: the pod keeps its extended resource.
    #[default]
    Extender,
    /// Dynamic Resource Allocation: the webhook rewrites the pod into one ResourceClaim.
    Dra,
}

/// NVIDIA's name for [`VisibleDevices`].
pub type DeviceIdStrategy = VisibleDevices;

/// How a container is told which GPU it has (`--device-list-strategy`, NVIDIA's names).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<id>`, acted on by the NVIDIA runtime (default runtime needed).
    Envvar,
    /// `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` plus one mount per GPU
    /// (`accept-nvidia-visible-devices-as-volume-mounts` in the NVIDIA runtime).
    VolumeMounts,
    /// A `cdi.k8s.io/…` annotation naming the CDI device (containerd 1.7+, CRI-O 1.23+).
    CdiAnnotations,
    /// The `cdi_devices` field of the Allocate answer (kubelet 1.28+ with a CDI runtime).
    CdiCri,
}

impl DeviceListStrategy {
    /// The flag / config spelling.
    pub fn name(self) -> &'static str {
        match self {
            DeviceListStrategy::Envvar => "envvar",
            DeviceListStrategy::VolumeMounts => "volume-mounts",
            DeviceListStrategy::CdiAnnotations => "cdi-annotations",
            DeviceListStrategy::CdiCri => "cdi-cri",
        }
    }

    /// Whether the strategy hands the GPU over through CDI.
    pub fn is_cdi(self) -> bool {
        matches!(
            self,
            DeviceListStrategy::CdiAnnotations | DeviceListStrategy::CdiCri
        )
    }
}

/// A device list strategy that is none of the four.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected envvar, volume-mounts, cdi-annotations or cdi-cri")]
pub struct UnknownStrategy(String);

impl std::str::FromStr for DeviceListStrategy {
    type Err = UnknownStrategy;
    fn from_str(s: &str) -> Result<Self, UnknownStrategy> {
        <Self as clap::ValueEnum>::from_str(s.trim(), true)
            .map_err(|_| UnknownStrategy(s.to_string()))
    }
}

/// One or more [`DeviceListStrategy`]s, combinable as upstream allows: written as a list or a
/// comma-separated string (`"envvar,cdi-cri"`), kept sorted and without repeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceListStrategies(Vec<DeviceListStrategy>);

impl DeviceListStrategies {
    /// The strategies given (sorted, deduplicated; empty is refused by validation).
    pub fn new(list: impl IntoIterator<Item = DeviceListStrategy>) -> Self {
        let mut v: Vec<DeviceListStrategy> = list.into_iter().collect();
        v.sort();
        v.dedup();
        DeviceListStrategies(v)
    }

    /// Whether `s` is one of them.
    pub fn includes(&self, s: DeviceListStrategy) -> bool {
        self.0.contains(&s)
    }

    /// Whether any CDI strategy is on.
    pub fn any_cdi(&self) -> bool {
        self.0.iter().any(|s| s.is_cdi())
    }

    /// Whether only CDI strategies are on (no `NVIDIA_VISIBLE_DEVICES` hand-over).
    pub fn only_cdi(&self) -> bool {
        !self.0.is_empty() && self.0.iter().all(|s| s.is_cdi())
    }

    /// The strategies, sorted.
    pub fn as_slice(&self) -> &[DeviceListStrategy] {
        &self.0
    }
}

impl Default for DeviceListStrategies {
    fn default() -> Self {
        DeviceListStrategies(vec![DeviceListStrategy::Envvar])
    }
}

impl std::fmt::Display for DeviceListStrategies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|s| s.name()).collect();
        f.write_str(&names.join(","))
    }
}

impl Serialize for DeviceListStrategies {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for DeviceListStrategies {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let items = CommaList::deserialize(d)?.0;
        let parsed: Result<Vec<DeviceListStrategy>, UnknownStrategy> =
            items.iter().map(|s| s.parse()).collect();
        parsed
            .map(DeviceListStrategies::new)
            .map_err(serde::de::Error::custom)
    }
}

/// A list written either as a list or as one comma-separated string (what an environment
/// variable or a Helm value can carry); empty items are dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct CommaList(Vec<String>);

impl<'de> Deserialize<'de> for CommaList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            One(String),
            Many(Vec<String>),
        }
        let items = match Form::deserialize(d)? {
            Form::One(s) => s.split(',').map(str::to_string).collect(),
            Form::Many(v) => v,
        };
        Ok(CommaList(
            items
                .into_iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
        ))
    }
}

fn comma_paths<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    Ok(CommaList::deserialize(d)?
        .0
        .into_iter()
        .map(PathBuf::from)
        .collect())
}

/// The kernel log the nvidia-smi backend reads `NVRM: Xid` lines from by default.
pub const DEFAULT_KMSG: &str = "/dev/kmsg";

/// The CDI kind nvidia-ctk and the GPU Operator write for whole GPUs.
pub const DEFAULT_CDI_KIND: &str = "nvidia.com/gpu";
/// The CDI annotation prefix containerd and CRI-O read.
pub const DEFAULT_CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// Where CDI specs live (the CDI specification's defaults; later directories win).
pub const DEFAULT_CDI_SPEC_DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];

/// What Allocate answers when no pod matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AllocateFailure {
    /// The upstream `no-gpu-has-<N><unit>-to-run` env (container start fails in the runtime).
    #[default]
    Env,
    /// A gRPC error that explains which pods were considered.
    Error,
}

/// `[device_plugin]`: the kubelet protocol of `gpushare device-plugin`. The node concerns it
/// held before (node name, memory unit, hand-over strategies, health, MPS) are in `[node]`;
/// their old `device_plugin.<key>` spellings still work ([`NODE_KEYS`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginConfig {
    /// kubelet's device-plugin directory.
    pub device_plugin_dir: PathBuf,
    /// kubelet's pod-resources socket (used when it exists).
    pub pod_resources_socket: PathBuf,
    /// env | error.
    pub allocate_failure: AllocateFailure,
    /// Address of /healthz, /readyz and /metrics; empty disables them.
    pub admin_address: String,
    /// Where Allocate's answers are made durable before they are returned, until the pods'
    /// annotations say so (one file per pod). On tmpfs, as long-lived as the node's
    /// containers; not writable: each answer waits for its write to the API server.
    pub state_dir: PathBuf,
}

/// The device plugin's default state directory (tmpfs).
pub const DEFAULT_DEVICE_PLUGIN_STATE_DIR: &str = "/var/run/gpushare/device-plugin";

impl Default for DevicePluginConfig {
    fn default() -> Self {
        DevicePluginConfig {
            device_plugin_dir: PathBuf::from(crate::core::wire::DEFAULT_DEVICE_PLUGIN_DIR),
            pod_resources_socket: PathBuf::from(crate::core::wire::DEFAULT_POD_RESOURCES_SOCKET),
            allocate_failure: AllocateFailure::Env,
            admin_address: "0.0.0.0:9101".to_string(),
            state_dir: PathBuf::from(DEFAULT_DEVICE_PLUGIN_STATE_DIR),
        }
    }
}

/// `[dra]`: the kubelet side of `gpushare dra-plugin`. The node concerns (node name, memory
/// unit, device-id strategy, health, MPS) are `[node]`, shared with the device plugin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DraConfig {
    /// The DRA driver name (the slices' `driver`, the DeviceClass selects on it).
    pub driver_name: String,
    /// kubelet's plugin registry directory (`<driver_name>-reg.sock` is created there).
    pub registry_dir: PathBuf,
    /// The plugin's own directory (`dra.sock`); empty:
    /// `/var/lib/kubelet/plugins/<driver_name>`.
    pub plugin_dir: PathBuf,
    /// Where the checkpoint of prepared claims is kept (`checkpoint.json`); empty:
    /// `/var/run/gpushare/<driver_name>`. It should live as long as `cdi_dir` (both on tmpfs:
    /// a reboot clears both, and kubelet prepares every claim again).
    pub state_dir: PathBuf,
    /// Where the transient CDI spec of each prepared claim is written.
    pub cdi_dir: PathBuf,
    /// binpack | spread: the order of the devices in the slice (first fit follows it).
    pub gpu_policy: GpuPolicy,
    /// Address of /healthz, /readyz and /metrics; empty disables them.
    pub admin_address: String,
}

impl Default for DraConfig {
    fn default() -> Self {
        DraConfig {
            driver_name: crate::core::wire::DRA_DRIVER_NAME.to_string(),
            registry_dir: PathBuf::from(DEFAULT_DRA_REGISTRY_DIR),
            plugin_dir: PathBuf::new(),
            state_dir: PathBuf::new(),
            cdi_dir: PathBuf::from(DEFAULT_DRA_CDI_DIR),
            gpu_policy: GpuPolicy::Binpack,
            admin_address: "0.0.0.0:9102".to_string(),
        }
    }
}

/// kubelet's plugin registry directory.
pub const DEFAULT_DRA_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The parent of the DRA plugin's own directory (`<this>/<driver>`).
pub const DEFAULT_DRA_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Where prepared claims' transient CDI specs go.
pub const DEFAULT_DRA_CDI_DIR: &str = "/var/run/cdi";
/// The parent of the DRA plugin's state directory (`<this>/<driver>`, the checkpoint).
pub const DEFAULT_DRA_STATE_DIR: &str = "/var/run/gpushare";
/// Where the node roles keep one lock file per GPU (`node.gpu_lock_dir` when empty).
pub const DEFAULT_GPU_LOCK_DIR: &str = "/var/run/gpushare/gpus";

impl DraConfig {
    /// The plugin directory: `plugin_dir`, or `/var/lib/kubelet/plugins/<driver_name>`.
    pub fn plugin_dir(&self) -> PathBuf {
        if self.plugin_dir.as_os_str().is_empty() {
            PathBuf::from(DEFAULT_DRA_PLUGINS_DIR).join(&self.driver_name)
        } else {
            self.plugin_dir.clone()
        }
    }

    /// The state directory: `state_dir`, or `/var/run/gpushare/<driver_name>`.
    pub fn state_dir(&self) -> PathBuf {
        if self.state_dir.as_os_str().is_empty() {
            PathBuf::from(DEFAULT_DRA_STATE_DIR).join(&self.driver_name)
        } else {
            self.state_dir.clone()
        }
    }
}

/// `[node]`: what the GPU node agent (`crate::node`) needs, whichever role serves the GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's name (upstream env `NODE_NAME`); required.
    pub node_name: String,
    /// GiB | MiB | <n>MiB: the size of one unit of aliyun.com/gpu-mem.
    pub memory_unit: MemoryUnit,
    /// index | uuid: the GPU's name in NVIDIA_VISIBLE_DEVICES, mounts and CDI device names.
    pub visible_devices: VisibleDevices,
    /// NVIDIA's name for `visible_devices` (`--device-id-strategy`); when set it wins.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_id_strategy: Option<VisibleDevices>,
    /// envvar | volume-mounts | cdi-annotations | cdi-cri, several comma-separated.
    pub device_list_strategy: DeviceListStrategies,
    /// CDI kind of the GPU devices (`<vendor>/<class>`).
    pub cdi_kind: String,
    /// Prefix of the CDI annotation key (ends with '/').
    pub cdi_annotation_prefix: String,
    /// Directories holding the node's CDI specs (`.yaml` / `.json`); later ones win.
    #[serde(deserialize_with = "comma_paths")]
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// Also answer DeviceSpecs for /dev/nvidia<minor>, nvidiactl, nvidia-uvm, nvidia-uvm-tools.
    pub pass_device_specs: bool,
    /// Watch XID errors and report unhealthy GPUs.
    pub health_check: bool,
    /// Seconds without new errors after which a GPU with a non-fatal XID is healthy again.
    pub health_recovery_secs: u64,
    /// Memory isolation through CUDA MPS.
    pub mps: bool,
    /// MPS pipe directory on the host, mounted into containers in MPS mode.
    pub mps_pipe_dir: PathBuf,
    /// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for MPS clients and the daemon's default
    /// (`set_default_active_thread_percentage`); 0 leaves both unset.
    pub mps_active_thread_percentage: u8,
    /// The MPS control program the node agent runs (`-d` to start the daemon, without
    /// arguments as the client of its control pipe): a path, or a name looked up on PATH.
    pub mps_control: String,
    /// CUDA_MPS_LOG_DIRECTORY of the daemon the node agent starts.
    pub mps_log_dir: PathBuf,
    /// Host directory the MPS daemon sees as /dev/shm, mounted at /dev/shm into MPS clients;
    /// empty: none is mounted (the clients share the daemon's /dev/shm some other way).
    pub mps_shm_dir: PathBuf,
    /// The daemon's default pinned memory limit per GPU in MiB
    /// (`set_default_device_pinned_mem_limit`), the ceiling of a client that drops its own
    /// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; 0: one memory unit (the smallest safe value).
    pub mps_pinned_mem_limit_mib: u64,
    /// How often the node agent asks the daemon `get_server_list`, in milliseconds.
    pub mps_check_interval_ms: u64,
    /// The longest wait between two restarts of a daemon that keeps failing, in seconds.
    pub mps_restart_backoff_max_secs: u64,
    /// auto | driver | limiter | mps | none: what holds a container to its share of GPU memory.
    pub enforcement: enforcement::Enforcement,
    /// The gpushare program the container runtime runs as the CDI hook that sets a container's
    /// limit (driver enforcement); the same path on the host and in the node agent's view.
    pub enforcement_hook: PathBuf,
    /// Copy the running gpushare to `enforcement_hook` at start when it differs (a node agent
    /// in a container, with the hook's directory a host directory).
    pub enforcement_install_hook: bool,
    /// Where the hook records each limit it set (host directory, the same path for the agent).
    pub enforcement_state_dir: PathBuf,
    /// Where the device-plugin path writes the CDI specs that carry the hook.
    pub enforcement_cdi_dir: PathBuf,
    /// How often every served container's limit is read back, in seconds.
    pub enforcement_check_secs: u64,
    /// The CUDA memory limiter the node agent installs into `limiter_dir` at start (the
    /// image's copy, or where a host install put it); empty: install nothing, use what
    /// `limiter_dir` holds.
    pub limiter_library: PathBuf,
    /// Host directory holding the installed limiter and the preload list mounted into
    /// containers (the same path on the host and in the node agent's view).
    pub limiter_dir: PathBuf,
    /// Host directory (a tmpfs) of each served container's limits file and state directory
    /// (the same path on the host and in the node agent's view).
    pub limiter_run_dir: PathBuf,
    /// The host's cgroup v2 root as the node agent sees it.
    pub cgroup_root: PathBuf,
    /// The cgroup v2 root as the container runtime (and so the hook) sees it.
    pub runtime_cgroup_root: PathBuf,
    /// /proc as the container runtime (and so the hook) sees it.
    pub runtime_proc_root: PathBuf,
    /// Host directory of the GPU lock files both node roles take before offering a GPU (one
    /// path per GPU across processes); empty: /var/run/gpushare/gpus, or with the fake backend
    /// a directory of the process's own.
    pub gpu_lock_dir: PathBuf,
}

impl NodeConfig {
    /// The GPU lock directory of real GPUs: `gpu_lock_dir`, or its default.
    pub fn gpu_lock_dir(&self) -> PathBuf {
        if self.gpu_lock_dir.as_os_str().is_empty() {
            PathBuf::from(DEFAULT_GPU_LOCK_DIR)
        } else {
            self.gpu_lock_dir.clone()
        }
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            node_name: String::new(),
            memory_unit: MemoryUnit::GIB,
            visible_devices: VisibleDevices::Index,
            device_id_strategy: None,
            device_list_strategy: DeviceListStrategies::default(),
            cdi_kind: DEFAULT_CDI_KIND.to_string(),
            cdi_annotation_prefix: DEFAULT_CDI_ANNOTATION_PREFIX.to_string(),
            cdi_spec_dirs: DEFAULT_CDI_SPEC_DIRS.iter().map(PathBuf::from).collect(),
            pass_device_specs: false,
            health_check: true,
            health_recovery_secs: 300,
            mps: false,
            mps_pipe_dir: PathBuf::from("/tmp/nvidia-mps"),
            mps_active_thread_percentage: 0,
            mps_control: "nvidia-cuda-mps-control".to_string(),
            mps_log_dir: PathBuf::from("/var/log/nvidia-mps"),
            mps_shm_dir: PathBuf::new(),
            mps_pinned_mem_limit_mib: 0,
            mps_check_interval_ms: 5000,
            mps_restart_backoff_max_secs: 60,
            enforcement: enforcement::Enforcement::Auto,
            enforcement_hook: PathBuf::from("/usr/local/bin/gpushare"),
            enforcement_install_hook: false,
            enforcement_state_dir: PathBuf::from("/var/run/gpushare/limits"),
            enforcement_cdi_dir: PathBuf::from("/var/run/cdi"),
            enforcement_check_secs: 30,
            limiter_library: PathBuf::from(DEFAULT_LIMITER_LIBRARY),
            limiter_dir: PathBuf::from(DEFAULT_LIMITER_DIR),
            limiter_run_dir: PathBuf::from(DEFAULT_LIMITER_RUN_DIR),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            runtime_cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            runtime_proc_root: PathBuf::from("/proc"),
            gpu_lock_dir: PathBuf::new(),
        }
    }
}

/// Where the image (and a host install) keeps the CUDA memory limiter the node agent installs.
pub const DEFAULT_LIMITER_LIBRARY: &str = "/usr/local/lib/gpushare/libgpushare_limiter.so";
/// Where the node agent installs the limiter and its preload list on the host.
pub const DEFAULT_LIMITER_DIR: &str = "/var/lib/gpushare/limiter";
/// Where each served container's limits file and state directory go on the host (tmpfs).
pub const DEFAULT_LIMITER_RUN_DIR: &str = "/run/gpushare/limiter";

/// The `[node]` keys that `[device_plugin]` held before; `device_plugin.<key>` (in the file
/// and as `GPUSHARE_DEVICE_PLUGIN__<KEY>`) still sets `node.<key>`, and doctor names it.
pub const NODE_KEYS: &[&str] = &[
    "node_name",
    "memory_unit",
    "visible_devices",
    "device_id_strategy",
    "device_list_strategy",
    "cdi_kind",
    "cdi_annotation_prefix",
    "cdi_spec_dirs",
    "pass_device_specs",
    "health_check",
    "health_recovery_secs",
    "mps",
    "mps_pipe_dir",
    "mps_active_thread_percentage",
    "mps_control",
    "mps_log_dir",
    "mps_shm_dir",
    "mps_pinned_mem_limit_mib",
    "mps_check_interval_ms",
    "mps_restart_backoff_max_secs",
];

/// GPU backend selection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum GpuBackendKind {
    /// nvml where this build can load it, else nvidia-smi.
    #[default]
    Auto,
    /// NVML through libnvidia-ml.so.1 (dynamically linked builds).
    Nvml,
    /// `nvidia-smi -q -x` (the static build).
    NvidiaSmi,
    /// GPUs described by `fake_gpus` (tests, demo, GPU-less clusters).
    Fake,
}

/// `[gpu]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuConfig {
    /// auto | nvml | nvidia-smi | fake.
    pub backend: GpuBackendKind,
    /// Fake GPUs: `2x16GiB`, or a comma list `16GiB,24GiB`, or `GPU-uuid=16GiB,...`.
    pub fake_gpus: String,
    /// Path of libnvidia-ml.so.1; empty uses the loader's search path.
    pub nvml_library: String,
    /// The nvidia-smi program.
    pub nvidia_smi: String,
    /// The kernel log the nvidia-smi backend reads `NVRM: Xid` lines from: `/dev/kmsg`, or a
    /// file or FIFO fed by something else (a recorded log, `journalctl -kf > fifo`).
    pub kmsg_path: String,
    /// Read `kmsg_path` from its start instead of only what is logged from now on (replaying
    /// a recorded log).
    pub kmsg_replay: bool,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            backend: GpuBackendKind::Auto,
            fake_gpus: String::new(),
            nvml_library: String::new(),
            nvidia_smi: "nvidia-smi".to_string(),
            kmsg_path: DEFAULT_KMSG.to_string(),
            kmsg_replay: false,
        }
    }
}

/// `[doctor]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DoctorConfig {
    /// Do not run the preflight before `extender` / `device-plugin` start.
    pub skip: bool,
}

/// `[http]`: deadlines and caps of every HTTP server gpushare runs (see `http_server`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Request headers must arrive within this (from connect, or from the previous request).
    pub header_read_timeout_ms: u64,
    /// A request body must arrive within this; a slower client gets 408.
    pub body_read_timeout_ms: u64,
    /// A whole request must finish within this; past it the client gets 503. Must exceed
    /// `extender.bind_timeout_ms`.
    pub request_timeout_ms: u64,
    /// Open connections per server at most; more are closed at once (and counted).
    pub max_connections: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            max_connections: 4096,
        }
    }
}

/// `[webhook]`: the admission webhook of managed clusters (`gpushare webhook`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// Address to listen on.
    pub bind_address: IpAddr,
    /// HTTPS port.
    pub port: u16,
    /// The scheduler gpu-mem pods are sent to (the chart's `scheduler.name`).
    pub scheduler_name: String,
    /// Largest `aliyun.com/gpu-mem` one pod may ask for, in units: more than any GPU a device
    /// plugin can advertise. The default is the most fake devices a node's ListAndWatch
    /// message can hold.
    pub max_gpu_mem: u64,
    /// PEM certificate (e.g. from cert-manager); with `tls_key`. Re-read when it changes.
    pub tls_cert: String,
    /// PEM private key for `tls_cert`.
    pub tls_key: String,
    /// Make and keep our own CA and serving certificate in a Secret, and write the CA into
    /// the webhook configurations.
    pub self_signed: bool,
    /// The Secret of `self_signed`.
    pub tls_secret: String,
    /// Namespace of the Secret and of the Service.
    pub namespace: String,
    /// The Service in front of the webhook (the serving certificate's DNS names).
    pub service_name: String,
    /// The Mutating- and ValidatingWebhookConfiguration whose `caBundle` `self_signed` writes.
    pub webhook_config: String,
    /// Serving certificate lifetime, in days.
    pub cert_validity_days: u32,
    /// Renew the serving certificate this many days before it expires.
    pub renew_before_days: u32,
    /// The path of `aliyun.com/gpu-mem` pods when their namespace has no
    /// `gpushare.io/gpu-mem-path` label: `extender` (sent to `scheduler_name`) or `dra`
    /// (rewritten into one ResourceClaim).
    pub gpu_mem_path: GpuMemPath,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            bind_address: IpAddr::from([0, 0, 0, 0]),
            port: 9443,
            scheduler_name: "gpushare-scheduler".to_string(),
            max_gpu_mem: 81_920,
            tls_cert: String::new(),
            tls_key: String::new(),
            self_signed: false,
            tls_secret: "gpushare-webhook-tls".to_string(),
            namespace: "kube-system".to_string(),
            service_name: "gpushare-webhook".to_string(),
            webhook_config: "gpushare-webhook".to_string(),
            cert_validity_days: 365,
            renew_before_days: 30,
            gpu_mem_path: GpuMemPath::Extender,
        }
    }
}

/// A configuration problem: which key, from where, and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file named by `--config` does not exist or cannot be read.
    #[error("configuration file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// A key has a value that is not allowed.
    #[error("invalid configuration: {key} (from {source_name}): {message}")]
    Invalid {
        /// Dotted key, e.g. `extender.port`.
        key: String,
        /// Where the value came from (file path, env var, flag).
        source_name: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// `[devices]` is refused (a kind's settings, or two kinds claiming one resource).
    #[error("invalid configuration: devices: {0}")]
    Devices(#[from] devices::DevicesConfigError),
}

/// Values given as command-line flags, by dotted key; the top layer of the configuration.
#[derive(Clone, Debug, Default)]
pub struct FlagOverrides {
    values: Vec<(String, Value)>,
}

impl FlagOverrides {
    /// No overrides.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (dotted, e.g. `extender.port`) when `value` is `Some`.
    pub fn set<T: Serialize>(&mut self, key: &str, value: Option<T>) -> &mut Self {
        if let Some(v) = value
            && let Ok(v) = Value::serialize(v)
        {
            self.values.push((key.to_string(), v));
        }
        self
    }

    /// Sets `key` to `true` when `flag` is set (for boolean switches).
    pub fn set_flag(&mut self, key: &str, flag: bool) -> &mut Self {
        if flag {
            self.set(key, Some(true));
        }
        self
    }
}

impl Provider for FlagOverrides {
    fn metadata(&self) -> Metadata {
        Metadata::named("command-line flag")
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut root = Dict::new();
        for (key, value) in &self.values {
            insert_dotted(&mut root, key, value.clone());
        }
        Ok(Map::from([(Profile::Global, root)]))
    }
}

fn insert_dotted(dict: &mut Dict, key: &str, value: Value) {
    match key.split_once('.') {
        None => {
            dict.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let entry = dict
                .entry(head.to_string())
                .or_insert_with(|| Value::from(Dict::new()));
            if let Value::Dict(_, inner) = entry {
                insert_dotted(inner, rest, value);
            }
        }
    }
}

/// The configuration sections, as spelled in the file and in `GPUSHARE_<SECTION>__<KEY>`.
const SECTIONS: &[&str] = &[
    "log",
    "cluster",
    "extender",
    "device_plugin",
    "node",
    "gpu",
    "doctor",
    "http",
    "webhook",
    "devices",
    "dra",
];

/// The upstream environment knobs, mapped onto our keys.
fn upstream_env() -> Env {
    Env::raw()
        .filter_map(|key| {
            let mapped = match key.as_str().to_ascii_uppercase().as_str() {
                "PORT" => "extender.port",
                "LOG_LEVEL" => "log.level",
                "NODE_NAME" => "node.node_name",
                "KUBECONFIG" => "cluster.kubeconfig",
                _ => return None,
            };
            Some(mapped.into())
        })
        .global()
}

/// A configuration layer whose `device_plugin.<key>` for a [`NODE_KEYS`] key is read as
/// `node.<key>`; where the same layer sets both, `node.<key>` wins. Layers keep their order
/// (a flag beats the environment beats the file, whichever name each uses).
struct NodeAliases<P>(P);

impl<P: Provider> Provider for NodeAliases<P> {
    fn metadata(&self) -> Metadata {
        self.0.metadata()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut data = self.0.data()?;
        for dict in data.values_mut() {
            move_node_keys(dict);
        }
        Ok(data)
    }

    fn profile(&self) -> Option<Profile> {
        self.0.profile()
    }
}

/// The [`NODE_KEYS`] this layer's `[device_plugin]` sets.
fn old_node_keys(dict: &Dict) -> Vec<&'static str> {
    match dict.get("device_plugin") {
        Some(Value::Dict(_, dp)) => NODE_KEYS
            .iter()
            .copied()
            .filter(|k| dp.contains_key(*k))
            .collect(),
        _ => Vec::new(),
    }
}

fn move_node_keys(dict: &mut Dict) {
    let mut moved = Vec::new();
    if let Some(Value::Dict(_, dp)) = dict.get_mut("device_plugin") {
        for key in NODE_KEYS {
            if let Some(v) = dp.remove(*key) {
                moved.push((*key, v));
            }
        }
    }
    if moved.is_empty() {
        return;
    }
    let node = dict
        .entry("node".to_string())
        .or_insert_with(|| Value::from(Dict::new()));
    if let Value::Dict(_, node) = node {
        for (key, value) in moved {
            node.entry(key.to_string()).or_insert(value);
        }
    }
}

/// A key spelled the old way (`device_plugin.<key>` of a [`NODE_KEYS`] key): still applied,
/// named by `gpushare doctor` with its new name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeprecatedKey {
    /// The old spelling as written (`device_plugin.mps`, `GPUSHARE_DEVICE_PLUGIN__MPS`).
    pub old: String,
    /// The new spelling (`node.mps`, `GPUSHARE_NODE__MPS`).
    pub new: String,
    /// Where it was written (`file /etc/gpushare/gpushare.toml`, `the environment`).
    pub source: String,
}

impl std::fmt::Display for DeprecatedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}) is deprecated: use {}",
            self.old, self.source, self.new
        )
    }
}

/// The configuration file read: `--config`, else [`DEFAULT_CONFIG_FILE`] if it exists.
fn file_layer(config_file: Option<&Path>) -> Result<Option<figment::providers::Data<Toml>>, Error> {
    match config_file {
        Some(path) => {
            if !path.is_file() {
                return Err(Error::File {
                    path: path.to_path_buf(),
                    reason: "no such file".to_string(),
                });
            }
            Ok(Some(Toml::file_exact(path)))
        }
        None if Path::new(DEFAULT_CONFIG_FILE).is_file() => {
            Ok(Some(Toml::file_exact(DEFAULT_CONFIG_FILE)))
        }
        None => Ok(None),
    }
}

/// The `GPUSHARE_<SECTION>__<KEY>` layer.
fn gpushare_env() -> Env {
    // Only our sections: other GPUSHARE_* variables (a test harness's, an image's
    // GPUSHARE_VERSION) are not configuration. Unknown keys inside a section still fail.
    Env::prefixed("GPUSHARE_")
        .filter(|key| {
            let key = key.as_str().to_ascii_lowercase();
            SECTIONS.iter().any(|s| key.starts_with(&format!("{s}__")))
        })
        .split("__")
        .global()
}

/// The layered figment: defaults, file, upstream env, `GPUSHARE_*` env, flags.
///
/// `config_file` is the `--config` value; `None` reads [`DEFAULT_CONFIG_FILE`] if it exists.
pub fn figment(config_file: Option<&Path>, flags: FlagOverrides) -> Result<Figment, Error> {
    let mut fig = Figment::from(Serialized::defaults(Config::default()));
    if let Some(file) = file_layer(config_file)? {
        fig = fig.merge(NodeAliases(file));
    }
    Ok(fig
        .merge(upstream_env())
        .merge(NodeAliases(gpushare_env()))
        .merge(NodeAliases(flags)))
}

/// The old spellings of [`NODE_KEYS`] in the configuration file and the `GPUSHARE_*`
/// environment (flags keep their names, so they have none).
pub fn deprecated_keys(config_file: Option<&Path>) -> Vec<DeprecatedKey> {
    let mut out = Vec::new();
    let dicts = |data: Result<Map<Profile, Dict>, figment::Error>| -> Vec<Dict> {
        data.map(|m| m.into_values().collect()).unwrap_or_default()
    };
    if let Ok(Some(file)) = file_layer(config_file) {
        let source = match file.metadata().source {
            Some(figment::Source::File(p)) => format!("file {}", p.display()),
            _ => "the configuration file".to_string(),
        };
        for dict in dicts(file.data()) {
            for key in old_node_keys(&dict) {
                out.push(DeprecatedKey {
                    old: format!("device_plugin.{key}"),
                    new: format!("node.{key}"),
                    source: source.clone(),
                });
            }
        }
    }
    for dict in dicts(gpushare_env().data()) {
        for key in old_node_keys(&dict) {
            let upper = key.to_ascii_uppercase();
            out.push(DeprecatedKey {
                old: format!("GPUSHARE_DEVICE_PLUGIN__{upper}"),
                new: format!("GPUSHARE_NODE__{upper}"),
                source: "the environment".to_string(),
            });
        }
    }
    out
}

/// Loads the configuration from the process environment, the file and `flags`.
pub fn load(config_file: Option<&Path>, flags: FlagOverrides) -> Result<Config, Error> {
    let mut config = Config::from_figment(&figment(config_file, flags)?)?;
    config.deprecated = deprecated_keys(config_file);
    Ok(config)
}

impl Config {
    /// Extracts and validates the configuration from any figment (tests pass their own).
    pub fn from_figment(fig: &Figment) -> Result<Config, Error> {
        let mut config: Config = fig.extract().map_err(|e| describe(fig, e))?;
        if let Some(id) = config.node.device_id_strategy {
            config.node.visible_devices = id;
        }
        config.validate(fig)?;
        Ok(config)
    }

    /// The defaults as TOML (what `packaging/gpushare.toml` must hold).
    pub fn defaults_toml() -> String {
        toml::to_string(&Config::default()).unwrap_or_default()
    }

    fn validate(&self, fig: &Figment) -> Result<(), Error> {
        let invalid = |key: &str, message: String| Error::Invalid {
            key: key.to_string(),
            source_name: source_of(fig, key),
            message,
        };
        let e = &self.extender;
        if !e.url_prefix.starts_with('/') || e.url_prefix.ends_with('/') && e.url_prefix.len() > 1 {
            return Err(invalid(
                "extender.url_prefix",
                format!(
                    "{:?}: must start with '/' and not end with '/'",
                    e.url_prefix
                ),
            ));
        }
        if e.tls_cert.is_empty() != e.tls_key.is_empty() {
            return Err(invalid(
                "extender.tls_cert",
                "tls_cert and tls_key must be given together".to_string(),
            ));
        }
        if !e.tls_client_ca.is_empty() && e.tls_cert.is_empty() {
            return Err(invalid(
                "extender.tls_client_ca",
                "client certificates need HTTPS: give tls_cert and tls_key too".to_string(),
            ));
        }
        let h = &self.http;
        for (key, ms) in [
            ("http.header_read_timeout_ms", h.header_read_timeout_ms),
            ("http.body_read_timeout_ms", h.body_read_timeout_ms),
            ("http.request_timeout_ms", h.request_timeout_ms),
        ] {
            if ms == 0 {
                return Err(invalid(key, "must be > 0".to_string()));
            }
        }
        if h.max_connections == 0 {
            return Err(invalid("http.max_connections", "must be > 0".to_string()));
        }
        if h.request_timeout_ms <= e.bind_timeout_ms {
            return Err(invalid(
                "http.request_timeout_ms",
                format!(
                    "{} ms: must exceed extender.bind_timeout_ms ({} ms), or binds would be cut off",
                    h.request_timeout_ms, e.bind_timeout_ms
                ),
            ));
        }
        if e.max_body_bytes < 1024 {
            return Err(invalid(
                "extender.max_body_bytes",
                "must be at least 1024".to_string(),
            ));
        }
        if e.bind_timeout_ms == 0 {
            return Err(invalid(
                "extender.bind_timeout_ms",
                "must be above 0".to_string(),
            ));
        }
        for (key, ms) in [
            ("extender.bind_settle_ms", e.bind_settle_ms),
            ("extender.watch_stale_after_ms", e.watch_stale_after_ms),
        ] {
            if ms == 0 {
                return Err(invalid(key, "must be above 0".to_string()));
            }
        }
        if e.retry_period_secs == 0
            || e.renew_deadline_secs <= e.retry_period_secs
            || e.lease_duration_secs <= e.renew_deadline_secs
        {
            return Err(invalid(
                "extender.lease_duration_secs",
                format!(
                    "need lease_duration_secs ({}) > renew_deadline_secs ({}) > retry_period_secs ({}) > 0",
                    e.lease_duration_secs, e.renew_deadline_secs, e.retry_period_secs
                ),
            ));
        }
        self.devices.validate()?;
        let w = &self.webhook;
        if w.tls_cert.is_empty() != w.tls_key.is_empty() {
            return Err(invalid(
                "webhook.tls_cert",
                "tls_cert and tls_key must be given together".to_string(),
            ));
        }
        if w.self_signed && !w.tls_cert.is_empty() {
            return Err(invalid(
                "webhook.self_signed",
                "choose either self_signed or tls_cert/tls_key".to_string(),
            ));
        }
        if w.cert_validity_days <= w.renew_before_days {
            return Err(invalid(
                "webhook.cert_validity_days",
                format!(
                    "{} days: must exceed webhook.renew_before_days ({})",
                    w.cert_validity_days, w.renew_before_days
                ),
            ));
        }
        if w.max_gpu_mem == 0 {
            return Err(invalid(
                "webhook.max_gpu_mem",
                "must be above 0".to_string(),
            ));
        }
        if e.leader_elect {
            let margin_ms = (e.lease_duration_secs - e.renew_deadline_secs).saturating_mul(1000);
            if e.bind_timeout_ms >= margin_ms {
                return Err(invalid(
                    "extender.bind_timeout_ms",
                    format!(
                        "{} ms does not fit inside extender.lease_duration_secs ({}) - \
                         extender.renew_deadline_secs ({}) = {margin_ms} ms: with leader election a \
                         bind of a deposed leader could still write after the next leader took over; \
                         lower bind_timeout_ms or widen the gap between the two",
                        e.bind_timeout_ms, e.lease_duration_secs, e.renew_deadline_secs
                    ),
                ));
            }
        }
        if !e.advertise_address.is_empty()
            && let Err(why) = split_host_port(&e.advertise_address)
        {
            return Err(invalid(
                "extender.advertise_address",
                format!("{:?}: {why}", e.advertise_address),
            ));
        }
        let d = &self.node;
        if d.mps_active_thread_percentage > 100 {
            return Err(invalid(
                "node.mps_active_thread_percentage",
                "must be 0 (unset) to 100".to_string(),
            ));
        }
        if d.mps_check_interval_ms == 0 {
            return Err(invalid(
                "node.mps_check_interval_ms",
                "must be at least 1".to_string(),
            ));
        }
        if d.enforcement_check_secs == 0 {
            return Err(invalid(
                "node.enforcement_check_secs",
                "must be at least 1".to_string(),
            ));
        }
        if d.enforcement == enforcement::Enforcement::Mps && !d.mps {
            return Err(invalid(
                "node.enforcement",
                "mps needs the MPS daemon: set node.mps = true (--mps), or choose auto, driver \
                 or none"
                    .to_string(),
            ));
        }
        for (key, path) in [
            ("node.enforcement_hook", &d.enforcement_hook),
            ("node.enforcement_state_dir", &d.enforcement_state_dir),
            ("node.enforcement_cdi_dir", &d.enforcement_cdi_dir),
            ("node.limiter_dir", &d.limiter_dir),
            ("node.limiter_run_dir", &d.limiter_run_dir),
            ("node.cgroup_root", &d.cgroup_root),
            ("node.runtime_cgroup_root", &d.runtime_cgroup_root),
            ("node.runtime_proc_root", &d.runtime_proc_root),
        ] {
            if !path.is_absolute() {
                return Err(invalid(
                    key,
                    format!("{}: must be an absolute path", path.display()),
                ));
            }
        }
        if !d.limiter_library.as_os_str().is_empty() && !d.limiter_library.is_absolute() {
            return Err(invalid(
                "node.limiter_library",
                format!(
                    "{}: must be an absolute path (or empty: install nothing)",
                    d.limiter_library.display()
                ),
            ));
        }
        if d.mps && d.mps_control.trim().is_empty() {
            return Err(invalid(
                "node.mps_control",
                "name the nvidia-cuda-mps-control program (a path or a name on PATH)".to_string(),
            ));
        }
        if d.device_list_strategy.as_slice().is_empty() {
            return Err(invalid(
                "node.device_list_strategy",
                "name at least one of envvar, volume-mounts, cdi-annotations, cdi-cri".to_string(),
            ));
        }
        if !valid_cdi_kind(&d.cdi_kind) {
            return Err(invalid(
                "node.cdi_kind",
                format!(
                    "{:?}: expected <vendor>/<class> as in a CDI spec, e.g. nvidia.com/gpu",
                    d.cdi_kind
                ),
            ));
        }
        if !d.cdi_annotation_prefix.ends_with('/') || d.cdi_annotation_prefix.len() < 2 {
            return Err(invalid(
                "node.cdi_annotation_prefix",
                format!(
                    "{:?}: expected a key prefix ending with '/', e.g. cdi.k8s.io/",
                    d.cdi_annotation_prefix
                ),
            ));
        }
        if d.device_list_strategy.any_cdi() && d.cdi_spec_dirs.is_empty() {
            return Err(invalid(
                "node.cdi_spec_dirs",
                "a CDI strategy needs at least one CDI spec directory".to_string(),
            ));
        }
        let d = &self.device_plugin;
        if !d.admin_address.is_empty() && d.admin_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "device_plugin.admin_address",
                format!("{:?}: expected HOST:PORT or empty", d.admin_address),
            ));
        }
        let d = &self.dra;
        if !d.admin_address.is_empty() && d.admin_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "dra.admin_address",
                format!("{:?}: expected HOST:PORT or empty", d.admin_address),
            ));
        }
        let label = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        if d.driver_name.len() > 63
            || !d.driver_name.contains('.')
            || !d.driver_name.split('.').all(label)
        {
            return Err(invalid(
                "dra.driver_name",
                format!(
                    "{:?}: expected a DNS subdomain such as gpushare.io",
                    d.driver_name
                ),
            ));
        }
        Ok(())
    }
}

/// A CDI kind: `<vendor>/<class>`, vendor a DNS-like name, class alphanumerics, `-`, `_`.
pub fn valid_cdi_kind(kind: &str) -> bool {
    let Some((vendor, class)) = kind.split_once('/') else {
        return false;
    };
    let ok = |s: &str, extra: &[char]| {
        !s.is_empty()
            && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || extra.contains(&c))
    };
    ok(vendor, &['-', '_', '.']) && ok(class, &['-', '_'])
}

/// Why a text is no `HOST[:PORT]`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostPortError {
    /// The port is not 1–65535.
    #[error("port {0:?} is not a number from 1 to 65535")]
    BadPort(String),
    /// `[` without `]`.
    #[error("an opening '[' without ']'")]
    UnclosedBracket,
    /// Brackets around something that is not an IPv6 address.
    #[error("{0:?} in brackets is not an IPv6 address")]
    NotIpv6(String),
    /// Text after `]` that is not `:PORT`.
    #[error("unexpected {0:?} after ']'")]
    AfterBracket(String),
    /// An empty host, or one with characters no host name has.
    #[error("expected HOST[:PORT]")]
    NotHostPort,
}

/// Splits `HOST[:PORT]` (an IPv6 host bare or in brackets: `fe80::1`, `[fe80::1]:8080`).
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), HostPortError> {
    let port = |p: &str| match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(HostPortError::BadPort(p.to_string())),
        Ok(n) => Ok(Some(n)),
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or(HostPortError::UnclosedBracket)?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(HostPortError::NotIpv6(host.to_string()));
        }
        return match tail {
            "" => Ok((host.to_string(), None)),
            t => match t.strip_prefix(':') {
                Some(p) => Ok((host.to_string(), port(p)?)),
                None => Err(HostPortError::AfterBracket(t.to_string())),
            },
        };
    }
    if s.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok((s.to_string(), None));
    }
    let (host, p) = match s.rsplit_once(':') {
        Some((h, p)) => (h, port(p)?),
        None => (s, None),
    };
    if host.is_empty() || host.contains(['/', ' ', '[', ']', ':', '@']) {
        return Err(HostPortError::NotHostPort);
    }
    Ok((host.to_string(), p))
}

/// Where the value of `key` came from, for error messages.
fn source_of(fig: &Figment, key: &str) -> String {
    match fig.find_metadata(key) {
        Some(md) => describe_metadata(md, key),
        None => "built-in default".to_string(),
    }
}

fn describe_metadata(md: &Metadata, key: &str) -> String {
    let path: Vec<&str> = key.split('.').collect();
    if md.name.contains("GPUSHARE_") {
        return format!(
            "environment variable GPUSHARE_{}",
            path.join("__").to_ascii_uppercase()
        );
    }
    if md.name.contains("environment") {
        let var = match key {
            "extender.port" => "PORT",
            "log.level" => "LOG_LEVEL",
            "node.node_name" => "NODE_NAME",
            "cluster.kubeconfig" => "KUBECONFIG",
            other => other,
        };
        return format!("environment variable {var}");
    }
    match &md.source {
        Some(figment::Source::File(p)) => format!("file {}", p.display()),
        _ if md.name.contains("flag") => {
            format!("flag --{}", path.last().unwrap_or(&key).replace('_', "-"))
        }
        _ => md.name.to_string(),
    }
}

fn describe(fig: &Figment, err: figment::Error) -> Error {
    let key = err
        .path
        .iter()
        .filter(|p| p.as_str() != "default" && p.as_str() != "global")
        .cloned()
        .collect::<Vec<_>>()
        .join(".");
    let source_name = match &err.metadata {
        Some(md) => describe_metadata(md, &key),
        None => source_of(fig, &key),
    };
    let message = err.kind.to_string();
    Error::Invalid {
        key: if key.is_empty() {
            "(file)".to_string()
        } else {
            key
        },
        source_name,
        message,
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;

    #[test]
    fn every_section_can_be_set_from_the_environment() {
        let config = serde_json::to_value(Config::default()).expect("serializes");
        let mut sections: Vec<&str> = config
            .as_object()
            .expect("a table")
            .keys()
            .map(String::as_str)
            .collect();
        sections.sort_unstable();
        let mut listed = SECTIONS.to_vec();
        listed.sort_unstable();
        assert_eq!(
            sections, listed,
            "SECTIONS must name every [section] of Config"
        );
        figment::Jail::expect_with(|jail| {
            jail.set_env("GPUSHARE_HTTP__MAX_CONNECTIONS", "77");
            let cfg = load(None, FlagOverrides::new()).unwrap();
            assert_eq!(cfg.http.max_connections, 77);
            Ok(())
        });
    }

    fn from_toml(toml: &str) -> Result<Config, Error> {
        Config::from_figment(
            &Figment::from(Serialized::defaults(Config::default()))
                .merge(NodeAliases(Toml::string(toml))),
        )
    }

    #[test]
    fn defaults_validate() {
        assert_eq!(from_toml("").unwrap(), Config::default());
    }

    #[test]
    fn the_packaged_example_holds_every_key_with_its_default() {
        let text = include_str!("../packaging/gpushare.toml");
        let from_file: Config = Figment::from(Toml::string(text)).extract().unwrap();
        assert_eq!(from_file, Config::default());
        // Every key of the defaults appears in the file (not merely defaulted by serde).
        let file: toml::Value = toml::from_str(text).unwrap();
        let defaults: toml::Value = toml::from_str(&Config::defaults_toml()).unwrap();
        let (toml::Value::Table(file), toml::Value::Table(defaults)) = (file, defaults) else {
            panic!("not tables")
        };
        for (section, keys) in defaults {
            let toml::Value::Table(keys) = keys else {
                continue;
            };
            for key in keys.keys() {
                let present = file
                    .get(&section)
                    .and_then(|s| s.as_table())
                    .is_some_and(|s| s.contains_key(key));
                assert!(present, "packaging/gpushare.toml lacks {section}.{key}");
            }
        }
    }

    #[test]
    fn errors_name_key_source_and_what_is_allowed() {
        let err = from_toml("[extender]\ngpu_policy = \"random\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.gpu_policy"), "{err}");
        assert!(err.contains("binpack") && err.contains("spread"), "{err}");
        let err = from_toml("[extender]\nport = 70000\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.port"), "{err}");
        let err = from_toml("[extender]\nprot = 1\n").unwrap_err().to_string();
        assert!(err.contains("prot"), "{err}");
        let err = from_toml("[device_plugin]\nmemory_unit = \"KiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node.memory_unit") && err.contains("GiB"),
            "{err}"
        );
        let err = from_toml("[extender]\nurl_prefix = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.url_prefix"), "{err}");
    }

    #[test]
    fn a_bind_timeout_outside_the_lease_margin_is_an_error_naming_the_keys() {
        let err = from_toml("[extender]\nleader_elect = true\nbind_timeout_ms = 5000\n")
            .unwrap_err()
            .to_string();
        for key in [
            "extender.bind_timeout_ms",
            "extender.lease_duration_secs",
            "extender.renew_deadline_secs",
        ] {
            assert!(err.contains(key), "{err}");
        }
        assert!(from_toml("[extender]\nleader_elect = true\nbind_timeout_ms = 4999\n").is_ok());
        // Without an election there is no lease to fit into.
        assert!(from_toml("[extender]\nbind_timeout_ms = 9000\n").is_ok());
    }

    #[test]
    fn a_client_ca_needs_https() {
        let err = from_toml("[extender]\ntls_client_ca = \"/ca.crt\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.tls_client_ca"), "{err}");
        assert!(
            from_toml(
                "[extender]\ntls_cert = \"/t.crt\"\ntls_key = \"/t.key\"\ntls_client_ca = \"/ca.crt\"\n"
            )
            .is_ok()
        );
        let c = from_toml("[cluster]\napi_wait_secs = 0\n").expect("0 is allowed");
        assert_eq!(c.cluster.api_wait_secs, 0);
    }

    #[test]
    fn advertise_addresses_are_host_and_optional_port() {
        let ok = |s: &str| split_host_port(s).unwrap();
        assert_eq!(ok("10.0.0.7"), ("10.0.0.7".into(), None));
        assert_eq!(ok("10.0.0.7:12345"), ("10.0.0.7".into(), Some(12345)));
        assert_eq!(ok("cp-1.example"), ("cp-1.example".into(), None));
        assert_eq!(ok("fe80::1"), ("fe80::1".into(), None));
        assert_eq!(ok("[fe80::1]:80"), ("fe80::1".into(), Some(80)));
        for bad in [
            "", ":80", "h:0", "h:x", "[x]:1", "[fe80::1", "http://h", "h:99999",
        ] {
            assert!(split_host_port(bad).is_err(), "{bad}");
        }
        let err = from_toml("[extender]\nadvertise_address = \"a b\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.advertise_address"), "{err}");
    }

    #[test]
    fn layers_apply_in_order_and_sources_are_named() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "gpushare.toml",
                "[extender]\nport = 1000\n[log]\nlevel = \"warn\"\n",
            )?;
            jail.set_env("PORT", "2000");
            jail.set_env("LOG_LEVEL", "debug");
            // The file is lower than the upstream env knobs.
            let cfg = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.extender.port, 2000);
            assert_eq!(cfg.log.level, LogLevel::Debug);
            jail.set_env("GPUSHARE_EXTENDER__PORT", "3000");
            let cfg = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.extender.port, 3000);
            let mut flags = FlagOverrides::new();
            flags.set("extender.port", Some(4000u16));
            let cfg = load(Some(Path::new("gpushare.toml")), flags).unwrap();
            assert_eq!(cfg.extender.port, 4000);
            // Variables outside our sections are not configuration; typos inside one are.
            jail.set_env("GPUSHARE_UPDATE_GOLDEN", "1");
            load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            jail.set_env("GPUSHARE_EXTENDER__PROT", "1");
            let err = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap_err();
            assert!(err.to_string().contains("prot"), "{err}");
            jail.clear_env();
            jail.set_env("GPUSHARE_EXTENDER__PORT", "lots");
            let err = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("GPUSHARE_EXTENDER__PORT"), "{text}");
            jail.set_env("GPUSHARE_EXTENDER__PORT", "3000");
            let mut flags = FlagOverrides::new();
            flags.set("extender.url_prefix", Some("nope"));
            let err = load(Some(Path::new("gpushare.toml")), flags)
                .unwrap_err()
                .to_string();
            assert!(err.contains("flag --url-prefix"), "{err}");
            assert!(matches!(
                load(Some(Path::new("missing.toml")), FlagOverrides::new()),
                Err(Error::File { .. })
            ));
            Ok(())
        });
    }

    #[test]
    fn upstream_knobs_map_onto_our_keys() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("NODE_NAME", "gpu-node-1");
            jail.set_env("KUBECONFIG", "/etc/kubernetes/kubelet.conf");
            let cfg = load(None, FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.node_name, "gpu-node-1");
            assert_eq!(cfg.cluster.kubeconfig, "/etc/kubernetes/kubelet.conf");
            Ok(())
        });
    }

    #[test]
    fn device_list_strategies_from_env_file_and_flags() {
        figment::Jail::expect_with(|jail| {
            jail.set_env(
                "GPUSHARE_DEVICE_PLUGIN__DEVICE_LIST_STRATEGY",
                "cdi-cri, envvar,cdi-cri",
            );
            jail.set_env("GPUSHARE_DEVICE_PLUGIN__CDI_SPEC_DIRS", "/run/cdi");
            let cfg = load(None, FlagOverrides::new()).unwrap();
            let d = &cfg.node;
            assert_eq!(d.device_list_strategy.to_string(), "envvar,cdi-cri");
            assert!(d.device_list_strategy.any_cdi() && !d.device_list_strategy.only_cdi());
            assert_eq!(d.cdi_spec_dirs, [PathBuf::from("/run/cdi")]);
            Ok(())
        });
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "g.toml",
                "[device_plugin]\ndevice_list_strategy = [\"cdi-annotations\"]\ndevice_id_strategy = \"uuid\"\n",
            )?;
            let cfg = load(Some(Path::new("g.toml")), FlagOverrides::new()).unwrap();
            assert!(cfg.node.device_list_strategy.only_cdi());
            assert_eq!(cfg.node.visible_devices, VisibleDevices::Uuid);
            for (key, value, what) in [
                ("device_list_strategy", "cdi", "expected envvar"),
                ("device_list_strategy", "", "at least one"),
                ("cdi_kind", "nvidia", "<vendor>/<class>"),
                ("cdi_annotation_prefix", "cdi.k8s.io", "ending with '/'"),
            ] {
                let mut flags = FlagOverrides::new();
                flags.set(&format!("device_plugin.{key}"), Some(value));
                let err = load(None, flags).expect_err(key).to_string();
                assert!(err.contains(what), "{key}={value:?}: {err}");
            }
            Ok(())
        });
    }

    #[test]
    fn old_device_plugin_keys_are_aliases_of_node_keys_by_layer() {
        figment::Jail::expect_with(|jail| {
            // The old name alone, in the file: applied, and named as deprecated.
            jail.create_file(
                "old.toml",
                "[device_plugin]\nmemory_unit = \"MiB\"\nmps = true\nadmin_address = \"\"\n",
            )?;
            let cfg = load(Some(Path::new("old.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit, MemoryUnit::MIB);
            assert!(cfg.node.mps);
            assert_eq!(cfg.device_plugin.admin_address, "");
            let old: Vec<&str> = cfg.deprecated.iter().map(|d| d.old.as_str()).collect();
            assert_eq!(old, ["device_plugin.memory_unit", "device_plugin.mps"]);
            assert_eq!(cfg.deprecated[0].new, "node.memory_unit");
            assert!(
                cfg.deprecated[0].source.contains("old.toml"),
                "{:?}",
                cfg.deprecated
            );
            // Both names in one layer: the new one wins.
            jail.create_file(
                "both.toml",
                "[device_plugin]\nmemory_unit = \"MiB\"\n[node]\nmemory_unit = \"256MiB\"\n",
            )?;
            let cfg = load(Some(Path::new("both.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit.mib(), 256);
            // A higher layer wins whatever name it uses: the old env name over the new file key.
            jail.create_file("new.toml", "[node]\nmemory_unit = \"256MiB\"\n")?;
            jail.set_env("GPUSHARE_DEVICE_PLUGIN__MEMORY_UNIT", "512MiB");
            let cfg = load(Some(Path::new("new.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit.mib(), 512);
            assert_eq!(cfg.deprecated.len(), 1);
            assert_eq!(cfg.deprecated[0].new, "GPUSHARE_NODE__MEMORY_UNIT");
            // ... and the new env name beats the old one in the same layer.
            jail.set_env("GPUSHARE_NODE__MEMORY_UNIT", "2GiB");
            let cfg = load(Some(Path::new("new.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit.mib(), 2048);
            // A flag, under either name, beats both.
            let mut flags = FlagOverrides::new();
            flags.set("device_plugin.memory_unit", Some("GiB"));
            let cfg = load(Some(Path::new("new.toml")), flags).unwrap();
            assert_eq!(cfg.node.memory_unit, MemoryUnit::GIB);
            // The new names name no deprecation; NODE_NAME still sets the node's name.
            jail.clear_env();
            jail.set_env("NODE_NAME", "n1");
            let cfg = load(Some(Path::new("new.toml")), FlagOverrides::new()).unwrap();
            assert!(cfg.deprecated.is_empty(), "{:?}", cfg.deprecated);
            assert_eq!(cfg.node.node_name, "n1");
            // An invalid value under the old name is reported under the new key.
            jail.create_file("bad.toml", "[device_plugin]\ncdi_kind = \"nvidia\"\n")?;
            let err = load(Some(Path::new("bad.toml")), FlagOverrides::new())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("node.cdi_kind") && err.contains("bad.toml"),
                "{err}"
            );
            Ok(())
        });
    }
}
