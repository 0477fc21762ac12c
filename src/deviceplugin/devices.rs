//! The fake devices advertised to kubelet: one `<UUID>-_-<n>` per memory unit, per GPU from
//! THAT GPU's memory (upstream used the first GPU's size for every GPU), and the guard that
//! keeps the ListAndWatch message under kubelet's 4 MiB receive limit.
//!
//! Pure: no I/O, no clock. Health comes in as a predicate.

use std::fmt;

use prost::encoding::encoded_len_varint;

use crate::core::MemoryUnit;
use crate::core::wire::{FAKE_ID_SEPARATOR, HEALTHY, UNHEALTHY, fake_device_id};
use crate::gpu::Inventory;
use crate::kubelet_api::KUBELET_MAX_MESSAGE_BYTES;
use crate::kubelet_api::deviceplugin::{Device, ListAndWatchResponse};
use crate::node::gpus::{ServedGpu, served_gpus};

/// The ListAndWatch message: every unit of every GPU, `Unhealthy` where `healthy(uuid)` is false.
pub(crate) fn list_and_watch_response(
    gpus: &[ServedGpu],
    healthy: impl Fn(&str) -> bool,
) -> ListAndWatchResponse {
    let mut devices = Vec::with_capacity(
        gpus.iter()
            .map(|g| usize::try_from(g.units.units()).unwrap_or(0))
            .sum(),
    );
    for gpu in gpus {
        let health = if healthy(&gpu.uuid) {
            HEALTHY
        } else {
            UNHEALTHY
        };
        for n in 0..gpu.units.units() {
            devices.push(Device {
                id: fake_device_id(&gpu.uuid, n),
                health: health.to_string(),
                topology: None,
            });
        }
    }
    ListAndWatchResponse { devices }
}

/// The largest ListAndWatch message these GPUs can produce (every device `Unhealthy`), in
/// bytes on the wire including the 5-byte gRPC frame header. Computed without building it.
pub(crate) fn worst_case_message_bytes(gpus: &[ServedGpu]) -> u64 {
    let mut total: u64 = 5;
    let health_field = 1 + encoded_len_varint(UNHEALTHY.len() as u64) + UNHEALTHY.len();
    for gpu in gpus {
        let base = gpu.uuid.len() + FAKE_ID_SEPARATOR.len();
        // Group the units by the number of decimal digits of n: 0-9, 10-99, 100-999, …
        let units = gpu.units.units();
        let (mut lo, mut hi, mut digits) = (0u64, 10u64, 1usize);
        while lo < units {
            let end = hi.min(units);
            let id_len = base + digits;
            let device_len = 1 + encoded_len_varint(id_len as u64) + id_len + health_field;
            let field_len = 1 + encoded_len_varint(device_len as u64) + device_len;
            total = total.saturating_add((end - lo).saturating_mul(field_len as u64));
            lo = hi;
            hi = hi.saturating_mul(10);
            digits += 1;
        }
    }
    total
}

/// The units offered as alternatives when the message would be too large, finest first.
pub(crate) const CANDIDATE_UNITS_MIB: [u32; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

/// The ListAndWatch message would not fit kubelet's 4 MiB limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageTooLarge {
    /// The unit asked for.
    pub unit: MemoryUnit,
    /// The number of fake devices it gives.
    pub devices: u64,
    /// The message size it gives.
    pub bytes: u64,
    /// The finest unit that fits, if any.
    pub suggestion: Option<MemoryUnit>,
}

impl fmt::Display for MessageTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "with --memory-unit {} this node's GPU memory is {} fake devices, a ListAndWatch \
             message of up to {} bytes, over kubelet's limit of {} bytes (kubelet would reject \
             it and the node would offer no aliyun.com/gpu-mem)",
            self.unit, self.devices, self.bytes, KUBELET_MAX_MESSAGE_BYTES
        )?;
        match self.suggestion {
            Some(u) => write!(f, "; use --memory-unit {u} or coarser"),
            None => write!(f, "; no unit up to GiB fits"),
        }
    }
}

