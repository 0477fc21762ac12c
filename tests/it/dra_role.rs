//! `gpushare dra-plugin` as it runs on a node, in-process over the sandbox: the real role
//! (node agent with fake GPUs, slices published by the role, the CDI preparer) with the
//! sandbox DRA allocator and DRA kubelet, and Python grpcio with the upstream protos. A pod
//! with a claim from a template is allocated, bound, prepared (the CDI spec's envs and device
//! names checked), unprepared after deletion across a restart of the plugin; an Xid reaches the
//! slice (a taint whose value names it) and `NodeWatchResources`, recovery removes both. The
//! lifetimes of the state: a CDI spec cleared while the checkpoint stayed (a reboot with the
//! state on disk) is written again on the next prepare; a checkpoint lost while the spec
//! stayed leaks no spec on unprepare.

use std::path::Path;

use gpushare::core::wire::{DRA_DRIVER_NAME, DRA_TAINT_UNHEALTHY};
use gpushare::dra::role::{self, DraPluginHandle};
use gpushare::gpu::HealthEvent;
use gpushare::gpu::fake::fake_uuid;
use gpushare_sandbox::dra_kubelet::ClaimOutcome;
use serde_json::{Value, json};

use crate::support::clients;
use crate::support::dra;
use crate::support::dra_node::{NODE, Node, node, node_with, pod_uid, spec_file, submit};
use crate::support::role_process::RoleProcess;
use crate::support::wait::wait_until;

/// The DRA path needs nothing of the device plugin's on the Node object: the slices carry the
/// GPUs (with their unit) and the webhook is told the unit. The role reads its Node (the uid of
/// its Events), lists only its own node's pods (the gate: pods the extender placed on a GPU) and
/// writes on the Node only its path's annotation `gpushare.io/dra-gpus`: never the device
/// plugin's `gpushare.io/devices` or `aliyun.com/gpu-count`.
#[tokio::test]
async fn the_role_writes_only_its_path_annotation_on_its_node() {
    let node = node(|_| {}).await;
    // The node once served the device-plugin path in another unit: nothing of it matters here.
    node.api
        .delete_object("nodes", None, NODE)
        .expect("the plain node goes");
    node.api
        .create_object(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": NODE, "annotations": { "gpushare.io/memory-unit": "MiB" } },
        }))
        .expect("the node, annotated by the device-plugin path in MiB");
    let plugin = node.start().await;
    dra::published(&plugin).await;
    let stored = node.api.get_object("nodes", None, NODE).expect("the node");
    let requests = node.api.requests();
    let pod_lists: Vec<String> = requests
        .iter()
        .filter(|r| r.path.ends_with("/pods") && r.method == http::Method::GET)
        .map(|r| r.query.clone())
        .collect();
    assert!(
        pod_lists
            .iter()
            .all(|q| q.contains("spec.nodeName%3Dnode-a") || q.contains("spec.nodeName=node-a")),
        "only its own node's pods: {pod_lists:?}"
    );
    let writes: Vec<String> = requests
        .iter()
        .filter(|r| r.path.contains("/nodes") && r.method != http::Method::GET)
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(
        writes.iter().all(|w| w == "PATCH /api/v1/nodes/node-a"),
        "only its own Node, no status: {writes:?}"
    );
    let annotations: Vec<&String> = stored["metadata"]["annotations"]
        .as_object()
        .map(|a| a.keys().collect())
        .unwrap_or_default();
    assert_eq!(
        annotations,
        ["gpushare.io/dra-gpus", "gpushare.io/memory-unit"],
        "its path's annotation beside what was there: {stored}"
    );
    assert!(
        stored["metadata"]["annotations"]
            .get("gpushare.io/devices")
            .is_none(),
        "{stored}"
    );
    assert!(
        stored["status"]["capacity"]
            .get("aliyun.com/gpu-count")
            .is_none(),
        "{stored}"
    );
    assert!(
        node.slice_devices()[0]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"]
            == "1073741824",
        "the configured unit (GiB) serves, whatever the node recorded: {:?}",
        node.slice_devices()
    );
    plugin.stop().await;
}

