//! GPU access behind one trait, [`GpuBackend`]: inventory (index, UUID, name, minor number,
//! PCI bus id, memory), driver version, and health events (XIDs).
//!
//! Backends (ARCHITECTURE.md §6): `nvml` (nvml-wrapper, dlopen of `libnvidia-ml.so.1`; only in
//! dynamically linked builds), `nvidia-smi` (parses `nvidia-smi -q -x`; how the static musl
//! binary reaches the driver), `fake` (GPUs from configuration). [`open`] picks one per
//! `[gpu] backend`; `auto` tries nvml then nvidia-smi and, when both fail, returns an error
//! naming what was tried — it never blocks (upstream hung forever).
//!
//! Only this module touches NVML.

pub mod cdi;
pub mod fake;
pub mod nvidia_smi;
pub mod nvml;

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use crate::config::{GpuBackendKind, GpuConfig};

/// The GPU flags shared by `device-plugin` and `doctor` (doctor tests what the plugin will
/// use), onto the `[gpu]` configuration keys.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct GpuArgs {
    /// GPU access: auto (nvml where this build can load it, else nvidia-smi), nvml,
    /// nvidia-smi, fake [config: gpu.backend; default auto]
    #[arg(long, value_enum)]
    pub gpu_backend: Option<crate::config::GpuBackendKind>,
    /// Fake GPUs for `--gpu-backend fake`: `2x16GiB`, `16GiB,24GiB` or `GPU-uuid=16GiB,…`
    /// [config: gpu.fake_gpus]
    #[arg(long, value_name = "SPEC")]
    pub fake_gpus: Option<String>,
    /// Path of libnvidia-ml.so.1 [config: gpu.nvml_library; default: the loader's search path]
    #[arg(long, value_name = "PATH")]
    pub nvml_library: Option<String>,
    /// The nvidia-smi program [config: gpu.nvidia_smi; default nvidia-smi on PATH]
    #[arg(long, value_name = "PATH")]
    pub nvidia_smi: Option<String>,
}

impl GpuArgs {
    /// The flags as configuration overrides.
    pub fn overrides(&self, flags: &mut crate::config::FlagOverrides) {
        let GpuArgs {
            gpu_backend,
            fake_gpus,
            nvml_library,
            nvidia_smi,
        } = self;
        flags
            .set("gpu.backend", *gpu_backend)
            .set("gpu.fake_gpus", fake_gpus.clone())
            .set("gpu.nvml_library", nvml_library.clone())
            .set("gpu.nvidia_smi", nvidia_smi.clone());
    }
}

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

/// What a backend found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Inventory {
    /// The backend that answered (`nvml`, `nvidia-smi`, `fake`).
    pub backend: &'static str,
    /// Driver version string, e.g. `550.54.15`.
    pub driver_version: String,
    /// GPUs by index.
    pub devices: Vec<GpuDevice>,
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
}

/// [`open`] on a blocking thread: opening runs nvidia-smi or initialises NVML, which must
/// never hold a tokio worker.
pub async fn open_off_runtime(config: &GpuConfig) -> Result<Arc<dyn GpuBackend>, Error> {
    let config = config.clone();
    tokio::task::spawn_blocking(move || open(&config))
        .await
        .map_err(|e| Error::Worker(e.to_string()))?
}

/// `backend.inventory()` on a blocking thread (nvidia-smi runs a process that can hang for
/// as long as its timeout): the way async code reads the GPUs.
pub async fn inventory_off_runtime(backend: &Arc<dyn GpuBackend>) -> Result<Inventory, Error> {
    let backend = Arc::clone(backend);
    tokio::task::spawn_blocking(move || backend.inventory())
        .await
        .map_err(|e| Error::Worker(e.to_string()))?
}

/// The backend `config` selects, with `auto` resolved: `nvml` where this build can dlopen and
/// the library loads, else `nvidia-smi` when it runs and its output parses, else
/// [`Error::NoBackend`] naming each attempt and why it failed. Never blocks for long: NVML
/// initialisation fails fast without a driver, and nvidia-smi runs under a timeout.
pub fn open(config: &GpuConfig) -> Result<Arc<dyn GpuBackend>, Error> {
    match config.backend {
        GpuBackendKind::Fake => Ok(Arc::new(fake::FakeBackend::from_spec(&config.fake_gpus)?)),
        GpuBackendKind::Nvml => Ok(Arc::new(nvml::NvmlBackend::open(&config.nvml_library)?)),
        GpuBackendKind::NvidiaSmi => Ok(Arc::new(nvidia_smi::NvidiaSmiBackend::open(
            nvidia_smi::NvidiaSmiOptions::new(&config.nvidia_smi),
        )?)),
        GpuBackendKind::Auto => {
            let mut tried = Vec::new();
            match nvml::NvmlBackend::open(&config.nvml_library) {
                Ok(backend) => return Ok(Arc::new(backend)),
                Err(e) => tried.push(format!("nvml: {}", e.reason())),
            }
            match nvidia_smi::NvidiaSmiBackend::open(nvidia_smi::NvidiaSmiOptions::new(
                &config.nvidia_smi,
            )) {
                Ok(backend) => return Ok(Arc::new(backend)),
                Err(e) => tried.push(format!("nvidia-smi: {}", e.reason())),
            }
            Err(Error::NoBackend { tried })
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_names_every_backend_it_tried() {
        let config = GpuConfig {
            backend: GpuBackendKind::Auto,
            nvml_library: "/nonexistent/libnvidia-ml.so.1".to_string(),
            nvidia_smi: "/nonexistent/nvidia-smi".to_string(),
            ..GpuConfig::default()
        };
        let err = open(&config).expect_err("no backend can work here");
        let Error::NoBackend { tried } = &err else {
            panic!("expected NoBackend, got {err}")
        };
        assert_eq!(tried.len(), 2, "{tried:?}");
        assert!(tried[0].starts_with("nvml: "), "{tried:?}");
        assert!(tried[1].starts_with("nvidia-smi: "), "{tried:?}");
        assert!(tried[1].contains("/nonexistent/nvidia-smi"), "{tried:?}");
    }

    #[tokio::test]
    async fn off_runtime_calls_return_what_the_backend_says() {
        let config = GpuConfig {
            backend: GpuBackendKind::Fake,
            fake_gpus: "2x16GiB".to_string(),
            ..GpuConfig::default()
        };
        let backend = open_off_runtime(&config).await.expect("opens");
        let inventory = inventory_off_runtime(&backend).await.expect("lists");
        assert_eq!(inventory.devices.len(), 2);
    }

    #[test]
    fn fake_is_selected_by_name() {
        let config = GpuConfig {
            backend: GpuBackendKind::Fake,
            fake_gpus: "2x16GiB".to_string(),
            ..GpuConfig::default()
        };
        let backend = open(&config).expect("fake backend");
        assert_eq!(backend.name(), "fake");
        assert_eq!(backend.inventory().expect("inventory").devices.len(), 2);
    }
}
