//! The DRA kubelet plugin's gRPC side (`gpushare::dra::plugin`) driven by kubelets someone
//! else wrote: the sandbox DRA kubelet and Python grpcio with the upstream protos. Claims come
//! from the webhook's rewrite and the sandbox allocator over slices built by
//! `gpushare::dra::slices`; what containers get is written by a preparer of this test (the
//! node agent's CDI writer takes its place in the role).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME};
use gpushare::core::{GpuPolicy, MemoryUnit};
use gpushare::dra::checkpoint::{Checkpoint, PreparedClaim};
use gpushare::dra::claims::{ClaimDevices, ClaimShare};
use gpushare::dra::plugin::{
    PluginConfig, PrepareError, Prepared, Preparer, RunningPlugin, SERVICES, Served, start,
};
use gpushare::dra::slices::{SliceGpu, build_slices, device_name};
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_kubelet::{ClaimOutcome, DraKubelet};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::support::clients;
use crate::support::dra;
use crate::support::dra::create_gpu_device_class;
use crate::support::dra_node::submit;
use crate::support::socket_dir::short_tempdir;

const GIB: u64 = 1 << 30;

/// Writes one JSON file per claim in its directory, naming a CDI device per share.
struct FilePreparer {
    dir: PathBuf,
    prepared: AtomicUsize,
    log: Mutex<Vec<String>>,
}

impl FilePreparer {
    fn spec(&self, uid: &str) -> PathBuf {
        self.dir.join(format!("claim-{uid}.json"))
    }
}

impl Preparer for FilePreparer {
    fn prepare(&self, uid: &str, claim: &ClaimDevices) -> Result<Prepared, PrepareError> {
        let shares: &[ClaimShare] = &claim.gpus;
        self.prepared.fetch_add(1, Ordering::SeqCst);
        let body: Vec<Value> = shares
            .iter()
            .map(|s| json!({ "request": s.request, "uuid": s.uuid, "units": s.units.units() }))
            .collect();
        std::fs::write(self.spec(uid), serde_json::to_vec(&body)?)?;
        Ok(Prepared {
            cdi_device_ids: shares
                .iter()
                .map(|s| vec![format!("k8s.gpushare.io/claim={uid}-{}", s.request)])
                .collect(),
            device_cdi_ids: Vec::new(),
            cdi_spec: Some(self.spec(uid)),
        })
    }

