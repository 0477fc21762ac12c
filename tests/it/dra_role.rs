//! `gpushare dra-plugin` as it runs on a node, in-process over the sandbox: the real role
//! (node agent with fake GPUs, slices published by the role, the CDI preparer) with the
//! sandbox DRA allocator and DRA kubelet, and Python grpcio with the upstream protos. A pod
//! with a claim from a template is allocated, bound, prepared (the CDI spec's envs and device
//! names checked), unprepared after deletion across a restart of the plugin; an Xid reaches the
//! slice (a taint whose value names it) and `NodeWatchResources`, recovery removes both. The
//! lifetimes of the state: a CDI spec cleared while the checkpoint stayed (a reboot with the
//! state on disk) is written again on the next prepare; a checkpoint lost while the spec
//! stayed leaks no spec on unprepare.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpushare::config::Config;
use gpushare::core::MemoryUnit;
use gpushare::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME, DRA_TAINT_UNHEALTHY};
use gpushare::dra::role::{self, DraPluginHandle};
use gpushare::gpu::HealthEvent;
use gpushare::gpu::fake::{FakeBackend, FakeHealth, fake_uuid};
use gpushare::k8s::dra_request::rewrite;
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::DraAllocator;
use gpushare_sandbox::dra_kubelet::{ClaimOutcome, DraKubelet};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use crate::support::clients;
use crate::support::dra;
use crate::support::socket_dir::short_tempdir;
use crate::support::wait::wait_until;

const NODE: &str = "node-a";

struct Node {
    api: ApiServer,
    dir: tempfile::TempDir,
    config: Config,
    backend: Arc<FakeBackend>,
    health: FakeHealth,
}

impl Node {
    async fn start(&self) -> DraPluginHandle {
        let backend: Arc<dyn gpushare::gpu::GpuBackend> = self.backend.clone();
        role::start(
            &self.config,
            self.api.admin_client(),
            backend,
            Shutdown::never(),
        )
        .await
        .expect("the DRA plugin starts")
    }

    fn kubelet(&self) -> DraKubelet {
        DraKubelet::start(&self.config.dra.registry_dir, NODE, self.api.admin_client())
            .expect("the DRA kubelet starts")
    }

    fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    fn slice_devices(&self) -> Vec<Value> {
        dra::slice_devices(&self.api, NODE)
    }
}

async fn node(tweak: impl FnOnce(&mut Config)) -> Node {
    let api = ApiServer::start().await.expect("starts");
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n"
    ))
    .expect("the node");
    api.create_object(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": DRA_DEVICE_CLASS },
        "spec": { "selectors": [{ "cel": { "expression": gpushare::core::wire::dra_gpu_class_selector(DRA_DRIVER_NAME) } }] },
    }))
    .expect("the class");
    let dir = short_tempdir();
    let mut config = Config::default();
    config.node.node_name = NODE.into();
    config.dra.registry_dir = dir.path().join("registry");
    config.dra.plugin_dir = dir.path().join("plugin");
    config.dra.state_dir = dir.path().join("state");
    config.dra.cdi_dir = dir.path().join("cdi");
    config.dra.admin_address = String::new();
    config.doctor.skip = true;
    tweak(&mut config);
    let backend = FakeBackend::from_spec("2x16GiB").expect("fake GPUs");
    let health = backend.health();
    Node {
        api,
        dir,
        config,
        backend: Arc::new(backend),
        health,
    }
}

/// Rewrites a `main` + `side` gpu-mem pod, stores its template and the pod.
fn submit(api: &ApiServer, name: &str, main: u64, side: u64) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "containers": [
            { "name": "main", "image": "x", "resources": { "limits": { "aliyun.com/gpu-mem": main.to_string() } } },
            { "name": "side", "image": "x", "resources": { "limits": { "aliyun.com/gpu-mem": side.to_string() } } },
        ] },
    }))
    .expect("a pod");
    let r = rewrite(
        &pod,
        "default",
        MemoryUnit::GIB,
        DRA_DRIVER_NAME,
        DRA_DEVICE_CLASS,
    )
    .expect("rewrites")
    .expect("rewritten");
    let template = r.template.metadata.name.clone().expect("named");
    if api
        .get_object("resourceclaimtemplates", Some("default"), &template)
        .is_none()
    {
        api.create_object(serde_json::to_value(&r.template).expect("json"))
            .expect("the template");
    }
    let mut value = serde_json::to_value(&r.pod).expect("json");
    value["apiVersion"] = json!("v1");
    value["kind"] = json!("Pod");
    api.create_object(value).expect("the pod");
}

