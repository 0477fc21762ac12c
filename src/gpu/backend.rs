//! The interface of GPU access, below every backend: what a backend reports (the GPUs of an
//! [`Inventory`], [`HealthEvent`]s, its [`Error`]s), the [`GpuBackend`] trait itself, and the
//! driver's per-cgroup memory limits a backend reaches ([`MemoryLimits`], [`LimitError`],
//! [`LimitReading`]). Types and traits only: the backends (`nvml`, `nvidia_smi`, `fake`), the
//! limits' two ways in (`limits`) and the choice among them (`gpu::open`) implement them and
//! import this module, never the reverse. `gpu` and `gpu::limits` re-export every name.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

/// One physical GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuDevice {
    /// NVML / enumeration index (what `NVIDIA_VISIBLE_DEVICES=<n>` means to the runtime).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Minor number (`/dev/nvidia<minor>`), when known.
    pub minor: Option<u32>,
    /// PCI bus id, when known.
    pub pci_bus_id: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
}

/// A GPU the backend saw but does not offer, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExcludedGpu {
    /// Its enumeration index (its place in the listing).
    pub index: u32,
    /// Its UUID, when the backend reported one.
    pub uuid: String,
    /// Product name, when known.
    pub name: String,
    /// Why it is left out.
    pub reason: ExclusionReason,
}

/// Why a GPU is not offered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExclusionReason {
    /// MIG mode is enabled: a container given the parent GPU's index cannot use its memory
    /// (only MIG instances can run work), so sharing the whole GPU's memory would be a lie.
    MigEnabled,
    /// The backend's record lacks what sharing needs (a UUID, the memory size).
    Incomplete(String),
}

impl fmt::Display for ExclusionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExclusionReason::MigEnabled => f.write_str(
                "MIG mode is enabled: containers given this GPU's index cannot use its memory \
                 (only its MIG instances run work); gpushare does not share MIG instances",
            ),
            ExclusionReason::Incomplete(what) => write!(f, "incomplete record: {what}"),
        }
    }
}

/// What a backend found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Inventory {
    /// The backend that answered (`nvml`, `nvidia-smi`, `fake`).
    pub backend: &'static str,
    /// Driver version string, e.g. `550.54.15`; empty when the backend did not say.
    pub driver_version: String,
    /// The GPUs offered, by index.
    pub devices: Vec<GpuDevice>,
    /// GPUs seen but not offered (MIG enabled, incomplete records), by index.
    pub excluded: Vec<ExcludedGpu>,
}

/// A health event reported by a backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthEvent {
    /// An XID error; `uuid` is `None` when the driver did not say which GPU.
    Xid {
        /// The GPU, if known.
        uuid: Option<String>,
        /// The XID number.
        xid: u64,
    },
    /// An XID the driver attributed to a PCI address that is none of the served GPUs
    /// (NVSwitch / NVLink XIDs such as 149 at `PCI:0000:00:00` on GB200, or a GPU this
    /// inventory does not list). It marks no GPU; the plugin logs and counts it.
    Unattributed {
        /// The PCI address as the kernel printed it.
        pci: String,
        /// The XID number.
        xid: u64,
    },
    /// The GPU stopped answering (fell off the bus, vanished from the inventory).
    Lost {
        /// The GPU.
        uuid: String,
    },
}

/// Why GPU access failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The NVML library could not be loaded or initialised.
    #[error("NVML: {0}")]
    Nvml(String),
    /// nvidia-smi could not be run or its output not understood.
    #[error("nvidia-smi: {0}")]
    NvidiaSmi(String),
    /// The fake GPU description is invalid.
    #[error("fake GPUs: {0}")]
    Fake(String),
    /// The blocking thread that ran a backend call panicked or was cancelled.
    #[error("GPU backend call did not finish: {0}")]
    Worker(String),
    /// `auto` found no working backend.
    #[error("no GPU backend works: {}", .tried.join("; "))]
    NoBackend {
        /// One line per backend tried, with why it failed.
        tried: Vec<String>,
    },
}

