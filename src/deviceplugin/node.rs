//! What the device plugin writes about its node: `aliyun.com/gpu-count` in the status
//! (upstream contract), the per-GPU memory and health in `gpushare.io/devices` plus the unit in
//! `gpushare.io/memory-unit` (ours, read by the extender and inspect), and Warning Events.
//!
//! Writes are retried on transient errors; Events are best effort (a failure is logged).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::PostParams;

use super::devices::ServedGpu;
use crate::core::MemoryUnit;
use crate::core::wire::{
    DEVICE_PLUGIN_COMPONENT, LABEL_CGPU_DISABLE, NODE_ANN_DEVICES, NODE_ANN_EXCLUDED_GPUS,
    NODE_ANN_MEMORY_UNIT,
};
use crate::gpu::ExcludedGpu;
use crate::k8s::project::PublishedGpu;
use crate::k8s::write::{is_transient, patch_node_annotations, patch_node_gpu_count};

/// Namespace of the node Events (as kubelet does for node events).
pub const EVENT_NAMESPACE: &str = "default";

/// Nanoseconds since the Unix epoch.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Runs `op` up to `attempts` times while it fails with a transient error.
pub async fn retry_transient<T, F, Fut>(attempts: u32, mut op: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut delay = Duration::from_millis(50);
    let mut tried = 0;
    loop {
        tried += 1;
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if tried < attempts && is_transient(&e) => {
                tracing::debug!(error = %e, tried, "transient API error, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(e),
        }
    }
}

/// What the plugin read from its Node at start.
#[derive(Clone, Debug, Default)]
pub struct NodeFacts {
    /// `metadata.uid`.
    pub uid: String,
    /// Label `cgpu.disable.isolation=true`.
    pub cgpu_disable: bool,
}

/// Reads the node (it must exist).
pub async fn read_node(client: &kube::Client, node: &str) -> anyhow::Result<NodeFacts> {
    let api: Api<Node> = Api::all(client.clone());
    let n = retry_transient(4, || api.get(node))
        .await
        .map_err(|e| anyhow::anyhow!("cannot read node {node:?} (is --node-name right?): {e}"))?;
    let cgpu_disable = n
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_CGPU_DISABLE))
        .is_some_and(|v| v == "true");
    Ok(NodeFacts {
        uid: n.metadata.uid.unwrap_or_default(),
        cgpu_disable,
    })
}

/// Patches `aliyun.com/gpu-count` into the node status.
pub async fn publish_gpu_count(
    client: &kube::Client,
    node: &str,
    count: usize,
) -> anyhow::Result<()> {
    retry_transient(4, || patch_node_gpu_count(client, node, count))
        .await
        .map_err(|e| anyhow::anyhow!("cannot patch aliyun.com/gpu-count on node {node}: {e}"))?;
    Ok(())
}

/// The `gpushare.io/devices` and `gpushare.io/memory-unit` annotations.
pub fn device_annotations(
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
pub fn excluded_annotation(excluded: &[ExcludedGpu]) -> BTreeMap<String, String> {
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
pub async fn publish_devices(
    client: &kube::Client,
    node: &str,
    annotations: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    retry_transient(4, || patch_node_annotations(client, node, annotations))
        .await
        .map_err(|e| anyhow::anyhow!("cannot patch the device annotations of node {node}: {e}"))?;
    Ok(())
}

/// Records a Warning Event on the node; failures are logged, never returned.
pub async fn warn_event(
    client: &kube::Client,
    node: &str,
    node_uid: &str,
    reason: &str,
    message: &str,
) {
    let api: Api<Event> = Api::namespaced(client.clone(), EVENT_NAMESPACE);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let message: String = message.chars().take(1024).collect();
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{node}.{:x}", now_ns())),
            namespace: Some(EVENT_NAMESPACE.to_string()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            kind: Some("Node".to_string()),
            api_version: Some("v1".to_string()),
            name: Some(node.to_string()),
            uid: (!node_uid.is_empty()).then(|| node_uid.to_string()),
            ..ObjectReference::default()
        },
        reason: Some(reason.to_string()),
        message: Some(message),
        type_: Some("Warning".to_string()),
        count: Some(1),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        source: Some(EventSource {
            component: Some(DEVICE_PLUGIN_COMPONENT.to_string()),
            host: Some(node.to_string()),
        }),
        reporting_component: Some(DEVICE_PLUGIN_COMPONENT.to_string()),
        reporting_instance: Some(node.to_string()),
        ..Event::default()
    };
    if let Err(e) = api.create(&PostParams::default(), &event).await {
        tracing::warn!(error = %e, reason, "could not record a node Event");
    }
}
