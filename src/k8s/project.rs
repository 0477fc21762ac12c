//! Projections of Kubernetes objects into the core's plain types: a Pod's GPU request and
//! annotations, a Node's GPUs (count, per-GPU memory, health, unit), a ResourceClaim's allocation results.
//!
//! Node GPUs come from what the device plugin publishes in `gpushare.io/devices` (per-GPU
//! memory and health, heterogeneous cards) when present and consistent with the node's
//! `aliyun.com/gpu-count`; otherwise from the upstream even split
//! capacity(gpu-mem) ÷ capacity(gpu-count).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};

use crate::core::memory::GpuMem;
use crate::core::request::{PodGpuRequest, RequestError, parse_quantity};
use crate::core::wire::{
    NODE_ANN_DEVICES, NODE_ANN_MEMORY_UNIT, RESOURCE_GPU_COUNT, RESOURCE_GPU_MEM,
};
use crate::core::{AnnotationError, GpuSpec, MemoryUnit, PodGpuAnnotations};

/// A pod's GPU request from its containers' `aliyun.com/gpu-mem` limits (init containers with
/// `restartPolicy: Always` are native sidecars).
pub(crate) fn pod_gpu_request(pod: &Pod) -> Result<PodGpuRequest, RequestError> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(PodGpuRequest::default());
    };
    let limit = |c: &k8s_openapi::api::core::v1::Container| {
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get(RESOURCE_GPU_MEM))
            .map(|q| q.0.clone())
    };
    let app: Vec<(String, Option<String>)> = spec
        .containers
        .iter()
        .map(|c| (c.name.clone(), limit(c)))
        .collect();
    let init: Vec<(String, Option<String>, bool)> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| {
            let sidecar = c.restart_policy.as_deref() == Some("Always");
            (c.name.clone(), limit(c), sidecar)
        })
        .collect();
    PodGpuRequest::from_containers(
        app.iter().map(|(n, l)| (n.as_str(), l.as_deref())),
        init.iter().map(|(n, l, r)| (n.as_str(), l.as_deref(), *r)),
    )
}

/// A pod's gpushare annotations, decoded (bad values reported, read as absent).
pub(crate) fn pod_annotations(pod: &Pod) -> (PodGpuAnnotations, Vec<AnnotationError>) {
    static EMPTY: BTreeMap<String, String> = BTreeMap::new();
    PodGpuAnnotations::decode(pod.metadata.annotations.as_ref().unwrap_or(&EMPTY))
}

/// Whether the pod has finished (Succeeded/Failed): its memory is free again.
///
/// A pod being deleted (deletionTimestamp set) is *not* terminal: its containers may run for
/// the grace period, so it keeps its memory until it is really gone (upstream released it at
/// once, spec §4.3).
pub(crate) fn pod_is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded") | Some("Failed")
    )
}

/// One GPU as the device plugin publishes it in `gpushare.io/devices`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedGpu {
    /// NVML index.
    pub index: u32,
    /// GPU UUID.
    #[serde(default)]
    pub uuid: String,
    /// Memory in units.
    pub memory: u64,
    /// Health.
    pub healthy: bool,
}

/// A node's GPUs as the extender and inspect see them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeGpus {
    /// Per GPU, by index.
    pub gpus: Vec<GpuSpec>,
    /// `capacity[aliyun.com/gpu-mem]`.
    pub capacity: GpuMem,
    /// The unit the device plugin declared, if any.
    pub unit: Option<MemoryUnit>,
    /// Whether per-GPU memory came from the device plugin (else the even split).
    pub published: bool,
    /// The node's first `InternalIP` ([`node_address`]), shown by inspect.
    pub address: Option<String>,
}

/// The first `InternalIP` of a node: the address `kubectl inspect gpushare` shows.
pub fn node_address(node: &Node) -> Option<String> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
        .map(|a| a.address.clone())
}

/// A node's GPUs (empty when it does not offer `aliyun.com/gpu-mem`).
///
/// `use_allocatable` reads `status.allocatable` instead of `status.capacity` (inspect does).
pub fn node_gpus(node: &Node, use_allocatable: bool) -> NodeGpus {
    NodeGpus {
        address: node_address(node),
        ..node_gpus_only(node, use_allocatable)
    }
}

