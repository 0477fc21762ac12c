//! The recorded HGX H100 node (`tests/fixtures/rdma/hgx-h100-8gpu-roce`) as the device-kind
//! tests of both paths use it: fake GPUs with the tree's PCI bus ids, the HCA INDEX pairs
//! with each GPU, a fake `/dev` holding the tree's `/dev/infiniband` and a few generic nodes,
//! and a generic declaration's path.

use std::path::Path;

use gpushare::config::devices::DevicePathConfig;
use gpushare::gpu::GpuDevice;
use gpushare::gpu::fake::{FakeBackend, fake_uuid};

use super::fixture;

/// The HGX H100 tree's GPUs, in index order (INDEX.md's pairing order).
pub const HGX_GPUS: [&str; 8] = [
    "00000000:19:00.0",
    "00000000:3B:00.0",
    "00000000:4C:00.0",
    "00000000:5D:00.0",
    "00000000:9B:00.0",
    "00000000:BB:00.0",
    "00000000:CB:00.0",
    "00000000:DB:00.0",
];
/// The 400G ConnectX-7 behind each GPU's switch (INDEX.md; `tests/it/rdma.rs` checks the
/// same pairing on the tree itself).
pub const HGX_NEAREST: [&str; 8] = [
    "mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11",
];

pub fn hgx_backend() -> FakeBackend {
    FakeBackend::new(
        HGX_GPUS
            .iter()
            .enumerate()
            .map(|(i, bus)| {
                let index = u32::try_from(i).expect("index");
                GpuDevice {
                    index,
                    uuid: fake_uuid(index),
                    name: "NVIDIA H100 80GB HBM3".to_string(),
                    minor: Some(index),
                    pci_bus_id: (*bus).to_string(),
                    memory_bytes: 80 << 30,
                }
            })
            .collect(),
    )
}

/// A `/dev` holding the HGX tree's `/dev/infiniband`, `/dev/fuse` and two USB serial ports.
pub fn fake_dev(dir: &Path) {
    let ib = dir.join("infiniband");
    std::fs::create_dir_all(&ib).expect("mkdir");
    let src = fixture("rdma/hgx-h100-8gpu-roce/dev/infiniband");
    for e in std::fs::read_dir(&src).expect("fixture dev") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), ib.join(e.file_name())).expect("copy");
    }
    for f in ["fuse", "ttyUSB0", "ttyUSB1", "ttyACM0"] {
        std::fs::write(dir.join(f), "").expect("node");
    }
}

pub fn dev_path(p: &str) -> DevicePathConfig {
    DevicePathConfig {
        path: p.to_string(),
        container_path: None,
        permissions: "rw".to_string(),
        optional: false,
    }
}
