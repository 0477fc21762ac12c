//! The ResourceSlice a node publishes for its GPUs, built from what the node serves.
//!
//! One device per served GPU, named after its UUID (`gpu-8e4c…`, stable across reboots and
//! index changes; `gpu-<index>` when the UUID is not a DNS label), with
//! `allowMultipleAllocations: true` and one consumable capacity, `memory`: the GPU's memory
//! rounded down to whole memory units (the device plugin's rule), with a `requestPolicy` whose
//! `validRange` has `min` and `step` of one unit and `max` the whole, and whose `default` is the
//! whole: a claim that asks no memory gets the whole GPU. Attributes: `uuid`, `index`,
//! `productName`, `driverVersion` (a semantic version, leading zeros dropped), `type: gpu` (the
//! GPU DeviceClass selects on it) and, where sysfs states them, the standard
//! `resource.kubernetes.io/pcieRoot`, `pciBusID` and `numaNode`. An unhealthy GPU carries the
//! taint `gpushare.io/unhealthy` (`NoSchedule`), so no new claim lands on it. The devices of
//! the node's other kinds ([`super::kinds`]: RDMA HCAs, generic devices) follow the GPUs in
//! the same pool, so a claim's `matchAttribute` can align them.
//!
//! Device order: kube-scheduler takes the first device that fits, in slice order, so the
//! order carries the GPU policy: `binpack` lists the GPU with the least memory free first (the
//! first that fits is then the best fit, the extender's choice), `spread` the most free first,
//! from the memory allocated on each GPU (ties by index). It is a hint, not a promise: the
//! scheduler reads the slice as last published, and several pods scheduled between two
//! publications see the same order.
//!
//! [`Pool`] keeps the published devices and moves the pool generation on every change; slices
//! hold at most [`MAX_DEVICES_PER_SLICE`] devices each, [`MAX_DEVICES_PER_SLICE_WITH_TAINTS`]
//! while any device of the pool has a taint (the API server's limits). What it does not do: talk to the API
//! server, read sysfs, or decide which GPUs are served (MIG-excluded GPUs and GPUs of the
//! device plugin never reach it).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::core::wire::{
    DRA_ATTR_DRIVER_VERSION, DRA_ATTR_INDEX, DRA_ATTR_PRODUCT_NAME, DRA_ATTR_TYPE, DRA_ATTR_UUID,
    DRA_CAPACITY_MEMORY, DRA_TAINT_UNHEALTHY, DRA_TYPE_GPU,
};
use crate::core::{GpuPolicy, MemoryUnit};
use crate::pcie::PciLocation;

/// The API's limit on devices in one ResourceSlice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// The API's limit on devices in one ResourceSlice once any of them has a taint (or consumes
/// counters): a slice over it is refused whole.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS: usize = 64;

/// One GPU the node serves on the DRA path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceGpu {
    /// Enumeration index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name.
    pub product_name: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Where its PCI function sits, when sysfs says ([`PciLocation::of_bus_id`]).
    pub place: Option<PciLocation>,
    /// `None` when healthy; else why not (the taint's value, shortened to a label value).
    pub unhealthy: Option<String>,
    /// Memory allocated on it now, in bytes (orders the devices by the policy).
    pub allocated_bytes: u64,
}

/// The stable device name of a GPU: its UUID in lower case when that is a DNS label
/// (`gpu-8e4c1c2e-…`), else `gpu-<index>` ([`crate::core::resource_name::gpu_device_name`]).
pub fn device_name(gpu: &SliceGpu) -> String {
    crate::core::resource_name::gpu_device_name(&gpu.uuid, gpu.index)
}

