//! The flags of every node role (`device-plugin`, `dra-plugin`): the node agent's `[node]`
//! keys, GPU access (`[gpu]`, [`crate::gpu::GpuArgs`]) and where the host's sysfs and /dev are
//! read (`[devices]`, [`crate::devices::RootArgs`]). Each role flattens [`NodeArgs`] into its
//! own flags and adds those of its kubelet path.
//!
//! It does not hold a role's own keys (`[device_plugin]`, `[dra]`) or the preflight switch.

use std::path::PathBuf;

use crate::config::{DeviceListStrategies, DeviceListStrategy, FlagOverrides, VisibleDevices};
use crate::core::MemoryUnit;

/// Flags of the node agent, shared by the node roles (each overrides its `[node]`, `[gpu]` or
/// `[devices]` key).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NodeArgs {
    /// This node's name [env: NODE_NAME]
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
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
    /// own; 0: one memory unit, the smallest safe value [default: 0]
    #[arg(long, value_name = "MIB")]
    pub mps_pinned_mem_limit_mib: Option<u64>,
    /// How often the daemon is asked get_server_list, in milliseconds [default: 5000]
    #[arg(long, value_name = "MS")]
    pub mps_check_interval_ms: Option<u64>,
    /// Longest wait between restarts of a failing daemon, in seconds [default: 60]
    #[arg(long, value_name = "SECS")]
    pub mps_restart_backoff_max_secs: Option<u64>,
    /// What holds a container to its share of GPU memory: auto (the strongest each GPU
    /// supports: driver, else limiter where the library is installed, else mps with --mps,
    /// else none), driver (the driver's per-cgroup limits, R615+; refuses to start without
    /// them), limiter (the CUDA memory limiter preloaded into containers), mps, none
    /// [default: auto]
    #[arg(long, value_enum)]
    pub enforcement: Option<crate::config::enforcement::Enforcement>,
    /// The gpushare program the container runtime runs as the CDI hook that sets a container's
    /// limit; the same path on the host and here [default: /usr/local/bin/gpushare]
    #[arg(long, value_name = "PATH")]
    pub enforcement_hook: Option<PathBuf>,
    /// Copy this gpushare to --enforcement-hook at start when it differs (the hook's
    /// directory a host directory)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub enforcement_install_hook: Option<bool>,
    /// Where the hook records the limits it set [default: /var/run/gpushare/limits]
    #[arg(long, value_name = "DIR")]
    pub enforcement_state_dir: Option<PathBuf>,
    /// Where the device-plugin path writes the CDI specs carrying the hook [default:
    /// /var/run/cdi]
    #[arg(long, value_name = "DIR")]
    pub enforcement_cdi_dir: Option<PathBuf>,
    /// How often every served container's limit is read back, in seconds [default: 30]
    #[arg(long, value_name = "SECS")]
    pub enforcement_check_secs: Option<u64>,
    /// The CUDA memory limiter to install into --limiter-dir at start; empty: install
    /// nothing [default: /usr/local/lib/gpushare/libgpushare_limiter.so]
    #[arg(long, value_name = "PATH")]
    pub limiter_library: Option<PathBuf>,
    /// Host directory of the installed limiter and its preload list, mounted into containers;
    /// the same path on the host and here [default: /var/lib/gpushare/limiter]
    #[arg(long, value_name = "DIR")]
    pub limiter_dir: Option<PathBuf>,
    /// Host directory (a tmpfs) of each container's limits file and state directory; the
    /// same path on the host and here [default: /run/gpushare/limiter]
    #[arg(long, value_name = "DIR")]
    pub limiter_run_dir: Option<PathBuf>,
    /// The host's cgroup v2 root as seen here [default: /sys/fs/cgroup]
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,
    /// The cgroup v2 root as the container runtime sees it, passed to the hook [default:
    /// /sys/fs/cgroup]
    #[arg(long, value_name = "DIR")]
    pub runtime_cgroup_root: Option<PathBuf>,
    /// /proc as the container runtime sees it, passed to the hook [default: /proc]
    #[arg(long, value_name = "DIR")]
    pub runtime_proc_root: Option<PathBuf>,
    /// Host directory of the GPU lock files (one path per GPU across the node's roles)
    /// [default: /var/run/gpushare/gpus]
    #[arg(long, value_name = "DIR")]
    pub gpu_lock_dir: Option<PathBuf>,
    /// GPU access.
    #[command(flatten)]
    pub gpu: crate::gpu::GpuArgs,
    /// Where the host's sysfs and /dev are read (RDMA HCAs, generic devices).
    #[command(flatten)]
    pub roots: crate::devices::RootArgs,
}