    fn unprepare(&self, uid: &str, claim: Option<&PreparedClaim>) -> Result<(), PrepareError> {
        if claim.is_some() {
            self.log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(uid.to_string());
        }
        // By its deterministic name: recorded or not.
        match std::fs::remove_file(self.spec(uid)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}

fn gpus() -> Vec<SliceGpu> {
    (0..2u32)
        .map(|i| SliceGpu {
            index: i,
            uuid: format!("GPU-{i}bbbbbbb-0000-0000-0000-000000000000"),
            product_name: "NVIDIA L4".into(),
            memory_bytes: 8 * GIB,
            place: None,
            unhealthy: None,
            allocated_bytes: 0,
        })
        .collect()
}

fn served() -> Served {
    Served::from_gpus(&gpus(), MemoryUnit::GIB)
}

struct Node {
    server: ApiServer,
    dir: tempfile::TempDir,
    config: PluginConfig,
    preparer: Arc<FilePreparer>,
    served: watch::Sender<Served>,
}

impl Node {
    fn start_plugin(&self) -> RunningPlugin {
        start(
            self.config.clone(),
            self.server.admin_client(),
            self.served.subscribe(),
            self.preparer.clone(),
            Shutdown::never(),
        )
        .expect("the plugin starts")
    }

    fn kubelet(&self) -> DraKubelet {
        DraKubelet::start(
            &self.config.registry_dir,
            "node-a",
            self.server.admin_client(),
        )
        .expect("the kubelet starts")
    }
}

/// A sandbox with the class, node-a's slice, and a rewritten pod `p` (3 + 1 units) placed.
async fn node() -> Node {
    let server = ApiServer::start().await.expect("starts");
    create_gpu_device_class(&server);
    for s in build_slices(
        "node-a",
        DRA_DRIVER_NAME,
        None,
        MemoryUnit::GIB,
        GpuPolicy::Binpack,
        &gpus(),
        &[],
        1,
    ) {
        server
            .create_object(serde_json::to_value(&s).expect("json"))
            .expect("the slice");
    }
    submit(&server, "p", 3, 1);
    crate::support::dra::allocate_one(&server).await;
    let dir = short_tempdir();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).expect("cdi dir");
    let config = PluginConfig {
        driver: DRA_DRIVER_NAME.into(),
        node: "node-a".into(),
        registry_dir: dir.path().join("registry"),
        plugin_dir: dir.path().join("plugin"),
        checkpoint: dir.path().join("state/checkpoint.json"),
        unit: MemoryUnit::GIB,
    };
    let preparer = Arc::new(FilePreparer {
        dir: cdi,
        prepared: AtomicUsize::new(0),
        log: Mutex::default(),
    });
    let (served, _) = watch::channel(served());
    Node {
        server,
        dir,
        config,
        preparer,
        served,
    }
}

fn pod_uid(server: &ApiServer) -> String {
    crate::support::objects::pod_uid(server, "p")
}

fn files(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

#[tokio::test]
async fn the_plugin_registers_prepares_once_survives_a_restart_and_unprepares_a_deleted_claim() {
    let node = node().await;
    let plugin = node.start_plugin();
    let kubelet = node.kubelet();
    let info = kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers");
    assert_eq!(info.versions, SERVICES);
    assert_eq!(info.endpoint, node.config.service_socket());
    assert_eq!(info.health_service.as_deref(), Some("v1.DRAResourceHealth"));
    let mut status = plugin.registration();
    tokio::time::timeout(Duration::from_secs(20), status.wait_for(|s| s.is_some()))
        .await
        .expect("kubelet answers in time")
        .expect("the channel is open");
    assert!(
        status
            .borrow()
            .as_ref()
            .is_some_and(|s| s.plugin_registered)
    );

    assert_eq!(kubelet.sync().await.expect("sync").prepared, ["default/p"]);
    let uid = pod_uid(&node.server);
    let claims = kubelet.prepared(&uid).expect("recorded");
    let ClaimOutcome::Prepared(devices) = &claims[0].outcome else {
        panic!("{claims:?}");
    };
    let by_request: Vec<(&str, &str)> = devices
        .iter()
        .map(|d| (d.request_names[0].as_str(), d.device.as_str()))
        .collect();
    let gpu = device_name(&gpus()[0]);
    assert_eq!(by_request, [("main", gpu.as_str()), ("side", gpu.as_str())]);
    assert!(
        devices
            .iter()
            .all(|d| d.share_id.is_some() && d.pool == "node-a")
    );
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("k8s.gpushare.io/claim={}-main", claims[0].uid)]
    );
    let spec: Value = serde_json::from_slice(
        &std::fs::read(node.preparer.spec(&claims[0].uid)).expect("the preparer wrote"),
    )
    .expect("json");
    assert_eq!(spec[0]["units"], 3);
    assert_eq!(spec[1]["units"], 1);

    // Idempotent: asked again, answered from the checkpoint without preparing again.
    let again = kubelet.prepare_pod("default", "p").await.expect("prepares");
    assert_eq!(again[0].outcome, claims[0].outcome);
    assert_eq!(node.preparer.prepared.load(Ordering::SeqCst), 1);
    let cp = Checkpoint::load(&node.config.checkpoint).expect("the checkpoint");
    assert!(cp.claims.contains_key(&claims[0].uid));

    // Health: an unhealthy GPU reaches kubelet as UNHEALTHY.
    node.served.send_modify(|s| {
        s.unhealthy.insert(gpu.clone(), "XID 79".into());
    });
    crate::support::dra_node::wait_device_health(&kubelet, &gpu, "UNHEALTHY", Some("XID 79")).await;

    // Restart: a new plugin process reads the checkpoint; the pod finishes and its claim is
    // deleted before kubelet unprepares: unprepare still works, from the checkpoint.
    drop(kubelet);
    drop(plugin);
    let _plugin = node.start_plugin();
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers again");
    let record = kubelet_record(&kubelet, &node).await;
    crate::support::dra_node::finish_and_unprepare(&node.server, &kubelet, "p", &uid).await;
    assert_eq!(*node.preparer.log.lock().expect("log"), [record]);
    assert_eq!(
        files(&node.dir.path().join("cdi")),
        0,
        "the spec is removed"
    );
    let cp = Checkpoint::load(&node.config.checkpoint).expect("the checkpoint");
    assert!(cp.claims.is_empty());
    assert_eq!(kubelet.prepared(&uid), None);
}

