//! `[gpu]`: which GPU backend the node roles and doctor use, and where the kernel log is.
//! Nothing here is checked beyond its type.

use serde::{Deserialize, Serialize};

/// The kernel log the nvidia-smi backend reads `NVRM: Xid` lines from by default.
pub const DEFAULT_KMSG: &str = "/dev/kmsg";

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