/// The slices of one node's pool, at `generation`: the GPUs ordered by `policy`, then
/// `others` (the other kinds' devices, [`super::kinds::KindDevice::to_device`]) as given,
/// split into slices of at most [`MAX_DEVICES_PER_SLICE`] ([`MAX_DEVICES_PER_SLICE_WITH_TAINTS`]
/// when any device has a taint), named `<node>-<driver>-<n>`.
#[allow(clippy::too_many_arguments)]
pub fn build_slices(
    node: &str,
    driver: &str,
    driver_version: Option<&str>,
    unit: MemoryUnit,
    policy: GpuPolicy,
    gpus: &[SliceGpu],
    others: &[Device],
    generation: i64,
) -> Vec<ResourceSlice> {
    // A GPU of fewer than two units would make the whole slice invalid: never published (the
    // role names it in an Event).
    let devices = ordered(gpus, policy, unit)
        .into_iter()
        .filter(|g| holds_enough_units(g.memory_bytes, unit))
        .map(|g| device(g, unit, driver_version))
        .chain(others.iter().cloned())
        .collect::<Vec<_>>();
    // One limit for the whole pool, so a device going unhealthy moves the split at most once.
    let per_slice = if devices.iter().any(|d| d.taints.is_some()) {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    let chunks: Vec<Vec<Device>> = if devices.is_empty() {
        vec![Vec::new()]
    } else {
        devices.chunks(per_slice).map(<[Device]>::to_vec).collect()
    };
    let count = chunks.len() as i64;
    let base = format!("{node}-{}", driver.replace(['.', '/', '_'], "-"));
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, devices)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!("{base}-{i}")),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.to_string(),
                node_name: Some(node.to_string()),
                pool: ResourcePool {
                    name: node.to_string(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(devices),
                ..Default::default()
            },
        })
        .collect()
}

/// The GPUs in first-fit order for `policy`, by the memory free on each (published memory
/// less what is allocated): `binpack` the least free first, so the first GPU that fits is the
/// best fit, the extender's binpack choice; `spread` the most free first, the extender's
/// spread choice. Ties by index, as the extender breaks them.
pub fn ordered(gpus: &[SliceGpu], policy: GpuPolicy, unit: MemoryUnit) -> Vec<&SliceGpu> {
    let free =
        |g: &SliceGpu| published_memory(g.memory_bytes, unit).saturating_sub(g.allocated_bytes);
    let mut out: Vec<&SliceGpu> = gpus.iter().collect();
    out.sort_by(|a, b| {
        let by_free = match policy {
            GpuPolicy::Binpack => free(a).cmp(&free(b)),
            GpuPolicy::Spread => free(b).cmp(&free(a)),
        };
        by_free.then(a.index.cmp(&b.index))
    });
    out
}

/// Whether a GPU of `memory_bytes` holds enough whole units of `unit` to be published
/// ([`crate::core::wire::DRA_MIN_UNITS_PER_GPU`]: a device of fewer is invalid, and with it
/// the whole slice).
pub fn holds_enough_units(memory_bytes: u64, unit: MemoryUnit) -> bool {
    unit.units_of_bytes(memory_bytes).units() >= crate::core::wire::DRA_MIN_UNITS_PER_GPU
}

/// The GPU's memory as the slice publishes it: whole units, in bytes.
pub fn published_memory(memory_bytes: u64, unit: MemoryUnit) -> u64 {
    unit.to_bytes(unit.units_of_bytes(memory_bytes))
}

fn device(gpu: &SliceGpu, unit: MemoryUnit, driver_version: Option<&str>) -> Device {
    let total = published_memory(gpu.memory_bytes, unit);
    let step = unit.to_bytes(crate::core::GpuMem::new(1));
    let q = |v: u64| Quantity(v.to_string());
    let mut attributes = BTreeMap::new();
    attributes.insert(
        DRA_ATTR_UUID.to_string(),
        DeviceAttribute {
            string: Some(gpu.uuid.clone()),
            ..Default::default()
        },
    );
    attributes.insert(
        DRA_ATTR_INDEX.to_string(),
        DeviceAttribute {
            int: Some(i64::from(gpu.index)),
            ..Default::default()
        },
    );
    attributes.insert(
        DRA_ATTR_PRODUCT_NAME.to_string(),
        DeviceAttribute {
            string: Some(gpu.product_name.clone()),
            ..Default::default()
        },
    );
    if let Some(v) = driver_version.and_then(semver) {
        attributes.insert(
            DRA_ATTR_DRIVER_VERSION.to_string(),
            DeviceAttribute {
                version: Some(v),
                ..Default::default()
            },
        );
    }
    attributes.insert(
        DRA_ATTR_TYPE.to_string(),
        DeviceAttribute {
            string: Some(DRA_TYPE_GPU.to_string()),
            ..Default::default()
        },
    );
    if let Some(place) = &gpu.place {
        for (k, v) in super::kinds::place_attributes(place) {
            attributes.insert(k, super::kinds::attribute(&v));
        }
    }
    let capacity = BTreeMap::from([(
        DRA_CAPACITY_MEMORY.to_string(),
        DeviceCapacity {
            value: q(total),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(q(total)),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: q(step.min(total)),
                    max: Some(q(total)),
                    step: Some(q(step)),
                }),
                valid_values: None,
            }),
        },
    )]);
    let taints = gpu.unhealthy.as_ref().map(|why| {
        vec![DeviceTaint {
            key: DRA_TAINT_UNHEALTHY.to_string(),
            value: Some(label_value(why)),
            effect: "NoSchedule".into(),
            time_added: None,
        }]
    });
    Device {
        name: device_name(gpu),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(capacity),
        taints,
        ..Default::default()
    }
}

