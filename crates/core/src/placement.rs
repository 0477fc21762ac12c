//! Placement: which GPU of a node a pod gets, whether a node can take a pod at all, and how
//! much the prioritize verb likes a node.
//!
//! `binpack` reproduces the upstream rule exactly (spec §3.2.3): among healthy GPUs with
//! enough free memory, the one with the least free; ties go to the lowest index. `spread`
//! picks the most free. Node scores are 0–10 (the extender API's range): binpack prefers
//! fuller nodes so whole GPUs stay free for big jobs, spread prefers emptier ones.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::ledger::{GpuSlot, NodeLedger};
use super::memory::GpuMem;

/// How to choose a GPU within a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuPolicy {
    /// Fullest GPU that fits (upstream).
    #[default]
    Binpack,
    /// Emptiest GPU.
    Spread,
}

/// How to score nodes in prioritize.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodePolicy {
    /// Fuller nodes first.
    #[default]
    Binpack,
    /// Emptier nodes first.
    Spread,
}

macro_rules! policy_text {
    ($t:ty) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self {
                    Self::Binpack => "binpack",
                    Self::Spread => "spread",
                })
            }
        }
        impl FromStr for $t {
            type Err = UnknownPolicy;
            fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
                match s {
                    "binpack" => Ok(Self::Binpack),
                    "spread" => Ok(Self::Spread),
                    other => Err(UnknownPolicy(other.to_string())),
                }
            }
        }
    };
}

/// A placement policy that is neither binpack nor spread.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid policy {0:?}: expected binpack or spread")]
pub struct UnknownPolicy(String);
policy_text!(GpuPolicy);
policy_text!(NodePolicy);

/// Why a pod does not fit on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoFit {
    /// The pod requests no GPU memory.
    ZeroRequest,
    /// Some healthy GPU is large enough but none has that much free now (preemption may help).
    InsufficientInOneDevice,
    /// No healthy GPU on the node is that large at all (preemption cannot help).
    LargerThanAnyGpu {
        /// The largest healthy GPU.
        largest: GpuMem,
    },
}

impl NoFit {
    /// Upstream's rejection wording, kept for the resolvable case (kube-scheduler aggregates
    /// it into pod events that users and scripts grep for).
    pub const INSUFFICIENT: &'static str = "Insufficient GPU Memory in one device";

    /// Whether evicting pods could make the pod fit.
    pub fn is_resolvable(&self) -> bool {
        matches!(self, NoFit::InsufficientInOneDevice)
    }

    /// The reason shown to kube-scheduler.
    pub fn reason(&self, request: GpuMem) -> String {
        match self {
            NoFit::ZeroRequest => "The pod requests no aliyun.com/gpu-mem".to_string(),
            NoFit::InsufficientInOneDevice => NoFit::INSUFFICIENT.to_string(),
            NoFit::LargerThanAnyGpu { largest } => format!(
                "{}: the request of {request} exceeds the largest healthy GPU ({largest})",
                NoFit::INSUFFICIENT
            ),
        }
    }
}

/// Whether some healthy GPU has `request` free. Stops at the first that has (filter's hot
/// path); only a miss walks every GPU, through [`choose_gpu`], for the reason.
pub fn check_fit<K: Eq + std::hash::Hash + Clone>(
    ledger: &NodeLedger<K>,
    request: GpuMem,
) -> Result<(), NoFit> {
    if !request.is_zero()
        && ledger
            .gpus()
            .iter()
            .any(|g| g.healthy && g.free() >= request)
    {
        return Ok(());
    }
    choose_gpu(ledger, request, GpuPolicy::Binpack).map(|_| ())
}

/// The GPU to place `request` on under `policy`.
pub fn choose_gpu<K: Eq + std::hash::Hash + Clone>(
    ledger: &NodeLedger<K>,
    request: GpuMem,
    policy: GpuPolicy,
) -> Result<u32, NoFit> {
    choose_gpu_in(ledger.gpus(), request, policy)
}