/// A GPU of fewer than two units (`min + step <= value` fails: here a 15 GiB GPU with an 8 GiB
/// unit) would make the API server refuse the node's whole slice; it is left out by name, and
/// the other GPU serves.
#[tokio::test]
async fn a_gpu_too_small_for_the_unit_is_left_out_by_name_and_the_others_serve() {
    let node = node_with("16GiB,15GiB", |c| {
        c.node.memory_unit = "8GiB".parse().expect("a unit")
    })
    .await;
    let plugin = node.start().await;
    dra::published(&plugin).await;
    let devices = node.slice_devices();
    let uuids: Vec<&str> = devices
        .iter()
        .filter_map(|d| d["attributes"]["uuid"]["string"].as_str())
        .collect();
    assert_eq!(uuids, [fake_uuid(0).as_str()], "{devices:?}");
    for d in &devices {
        let capacity = &d["capacity"]["memory"];
        let value: u64 = capacity["value"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .expect("bytes");
        let range = &capacity["requestPolicy"]["validRange"];
        let min: u64 = range["min"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .expect("min");
        let step: u64 = range["step"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .expect("step");
        assert!(
            min + step <= value,
            "upstream's rule min + step <= value: {d}"
        );
    }
    let events = node.api.list_objects("events.events.k8s.io", None);
    assert!(
        events.iter().any(|e| e["reason"] == "GpuShareGpuTooSmall"
            && e["note"]
                .as_str()
                .is_some_and(|n| n.contains(&fake_uuid(1)) && n.contains("8GiB"))),
        "a Warning Event names the GPU left out and the unit: {events:?}"
    );
    plugin.stop().await;
}

/// `gpushare dra-plugin` as the binary, with its preflight: the DRA node's checks (its own
/// directories, CDI, its RBAC), not the device plugin's (kubelet's device-plugin directory
/// does not exist here, as it is not mounted into the DRA plugin's pod).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_the_dra_preflight_and_serves() {
    let node = node(|_| {}).await;
    let kubelet = node.kubelet();
    for dir in ["plugin", "state", "cdi"] {
        std::fs::create_dir_all(node.dir.path().join(dir)).expect("a directory");
    }
    let path = |p: &Path| p.display().to_string();
    let args: Vec<String> = [
        "dra-plugin".to_string(),
        format!("--node-name={NODE}"),
        "--gpu-backend=fake".into(),
        "--fake-gpus=2x16GiB".into(),
        format!("--registry-dir={}", path(&node.config.dra.registry_dir)),
        format!("--plugin-dir={}", path(&node.config.dra.plugin_dir)),
        format!("--state-dir={}", path(&node.config.dra.state_dir)),
        format!("--cdi-dir={}", path(&node.config.dra.cdi_dir)),
        "--admin-address=".into(),
        format!("--kubeconfig={}", path(&node.api.admin_kubeconfig_path())),
    ]
    .into();
    let mut role = RoleProcess::start("dra-plugin", None, &args, &[]);
    role.wait_for(
        "its registration with kubelet",
        std::time::Duration::from_secs(30),
        || {
            kubelet
                .plugins()
                .iter()
                .any(|p| p.driver == DRA_DRIVER_NAME && p.registered)
        },
    )
    .await;
    let log = role.log();
    assert!(
        log.contains("] dra-registry-dir "),
        "the DRA checks ran: {log}"
    );
    assert!(
        log.contains("DRA plugin: 12 of 12 allowed"),
        "its own RBAC: {log}"
    );
    for id in ["device-plugin-dir", "kubelet-socket", "plugin-conflict "] {
        assert!(!log.contains(&format!("] {id}")), "{id}: {log}");
    }
}

/// A publication the API server refuses for certain (422: the slice is invalid) is not a
/// transient failure: it is said once, as an error and a Warning Event on the node with the
/// API server's message, not retried every two seconds in silence.
#[tokio::test]
async fn a_refused_publication_is_named_in_an_event() {
    let node = node(|_| {}).await;
    node.api.inject(
        gpushare_sandbox::apiserver::Fault::new(
            Some(http::Method::POST),
            "/resourceslices",
            gpushare_sandbox::apiserver::FaultAction::Status(422),
        )
        .times(1000),
    );
    let plugin = node.start().await;
    wait_until("a Warning Event naming the refused slice", || {
        node.api
            .list_objects("events.events.k8s.io", None)
            .iter()
            .any(|e| e["reason"] == "GpuShareSliceRefused" && e["type"] == "Warning")
    })
    .await;
    let posts = node
        .api
        .requests()
        .iter()
        .filter(|r| r.method == http::Method::POST && r.path.ends_with("/resourceslices"))
        .count();
    assert!(
        posts <= 4,
        "a certain refusal is not retried at once: {posts} creates"
    );
    plugin.stop().await;
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
    crate::support::dra::allocate_one(&node.api).await;
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
    crate::support::dra_node::finish_and_unprepare(&node.api, &kubelet, "p", &uid).await;
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
    crate::support::dra_node::wait_device_health(&kubelet, &gpu1, "UNHEALTHY", Some("xid-62"))
        .await;
    assert!(
        node.slice_devices()
            .iter()
            .filter(|d| d["name"] != gpu1.as_str())
            .all(|d| d["taints"].is_null()),
        "GPU 0 is untouched"
    );
    wait_until("the taint removed", || untainted(&node.slice_devices())).await;
    crate::support::dra_node::wait_device_health(&kubelet, &gpu1, "HEALTHY", None).await;
    plugin.stop().await;
}

/// Python grpcio with the upstream protos (a kubelet someone else wrote) against the real
/// role: registration, prepare (the CDI ids of the role's preparer), health, unprepare.
#[tokio::test]
async fn grpcio_prepares_and_unprepares_through_the_role() {
    let Some(python) = clients::grpcio_python() else {
        return;
    };
    let node = node(|_| {}).await;
    let plugin = node.start().await;
    dra::published(&plugin).await;
    submit(&node.api, "p", 2, 2);
    crate::support::dra::allocate_one(&node.api).await;
    let (name, uid) = dra::pod_claim(&node.api, "p");
    let claim = format!("default/{uid}/{name}");
    let args = clients::grpcio_round("path", &["--api", "v1"], &[&claim]);
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
    crate::support::dra::allocate_one(&node.api).await;
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
    let Some(python) = clients::grpcio_python() else {
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
    let Some(python) = clients::grpcio_python() else {
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
