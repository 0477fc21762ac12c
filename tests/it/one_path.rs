//! One path per GPU across the node's processes: the device plugin and the DRA plugin run on
//! node agents of their own (as their DaemonSets do), sharing only the GPU lock directory,
//! the sandbox API server and the fake GPUs. In either order, the second role offers no GPU
//! the first serves, and a GPU the first path's pods or claims still hold is offered only once
//! they are gone (the move recipe of the DRA page, safe by construction).

use std::collections::BTreeSet;
use std::sync::Arc;

use gpushare::config::Config;
use gpushare::core::wire::{self, DRA_DRIVER_NAME};
use gpushare::deviceplugin::{self, DevicePluginHandle};
use gpushare::dra::role::DraPluginHandle;
use gpushare::gpu::fake::{FakeBackend, fake_uuid};
use gpushare::kubelet_api::deviceplugin::Device;
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::dra_kubelet::ClaimOutcome;
use gpushare_sandbox::kubelet::Kubelet;
use serde_json::Value;

use crate::support::dra_node::{self, NODE, Node};
use crate::support::objects::bound_pod;
use crate::support::wait::wait_until;

/// A DRA node (API server, class, DRA directories) whose GPU lock directory the device plugin
/// shares, and a sandbox kubelet for the device plugin.
async fn node_for_both() -> (Node, Kubelet) {
    let node = dra_node::node(|_| {}).await;
    let mut node = node;
    node.config.node.gpu_lock_dir = node.dir.path().join("locks");
    let kubelet = Kubelet::start(&node.dir.path().join("kubelet"))
        .await
        .expect("the device-plugin kubelet");
    (node, kubelet)
}

/// The device plugin on an agent of its own (another process on a real node).
async fn device_plugin(node: &Node, kubelet: &Kubelet) -> DevicePluginHandle {
    let mut config: Config = node.config.clone();
    config.device_plugin.device_plugin_dir = kubelet.device_plugin_dir();
    config.device_plugin.state_dir = node.dir.path().join("device-plugin-state");
    config.device_plugin.pod_resources_socket = kubelet.pod_resources_socket();
    config.device_plugin.admin_address = String::new();
    let backend = FakeBackend::from_spec("2x16GiB").expect("fake GPUs");
    let plugin = deviceplugin::start(
        &config,
        node.api.admin_client(),
        Arc::new(backend),
        Shutdown::never(),
    )
    .await
    .expect("the device plugin starts");
    kubelet
        .wait_registered(wire::RESOURCE_GPU_MEM)
        .await
        .expect("registers");
    plugin
}

