//! The filter verb: which candidate nodes have ONE healthy GPU with room for the pod.
//!
//! Pure in-memory work on the ledger (read locks only, no API call). A pod that holds a
//! reservation of its own (an earlier bind's, found on it after a failover) passes the
//! reserved node only: its memory is counted there already. Rejection reasons keep
//! upstream wording; a node whose largest healthy GPU is smaller than the request goes to
//! `FailedAndUnresolvableNodes`, since preemption cannot help there.

use std::collections::BTreeMap;

use super::cache::Fit;
use super::state::ExtenderState;
use super::verb_error::PodRequestError;
use super::wire::{Candidates, ExtenderArgs, FilterResult, NodeList};
use crate::core::{GpuMem, NoFit};

/// The rejection reason for nodes that offer no shared GPUs (upstream wording).
pub(crate) fn not_for_gpu_share(node: &str) -> String {
    format!("The node {node} is not for GPU share, need skip")
}

/// The rejection reason for nodes other than the one a pod's own reservation holds.
pub(crate) fn reserved_elsewhere(node: &str, gpu: u32) -> String {
    format!(
        "The pod holds a reservation on node {node} GPU {gpu} from an earlier bind; it binds there"
    )
}

/// The pod's request, or why it cannot be read (a 400 answer).
pub(crate) fn pod_request(
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Result<GpuMem, PodRequestError> {
    Ok(crate::k8s::pod_gpu_request(pod)?.total())
}

/// Runs filter; `Err` is a bad request.
pub fn filter(state: &ExtenderState, args: ExtenderArgs) -> Result<FilterResult, PodRequestError> {
    let request = pod_request(&args.pod)?;
    let metrics = state.metrics();
    let mut passing = Vec::new();
    let mut failed = BTreeMap::new();
    let mut unresolvable = BTreeMap::new();
    let names = args.candidates.names();
    let fits = state.cache().map_slots(names.iter().copied(), |slot| {
        slot.map_or(Fit::NotForGpuShare, |s| s.fit(request))
    });
    // The pod's own reservation is its own: its memory is counted on the reserved node
    // already, so that node passes, and no other can take the pod while it holds.
    let own = args
        .pod
        .metadata
        .uid
        .as_deref()
        .and_then(|uid| state.cache().own_reservation(uid));
    for (i, (name, fit)) in names.iter().zip(fits).enumerate() {
        if request.is_zero() {
            // kube-scheduler only sends gpu-mem pods; be lenient with the others.
            passing.push(i);
            continue;
        }
        if let Some((node, gpu)) = &own {
            if *name == node.as_str() {
                passing.push(i);
            } else {
                failed.insert(name.to_string(), reserved_elsewhere(node, *gpu));
                metrics
                    .rejections
                    .get_or_create(&super::metrics::ReasonLabels {
                        reason: "reserved_elsewhere",
                    })
                    .inc();
            }
            continue;
        }
        let reason_label = match fit {
            Fit::Fits => {
                passing.push(i);
                continue;
            }
            Fit::NotForGpuShare => {
                failed.insert(name.to_string(), not_for_gpu_share(name));
                "not_for_gpu_share"
            }
            Fit::NoFit(no) if no.is_resolvable() => {
                failed.insert(name.to_string(), no.reason(request));
                "insufficient_in_one_device"
            }
            Fit::NoFit(no @ NoFit::LargerThanAnyGpu { .. }) => {
                unresolvable.insert(name.to_string(), no.reason(request));
                "larger_than_any_gpu"
            }
            Fit::NoFit(no) => {
                failed.insert(name.to_string(), no.reason(request));
                "other"
            }
        };
        metrics
            .rejections
            .get_or_create(&super::metrics::ReasonLabels {
                reason: reason_label,
            })
            .inc();
    }
    let mut result = FilterResult {
        failed_nodes: failed,
        failed_and_unresolvable: (!unresolvable.is_empty()).then_some(unresolvable),
        ..FilterResult::default()
    };
    match args.candidates {
        Candidates::Names(names) => {
            result.node_names = Some(passing.iter().filter_map(|&i| names.get(i)).collect());
        }
        Candidates::Nodes(nodes) => {
            let mut nodes: Vec<Option<serde_json::Value>> =
                nodes.into_iter().map(|(_, v)| Some(v)).collect();
            result.nodes = Some(NodeList {
                metadata: serde_json::Map::new(),
                items: passing
                    .iter()
                    .filter_map(|&i| nodes.get_mut(i).and_then(Option::take))
                    .collect(),
            });
        }
    }
    Ok(result)
}
