//! The one home of the Kubernetes objects the tests seed and send: a GPU node, a pending pod
//! asking for GPU memory, a pod the extender has bound and the device plugin has assigned
//! (what a ledger rebuilds from), and a pod the extender has bound that waits for Allocate
//! (what the device plugin matches). Plain JSON, as the sandbox API server and the extender's
//! HTTP verbs take it; and the UID the API server gave a stored pod.

use std::fmt::Display;

use gpushare::core::wire::{
    ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, ANN_POD_MEM, RESOURCE_GPU_COUNT,
    RESOURCE_GPU_MEM,
};
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::{Value, json};

/// A node offering `gpus` GPUs of `units` each (the upstream even split), and 8 CPUs.
pub(crate) fn gpu_node(name: &str, gpus: u64, units: u64) -> Value {
    let res = json!({RESOURCE_GPU_MEM: (gpus * units).to_string(),
                     RESOURCE_GPU_COUNT: gpus.to_string(), "cpu": "8"});
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
           "status": {"capacity": res, "allocatable": res}})
}

/// A pending pod in `default` whose one container `main` asks for `mem` of GPU memory
/// (anything that displays: the hostile-input tests send quantities that are not numbers).
pub(crate) fn pending_pod(name: &str, mem: impl Display) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default"},
           "spec": {"containers": [{"name": "main", "image": "cuda",
               "resources": {"limits": {RESOURCE_GPU_MEM: mem.to_string()}}}]},
           "status": {"phase": "Pending"}})
}

/// A running pod bound to `node`, holding `mem` units of GPU `gpu` of `units` (annotations as
/// the extender's bind writes them, assigned by the device plugin).
pub(crate) fn bound_pod(name: &str, node: &str, gpu: u32, mem: u64, units: u64) -> Value {
    let mut pod = pending_pod(name, mem);
    pod["spec"]["nodeName"] = json!(node);
    pod["status"]["phase"] = json!("Running");
    pod["metadata"]["annotations"] = json!({
        ANN_GPU_INDEX: gpu.to_string(), ANN_POD_MEM: mem.to_string(),
        ANN_DEVICE_MEM: units.to_string(), ANN_ASSIGNED: "true",
        ANN_ASSUME_TIME: "1700000000000000000",
    });
    pod
}

/// A pending pod on `node` in `default` with these GPU init and app containers (name,
/// units); with `idx`, the annotations the extender's bind writes before Allocate (GPU `idx`
/// of 16 units, ASSIGNED=false, ASSUME_TIME `assume_time`).
pub(crate) fn assumed_pod(
    name: &str,
    node: &str,
    init: &[(&str, u64)],
    containers: &[(&str, u64)],
    idx: Option<u32>,
    assume_time: u64,
) -> Value {
    let c = |list: &[(&str, u64)]| -> Vec<Value> {
        list.iter()
            .map(|(n, m)| {
                json!({"name": n, "image": "cuda",
                       "resources": {"limits": {RESOURCE_GPU_MEM: m.to_string()}}})
            })
            .collect()
    };
    let total = init
        .iter()
        .map(|x| x.1)
        .max()
        .unwrap_or(0)
        .max(containers.iter().map(|x| x.1).sum());
    let mut annotations = serde_json::Map::new();
    if let Some(idx) = idx {
        annotations.insert(ANN_GPU_INDEX.into(), idx.to_string().into());
        annotations.insert(ANN_POD_MEM.into(), total.to_string().into());
        annotations.insert(ANN_DEVICE_MEM.into(), "16".into());
        annotations.insert(ANN_ASSIGNED.into(), "false".into());
        annotations.insert(ANN_ASSUME_TIME.into(), assume_time.to_string().into());
    }
    let mut spec = json!({"nodeName": node, "containers": c(containers)});
    if !init.is_empty() {
        spec["initContainers"] = Value::Array(c(init));
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": annotations},
        "spec": spec,
        "status": {"phase": "Pending"},
    })
}

/// Pod `default/<name>` with a claim `gpu` made from ResourceClaimTemplate `template`, each of
/// its containers `(container, request)` using that request of the claim.
pub fn claim_pod(name: &str, template: &str, containers: &[(&str, &str)]) -> Value {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(container, request)| {
            json!({ "name": container, "image": "x",
                "resources": { "claims": [{ "name": "gpu", "request": request }] } })
        })
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "containers": containers,
            "resourceClaims": [{ "name": "gpu", "resourceClaimTemplateName": template }],
        },
    })
}

/// The UID of pod `default/<name>` as the API server stored it.
pub fn pod_uid(api: &ApiServer, name: &str) -> String {
    api.get_object("pods", Some("default"), name).expect("pod")["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_string()
}
