//! The inspect report: who holds how much memory on which GPU, per node — a pure model built
//! either from Nodes and Pods (what the API server says) or from the extender's `/inspect`
//! answer (what the scheduler believes).
//!
//! Rules (reference spec §6, with the upstream bugs fixed):
//! - nodes: those whose `allocatable[aliyun.com/gpu-mem]` is > 0, sorted by name; a node
//!   without the resource is skipped (also when named);
//! - GPUs: from [`node_gpus`] on `allocatable` — the device plugin's published per-GPU sizes
//!   and health when present, else the upstream even split;
//! - pods: on the node, not Succeeded/Failed, asking for GPU memory; memory = the pod's
//!   request (`max(largest init, sum of app containers)`, i.e. upstream's limits sum for
//!   ordinary pods), or its `ALIYUN_COM_GPU_MEM_POD` annotation when the limits cannot be read;
//! - placement: `scheduler.framework.gpushare.allocation` when it decodes (per-GPU amounts),
//!   else the whole memory on GPU `ALIYUN_COM_GPU_MEM_IDX`; without a valid index, or with an
//!   index the node does not have (gpu-count shrank), the pod goes to `pending` — never a
//!   panic;
//! - pods in a bucket are sorted by namespace, then name;
//! - the unit: what the device plugin declared (`gpushare.io/memory-unit`), else upstream's
//!   guess (per-GPU memory > 100 ⇒ MiB, else GiB). The report's unit is that of the first
//!   node by name; when nodes disagree a note says so.
//!
//! This module does not talk to anything and does not format text (see `render`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};

use crate::core::MemoryUnit;
use crate::core::annotations::decode_allocation_json;
use crate::core::wire::ANN_ALLOCATION_JSON;
use crate::core::wire::NODE_ANN_CONTAINER_GPU_MEMORY;
use crate::k8s::project::{node_gpus, pod_annotations, pod_gpu_request, pod_is_terminal};
use crate::node::enforcement::report::{ContainerMemory, LimitState, from_annotation};

/// The whole report. Serialized as the `json`/`yaml` output (camelCase keys).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Where the data came from: `api` or `extender`.
    pub source: String,
    /// Unit label of the cluster totals (the first node's unit; `GiB` when there are none).
    pub unit: String,
    /// Nodes, by name.
    pub nodes: Vec<NodeReport>,
    /// Sum of the nodes' totals.
    pub total: u64,
    /// Sum of the nodes' used memory (pending included).
    pub used: u64,
    /// Remarks for the reader (e.g. nodes that count in different units).
    pub notes: Vec<String>,
}

/// One node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    /// Node name.
    pub name: String,
    /// First `InternalIP`, else `unknown`.
    pub address: String,
    /// Unit label of this node's amounts.
    pub unit: String,
    /// GPUs by index.
    pub gpus: Vec<GpuReport>,
    /// Pods on the node that hold memory on no known GPU (no valid index, or an index the
    /// node does not have): upstream's `PENDING` column.
    pub pending: Vec<PodShare>,
    /// The node's GPU memory (`allocatable[aliyun.com/gpu-mem]`).
    pub total: u64,
    /// Memory held on the node, pending included.
    pub used: u64,
    /// The largest request that still fits on one healthy GPU of this node.
    pub largest_fit: u64,
    /// Devices other than GPUs: each extended resource the node offers beside the GPU's
    /// (`gpushare.io/rdma`, generic devices), by name, with the pods asking for it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceReport>,
}

/// One extended resource beside the GPU on a node, and who holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceReport {
    /// The resource (`gpushare.io/rdma`).
    pub resource: String,
    /// `allocatable` of the node.
    pub total: u64,
    /// What the pods on the node ask (the largest init container or the sum of the app
    /// containers, per pod).
    pub used: u64,
    /// The pods asking for it, by `namespace/name`.
    pub pods: Vec<DeviceHolder>,
}

