//! The DRA plugin (`gpushare dra-plugin`, in-process on fake GPUs) under the faults a node
//! meets: a claim read that hangs (fault injection's `Hold`) holds up no other claim, and
//! gives up within its deadline; consumption that overflows 64 bits, is sub-unit or zero;
//! an unprepare whose result cannot be recorded; a restart that finds records of claims the
//! API no longer has and specs no record knows; a changed `--cdi-dir`; a fatal Xid across a
//! restart; a registration socket removed under the plugin.

use std::time::Duration;

use gpushare::core::wire::DRA_DRIVER_NAME;
use gpushare::dra::role::DraPluginHandle;
use gpushare::gpu::HealthEvent;
use gpushare::gpu::fake::{FakeBackend, fake_uuid};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, Hold};
use gpushare_sandbox::dra_kubelet::{ClaimOutcome, DraKubelet, PreparedClaim};
use serde_json::{Value, json};

use crate::support::dra;
use crate::support::dra_node::{NODE, Node, node, node_with, spec_file, submit};
use crate::support::wait::{eventually, wait_until};

/// A claim `default/<name>` allocated by hand on this node's devices: `(device, consumed
/// memory)` per result (`None`: no `consumedCapacity`, the whole device). Its uid.
fn allocated_claim(api: &ApiServer, name: &str, results: &[(&str, Option<&str>)]) -> String {
    let results: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (device, memory))| {
            let mut r = json!({
                "request": format!("r{i}"), "driver": DRA_DRIVER_NAME, "pool": NODE,
                "device": device, "shareID": format!("{name}-{i}"),
            });
            if let Some(m) = memory {
                r["consumedCapacity"] = json!({ "memory": m });
            }
            r
        })
        .collect();
    let stored = api
        .create_object(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "devices": { "requests": [] } },
            "status": { "allocation": { "devices": { "results": results } } },
        }))
        .expect("the claim");
    stored["metadata"]["uid"].as_str().expect("uid").to_string()
}

/// The device name of GPU `index` as the plugin serves it.
fn gpu_device(plugin: &DraPluginHandle, index: u32) -> String {
    plugin
        .served()
        .borrow()
        .devices
        .iter()
        .find(|(_, d)| d.index == index)
        .map(|(n, _)| n.clone())
        .expect("the GPU is served")
}

/// `(default, uid, name)` of a claim, as kubelet names it.
fn claim_ref(uid: &str, name: &str) -> (String, String, String) {
    ("default".to_string(), uid.to_string(), name.to_string())
}

/// Prepares one claim by a direct kubelet call (nothing read by the kubelet itself).
async fn prepare(kubelet: &DraKubelet, uid: &str, name: &str) -> ClaimOutcome {
    let mut answered = kubelet
        .prepare_claims(DRA_DRIVER_NAME, &[claim_ref(uid, name)])
        .await
        .expect("the plugin answers");
    answered.pop().expect("one claim").outcome
}

/// Unprepares one claim by a direct kubelet call; its error (empty when done).
async fn unprepare(kubelet: &DraKubelet, uid: &str, name: &str) -> String {
    let answers = kubelet
        .unprepare_claims(DRA_DRIVER_NAME, &[claim_ref(uid, name)])
        .await
        .expect("the plugin answers");
    answers.get(uid).cloned().expect("an answer for the claim")
}

/// The role started and registered with the sandbox kubelet.
async fn started(node: &Node) -> (DraPluginHandle, DraKubelet) {
    let plugin = node.start().await;
    dra::published(&plugin).await;
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers");
    (plugin, kubelet)
}

/// The envs of CDI device `n` of claim `uid`'s spec.
fn spec_env(node: &Node, uid: &str, n: usize) -> Vec<String> {
    let spec: Value = serde_json::from_slice(
        &std::fs::read(spec_file(&node.cdi_dir(), uid)).expect("the spec is written"),
    )
    .expect("json");
    spec["devices"][n]["containerEdits"]["env"]
        .as_array()
        .expect("envs")
        .iter()
        .filter_map(|e| e.as_str().map(str::to_string))
        .collect()
}

fn recorded(node: &Node) -> Value {
    serde_json::from_slice(&std::fs::read(node.checkpoint()).expect("the checkpoint"))
        .expect("json")
}

// ---------------------------------------------------------------- a hung claim read

