//! What an allocated ResourceClaim gives this node's DRA driver: for each allocation result
//! of the driver, the device, the request it serves, the `shareID` and what it consumes (GPU
//! memory, or shares of a device of another kind: an RDMA HCA, a generic device).
//!
//! [`read_claim`] checks each result against the devices this node publishes (pool = the node,
//! device known), and [`admit`] checks a claim against what prepared claims already hold on
//! each device. Both answer a typed [`ClaimError`] that concerns that claim only: kubelet gets it
//! as the claim's error in `NodePrepareResources`, and nothing else changes. What this does
//! not do: read the claim from the API, or decide what a container sees (the container
//! contract does, from the [`ClaimShare`]s).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::core::wire::{DRA_CAPACITY_MEMORY, DRA_CAPACITY_SHARES};
use crate::core::{GpuMem, MemoryUnit, QuantityError, parse_whole_quantity};

/// A device this node publishes, as prepare needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeDevice {
    /// The GPU's UUID.
    pub uuid: String,
    /// Its enumeration index.
    pub index: u32,
    /// The memory it publishes (the `memory` capacity), in bytes.
    pub memory_bytes: u64,
}

/// A device of another kind this node publishes ([`super::kinds::KindDevice`]), as prepare
/// needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindDeviceRef {
    /// The kind's extended resource (`gpushare.io/rdma`).
    pub resource: String,
    /// The device's id in its kind (the HCA's name).
    pub id: String,
    /// How many pods may hold it (1: whole).
    pub shares: u32,
}

/// One allocation result of this driver on a device of another kind.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceShare {
    /// The claim's request this result serves.
    pub request: String,
    /// The device name in the slice.
    pub device: String,
    /// The kind's extended resource.
    pub resource: String,
    /// The device's id in its kind.
    pub id: String,
    /// The `shareID` of the result (absent for an exclusive device).
    pub share_id: Option<String>,
    /// Shares consumed (all of them when the result has no `consumedCapacity`).
    pub shares: u32,
}

/// What one claim holds on this node: its GPU shares and its devices of other kinds, each
/// in the order of the allocation results.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimDevices {
    /// Shares of GPUs.
    pub gpus: Vec<ClaimShare>,
    /// Devices of other kinds.
    pub devices: Vec<DeviceShare>,
}

/// One allocation result of this driver: a share of one GPU.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClaimShare {
    /// The claim's request this result serves (`<request>` or `<request>/<subrequest>`).
    pub request: String,
    /// The device name in the slice.
    pub device: String,
    /// The GPU's UUID.
    pub uuid: String,
    /// The GPU's index.
    pub index: u32,
    /// The `shareID` of the result (absent for whole-device results).
    pub share_id: Option<String>,
    /// Memory consumed, in bytes (the whole GPU when the result has no `consumedCapacity`).
    pub memory_bytes: u64,
    /// The same in memory units (rounded down).
    pub units: GpuMem,
}

/// Why a claim cannot be prepared on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// The claim has no allocation (kubelet should not have asked).
    #[error("claim {claim} is not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The claim has no allocation result for this driver.
    #[error("claim {claim} has no device of driver {driver}")]
    NoResults {
        /// `namespace/name`.
        claim: String,
        /// The driver.
        driver: String,
    },
    /// A result names a pool or device this node does not publish.
    #[error("claim {claim}: device {pool}/{device} is not on this node")]
    DeviceNotOnNode {
        /// `namespace/name`.
        claim: String,
        /// The result's pool.
        pool: String,
        /// The result's device.
        device: String,
    },
    /// A consumed quantity that cannot be read.
    #[error("claim {claim}: device {device}: consumed memory {source}")]
    BadQuantity {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// Why.
        #[source]
        source: QuantityError,
    },
    /// What the claim (with what is prepared already) consumes of a device does not fit in 64
    /// bits: refused, never wrapped around.
    #[error(
        "claim {claim}: device {device}: the consumption does not fit in 64 bits (over-consumed)"
    )]
    Overflow {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
    },
    /// The claim (with what is prepared already) consumes more of a device than it has:
    /// memory of a GPU (bytes), shares of a device of another kind.
    #[error(
        "claim {claim}: device {device} would hold {wanted} {what} of {capacity} (over-consumed)"
    )]
    OverConsumption {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// What it would hold with this claim.
        wanted: u64,
        /// What it has.
        capacity: u64,
        /// The unit of both: `bytes` or `shares`.
        what: &'static str,
    },
}

