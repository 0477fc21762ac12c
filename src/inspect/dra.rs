//! DRA allocations in the inspect report: the GPUs a node publishes in its ResourceSlices
//! (of our driver: `gpushare.io` unless `dra.driver_name` / `--driver-name` says otherwise) and the ResourceClaims allocated on them, added to the same per-GPU
//! table as the annotation ledger.
//!
//! A device is mapped to its GPU index through the slice's `index` attribute; its size is the
//! `memory` capacity. A claim's result counts `consumedCapacity.memory` (rounded up to whole
//! units of the node; the whole GPU when absent) for the pods in the claim's `reservedFor`
//! (the first pod; `claim/<name>` while none is reserved). A node that has both paths' GPUs
//! shows both; a node with only DRA GPUs gets its unit from the slice's memory step.
//!
//! The node's devices of other kinds (RDMA HCAs, generic devices: a `resource` attribute)
//! join the table of other devices below the GPUs, one row per resource: its total shares,
//! and the shares each claim's pod holds (`consumedCapacity.shares`; an exclusive device is
//! one).
//!
//! Pure: no I/O (the role lists slices and claims; an API server without `resource.k8s.io`
//! gives none).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};

use super::report::{DeviceHolder, DeviceReport, GpuReport, NodeReport, OtherPath, PodShare};
use crate::core::MemoryUnit;
use crate::core::parse_whole_quantity;
use crate::core::wire::{
    DRA_ATTR_INDEX, DRA_ATTR_RESOURCE, DRA_CAPACITY_MEMORY, DRA_CAPACITY_SHARES, DRA_DRIVER_NAME,
};
use crate::k8s::project::claim_results;

/// The state of a pod whose memory comes from a DRA claim.
pub const STATE_DRA_CLAIM: &str = "dra-claim";

/// What the API holds on the DRA path.
#[derive(Clone, Debug)]
pub struct DraCluster {
    /// ResourceSlices (every driver; only ours are read).
    pub slices: Vec<ResourceSlice>,
    /// ResourceClaims (only allocations of our driver are read).
    pub claims: Vec<ResourceClaim>,
    /// Our DRA driver's name (`dra.driver_name`, the chart's `dra.driverName`).
    pub driver: String,
}

impl Default for DraCluster {
    fn default() -> Self {
        DraCluster {
            slices: Vec::new(),
            claims: Vec::new(),
            driver: DRA_DRIVER_NAME.to_string(),
        }
    }
}

/// One published GPU: index and memory in bytes.
struct Device {
    index: u32,
    bytes: u64,
}

impl DraCluster {
    /// The same objects, read as those of driver `driver`.
    pub fn with_driver(mut self, driver: &str) -> DraCluster {
        self.driver = driver.to_string();
        self
    }

    /// Reads the ResourceSlices and ResourceClaims of a fixture (the YAML forms of
    /// [`super::report::cluster_from_yaml`]); other kinds are ignored.
    pub fn from_yaml(text: &str) -> anyhow::Result<DraCluster> {
        let mut out = DraCluster::default();
        for item in super::report::yaml_items(text)? {
            match item.get("kind").and_then(|k| k.as_str()) {
                Some("ResourceSlice") => out.slices.push(yaml_serde::from_value(item)?),
                Some("ResourceClaim") => out.claims.push(yaml_serde::from_value(item)?),
                _ => {}
            }
        }
        Ok(out)
    }