/// One claim's read hangs (a GET held at the API server): a prepare of another claim and an
/// unprepare of a third are answered while it still hangs; once let through, the first is
/// prepared too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_claim_read_holds_up_no_other_prepare_or_unprepare() {
    let node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let a = allocated_claim(&node.api, "a", &[(&gpu0, Some("1Gi"))]);
    let b = allocated_claim(&node.api, "b", &[(&gpu0, Some("1Gi"))]);
    let c = allocated_claim(&node.api, "c", &[(&gpu0, Some("1Gi"))]);
    assert!(matches!(
        prepare(&kubelet, &c, "c").await,
        ClaimOutcome::Prepared(_)
    ));

    let hold = Hold::new();
    node.api.inject(Fault::new(
        Some(http::Method::GET),
        "/resourceclaims/a",
        FaultAction::Hold(hold.clone()),
    ));
    let hung = {
        let kubelet = kubelet.clone();
        let a = a.clone();
        tokio::spawn(async move { prepare(&kubelet, &a, "a").await })
    };
    hold.wait_reached(1).await;

    let others = async {
        let b = prepare(&kubelet, &b, "b").await;
        let c = unprepare(&kubelet, &c, "c").await;
        (b, c)
    };
    let (b_answer, c_answer) = tokio::time::timeout(Duration::from_secs(30), others)
        .await
        .expect("the other claims are answered while claim a's read hangs");
    assert!(
        matches!(b_answer, ClaimOutcome::Prepared(_)),
        "{b_answer:?}"
    );
    assert_eq!(c_answer, "");
    assert!(!hung.is_finished(), "claim a's read still hangs");

    hold.release();
    let a_answer = hung.await.expect("the hung prepare ends");
    assert!(
        matches!(a_answer, ClaimOutcome::Prepared(_)),
        "{a_answer:?}"
    );
    plugin.stop().await;
}

/// A claim read that never answers fails that claim within the read's deadline, with an
/// error kubelet retries on; nothing is recorded for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_read_that_never_answers_fails_the_claim_within_its_deadline() {
    let node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let a = allocated_claim(&node.api, "a", &[(&gpu0, Some("1Gi"))]);
    let hold = Hold::new();
    node.api.inject(Fault::new(
        Some(http::Method::GET),
        "/resourceclaims/a",
        FaultAction::Hold(hold.clone()),
    ));
    let answer = prepare(&kubelet, &a, "a").await;
    let ClaimOutcome::Failed(why) = &answer else {
        panic!("{answer:?}");
    };
    assert!(
        why.contains("reading ResourceClaim default/a") && why.contains("no answer"),
        "{why}"
    );
    assert!(!spec_file(&node.cdi_dir(), &a).exists());
    hold.release();
    assert!(matches!(
        prepare(&kubelet, &a, "a").await,
        ClaimOutcome::Prepared(_)
    ));
    plugin.stop().await;
}

// ---------------------------------------------------------------- arithmetic

/// A claim whose consumption adds up past 64 bits (2 × i64::MAX + 2 bytes, which wraps to 0
/// in unchecked arithmetic) is refused by name; the GPU stays free for a whole-GPU claim,
/// and a second one is refused as over-consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumption_past_64_bits_is_refused_by_name_and_admits_no_over_commit() {
    let node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let max = i64::MAX.to_string();
    let huge = allocated_claim(
        &node.api,
        "huge",
        &[(&gpu0, Some(&max)), (&gpu0, Some(&max)), (&gpu0, Some("2"))],
    );
    let answer = prepare(&kubelet, &huge, "huge").await;
    let ClaimOutcome::Failed(why) = &answer else {
        panic!("an overflowing claim was prepared: {answer:?}");
    };
    assert!(why.contains("default/huge") && why.contains(&gpu0), "{why}");
    let whole = allocated_claim(&node.api, "whole", &[(&gpu0, None)]);
    assert!(matches!(
        prepare(&kubelet, &whole, "whole").await,
        ClaimOutcome::Prepared(_)
    ));
    let more = allocated_claim(&node.api, "more", &[(&gpu0, Some("1Gi"))]);
    let answer = prepare(&kubelet, &more, "more").await;
    let ClaimOutcome::Failed(why) = &answer else {
        panic!("over-committed: {answer:?}");
    };
    assert!(why.contains("over-consumed"), "{why}");
    plugin.stop().await;
}