impl std::error::Error for MessageTooLarge {}

/// Checks that the GPUs of `inventory` counted in `unit` fit one ListAndWatch message; when
/// they do not, names the finest unit that does.
pub(crate) fn check_message_size(
    inventory: &Inventory,
    unit: MemoryUnit,
) -> Result<(), MessageTooLarge> {
    let fits = |u: MemoryUnit| {
        worst_case_message_bytes(&served_gpus(inventory, u)) <= KUBELET_MAX_MESSAGE_BYTES as u64
    };
    if fits(unit) {
        return Ok(());
    }
    let suggestion = CANDIDATE_UNITS_MIB
        .iter()
        .filter(|mib| **mib > unit.mib())
        .filter_map(|mib| MemoryUnit::from_mib(*mib))
        .find(|u| fits(*u));
    let gpus = served_gpus(inventory, unit);
    Err(MessageTooLarge {
        unit,
        devices: gpus.iter().map(|g| g.units.units()).sum(),
        bytes: worst_case_message_bytes(&served_gpus(inventory, unit)),
        suggestion,
    })
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::core::GpuMem;
    use crate::gpu::GpuDevice;

    fn inventory(sizes_gib: &[u64]) -> Inventory {
        Inventory {
            backend: "fake",
            driver_version: "0".to_string(),
            devices: sizes_gib
                .iter()
                .enumerate()
                .map(|(i, gib)| GpuDevice {
                    index: i as u32,
                    uuid: format!("GPU-{i:08}-0000-0000-0000-000000000000"),
                    name: "Fake".to_string(),
                    minor: Some(i as u32),
                    pci_bus_id: String::new(),
                    memory_bytes: gib * 1024 * 1024 * 1024,
                })
                .collect(),
            excluded: Vec::new(),
        }
    }

    #[test]
    fn each_gpu_counts_its_own_memory() {
        let gpus = served_gpus(&inventory(&[16, 24]), MemoryUnit::GIB);
        assert_eq!(gpus[0].units, GpuMem::new(16));
        assert_eq!(gpus[1].units, GpuMem::new(24));
        let msg = list_and_watch_response(&gpus, |_| true);
        assert_eq!(msg.devices.len(), 40);
        assert_eq!(
            msg.devices[16].id,
            "GPU-00000001-0000-0000-0000-000000000000-_-0"
        );
        assert!(msg.devices.iter().all(|d| d.health == HEALTHY));
    }

    #[test]
    fn the_size_estimate_is_exact() {
        for units in [0u64, 1, 9, 10, 11, 99, 100, 1000, 12345] {
            let gpus = vec![
                ServedGpu {
                    index: 0,
                    uuid: "GPU-abc".to_string(),
                    units: GpuMem::new(units),
                    minor: None,
                },
                ServedGpu {
                    index: 1,
                    uuid: "GPU-00000000-0000-0000-0000-000000000000".to_string(),
                    units: GpuMem::new(units / 3),
                    minor: None,
                },
            ];
            let msg = list_and_watch_response(&gpus, |_| false);
            assert_eq!(
                worst_case_message_bytes(&gpus),
                msg.encoded_len() as u64 + 5,
                "units {units}"
            );
        }
    }

    #[test]
    fn the_guard_refuses_mib_on_big_nodes_and_names_a_unit() {
        let big = inventory(&[80; 8]);
        assert!(check_message_size(&big, MemoryUnit::GIB).is_ok());
        let err = check_message_size(&big, MemoryUnit::MIB).unwrap_err();
        let suggestion = err.suggestion.unwrap();
        assert!(check_message_size(&big, suggestion).is_ok());
        let finer = MemoryUnit::from_mib(suggestion.mib() / 2).unwrap();
        assert!(check_message_size(&big, finer).is_err());
        assert!(
            err.to_string()
                .contains(&format!("use --memory-unit {suggestion} or coarser"))
        );
        // A 16 GiB card in MiB fits, as upstream.
        assert!(check_message_size(&inventory(&[16]), MemoryUnit::MIB).is_ok());
    }
}