/// What this node's `driver` holds in `claim`, checked against the GPUs `devices` and the
/// devices of other kinds `others` (by device name) of the pool `pool` (the node's name).
/// Results of other drivers are ignored.
pub fn read_claim(
    claim: &ResourceClaim,
    driver: &str,
    pool: &str,
    devices: &BTreeMap<String, NodeDevice>,
    others: &BTreeMap<String, KindDeviceRef>,
    unit: MemoryUnit,
) -> Result<ClaimDevices, ClaimError> {
    let id = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    );
    let results = crate::k8s::project::claim_results(claim)
        .ok_or_else(|| ClaimError::NotAllocated { claim: id.clone() })?;
    let mut out = ClaimDevices::default();
    for r in results.iter().filter(|r| r.driver == driver) {
        let not_here = || ClaimError::DeviceNotOnNode {
            claim: id.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
        };
        if r.pool != pool {
            return Err(not_here());
        }
        if let Some(other) = others.get(&r.device) {
            let consumed = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get(DRA_CAPACITY_SHARES));
            let shares = match consumed {
                // An exclusive device is allocated whole, whatever a result claims to consume
                // of it (upstream's allocator records no consumption on such a device).
                _ if other.shares <= 1 => other.shares,
                // At least one share: the policy's minimum, as upstream rounds a request up.
                Some(q) => parse_whole_quantity(&q.0)
                    .map_err(|source| ClaimError::BadQuantity {
                        claim: id.clone(),
                        device: r.device.clone(),
                        source,
                    })
                    .map(|n| u32::try_from(n).unwrap_or(u32::MAX).max(1))?,
                None => other.shares,
            };
            out.devices.push(DeviceShare {
                request: r.request.clone(),
                device: r.device.clone(),
                resource: other.resource.clone(),
                id: other.id.clone(),
                share_id: r.share_id.clone(),
                shares,
            });
            continue;
        }
        let dev = devices.get(&r.device).ok_or_else(not_here)?;
        let memory_bytes = match r
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(DRA_CAPACITY_MEMORY))
        {
            Some(q) => {
                let consumed =
                    parse_whole_quantity(&q.0).map_err(|source| ClaimError::BadQuantity {
                        claim: id.clone(),
                        device: r.device.clone(),
                        source,
                    })?;
                as_allocated(consumed, unit)
            }
            None => dev.memory_bytes,
        };
        out.gpus.push(ClaimShare {
            request: r.request.clone(),
            device: r.device.clone(),
            uuid: dev.uuid.clone(),
            index: dev.index,
            share_id: r.share_id.clone(),
            memory_bytes,
            units: unit.units_of_bytes(memory_bytes),
        });
    }
    if out.gpus.is_empty() && out.devices.is_empty() {
        return Err(ClaimError::NoResults {
            claim: id,
            driver: driver.to_string(),
        });
    }
    Ok(out)
}

/// A consumed memory of `consumed` bytes as upstream's allocator would have allocated it from
/// the slice's request policy (`validRange` with `min` and `step` of one unit): rounded up to
/// whole units, at least one. So a sub-unit or zero consumption is one unit, never a limit of
/// 0 (`ALIYUN_COM_GPU_MEM_CONTAINER=0` would hand out no memory, or all of it, depending on
/// the program).
pub fn as_allocated(consumed: u64, unit: MemoryUnit) -> u64 {
    let step = unit.to_bytes(GpuMem::new(1)).max(1);
    consumed
        .max(1)
        .div_ceil(step)
        .checked_mul(step)
        .unwrap_or(u64::MAX / step * step)
}