/// A source of GPU inventory and health.
pub trait GpuBackend: Send + Sync + fmt::Debug {
    /// `nvml`, `nvidia-smi` or `fake`.
    fn name(&self) -> &'static str;

    /// The GPUs and driver version, read now.
    fn inventory(&self) -> Result<Inventory, Error>;

    /// Starts watching for health events; events arrive on the returned channel until it is
    /// dropped. Backends without a health source return a channel that never yields.
    fn watch_health(&self) -> Result<tokio::sync::mpsc::Receiver<HealthEvent>, Error>;

    /// The driver's per-cgroup memory limits, reached the way this backend reaches the driver
    /// (blocking: it may load a library). The fake backend has none.
    fn memory_limits(&self) -> Result<Arc<dyn MemoryLimits>, LimitError> {
        Err(LimitError::Unavailable(format!(
            "the {} GPU backend has no driver to set memory limits with",
            self.name()
        )))
    }
}

impl Error {
    /// The message without the backend prefix (for lists that already name the backend).
    pub fn reason(&self) -> String {
        match self {
            Error::Nvml(r) | Error::NvidiaSmi(r) | Error::Fake(r) | Error::Worker(r) => r.clone(),
            Error::NoBackend { .. } => self.to_string(),
        }
    }
}

/// The hard limit that is no limit (NVML's `NVML_DEVICE_MEMORY_LIMIT_MAX`).
pub const NO_LIMIT: u64 = gpushare_nvml_limits::MEMORY_LIMIT_MAX;

/// One cgroup's limits on one GPU, read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LimitReading {
    /// Soft limit in bytes (0: none).
    pub soft: u64,
    /// Hard limit in bytes ([`NO_LIMIT`]: none).
    pub hard: u64,
    /// Device memory the cgroup uses, in bytes.
    pub used: u64,
}

impl LimitReading {
    /// No limit at all: soft 0 and no hard limit.
    pub fn is_unlimited(&self) -> bool {
        self.soft == 0 && self.hard == NO_LIMIT
    }
}

/// Why a limit could not be set or read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// Nothing to set limits with: no NVML and no nvidia-smi, or the fake backend.
    #[error("no way to reach the driver: {0}")]
    Unavailable(String),
    /// The driver has no per-cgroup memory limits (older than R615).
    #[error("the driver has no per-cgroup memory limits (it is older than R615 / CUDA 13.4): {0}")]
    TooOld(String),
    /// The driver refuses on this GPU or host: memory partitioning off, a MIG GPU, cgroup v1,
    /// or (misc backend, reading) no limit reaches the cgroup.
    #[error("not supported: {0}")]
    NotSupported(String),
    /// The cgroup is not there, or has no dmem files of its own (its parent did not enable
    /// `+dmem`).
    #[error("not found: {0}")]
    NotFound(String),
    /// The GPU is not known to the driver.
    #[error("unknown GPU: {0}")]
    UnknownGpu(String),
    /// Setting limits needs root.
    #[error("no permission (setting limits needs root): {0}")]
    NoPermission(String),
    /// Any other failure.
    #[error("{0}")]
    Failed(String),
}

/// Setting and reading per-cgroup limits.
pub trait MemoryLimits: Send + Sync + fmt::Debug {
    /// `nvml` or `nvidia-smi`.
    fn via(&self) -> &'static str;

    /// Sets the soft and hard limit (bytes) of GPU `gpu` (UUID) for cgroup directory `cgroup`.
    fn set(&self, gpu: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), LimitError>;

    /// Reads back the limits and the use of GPU `gpu` for cgroup directory `cgroup`.
    fn get(&self, gpu: &str, cgroup: &Path) -> Result<LimitReading, LimitError>;

    /// Whether GPU `gpu` is in MIG mode, when this way can tell.
    fn mig_enabled(&self, gpu: &str) -> Option<bool>;

    /// Whether the driver has the calls at all (`false`: older than R615), when this way can
    /// tell without a cgroup.
    fn has_limits(&self) -> Option<bool>;

    /// The `gpushare cdi-hook memory-limit` flags that reach the driver this same way
    /// (`--gpu-backend`, and the library or program when not the default).
    fn hook_args(&self) -> Vec<String>;
}
