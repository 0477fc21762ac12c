//! The GPU checks: `gpu-access` (which backend serves, why the others do not, the devices it
//! found, the GPUs it leaves out and why: MIG mode, incomplete records), `driver-version`
//! (>= 361.93; a Jetson/L4T release number is named as such, not compared) and `memory-unit` (the fake device list fits the
//! kubelet's 4 MiB ListAndWatch message).
//!
//! GPU access goes through [`crate::gpu::open`] like the device plugin's; it runs on its own
//! thread under a deadline so a wedged driver or `nvidia-smi` cannot hang doctor.

use std::sync::Arc;
use std::time::Duration;

use prost::encoding::encoded_len_varint;

use super::host::HostRoot;
use super::report::{Check, Status};
use crate::config::{GpuBackendKind, GpuConfig};
use crate::core::{MemoryUnit, wire};
use crate::gpu::{ExclusionReason, GpuDevice, Inventory};
use crate::kubelet_api::KUBELET_MAX_MESSAGE_BYTES;

/// The oldest driver gpushare supports (the device plugin API's NVML calls need it).
pub(crate) const MIN_DRIVER: (u64, u64) = (361, 93);

/// Driver versions with a major number below this are Jetson / L4T release numbers
/// (`35.3.1`), not driver branches: every NVIDIA desktop and datacenter driver since the
/// 1.0-xxxx scheme ended (2008) has a three-digit major.
pub(crate) const L4T_MAJOR_BELOW: u64 = 100;

/// How long GPU discovery may take before doctor gives up on it.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(15);

/// What opening the configured GPU backend gave.
#[derive(Clone, Debug)]
pub struct Probe {
    /// The backend asked for (`auto` included).
    pub configured: GpuBackendKind,
    /// The inventory, or why there is none.
    pub result: Result<Inventory, ProbeError>,
    /// Why other backends do not serve (for `auto`).
    pub notes: Vec<String>,
}

impl Probe {
    /// The devices, when discovery worked.
    pub fn devices(&self) -> Option<&[GpuDevice]> {
        self.result.as_ref().ok().map(|i| i.devices.as_slice())
    }
}

/// Why GPU discovery gave no inventory (the GPU checks report it).
#[derive(Clone, Debug, thiserror::Error)]
pub enum ProbeError {
    /// The configured backend could not be opened.
    #[error("{0}")]
    Open(Arc<crate::gpu::Error>),
    /// The backend opened but could not list the GPUs.
    #[error("{backend}: {error}")]
    Inventory {
        /// The backend's name.
        backend: &'static str,
        /// Why.
        error: Arc<crate::gpu::Error>,
    },
    /// The probe's thread could not be started.
    #[error("cannot start the GPU probe: {0}")]
    Thread(Arc<std::io::Error>),
    /// The probe's thread ended without sending its result.
    #[error("the GPU probe ended without an answer")]
    Vanished,
    /// The backend did not answer within the probe's deadline.
    #[error("no answer from the {backend} backend within {secs} s (driver or nvidia-smi hung?)")]
    TimedOut {
        /// The backend asked for.
        backend: &'static str,
        /// The deadline in seconds.
        secs: u64,
    },
}

fn backend_label(kind: GpuBackendKind) -> &'static str {
    match kind {
        GpuBackendKind::Auto => "auto",
        GpuBackendKind::Nvml => "nvml",
        GpuBackendKind::NvidiaSmi => "nvidia-smi",
        GpuBackendKind::Fake => "fake",
    }
}

fn open_and_list(config: &GpuConfig) -> Result<Inventory, ProbeError> {
    let backend = crate::gpu::open(config).map_err(|e| ProbeError::Open(Arc::new(e)))?;
    backend.inventory().map_err(|e| ProbeError::Inventory {
        backend: backend.name(),
        error: Arc::new(e),
    })
}

/// Opens the backend `config` selects and reads its inventory, within [`PROBE_TIMEOUT`].
pub async fn probe(config: &GpuConfig) -> Probe {
    probe_within(config, PROBE_TIMEOUT).await
}

