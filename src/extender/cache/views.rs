//! Read-only views of the extender's ledger: one node with its GPUs and the pods on them
//! ([`NodeView`]), every node, the counters and the per-GPU rows for metrics. Copies taken
//! under read locks; nothing here changes the ledger.

use super::{Cache, Uid, read};
use crate::core::{GpuMem, LedgerPod, MemoryUnit, PodState};

/// Read-only view of one pod on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// GPU index.
    pub gpu: u32,
    /// Memory held.
    pub mem: GpuMem,
    /// Assumed or assigned.
    pub state: PodState,
}

/// Read-only view of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    /// Index.
    pub index: u32,
    /// Total memory.
    pub total: GpuMem,
    /// Memory held.
    pub used: GpuMem,
    /// Whether it may receive pods.
    pub healthy: bool,
    /// Pods on it, sorted by namespace/name.
    pub pods: Vec<PodView>,
}

/// Read-only view of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Name.
    pub name: String,
    /// Whether the Node object exists.
    pub exists: bool,
    /// `capacity[aliyun.com/gpu-mem]`.
    pub capacity: GpuMem,
    /// The unit the device plugin declared.
    pub unit: Option<MemoryUnit>,
    /// The node's first `InternalIP`, when it has one.
    pub address: Option<String>,
    /// GPUs by index.
    pub gpus: Vec<GpuView>,
    /// Pods whose GPU index is not on this node (the node shrank or is gone).
    pub pending: Vec<PodView>,
}

impl NodeView {
    /// Sum of GPU sizes.
    pub fn total(&self) -> GpuMem {
        self.gpus.iter().map(|g| g.total).sum()
    }
    /// Sum of memory held on the GPUs.
    pub fn used(&self) -> GpuMem {
        self.gpus.iter().map(|g| g.used).sum()
    }
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Nodes known (Node object exists).
    pub nodes: usize,
    /// Pods holding memory.
    pub pods: usize,
    /// Of which assumed (bound, not yet allocated by the device plugin).
    pub assumed: usize,
}

impl Cache {
    /// Names of the nodes whose Node object exists, sorted.
    #[cfg(test)]
    pub(crate) fn node_names(&self) -> Vec<String> {
        let mut names: Vec<String> = read(&self.nodes)
            .iter()
            .filter(|(_, s)| read(&s.entry).exists)
            .map(|(n, _)| n.to_string())
            .collect();
        names.sort();
        names
    }

    /// A view of one node (also one that only orphan pods point at).
    pub(crate) fn node_view(&self, node: &str) -> Option<NodeView> {
        let pods = read(&self.pods);
        let slot = read(&self.nodes).get(node).cloned()?;
        let e = read(&slot.entry);
        let view_of = |uid: &Uid, p: &LedgerPod| {
            let (namespace, name) = pods
                .get(uid)
                .map(|r| (r.namespace.to_string(), r.name.to_string()))
                .unwrap_or_default();
            PodView {
                uid: uid.to_string(),
                namespace,
                name,
                gpu: p.gpu,
                mem: p.mem,
                state: p.state,
            }
        };
        let mut gpus: Vec<GpuView> = e
            .ledger
            .gpus()
            .iter()
            .enumerate()
            .map(|(i, g)| GpuView {
                index: i as u32,
                total: g.total,
                used: g.used,
                healthy: g.healthy,
                pods: Vec::new(),
            })
            .collect();
        let mut pending = Vec::new();
        for (uid, p) in e.ledger.pods() {
            match gpus.get_mut(p.gpu as usize) {
                Some(g) => g.pods.push(view_of(uid, p)),
                None => pending.push(view_of(uid, p)),
            }
        }
        let order = |a: &PodView, b: &PodView| {
            (&a.namespace, &a.name, &a.uid).cmp(&(&b.namespace, &b.name, &b.uid))
        };
        for g in &mut gpus {
            g.pods.sort_by(order);
        }
        pending.sort_by(order);
        Some(NodeView {
            name: node.to_string(),
            exists: e.exists,
            capacity: e.gpus.capacity,
            unit: e.gpus.unit,
            address: e.gpus.address.clone(),
            gpus,
            pending,
        })
    }

    /// Views of every node that exists and offers shared GPUs or holds pods, sorted by name.
    pub(crate) fn views(&self) -> Vec<NodeView> {
        let mut names: Vec<String> = read(&self.nodes)
            .iter()
            .filter(|(_, s)| {
                let e = read(&s.entry);
                e.exists && (e.shares_gpus() || e.ledger.pod_count() > 0)
            })
            .map(|(n, _)| n.to_string())
            .collect();
        names.sort();
        names.iter().filter_map(|n| self.node_view(n)).collect()
    }

    /// Counters for metrics.
    pub fn stats(&self) -> CacheStats {
        let pods = read(&self.pods);
        let nodes = read(&self.nodes)
            .values()
            .filter(|s| read(&s.entry).exists)
            .count();
        CacheStats {
            nodes,
            pods: pods.len(),
            assumed: pods
                .values()
                .filter(|r| r.state == PodState::Assumed)
                .count(),
        }
    }

    /// Every (node, GPU index, total, used, the node's declared unit) for the memory gauges.
    pub(crate) fn gpu_rows(&self) -> Vec<(String, u32, GpuMem, GpuMem, Option<MemoryUnit>)> {
        let map = read(&self.nodes);
        let mut rows = Vec::new();
        for (name, slot) in map.iter() {
            let e = read(&slot.entry);
            if !e.exists {
                continue;
            }
            for (i, g) in e.ledger.gpus().iter().enumerate() {
                rows.push((name.to_string(), i as u32, g.total, g.used, e.gpus.unit));
            }
        }
        rows
    }
}
