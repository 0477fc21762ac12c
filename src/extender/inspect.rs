//! The inspect endpoint: the ledger as JSON, in upstream's shape
//! (`{"nodes":[{"name","totalGPU","usedGPU","devs":[{"id","totalGPU","usedGPU","pods":[…]}]}]}`)
//! with added fields: node `unit`, `address` (its first `InternalIP`) and `pending` (pods whose GPU index is not on the node),
//! GPU `healthy`, pod `uid` and `state`, and, with leader election, `view`: whose ledger this
//! is. Nodes are sorted by name, pods by namespace/name.

use serde::Serialize;

use super::cache::{NodeView, PodView};
use crate::core::PodState;

/// The whole answer.
#[derive(Debug, Clone, Serialize)]
pub struct Inspect {
    /// Nodes.
    pub nodes: Vec<InspectNode>,
    /// Whose ledger this is (with leader election only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub view: Option<View>,
}

/// Whose ledger an answer shows.
#[derive(Debug, Clone, Serialize)]
pub struct View {
    /// The replica's identity.
    pub replica: String,
    /// Whether it leads (its ledger is the one binds use).
    pub leader: bool,
    /// Why a standby shows its own view rather than the leader's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One node.
#[derive(Debug, Clone, Serialize)]
pub struct InspectNode {
    /// Node name.
    pub name: String,
    /// Sum of the GPUs' memory (units).
    #[serde(rename = "totalGPU")]
    pub total_gpu: u64,
    /// Memory held on the GPUs (units).
    #[serde(rename = "usedGPU")]
    pub used_gpu: u64,
    /// The device plugin's unit, when it declared one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// The node's first `InternalIP`, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// GPUs.
    pub devs: Vec<InspectDev>,
    /// Pods recorded on the node whose GPU index it does not have.
    pub pending: Vec<InspectPod>,
}

/// One GPU.
#[derive(Debug, Clone, Serialize)]
pub struct InspectDev {
    /// GPU index.
    pub id: u32,
    /// GPU memory.
    #[serde(rename = "totalGPU")]
    pub total_gpu: u64,
    /// Memory held.
    #[serde(rename = "usedGPU")]
    pub used_gpu: u64,
    /// Whether it may receive pods.
    pub healthy: bool,
    /// Pods on it.
    pub pods: Vec<InspectPod>,
}

/// One pod.
#[derive(Debug, Clone, Serialize)]
pub struct InspectPod {
    /// Pod name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Memory held.
    #[serde(rename = "usedGPU")]
    pub used_gpu: u64,
    /// UID.
    pub uid: String,
    /// assumed | assigned.
    pub state: PodState,
}

fn pod(p: &PodView) -> InspectPod {
    InspectPod {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        used_gpu: int64(p.mem.units()),
        uid: p.uid.clone(),
        state: p.state,
    }
}

/// A count as the JSON answer carries it: never above int64 (what Go and kubectl decode).
fn int64(units: u64) -> u64 {
    units.min(i64::MAX as u64)
}

/// One node's entry.
pub fn node(v: &NodeView) -> InspectNode {
    InspectNode {
        name: v.name.clone(),
        total_gpu: int64(v.total().units()),
        used_gpu: int64(v.used().units()),
        unit: v.unit.map(|u| u.to_string()),
        address: v.address.clone(),
        devs: v
            .gpus
            .iter()
            .map(|g| InspectDev {
                id: g.index,
                total_gpu: int64(g.total.units()),
                used_gpu: int64(g.used.units()),
                healthy: g.healthy,
                pods: g.pods.iter().map(pod).collect(),
            })
            .collect(),
        pending: v.pending.iter().map(pod).collect(),
    }
}

/// The answer for `views`.
pub fn inspect(views: &[NodeView]) -> Inspect {
    Inspect {
        nodes: views.iter().map(node).collect(),
        view: None,
    }
}