/// A pod holding devices of one resource.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceHolder {
    /// `namespace/name`.
    pub pod: String,
    /// How many it asks.
    pub count: u64,
}

/// Whether `name` is an extended resource beside the GPU: a domain of its own, not the GPU's
/// (`aliyun.com/gpu-*`, `nvidia.com/gpu`) and not Kubernetes' own.
fn other_device_resource(name: &str) -> bool {
    let Some((domain, _)) = name.split_once('/') else {
        return false;
    };
    !(domain == "aliyun.com" || name == "nvidia.com/gpu" || domain.ends_with("kubernetes.io"))
}

/// The other devices of `node`, with the requests of `pods` (those on the node, not finished).
fn other_devices(node: &Node, pods: &[&Pod]) -> Vec<DeviceReport> {
    let Some(alloc) = node.status.as_ref().and_then(|s| s.allocatable.as_ref()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (resource, q) in alloc {
        if !other_device_resource(resource) {
            continue;
        }
        let total = q.0.trim().parse::<u64>().unwrap_or(0);
        let mut report = DeviceReport {
            resource: resource.clone(),
            total,
            ..DeviceReport::default()
        };
        for pod in pods {
            let Some(spec) = &pod.spec else { continue };
            let ask = |c: &k8s_openapi::api::core::v1::Container| {
                c.resources
                    .as_ref()
                    .and_then(|r| r.limits.as_ref())
                    .and_then(|l| l.get(resource))
                    .and_then(|q| q.0.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            let app: u64 = spec.containers.iter().map(ask).fold(0, u64::saturating_add);
            let init = spec
                .init_containers
                .iter()
                .flatten()
                .map(ask)
                .max()
                .unwrap_or(0);
            let n = app.max(init);
            if n > 0 {
                let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
                let name = pod.metadata.name.as_deref().unwrap_or_default();
                report.pods.push(DeviceHolder {
                    pod: format!("{ns}/{name}"),
                    count: n,
                });
                report.used = report.used.saturating_add(n);
            }
        }
        report.pods.sort();
        out.push(report);
    }
    out
}

/// One GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    /// GPU index on the node.
    pub index: u32,
    /// Its memory.
    pub total: u64,
    /// Memory held by pods on it.
    pub used: u64,
    /// Health as the device plugin publishes it (always true without published devices).
    pub healthy: bool,
    /// Pods holding memory on it, by namespace then name.
    pub pods: Vec<PodShare>,
}

/// What one pod holds on one GPU (or in the pending bucket).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodShare {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID (may be empty when the source does not give it).
    pub uid: String,
    /// Memory held here, in the node's unit.
    pub memory: u64,
    /// One of [`PodState`]'s names.
    pub state: String,
    /// Under driver enforcement: what the pod's containers use of this GPU and their limits,
    /// as the node agent last read them back (the node annotation
    /// `gpushare.io/container-gpu-memory`); absent without readback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<PodGpuMemory>,
}

/// A pod's GPU memory on one GPU as the node agent read it back.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodGpuMemory {
    /// Bytes its containers use (the sum of those read).
    pub used_bytes: u64,
    /// `enforced` when every container's limit is its share, else the first other state
    /// (`missing`, `mismatch`, `unreadable`).
    pub state: String,
    /// Each container's row.
    pub containers: Vec<ContainerMemory>,
}

/// Why a pod is where it is (the `state` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    /// The device plugin served it (`ALIYUN_COM_GPU_MEM_ASSIGNED=true`).
    Assigned,
    /// The extender bound it; the device plugin has not served it yet (`ASSIGNED=false`).
    Assumed,
    /// It has a GPU index but no `ASSIGNED` annotation.
    Bound,
    /// Placed by the `scheduler.framework.gpushare.allocation` annotation.
    AllocationAnnotation,
    /// No valid GPU index: bound without the extender (pending column).
    NoIndex,
    /// Its GPU index is beyond the node's GPUs (pending column).
    IndexOutOfRange,
}

