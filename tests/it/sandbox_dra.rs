//! The sandbox's DRA surface: `resource.k8s.io/v1` served by the sandbox API server (kube-rs
//! and discovery), and the sandbox allocator (`gpushare_sandbox::dra_allocator`) turning a
//! pod's claim templates into allocated claims and a bound pod, then releasing them.

use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::{DraAllocator, POD_CLAIM_NAME_ANNOTATION};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

use crate::support::objects::claim_pod;

const SEED: &str = include_str!("../fixtures/apiserver/dra-gpu-mem.yaml");

fn gpu_pod(name: &str) -> Value {
    claim_pod(name, "gpu-mem", &[("main", "main"), ("side", "side")])
}

async fn cluster() -> ApiServer {
    crate::support::dra::seeded_api(SEED).await
}

#[tokio::test]
async fn resource_k8s_io_v1_is_discoverable_and_typed() {
    let server = cluster().await;
    let client = server.admin_client();
    let list: Value = client
        .request(
            http::Request::get("/apis/resource.k8s.io/v1")
                .body(Vec::new())
                .expect("a request"),
        )
        .await
        .expect("the group version is served");
    let names: Vec<(&str, bool)> = list["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap_or(""),
                r["namespaced"].as_bool().unwrap_or(true),
            )
        })
        .collect();
    for want in [
        ("resourceslices", false),
        ("deviceclasses", false),
        ("resourceclaims", true),
        ("resourceclaims/status", true),
        ("resourceclaimtemplates", true),
    ] {
        assert!(names.contains(&want), "{want:?} in {names:?}");
    }
    let groups: Value = client
        .request(
            http::Request::get("/apis")
                .body(Vec::new())
                .expect("a request"),
        )
        .await
        .expect("/apis");
    assert!(
        groups["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .any(|g| g["name"] == "resource.k8s.io")
    );
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("slices list");
    assert_eq!(slices.items.len(), 1);
    let device = &slices.items[0].spec.devices.as_ref().expect("devices")[0];
    assert_eq!(device.allow_multiple_allocations, Some(true));
    let classes = Api::<DeviceClass>::all(client)
        .list(&ListParams::default())
        .await
        .expect("classes list");
    assert_eq!(
        classes.items[0].metadata.name.as_deref(),
        Some("gpu-mem.gpushare.io")
    );
}

#[tokio::test]
async fn a_templated_pod_gets_its_claim_allocated_on_one_gpu_and_bound_then_released() {
    let server = cluster().await;
    server.create_object(gpu_pod("p1")).expect("the pod");
    let allocator = DraAllocator::new(server.admin_client());
    let pass = allocator.reconcile().await.expect("a pass");
    assert_eq!(pass.created.len(), 1, "{pass:?}");
    assert_eq!(
        pass.bound,
        [("default/p1".to_string(), "node-a".to_string())]
    );

    let pod: Pod = server
        .get_as("pods", Some("default"), "p1")
        .expect("the pod");
    assert_eq!(
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some("node-a")
    );
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .expect("the pod names its claim");
    let claim_name = statuses[0].resource_claim_name.clone().expect("a name");
    assert!(claim_name.starts_with("p1-gpu-"), "{claim_name}");
    let claim: ResourceClaim = server
        .get_as("resourceclaims", Some("default"), &claim_name)
        .expect("the claim");
    assert_eq!(
        claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(POD_CLAIM_NAME_ANNOTATION))
            .map(String::as_str),
        Some("gpu")
    );
    let owner = &claim.metadata.owner_references.as_ref().expect("an owner")[0];
    assert_eq!((owner.kind.as_str(), owner.controller), ("Pod", Some(true)));
    assert_eq!(Some(&owner.uid), pod.metadata.uid.as_ref());
    let status = claim.status.as_ref().expect("a status");
    let results = status
        .allocation
        .as_ref()
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .expect("results");
    let got: Vec<(&str, &str, &str, &str)> = results
        .iter()
        .map(|r| {
            (
                r.request.as_str(),
                r.driver.as_str(),
                r.device.as_str(),
                r.consumed_capacity
                    .as_ref()
                    .map_or("", |c| c["memory"].0.as_str()),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("main", "gpushare.io", "gpu-0", "6Gi"),
            ("side", "gpushare.io", "gpu-0", "2Gi")
        ]
    );
    assert!(results.iter().all(|r| r.share_id.is_some()));
    assert_ne!(results[0].share_id, results[1].share_id);
    let reserved = status.reserved_for.as_ref().expect("reservedFor");
    assert_eq!(
        (reserved[0].resource.as_str(), reserved[0].name.as_str()),
        ("pods", "p1")
    );

    // A second pass changes nothing: no second claim, no second binding.
    let pass = allocator.reconcile().await.expect("a pass");
    assert!(pass.created.is_empty() && pass.bound.is_empty(), "{pass:?}");

    // 8 GiB left: a second pod needs 6 + 2 and fits; a third does not.
    server.create_object(gpu_pod("p2")).expect("p2");
    server.create_object(gpu_pod("p3")).expect("p3");
    let pass = allocator.reconcile().await.expect("a pass");
    assert_eq!(pass.bound.len(), 1, "{pass:?}");
    assert_eq!(pass.pending.len(), 1, "{pass:?}");
    let waiting: Pod = server
        .get_as(
            "pods",
            Some("default"),
            &pass.pending[0].0["default/".len()..],
        )
        .expect("the pending pod");
    let cond = waiting
        .status
        .and_then(|s| s.conditions)
        .and_then(|c| c.into_iter().find(|c| c.type_ == "PodScheduled"))
        .expect("PodScheduled");
    assert_eq!(
        (cond.status.as_str(), cond.reason.as_deref()),
        ("False", Some("Unschedulable"))
    );
    assert_eq!(
        cond.message.as_deref(),
        Some("0/1 nodes are available: 1 cannot allocate all claims."),
        "kube-scheduler's words"
    );

    // p1 finishes: its claim is deleted, and the waiting pod fits.
    server
        .set_pod_phase("default", "p1", "Succeeded")
        .expect("phase");
    let pass = allocator.reconcile().await.expect("a pass");
    assert_eq!(pass.released, [format!("default/{claim_name}")]);
    assert!(
        server
            .get_object("resourceclaims", Some("default"), &claim_name)
            .is_none()
    );
    assert_eq!(pass.bound.len(), 1, "{pass:?}");
}