/// Checks that what claim `claim` holds fits next to `held` (what other prepared claims
/// already hold on each device, in the device's unit: bytes of a GPU's memory, shares of a
/// device of another kind): no device ends above its capacity.
pub fn admit(
    claim: &str,
    mine: &ClaimDevices,
    held: &BTreeMap<String, u64>,
    devices: &BTreeMap<String, NodeDevice>,
    others: &BTreeMap<String, KindDeviceRef>,
) -> Result<(), ClaimError> {
    let overflow = |device: &str| ClaimError::Overflow {
        claim: claim.to_string(),
        device: device.to_string(),
    };
    let mut wants: BTreeMap<&str, u64> = BTreeMap::new();
    let amounts = mine
        .gpus
        .iter()
        .map(|s| (s.device.as_str(), s.memory_bytes))
        .chain(
            mine.devices
                .iter()
                .map(|s| (s.device.as_str(), u64::from(s.shares))),
        );
    for (device, amount) in amounts {
        let want = wants.entry(device).or_default();
        *want = want.checked_add(amount).ok_or_else(|| overflow(device))?;
    }
    for (device, amount) in wants {
        let (capacity, what) = match (devices.get(device), others.get(device)) {
            (Some(d), _) => (d.memory_bytes, "bytes"),
            (None, Some(o)) => (u64::from(o.shares), "shares"),
            (None, None) => (0, "bytes"),
        };
        let wanted = held
            .get(device)
            .copied()
            .unwrap_or(0)
            .checked_add(amount)
            .ok_or_else(|| overflow(device))?;
        if wanted > capacity {
            return Err(ClaimError::OverConsumption {
                claim: claim.to_string(),
                device: device.to_string(),
                wanted,
                capacity,
                what,
            });
        }
    }
    Ok(())
}