/// The new kubelet has no record of the pod: it prepares it (answered from the plugin's
/// checkpoint, nothing prepared twice) and returns the claim's uid.
async fn kubelet_record(kubelet: &DraKubelet, node: &Node) -> String {
    let claims = kubelet.prepare_pod("default", "p").await.expect("prepares");
    assert!(matches!(claims[0].outcome, ClaimOutcome::Prepared(_)));
    assert_eq!(node.preparer.prepared.load(Ordering::SeqCst), 1);
    claims[0].uid.clone()
}

/// Python grpcio as the kubelet, with the upstream protos: registration, prepare of a good
/// claim next to a claim of a device not on this node (its own error; the good one prepared),
/// health, unprepare; over v1 with the socket path as `:authority` and over v1beta1 with
/// `localhost`.
#[tokio::test]
async fn grpcio_kubelet_drives_the_plugin_with_per_claim_errors() {
    let Some(python) = clients::grpcio_python() else {
        return;
    };
    let node = node().await;
    // A claim allocated on a device this node does not publish.
    let stray = node
        .server
        .create_object(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": "stray", "namespace": "default" },
            "spec": { "devices": { "requests": [{ "name": "r", "exactly": { "deviceClassName": DRA_DEVICE_CLASS } }] } },
            "status": { "allocation": { "devices": { "results": [
                { "request": "r", "driver": DRA_DRIVER_NAME, "pool": "node-a", "device": "gpu-gone" }] } } },
        }))
        .expect("the stray claim");
    let stray_uid = stray["metadata"]["uid"].as_str().expect("uid").to_string();
    let (name, uid) = dra::pod_claim(&node.server, "p");
    let _plugin = node.start_plugin();
    for (authority, api) in [("path", "v1"), ("localhost", "v1beta1")] {
        let claims = [
            format!("default/{uid}/{name}"),
            format!("default/{stray_uid}/stray"),
        ];
        let args = clients::grpcio_round(authority, &["--api", api], &[&claims[0], &claims[1]]);
        let report =
            clients::dra_kubelet_grpcio(&python, &node.config.registration_socket(), &args).await;
        assert_eq!(report["info"]["type"], "DRAPlugin");
        assert_eq!(report["info"]["name"], DRA_DRIVER_NAME);
        assert_eq!(report["info"]["supported_versions"], json!(SERVICES));
        let good = &report["prepare"][&uid];
        assert_eq!(good["error"], "", "{report}");
        assert_eq!(good["devices"].as_array().map(Vec::len), Some(2));
        assert_eq!(good["devices"][0]["request_names"], json!(["main"]));
        assert_eq!(
            good["devices"][0]["share_id"].is_string(),
            api == "v1",
            "{report}"
        );
        let bad = report["prepare"][&stray_uid]["error"]
            .as_str()
            .unwrap_or("");
        assert!(
            bad.contains("gpu-gone") && bad.contains("not on this node"),
            "{report}"
        );
        assert_eq!(report["health_api"], "health_v1");
        assert_eq!(report["health"].as_array().map(Vec::len), Some(2));
        assert!(
            report["health"]
                .as_array()
                .is_some_and(|h| h.iter().all(|d| d["health"] == "HEALTHY"))
        );
        assert_eq!(report["unprepare"][&uid], "");
        assert_eq!(report["unprepare"][&stray_uid], "");
    }
    // Both rounds prepared and unprepared the good claim; the stray one was never prepared.
    assert_eq!(node.preparer.prepared.load(Ordering::SeqCst), 2);
    assert_eq!(files(&node.dir.path().join("cdi")), 0);
}