fn pod_uid(api: &ApiServer, name: &str) -> String {
    api.get_object("pods", Some("default"), name).expect("pod")["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_string()
}

fn spec_file(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join(format!("gpushare.io_gpu_{claim_uid}.json"))
}

#[tokio::test]
async fn the_role_publishes_prepares_a_cdi_spec_and_unprepares_across_a_restart() {
    let node = node(|_| {}).await;
    let plugin = node.start().await;
    dra::published(&plugin).await;
    let devices = node.slice_devices();
    assert_eq!(devices.len(), 2, "one device per GPU: {devices:?}");
    assert_eq!(devices[0]["attributes"]["uuid"]["string"], fake_uuid(0));
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers");
    wait_until("ready once registered", || plugin.is_ready()).await;

    submit(&node.api, "p", 3, 1);
    let pass = DraAllocator::new(node.api.admin_client())
        .reconcile()
        .await
        .expect("a pass");
    assert_eq!(pass.bound.len(), 1, "{pass:?}");
    assert_eq!(kubelet.sync().await.expect("sync").prepared, ["default/p"]);
    let uid = pod_uid(&node.api, "p");
    let claims = kubelet.prepared(&uid).expect("recorded");
    let ClaimOutcome::Prepared(devices) = &claims[0].outcome else {
        panic!("{claims:?}");
    };
    let claim_uid = claims[0].uid.clone();
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("gpushare.io/gpu={claim_uid}-0")]
    );
    assert_eq!(
        devices[1].cdi_device_ids,
        [format!("gpushare.io/gpu={claim_uid}-1")]
    );
    let spec: Value = serde_json::from_slice(
        &std::fs::read(spec_file(&node.cdi_dir(), &claim_uid)).expect("the spec is written"),
    )
    .expect("json");
    assert_eq!(spec["kind"], "gpushare.io/gpu");
    assert_eq!(spec["devices"][0]["name"], format!("{claim_uid}-0"));
    let env = |i: usize| -> Vec<String> {
        spec["devices"][i]["containerEdits"]["env"]
            .as_array()
            .expect("envs")
            .iter()
            .filter_map(|e| e.as_str().map(str::to_string))
            .collect()
    };
    for want in [
        "NVIDIA_VISIBLE_DEVICES=0",
        "ALIYUN_COM_GPU_MEM_IDX=0",
        "ALIYUN_COM_GPU_MEM_CONTAINER=3",
        "ALIYUN_COM_GPU_MEM_POD=4",
        "ALIYUN_COM_GPU_MEM_DEV=16",
    ] {
        assert!(env(0).iter().any(|e| e == want), "{want} in {:?}", env(0));
    }
    assert!(env(1).iter().any(|e| e == "ALIYUN_COM_GPU_MEM_CONTAINER=1"));

    // Binpack: the allocated GPU stays first; what is allocated is followed.
    assert_eq!(
        node.slice_devices()[0]["attributes"]["uuid"]["string"],
        fake_uuid(0)
    );

    // Restart between prepare and unprepare; the claim goes before kubelet unprepares.
    drop(kubelet);
    let sockets = (
        plugin.registration_socket().to_path_buf(),
        plugin.service_socket().to_path_buf(),
    );
    plugin.stop().await;
    assert!(
        !sockets.0.exists() && !sockets.1.exists(),
        "sockets removed"
    );
    let plugin = node.start().await;
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers again");
    let again = kubelet.prepare_pod("default", "p").await.expect("prepares");
    assert_eq!(
        again[0].outcome, claims[0].outcome,
        "answered from the checkpoint"
    );
    node.api
        .set_pod_phase("default", "p", "Succeeded")
        .expect("phase");
    let pass = DraAllocator::new(node.api.admin_client())
        .reconcile()
        .await
        .expect("a pass");
    assert_eq!(pass.released.len(), 1);
    assert!(
        kubelet
            .unprepare_pod(&uid)
            .await
            .expect("unprepares")
            .is_empty()
    );
    assert!(
        !spec_file(&node.cdi_dir(), &claim_uid).exists(),
        "the spec is removed"
    );
    plugin.stop().await;
}

