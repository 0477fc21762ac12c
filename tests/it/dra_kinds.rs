//! RDMA HCAs and generic devices on the DRA path: the real `gpushare dra-plugin` role over the
//! recorded HGX H100 tree (`tests/fixtures/rdma/hgx-h100-8gpu-roce`: 8 GPUs with the tree's
//! PCI bus ids, its HCAs, a fake `/dev`), the sandbox DRA allocator and kubelet, and Python
//! grpcio with the upstream protos. The slice lists the GPUs then the HCAs and the generic
//! devices, with the standard `resource.kubernetes.io/` PCIe attributes; one claim asking GPU
//! memory and an HCA under the same `pcieRoot` (`matchAttribute`) gets the HCA INDEX pairs with
//! the GPU, and prepare hands over both (and a generic device) in one CDI spec; a pod written
//! with `gpushare.io/rdma` in its limits gets the same through the webhook's rewrite.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpushare::config::Config;
use gpushare::config::devices::GenericDeviceConfig;
use gpushare::core::wire::{
    DRA_DEVICE_CLASS, DRA_DRIVER_NAME, dra_gpu_class_selector, dra_kind_class_name,
    dra_kind_class_selector,
};
use gpushare::dra::role::{self, DraPluginHandle};
use gpushare::shutdown::Shutdown;
use gpushare::webhook::dra_rewrite::{kind_requests, rewrite_with_kinds};
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_kubelet::ClaimOutcome;
use serde_json::{Value, json};

use crate::support::clients;
use crate::support::dra;
use crate::support::fixture;
use crate::support::hgx::{HGX_NEAREST, dev_path, fake_dev, hgx_backend};
use crate::support::socket_dir::short_tempdir;

const NODE: &str = "node-a";
const RDMA: &str = "gpushare.io/rdma";
const FUSE: &str = "example.com/fuse";
const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";

struct Node {
    api: ApiServer,
    dir: tempfile::TempDir,
    config: Config,
}

impl Node {
    async fn start(&self) -> DraPluginHandle {
        let plugin = role::start(
            &self.config,
            self.api.admin_client(),
            Arc::new(hgx_backend()),
            Shutdown::never(),
        )
        .await
        .expect("the DRA plugin starts");
        dra::published(&plugin).await;
        plugin
    }

    fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    fn slice_devices(&self) -> Vec<Value> {
        dra::slice_devices(&self.api, NODE)
    }

    fn claim_of(&self, pod: &str) -> (String, String) {
        dra::pod_claim(&self.api, pod)
    }

    /// The device pod `pod`'s claim was allocated for `request`.
    fn allocated(&self, pod: &str, request: &str) -> String {
        let (name, _) = self.claim_of(pod);
        let claim = self
            .api
            .get_object("resourceclaims", Some("default"), &name)
            .expect("the claim");
        let results = &claim["status"]["allocation"]["devices"]["results"];
        results
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["request"] == request)
            .and_then(|r| r["device"].as_str())
            .unwrap_or_else(|| panic!("no result for {request}: {results}"))
            .to_string()
    }
}

async fn node(dev: &Path) -> Node {
    let api = ApiServer::start().await.expect("starts");
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n"
    ))
    .expect("the node");
    // The chart's classes: GPU memory, then one per kind.
    let class = |name: String, expression: String| {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": { "name": name },
            "spec": { "selectors": [{ "cel": { "expression": expression } }] },
        })
    };
    api.create_object(class(
        DRA_DEVICE_CLASS.into(),
        dra_gpu_class_selector(DRA_DRIVER_NAME),
    ))
    .expect("the GPU class");
    for resource in [RDMA, FUSE] {
        api.create_object(class(
            dra_kind_class_name(resource).expect("a class name"),
            dra_kind_class_selector(DRA_DRIVER_NAME, resource),
        ))
        .expect("a kind's class");
    }
    let dir = short_tempdir();
    let mut config = Config::default();
    config.node.node_name = NODE.into();
    config.dra.registry_dir = dir.path().join("registry");
    config.dra.plugin_dir = dir.path().join("plugin");
    config.dra.cdi_dir = dir.path().join("cdi");
    config.dra.state_dir = dir.path().join("state");
    config.dra.admin_address = String::new();
    config.doctor.skip = true;
    config.devices.sysfs_root = fixture("rdma/hgx-h100-8gpu-roce/sys");
    config.devices.dev_root = dev.to_path_buf();
    config.devices.rdma.enabled = true;
    config.devices.rdma.shares_per_hca = 2;
    config.devices.generic = vec![GenericDeviceConfig {
        resource: FUSE.to_string(),
        paths: vec![dev_path("/dev/fuse")],
        shares: 3,
        envs: [("FUSE_OK".to_string(), "1".to_string())].into(),
        mounts: Vec::new(),
    }];
    Node { api, dir, config }
}