impl PodState {
    /// The name used in the output.
    pub fn as_str(self) -> &'static str {
        match self {
            PodState::Assigned => "assigned",
            PodState::Assumed => "assumed",
            PodState::Bound => "bound",
            PodState::AllocationAnnotation => "allocation-annotation",
            PodState::NoIndex => "no-index",
            PodState::IndexOutOfRange => "index-out-of-range",
        }
    }
}

/// Upstream's unit guess for a node that does not declare one.
pub(crate) fn guess_unit(per_gpu: u64) -> &'static str {
    if per_gpu > 100 { "MiB" } else { "GiB" }
}

/// Reads a cluster fixture: a YAML `List` (or a plain sequence, or several documents) of
/// Nodes and Pods; other kinds are ignored.
pub fn cluster_from_yaml(text: &str) -> anyhow::Result<(Vec<Node>, Vec<Pod>)> {
    let mut nodes = Vec::new();
    let mut pods = Vec::new();
    for item in yaml_items(text)? {
        match item.get("kind").and_then(|k| k.as_str()) {
            Some("Node") => nodes.push(yaml_serde::from_value(item)?),
            Some("Pod") => pods.push(yaml_serde::from_value(item)?),
            _ => {}
        }
    }
    Ok((nodes, pods))
}

/// The objects of a fixture: a YAML `List`, a plain sequence, or several documents.
pub(crate) fn yaml_items(text: &str) -> anyhow::Result<Vec<yaml_serde::Value>> {
    let mut out = Vec::new();
    for doc in yaml_serde::Deserializer::from_str(text) {
        let value = yaml_serde::Value::deserialize(doc)?;
        let items = match value {
            yaml_serde::Value::Sequence(items) => items,
            yaml_serde::Value::Mapping(mut m) => match m.remove("items") {
                Some(yaml_serde::Value::Sequence(items)) => items,
                Some(_) => Vec::new(),
                None => vec![yaml_serde::Value::Mapping(m)],
            },
            _ => Vec::new(),
        };
        out.extend(items);
    }
    Ok(out)
}

/// The first `InternalIP` of a node, else `unknown` (upstream).
/// GPUs a node serves on another path than the annotation ledger (the DRA path,
/// [`super::dra::DraCluster`]), added to the same table.
pub trait OtherPath {
    /// Whether `node` serves GPUs on that path.
    fn serves(&self, node: &str) -> bool;
    /// The unit of a node that serves only on that path.
    fn unit_of(&self, node: &str) -> Option<MemoryUnit>;
    /// Adds the node's GPUs on that path and what is allocated on them; `unit` is the node's.
    fn add_to(&self, report: &mut NodeReport, unit: MemoryUnit);
}

/// No other path.
impl OtherPath for () {
    fn serves(&self, _: &str) -> bool {
        false
    }
    fn unit_of(&self, _: &str) -> Option<MemoryUnit> {
        None
    }
    fn add_to(&self, _: &mut NodeReport, _: MemoryUnit) {}
}

fn node_address(node: &Node) -> String {
    crate::k8s::node_address(node).unwrap_or_else(|| "unknown".to_string())
}

impl Report {
    /// Builds the report from the API's Nodes and Pods. `only` restricts it to one node.
    pub fn from_cluster(nodes: &[Node], pods: &[Pod], only: Option<&str>) -> Report {
        Report::from_cluster_with_dra(nodes, pods, &(), only)
    }

