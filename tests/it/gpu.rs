//! GPU backends without a GPU: `nvml` through the NVML stub library (loaded by nvml-wrapper
//! exactly like the real `libnvidia-ml.so.1`), `nvidia-smi` through recorded `-q -x` outputs
//! and fake `nvidia-smi` scripts, and backend selection.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare::config::{GpuBackendKind, GpuConfig};
use gpushare::gpu::nvidia_smi::{NvidiaSmiBackend, NvidiaSmiOptions, parse_xml};
use gpushare::gpu::nvml::NvmlBackend;
use gpushare::gpu::{self, GpuBackend, HealthEvent};
use gpushare_sandbox::nvml_stub::{self, StubGpu};

use crate::support::fixture;

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

#[test]
fn nvml_mig_enabled_gpus_are_excluded_with_the_reason() {
    let (_dir, library) = stub_library();
    nvml_stub::enable_mig(&library, 1).expect("mig");
    let backend = NvmlBackend::open(path_str(&library)).expect("NVML initialises");
    let inventory = backend.inventory().expect("inventory");
    let offered: Vec<&str> = inventory.devices.iter().map(|d| d.uuid.as_str()).collect();
    assert_eq!(offered, [stub_gpus()[0].uuid.as_str()]);
    assert_eq!(inventory.excluded.len(), 1);
    assert_eq!(inventory.excluded[0].index, 1);
    assert_eq!(inventory.excluded[0].uuid, stub_gpus()[1].uuid);
    assert_eq!(
        inventory.excluded[0].reason,
        gpu::ExclusionReason::MigEnabled
    );
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

// ---- nvidia-smi ----

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn smi_fixture(name: &str) -> String {
    std::fs::read_to_string(fixture(&format!("nvidia-smi/{name}"))).expect("fixture")
}

/// Expected facts per recorded output: driver, names, minors, first GPU's memory and bus id.
struct Expect {
    file: &'static str,
    driver: &'static str,
    name: &'static str,
    minors: Vec<Option<u32>>,
    memory: u64,
    first_bus: &'static str,
}

#[test]
fn nvidia_smi_outputs_of_several_driver_generations_parse() {
    let cases = [
        Expect {
            file: "418.87.01-tesla-v100-x2.xml",
            driver: "418.87.01",
            name: "Tesla V100-SXM2-16GB",
            minors: vec![Some(0), Some(1)],
            memory: 16130 * MIB,
            first_bus: "00000000:3B:00.0",
        },
        Expect {
            file: "470.182.03-tesla-t4-x1.xml",
            driver: "470.182.03",
            name: "Tesla T4",
            minors: vec![Some(0)],
            memory: 15109 * MIB,
            first_bus: "00000000:00:1E.0",
        },
        Expect {
            file: "535.104.05-a100-80gb-x8.xml",
            driver: "535.104.05",
            name: "NVIDIA A100-SXM4-80GB",
            // DGX-style: minor numbers do not follow the enumeration order.
            minors: [2, 3, 0, 1, 6, 7, 4, 5].into_iter().map(Some).collect(),
            memory: 80 * GIB,
            first_bus: "00000000:07:00.0",
        },
        Expect {
            file: "550.54.15-h100-80gb-x4.xml",
            driver: "550.54.15",
            name: "NVIDIA H100 80GB HBM3",
            minors: vec![Some(0), Some(1), Some(2), Some(3)],
            memory: 81559 * MIB,
            first_bus: "00000000:18:00.0",
        },
        Expect {
            file: "560.35.03-wsl-rtx-4090-minor-na.xml",
            driver: "560.35.03",
            name: "NVIDIA GeForce RTX 4090",
            minors: vec![None],
            memory: 24564 * MIB,
            first_bus: "00000000:01:00.0",
        },
    ];
    for c in cases {
        let inventory =
            parse_xml(&smi_fixture(c.file)).unwrap_or_else(|e| panic!("{}: {e}", c.file));
        assert_eq!(inventory.backend, "nvidia-smi");
        assert_eq!(inventory.driver_version, c.driver, "{}", c.file);
        let minors: Vec<Option<u32>> = inventory.devices.iter().map(|d| d.minor).collect();
        assert_eq!(minors, c.minors, "{}", c.file);
        for (i, d) in inventory.devices.iter().enumerate() {
            assert_eq!(
                d.index, i as u32,
                "{}: index is the order of appearance",
                c.file
            );
            assert_eq!(d.name, c.name, "{}", c.file);
            assert_eq!(d.memory_bytes, c.memory, "{}", c.file);
            assert!(d.uuid.starts_with("GPU-"), "{}: {}", c.file, d.uuid);
        }
        assert_eq!(inventory.devices[0].pci_bus_id, c.first_bus, "{}", c.file);
        let uuids: BTreeSet<&str> = inventory.devices.iter().map(|d| d.uuid.as_str()).collect();
        assert_eq!(
            uuids.len(),
            inventory.devices.len(),
            "{}: UUIDs are distinct",
            c.file
        );
    }
}

/// Writes an executable shell script; returns its path.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn smi_options(program: &Path) -> NvidiaSmiOptions {
    let mut options = NvidiaSmiOptions::new(path_str(program));
    options.kmsg = None;
    options
}

