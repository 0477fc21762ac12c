//! The per-node GPU ledger: for each GPU its total and used memory and health, and the pods
//! that hold memory on it.
//!
//! Pods are keyed by UID; every operation is idempotent (applying the same pod twice counts it
//! once, removing an unknown pod is a no-op) so a watch that replays events cannot
//! double-count. Used memory is kept per GPU as pods come and go; free memory is computed with
//! saturating arithmetic, so a GPU whose pods exceed its size (a unit change, a capacity
//! shrink) reads as full, never as empty (upstream wrapped around, spec §4.3).
//!
//! A pod whose GPU index is beyond the node's GPU list (the node shrank) is kept as an
//! *orphan*: it is not counted on any GPU, but it is remembered so that it is counted again
//! if the GPU comes back, and `inspect` can show it.

use std::collections::HashMap;

use serde::Serialize;

use super::memory::GpuMem;

/// How a GPU of a node is described by whoever publishes it (device plugin or node capacity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GpuSpec {
    /// Total memory of the GPU in units.
    pub total: GpuMem,
    /// Whether the GPU may receive new pods.
    pub healthy: bool,
}

/// Where a pod is in its lifecycle, as far as the ledger cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PodState {
    /// Bound by the extender (`ASSIGNED=false`); the device plugin has not served it yet.
    Assumed,
    /// Served by the device plugin (`ASSIGNED=true`), running or about to.
    Assigned,
}

/// One pod's hold on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LedgerPod {
    /// GPU index on the node.
    pub gpu: u32,
    /// Memory held.
    pub mem: GpuMem,
    /// Lifecycle state.
    pub state: PodState,
}

/// One GPU's row of the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GpuSlot {
    /// Total memory.
    pub total: GpuMem,
    /// Memory held by pods (may exceed `total` after a shrink; never wraps).
    pub used: GpuMem,
    /// Whether the GPU may receive new pods.
    pub healthy: bool,
}

impl GpuSlot {
    /// Memory still free, saturating at zero.
    pub fn free(&self) -> GpuMem {
        self.total.saturating_sub(self.used)
    }
}

/// The ledger of one node. `K` is the pod key (a UID string in production).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeLedger<K: Eq + std::hash::Hash = String> {
    gpus: Vec<GpuSlot>,
    pods: HashMap<K, LedgerPod>,
}

impl<K: Eq + std::hash::Hash + Clone> NodeLedger<K> {
    /// A ledger for GPUs described by `specs`, holding no pods.
    pub fn new(specs: &[GpuSpec]) -> Self {
        let mut ledger = NodeLedger {
            gpus: Vec::new(),
            pods: HashMap::new(),
        };
        ledger.set_gpus(specs);
        ledger
    }

    /// Replaces the GPU list (count, sizes, health) and recounts every pod against it.
    pub fn set_gpus(&mut self, specs: &[GpuSpec]) {
        self.gpus = specs
            .iter()
            .map(|s| GpuSlot {
                total: s.total,
                used: GpuMem::ZERO,
                healthy: s.healthy,
            })
            .collect();
        for pod in self.pods.values() {
            if let Some(slot) = self.gpus.get_mut(pod.gpu as usize) {
                slot.used = slot.used.saturating_add(pod.mem);
            }
        }
    }

    /// Marks one GPU healthy or not; unknown indices are ignored.
    pub fn set_health(&mut self, gpu: u32, healthy: bool) {
        if let Some(slot) = self.gpus.get_mut(gpu as usize) {
            slot.healthy = healthy;
        }
    }

    /// Adds the pod, or replaces what was recorded for it. Returns the previous record.
    pub fn apply_pod(&mut self, key: K, pod: LedgerPod) -> Option<LedgerPod> {
        let previous = self.pods.insert(key, pod);
        if let Some(old) = previous {
            self.uncount(old);
        }
        self.count(pod);
        previous
    }