    /// [`Report::from_cluster`] with the DRA path's slices and claims: a node's DRA GPUs and
    /// allocations are in the same table (see [`super::dra`]).
    pub fn from_cluster_with_dra(
        nodes: &[Node],
        pods: &[Pod],
        dra: &dyn OtherPath,
        only: Option<&str>,
    ) -> Report {
        let mut by_node: BTreeMap<&str, Vec<&Pod>> = BTreeMap::new();
        for pod in pods {
            let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
                continue;
            };
            if !pod_is_terminal(pod) {
                by_node.entry(node).or_default().push(pod);
            }
        }
        let mut reports = Vec::new();
        for node in nodes {
            let name = node.metadata.name.as_deref().unwrap_or_default();
            if only.is_some_and(|o| o != name) {
                continue;
            }
            let gpus = node_gpus(node, true);
            let dra_only = gpus.capacity.is_zero();
            if dra_only && !dra.serves(name) {
                continue;
            }
            let unit_value = match gpus.unit {
                Some(u) => u,
                None if dra_only => dra.unit_of(name).unwrap_or(MemoryUnit::GIB),
                None => {
                    let per_gpu = match gpus.gpus.first() {
                        Some(g) => g.total.units(),
                        None => gpus.capacity.units(),
                    };
                    if guess_unit(per_gpu) == "MiB" {
                        MemoryUnit::MIB
                    } else {
                        MemoryUnit::GIB
                    }
                }
            };
            let unit = match gpus.unit {
                Some(u) => u.to_string(),
                None if dra_only => unit_value.to_string(),
                None => {
                    let per_gpu = match gpus.gpus.first() {
                        Some(g) => g.total.units(),
                        None => gpus.capacity.units(),
                    };
                    guess_unit(per_gpu).to_string()
                }
            };
            let mut report = NodeReport {
                name: name.to_string(),
                address: node_address(node),
                unit,
                gpus: gpus
                    .gpus
                    .iter()
                    .enumerate()
                    .map(|(i, g)| GpuReport {
                        index: i as u32,
                        total: g.total.units(),
                        used: 0,
                        healthy: g.healthy,
                        pods: Vec::new(),
                    })
                    .collect(),
                pending: Vec::new(),
                total: gpus.capacity.units(),
                used: 0,
                largest_fit: 0,
                devices: other_devices(node, by_node.get(name).map_or(&[][..], Vec::as_slice)),
            };
            for pod in by_node.get(name).into_iter().flatten() {
                place_pod(&mut report, pod);
            }
            dra.add_to(&mut report, unit_value);
            attach_gpu_memory(&mut report, node);
            report.finish();
            reports.push(report);
        }
        Report::from_nodes("api", reports)
    }

    /// Assembles a report from finished node reports: sorts them and sums the totals.
    pub(crate) fn from_nodes(source: &str, mut nodes: Vec<NodeReport>) -> Report {
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        let unit = nodes
            .first()
            .map(|n| n.unit.clone())
            .unwrap_or_else(|| "GiB".to_string());
        let mut notes = Vec::new();
        if nodes.iter().any(|n| n.unit != unit) {
            let list: Vec<String> = nodes
                .iter()
                .map(|n| format!("{}={}", n.name, n.unit))
                .collect();
            notes.push(format!(
                "nodes count GPU memory in different units ({}); totals are plain sums labelled {unit}",
                list.join(", ")
            ));
        }
        let total = nodes
            .iter()
            .map(|n| n.total)
            .fold(0u64, u64::saturating_add);
        let used = nodes.iter().map(|n| n.used).fold(0u64, u64::saturating_add);
        Report {
            source: source.to_string(),
            unit,
            nodes,
            total,
            used,
            notes,
        }
    }
}