async fn probe_within(config: &GpuConfig, limit: Duration) -> Probe {
    let configured = config.backend;
    let cfg = config.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    // A plain thread, not spawn_blocking: a wedged driver call must not hold up the runtime's
    // shutdown when doctor exits.
    let spawned = std::thread::Builder::new()
        .name("doctor-gpu-probe".to_string())
        .spawn(move || {
            let result = open_and_list(&cfg);
            let mut notes = Vec::new();
            if cfg.backend == GpuBackendKind::Auto
                && result.as_ref().is_ok_and(|inv| inv.backend != "nvml")
            {
                let nvml_only = GpuConfig {
                    backend: GpuBackendKind::Nvml,
                    ..cfg.clone()
                };
                if let Err(e) = open_and_list(&nvml_only) {
                    notes.push(format!("nvml does not serve: {e}"));
                }
            }
            let _ = tx.send((result, notes));
        });
    if let Err(e) = spawned {
        return Probe {
            configured,
            result: Err(ProbeError::Thread(Arc::new(e))),
            notes: Vec::new(),
        };
    }
    let mut notes = Vec::new();
    if crate::buildinfo::is_static_binary()
        && matches!(configured, GpuBackendKind::Auto | GpuBackendKind::Nvml)
    {
        notes.push(
            "this gpushare binary is statically linked: it cannot dlopen libnvidia-ml.so.1, so NVML \
             is out of reach and nvidia-smi serves (the gpushare-glibc build uses NVML directly)"
                .to_string(),
        );
    }
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok((result, more))) => {
            notes.extend(more);
            Probe {
                configured,
                result,
                notes,
            }
        }
        Ok(Err(_)) => Probe {
            configured,
            result: Err(ProbeError::Vanished),
            notes,
        },
        Err(_) => Probe {
            configured,
            result: Err(ProbeError::TimedOut {
                backend: backend_label(configured),
                secs: limit.as_secs(),
            }),
            notes,
        },
    }
}

/// `gpu-access`: which backend serves and what it found.
pub fn gpu_access(probe: &Probe, config: &GpuConfig) -> Check {
    const ID: &str = "gpu-access";
    const TITLE: &str = "GPU access";
    let asked = match probe.configured {
        GpuBackendKind::Nvml if !config.nvml_library.is_empty() => {
            format!("nvml (library {})", config.nvml_library)
        }
        GpuBackendKind::NvidiaSmi => format!("nvidia-smi (program {})", config.nvidia_smi),
        GpuBackendKind::Fake => format!("fake, fake GPUs {:?}", config.fake_gpus),
        other => backend_label(other).to_string(),
    };
    let mut lines = Vec::new();
    let status = match &probe.result {
        Ok(inv) => {
            let driver = if inv.driver_version.is_empty() {
                "unknown"
            } else {
                &inv.driver_version
            };
            lines.push(format!(
                "backend {} serves {} GPU(s), driver {driver} (asked for {asked})",
                inv.backend,
                inv.devices.len()
            ));
            for d in &inv.devices {
                lines.push(format!(
                    "GPU {}: {}, {} MiB, {}",
                    d.index,
                    d.name,
                    d.memory_bytes / (1024 * 1024),
                    d.uuid
                ));
            }
            for g in &inv.excluded {
                lines.push(format!(
                    "GPU {}: {}{}{} not offered: {}",
                    g.index,
                    g.name,
                    if g.uuid.is_empty() { "" } else { ", " },
                    g.uuid,
                    g.reason
                ));
            }
            if inv.devices.is_empty() {
                Status::Fail
            } else if inv.excluded.is_empty() {
                Status::Ok
            } else {
                Status::Warn
            }
        }
        Err(e) => {
            lines.push(format!("backend {asked}: {e}"));
            Status::Fail
        }
    };
    lines.extend(probe.notes.iter().cloned());
    let check = Check::new(ID, TITLE, status, lines.join("\n"));
    if status == Status::Ok {
        return check;
    }
    let mig = probe.result.as_ref().is_ok_and(|i| {
        i.excluded
            .iter()
            .any(|g| g.reason == ExclusionReason::MigEnabled)
    });
    if mig {
        let hint = "gpushare shares whole GPUs: disable MIG on the GPUs to share (nvidia-smi -i <index> -mig 0, then reset the GPU),\n\
                    or leave them to NVIDIA's device plugin (MIG strategy single/mixed) on nodes without gpushare";
        return check.hint(hint);
    }
    if probe.result.as_ref().is_err_and(|e| {
        e.to_string()
            .contains(crate::gpu::nvidia_smi::DUPLICATE_UUIDS)
    }) {
        return check.hint(
            "every GPU needs its own UUID (the device IDs are <UUID>-_-<n>): compare `nvidia-smi -L`;\n\
             an output with anonymised or copied UUIDs cannot serve, and a real duplicate is a driver fault (reset the GPUs)",
        );
    }
    if probe.result.as_ref().is_ok_and(|i| i.devices.is_empty()) {
        return check.hint(
            "the driver sees no GPU: check `nvidia-smi -L`, the kernel module (lsmod | grep nvidia) and dmesg",
        );
    }
    check.hint(match probe.configured {
        GpuBackendKind::Nvml => {
            "NVML must load: libnvidia-ml.so.1 present (see nvml-library) and the driver loaded;\n\
             a statically linked gpushare cannot load it: use --gpu-backend nvidia-smi or the gpushare-glibc build"
        }
        GpuBackendKind::NvidiaSmi => {
            "nvidia-smi must run: `nvidia-smi -q -x` on the host; in a container use the nvidia runtime with\n\
             NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=utility"
        }
        GpuBackendKind::Fake => "describe the fake GPUs, e.g. --fake-gpus 2x16GiB",
        GpuBackendKind::Auto => {
            "install the NVIDIA driver and check `nvidia-smi` works; in a container use the nvidia runtime with\n\
             NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=utility (see container-runtime)"
        }
    })
}