/// The slices of a node reach the API and follow its changes; slices of other nodes and
/// drivers are left alone; a pass whose create answer was lost is settled by reading.
#[tokio::test]
async fn slices_are_published_updated_and_deleted_by_one_reconciling_pass() {
    use gpushare::dra::publish::{Published, sync_slices};
    use gpushare_sandbox::apiserver::{Fault, FaultAction};
    use k8s_openapi::api::resource::v1::ResourceSlice;

    let server = ApiServer::start().await.expect("starts");
    let client = server.admin_client();
    let other = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": "node-b-gpushare-io-0" },
        "spec": { "driver": DRA_DRIVER_NAME, "nodeName": "node-b",
                  "pool": { "name": "node-b", "generation": 1, "resourceSliceCount": 1 }, "devices": [] },
    });
    server.create_object(other).expect("another node's slice");
    let slices = |generation, gpus: &[SliceGpu]| {
        build_slices(
            "node-a",
            DRA_DRIVER_NAME,
            None,
            MemoryUnit::GIB,
            GpuPolicy::Binpack,
            gpus,
            &[],
            generation,
        )
    };
    // The create lands but its answer is lost: the retried pass finds the slice.
    server.inject(Fault::new(
        Some(http::Method::POST),
        "/resourceslices",
        FaultAction::ApplyThenDrop,
    ));
    let first = sync_slices(&client, "node-a", DRA_DRIVER_NAME, &slices(1, &gpus()))
        .await
        .expect("published");
    assert_eq!(
        first,
        Published::default(),
        "the retried pass read what had landed"
    );
    let posts = server
        .requests()
        .iter()
        .filter(|r| r.method == http::Method::POST && r.path.ends_with("/resourceslices"))
        .count();
    assert_eq!(posts, 1, "one create, never a second");
    let stored: ResourceSlice = server
        .get_as("resourceslices", None, "node-a-gpushare-io-0")
        .expect("stored");
    assert_eq!(stored.spec.devices.as_ref().map(Vec::len), Some(2));
    let again = sync_slices(&client, "node-a", DRA_DRIVER_NAME, &slices(1, &gpus()))
        .await
        .expect("published");
    assert_eq!(
        again,
        Published::default(),
        "nothing changed, nothing written"
    );
    let mut sick = gpus();
    sick[1].unhealthy = Some("xid".into());
    let changed = sync_slices(&client, "node-a", DRA_DRIVER_NAME, &slices(2, &sick))
        .await
        .expect("published");
    assert_eq!(changed.updated, 1);
    let stored: ResourceSlice = server
        .get_as("resourceslices", None, "node-a-gpushare-io-0")
        .expect("stored");
    assert_eq!(stored.spec.pool.generation, 2);
    let gone = sync_slices(&client, "node-a", DRA_DRIVER_NAME, &[])
        .await
        .expect("published");
    assert_eq!(gone.deleted, 1);
    assert!(
        server
            .get_object("resourceslices", None, "node-a-gpushare-io-0")
            .is_none()
    );
    assert!(
        server
            .get_object("resourceslices", None, "node-b-gpushare-io-0")
            .is_some()
    );
}

/// Python grpcio prepares, the plugin restarts, the claim is deleted, grpcio unprepares: the
/// new plugin process undoes the claim from its checkpoint.
#[tokio::test]
async fn grpcio_unprepares_after_a_plugin_restart_and_the_claim_is_gone() {
    let Some(python) = clients::grpcio_python() else {
        return;
    };
    let node = node().await;
    let (name, uid) = dra::pod_claim(&node.server, "p");
    let socket = node.config.registration_socket();
    let claim = format!("default/{uid}/{name}");
    let kubelet = |step: &'static str| {
        let args = [step, "--claim", &claim].map(str::to_string);
        let (python, socket) = (python.clone(), socket.clone());
        async move { clients::dra_kubelet_grpcio(&python, &socket, &args).await }
    };
    let plugin = node.start_plugin();
    let report = kubelet("--prepare").await;
    assert_eq!(report["prepare"][&uid]["error"], "", "{report}");
    drop(plugin);
    node.server
        .delete_object("resourceclaims", Some("default"), &name)
        .expect("the claim is deleted");
    let _plugin = node.start_plugin();
    let report = kubelet("--unprepare").await;
    assert_eq!(report["unprepare"][&uid], "", "{report}");
    assert_eq!(
        *node.preparer.log.lock().expect("log"),
        std::slice::from_ref(&uid),
        "the restarted plugin undid the claim"
    );
    assert_eq!(files(&node.dir.path().join("cdi")), 0);
    assert!(
        Checkpoint::load(&node.config.checkpoint)
            .expect("the checkpoint")
            .claims
            .is_empty()
    );
}