impl NodeReport {
    /// Sorts the pods, sums the used memory (a GPU's `used` is at least its pods' sum) and
    /// computes the largest fit.
    pub fn finish(&mut self) {
        let by_name = |a: &PodShare, b: &PodShare| {
            (a.namespace.as_str(), a.name.as_str(), a.uid.as_str()).cmp(&(
                b.namespace.as_str(),
                b.name.as_str(),
                b.uid.as_str(),
            ))
        };
        for gpu in &mut self.gpus {
            gpu.pods.sort_by(by_name);
            // The pods' sum, or more when the source says so (the extender counts pods it
            // cannot list yet).
            let pods = gpu
                .pods
                .iter()
                .map(|p| p.memory)
                .fold(0, u64::saturating_add);
            gpu.used = gpu.used.max(pods);
        }
        self.pending.sort_by(by_name);
        let pending: u64 = self
            .pending
            .iter()
            .map(|p| p.memory)
            .fold(0, u64::saturating_add);
        self.used = self
            .gpus
            .iter()
            .map(|g| g.used)
            .fold(pending, u64::saturating_add);
        self.largest_fit = self
            .gpus
            .iter()
            .filter(|g| g.healthy)
            .map(|g| g.total.saturating_sub(g.used))
            .max()
            .unwrap_or(0);
    }

    /// Memory in the pending bucket.
    pub(crate) fn pending_memory(&self) -> u64 {
        self.pending
            .iter()
            .map(|p| p.memory)
            .fold(0, u64::saturating_add)
    }
}

/// Adds what the node agent read back of each pod's containers (the node annotation
/// `gpushare.io/container-gpu-memory`) to the pods on each GPU.
fn attach_gpu_memory(report: &mut NodeReport, node: &Node) {
    let Some(rows) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_ANN_CONTAINER_GPU_MEMORY))
        .and_then(|t| from_annotation(t))
    else {
        return;
    };
    for gpu in &mut report.gpus {
        for pod in &mut gpu.pods {
            let mine: Vec<ContainerMemory> = rows
                .iter()
                .filter(|r| {
                    r.index == gpu.index && r.namespace == pod.namespace && r.pod == pod.name
                })
                .cloned()
                .collect();
            if mine.is_empty() {
                continue;
            }
            let state = mine
                .iter()
                .map(|r| r.state)
                .find(|s| *s != LimitState::Enforced)
                .unwrap_or(LimitState::Enforced);
            pod.gpu_memory = Some(PodGpuMemory {
                used_bytes: mine
                    .iter()
                    .filter_map(|r| r.used)
                    .fold(0, u64::saturating_add),
                state: state.as_str().to_string(),
                containers: mine,
            });
        }
    }
}

/// Puts one pod's memory where it belongs on `node`.
fn place_pod(node: &mut NodeReport, pod: &Pod) {
    let (annotations, _) = pod_annotations(pod);
    // The one rule the extender and the device plugin count by.
    let memory = crate::core::pod_holding(pod_gpu_request(pod).ok().as_ref(), &annotations);
    if memory.is_zero() {
        return;
    }
    let share = |memory: u64, state: PodState| PodShare {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        memory,
        state: state.as_str().to_string(),
        gpu_memory: None,
    };
    let allocation = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANN_ALLOCATION_JSON))
        .and_then(|v| decode_allocation_json(v).ok())
        .filter(|a| !a.is_empty());
    if let Some(allocation) = allocation {
        let mut orphaned = 0u64;
        for (gpu, mem) in allocation {
            match node.gpus.get_mut(gpu as usize) {
                Some(g) => g
                    .pods
                    .push(share(mem.units(), PodState::AllocationAnnotation)),
                None => orphaned = orphaned.saturating_add(mem.units()),
            }
        }
        if orphaned > 0 {
            node.pending
                .push(share(orphaned, PodState::IndexOutOfRange));
        }
        return;
    }
    let state = match annotations.assigned {
        Some(true) => PodState::Assigned,
        Some(false) => PodState::Assumed,
        None => PodState::Bound,
    };
    match annotations.gpu_index {
        Some(i) => match node.gpus.get_mut(i as usize) {
            Some(g) => g.pods.push(share(memory.units(), state)),
            None => node
                .pending
                .push(share(memory.units(), PodState::IndexOutOfRange)),
        },
        None => node.pending.push(share(memory.units(), PodState::NoIndex)),
    }
}