    /// The devices of other kinds of `node` by name: their resource and shares.
    fn kind_devices(&self, node: &str) -> BTreeMap<String, (String, u64)> {
        let mut out = BTreeMap::new();
        for slice in &self.slices {
            let s = &slice.spec;
            if s.driver != self.driver || s.node_name.as_deref() != Some(node) {
                continue;
            }
            for d in s.devices.iter().flatten() {
                let Some(resource) = d
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(DRA_ATTR_RESOURCE))
                    .and_then(|a| a.string.clone())
                else {
                    continue;
                };
                let shares = d
                    .capacity
                    .as_ref()
                    .and_then(|c| c.get(DRA_CAPACITY_SHARES))
                    .and_then(|c| parse_whole_quantity(&c.value.0).ok())
                    .unwrap_or(1);
                out.insert(d.name.clone(), (resource, shares));
            }
        }
        out
    }

    /// Adds the node's devices of other kinds and who holds them to `report.devices`.
    fn add_kinds(&self, report: &mut NodeReport) {
        let devices = self.kind_devices(&report.name);
        if devices.is_empty() {
            return;
        }
        let mut rows: BTreeMap<String, DeviceReport> = BTreeMap::new();
        for (resource, shares) in devices.values() {
            let row = rows
                .entry(resource.clone())
                .or_insert_with(|| DeviceReport {
                    resource: resource.clone(),
                    ..DeviceReport::default()
                });
            row.total = row.total.saturating_add(*shares);
        }
        for claim in &self.claims {
            let results = claim_results(claim);
            let holder = holder(claim);
            for r in results.into_iter().flatten() {
                if r.driver != self.driver || r.pool != report.name {
                    continue;
                }
                let Some((resource, _)) = devices.get(&r.device) else {
                    continue;
                };
                let count = r
                    .consumed_capacity
                    .as_ref()
                    .and_then(|c| c.get(DRA_CAPACITY_SHARES))
                    .and_then(|q| parse_whole_quantity(&q.0).ok())
                    .unwrap_or(1);
                let Some(row) = rows.get_mut(resource) else {
                    continue;
                };
                row.used = row.used.saturating_add(count);
                match row.pods.iter_mut().find(|h| h.pod == holder) {
                    Some(h) => h.count = h.count.saturating_add(count),
                    None => row.pods.push(DeviceHolder {
                        pod: holder.clone(),
                        count,
                    }),
                }
            }
        }
        for (resource, mut row) in rows {
            row.pods.sort();
            match report.devices.iter_mut().find(|d| d.resource == resource) {
                Some(d) => {
                    d.total = d.total.saturating_add(row.total);
                    d.used = d.used.saturating_add(row.used);
                    d.pods.extend(row.pods);
                    d.pods.sort();
                }
                None => report.devices.push(row),
            }
        }
    }

    /// The devices of `node` by name, and the unit their memory step says.
    fn devices(&self, node: &str) -> (BTreeMap<String, Device>, Option<MemoryUnit>) {
        let mut out = BTreeMap::new();
        let mut unit = None;
        for slice in &self.slices {
            let s = &slice.spec;
            if s.driver != self.driver || s.node_name.as_deref() != Some(node) {
                continue;
            }
            for d in s.devices.iter().flatten() {
                let index = d
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(DRA_ATTR_INDEX))
                    .and_then(|a| a.int)
                    .and_then(|i| u32::try_from(i).ok());
                let capacity = d.capacity.as_ref().and_then(|c| c.get(DRA_CAPACITY_MEMORY));
                let bytes = capacity.and_then(|c| parse_whole_quantity(&c.value.0).ok());
                let step = capacity
                    .and_then(|c| c.request_policy.as_ref())
                    .and_then(|p| p.valid_range.as_ref())
                    .and_then(|r| r.step.as_ref())
                    .and_then(|q| parse_whole_quantity(&q.0).ok());
                if unit.is_none() {
                    unit = step
                        .and_then(|b| u32::try_from(b >> 20).ok())
                        .and_then(MemoryUnit::from_mib);
                }
                if let (Some(index), Some(bytes)) = (index, bytes) {
                    out.insert(d.name.clone(), Device { index, bytes });
                }
            }
        }
        (out, unit)
    }
}

/// Who holds a claim, as the table of other devices names pods: `namespace/pod` of the first
/// pod it is reserved for, else `namespace/claim/<name>`.
fn holder(claim: &ResourceClaim) -> String {
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
    match reserved.and_then(|r| r.iter().find(|c| c.resource == "pods")) {
        Some(pod) => format!("{namespace}/{}", pod.name),
        None => format!(
            "{namespace}/claim/{}",
            claim.metadata.name.as_deref().unwrap_or_default()
        ),
    }
}

impl OtherPath for DraCluster {
    /// Whether `node` publishes GPUs on the DRA path.
    fn serves(&self, node: &str) -> bool {
        !self.devices(node).0.is_empty()
    }

    /// The unit of a node that serves only on the DRA path.
    fn unit_of(&self, node: &str) -> Option<MemoryUnit> {
        self.devices(node).1
    }

    /// Adds the node's DRA GPUs (those the report does not have yet) and its claims' shares.
    /// `unit` is the node's memory unit.
    fn add_to(&self, report: &mut NodeReport, unit: MemoryUnit) {
        self.add_kinds(report);
        let (devices, _) = self.devices(&report.name);
        if devices.is_empty() {
            return;
        }
        let unit_bytes = unit.to_bytes(crate::core::GpuMem::new(1)).max(1);
        for d in devices.values() {
            if report.gpus.iter().all(|g| g.index != d.index) {
                let total = d.bytes / unit_bytes;
                report.gpus.push(GpuReport {
                    index: d.index,
                    total,
                    used: 0,
                    healthy: true,
                    pods: Vec::new(),
                });
                report.total = report.total.saturating_add(total);
            }
        }
        report.gpus.sort_by_key(|g| g.index);
        for claim in &self.claims {
            let Some(results) = claim_results(claim) else {
                continue;
            };
            let namespace = claim.metadata.namespace.clone().unwrap_or_default();
            let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
            let (name, uid) = match reserved.and_then(|r| r.iter().find(|c| c.resource == "pods")) {
                Some(pod) => (pod.name.clone(), pod.uid.clone()),
                None => (
                    format!(
                        "claim/{}",
                        claim.metadata.name.as_deref().unwrap_or_default()
                    ),
                    String::new(),
                ),
            };
            for r in results {
                if r.driver != self.driver || r.pool != report.name {
                    continue;
                }
                let Some(device) = devices.get(&r.device) else {
                    continue;
                };
                let bytes = r
                    .consumed_capacity
                    .as_ref()
                    .and_then(|c| c.get(DRA_CAPACITY_MEMORY))
                    .and_then(|q| parse_whole_quantity(&q.0).ok())
                    .unwrap_or(device.bytes);
                let memory = bytes.div_ceil(unit_bytes);
                let Some(gpu) = report.gpus.iter_mut().find(|g| g.index == device.index) else {
                    continue;
                };
                match gpu
                    .pods
                    .iter_mut()
                    .find(|p| p.namespace == namespace && p.name == name && p.uid == uid)
                {
                    Some(p) => p.memory = p.memory.saturating_add(memory),
                    None => gpu.pods.push(PodShare {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        uid: uid.clone(),
                        memory,
                        state: STATE_DRA_CLAIM.to_string(),
                        gpu_memory: None,
                    }),
                }
            }
        }
    }
}