#[tokio::test]
async fn an_xid_taints_the_device_and_reports_unhealthy_and_recovery_removes_both() {
    let node = node(|c| c.node.health_recovery_secs = 1).await;
    let plugin = node.start().await;
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers");
    wait_until("the health watcher", || node.health.subscribers() > 0).await;
    let served = plugin.served().borrow().clone();
    let gpu1 = served
        .devices
        .iter()
        .find(|(_, d)| d.index == 1)
        .map(|(n, _)| n.clone())
        .expect("GPU 1 served");
    // The taint's value names the XID.
    let tainted = |devices: &[Value]| {
        devices
            .iter()
            .find(|d| d["name"] == gpu1.as_str())
            .is_some_and(|d| {
                d["taints"].as_array().is_some_and(|t| {
                    t.iter().any(|t| {
                        t["key"] == DRA_TAINT_UNHEALTHY
                            && t["effect"] == "NoSchedule"
                            && t["value"] == "xid-62"
                    })
                })
            })
    };
    let untainted = |devices: &[Value]| {
        devices
            .iter()
            .find(|d| d["name"] == gpu1.as_str())
            .is_some_and(|d| d["taints"].is_null())
    };
    // XID 62 is transient: down, then healthy again after the quiet period.
    node.health.inject(HealthEvent::Xid {
        uuid: Some(fake_uuid(1)),
        xid: 62,
    });
    wait_until("the taint on GPU 1", || tainted(&node.slice_devices())).await;
    kubelet
        .wait_plugins("UNHEALTHY", |ps| {
            ps.iter().any(|p| {
                p.health
                    .iter()
                    .any(|h| h.device == gpu1 && h.health == "UNHEALTHY" && h.message == "xid-62")
            })
        })
        .await
        .expect("UNHEALTHY, naming the XID, reaches kubelet");
    assert!(
        node.slice_devices()
            .iter()
            .filter(|d| d["name"] != gpu1.as_str())
            .all(|d| d["taints"].is_null()),
        "GPU 0 is untouched"
    );
    wait_until("the taint removed", || untainted(&node.slice_devices())).await;
    kubelet
        .wait_plugins("HEALTHY again", |ps| {
            ps.iter().any(|p| {
                p.health
                    .iter()
                    .any(|h| h.device == gpu1 && h.health == "HEALTHY")
            })
        })
        .await
        .expect("HEALTHY reaches kubelet");
    plugin.stop().await;
}

/// Python grpcio with the upstream protos (a kubelet someone else wrote) against the real
/// role: registration, prepare (the CDI ids of the role's preparer), health, unprepare.
#[tokio::test]
async fn grpcio_prepares_and_unprepares_through_the_role() {
    let Some(python) = clients::python_with(&["grpc", "grpc_tools"]) else {
        return;
    };
    let node = node(|_| {}).await;
    let plugin = node.start().await;
    dra::published(&plugin).await;
    submit(&node.api, "p", 2, 2);
    let pass = DraAllocator::new(node.api.admin_client())
        .reconcile()
        .await
        .expect("a pass");
    assert_eq!(pass.bound.len(), 1, "{pass:?}");
    let (name, uid) = dra::pod_claim(&node.api, "p");
    let args = [
        "--authority",
        "path",
        "--api",
        "v1",
        "--prepare",
        "--health",
        "--unprepare",
        "--claim",
        &format!("default/{uid}/{name}"),
    ]
    .map(str::to_string);
    let report = clients::dra_kubelet_grpcio(&python, plugin.registration_socket(), &args).await;
    let good = &report["prepare"][&uid];
    assert_eq!(good["error"], "", "{report}");
    assert_eq!(
        good["devices"][0]["cdi_device_ids"],
        json!([format!("gpushare.io/gpu={uid}-0")]),
        "{report}"
    );
    assert_eq!(report["health"].as_array().map(Vec::len), Some(2));
    assert_eq!(report["unprepare"][&uid], "");
    assert!(!spec_file(&node.cdi_dir(), &uid).exists());
    plugin.stop().await;
}