/// The extender's `/inspect` answer (upstream keys, plus the optional extras our extender
/// adds: node `unit`, `address` and `pending` pods, device `healthy`, pod `uid` and `state`).
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct ExtenderInspect {
    /// Nodes.
    #[serde(default)]
    pub nodes: Vec<ExtenderNode>,
    /// Error text, when the extender failed.
    #[serde(default)]
    pub error: Option<String>,
}

/// A node in the extender's answer.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtenderNode {
    /// Node name.
    #[serde(default)]
    pub name: String,
    /// Node capacity of gpu-mem.
    #[serde(default, rename = "totalGPU")]
    pub total_gpu: u64,
    /// Memory in use on the node.
    #[serde(default, rename = "usedGPU")]
    pub used_gpu: u64,
    /// GPUs.
    #[serde(default)]
    pub devs: Vec<ExtenderDev>,
    /// Unit (ours).
    #[serde(default)]
    pub unit: Option<String>,
    /// Address (ours).
    #[serde(default)]
    pub address: Option<String>,
    /// Pods on the node whose GPU index it does not have (ours).
    #[serde(default)]
    pub pending: Vec<ExtenderPod>,
}

/// A GPU in the extender's answer.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtenderDev {
    /// GPU index (`-1`: pods without a GPU).
    #[serde(default)]
    pub id: i64,
    /// GPU memory.
    #[serde(default, rename = "totalGPU")]
    pub total_gpu: u64,
    /// Memory in use.
    #[serde(default, rename = "usedGPU")]
    pub used_gpu: u64,
    /// Pods.
    #[serde(default)]
    pub pods: Vec<ExtenderPod>,
    /// Health (ours; absent means healthy).
    #[serde(default)]
    pub healthy: Option<bool>,
}

/// A pod in the extender's answer.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtenderPod {
    /// Name.
    #[serde(default)]
    pub name: String,
    /// Namespace.
    #[serde(default)]
    pub namespace: String,
    /// Memory it holds.
    #[serde(default, rename = "usedGPU")]
    pub used_gpu: u64,
    /// UID (ours).
    #[serde(default)]
    pub uid: Option<String>,
    /// State (ours).
    #[serde(default)]
    pub state: Option<String>,
}