/// A pod whose one claim asks `gib` of GPU memory, an HCA under the same PCIe root and, with
/// `fuse`, one share of `/dev/fuse`.
fn submit(api: &ApiServer, pod: &str, gib: u64, fuse: bool) {
    let mut requests = vec![
        json!({ "name": "gpu", "exactly": { "deviceClassName": DRA_DEVICE_CLASS,
            "capacity": { "requests": { "memory": format!("{gib}Gi") } } } }),
        json!({ "name": "nic", "exactly": {
            "deviceClassName": dra_kind_class_name(RDMA).expect("a class") } }),
    ];
    if fuse {
        requests.push(json!({ "name": "fuse", "exactly": {
            "deviceClassName": dra_kind_class_name(FUSE).expect("a class") } }));
    }
    api.create_object(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": { "name": pod, "namespace": "default" },
        "spec": { "spec": { "devices": {
            "requests": requests,
            "constraints": [{ "requests": ["gpu", "nic"], "matchAttribute": PCIE_ROOT }],
        } } },
    }))
    .expect("the template");
    api.create_object(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": pod, "namespace": "default" },
        "spec": {
            "resourceClaims": [{ "name": "job", "resourceClaimTemplateName": pod }],
            "containers": [{ "name": "trainer", "image": "x",
                "resources": { "claims": [{ "name": "job" }] } }],
        },
    }))
    .expect("the pod");
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn hcas_and_generic_devices_follow_the_gpus_with_the_standard_pcie_attributes() {
    let dev = short_tempdir();
    fake_dev(dev.path());
    let node = node(dev.path()).await;
    let plugin = node.start().await;
    let devices = node.slice_devices();
    let kind = |d: &Value| {
        d["attributes"]["type"]["string"]
            .as_str()
            .map(str::to_string)
    };
    let kinds: Vec<String> = devices.iter().filter_map(kind).collect();
    let first_other = kinds.iter().position(|k| k != "gpu").expect("other kinds");
    assert_eq!(first_other, 8, "the 8 GPUs come first: {kinds:?}");
    assert!(
        kinds[8..].iter().all(|k| k == "rdma" || k == "generic"),
        "{kinds:?}"
    );
    assert_eq!(kinds.last().map(String::as_str), Some("generic"));
    let by_ibdev = |name: &str| {
        devices
            .iter()
            .find(|d| d["attributes"]["ibdev"]["string"] == name)
            .unwrap_or_else(|| panic!("HCA {name} published: {devices:?}"))
            .clone()
    };
    for (i, nearest) in HGX_NEAREST.iter().enumerate() {
        let gpu = devices
            .iter()
            .find(|d| d["attributes"]["index"]["int"] == i)
            .expect("the GPU");
        let hca = by_ibdev(nearest);
        assert_eq!(
            gpu["attributes"][PCIE_ROOT], hca["attributes"][PCIE_ROOT],
            "GPU {i} and {nearest} share a root complex"
        );
        assert!(gpu["attributes"]["resource.kubernetes.io/numaNode"]["int"].is_i64());
        assert_eq!(hca["attributes"]["resource"]["string"], RDMA);
        assert_eq!(hca["allowMultipleAllocations"], true);
        assert_eq!(hca["capacity"]["shares"]["value"], "2");
    }
    let hca = by_ibdev("mlx5_5");
    assert_eq!(hca["name"], "rdma-mlx5-5");
    assert_eq!(
        hca["attributes"]["resource.kubernetes.io/pciBusID"]["string"],
        "0000:5e:00.0"
    );
    assert_eq!(
        hca["attributes"]["resource.kubernetes.io/numaNode"]["int"],
        0
    );
    assert_eq!(hca["attributes"]["linkLayer"]["string"], "Ethernet");
    let fuse = devices.last().expect("fuse");
    assert_eq!(fuse["attributes"]["resource"]["string"], FUSE);
    assert_eq!(fuse["capacity"]["shares"]["value"], "3");
    assert!(
        fuse["attributes"][PCIE_ROOT].is_null(),
        "no PCI place, no guess"
    );
    let served = plugin.served().borrow().clone();
    assert_eq!(served.devices.len(), 8);
    assert_eq!(served.others.len(), devices.len() - 8);
    plugin.stop().await;
}

