//! The GPUs the node agent serves: each GPU of the inventory with its memory counted in the
//! node's unit (THAT GPU's memory; upstream used the first GPU's size for every GPU).
//!
//! Pure: no I/O. It does not decide the unit ([`super::unit_change`]) nor which path offers a
//! GPU ([`super::paths`]).

use crate::core::{GpuMem, MemoryUnit};
use crate::gpu::Inventory;

/// One GPU as the node serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedGpu {
    /// NVML index (what `NVIDIA_VISIBLE_DEVICES=<n>` and the extender's IDX mean).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Memory in units (floor of MiB over the unit size).
    pub units: GpuMem,
    /// Minor number (`/dev/nvidia<minor>`), when the backend knows it.
    pub minor: Option<u32>,
}

/// The served GPUs of an inventory, in index order, each with its own unit count.
pub(crate) fn served_gpus(inventory: &Inventory, unit: MemoryUnit) -> Vec<ServedGpu> {
    let mut gpus: Vec<ServedGpu> = inventory
        .devices
        .iter()
        .map(|d| ServedGpu {
            index: d.index,
            uuid: d.uuid.clone(),
            units: unit.units_of_bytes(d.memory_bytes),
            minor: d.minor,
        })
        .collect();
    gpus.sort_by_key(|g| g.index);
    gpus
}