impl Report {
    /// Builds the report from the extender's `/inspect` answer.
    pub(crate) fn from_extender(answer: &ExtenderInspect) -> Report {
        let mut nodes = Vec::new();
        for n in &answer.nodes {
            if n.total_gpu == 0 {
                continue;
            }
            let mut devs: Vec<&ExtenderDev> = n.devs.iter().filter(|d| d.id >= 0).collect();
            devs.sort_by_key(|d| d.id);
            let per_gpu = devs.first().map(|d| d.total_gpu).unwrap_or(n.total_gpu);
            let unit = n
                .unit
                .clone()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| guess_unit(per_gpu).to_string());
            let share = |p: &ExtenderPod, pending: bool| PodShare {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                uid: p.uid.clone().unwrap_or_default(),
                memory: p.used_gpu,
                state: match &p.state {
                    Some(s) if !s.is_empty() => s.clone(),
                    _ if pending => PodState::NoIndex.as_str().to_string(),
                    _ => PodState::Bound.as_str().to_string(),
                },
                gpu_memory: None,
            };
            let mut report = NodeReport {
                name: n.name.clone(),
                address: n.address.clone().unwrap_or_else(|| "unknown".to_string()),
                unit,
                total: n.total_gpu,
                ..NodeReport::default()
            };
            // GPUs are numbered 0..n by the extender; a gap or a negative id is pending.
            for d in &devs {
                if d.id as usize == report.gpus.len() {
                    report.gpus.push(GpuReport {
                        index: d.id as u32,
                        total: d.total_gpu,
                        used: d.used_gpu,
                        healthy: d.healthy.unwrap_or(true),
                        pods: d.pods.iter().map(|p| share(p, false)).collect(),
                    });
                } else {
                    report.pending.extend(d.pods.iter().map(|p| share(p, true)));
                }
            }
            for d in n.devs.iter().filter(|d| d.id < 0) {
                report.pending.extend(d.pods.iter().map(|p| share(p, true)));
            }
            report
                .pending
                .extend(n.pending.iter().map(|p| share(p, true)));
            report.finish();
            nodes.push(report);
        }
        Report::from_nodes("extender", nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: n1}
  status:
    allocatable: {aliyun.com/gpu-mem: "30", aliyun.com/gpu-count: "2"}
    addresses: [{type: Hostname, address: n1}, {type: InternalIP, address: 10.0.0.1}]
- apiVersion: v1
  kind: Node
  metadata: {name: n0}
  status: {allocatable: {cpu: "4"}}
- apiVersion: v1
  kind: Pod
  metadata: {name: b, namespace: default, uid: u-b, annotations: {ALIYUN_COM_GPU_MEM_IDX: "1", ALIYUN_COM_GPU_MEM_ASSIGNED: "true"}}
  spec:
    nodeName: n1
    containers: [{name: c, resources: {limits: {aliyun.com/gpu-mem: "4"}}}]
- apiVersion: v1
  kind: Pod
  metadata: {name: a, namespace: default, uid: u-a, annotations: {ALIYUN_COM_GPU_MEM_IDX: "7"}}
  spec:
    nodeName: n1
    containers: [{name: c, resources: {limits: {aliyun.com/gpu-mem: "2"}}}]
- apiVersion: v1
  kind: Pod
  metadata: {name: done, namespace: default, annotations: {ALIYUN_COM_GPU_MEM_IDX: "0"}}
  spec:
    nodeName: n1
    containers: [{name: c, resources: {limits: {aliyun.com/gpu-mem: "9"}}}]
  status: {phase: Succeeded}
"#;

    #[test]
    fn pods_land_on_their_gpu_or_in_pending() {
        let (nodes, pods) = cluster_from_yaml(CLUSTER).unwrap();
        let r = Report::from_cluster(&nodes, &pods, None);
        assert_eq!(r.nodes.len(), 1, "the node without gpu-mem is skipped");
        let n = &r.nodes[0];
        assert_eq!(n.address, "10.0.0.1");
        assert_eq!(n.unit, "GiB");
        assert_eq!(n.gpus[1].used, 4);
        assert_eq!(n.gpus[1].pods[0].state, "assigned");
        assert_eq!(n.gpus[0].used, 0, "finished pods hold nothing");
        assert_eq!(n.pending[0].name, "a");
        assert_eq!(n.pending[0].state, "index-out-of-range");
        assert_eq!((n.used, n.total, n.largest_fit), (6, 30, 15));
        assert_eq!((r.used, r.total), (6, 30));
    }

    #[test]
    fn naming_a_node_keeps_only_it() {
        let (nodes, pods) = cluster_from_yaml(CLUSTER).unwrap();
        assert_eq!(
            Report::from_cluster(&nodes, &pods, Some("n0")).nodes.len(),
            0
        );
        assert_eq!(
            Report::from_cluster(&nodes, &pods, Some("n1")).nodes.len(),
            1
        );
    }

    #[test]
    fn fixtures_may_be_lists_sequences_or_documents() {
        let docs = "kind: Node\nmetadata: {name: a}\n---\n- kind: Pod\n  metadata: {name: p}\n- kind: Service\n";
        let (nodes, pods) = cluster_from_yaml(docs).unwrap();
        assert_eq!((nodes.len(), pods.len()), (1, 1));
        assert!(cluster_from_yaml("kind: Node\nmetadata: 7\n").is_err());
    }

    #[test]
    fn the_unit_is_guessed_only_without_a_declaration() {
        assert_eq!(guess_unit(15), "GiB");
        assert_eq!(guess_unit(141), "MiB");
    }
}