/// A driver version as a semantic version: `550.54.15` stays, `535.104.05` becomes
/// `535.104.5`, `470.82` becomes `470.82.0`; `None` when it is not numbers and dots.
pub fn semver(version: &str) -> Option<String> {
    let parts: Vec<u64> = version
        .trim()
        .split('.')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut p = parts;
    p.resize(3, 0);
    Some(format!("{}.{}.{}", p[0], p[1], p[2]))
}

/// A taint value: at most 63 characters of `[A-Za-z0-9._-]`, starting and ending with an
/// alphanumeric (others become `-`).
fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// One node's pool as last published: the generation moves on every change of the devices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pool {
    generation: i64,
    devices: Option<Vec<Device>>,
}

impl Pool {
    /// A pool that has published nothing yet; its first publication is generation 1.
    pub fn new() -> Pool {
        Pool::default()
    }

    /// The generation of the last publication (0 before the first).
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// The slices to publish for `gpus` and `others` ([`build_slices`]): `Some` (with a new
    /// generation) when the devices differ from the last publication, `None` when nothing
    /// changed.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        node: &str,
        driver: &str,
        driver_version: Option<&str>,
        unit: MemoryUnit,
        policy: GpuPolicy,
        gpus: &[SliceGpu],
        others: &[Device],
    ) -> Option<Vec<ResourceSlice>> {
        let slices = build_slices(
            node,
            driver,
            driver_version,
            unit,
            policy,
            gpus,
            others,
            self.generation + 1,
        );
        let devices: Vec<Device> = slices
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .collect();
        if self.devices.as_ref() == Some(&devices) {
            return None;
        }
        self.generation += 1;
        self.devices = Some(devices);
        Some(slices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, gib: u64, allocated_gib: u64) -> SliceGpu {
        SliceGpu {
            index,
            uuid: format!("GPU-0000000{index}-1111-2222-3333-444444444444"),
            product_name: "Tesla V100-SXM2-16GB".into(),
            memory_bytes: gib * GIB + (123 << 20),
            place: (index == 0).then(|| PciLocation {
                address: "0000:3b:00.0".parse().expect("an address"),
                pcie_root: Some("pci0000:3a".into()),
                bridges: Vec::new(),
                numa_node: Some(1),
            }),
            unhealthy: None,
            allocated_bytes: allocated_gib * GIB,
        }
    }

    fn names(slices: &[ResourceSlice]) -> Vec<String> {
        slices
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .map(|d| d.name)
            .collect()
    }

    /// What the API server would store: the JSON field names of `resource.k8s.io/v1`, and the
    /// object reads back as the typed API object.
    #[test]
    fn a_slice_is_a_valid_resource_k8s_io_v1_object() {
        let slices = build_slices(
            "node-a",
            "gpushare.io",
            Some("535.104.05"),
            MemoryUnit::GIB,
            GpuPolicy::Binpack,
            &[gpu(0, 16, 0)],
            &[],
            3,
        );
        let json = serde_json::to_value(&slices[0]).expect("serialises");
        assert_eq!(json["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(json["kind"], "ResourceSlice");
        assert_eq!(json["spec"]["pool"]["generation"], 3);
        assert_eq!(json["spec"]["nodeName"], "node-a");
        let d = &json["spec"]["devices"][0];
        assert_eq!(d["name"], "gpu-00000000-1111-2222-3333-444444444444");
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(
            d["attributes"]["uuid"]["string"],
            "GPU-00000000-1111-2222-3333-444444444444"
        );
        assert_eq!(d["attributes"]["index"]["int"], 0);
        assert_eq!(d["attributes"]["driverVersion"]["version"], "535.104.5");
        assert_eq!(
            d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"],
            "pci0000:3a"
        );
        assert_eq!(
            d["attributes"]["resource.kubernetes.io/pciBusID"]["string"],
            "0000:3b:00.0"
        );
        assert_eq!(d["attributes"]["resource.kubernetes.io/numaNode"]["int"], 1);
        assert_eq!(d["attributes"]["type"]["string"], "gpu");
        let mem = &d["capacity"]["memory"];
        assert_eq!(mem["value"], (16 * GIB).to_string());
        assert_eq!(mem["requestPolicy"]["default"], (16 * GIB).to_string());
        assert_eq!(mem["requestPolicy"]["validRange"]["min"], GIB.to_string());
        assert_eq!(mem["requestPolicy"]["validRange"]["step"], GIB.to_string());
        let back: ResourceSlice = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, slices[0]);
    }

    #[test]
    fn binpack_lists_the_least_free_gpu_first_and_spread_the_most_free() {
        let gpus = [gpu(0, 16, 2), gpu(1, 16, 10), gpu(2, 16, 0), gpu(3, 16, 10)];
        let order = |p| {
            ordered(&gpus, p, MemoryUnit::GIB)
                .iter()
                .map(|g| g.index)
                .collect::<Vec<_>>()
        };
        assert_eq!(order(GpuPolicy::Binpack), [1, 3, 0, 2]);
        assert_eq!(order(GpuPolicy::Spread), [2, 0, 1, 3]);
    }

    /// GPUs of different sizes: the order is by memory free, so first fit over it places a
    /// pod where the extender's best fit (binpack) or most-free (spread) choice would.
    #[test]
    fn on_mixed_gpus_first_fit_over_the_order_is_the_extenders_choice() {
        use crate::core::placement::choose_gpu_in;
        let sizes = [8, 32, 4, 16];
        for allocated in [[0, 0, 0, 0], [4, 0, 0, 0], [4, 30, 4, 1], [8, 8, 0, 15]] {
            let gpus: Vec<SliceGpu> = (0..4)
                .map(|i| gpu(i as u32, sizes[i], allocated[i]))
                .collect();
            for policy in [GpuPolicy::Binpack, GpuPolicy::Spread] {
                for ask in 1..=8u64 {
                    let first_fit = ordered(&gpus, policy, MemoryUnit::GIB)
                        .into_iter()
                        .find(|g| g.memory_bytes / GIB - g.allocated_bytes / GIB >= ask)
                        .map(|g| g.index);
                    let slots: Vec<crate::core::ledger::GpuSlot> = (0..4)
                        .map(|i| crate::core::ledger::GpuSlot {
                            total: crate::core::GpuMem::new(sizes[i]),
                            used: crate::core::GpuMem::new(allocated[i]),
                            healthy: true,
                        })
                        .collect();
                    let extender =
                        choose_gpu_in(&slots, crate::core::GpuMem::new(ask), policy).ok();
                    assert_eq!(first_fit, extender, "{policy:?} {ask} GiB on {allocated:?}");
                }
            }
        }
    }

    #[test]
    fn units_round_memory_down_and_unhealthy_gpus_are_tainted() {
        let mut sick = gpu(1, 24, 0);
        sick.unhealthy = Some("XID 79: GPU has fallen off the bus".into());
        let unit = MemoryUnit::from_mib(256).expect("a unit");
        let mut odd = gpu(0, 0, 0);
        odd.memory_bytes = 1000 << 20; // 1000 MiB: three 256 MiB units
        let slices = build_slices(
            "n",
            "gpushare.io",
            None,
            unit,
            GpuPolicy::Binpack,
            &[odd, sick],
            &[],
            1,
        );
        let devices = slices[0].spec.devices.clone().expect("devices");
        let cap = &devices[0].capacity.as_ref().expect("capacity")["memory"];
        assert_eq!(cap.value.0, (768u64 << 20).to_string());
        assert!(devices[0].taints.is_none());
        assert!(
            devices[0]
                .attributes
                .as_ref()
                .expect("a")
                .get("driverVersion")
                .is_none()
        );
        let taint = &devices[1].taints.as_ref().expect("tainted")[0];
        assert_eq!(taint.key, "gpushare.io/unhealthy");
        assert_eq!(taint.effect, "NoSchedule");
        assert_eq!(
            taint.value.as_deref(),
            Some("XID-79--GPU-has-fallen-off-the-bus")
        );
    }

    #[test]
    fn device_names_are_stable_dns_labels() {
        let mut g = gpu(5, 16, 0);
        assert_eq!(device_name(&g), "gpu-00000005-1111-2222-3333-444444444444");
        g.uuid = "MIG-GPU-weird/uuid".into();
        assert_eq!(device_name(&g), "gpu-5");
        g.uuid = String::new();
        assert_eq!(device_name(&g), "gpu-5");
    }

    #[test]
    fn the_generation_moves_on_every_change_and_only_then() {
        let mut pool = Pool::new();
        let mut gpus = vec![gpu(0, 16, 0), gpu(1, 16, 0)];
        let publish = |pool: &mut Pool, gpus: &[SliceGpu]| {
            pool.update(
                "n",
                "gpushare.io",
                None,
                MemoryUnit::GIB,
                GpuPolicy::Binpack,
                gpus,
                &[],
            )
        };
        let first = publish(&mut pool, &gpus).expect("first publication");
        assert_eq!(first[0].spec.pool.generation, 1);
        assert!(publish(&mut pool, &gpus).is_none(), "nothing changed");
        gpus[1].allocated_bytes = GIB; // binpack order changes
        let second = publish(&mut pool, &gpus).expect("reordered");
        assert_eq!(second[0].spec.pool.generation, 2);
        assert_eq!(names(&second)[0], device_name(&gpus[1]));
        gpus[0].unhealthy = Some("xid".into());
        assert_eq!(
            publish(&mut pool, &gpus).expect("tainted")[0]
                .spec
                .pool
                .generation,
            3
        );
        assert_eq!(pool.generation(), 3);
    }

    #[test]
    fn more_than_128_gpus_split_into_counted_slices() {
        let gpus: Vec<SliceGpu> = (0..130).map(|i| gpu(i, 2, 0)).collect();
        let slices = build_slices(
            "n",
            "gpushare.io",
            None,
            MemoryUnit::GIB,
            GpuPolicy::Spread,
            &gpus,
            &[],
            1,
        );
        assert_eq!(slices.len(), 2);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 2));
        assert_eq!(names(&slices).len(), 130);
        let empty = build_slices(
            "n",
            "gpushare.io",
            None,
            MemoryUnit::GIB,
            GpuPolicy::Spread,
            &[],
            &[],
            1,
        );
        assert_eq!(
            empty.len(),
            1,
            "an empty pool is published as one empty slice"
        );
    }

    /// Upstream's validation: 128 devices per slice, 64 once any device of the slice has a
    /// taint (or consumes counters); a slice over it is refused (422) whole.
    #[test]
    fn a_pool_with_a_tainted_device_splits_at_64() {
        let mut gpus: Vec<SliceGpu> = (0..100).map(|i| gpu(i, 2, 0)).collect();
        let build = |gpus: &[SliceGpu]| {
            build_slices(
                "n",
                "gpushare.io",
                None,
                MemoryUnit::GIB,
                GpuPolicy::Spread,
                gpus,
                &[],
                1,
            )
        };
        assert_eq!(build(&gpus).len(), 1, "100 untainted devices fit one slice");
        gpus[37].unhealthy = Some("xid-79".into());
        let slices = build(&gpus);
        assert_eq!(names(&slices).len(), 100);
        for s in &slices {
            let devices = s.spec.devices.clone().unwrap_or_default();
            let tainted = devices.iter().any(|d| d.taints.is_some());
            let limit = if tainted {
                MAX_DEVICES_PER_SLICE_WITH_TAINTS
            } else {
                MAX_DEVICES_PER_SLICE
            };
            assert!(
                devices.len() <= limit,
                "{} devices, tainted {tainted}",
                devices.len()
            );
        }
        assert!(
            slices
                .iter()
                .all(|s| s.spec.pool.resource_slice_count == slices.len() as i64)
        );
    }

    #[test]
    fn driver_versions_become_semantic_versions() {
        assert_eq!(semver("550.54.15").as_deref(), Some("550.54.15"));
        assert_eq!(semver("535.104.05").as_deref(), Some("535.104.5"));
        assert_eq!(semver("470.82").as_deref(), Some("470.82.0"));
        assert_eq!(semver("abc"), None);
        assert_eq!(semver("1.2.3.4"), None);
    }
}
