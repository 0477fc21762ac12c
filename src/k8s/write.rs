//! The writes gpushare makes to the API server: merge patches of pod annotations, Bindings
//! with a UID precondition, the node-status gpu-count patch, node annotations, and Events.
//!
//! Every write is a PATCH or a create, never a full-object UPDATE (upstream's UPDATE dropped
//! unknown fields with older clients, EXT#122).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::core::wire::RESOURCE_GPU_COUNT;

/// Merge-patches `annotations` onto the pod.
pub async fn patch_pod_annotations(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<Pod, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let patch = json!({ "metadata": { "annotations": annotations } });
    pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

/// Merge-patches annotation changes onto the pod: `Some` sets a value, `None` removes the key.
/// With `resource_version` the patch applies only to that version of the pod (409 Conflict
/// otherwise), so a slow patch cannot land over a newer write.
pub(crate) async fn patch_pod_annotation_changes(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    changes: &BTreeMap<String, Option<String>>,
    resource_version: Option<&str>,
) -> Result<Pod, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut patch = json!({ "metadata": { "annotations": changes } });
    if let Some(rv) = resource_version {
        patch["metadata"]["resourceVersion"] = json!(rv);
    }
    pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

/// Creates the Binding of pod `name` (with `uid` as precondition) to `node`.
pub async fn bind_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    uid: &str,
    node: &str,
) -> Result<(), kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            uid: Some(uid.to_string()),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            kind: Some("Node".to_string()),
            api_version: Some("v1".to_string()),
            name: Some(node.to_string()),
            ..ObjectReference::default()
        },
    };
    let _: serde_json::Value = pods
        .create_subresource("binding", name, &PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// Sets `aliyun.com/gpu-count` in the node's status capacity and allocatable.
pub async fn patch_node_gpu_count(
    client: &kube::Client,
    node: &str,
    count: usize,
) -> Result<Node, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let patch = json!({ "status": {
        "capacity": { RESOURCE_GPU_COUNT: count.to_string() },
        "allocatable": { RESOURCE_GPU_COUNT: count.to_string() },
    }});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

/// Merge-patches `annotations` onto the node.
pub(crate) async fn patch_node_annotations(
    client: &kube::Client,
    node: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<Node, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let patch = json!({ "metadata": { "annotations": annotations } });
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

/// Whether a failed write was refused for certain: only an answer in which the API server
/// says so (4xx: 400, 403, 404, 409, 422, 429, ...) proves that nothing was applied. Every
/// other failure — a 5xx (a 500 `etcdserver: request timed out` may still be committed), a
/// timeout, a reset or dropped connection — is an UNKNOWN outcome, to be settled by reading
/// the object, never taken as "not applied".
pub fn refused_for_certain(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if (400..500).contains(&s.code))
}

/// Nanoseconds since the Unix epoch, as the `ALIYUN_COM_GPU_MEM_ASSUME_TIME` annotation and
/// unique object names want them.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