/// Opens the backend, retrying only the "Text file busy" race of executing a script that a
/// concurrently forked test process briefly holds open for writing.
fn open_smi(options: NvidiaSmiOptions) -> Result<NvidiaSmiBackend, gpu::Error> {
    let mut last = None;
    for _ in 0..5 {
        match NvidiaSmiBackend::open(options.clone()) {
            Err(e) if e.to_string().contains("Text file busy") => last = Some(e),
            other => return other,
        }
    }
    Err(last.expect("at least one attempt"))
}

#[test]
fn fake_nvidia_smi_script_serves_the_inventory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let xml = fixture("nvidia-smi/550.54.15-h100-80gb-x4.xml");
    let program = script(
        dir.path(),
        "nvidia-smi",
        &format!("cat '{}'", path_str(&xml)),
    );
    let backend = open_smi(smi_options(&program)).expect("nvidia-smi backend");
    let inventory = backend.inventory().expect("inventory");
    assert_eq!(
        inventory,
        parse_xml(&smi_fixture("550.54.15-h100-80gb-x4.xml")).expect("parse")
    );

    // And through configuration, as the device plugin opens it.
    let config = GpuConfig {
        backend: GpuBackendKind::NvidiaSmi,
        nvidia_smi: path_str(&program).to_string(),
        ..GpuConfig::default()
    };
    let opened = gpu::open(&config).or_else(|e| {
        if e.to_string().contains("Text file busy") {
            gpu::open(&config)
        } else {
            Err(e)
        }
    });
    assert_eq!(
        opened
            .expect("configured nvidia-smi")
            .inventory()
            .expect("inventory")
            .devices
            .len(),
        4
    );
}

#[test]
fn failing_or_garbage_nvidia_smi_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let failing = script(
        dir.path(),
        "smi-fails",
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. \
         Make sure that the latest NVIDIA driver is installed and running.\"\nexit 9",
    );
    let err = open_smi(smi_options(&failing))
        .expect_err("exit 9")
        .to_string();
    assert!(err.starts_with("nvidia-smi: "), "{err}");
    assert!(err.contains("exit status: 9"), "{err}");
    assert!(
        err.contains("couldn't communicate with the NVIDIA driver"),
        "{err}"
    );

    let garbage = script(dir.path(), "smi-garbage", "echo 'this is not XML <'");
    let err = open_smi(smi_options(&garbage))
        .expect_err("garbage")
        .to_string();
    assert!(err.contains("not the expected XML"), "{err}");

    let missing = dir.path().join("no-such-nvidia-smi");
    let err = open_smi(smi_options(&missing))
        .expect_err("missing")
        .to_string();
    assert!(err.contains("cannot run"), "{err}");
    assert!(err.contains("no-such-nvidia-smi"), "{err}");

    let hanging = script(dir.path(), "smi-hangs", "exec sleep 600");
    let mut options = smi_options(&hanging);
    options.timeout = Duration::from_millis(300);
    let err = open_smi(options).expect_err("hangs").to_string();
    assert!(err.contains("did not finish within"), "{err}");
}

