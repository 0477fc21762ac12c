//! What the node agent writes about its node: `aliyun.com/gpu-count` in the status
//! (upstream contract), the per-GPU memory and health in `gpushare.io/devices` plus the unit in
//! `gpushare.io/memory-unit` (ours, read by the extender and inspect), and Warning Events.
//!
//! Every call has a request timeout; writes are retried on transient errors; Events are best
//! effort (a failure is logged).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use super::AgentError;
use super::api::bounded;
use super::gpus::ServedGpu;
use crate::core::MemoryUnit;
use crate::core::wire::{
    LABEL_CGPU_DISABLE, NODE_ANN_DEVICES, NODE_ANN_EXCLUDED_GPUS, NODE_ANN_MEMORY_UNIT,
};
use crate::gpu::ExcludedGpu;
use crate::k8s::events::{Events, Severity, node_reference};
use crate::k8s::project::PublishedGpu;
use crate::k8s::retry::retry_attempts;
use crate::k8s::write::{patch_node_annotations, patch_node_gpu_count};

/// What the node agent read from its Node at start.
#[derive(Clone, Debug, Default)]
pub(crate) struct NodeFacts {
    /// `metadata.uid`.
    pub uid: String,
    /// Label `cgpu.disable.isolation=true`.
    pub cgpu_disable: bool,
    /// The unit the node's GPU memory was last published in (`gpushare.io/memory-unit`).
    pub memory_unit: Option<String>,
}

/// Reads the node (it must exist).
pub(crate) async fn read_node(client: &kube::Client, node: &str) -> Result<NodeFacts, AgentError> {
    let api: Api<Node> = Api::all(client.clone());
    let n = retry_attempts(4, || bounded(api.get(node)))
        .await
        .map_err(|error| AgentError::ReadNode {
            node: node.to_string(),
            error,
        })?;
    let cgpu_disable = n
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_CGPU_DISABLE))
        .is_some_and(|v| v == "true");
    let memory_unit = n
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_ANN_MEMORY_UNIT))
        .cloned();
    Ok(NodeFacts {
        uid: n.metadata.uid.unwrap_or_default(),
        cgpu_disable,
        memory_unit,
    })
}

/// Patches `aliyun.com/gpu-count` into the node status.
pub(crate) async fn publish_gpu_count(
    client: &kube::Client,
    node: &str,
    count: usize,
) -> Result<(), AgentError> {
    retry_attempts(4, || bounded(patch_node_gpu_count(client, node, count)))
        .await
        .map_err(|error| AgentError::PublishGpuCount {
            node: node.to_string(),
            error,
        })?;
    Ok(())
}

/// The `gpushare.io/devices` and `gpushare.io/memory-unit` annotations.
pub(crate) fn device_annotations(
    gpus: &[ServedGpu],
    unit: MemoryUnit,
    healthy: impl Fn(&str) -> bool,
) -> BTreeMap<String, String> {
    let published: Vec<PublishedGpu> = gpus
        .iter()
        .map(|g| PublishedGpu {
            index: g.index,
            uuid: g.uuid.clone(),
            memory: g.units.units(),
            healthy: healthy(&g.uuid),
        })
        .collect();
    BTreeMap::from([
        (
            NODE_ANN_DEVICES.to_string(),
            serde_json::to_string(&published).unwrap_or_else(|_| "[]".to_string()),
        ),
        (NODE_ANN_MEMORY_UNIT.to_string(), unit.to_string()),
    ])
}

/// The `gpushare.io/excluded-gpus` annotation: the GPUs not offered (MIG mode on, incomplete
/// records) with the reason, `[]` when none (so a stale list is overwritten).
pub(crate) fn excluded_annotation(excluded: &[ExcludedGpu]) -> BTreeMap<String, String> {
    let list: Vec<serde_json::Value> = excluded
        .iter()
        .map(|g| {
            serde_json::json!({
                "index": g.index,
                "uuid": g.uuid,
                "reason": g.reason.to_string(),
            })
        })
        .collect();
    BTreeMap::from([(
        NODE_ANN_EXCLUDED_GPUS.to_string(),
        serde_json::Value::Array(list).to_string(),
    )])
}

/// Patches the device annotations onto the node.
pub(crate) async fn publish_devices(
    client: &kube::Client,
    node: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<(), AgentError> {
    retry_attempts(4, || {
        bounded(patch_node_annotations(client, node, annotations))
    })
    .await
    .map_err(|error| AgentError::PublishDevices {
        node: node.to_string(),
        error,
    })?;
    Ok(())
}

/// The node's Warning Events (events.k8s.io/v1, repeats folded into a series): the sink the
/// node agent, its MPS supervisor and the node roles raise them through.
#[derive(Clone, Debug)]
pub struct NodeEvents {
    events: Events,
    node: String,
    node_uid: String,
}

impl NodeEvents {
    /// Events about `node` (`node_uid`) published by `events`.
    pub fn new(events: Events, node: &str, node_uid: &str) -> NodeEvents {
        NodeEvents {
            events,
            node: node.to_string(),
            node_uid: node_uid.to_string(),
        }
    }

    /// Raises a Warning Event on this node (best effort: a failure is logged).
    pub async fn warn(&self, action: &str, reason: &str, message: &str) {
        self.events
            .publish(
                &node_reference(&self.node, &self.node_uid),
                Severity::Warning,
                action,
                reason,
                message,
            )
            .await;
    }

    /// [`NodeEvents::warn`] in a task of its own, so the caller never waits for the API server.
    pub fn warn_soon(&self, action: &'static str, reason: &'static str, message: String) {
        let events = self.clone();
        tokio::spawn(async move { events.warn(action, reason, &message).await });
    }
}