#[tokio::test]
async fn one_claim_gets_gpu_memory_and_the_hca_under_the_same_root_and_prepare_hands_over_both() {
    let dev = short_tempdir();
    fake_dev(dev.path());
    let node = node(dev.path()).await;
    let plugin = node.start().await;
    let kubelet = crate::support::dra_node::registered_kubelet(&node.config, &node.api).await;

    // The first pod takes the whole first GPU (binpack), so the second lands on GPU 1: its
    // HCA must be the one behind GPU 1's switch, not the first HCA that fits.
    submit(&node.api, "whole", 80, false);
    crate::support::dra::allocate_one(&node.api).await;
    submit(&node.api, "trainer", 10, true);
    crate::support::dra::allocate_one(&node.api).await;
    let report = kubelet.sync().await.expect("sync");
    assert_eq!(report.prepared.len(), 2, "{report:?}");

    let (_, claim_uid) = node.claim_of("trainer");
    let device_of = |request: &str| node.allocated("trainer", request);
    assert_eq!(device_of("nic"), "rdma-mlx5-3");
    assert_eq!(device_of("fuse"), "fuse-fuse");

    let pod_uid = node
        .api
        .get_object("pods", Some("default"), "trainer")
        .expect("pod")["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_string();
    let claims = kubelet.prepared(&pod_uid).expect("recorded");
    let ClaimOutcome::Prepared(answered) = &claims[0].outcome else {
        panic!("{claims:?}");
    };
    let ids: Vec<(String, Vec<String>)> = answered
        .iter()
        .map(|d| (d.device.clone(), d.cdi_device_ids.clone()))
        .collect();
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert_eq!(
        ids[1],
        (
            "rdma-mlx5-3".to_string(),
            vec![format!("gpushare.io/gpu={claim_uid}-1")]
        )
    );
    assert_eq!(
        ids[2],
        (
            "fuse-fuse".to_string(),
            vec![format!("gpushare.io/gpu={claim_uid}-2")]
        )
    );

    let spec_path = node
        .cdi_dir()
        .join(format!("gpushare.io_gpu_{claim_uid}.json"));
    let spec: Value =
        serde_json::from_slice(&std::fs::read(&spec_path).expect("the spec")).expect("json");
    let devices = spec["devices"].as_array().expect("devices");
    assert!(
        strings(&devices[0]["containerEdits"]["env"]).contains(&"NVIDIA_VISIBLE_DEVICES=1".into()),
        "{spec}"
    );
    let nic = &devices[1]["containerEdits"];
    let nodes: Vec<String> = nic["deviceNodes"]
        .as_array()
        .expect("device nodes")
        .iter()
        .filter_map(|n| n["path"].as_str().map(str::to_string))
        .collect();
    assert!(
        nodes.contains(&"/dev/infiniband/rdma_cm".to_string()),
        "{nodes:?}"
    );
    assert!(
        nodes.iter().filter(|n| n.contains("uverbs")).count() == 1,
        "exactly mlx5_3's verbs node: {nodes:?}"
    );
    assert!(
        strings(&nic["env"]).contains(&"NCCL_IB_HCA==mlx5_3".to_string()),
        "{nic}"
    );
    let fuse = &devices[2]["containerEdits"];
    assert_eq!(fuse["deviceNodes"][0]["path"], "/dev/fuse");
    assert!(strings(&fuse["env"]).contains(&"FUSE_OK=1".to_string()));

    // The spec cleared while the checkpoint stayed (a reboot with the state on disk): asked
    // again, the plugin writes it again, the HCA and the generic device included.
    std::fs::remove_file(&spec_path).expect("cleared");
    let again = kubelet
        .prepare_pod("default", "trainer")
        .await
        .expect("prepares");
    assert_eq!(again[0].outcome, claims[0].outcome, "the same answer");
    let restored: Value =
        serde_json::from_slice(&std::fs::read(&spec_path).expect("written again")).expect("json");
    assert_eq!(restored, spec, "the same spec");

    // Released: unprepare removes the spec.
    crate::support::dra_node::finish_and_unprepare(&node.api, &kubelet, "trainer", &pod_uid).await;
    assert!(!spec_path.exists(), "the spec is removed");
    plugin.stop().await;
}

/// Python grpcio with the upstream protos: the answer names the GPU share and the HCA with
/// their CDI ids.
#[tokio::test]
async fn grpcio_gets_the_gpu_share_and_the_hca_of_one_claim() {
    let dev = short_tempdir();
    let Some(python) = clients::grpcio_python() else {
        return;
    };
    fake_dev(dev.path());
    let node = node(dev.path()).await;
    let plugin = node.start().await;
    submit(&node.api, "p", 4, false);
    crate::support::dra::allocate_one(&node.api).await;
    let (name, uid) = node.claim_of("p");
    let args = [
        "--authority",
        "path",
        "--api",
        "v1",
        "--prepare",
        "--unprepare",
        "--claim",
    ]
    .map(str::to_string)
    .into_iter()
    .chain([format!("default/{uid}/{name}")])
    .collect::<Vec<_>>();
    let report = clients::dra_kubelet_grpcio(&python, plugin.registration_socket(), &args).await;
    let answer = &report["prepare"][&uid];
    assert_eq!(answer["error"], "", "{report}");
    let devices = answer["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 2, "{report}");
    assert_eq!(devices[1]["device"], "rdma-mlx5-0", "{report}");
    assert_eq!(devices[1]["request_names"], json!(["nic"]));
    assert_eq!(
        devices[1]["cdi_device_ids"],
        json!([format!("gpushare.io/gpu={uid}-1")])
    );
    assert!(
        devices[1]["share_id"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "a shared HCA's result has a share id: {report}"
    );
    assert_eq!(report["unprepare"][&uid], "");
    plugin.stop().await;
}

/// The same job written for the device-plugin path (`aliyun.com/gpu-mem` and `gpushare.io/rdma`
/// in its limits), rewritten as the webhook's DRA mode does with `[devices]` (the node's own
/// configuration): one claim whose HCA is the one under the GPU's root.
#[tokio::test]
async fn a_pod_written_with_limits_gets_its_gpu_and_the_hca_under_its_root() {
    let dev = short_tempdir();
    fake_dev(dev.path());
    let node = node(dev.path()).await;
    let plugin = node.start().await;
    submit(&node.api, "whole", 80, false);
    crate::support::dra::allocate_one(&node.api).await;
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": { "name": "limits", "namespace": "default" },
        "spec": { "containers": [{ "name": "trainer", "image": "x", "resources": {
            "limits": { "aliyun.com/gpu-mem": "10", "gpushare.io/rdma": "1" } } }] },
    }))
    .expect("a pod");
    let r = rewrite_with_kinds(
        &pod,
        "default",
        gpushare::core::MemoryUnit::GIB,
        DRA_DRIVER_NAME,
        DRA_DEVICE_CLASS,
        &kind_requests(&node.config.devices),
    )
    .expect("rewrites")
    .expect("rewritten");
    node.api
        .create_object(serde_json::to_value(&r.template).expect("json"))
        .expect("the template");
    let mut value = serde_json::to_value(&r.pod).expect("json");
    value["apiVersion"] = json!("v1");
    value["kind"] = json!("Pod");
    node.api.create_object(value).expect("the pod");
    crate::support::dra::allocate_one(&node.api).await;
    let device_of = |request: &str| node.allocated("limits", request);
    let gpu1 = plugin
        .served()
        .borrow()
        .devices
        .iter()
        .find(|(_, d)| d.index == 1)
        .map(|(n, _)| n.clone())
        .expect("GPU 1");
    assert_eq!(device_of("trainer"), gpu1);
    assert_eq!(device_of("trainer-rdma"), "rdma-mlx5-3");
    plugin.stop().await;
}