/// Memory allocated on each device of `(driver, pool)` by every allocated claim (bytes, by
/// device name): what orders the slice by the GPU policy. It counts allocations the scheduler
/// made that no kubelet has prepared yet, which the checkpoint cannot know. A result without
/// `consumedCapacity` holds the whole device (`whole` gives its memory); an unreadable
/// quantity counts as the whole device too (the order errs towards "full").
pub fn allocated_per_device<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
    driver: &str,
    pool: &str,
    whole: impl Fn(&str) -> u64,
) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for claim in claims {
        let results = crate::k8s::project::claim_results(claim);
        for r in results
            .into_iter()
            .flatten()
            .filter(|r| r.driver == driver && r.pool == pool)
        {
            let bytes = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get(DRA_CAPACITY_MEMORY))
                .and_then(|q| parse_whole_quantity(&q.0).ok())
                .unwrap_or_else(|| whole(&r.device));
            let held = out.entry(r.device.clone()).or_default();
            *held = held.saturating_add(bytes);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const GIB: u64 = 1 << 30;

    fn devices() -> BTreeMap<String, NodeDevice> {
        BTreeMap::from([
            (
                "gpu-a".to_string(),
                NodeDevice {
                    uuid: "GPU-A".into(),
                    index: 0,
                    memory_bytes: 16 * GIB,
                },
            ),
            (
                "gpu-b".to_string(),
                NodeDevice {
                    uuid: "GPU-B".into(),
                    index: 1,
                    memory_bytes: 8 * GIB,
                },
            ),
        ])
    }

    fn others() -> BTreeMap<String, KindDeviceRef> {
        BTreeMap::from([
            (
                "rdma-mlx5-0".to_string(),
                KindDeviceRef {
                    resource: "gpushare.io/rdma".into(),
                    id: "mlx5_0".into(),
                    shares: 4,
                },
            ),
            (
                "fuse-fuse".to_string(),
                KindDeviceRef {
                    resource: "example.com/fuse".into(),
                    id: "fuse".into(),
                    shares: 1,
                },
            ),
        ])
    }

    /// `c` read as node-a's driver `gpushare.io` reads it, in `unit`.
    fn read_in(c: &ResourceClaim, unit: MemoryUnit) -> Result<ClaimDevices, ClaimError> {
        read_claim(c, "gpushare.io", "node-a", &devices(), &others(), unit)
    }

    fn claim(results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": { "name": "c", "namespace": "ns", "uid": "u-1" },
            "spec": { "devices": { "requests": [] } },
            "status": { "allocation": { "devices": { "results": results } } },
        }))
        .expect("a claim")
    }

    #[test]
    fn results_of_this_driver_become_shares_in_units() {
        let c = claim(json!([
            { "request": "main", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-a",
              "shareID": "s-1", "consumedCapacity": { "memory": "6Gi" } },
            { "request": "side", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-a",
              "shareID": "s-2", "consumedCapacity": { "memory": "2Gi" } },
            { "request": "nic", "driver": "other.example.com", "pool": "x", "device": "eth0" },
        ]));
        let shares = read_in(&c, MemoryUnit::GIB).expect("reads").gpus;
        assert_eq!(shares.len(), 2);
        assert_eq!(shares[0].uuid, "GPU-A");
        assert_eq!(shares[0].share_id.as_deref(), Some("s-1"));
        assert_eq!(shares[0].units, GpuMem::new(6));
        assert_eq!(shares[1].request, "side");
        assert_eq!(shares[1].memory_bytes, 2 * GIB);
    }

    #[test]
    fn a_whole_device_result_takes_the_whole_gpu() {
        let c = claim(json!([
            { "request": "r", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-b" },
        ]));
        let shares = read_in(&c, MemoryUnit::MIB).expect("reads").gpus;
        assert_eq!(shares[0].memory_bytes, 8 * GIB);
        assert_eq!(shares[0].units, GpuMem::new(8192));
        assert_eq!(shares[0].share_id, None);
    }

    #[test]
    fn each_claim_gets_its_own_typed_error() {
        let read = |results| read_in(&claim(results), MemoryUnit::GIB);
        assert!(matches!(
            read(
                json!([{ "request": "r", "driver": "gpushare.io", "pool": "node-b", "device": "gpu-a" }])
            ),
            Err(ClaimError::DeviceNotOnNode { .. })
        ));
        assert!(matches!(
            read(
                json!([{ "request": "r", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-z" }])
            ),
            Err(ClaimError::DeviceNotOnNode { .. })
        ));
        assert!(matches!(
            read(
                json!([{ "request": "r", "driver": "other", "pool": "node-a", "device": "gpu-a" }])
            ),
            Err(ClaimError::NoResults { .. })
        ));
        assert!(matches!(
            read(
                json!([{ "request": "r", "driver": "gpushare.io", "pool": "node-a",
                          "device": "gpu-a", "consumedCapacity": { "memory": "lots" } }])
            ),
            Err(ClaimError::BadQuantity { .. })
        ));
        let mut unallocated = claim(json!([]));
        unallocated.status = None;
        let err = read_in(&unallocated, MemoryUnit::GIB).expect_err("not allocated");
        assert_eq!(err.to_string(), "claim ns/c is not allocated");
    }

    #[test]
    fn allocations_of_every_claim_of_this_pool_add_up_per_device() {
        let a = claim(json!([
            { "request": "m", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-a",
              "shareID": "1", "consumedCapacity": { "memory": "6Gi" } },
            { "request": "n", "driver": "gpushare.io", "pool": "node-b", "device": "gpu-a",
              "shareID": "2", "consumedCapacity": { "memory": "1Gi" } },
        ]));
        let b = claim(json!([
            { "request": "m", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-a",
              "shareID": "3", "consumedCapacity": { "memory": "2Gi" } },
            { "request": "w", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-b" },
            { "request": "x", "driver": "other", "pool": "node-a", "device": "gpu-b" },
        ]));
        let mut pending = claim(json!([]));
        pending.status = None;
        let got = allocated_per_device([&a, &b, &pending], "gpushare.io", "node-a", |d| {
            devices().get(d).map_or(0, |x| x.memory_bytes)
        });
        assert_eq!(
            got,
            BTreeMap::from([
                ("gpu-a".to_string(), 8 * GIB),
                ("gpu-b".to_string(), 8 * GIB)
            ])
        );
    }

    #[test]
    fn over_consumption_is_refused_with_what_is_held() {
        let c = claim(json!([
            { "request": "a", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-b",
              "shareID": "1", "consumedCapacity": { "memory": "3Gi" } },
            { "request": "b", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-b",
              "shareID": "2", "consumedCapacity": { "memory": "3Gi" } },
        ]));
        let shares = read_in(&c, MemoryUnit::GIB).expect("reads");
        let held = BTreeMap::from([("gpu-b".to_string(), 2 * GIB)]);
        assert_eq!(admit("ns/c", &shares, &held, &devices(), &others()), Ok(()));
        let held = BTreeMap::from([("gpu-b".to_string(), 3 * GIB)]);
        assert_eq!(
            admit("ns/c", &shares, &held, &devices(), &others()),
            Err(ClaimError::OverConsumption {
                claim: "ns/c".into(),
                device: "gpu-b".into(),
                wanted: 9 * GIB,
                capacity: 8 * GIB,
                what: "bytes",
            })
        );
    }

    /// An exclusive device (one share, published without `allowMultipleAllocations`) is
    /// allocated whole, as upstream's allocator does: a result claiming to consume none of it
    /// still holds it, so a second claim on it is refused. A shared device's zero is one share.
    #[test]
    fn a_consumption_on_an_exclusive_device_holds_the_whole_device() {
        let c = claim(json!([
            { "request": "fuse", "driver": "gpushare.io", "pool": "node-a", "device": "fuse-fuse",
              "shareID": "s-1", "consumedCapacity": { "shares": "0" } },
            { "request": "nic", "driver": "gpushare.io", "pool": "node-a", "device": "rdma-mlx5-0",
              "shareID": "s-2", "consumedCapacity": { "shares": "0" } },
        ]));
        let got = read_in(&c, MemoryUnit::GIB).expect("reads");
        assert_eq!(got.devices[0].shares, 1, "the exclusive device, whole");
        assert_eq!(
            got.devices[1].shares, 1,
            "a shared device's zero is one share"
        );
        let held = BTreeMap::from([("fuse-fuse".to_string(), 1)]);
        assert!(matches!(
            admit("ns/c", &got, &held, &devices(), &others()),
            Err(ClaimError::OverConsumption { .. })
        ));
    }

    #[test]
    fn consumed_memory_is_rounded_up_to_whole_units_at_least_one() {
        assert_eq!(as_allocated(0, MemoryUnit::GIB), GIB);
        assert_eq!(as_allocated(1, MemoryUnit::GIB), GIB);
        assert_eq!(as_allocated(GIB, MemoryUnit::GIB), GIB);
        assert_eq!(as_allocated(GIB + 1, MemoryUnit::GIB), 2 * GIB);
        assert_eq!(
            as_allocated(u64::MAX, MemoryUnit::GIB),
            u64::MAX / GIB * GIB
        );
    }

    #[test]
    fn results_on_other_kinds_are_device_shares_checked_against_their_shares() {
        let c = claim(json!([
            { "request": "gpu", "driver": "gpushare.io", "pool": "node-a", "device": "gpu-a",
              "shareID": "s-1", "consumedCapacity": { "memory": "2Gi" } },
            { "request": "nic", "driver": "gpushare.io", "pool": "node-a", "device": "rdma-mlx5-0",
              "shareID": "s-2", "consumedCapacity": { "shares": "1" } },
            { "request": "fuse", "driver": "gpushare.io", "pool": "node-a", "device": "fuse-fuse" },
        ]));
        let got = read_in(&c, MemoryUnit::GIB).expect("reads");
        assert_eq!(got.gpus.len(), 1);
        assert_eq!(
            got.devices,
            [
                DeviceShare {
                    request: "nic".into(),
                    device: "rdma-mlx5-0".into(),
                    resource: "gpushare.io/rdma".into(),
                    id: "mlx5_0".into(),
                    share_id: Some("s-2".into()),
                    shares: 1,
                },
                DeviceShare {
                    request: "fuse".into(),
                    device: "fuse-fuse".into(),
                    resource: "example.com/fuse".into(),
                    id: "fuse".into(),
                    share_id: None,
                    shares: 1,
                },
            ]
        );
        let held = BTreeMap::from([("rdma-mlx5-0".to_string(), 3)]);
        assert_eq!(admit("ns/c", &got, &held, &devices(), &others()), Ok(()));
        let held = BTreeMap::from([("rdma-mlx5-0".to_string(), 4)]);
        assert_eq!(
            admit("ns/c", &got, &held, &devices(), &others()),
            Err(ClaimError::OverConsumption {
                claim: "ns/c".into(),
                device: "rdma-mlx5-0".into(),
                wanted: 5,
                capacity: 4,
                what: "shares",
            })
        );
        let only_nic = claim(json!([
            { "request": "nic", "driver": "gpushare.io", "pool": "node-a", "device": "rdma-mlx5-0",
              "shareID": "s-2", "consumedCapacity": { "shares": "two" } },
        ]));
        assert!(matches!(
            read_in(&only_nic, MemoryUnit::GIB),
            Err(ClaimError::BadQuantity { .. })
        ));
    }
}
