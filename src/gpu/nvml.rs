//! The `nvml` backend: nvml-wrapper over `libnvidia-ml.so.1` (dlopen). One NVML
//! initialisation per backend (the device plugin opens one per process); the library path is
//! overridable (`[gpu] nvml_library` / `--nvml-library`).
//!
//! Health: a blocking thread waits on an NVML event set registered for critical XID errors on
//! every GPU that supports them, and forwards each as [`HealthEvent::Xid`]. It stops within
//! one wait period after the receiver is dropped.
//!
//! Not available in the static musl build: musl cannot dlopen, so [`NvmlBackend::open`] says so
//! instead of trying (use the `nvidia-smi` backend or the `gpushare-glibc` artifact).

use std::ffi::OsStr;
use std::sync::Arc;
#[cfg(target_os = "linux")]
use std::time::Duration;

use nvml_wrapper::Nvml;
#[cfg(target_os = "linux")]
use nvml_wrapper::bitmasks::event::EventTypes;
#[cfg(target_os = "linux")]
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use tokio::sync::mpsc;

use super::driver::DEFAULT_LIBRARY;
use super::{Error, ExcludedGpu, ExclusionReason, GpuBackend, GpuDevice, HealthEvent, Inventory};

/// NVML's `NVML_DEVICE_MIG_ENABLE` (nvml.h).
const NVML_DEVICE_MIG_ENABLE: u32 = 1;

#[cfg(target_os = "linux")]
/// How long one `nvmlEventSetWait` blocks before the thread checks its receiver again.
const EVENT_WAIT_MS: u32 = 5000;
#[cfg(target_os = "linux")]
/// Pause after an unexpected wait error, so a broken event set cannot spin a core.
const EVENT_ERROR_BACKOFF: Duration = Duration::from_secs(1);
#[cfg(target_os = "linux")]
/// XID number nvml-wrapper reports as "unknown" (NVML's 999).
const XID_UNKNOWN: u64 = 999;

/// NVML through nvml-wrapper.
pub struct NvmlBackend {
    nvml: Arc<Nvml>,
    library: String,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads and initialises NVML from `library` (empty: [`DEFAULT_LIBRARY`] via the loader's
    /// search path). Fails fast, with the reason, when the library is missing or the driver
    /// does not answer.
    pub fn open(library: &str) -> Result<NvmlBackend, Error> {
        let library = if library.is_empty() {
            DEFAULT_LIBRARY
        } else {
            library
        }
        .to_string();
        if cfg!(target_env = "musl") {
            return Err(Error::Nvml(format!(
                "this gpushare build is statically linked (musl) and cannot dlopen {library}; \
                 use --gpu-backend nvidia-smi or the gpushare-glibc build"
            )));
        }
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(&library))
            .init()
            .map_err(|e| Error::Nvml(format!("cannot initialise {library}: {}", describe(&e))))?;
        Ok(NvmlBackend {
            nvml: Arc::new(nvml),
            library,
        })
    }
}

/// nvml-wrapper's errors, with the underlying loader error spelled out.
fn describe(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(inner) => format!("{e}: {inner}"),
        other => other.to_string(),
    }
}

