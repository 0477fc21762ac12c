//! GPU access behind one trait, [`GpuBackend`]: inventory (index, UUID, name, minor number,
//! PCI bus id, memory), driver version, and health events (XIDs).
//!
//! Backends (ARCHITECTURE.md §6): `nvml` (nvml-wrapper, dlopen of `libnvidia-ml.so.1`; only in
//! dynamically linked builds), `nvidia-smi` (parses `nvidia-smi -q -x`; how the static musl
//! binary reaches the driver), `fake` (GPUs from configuration). [`open`] picks one per
//! `[gpu] backend`; `auto` tries nvml then nvidia-smi and, when both fail, returns an error
//! naming what was tried — it never blocks (upstream hung forever).
//!
//! Only this module touches NVML. [`mps`] drives the CUDA MPS control program; [`limits`] sets
//! and reads the driver's per-cgroup memory limits.

mod backend;
pub mod cdi;
mod driver;
pub mod fake;
pub mod limits;
pub mod mps;
pub mod nvidia_smi;
pub mod nvml;

use std::sync::Arc;

use crate::config::{GpuBackendKind, GpuConfig};

pub use backend::{
    Error, ExcludedGpu, ExclusionReason, GpuBackend, GpuDevice, HealthEvent, Inventory,
};

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
    #[arg(long, value_name = "SPEC", value_parser = fake_gpus_flag)]
    pub fake_gpus: Option<String>,
    /// Path of libnvidia-ml.so.1 [config: gpu.nvml_library; default: the loader's search path]
    #[arg(long, value_name = "PATH")]
    pub nvml_library: Option<String>,
    /// The nvidia-smi program [config: gpu.nvidia_smi; default nvidia-smi on PATH]
    #[arg(long, value_name = "PATH")]
    pub nvidia_smi: Option<String>,
    /// Kernel log read for XID lines by the nvidia-smi backend: /dev/kmsg, or a file or FIFO
    /// [config: gpu.kmsg_path; default /dev/kmsg]
    #[arg(long, value_name = "PATH")]
    pub kmsg_path: Option<String>,
    /// Read the kernel log from its start (replay a recorded log) [config: gpu.kmsg_replay]
    #[arg(long)]
    pub kmsg_replay: bool,
}

impl GpuArgs {
    /// The flags as configuration overrides.
    pub(crate) fn overrides(&self, flags: &mut crate::config::FlagOverrides) {
        let GpuArgs {
            gpu_backend,
            fake_gpus,
            nvml_library,
            nvidia_smi,
            kmsg_path,
            kmsg_replay,
        } = self;
        flags
            .set("gpu.backend", *gpu_backend)
            .set("gpu.fake_gpus", fake_gpus.clone())
            .set("gpu.nvml_library", nvml_library.clone())
            .set("gpu.nvidia_smi", nvidia_smi.clone())
            .set("gpu.kmsg_path", kmsg_path.clone())
            .set_flag("gpu.kmsg_replay", *kmsg_replay);
    }
}

/// Checks what configuration alone decides, before anything is opened: with the `fake`
/// backend, the fake GPUs must be described and the description must parse.
pub fn check_config(config: &GpuConfig) -> Result<(), Error> {
    match config.backend {
        GpuBackendKind::Fake => fake::parse_spec(&config.fake_gpus).map(|_| ()),
        _ => Ok(()),
    }
}

/// `--fake-gpus` as the command line takes it (`device-plugin`, `doctor`, `demo`): a value
/// that does not parse is a usage error (exit 64), named by clap with the flag.
pub fn fake_gpus_flag(spec: &str) -> Result<String, Error> {
    fake::parse_spec(spec)?;
    Ok(spec.to_string())
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
            nvidia_smi::NvidiaSmiOptions::from_config(config),
        )?)),
        GpuBackendKind::Auto => {
            let mut tried = Vec::new();
            match nvml::NvmlBackend::open(&config.nvml_library) {
                Ok(backend) => return Ok(Arc::new(backend)),
                Err(e) => tried.push(format!("nvml: {}", e.reason())),
            }
            match nvidia_smi::NvidiaSmiBackend::open(nvidia_smi::NvidiaSmiOptions::from_config(
                config,
            )) {
                Ok(backend) => return Ok(Arc::new(backend)),
                Err(e) => tried.push(format!("nvidia-smi: {}", e.reason())),
            }
            Err(Error::NoBackend { tried })
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
    fn the_kmsg_flags_reach_the_nvidia_smi_options() {
        let args = GpuArgs {
            kmsg_path: Some("/run/gpushare/kmsg.fifo".to_string()),
            kmsg_replay: true,
            ..GpuArgs::default()
        };
        let mut flags = crate::config::FlagOverrides::default();
        args.overrides(&mut flags);
        let config = crate::config::load(None, flags).expect("config");
        let options = nvidia_smi::NvidiaSmiOptions::from_config(&config.gpu);
        assert_eq!(
            options.kmsg.as_deref(),
            Some(std::path::Path::new("/run/gpushare/kmsg.fifo"))
        );
        assert!(options.kmsg_replay);
        // The default is /dev/kmsg; an empty path turns the kernel log off.
        let default = nvidia_smi::NvidiaSmiOptions::from_config(&GpuConfig::default());
        assert_eq!(
            default.kmsg.as_deref(),
            Some(std::path::Path::new(nvidia_smi::DEFAULT_KMSG))
        );
        let off = GpuConfig {
            kmsg_path: String::new(),
            ..GpuConfig::default()
        };
        assert_eq!(nvidia_smi::NvidiaSmiOptions::from_config(&off).kmsg, None);
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
