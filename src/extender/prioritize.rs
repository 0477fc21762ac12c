//! The prioritize verb: a 0–10 score per candidate node under `--node-policy` (binpack:
//! fuller nodes first; spread: emptier nodes first). Nodes where the pod does not fit, or that
//! offer no shared GPUs, score 0. Pure in-memory work, like filter.

use super::filter::pod_request;
use super::state::ExtenderState;
use super::verb_error::PodRequestError;
use super::wire::{ExtenderArgs, HostPriority};

/// Runs prioritize; `Err` is a bad request.
pub fn prioritize<'a>(
    state: &ExtenderState,
    args: &'a ExtenderArgs,
) -> Result<Vec<HostPriority<'a>>, PodRequestError> {
    let request = pod_request(&args.pod)?;
    let policy = state.config().node_policy;
    let names = args.candidates.names();
    let scores = state.cache().map_slots(names.iter().copied(), |slot| {
        match (request.is_zero(), slot) {
            (false, Some(s)) => i64::from(s.score(request, policy)),
            _ => 0,
        }
    });
    Ok(names
        .iter()
        .zip(scores)
        .map(|(host, score)| HostPriority { host, score })
        .collect())
}
