//! A change of `--memory-unit` on a node (GiB to MiB or back) while pods placed under the old
//! unit still run: their requests, annotations and envs count in the old unit, so serving the
//! new one would miscount every one of them. The change is refused loudly — the unit the node
//! publishes (`gpushare.io/memory-unit`) is kept, with an error log, a Warning Event naming
//! the pods and the `gpushare_device_plugin_memory_unit_change_refused` gauge — until no such
//! pod is left; the next start then applies it.
//!
//! It does not convert pods between units (a pod's request is the number of devices kubelet
//! hands it, in whatever unit the node serves).

use k8s_openapi::api::core::v1::Pod;

use super::AgentError;
use super::api::list_node_pods;
use crate::core::MemoryUnit;
use crate::k8s::retry::retry_attempts;
use crate::k8s::{pod_annotations, pod_gpu_request, pod_is_terminal};

/// The unit to serve, and why the configured one is not when it is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnitDecision {
    /// The unit the plugin serves.
    pub unit: MemoryUnit,
    /// The refusal, for the log and the Event.
    pub refused: Option<String>,
}

/// The pods still placed on the node by the extender: bound (`ALIYUN_COM_GPU_MEM_IDX`), GPU
/// pods, not finished.
fn placed(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .filter(|p| {
            !pod_is_terminal(p)
                && pod_annotations(p).0.gpu_index.is_some()
                && pod_gpu_request(p).is_ok_and(|r| r.is_gpu_pod())
        })
        .map(|p| {
            format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or_default(),
                p.metadata.name.as_deref().unwrap_or_default()
            )
        })
        .collect()
}

/// Decides the unit for a node that last published `recorded` and is configured with
/// `configured`; lists the node's pods only when they differ.
pub(crate) async fn decide(
    client: &kube::Client,
    node: &str,
    recorded: Option<&str>,
    configured: MemoryUnit,
) -> Result<UnitDecision, AgentError> {
    let accept = UnitDecision {
        unit: configured,
        refused: None,
    };
    let Some(recorded) = recorded.and_then(|u| u.trim().parse::<MemoryUnit>().ok()) else {
        return Ok(accept);
    };
    if recorded == configured {
        return Ok(accept);
    }
    let pods = retry_attempts(4, || list_node_pods(client, node))
        .await
        .map_err(|error| AgentError::UnitCheck {
            recorded,
            configured,
            error,
        })?;
    let placed = placed(&pods);
    if placed.is_empty() {
        tracing::info!(from = %recorded, to = %configured, "memory unit changes (no GPU pod placed under the old one)");
        return Ok(accept);
    }
    const SHOWN: usize = 10;
    let mut names = placed
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if placed.len() > SHOWN {
        names.push_str(&format!(" and {} more", placed.len() - SHOWN));
    }
    Ok(UnitDecision {
        unit: recorded,
        refused: Some(format!(
            "--memory-unit {configured} refused: this node's GPU memory is published in \
             {recorded} and {} pod(s) placed under {recorded} still run ({names}); serving \
             {recorded} until they are gone (then restart the device plugin to apply \
             {configured})",
            placed.len()
        )),
    })
}