/// [`choose_gpu`] over a plain GPU list.
pub fn choose_gpu_in(gpus: &[GpuSlot], request: GpuMem, policy: GpuPolicy) -> Result<u32, NoFit> {
    if request.is_zero() {
        return Err(NoFit::ZeroRequest);
    }
    let mut best: Option<(usize, GpuMem)> = None;
    for (i, gpu) in gpus.iter().enumerate() {
        if !gpu.healthy {
            continue;
        }
        let free = gpu.free();
        if free < request {
            continue;
        }
        let better = match (best, policy) {
            (None, _) => true,
            (Some((_, b)), GpuPolicy::Binpack) => free < b,
            (Some((_, b)), GpuPolicy::Spread) => free > b,
        };
        if better {
            best = Some((i, free));
        }
    }
    match best {
        Some((i, _)) => Ok(i as u32),
        None => {
            let largest = gpus
                .iter()
                .filter(|g| g.healthy)
                .map(|g| g.total)
                .max()
                .unwrap_or_default();
            if largest >= request {
                Err(NoFit::InsufficientInOneDevice)
            } else {
                Err(NoFit::LargerThanAnyGpu { largest })
            }
        }
    }
}

/// The prioritize score (0–10) of placing `request` on this node; 0 when it does not fit.
///
/// Binpack scores the node's healthy-memory utilisation after placement (fuller is better);
/// spread scores what would remain free.
pub fn node_score<K: Eq + std::hash::Hash + Clone>(
    ledger: &NodeLedger<K>,
    request: GpuMem,
    policy: NodePolicy,
) -> u8 {
    if check_fit(ledger, request).is_err() {
        return 0;
    }
    let (total, used) =
        ledger
            .gpus()
            .iter()
            .filter(|g| g.healthy)
            .fold((0u128, 0u128), |(t, u), g| {
                (
                    t + g.total.units() as u128,
                    u + g.used.min(g.total).units() as u128,
                )
            });
    if total == 0 {
        return 0;
    }
    let after = (used + request.units() as u128).min(total);
    let fullness = (after * 10 + total / 2) / total; // rounded 0..=10
    let fullness = fullness.min(10) as u8;
    match policy {
        NodePolicy::Binpack => fullness,
        NodePolicy::Spread => 10 - fullness,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{GpuSpec, LedgerPod, PodState};

    fn ledger(totals: &[u64], used: &[u64]) -> NodeLedger {
        let specs: Vec<_> = totals
            .iter()
            .map(|t| GpuSpec {
                total: GpuMem::new(*t),
                healthy: true,
            })
            .collect();
        let mut l = NodeLedger::new(&specs);
        for (i, u) in used.iter().enumerate() {
            if *u > 0 {
                l.apply_pod(
                    format!("pod-{i}"),
                    LedgerPod {
                        gpu: i as u32,
                        mem: GpuMem::new(*u),
                        state: PodState::Assigned,
                    },
                );
            }
        }
        l
    }

    /// Spec §8 A1: three 8138 MiB pods on 2 × 16276 MiB binpack as GPU0, GPU0, GPU1.
    #[test]
    fn demo_a1_binpack_fills_gpu0_first() {
        let mut l = ledger(&[16276, 16276], &[]);
        let mut placed = Vec::new();
        for n in 0..3 {
            let gpu = choose_gpu(&l, GpuMem::new(8138), GpuPolicy::Binpack).unwrap();
            l.apply_pod(
                format!("binpack-{n}"),
                LedgerPod {
                    gpu,
                    mem: GpuMem::new(8138),
                    state: PodState::Assumed,
                },
            );
            placed.push(gpu);
        }
        assert_eq!(placed, [0, 0, 1]);
        assert_eq!(l.gpus()[0].used, GpuMem::new(16276));
        assert_eq!(l.gpus()[1].used, GpuMem::new(8138));
    }

    /// Spec §8 A2: 16276 free on the node, 8138 per GPU: a 16276 request does not fit one GPU.
    #[test]
    fn demo_a2_node_fits_but_no_single_gpu() {
        let l = ledger(&[16276, 16276], &[8138, 8138]);
        let err = check_fit(&l, GpuMem::new(16276)).unwrap_err();
        assert_eq!(err, NoFit::InsufficientInOneDevice);
        assert!(err.is_resolvable());
        assert_eq!(
            err.reason(GpuMem::new(16276)),
            "Insufficient GPU Memory in one device"
        );
    }

    /// Spec §8 A3: filter over N2 (4069 free per GPU) and N3 (8138 free on GPU0).
    #[test]
    fn demo_a3_filter() {
        let n2 = ledger(&[16276, 16276], &[12207, 12207]);
        let n3 = ledger(&[16276, 16276], &[8138, 16276]);
        assert_eq!(
            check_fit(&n2, GpuMem::new(8138)),
            Err(NoFit::InsufficientInOneDevice)
        );
        assert_eq!(check_fit(&n3, GpuMem::new(8138)), Ok(()));
    }

    /// Spec §8 A4: free {0:12207, 1:8138, 2:4069, 3:16276}, request 8138 ⇒ GPU 1.
    #[test]
    fn demo_a4_bind_best_fit() {
        let l = ledger(&[16276; 4], &[4069, 8138, 12207, 0]);
        assert_eq!(choose_gpu(&l, GpuMem::new(8138), GpuPolicy::Binpack), Ok(1));
        assert_eq!(choose_gpu(&l, GpuMem::new(8138), GpuPolicy::Spread), Ok(3));
    }

    #[test]
    fn ties_go_to_the_lowest_index_and_unhealthy_gpus_are_skipped() {
        let mut l = ledger(&[16, 16, 16], &[]);
        assert_eq!(choose_gpu(&l, GpuMem::new(4), GpuPolicy::Binpack), Ok(0));
        assert_eq!(choose_gpu(&l, GpuMem::new(4), GpuPolicy::Spread), Ok(0));
        l.set_health(0, false);
        assert_eq!(choose_gpu(&l, GpuMem::new(4), GpuPolicy::Binpack), Ok(1));
        l.set_health(1, false);
        l.set_health(2, false);
        assert_eq!(
            choose_gpu(&l, GpuMem::new(4), GpuPolicy::Binpack),
            Err(NoFit::LargerThanAnyGpu {
                largest: GpuMem::ZERO
            })
        );
    }

    #[test]
    fn a_request_larger_than_every_gpu_is_unresolvable() {
        let l = ledger(&[16, 24], &[]);
        let err = check_fit(&l, GpuMem::new(32)).unwrap_err();
        assert_eq!(
            err,
            NoFit::LargerThanAnyGpu {
                largest: GpuMem::new(24)
            }
        );
        assert!(!err.is_resolvable());
        assert!(err.reason(GpuMem::new(32)).starts_with(NoFit::INSUFFICIENT));
        assert_eq!(check_fit(&l, GpuMem::ZERO), Err(NoFit::ZeroRequest));
    }

    #[test]
    fn scores_prefer_full_nodes_for_binpack_and_empty_ones_for_spread() {
        let empty = ledger(&[16, 16], &[]);
        let half = ledger(&[16, 16], &[16, 0]);
        let req = GpuMem::new(4);
        assert!(
            node_score(&half, req, NodePolicy::Binpack)
                > node_score(&empty, req, NodePolicy::Binpack)
        );
        assert!(
            node_score(&half, req, NodePolicy::Spread)
                < node_score(&empty, req, NodePolicy::Spread)
        );
        let full = ledger(&[16, 16], &[16, 16]);
        assert_eq!(node_score(&full, req, NodePolicy::Binpack), 0);
        assert_eq!(node_score(&full, req, NodePolicy::Spread), 0);
        assert!(node_score(&ledger(&[16], &[12]), req, NodePolicy::Binpack) == 10);
    }
}