    /// Removes the pod; returns what was recorded, `None` if it was unknown.
    pub fn remove_pod<Q>(&mut self, key: &Q) -> Option<LedgerPod>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ?Sized,
    {
        let old = self.pods.remove(key)?;
        self.uncount(old);
        Some(old)
    }

    /// The record of one pod.
    pub fn pod<Q>(&self, key: &Q) -> Option<&LedgerPod>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ?Sized,
    {
        self.pods.get(key)
    }

    /// Every pod and its record (no particular order).
    pub fn pods(&self) -> impl Iterator<Item = (&K, &LedgerPod)> {
        self.pods.iter()
    }

    /// Number of pods recorded (orphans included).
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// The GPUs, by index.
    pub fn gpus(&self) -> &[GpuSlot] {
        &self.gpus
    }

    /// Pods whose GPU index is beyond the GPU list.
    pub fn orphans(&self) -> impl Iterator<Item = (&K, &LedgerPod)> {
        let n = self.gpus.len();
        self.pods.iter().filter(move |(_, p)| p.gpu as usize >= n)
    }

    /// Sum of GPU sizes.
    pub fn total(&self) -> GpuMem {
        self.gpus.iter().map(|g| g.total).sum()
    }

    /// Sum of memory held on existing GPUs.
    pub fn used(&self) -> GpuMem {
        self.gpus.iter().map(|g| g.used).sum()
    }

    fn count(&mut self, pod: LedgerPod) {
        if let Some(slot) = self.gpus.get_mut(pod.gpu as usize) {
            slot.used = slot.used.saturating_add(pod.mem);
        }
    }

    fn uncount(&mut self, pod: LedgerPod) {
        if let Some(slot) = self.gpus.get_mut(pod.gpu as usize) {
            slot.used = slot.used.saturating_sub(pod.mem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(totals: &[u64]) -> Vec<GpuSpec> {
        totals
            .iter()
            .map(|t| GpuSpec {
                total: GpuMem::new(*t),
                healthy: true,
            })
            .collect()
    }

    fn pod(gpu: u32, mem: u64) -> LedgerPod {
        LedgerPod {
            gpu,
            mem: GpuMem::new(mem),
            state: PodState::Assumed,
        }
    }

    #[test]
    fn apply_and_remove_are_idempotent() {
        let mut l: NodeLedger = NodeLedger::new(&gpus(&[16, 16]));
        l.apply_pod("a".into(), pod(0, 4));
        l.apply_pod("a".into(), pod(0, 4));
        assert_eq!(l.gpus()[0].used, GpuMem::new(4));
        l.apply_pod("a".into(), pod(1, 6));
        assert_eq!(l.gpus()[0].used, GpuMem::ZERO);
        assert_eq!(l.gpus()[1].used, GpuMem::new(6));
        assert!(l.remove_pod("a").is_some());
        assert!(l.remove_pod("a").is_none());
        assert_eq!(l.used(), GpuMem::ZERO);
    }

    #[test]
    fn overuse_reads_as_full_not_empty() {
        let mut l: NodeLedger = NodeLedger::new(&gpus(&[16]));
        l.apply_pod("a".into(), pod(0, 12));
        l.set_gpus(&gpus(&[8])); // capacity shrank (unit change)
        assert_eq!(l.gpus()[0].used, GpuMem::new(12));
        assert_eq!(l.gpus()[0].free(), GpuMem::ZERO);
    }

    #[test]
    fn pods_on_vanished_gpus_are_orphans_until_the_gpu_returns() {
        let mut l: NodeLedger = NodeLedger::new(&gpus(&[16, 16]));
        l.apply_pod("a".into(), pod(1, 5));
        l.set_gpus(&gpus(&[16]));
        assert_eq!(l.orphans().count(), 1);
        assert_eq!(l.used(), GpuMem::ZERO);
        l.set_gpus(&gpus(&[16, 16]));
        assert_eq!(l.orphans().count(), 0);
        assert_eq!(l.gpus()[1].used, GpuMem::new(5));
        l.remove_pod("a");
        assert_eq!(l.used(), GpuMem::ZERO);
    }
}