/// The UUIDs of the GPUs the node's slices publish.
fn published_gpus(node: &Node) -> BTreeSet<String> {
    node.slice_devices()
        .iter()
        .filter_map(|d| {
            d["attributes"]["uuid"]["string"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

fn uuids(indices: &[u32]) -> BTreeSet<String> {
    indices.iter().map(|i| fake_uuid(*i)).collect()
}

/// The healthy devices of GPU `index` in a device list.
fn healthy_devices(devices: &[Device], index: u32) -> usize {
    devices
        .iter()
        .filter(|d| d.id.starts_with(&fake_uuid(index)) && d.health == "Healthy")
        .count()
}

fn dra_offer(plugin: &DraPluginHandle) -> gpushare::node::path_gate::Offer {
    plugin.offer().expect("the gate is open").borrow().clone()
}

fn annotation(node: &Node, key: &str) -> Option<Value> {
    let n = node.api.get_object("nodes", None, NODE).expect("the node");
    n["metadata"]["annotations"][key]
        .as_str()
        .and_then(|v| serde_json::from_str(v).ok())
}

/// The device plugin serves, and a pod it placed holds 12 of GPU 0's 16 units; then the DRA
/// plugin starts (as a node labelled for DRA while its device plugin is still terminating):
/// it publishes no GPU while the device plugin holds them, then GPU 1 once the device plugin
/// is gone, and GPU 0 only once the pod holding memory on it has finished. A claim never lands
/// on GPU 0 beside the pod: no 20 GiB on 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_plugin_offers_no_gpu_the_device_plugin_serves_or_its_pods_hold() {
    let (node, kubelet) = node_for_both().await;
    let dp = device_plugin(&node, &kubelet).await;
    node.api
        .create_object(bound_pod("extender-pod", NODE, 0, 12, 16))
        .expect("a pod placed by the extender on GPU 0");

    let dra = node.start().await;
    let offer = dra_offer(&dra);
    assert!(
        offer.offered.is_empty(),
        "GPUs offered on DRA while the device plugin serves them: {offer:?}"
    );
    assert!(
        offer.held_back[&0].contains("served by the device plugin"),
        "{offer:?}"
    );
    assert!(
        published_gpus(&node).is_empty(),
        "{:?}",
        node.slice_devices()
    );
    assert!(
        annotation(&node, wire::NODE_ANN_DEVICE_PLUGIN_GPUS)
            .is_some_and(|a| a["offered"] == serde_json::json!([0, 1])),
        "the device plugin's GPUs on the Node"
    );

    // The device plugin goes (the node was labelled for DRA).
    dp.stop().await;
    wait_until("GPU 1 published on DRA", || {
        published_gpus(&node) == uuids(&[1])
    })
    .await;
    let offer = dra_offer(&dra);
    assert!(
        offer.held_back[&0]
            .contains("pod default/extender-pod placed by the extender holds 12 units"),
        "{offer:?}"
    );
    assert!(
        annotation(&node, wire::NODE_ANN_DEVICE_PLUGIN_GPUS).is_none(),
        "removed when the device plugin stopped"
    );

    // A claim of 8 GiB lands on GPU 1, the only one published.
    dra_node::submit_containers(&node.api, "claim-pod", &[("main", 8)]);
    crate::support::dra::allocate_one(&node.api).await;
    let claim = node
        .api
        .list_objects("resourceclaims", Some("default"))
        .pop()
        .expect("the claim");
    let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .expect("a device")
        .to_string();
    assert_eq!(device, fake_uuid(1).to_ascii_lowercase(), "{claim:#}");

    // The pod on GPU 0 finishes: GPU 0 is published too.
    node.api
        .set_pod_phase("default", "extender-pod", "Succeeded")
        .expect("phase");
    wait_until("GPU 0 published once free", || {
        published_gpus(&node) == uuids(&[0, 1])
    })
    .await;
    assert!(
        annotation(&node, wire::NODE_ANN_DRA_GPUS)
            .is_some_and(|a| a["offered"] == serde_json::json!([0, 1])),
        "the DRA plugin's GPUs on the Node"
    );
    dra.stop().await;
    kubelet.stop().await;
}

/// The reverse order: the DRA plugin serves and a claim is prepared on GPU 0; then the device
/// plugin starts. It lists every device unhealthy while the DRA plugin holds the GPUs, keeps
/// them so while the DRA plugin's slice still publishes them after it stopped, offers GPU 1
/// once the slice is gone, and GPU 0 only once no claim is allocated on it; Allocate of a pod
/// placed on a held-back GPU is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_offers_no_gpu_the_dra_plugin_serves_or_its_claims_hold() {
    let (node, kubelet) = node_for_both().await;
    let dra = node.start().await;
    let dra_kubelet = node.kubelet();
    dra_kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers");
    wait_until("both GPUs published", || {
        published_gpus(&node) == uuids(&[0, 1])
    })
    .await;
    dra_node::submit_containers(&node.api, "claim-pod", &[("main", 8)]);
    crate::support::dra::allocate_one(&node.api).await;
    let claims = dra_kubelet
        .prepare_pod("default", "claim-pod")
        .await
        .expect("answers");
    assert!(matches!(claims[0].outcome, ClaimOutcome::Prepared(_)));
    let (claim_name, _) = crate::support::dra::pod_claim(&node.api, "claim-pod");
    let on = node
        .api
        .get_object("resourceclaims", Some("default"), &claim_name)
        .expect("the claim")["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .expect("a device")
        .to_string();
    let held = if on == fake_uuid(0).to_ascii_lowercase() {
        0
    } else {
        1
    };
    let free = 1 - held;

    let dp = device_plugin(&node, &kubelet).await;
    let offer = dp.offer().borrow().clone();
    assert!(
        offer.offered.is_empty(),
        "GPUs offered by the device plugin while the DRA plugin serves them: {offer:?}"
    );
    assert!(
        offer.held_back[&held].contains("served by the DRA kubelet plugin"),
        "{offer:?}"
    );
    kubelet
        .wait_devices(wire::RESOURCE_GPU_MEM, |ds| {
            !ds.is_empty() && ds.iter().all(|d| d.health == "Unhealthy")
        })
        .await
        .expect("every device unhealthy");
    let devices =
        node.api.get_object("nodes", None, NODE).expect("the node")["metadata"]["annotations"]
            [wire::NODE_ANN_DEVICES]
            .as_str()
            .map(str::to_string)
            .expect("the device annotation");
    assert!(
        !devices.contains("\"healthy\":true"),
        "the extender sees no GPU to place on: {devices}"
    );

    // The DRA plugin stops; its slice stays until kubelet removes it.
    dra.stop().await;
    drop(dra_kubelet);
    let still = dp.offer();
    wait_until("held back by the slice left behind", || {
        still
            .borrow()
            .held_back
            .values()
            .all(|why| why.contains("ResourceSlice"))
    })
    .await;
    assert!(dp.offer().borrow().offered.is_empty());
    for s in node.api.list_objects("resourceslices", None) {
        let name = s["metadata"]["name"].as_str().expect("named").to_string();
        node.api
            .delete_object("resourceslices", None, &name)
            .expect("kubelet removes the stopped plugin's slices");
    }
    wait_until("the free GPU offered", || {
        dp.offer().borrow().is_offered(free)
    })
    .await;
    kubelet
        .wait_devices(wire::RESOURCE_GPU_MEM, |ds| healthy_devices(ds, free) == 16)
        .await
        .expect("the free GPU's devices healthy");
    let offer = dp.offer().borrow().clone();
    assert!(
        offer.held_back[&held].contains(&format!("ResourceClaim default/{claim_name}")),
        "{offer:?}"
    );
    assert_eq!(
        healthy_devices(&kubelet.devices(wire::RESOURCE_GPU_MEM), held),
        0
    );

    // A pod the extender placed on the held-back GPU is refused at Allocate.
    node.api
        .create_object(crate::support::objects::assumed_pod(
            "late",
            NODE,
            &[],
            &[("main", 2)],
            Some(held),
            1,
        ))
        .expect("a pod placed on the held-back GPU");
    wait_until("the device plugin sees the pod", || {
        dp.watched_pod("default", "late").is_some()
    })
    .await;
    let err = kubelet
        .allocate_container(wire::RESOURCE_GPU_MEM, "default", "late", "main", 2)
        .await
        .expect_err("refused on a held-back GPU");
    assert!(
        format!("{err:#}").contains("not offered on the device-plugin path"),
        "{err:#}"
    );

    // The claim goes: the GPU is offered.
    node.api
        .delete_object("resourceclaims", Some("default"), &claim_name)
        .expect("the claim deleted");
    wait_until("the claimed GPU offered once free", || {
        dp.offer().borrow().is_offered(held)
    })
    .await;
    dp.stop().await;
    kubelet.stop().await;
}
