//! GPU backends without a GPU: `nvml` through the NVML stub library (loaded by nvml-wrapper
//! exactly like the real `libnvidia-ml.so.1`), `nvidia-smi` through recorded `-q -x` outputs
//! and fake `nvidia-smi` scripts, and backend selection.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare::config::{GpuBackendKind, GpuConfig};
use gpushare::gpu::nvml::NvmlBackend;
use gpushare::gpu::{self, GpuBackend, HealthEvent};
use gpushare::sandbox::nvml_stub::{self, StubGpu};

/// Generous bound for an event to arrive; never a timing assertion, only a hang guard.
const EVENT_DEADLINE: Duration = Duration::from_secs(30);

fn stub_gpus() -> Vec<StubGpu> {
    vec![
        StubGpu {
            uuid: "GPU-11111111-2222-3333-4444-555555555555".into(),
            name: "Tesla V100-SXM2-16GB".into(),
            memory_mib: 16160,
            minor: Some(0),
            pci_bus_id: "00000000:3B:00.0".into(),
        },
        StubGpu {
            uuid: "GPU-66666666-7777-8888-9999-000000000000".into(),
            name: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib: 81920,
            minor: None,
            pci_bus_id: "00000000:86:00.0".into(),
        },
    ]
}

/// A stub library with `stub_gpus()` in its own tempdir.
fn stub_library() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let library = nvml_stub::build(dir.path()).expect("the NVML stub builds with the system cc");
    nvml_stub::write_config(&library, "535.104.05", &stub_gpus()).expect("stub config");
    (dir, library)
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

#[test]
fn nvml_inventory_comes_from_the_library() {
    let (_dir, library) = stub_library();
    let backend = NvmlBackend::open(path_str(&library)).expect("NVML initialises");
    let inventory = backend.inventory().expect("inventory");
    assert_eq!(inventory.backend, "nvml");
    assert_eq!(inventory.driver_version, "535.104.05");
    assert_eq!(inventory.devices.len(), 2);
    for (i, (device, stub)) in inventory.devices.iter().zip(stub_gpus()).enumerate() {
        assert_eq!(device.index, i as u32);
        assert_eq!(device.uuid, stub.uuid);
        assert_eq!(device.name, stub.name);
        assert_eq!(device.minor, stub.minor);
        assert_eq!(device.pci_bus_id, stub.pci_bus_id);
        assert_eq!(device.memory_bytes, stub.memory_mib << 20);
    }
}

#[tokio::test]
async fn nvml_xid_appended_at_run_time_becomes_a_health_event() {
    let (_dir, library) = stub_library();
    let backend = NvmlBackend::open(path_str(&library)).expect("NVML initialises");
    // An XID logged before anyone watched is history, not an event.
    nvml_stub::append_xid(&library, 0, 31).expect("append");
    let mut events = backend.watch_health().expect("event set registered");
    nvml_stub::append_xid(&library, 1, 79).expect("append");
    let event = tokio::time::timeout(EVENT_DEADLINE, events.recv())
        .await
        .expect("an event arrives")
        .expect("channel open");
    assert_eq!(
        event,
        HealthEvent::Xid {
            uuid: Some(stub_gpus()[1].uuid.clone()),
            xid: 79
        }
    );
    nvml_stub::append_xid(&library, 0, 48).expect("append");
    let event = tokio::time::timeout(EVENT_DEADLINE, events.recv())
        .await
        .expect("a second event arrives")
        .expect("channel open");
    assert_eq!(
        event,
        HealthEvent::Xid {
            uuid: Some(stub_gpus()[0].uuid.clone()),
            xid: 48
        }
    );
}

#[test]
fn nvml_without_driver_fails_fast_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let library = nvml_stub::build(dir.path()).expect("stub builds");
    // No nvml_stub.conf: the stub behaves like NVML on a machine without the driver.
    let err = NvmlBackend::open(path_str(&library))
        .expect_err("no driver")
        .to_string();
    assert!(err.starts_with("NVML: "), "{err}");
    assert!(err.to_lowercase().contains("driver"), "{err}");

    let missing = dir.path().join("nope/libnvidia-ml.so.1");
    let err = NvmlBackend::open(path_str(&missing))
        .expect_err("no library")
        .to_string();
    assert!(err.contains("nope/libnvidia-ml.so.1"), "{err}");
}

#[test]
fn auto_prefers_nvml_when_it_loads() {
    let (_dir, library) = stub_library();
    let config = GpuConfig {
        backend: GpuBackendKind::Auto,
        nvml_library: path_str(&library).to_string(),
        nvidia_smi: "/nonexistent/nvidia-smi".to_string(),
        ..GpuConfig::default()
    };
    let backend = gpu::open(&config).expect("auto finds nvml");
    assert_eq!(backend.name(), "nvml");
    assert_eq!(backend.inventory().expect("inventory").devices.len(), 2);
}