impl NodeArgs {
    /// The flags as configuration overrides.
    pub fn overrides(&self, flags: &mut FlagOverrides) {
        let node = |k: &str| format!("node.{k}");
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        flags.set(&node("node_name"), self.node_name.clone());
        flags.set(&node("memory_unit"), self.memory_unit);
        flags.set(&node("device_id_strategy"), self.visible_devices);
        if !self.device_list_strategy.is_empty() {
            let list = DeviceListStrategies::new(self.device_list_strategy.iter().copied());
            flags.set(&node("device_list_strategy"), Some(list.to_string()));
        }
        flags.set(&node("cdi_kind"), self.cdi_kind.clone());
        flags.set(
            &node("cdi_annotation_prefix"),
            self.cdi_annotation_prefix.clone(),
        );
        if !self.cdi_spec_dirs.is_empty() {
            let dirs: Vec<String> = self
                .cdi_spec_dirs
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            flags.set(&node("cdi_spec_dirs"), Some(dirs));
        }
        flags.set(&node("pass_device_specs"), self.pass_device_specs);
        flags.set(&node("health_check"), self.health_check);
        flags.set(&node("health_recovery_secs"), self.health_recovery);
        flags.set(&node("mps"), self.mps);
        flags.set(&node("mps_pipe_dir"), path(&self.mps_pipe_dir));
        flags.set(
            &node("mps_active_thread_percentage"),
            self.mps_active_thread_percentage,
        );
        flags.set(&node("mps_control"), self.mps_control.clone());
        flags.set(&node("mps_log_dir"), path(&self.mps_log_dir));
        flags.set(&node("mps_shm_dir"), path(&self.mps_shm_dir));
        flags.set(
            &node("mps_pinned_mem_limit_mib"),
            self.mps_pinned_mem_limit_mib,
        );
        flags.set(&node("mps_check_interval_ms"), self.mps_check_interval_ms);
        flags.set(&node("gpu_lock_dir"), path(&self.gpu_lock_dir));
        flags.set(
            &node("mps_restart_backoff_max_secs"),
            self.mps_restart_backoff_max_secs,
        );
        flags.set(&node("enforcement"), self.enforcement);
        flags.set(&node("enforcement_hook"), path(&self.enforcement_hook));
        flags.set(
            &node("enforcement_install_hook"),
            self.enforcement_install_hook,
        );
        flags.set(
            &node("enforcement_state_dir"),
            path(&self.enforcement_state_dir),
        );
        flags.set(
            &node("enforcement_cdi_dir"),
            path(&self.enforcement_cdi_dir),
        );
        flags.set(&node("enforcement_check_secs"), self.enforcement_check_secs);
        flags.set(&node("limiter_library"), path(&self.limiter_library));
        flags.set(&node("limiter_dir"), path(&self.limiter_dir));
        flags.set(&node("limiter_run_dir"), path(&self.limiter_run_dir));
        flags.set(&node("cgroup_root"), path(&self.cgroup_root));
        flags.set(
            &node("runtime_cgroup_root"),
            path(&self.runtime_cgroup_root),
        );
        flags.set(&node("runtime_proc_root"), path(&self.runtime_proc_root));
        self.gpu.overrides(flags);
        self.roots.overrides(flags);
    }
}