#[tokio::test]
async fn a_claim_created_whose_answer_was_lost_is_found_not_duplicated() {
    let server = cluster().await;
    let created = server.create_object(gpu_pod("p1")).expect("the pod");
    let uid = created["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_string();
    // What a pass that died after its create left: the claim, but no pod status.
    server
        .create_object(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": "p1-gpu-abcde", "namespace": "default",
                "annotations": { POD_CLAIM_NAME_ANNOTATION: "gpu" },
                "ownerReferences": [{ "apiVersion": "v1", "kind": "Pod", "name": "p1", "uid": uid, "controller": true }] },
            "spec": { "devices": { "requests": [{ "name": "main", "exactly": { "deviceClassName": "gpu-mem.gpushare.io" } }] } },
        }))
        .expect("the earlier claim");
    let pass = DraAllocator::new(server.admin_client())
        .reconcile()
        .await
        .expect("a pass");
    assert!(pass.created.is_empty(), "{pass:?}");
    let claims = Api::<ResourceClaim>::namespaced(server.admin_client(), "default")
        .list(&ListParams::default())
        .await
        .expect("claims");
    assert_eq!(claims.items.len(), 1);
    let pod: Pod = server.get_as("pods", Some("default"), "p1").expect("pod");
    assert_eq!(
        pod.status
            .and_then(|s| s.resource_claim_statuses)
            .and_then(|s| s[0].resource_claim_name.clone())
            .as_deref(),
        Some("p1-gpu-abcde")
    );
}

/// A selector that fails on a device (an attribute the device lacks) is an allocation error,
/// as upstream's allocator has it: the pod stays pending with the error, pass after pass, as
/// kube-scheduler retries it for ever, although another device would match.
#[tokio::test]
async fn a_selector_runtime_error_keeps_the_pod_pending_with_the_error() {
    let server = cluster().await;
    server
        .seed_yaml(
            r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: { name: nic.gpushare.io }
spec:
  selectors:
  - cel: { expression: 'device.attributes["gpushare.io"].kind == "nic"' }
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: { name: nic, namespace: default }
spec:
  spec:
    devices:
      requests:
      - name: nic
        exactly: { deviceClassName: nic.gpushare.io }
"#,
        )
        .expect("the class and template");
    let mut pod = gpu_pod("p");
    pod["spec"]["resourceClaims"] = json!([{ "name": "gpu", "resourceClaimTemplateName": "nic" }]);
    pod["spec"]["containers"] = json!([{ "name": "main", "image": "x",
        "resources": { "claims": [{ "name": "gpu" }] } }]);
    server.create_object(pod).expect("the pod");
    let allocator = DraAllocator::new(server.admin_client());
    for _ in 0..2 {
        let pass = allocator.reconcile().await.expect("a pass");
        assert!(pass.bound.is_empty(), "{pass:?}");
        let (pod, why) = &pass.pending[0];
        assert_eq!(pod, "default/p");
        assert!(
            why.starts_with(
                "class nic.gpushare.io: selector #0 on device gpushare.io/node-a/gpu-0: CEL runtime error: no such key: kind"
            ),
            "{why}"
        );
    }
}