/// One grpcio kubelet call (`--prepare` or `--unprepare`) of `claim` (`ns/uid/name`); its
/// JSON report.
async fn grpcio(python: &Path, socket: &Path, step: &str, claim: &str) -> Value {
    let args = ["--authority", "path", "--api", "v1", step, "--claim", claim].map(str::to_string);
    clients::dra_kubelet_grpcio(python, socket, &args).await
}

/// The role started, a pod `p` (2 + 1 units) allocated, its claim prepared by grpcio: the
/// plugin, `ns/uid/name` of the claim, and its uid.
async fn prepared_by_grpcio(node: &Node, python: &Path) -> (DraPluginHandle, String, String) {
    let plugin = node.start().await;
    dra::published(&plugin).await;
    submit(&node.api, "p", 2, 1);
    let pass = DraAllocator::new(node.api.admin_client())
        .reconcile()
        .await
        .expect("a pass");
    assert_eq!(pass.bound.len(), 1, "{pass:?}");
    let (name, uid) = dra::pod_claim(&node.api, "p");
    let claim = format!("default/{uid}/{name}");
    let report = grpcio(python, plugin.registration_socket(), "--prepare", &claim).await;
    assert_eq!(report["prepare"][&uid]["error"], "", "{report}");
    assert!(
        spec_file(&node.cdi_dir(), &uid).exists(),
        "the spec is written"
    );
    (plugin, claim, uid)
}

/// A reboot with the state directory on disk: the CDI directory (tmpfs) is empty, the
/// checkpoint still records the claim, and kubelet prepares it again: the spec is written
/// again from the recorded shares before the answer, the same as before.
#[tokio::test]
async fn a_cdi_spec_cleared_while_the_checkpoint_stayed_is_written_again_on_prepare() {
    let Some(python) = clients::python_with(&["grpc", "grpc_tools"]) else {
        return;
    };
    let node = node(|_| {}).await;
    let (plugin, claim, uid) = prepared_by_grpcio(&node, &python).await;
    let spec = spec_file(&node.cdi_dir(), &uid);
    let written = std::fs::read(&spec).expect("the spec");
    let checkpoint = node.dir.path().join("state").join(role::CHECKPOINT_FILE);
    assert!(checkpoint.exists(), "the checkpoint is in the state dir");
    plugin.stop().await;
    std::fs::remove_file(&spec).expect("the reboot clears the CDI directory");

    let plugin = node.start().await;
    let report = grpcio(&python, plugin.registration_socket(), "--prepare", &claim).await;
    assert_eq!(report["prepare"][&uid]["error"], "", "{report}");
    assert_eq!(
        report["prepare"][&uid]["devices"][0]["cdi_device_ids"],
        json!([format!("gpushare.io/gpu={uid}-0")]),
        "{report}"
    );
    assert_eq!(
        std::fs::read(&spec).expect("the spec is written again"),
        written,
        "the same spec as before"
    );
    let report = grpcio(&python, plugin.registration_socket(), "--unprepare", &claim).await;
    assert_eq!(report["unprepare"][&uid], "", "{report}");
    assert!(!spec.exists(), "the spec is removed");
    plugin.stop().await;
}

/// The checkpoint is lost while the CDI spec stays (the state directory cleared, the CDI
/// directory on disk): unprepare of the claim the plugin no longer knows still removes its
/// spec, by its deterministic name.
#[tokio::test]
async fn unprepare_of_a_claim_missing_from_a_lost_checkpoint_removes_its_spec() {
    let Some(python) = clients::python_with(&["grpc", "grpc_tools"]) else {
        return;
    };
    let node = node(|_| {}).await;
    let (plugin, claim, uid) = prepared_by_grpcio(&node, &python).await;
    plugin.stop().await;
    std::fs::remove_dir_all(node.dir.path().join("state")).expect("the state is lost");

    let plugin = node.start().await;
    let report = grpcio(&python, plugin.registration_socket(), "--unprepare", &claim).await;
    assert_eq!(report["unprepare"][&uid], "", "{report}");
    assert!(
        !spec_file(&node.cdi_dir(), &uid).exists(),
        "no spec leaks when the checkpoint was lost"
    );
    plugin.stop().await;
}