/// [`node_gpus`] without the address.
fn node_gpus_only(node: &Node, use_allocatable: bool) -> NodeGpus {
    let status = node.status.as_ref();
    let resources = status.and_then(|s| {
        if use_allocatable {
            s.allocatable.as_ref()
        } else {
            s.capacity.as_ref()
        }
    });
    let read = |name: &str| {
        resources
            .and_then(|r| r.get(name))
            .and_then(|q| parse_quantity(&q.0).ok())
            .unwrap_or_default()
    };
    let capacity = read(RESOURCE_GPU_MEM);
    let count = read(RESOURCE_GPU_COUNT).units();
    let annotations = node.metadata.annotations.as_ref();
    let unit = annotations
        .and_then(|a| a.get(NODE_ANN_MEMORY_UNIT))
        .and_then(|u| u.parse().ok());
    if capacity.is_zero() {
        return NodeGpus {
            unit,
            ..NodeGpus::default()
        };
    }
    let published: Option<Vec<PublishedGpu>> = annotations
        .and_then(|a| a.get(NODE_ANN_DEVICES))
        .and_then(|v| serde_json::from_str(v).ok());
    if let Some(mut list) = published {
        list.sort_by_key(|g| g.index);
        let consistent = !list.is_empty()
            && (count == 0 || list.len() as u64 == count)
            && list.iter().enumerate().all(|(i, g)| g.index as usize == i)
            && list.iter().all(|g| g.memory <= GpuMem::MAX_REQUEST.units());
        if consistent {
            let gpus = list
                .iter()
                .map(|g| GpuSpec {
                    total: GpuMem::new(g.memory),
                    healthy: g.healthy,
                })
                .collect();
            return NodeGpus {
                gpus,
                capacity,
                unit,
                published: true,
                address: None,
            };
        }
    }
    if count == 0 || count > 1024 {
        return NodeGpus {
            capacity,
            unit,
            ..NodeGpus::default()
        };
    }
    let each = GpuMem::new(capacity.units() / count);
    let gpus = (0..count)
        .map(|_| GpuSpec {
            total: each,
            healthy: true,
        })
        .collect();
    NodeGpus {
        gpus,
        capacity,
        unit,
        published: false,
        address: None,
    }
}

/// The allocation results of a ResourceClaim (`status.allocation.devices.results`); `None`
/// while it is not allocated.
pub fn claim_results(
    claim: &k8s_openapi::api::resource::v1::ResourceClaim,
) -> Option<&[k8s_openapi::api::resource::v1::DeviceRequestAllocationResult]> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn node(mem: &str, count: &str, devices: Option<&str>) -> Node {
        let mut n = Node::default();
        let res = BTreeMap::from([
            (RESOURCE_GPU_MEM.to_string(), Quantity(mem.to_string())),
            (RESOURCE_GPU_COUNT.to_string(), Quantity(count.to_string())),
        ]);
        n.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            capacity: Some(res.clone()),
            allocatable: Some(res),
            ..Default::default()
        });
        if let Some(d) = devices {
            n.metadata.annotations = Some(BTreeMap::from([(
                NODE_ANN_DEVICES.to_string(),
                d.to_string(),
            )]));
        }
        n
    }

    #[test]
    fn even_split_without_published_devices() {
        let g = node_gpus(&node("32552", "2", None), false);
        assert_eq!(g.gpus.len(), 2);
        assert_eq!(g.gpus[0].total, GpuMem::new(16276));
        assert!(!g.published);
    }

    #[test]
    fn published_devices_give_heterogeneous_sizes_and_health() {
        let d = r#"[{"index":1,"uuid":"b","memory":24,"healthy":false},{"index":0,"uuid":"a","memory":16,"healthy":true}]"#;
        let g = node_gpus(&node("40", "2", Some(d)), false);
        assert!(g.published);
        assert_eq!(g.gpus[0].total, GpuMem::new(16));
        assert_eq!(g.gpus[1].total, GpuMem::new(24));
        assert!(!g.gpus[1].healthy);
        // Inconsistent with gpu-count: fall back to the even split.
        let g = node_gpus(&node("40", "4", Some(d)), false);
        assert!(!g.published);
        assert_eq!(g.gpus.len(), 4);
        // Garbage: fall back too.
        assert!(!node_gpus(&node("40", "2", Some("nope")), false).published);
    }

    #[test]
    fn nodes_without_the_resource_have_no_gpus() {
        assert!(node_gpus(&Node::default(), false).gpus.is_empty());
        assert!(node_gpus(&node("0", "2", None), false).gpus.is_empty());
        assert!(node_gpus(&node("16", "0", None), false).gpus.is_empty());
        assert!(
            node_gpus(&node("garbage", "2", None), false)
                .gpus
                .is_empty()
        );
    }
}