/// A dotted version's numeric components (`550.54.15` → `[550, 54, 15]`); `None` if not one.
pub(crate) fn parse_version(text: &str) -> Option<Vec<u64>> {
    let parts: Option<Vec<u64>> = text.split('.').map(|p| p.parse().ok()).collect();
    parts.filter(|p| p.len() >= 2)
}

/// The driver version in `/proc/driver/nvidia/version` text.
pub fn proc_driver_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|tok| parse_version(tok).is_some())
        .map(str::to_string)
}

const PROC_VERSION: &str = "/proc/driver/nvidia/version";

/// `driver-version`: the NVIDIA driver is loaded and at least [`MIN_DRIVER`].
pub fn driver_version(host: &HostRoot, probe: &Probe) -> Check {
    const ID: &str = "driver-version";
    const TITLE: &str = "NVIDIA driver version";
    let from_backend = probe
        .result
        .as_ref()
        .ok()
        .filter(|inv| inv.backend != "fake" && !inv.driver_version.is_empty())
        .map(|inv| {
            (
                inv.driver_version.clone(),
                format!("from the {} backend", inv.backend),
            )
        });
    let from_proc = || {
        host.read(PROC_VERSION)
            .map(|text| match proc_driver_version(&text) {
                Some(v) => (v, format!("from {PROC_VERSION}")),
                None => (
                    String::new(),
                    format!("{PROC_VERSION} has no NVRM version line"),
                ),
            })
    };
    let min = format!("{}.{}", MIN_DRIVER.0, MIN_DRIVER.1);
    let Some((version, source)) = from_backend.or_else(from_proc) else {
        if let Some(inv) = probe.result.as_ref().ok().filter(|i| i.backend != "fake") {
            return Check::new(
                ID,
                TITLE,
                Status::Warn,
                format!(
                    "driver version unknown: the {} backend found {} GPU(s) but did not report the driver \
                     version, and there is no {PROC_VERSION}",
                    inv.backend,
                    inv.devices.len()
                ),
            )
            .hint(format!(
                "check `nvidia-smi -q | grep 'Driver Version'` or `cat {PROC_VERSION}`: {min} or newer is needed"
            ));
        }
        if probe.configured == GpuBackendKind::Fake {
            return Check::new(
                ID,
                TITLE,
                Status::Skip,
                format!("fake GPU backend and no {PROC_VERSION}: no driver on this host"),
            );
        }
        return Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!("no NVIDIA driver found: no {PROC_VERSION} and no GPU backend answered"),
        )
        .hint(format!(
            "install the NVIDIA driver ({min} or newer) and load its kernel module (modprobe nvidia)"
        ));
    };
    let Some(parts) = parse_version(&version) else {
        return Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!("cannot read the driver version {version:?} ({source})"),
        );
    };
    if parts[0] < L4T_MAJOR_BELOW {
        return Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!(
                "{version} ({source}) is a Jetson / L4T (Tegra) release number, not an NVIDIA desktop or \
                 datacenter driver version (those are 100 and up): gpushare does not support Jetson/L4T"
            ),
        )
        .hint(
            "Jetson's integrated GPU has no memory of its own (it shares system RAM) and NVML there does not\n\
             enumerate it the way the device plugin needs, so there is no GPU memory to share: run gpushare on\n\
             nodes with discrete NVIDIA GPUs and leave Jetson nodes to NVIDIA's own device plugin",
        );
    }
    let detail = format!("{version} ({source}); {min} or newer is needed");
    if (parts[0], parts[1]) >= MIN_DRIVER {
        Check::new(ID, TITLE, Status::Ok, detail)
    } else {
        Check::new(ID, TITLE, Status::Fail, detail).hint(format!(
            "upgrade the NVIDIA driver to {min} or newer (a current LTS branch is best)"
        ))
    }
}

