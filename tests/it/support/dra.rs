//! What the DRA tests read back from the sandbox: a node's published devices, a pod's claim,
//! and the wait for a plugin's first publication; and what they seed: a DRA node with the
//! DeviceClass, a gpu-mem pod as the webhook rewrites it; one pass of the sandbox allocator
//! that must bind or release exactly one claim.

use std::time::Duration;

use gpushare::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME};
use gpushare::dra::role::DraPluginHandle;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::{DraAllocator, Pass};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{Value, json};

/// A sandbox API server seeded with the objects of `yaml` (documents separated by `---`).
pub async fn seeded_api(yaml: &str) -> ApiServer {
    let api = ApiServer::start()
        .await
        .expect("the sandbox API server starts");
    api.seed_yaml(yaml).expect("the objects seed");
    api
}

/// A sandbox API server holding node `node` on the DRA path (its label) and gpushare's
/// DeviceClass.
pub async fn dra_node_api(node: &str) -> ApiServer {
    let api = ApiServer::start().await.expect("starts");
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n  labels:\n    gpushare.io/gpu-mem-path: dra\n"
    ))
    .expect("the node");
    create_gpu_device_class(&api);
    api
}

/// gpushare's DeviceClass (`gpu-mem.gpushare.io`, selecting the default driver's GPUs), as
/// the chart installs it.
pub fn create_gpu_device_class(api: &ApiServer) {
    api.create_object(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": DRA_DEVICE_CLASS },
        "spec": { "selectors": [{ "cel": { "expression": gpushare::core::wire::dra_gpu_class_selector(DRA_DRIVER_NAME) } }] },
    }))
    .expect("the class");
}

/// A one-container (`main`) gpu-mem pod `default/<name>` of `gib` GiB, rewritten for the DRA
/// path as the webhook does: its claim template and the pod stored.
pub fn submit_gpu_pod(api: &ApiServer, name: &str, gib: u64) {
    super::dra_node::submit_containers(api, name, &[("main", gib)]);
}

/// The devices of every ResourceSlice of `node`, as JSON, in slice order.
pub fn slice_devices(api: &ApiServer, node: &str) -> Vec<Value> {
    api.list_objects("resourceslices", None)
        .into_iter()
        .filter_map(|v| serde_json::from_value::<ResourceSlice>(v).ok())
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .flat_map(|s| s.spec.devices.unwrap_or_default())
        .map(|d| serde_json::to_value(d).expect("json"))
        .collect()
}

/// The name and uid of the first claim of pod `default/<pod>` (its `resourceClaimStatuses`).
pub fn pod_claim(api: &ApiServer, pod: &str) -> (String, String) {
    let p: Pod = api.get_as("pods", Some("default"), pod).expect("the pod");
    let name = p
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|s| s[0].resource_claim_name.clone())
        .expect("the pod's claim");
    let uid = api
        .get_object("resourceclaims", Some("default"), &name)
        .expect("the claim")["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_string();
    (name, uid)
}

/// Waits (30 s at most) until `plugin` has published its first slice.
pub async fn published(plugin: &DraPluginHandle) {
    let mut generation = plugin.published_generation();
    tokio::time::timeout(Duration::from_secs(30), generation.wait_for(|g| *g >= 1))
        .await
        .expect("the slice is published in time")
        .expect("open");
}

/// One pass of the sandbox allocator over `api`.
async fn allocator_pass(api: &ApiServer) -> Pass {
    DraAllocator::new(api.admin_client())
        .reconcile()
        .await
        .expect("a pass")
}

/// One pass of the sandbox allocator over `api`, which must bind exactly one claim.
pub async fn allocate_one(api: &ApiServer) -> Pass {
    let pass = allocator_pass(api).await;
    assert_eq!(pass.bound.len(), 1, "{pass:?}");
    pass
}

/// One pass of the sandbox allocator over `api`, which must release exactly one claim.
pub async fn release_one(api: &ApiServer) -> Pass {
    let pass = allocator_pass(api).await;
    assert_eq!(pass.released.len(), 1, "{pass:?}");
    pass
}