/// A sub-unit or zero consumption is handed out as upstream's allocator would have allocated
/// it from the slice's policy (min and step one unit): one unit, never a limit of 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_unit_and_zero_consumption_are_one_unit_never_a_zero_limit() {
    let node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let small = allocated_claim(
        &node.api,
        "small",
        &[
            (&gpu0, Some("1")),
            (&gpu0, Some("0")),
            (&gpu0, Some("1536Mi")),
        ],
    );
    assert!(matches!(
        prepare(&kubelet, &small, "small").await,
        ClaimOutcome::Prepared(_)
    ));
    for (n, units) in [(0, "1"), (1, "1"), (2, "2")] {
        let env = spec_env(&node, &small, n);
        let want = format!("ALIYUN_COM_GPU_MEM_CONTAINER={units}");
        assert!(env.contains(&want), "device {n}: {want} in {env:?}");
    }
    assert!(
        spec_env(&node, &small, 0).contains(&"ALIYUN_COM_GPU_MEM_POD=4".to_string()),
        "{:?}",
        spec_env(&node, &small, 0)
    );
    plugin.stop().await;
}

// ---------------------------------------------------------------- recording and restarts

/// Replaces the state directory by a file, so that no checkpoint can be saved; the returned
/// guard puts it back.
struct BrokenState {
    dir: std::path::PathBuf,
    moved: std::path::PathBuf,
}

impl BrokenState {
    fn new(node: &Node) -> BrokenState {
        let dir = node.config.dra.state_dir.clone();
        let moved = dir.with_extension("moved");
        std::fs::rename(&dir, &moved).expect("the state dir moved away");
        std::fs::write(&dir, b"not a directory").expect("a file in its place");
        BrokenState { dir, moved }
    }

    fn repair(self) {
        std::fs::remove_file(&self.dir).expect("the file removed");
        std::fs::rename(&self.moved, &self.dir).expect("the state dir back");
    }
}

/// An unprepare whose result cannot be saved answers an error (kubelet retries), and the
/// record stays; the retry, once the checkpoint can be saved, records it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unprepare_that_cannot_be_recorded_answers_an_error_and_its_retry_records_it() {
    let node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let a = allocated_claim(&node.api, "a", &[(&gpu0, Some("4Gi"))]);
    assert!(matches!(
        prepare(&kubelet, &a, "a").await,
        ClaimOutcome::Prepared(_)
    ));
    let broken = BrokenState::new(&node);
    let error = unprepare(&kubelet, &a, "a").await;
    assert!(
        error.contains("not recorded"),
        "an unrecorded unprepare answered {error:?}"
    );
    broken.repair();
    assert!(
        recorded(&node)["claims"].get(&a).is_some(),
        "still recorded on disk"
    );
    assert_eq!(unprepare(&kubelet, &a, "a").await, "");
    assert!(
        recorded(&node)["claims"].get(&a).is_none(),
        "the retry recorded it"
    );
    assert!(!spec_file(&node.cdi_dir(), &a).exists());
    plugin.stop().await;
}

/// A restart finds a record of a claim the API no longer has (its unprepare was lost) and a
/// spec no record knows: both are undone, so a whole-GPU claim allocated on the freed GPU is
/// prepared, not refused as over-consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_forgets_claims_the_api_no_longer_has_and_specs_no_record_knows() {
    let node = node_with("1x16GiB", |_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let gone = allocated_claim(&node.api, "gone", &[(&gpu0, None)]);
    assert!(matches!(
        prepare(&kubelet, &gone, "gone").await,
        ClaimOutcome::Prepared(_)
    ));
    plugin.stop().await;
    node.api
        .delete_object("resourceclaims", Some("default"), "gone")
        .expect("the claim is deleted");
    let orphan = spec_file(&node.cdi_dir(), "0000-orphan");
    std::fs::copy(spec_file(&node.cdi_dir(), &gone), &orphan).expect("an orphan spec");

    drop(kubelet);
    let (plugin, kubelet) = started(&node).await;
    let whole = allocated_claim(&node.api, "whole", &[(&gpu0, None)]);
    eventually("the whole-GPU claim is prepared", || async {
        matches!(
            prepare(&kubelet, &whole, "whole").await,
            ClaimOutcome::Prepared(_)
        )
    })
    .await;
    wait_until("the stale spec and the orphan removed", || {
        !spec_file(&node.cdi_dir(), &gone).exists() && !orphan.exists()
    })
    .await;
    assert!(recorded(&node)["claims"].get(&gone).is_none());
    plugin.stop().await;
}