/// Bytes of the ListAndWatch message advertising every unit of every device in `unit`,
/// counted as protobuf encodes it: per fake ID `<UUID>-_-<n>` a `Device{ID, health, topology}`
/// (the NUMA topology counted as present, an upper bound).
pub(crate) fn list_and_watch_bytes(devices: &[GpuDevice], unit: MemoryUnit) -> u64 {
    const TOPOLOGY: u64 = 6; // 0x1a len { 0x0a len { 0x08 numa } }
    let health = wire::HEALTHY.len() as u64;
    let health_field = 1 + encoded_len_varint(health) as u64 + health;
    let mut total = 0u64;
    for d in devices {
        let units = unit.units_of_bytes(d.memory_bytes).units();
        let prefix = (d.uuid.len() + wire::FAKE_ID_SEPARATOR.len()) as u64;
        // Group the units by the number of decimal digits of n.
        let mut start = 0u64;
        let mut digits = 1u32;
        while start < units {
            let end = 10u64.saturating_pow(digits).min(units);
            let id_len = prefix + digits as u64;
            let device = 1 + encoded_len_varint(id_len) as u64 + id_len + health_field + TOPOLOGY;
            let per = 1 + encoded_len_varint(device) as u64 + device;
            total = total.saturating_add(per.saturating_mul(end - start));
            start = end;
            digits += 1;
        }
    }
    total
}

/// Units offered for `devices` in `unit`.
fn total_units(devices: &[GpuDevice], unit: MemoryUnit) -> u64 {
    devices
        .iter()
        .map(|d| unit.units_of_bytes(d.memory_bytes).units())
        .sum()
}

/// Units a fix may suggest, finest first.
const CANDIDATE_UNITS_MIB: &[u32] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