fn nvml_err(what: &str, e: NvmlError) -> Error {
    Error::Nvml(format!("{what}: {}", describe(&e)))
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> Result<Inventory, Error> {
        let nvml = &self.nvml;
        let driver_version = nvml
            .sys_driver_version()
            .map_err(|e| nvml_err("driver version", e))?;
        let count = nvml
            .device_count()
            .map_err(|e| nvml_err("device count", e))?;
        let mut devices = Vec::with_capacity(count as usize);
        let mut excluded = Vec::new();
        for i in 0..count {
            let device = nvml
                .device_by_index(i)
                .map_err(|e| nvml_err(&format!("GPU {i}: handle"), e))?;
            let at = |what: &str| format!("GPU {i}: {what}");
            let index = device.index().unwrap_or(i);
            let uuid = device.uuid().map_err(|e| nvml_err(&at("UUID"), e))?;
            let name = device.name().map_err(|e| nvml_err(&at("name"), e))?;
            // NotSupported (pre-Ampere) or a library without the call: MIG is off.
            if device
                .mig_mode()
                .is_ok_and(|m| m.current == NVML_DEVICE_MIG_ENABLE)
            {
                excluded.push(ExcludedGpu {
                    index,
                    uuid,
                    name,
                    reason: ExclusionReason::MigEnabled,
                });
                continue;
            }
            devices.push(GpuDevice {
                index,
                uuid,
                name,
                // nvml-wrapper has the minor number (the /dev/nvidiaN index) on Linux only.
                #[cfg(target_os = "linux")]
                minor: device.minor_number().ok(),
                #[cfg(not(target_os = "linux"))]
                minor: None,
                pci_bus_id: device
                    .pci_info()
                    .map_err(|e| nvml_err(&at("PCI info"), e))?
                    .bus_id,
                memory_bytes: device
                    .memory_info()
                    .map_err(|e| nvml_err(&at("memory"), e))?
                    .total,
            });
        }
        Ok(Inventory {
            backend: self.name(),
            driver_version,
            devices,
            excluded,
        })
    }

    fn memory_limits(
        &self,
    ) -> Result<Arc<dyn super::limits::MemoryLimits>, super::limits::LimitError> {
        Ok(Arc::new(super::limits::NvmlLimits::open(&self.library)?))
    }

    /// NVML event sets (XIDs) exist on Linux only.
    #[cfg(not(target_os = "linux"))]
    fn watch_health(&self) -> Result<mpsc::Receiver<HealthEvent>, Error> {
        Err(Error::Nvml("XID events are read on Linux only".to_string()))
    }

    #[cfg(target_os = "linux")]
    fn watch_health(&self) -> Result<mpsc::Receiver<HealthEvent>, Error> {
        let (tx, rx) = mpsc::channel(64);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<(), Error>>(1);
        let nvml = Arc::clone(&self.nvml);
        std::thread::Builder::new()
            .name("nvml-health".to_string())
            .spawn(move || watch_xids(&nvml, &tx, &ready_tx))
            .map_err(|e| Error::Nvml(format!("cannot start the health thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(rx),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Nvml(
                "the health thread stopped before it was ready".to_string(),
            )),
        }
    }
}

#[cfg(target_os = "linux")]
/// Registers every XID-capable GPU in one event set, reports readiness, then forwards events
/// until `tx` closes.
fn watch_xids(
    nvml: &Nvml,
    tx: &mpsc::Sender<HealthEvent>,
    ready: &std::sync::mpsc::SyncSender<Result<(), Error>>,
) {
    let set = match register_xid_events(nvml) {
        Ok(set) => set,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    while !tx.is_closed() {
        match set.wait(EVENT_WAIT_MS) {
            Ok(data) => {
                let xid = match data.event_data {
                    Some(XidError::Value(x)) => x,
                    Some(XidError::Unknown) => XID_UNKNOWN,
                    None => continue,
                };
                let uuid = data.device.uuid().ok();
                if tx.blocking_send(HealthEvent::Xid { uuid, xid }).is_err() {
                    break;
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %describe(&e), "NVML event wait failed");
                std::thread::sleep(EVENT_ERROR_BACKOFF);
            }
        }
    }
    tracing::debug!("NVML health watch stopped (receiver dropped)");
}

#[cfg(target_os = "linux")]
fn register_xid_events(nvml: &Nvml) -> Result<nvml_wrapper::EventSet<'_>, Error> {
    let mut set = nvml
        .create_event_set()
        .map_err(|e| nvml_err("event set", e))?;
    let count = nvml
        .device_count()
        .map_err(|e| nvml_err("device count", e))?;
    for i in 0..count {
        let device = nvml
            .device_by_index(i)
            .map_err(|e| nvml_err(&format!("GPU {i}: handle"), e))?;
        let supported = match device.supported_event_types() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(gpu = i, error = %describe(&e), "cannot read supported NVML events; no XID health for this GPU");
                continue;
            }
        };
        if !supported.contains(EventTypes::CRITICAL_XID_ERROR) {
            tracing::warn!(
                gpu = i,
                "GPU does not report XID events; no XID health for it"
            );
            continue;
        }
        set = device
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .map_err(|e| nvml_err(&format!("GPU {i}: register XID events"), e.error))?;
    }
    Ok(set)
}