/// `--cdi-dir` changed across a restart: a recorded claim is answered with a spec written in
/// the new directory (the old one removed), and its unprepare leaves nothing in either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_cdi_dir_moves_a_recorded_claims_spec_and_unprepare_leaves_none() {
    let mut node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    let gpu0 = gpu_device(&plugin, 0);
    let a = allocated_claim(&node.api, "a", &[(&gpu0, Some("2Gi"))]);
    let before = prepare(&kubelet, &a, "a").await;
    assert!(matches!(before, ClaimOutcome::Prepared(_)));
    let old = spec_file(&node.cdi_dir(), &a);
    assert!(old.exists());
    plugin.stop().await;

    node.config.dra.cdi_dir = node.dir.path().join("cdi-new");
    drop(kubelet);
    let (plugin, kubelet) = started(&node).await;
    let again = prepare(&kubelet, &a, "a").await;
    assert_eq!(again, before, "the same CDI ids");
    let new = spec_file(&node.cdi_dir(), &a);
    assert!(new.exists(), "the spec is in the new CDI directory");
    assert!(!old.exists(), "the old spec is removed");
    assert_eq!(unprepare(&kubelet, &a, "a").await, "");
    assert!(!new.exists() && !old.exists(), "nothing leaks");
    plugin.stop().await;
}

/// A fatal Xid (79: fallen off the bus) is kept beside the checkpoint: a restarted plugin
/// still taints the GPU; once the GPU left the node, the record is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_xid_survives_a_restart_until_the_gpu_leaves() {
    let node = node(|c| c.node.health_recovery_secs = 1).await;
    let (plugin, _kubelet) = started(&node).await;
    wait_until("the health watcher", || node.health.subscribers() > 0).await;
    let gpu1 = gpu_device(&plugin, 1);
    node.health.inject(HealthEvent::Xid {
        uuid: Some(fake_uuid(1)),
        xid: 79,
    });
    let tainted = |devices: &[Value]| {
        devices.iter().any(|d| {
            d["name"] == gpu1.as_str()
                && d["taints"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["value"] == "xid-79"))
        })
    };
    wait_until("the taint on GPU 1", || tainted(&node.slice_devices())).await;
    plugin.stop().await;

    // Restarted: still down, and not only on the slice left behind.
    let plugin = node.start().await;
    wait_until("published again", || {
        *plugin.published_generation().borrow() >= 1
    })
    .await;
    assert_eq!(
        plugin
            .served()
            .borrow()
            .unhealthy
            .get(&gpu1)
            .map(String::as_str),
        Some("xid-79"),
        "the fatal Xid is remembered"
    );
    assert!(tainted(&node.slice_devices()));
    plugin.stop().await;

    // GPU 1 leaves the node: forgotten; when a GPU comes back with that UUID it is healthy.
    let one = FakeBackend::from_spec("1x16GiB").expect("fake GPUs");
    let backend: std::sync::Arc<dyn gpushare::gpu::GpuBackend> = std::sync::Arc::new(one);
    let plugin = gpushare::dra::role::start(
        &node.config,
        node.api.admin_client(),
        backend,
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("starts on one GPU");
    plugin.stop().await;
    let plugin = node.start().await;
    assert!(
        plugin.served().borrow().unhealthy.is_empty(),
        "{:?}",
        plugin.served().borrow().unhealthy
    );
    plugin.stop().await;
}

// ---------------------------------------------------------------- registration

/// The registration socket removed under a running plugin (a clean-up, a kubelet that wiped
/// its registry): the plugin is not ready while kubelet has no registration, serves the
/// socket again, and is ready once kubelet registered it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_registration_socket_is_served_again_and_readiness_follows() {
    let node = node(|_| {}).await;
    let (plugin, kubelet) = started(&node).await;
    wait_until("ready", || plugin.is_ready()).await;
    let socket = plugin.registration_socket().to_path_buf();
    let registry = node.config.dra.registry_dir.clone();
    // The socket removed, and its directory kept from being used for a while (a file in its
    // place), so that the time without a registration can be seen.
    std::fs::remove_file(&socket).expect("the socket removed");
    let moved = registry.with_extension("moved");
    std::fs::rename(&registry, &moved).expect("the registry moved away");
    std::fs::write(&registry, b"not a directory").expect("a file in its place");
    wait_until("not ready without a registration", || !plugin.is_ready()).await;
    std::fs::remove_file(&registry).expect("the file removed");
    std::fs::rename(&moved, &registry).expect("the registry back");
    wait_until("the socket is served again", || socket.exists()).await;
    kubelet
        .wait_plugins("registered again", |ps| {
            ps.iter().any(|p| {
                p.driver == DRA_DRIVER_NAME && p.registered && p.registration_socket == socket
            })
        })
        .await
        .expect("kubelet registers the plugin again");
    wait_until("ready again", || plugin.is_ready()).await;
    submit(&node.api, "p", 1, 1);
    crate::support::dra::allocate_one(&node.api).await;
    let claims: Vec<PreparedClaim> = kubelet.prepare_pod("default", "p").await.expect("answers");
    assert!(
        matches!(claims[0].outcome, ClaimOutcome::Prepared(_)),
        "{claims:?}"
    );
    plugin.stop().await;
}