#[tokio::test]
async fn kernel_log_xid_lines_become_health_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let xml = fixture("nvidia-smi/418.87.01-tesla-v100-x2.xml");
    let program = script(
        dir.path(),
        "nvidia-smi",
        &format!("cat '{}'", path_str(&xml)),
    );
    let kmsg = dir.path().join("kmsg");
    std::fs::write(
        &kmsg,
        "NVRM: Xid (PCI:0000:3b:00): 13, old news before the watch\n",
    )
    .expect("kmsg");
    let mut options = smi_options(&program);
    options.kmsg = Some(kmsg.clone());
    options.poll_interval = Duration::from_secs(3600);
    let backend = open_smi(options).expect("backend");
    let mut events = backend.watch_health().expect("watch");
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&kmsg)
            .expect("open kmsg");
        f.write_all(
            b"6,2001,93847561,-;NVRM: Xid (PCI:0000:86:00): 79, pid=0, GPU has fallen off the bus.\n",
        )
        .expect("append");
    }
    let event = tokio::time::timeout(EVENT_DEADLINE, events.recv())
        .await
        .expect("an event arrives")
        .expect("channel open");
    let second_gpu = parse_xml(&smi_fixture("418.87.01-tesla-v100-x2.xml"))
        .expect("parse")
        .devices[1]
        .uuid
        .clone();
    assert_eq!(
        event,
        HealthEvent::Xid {
            uuid: Some(second_gpu),
            xid: 79
        }
    );
}

#[tokio::test]
async fn gpus_vanishing_from_nvidia_smi_are_reported_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let current = dir.path().join("current");
    let v100 = fixture("nvidia-smi/418.87.01-tesla-v100-x2.xml");
    let t4 = fixture("nvidia-smi/470.182.03-tesla-t4-x1.xml");
    std::fs::write(&current, path_str(&v100)).expect("state");
    let program = script(
        dir.path(),
        "nvidia-smi",
        &format!("cat \"$(cat '{}')\"", path_str(&current)),
    );
    let mut options = smi_options(&program);
    options.poll_interval = Duration::from_millis(50);
    let backend = open_smi(options).expect("backend");
    let mut events = backend.watch_health().expect("watch");
    // Both V100s vanish (the node now answers with another machine's list).
    std::fs::write(&current, path_str(&t4)).expect("state");
    let mut lost = BTreeSet::new();
    while lost.len() < 2 {
        match tokio::time::timeout(EVENT_DEADLINE, events.recv()).await {
            Ok(Some(HealthEvent::Lost { uuid })) => {
                lost.insert(uuid);
            }
            other => panic!("expected Lost events, got {other:?}"),
        }
    }
    let expected: BTreeSet<String> = parse_xml(&smi_fixture("418.87.01-tesla-v100-x2.xml"))
        .expect("parse")
        .devices
        .into_iter()
        .map(|d| d.uuid)
        .collect();
    assert_eq!(lost, expected);
}

// ---- real hardware (`make test-gpu`) ----

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn gpu_nvml_and_nvidia_smi_agree_on_the_real_gpus() {
    let nvml = NvmlBackend::open("").expect("NVML loads on a GPU node");
    let from_nvml = nvml.inventory().expect("NVML inventory");
    assert!(!from_nvml.devices.is_empty(), "a GPU node has GPUs");
    let smi = NvidiaSmiBackend::open(NvidiaSmiOptions::new("nvidia-smi")).expect("nvidia-smi runs");
    let from_smi = smi.inventory().expect("nvidia-smi inventory");
    assert_eq!(from_smi.driver_version, from_nvml.driver_version);
    assert_eq!(from_smi.devices.len(), from_nvml.devices.len());
    for (a, b) in from_nvml.devices.iter().zip(&from_smi.devices) {
        assert_eq!(a.index, b.index);
        assert_eq!(a.uuid, b.uuid);
        assert_eq!(a.name, b.name);
        assert_eq!(a.minor, b.minor);
        assert_eq!(a.pci_bus_id, b.pci_bus_id);
        // nvidia-smi rounds to MiB.
        assert_eq!(a.memory_bytes >> 20, b.memory_bytes >> 20, "{}", a.uuid);
    }
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU and driver"]
async fn gpu_nvml_event_set_registers_on_the_real_gpus() {
    let nvml = NvmlBackend::open("").expect("NVML loads on a GPU node");
    let events = nvml.watch_health().expect("XID event set registers");
    drop(events);
}