/// `memory-unit`: the chosen unit keeps ListAndWatch under the kubelet's 4 MiB limit.
pub fn memory_unit(unit: MemoryUnit, devices: Option<&[GpuDevice]>) -> Check {
    const ID: &str = "memory-unit";
    const TITLE: &str = "memory unit fits the kubelet's 4 MiB ListAndWatch limit";
    let Some(devices) = devices.filter(|d| !d.is_empty()) else {
        return Check::new(
            ID,
            TITLE,
            Status::Skip,
            format!("unit {unit}; no GPU inventory to size it against (see gpu-access)"),
        );
    };
    let limit = KUBELET_MAX_MESSAGE_BYTES as u64;
    let bytes = list_and_watch_bytes(devices, unit);
    let units = total_units(devices, unit);
    let detail = format!(
        "unit {unit}: {units} device IDs, ListAndWatch about {} KiB of the {} KiB limit ({}%)",
        bytes.div_ceil(1024),
        limit / 1024,
        bytes.saturating_mul(100) / limit
    );
    let finest_fit = CANDIDATE_UNITS_MIB
        .iter()
        .filter_map(|m| MemoryUnit::from_mib(*m))
        .find(|u| list_and_watch_bytes(devices, *u) <= limit / 2);
    let suggestion = finest_fit.map_or_else(
        || "use a coarser unit, e.g. --memory-unit 2GiB".to_string(),
        |u| {
            format!(
                "use --memory-unit {u} (or coarser, e.g. GiB): {} device IDs, about {} KiB",
                total_units(devices, u),
                list_and_watch_bytes(devices, u).div_ceil(1024)
            )
        },
    );
    if bytes > limit {
        return Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!("{detail}\nkubelet rejects the message (ResourceExhausted) and the node shows gpu-mem 0"),
        )
        .hint(suggestion);
    }
    if bytes > limit * 3 / 4 {
        return Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!("{detail}\nclose to the limit"),
        )
        .hint(suggestion);
    }
    if let Some(small) = devices
        .iter()
        .find(|d| unit.units_of_bytes(d.memory_bytes).is_zero())
    {
        return Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!(
                "{detail}\nGPU {} has less than one {unit}: it offers nothing",
                small.index
            ),
        )
        .hint("use a finer unit, e.g. --memory-unit 256MiB");
    }
    Check::new(ID, TITLE, Status::Ok, detail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet_api::deviceplugin::{Device, ListAndWatchResponse, NumaNode, TopologyInfo};
    use prost::Message;

    fn gpu(index: u32, gib: u64) -> GpuDevice {
        GpuDevice {
            index,
            uuid: format!("GPU-{index:08}-aaaa-bbbb-cccc-dddddddddddd"),
            name: "Tesla V100".to_string(),
            minor: Some(index),
            pci_bus_id: String::new(),
            memory_bytes: gib << 30,
        }
    }

    #[test]
    fn proc_version_lines_of_both_kernel_modules() {
        let proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:54 UTC 2024\nGCC version:  gcc version 12.3.0\n";
        assert_eq!(
            proc_driver_version(proprietary).as_deref(),
            Some("550.54.15")
        );
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build  (dvs-builder@U16-I3-B03-4-3)  Fri Aug 16 21:42:42 UTC 2024\n";
        assert_eq!(proc_driver_version(open).as_deref(), Some("560.35.03"));
        assert_eq!(proc_driver_version("garbage"), None);
        assert_eq!(parse_version("361.93"), Some(vec![361, 93]));
        assert_eq!(parse_version("fake"), None);
    }

    #[test]
    fn the_size_estimate_is_the_protobuf_size() {
        let devices = [gpu(0, 2), gpu(1, 3)];
        let unit = MemoryUnit::from_mib(64).unwrap();
        let mut msg = ListAndWatchResponse::default();
        for d in &devices {
            for n in 0..unit.units_of_bytes(d.memory_bytes).units() {
                msg.devices.push(Device {
                    id: wire::fake_device_id(&d.uuid, n),
                    health: wire::HEALTHY.to_string(),
                    topology: Some(TopologyInfo {
                        nodes: vec![NumaNode { id: 1 }],
                    }),
                });
            }
        }
        assert_eq!(
            list_and_watch_bytes(&devices, unit),
            msg.encoded_len() as u64
        );
    }

    #[test]
    fn mib_on_big_gpus_fails_and_suggests_a_unit_that_fits() {
        // 8 × 80 GiB in MiB: 655360 IDs, far over 4 MiB (upstream DP#39).
        let devices: Vec<_> = (0..8).map(|i| gpu(i, 80)).collect();
        let c = memory_unit(MemoryUnit::MIB, Some(&devices));
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.hint.contains("--memory-unit 32MiB"), "{c:?}");
        assert_eq!(
            memory_unit(MemoryUnit::GIB, Some(&devices)).status,
            Status::Ok
        );
        assert_eq!(memory_unit(MemoryUnit::GIB, None).status, Status::Skip);
        // 1 × 16 GiB in MiB fits.
        assert_eq!(
            memory_unit(MemoryUnit::MIB, Some(&[gpu(0, 16)])).status,
            Status::Ok
        );
    }

    #[test]
    fn old_and_new_drivers() {
        let host = HostRoot::new("/nonexistent-root");
        let probe = |v: &str| Probe {
            configured: GpuBackendKind::Nvml,
            result: Ok(Inventory {
                backend: "nvml",
                driver_version: v.to_string(),
                devices: vec![gpu(0, 16)],
                excluded: vec![],
            }),
            notes: vec![],
        };
        assert_eq!(
            driver_version(&host, &probe("550.54.15")).status,
            Status::Ok
        );
        assert_eq!(driver_version(&host, &probe("361.93")).status, Status::Ok);
        assert_eq!(
            driver_version(&host, &probe("340.108")).status,
            Status::Fail
        );
        let none = Probe {
            configured: GpuBackendKind::Auto,
            result: Err(ProbeError::Vanished),
            notes: vec![],
        };
        assert_eq!(driver_version(&host, &none).status, Status::Fail);
        let fake = Probe {
            configured: GpuBackendKind::Fake,
            ..none
        };
        assert_eq!(driver_version(&host, &fake).status, Status::Skip);
    }

    #[test]
    fn a_jetson_l4t_version_is_named_not_compared() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            dir.path().join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  35.3.1  Release Build  (buildbrain@mobile-u64-6289-d7000)  Sun Mar 19 08:09:33 PDT 2023\n",
        )
        .unwrap();
        let fake = Probe {
            configured: GpuBackendKind::Fake,
            result: Err(ProbeError::Vanished),
            notes: vec![],
        };
        let c = driver_version(&HostRoot::new(dir.path()), &fake);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("Jetson / L4T"), "{c:?}");
        assert!(!c.hint.contains("361.93"), "{c:?}");
    }

    #[tokio::test]
    async fn a_missing_nvml_library_fails_quickly_with_the_path() {
        let config = GpuConfig {
            backend: GpuBackendKind::Nvml,
            nvml_library: "/nonexistent/libnvidia-ml.so.1".to_string(),
            ..GpuConfig::default()
        };
        let p = probe(&config).await;
        let c = gpu_access(&p, &config);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("/nonexistent/libnvidia-ml.so.1"), "{c:?}");
        assert!(!c.hint.is_empty());
    }
}
