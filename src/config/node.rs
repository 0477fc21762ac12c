//! `[node]`: what the GPU node agent needs whichever role serves the GPUs (node name, memory
//! unit, hand-over strategies, CDI, health, MPS, enforcement), the old `[device_plugin]`
//! spellings of those keys ([`NODE_KEYS`]), and the checks of the section. Loading is
//! [`super::load`]'s.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::enforcement;
use super::error::{Check, Error};
use crate::core::MemoryUnit;

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

/// The CDI kind nvidia-ctk and the GPU Operator write for whole GPUs.
pub const DEFAULT_CDI_KIND: &str = "nvidia.com/gpu";
/// The CDI annotation prefix containerd and CRI-O read.
pub const DEFAULT_CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// Where CDI specs live (the CDI specification's defaults; later directories win).
pub const DEFAULT_CDI_SPEC_DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];

/// Where the node roles keep one lock file per GPU (`node.gpu_lock_dir` when empty).
pub const DEFAULT_GPU_LOCK_DIR: &str = "/var/run/gpushare/gpus";

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

impl NodeConfig {
    /// The `[node]` checks.
    pub fn validate(&self, check: &Check<'_>) -> Result<(), Error> {
        let d = self;
        if d.mps_active_thread_percentage > 100 {
            return Err(check.invalid(
                "node.mps_active_thread_percentage",
                "must be 0 (unset) to 100".to_string(),
            ));
        }
        if d.mps_check_interval_ms == 0 {
            return Err(check.invalid(
                "node.mps_check_interval_ms",
                "must be at least 1".to_string(),
            ));
        }
        if d.enforcement_check_secs == 0 {
            return Err(check.invalid(
                "node.enforcement_check_secs",
                "must be at least 1".to_string(),
            ));
        }
        if d.enforcement == enforcement::Enforcement::Mps && !d.mps {
            return Err(check.invalid(
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
                return Err(
                    check.invalid(key, format!("{}: must be an absolute path", path.display()))
                );
            }
        }
        if !d.limiter_library.as_os_str().is_empty() && !d.limiter_library.is_absolute() {
            return Err(check.invalid(
                "node.limiter_library",
                format!(
                    "{}: must be an absolute path (or empty: install nothing)",
                    d.limiter_library.display()
                ),
            ));
        }
        if d.mps && d.mps_control.trim().is_empty() {
            return Err(check.invalid(
                "node.mps_control",
                "name the nvidia-cuda-mps-control program (a path or a name on PATH)".to_string(),
            ));
        }
        if d.device_list_strategy.as_slice().is_empty() {
            return Err(check.invalid(
                "node.device_list_strategy",
                "name at least one of envvar, volume-mounts, cdi-annotations, cdi-cri".to_string(),
            ));
        }
        if !valid_cdi_kind(&d.cdi_kind) {
            return Err(check.invalid(
                "node.cdi_kind",
                format!(
                    "{:?}: expected <vendor>/<class> as in a CDI spec, e.g. nvidia.com/gpu",
                    d.cdi_kind
                ),
            ));
        }
        if !d.cdi_annotation_prefix.ends_with('/') || d.cdi_annotation_prefix.len() < 2 {
            return Err(check.invalid(
                "node.cdi_annotation_prefix",
                format!(
                    "{:?}: expected a key prefix ending with '/', e.g. cdi.k8s.io/",
                    d.cdi_annotation_prefix
                ),
            ));
        }
        if d.device_list_strategy.any_cdi() && d.cdi_spec_dirs.is_empty() {
            return Err(check.invalid(
                "node.cdi_spec_dirs",
                "a CDI strategy needs at least one CDI spec directory".to_string(),
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
