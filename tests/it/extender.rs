//! The scheduler extender over real HTTP, against the sandbox API server: the spec's demos
//! A1–A4, restart rebuild, node changes, pods deleted mid-bind, injected API faults, 200
//! concurrent binds, and hostile input.
//!
//! No sleeps as synchronisation: readiness through `wait_ready`, ledger convergence by polling
//! `/inspect` (or the API server) against a deadline.

use std::collections::BTreeMap;
use std::time::Duration;

use gpushare::extender;
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};
use http::Method;
use serde_json::{Value, json};

use crate::support::extender_http::{get, inspect, post, request};
use crate::support::extender_sandbox::{
    Env, annotations, bind, binding_fault, config, create, filter, used,
};
use crate::support::objects::{bound_pod, gpu_node, pending_pod};
use crate::support::wait::eventually;

const MIB_GPU: u64 = 16276;

// ---------------------------------------------------------------- spec demos

/// A1 + A2: three half-GPU pods binpack onto GPU0, GPU0, GPU1; a whole-GPU pod then fits the
/// node in aggregate but no single GPU.
#[tokio::test]
async fn demo_a1_a2_binpack_then_no_single_gpu_fits() {
    let env = Env::with_nodes(config(), &[("n1", 2, MIB_GPU)]).await;
    let mut gpus = Vec::new();
    for i in 1..=3 {
        let p = create(&env.api, pending_pod(&format!("binpack-{i}"), "8138"));
        let (s, r) = filter(env.addr(), &p, &["n1"]).await;
        assert_eq!(s, 200);
        assert_eq!(r["NodeNames"], json!(["n1"]), "{r}");
        assert_eq!(r["Nodes"], Value::Null);
        assert_eq!(r["Error"], "");
        let (s, r) = bind(env.addr(), &p, "n1").await;
        assert_eq!((s, &r), (200, &json!({"Error": ""})));
        let a = annotations(&env.api, &format!("binpack-{i}"));
        assert_eq!(a["ALIYUN_COM_GPU_MEM_POD"], "8138");
        assert_eq!(a["ALIYUN_COM_GPU_MEM_DEV"], MIB_GPU.to_string());
        assert_eq!(a["ALIYUN_COM_GPU_MEM_ASSIGNED"], "false");
        assert!(
            a["ALIYUN_COM_GPU_MEM_ASSUME_TIME"].parse::<u64>().unwrap() > 1_000_000_000_000_000_000
        );
        gpus.push(a["ALIYUN_COM_GPU_MEM_IDX"].clone());
        let bound = env
            .api
            .get_object("pods", Some("default"), &format!("binpack-{i}"))
            .unwrap();
        assert_eq!(bound["spec"]["nodeName"], "n1");
    }
    assert_eq!(gpus, ["0", "0", "1"]);
    let i = inspect(env.addr()).await;
    assert_eq!(used(&i, "n1"), [16276, 8138]);
    assert_eq!(i["nodes"][0]["totalGPU"], 32552);
    assert_eq!(i["nodes"][0]["usedGPU"], 24414);
    let names: Vec<&str> = i["nodes"][0]["devs"][0]["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["binpack-1", "binpack-2"]);

    // A2: 8138 free on each GPU, 16276 requested.
    let p4 = create(&env.api, pending_pod("binpack-4", "16276"));
    let (s, r) = filter(env.addr(), &p4, &["n1"]).await;
    assert_eq!(s, 200);
    assert_eq!(r["NodeNames"], json!([]));
    assert_eq!(
        r["FailedNodes"],
        json!({"n1": "Insufficient GPU Memory in one device"})
    );
    assert_eq!(r["FailedAndUnresolvableNodes"], Value::Null);
    // Bind re-checks and refuses with 500, leaving the ledger alone.
    let (s, r) = bind(env.addr(), &p4, "n1").await;
    assert_eq!(s, 500);
    assert!(
        r["Error"]
            .as_str()
            .unwrap()
            .contains("Insufficient GPU Memory"),
        "{r}"
    );
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [16276, 8138]);

    // Events tell which GPU each pod got.
    eventually("GpuShareBound events", || async {
        env.api
            .list_objects("events.events.k8s.io", Some("default"))
            .iter()
            .filter(|e| e["reason"] == "GpuShareBound")
            .count()
            == 3
    })
    .await;
    let events = env
        .api
        .list_objects("events.events.k8s.io", Some("default"));
    assert!(events.iter().any(|e| {
        e["reason"] == "GpuShareBound"
            && e["regarding"]["name"] == "binpack-3"
            && e["reportingController"] == "gpushare-schd-extender"
            && e["note"]
                .as_str()
                .unwrap()
                .starts_with("assigned GPU 1 (8138")
    }));
    env.ext.stop().await;
}

/// A3: N2 has 4069 free per GPU, N3 8138 free on GPU0; N1 is not a GPU node.
#[tokio::test]
async fn demo_a3_filter_by_names_and_by_node_objects() {
    let env = Env::start_with(config(), |api| {
        create(api, gpu_node("n1", 0, 0));
        create(api, gpu_node("n2", 2, MIB_GPU));
        create(api, gpu_node("n3", 2, MIB_GPU));
        create(api, bound_pod("n2-a", "n2", 0, 12207, MIB_GPU));
        create(api, bound_pod("n2-b", "n2", 1, 12207, MIB_GPU));
        create(api, bound_pod("n3-a", "n3", 0, 8138, MIB_GPU));
        create(api, bound_pod("n3-b", "n3", 1, 16276, MIB_GPU));
    })
    .await;
    let p = create(&env.api, pending_pod("want", "8138"));
    let (s, r) = filter(env.addr(), &p, &["n1", "n2", "n3", "nowhere"]).await;
    assert_eq!(s, 200);
    assert_eq!(r["NodeNames"], json!(["n3"]));
    assert_eq!(
        r["FailedNodes"],
        json!({
            "n1": "The node n1 is not for GPU share, need skip",
            "n2": "Insufficient GPU Memory in one device",
            "nowhere": "The node nowhere is not for GPU share, need skip",
        })
    );
    // With node objects: the passing objects come back as given, NodeNames is null.
    let n2 = env.api.get_object("nodes", None, "n2").unwrap();
    let mut n3 = env.api.get_object("nodes", None, "n3").unwrap();
    n3["metadata"]["labels"] = json!({"marker": "kept"});
    let (s, r) = post(
        env.addr(),
        "/gpushare-scheduler/filter",
        &json!({"pod": p, "nodes": {"metadata": {}, "items": [n2, n3]}}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(r["NodeNames"], Value::Null);
    assert_eq!(r["Nodes"]["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        r["Nodes"]["items"][0]["metadata"]["labels"]["marker"],
        "kept"
    );
    // A request larger than any GPU cannot be helped by preemption.
    let big = create(&env.api, pending_pod("big", "20000"));
    let (_, r) = filter(env.addr(), &big, &["n3"]).await;
    assert_eq!(r["FailedNodes"], json!({}));
    assert!(
        r["FailedAndUnresolvableNodes"]["n3"]
            .as_str()
            .unwrap()
            .starts_with("Insufficient GPU Memory in one device")
    );
    // Prioritize: binpack prefers the fuller node among those that fit.
    create(&env.api, gpu_node("n4", 2, MIB_GPU));
    env.wait_used("N4 in the ledger", "n4", &[0, 0]).await;
    let (s, r) = post(
        env.addr(),
        "/gpushare-scheduler/prioritize",
        &json!({"Pod": p, "NodeNames": ["n2", "n3", "n4"]}),
    )
    .await;
    assert_eq!(s, 200);
    let scores: BTreeMap<String, i64> = r
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["Host"].as_str().unwrap().to_string(),
                h["Score"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(scores["n2"], 0, "does not fit");
    assert!(scores["n3"] > scores["n4"], "{scores:?}");
    assert!(scores.values().all(|s| (0..=10).contains(s)));
    env.ext.stop().await;
}

/// A4: free {0:12207, 1:8138, 2:4069, 3:16276}, request 8138 ⇒ GPU 1.
#[tokio::test]
async fn demo_a4_bind_best_fit() {
    let env = Env::start_with(config(), |api| {
        create(api, gpu_node("n1", 4, MIB_GPU));
        create(api, bound_pod("a", "n1", 0, 4069, MIB_GPU));
        create(api, bound_pod("b", "n1", 1, 8138, MIB_GPU));
        create(api, bound_pod("c", "n1", 2, 12207, MIB_GPU));
    })
    .await;
    let p = create(&env.api, pending_pod("want", "8138"));
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!((s, r), (200, json!({"Error": ""})));
    let a = annotations(&env.api, "want");
    assert_eq!(a["ALIYUN_COM_GPU_MEM_IDX"], "1");
    assert_eq!(a["ALIYUN_COM_GPU_MEM_POD"], "8138");
    assert_eq!(a["ALIYUN_COM_GPU_MEM_DEV"], "16276");
    assert_eq!(a["ALIYUN_COM_GPU_MEM_ASSIGNED"], "false");
    // The annotation patch is a merge patch, the binding carries the UID.
    let reqs = env.api.requests();
    let patch = reqs
        .iter()
        .find(|r| r.method == Method::PATCH && r.path.ends_with("/pods/want"))
        .expect("a patch of the pod");
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    let binding = reqs
        .iter()
        .find(|r| r.method == Method::POST && r.path.ends_with("/pods/want/binding"))
        .expect("a binding");
    let body: Value = serde_json::from_str(&binding.body).unwrap();
    assert_eq!(body["metadata"]["uid"], p["metadata"]["uid"]);
    assert_eq!(body["target"]["name"], "n1");
    assert_eq!(
        used(&inspect(env.addr()).await, "n1"),
        [4069, 16276, 12207, 0]
    );
    env.ext.stop().await;
}

// ---------------------------------------------------------------- ledger life cycle

#[tokio::test]
async fn a_restarted_extender_rebuilds_the_same_ledger_from_annotations() {
    let env = Env::with_nodes(config(), &[("n1", 2, 16), ("n2", 4, 16)]).await;
    for (i, (mem, node)) in [(3, "n1"), (5, "n1"), (16, "n2"), (7, "n2"), (9, "n1")]
        .iter()
        .enumerate()
    {
        let p = create(&env.api, pending_pod(&format!("p{i}"), mem));
        assert_eq!(bind(env.addr(), &p, node).await.0, 200);
    }
    // The device plugin assigned one of them.
    let patch = json!({"metadata": {"annotations": {"ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}}});
    gpushare::k8s::write::patch_pod_annotations(
        &env.api.admin_client(),
        "default",
        "p0",
        &serde_json::from_value(patch["metadata"]["annotations"].clone()).unwrap(),
    )
    .await
    .unwrap();
    let first = env.ext.addr;
    eventually("p0 assigned in the ledger", || async {
        inspect(first).await.to_string().contains("\"assigned\"")
    })
    .await;
    let before = inspect(first).await;
    let second = env.another().await;
    let after = inspect(second.addr).await;
    assert_eq!(before, after);
    assert_eq!(used(&after, "n1"), [8, 9]);
    assert_eq!(used(&after, "n2"), [16, 7, 0, 0]);
    second.stop().await;
    env.ext.stop().await;
}

#[tokio::test]
async fn node_capacity_changes_are_picked_up() {
    let env = Env::with_nodes(config(), &[("n1", 2, 16)]).await;
    let p = create(&env.api, pending_pod("p", "12"));
    assert_eq!(bind(env.addr(), &p, "n1").await.0, 200);
    // The cards were swapped for four 24 GiB ones (EXT#191).
    let client = env.api.admin_client();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client);
    let patch =
        json!({"status": {"capacity": {"aliyun.com/gpu-mem": "96", "aliyun.com/gpu-count": "4"}}});
    nodes
        .patch_status(
            "n1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    env.wait_used("four GPUs", "n1", &[12, 0, 0, 0]).await;
    let i = inspect(env.addr()).await;
    assert_eq!(i["nodes"][0]["devs"][0]["totalGPU"], 24);
    let big = create(&env.api, pending_pod("big", "20"));
    assert_eq!(
        filter(env.addr(), &big, &["n1"]).await.1["NodeNames"],
        json!(["n1"])
    );
    // A GPU reported unhealthy through the upstream ConfigMap is skipped; bad entries ignored.
    create(
        &env.api,
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "unhealthy-gpu-n1", "namespace": "kube-system"},
               "data": {"gpus": "1,2,3,zero"}}),
    );
    eventually("GPUs 1-3 unhealthy", || async {
        let i = inspect(env.addr()).await;
        i["nodes"][0]["devs"][0]["healthy"] == true && i["nodes"][0]["devs"][3]["healthy"] == false
    })
    .await;
    let (_, r) = filter(env.addr(), &big, &["n1"]).await;
    assert_eq!(
        r["FailedNodes"]["n1"], "Insufficient GPU Memory in one device",
        "{r}"
    );
    env.api
        .delete_object("configmaps", Some("kube-system"), "unhealthy-gpu-n1")
        .unwrap();
    eventually("GPUs healthy again", || async {
        filter(env.addr(), &big, &["n1"]).await.1["NodeNames"] == json!(["n1"])
    })
    .await;
    env.ext.stop().await;
}

#[tokio::test]
async fn a_deleted_node_with_pods_crashes_nothing() {
    let env = Env::start_with(config(), |api| {
        create(api, gpu_node("n1", 2, 16));
        create(api, gpu_node("n2", 2, 16));
        // A pod pointing at a node that never existed (upstream crash-looped on this).
        create(api, bound_pod("ghost", "gone", 0, 4, MIB_GPU));
    })
    .await;
    let p = create(&env.api, pending_pod("p", "4"));
    assert_eq!(bind(env.addr(), &p, "n1").await.0, 200);
    env.api.delete_object("nodes", None, "n1").unwrap();
    eventually("n1 gone from inspect", || async {
        let i = inspect(env.addr()).await;
        i["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["name"] != "n1")
    })
    .await;
    let q = create(&env.api, pending_pod("q", "4"));
    let (_, r) = filter(env.addr(), &q, &["n1", "n2"]).await;
    assert_eq!(r["NodeNames"], json!(["n2"]));
    assert_eq!(
        r["FailedNodes"]["n1"],
        "The node n1 is not for GPU share, need skip"
    );
    let (s, r) = bind(env.addr(), &q, "n1").await;
    assert_eq!(s, 500);
    assert!(r["Error"].as_str().unwrap().contains("not for GPU share"));
    // The node's pods are still known (pending) and counted again if it comes back.
    let (s, b) = get(env.addr(), "/gpushare-scheduler/inspect/n1").await;
    assert_eq!(s, 200, "{b}");
    assert!(b.contains("\"pending\":[{"), "{b}");
    create(&env.api, gpu_node("n1", 2, 16));
    env.wait_used("n1 back with its pod", "n1", &[4, 0]).await;
    assert_eq!(get(env.addr(), "/healthz").await.0, 200);
    env.ext.stop().await;
}

#[tokio::test]
async fn finished_and_deleted_pods_release_memory_terminating_ones_keep_it() {
    let env = Env::start_with(config(), |api| {
        create(api, gpu_node("n1", 1, 16));
        create(api, bound_pod("done", "n1", 0, 4, MIB_GPU));
        create(api, bound_pod("gone", "n1", 0, 4, MIB_GPU));
        create(api, bound_pod("stays", "n1", 0, 4, MIB_GPU));
    })
    .await;
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [12]);
    env.api
        .set_pod_phase("default", "done", "Succeeded")
        .unwrap();
    env.wait_used("finished pod released", "n1", &[8]).await;
    env.api
        .delete_object("pods", Some("default"), "gone")
        .unwrap();
    env.wait_used("deleted pod released", "n1", &[4]).await;
    env.ext.stop().await;
}

// ---------------------------------------------------------------- bind under faults

#[tokio::test]
async fn transient_errors_on_patch_and_binding_are_retried() {
    let env = Env::with_nodes(config(), &[("n1", 2, 16)]).await;
    let p = create(&env.api, pending_pod("p", "4"));
    env.api
        .inject(Fault::new(Some(Method::PATCH), "/pods/p", FaultAction::Status(409)).times(2));
    env.api
        .inject(binding_fault("p", FaultAction::Status(500)).times(2));
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!((s, r), (200, json!({"Error": ""})));
    let reqs = env.api.requests();
    assert_eq!(
        reqs.iter()
            .filter(|r| r.method == Method::PATCH && r.path.ends_with("/pods/p"))
            .count(),
        3
    );
    assert_eq!(
        reqs.iter()
            .filter(|r| r.path.ends_with("/pods/p/binding"))
            .count(),
        3
    );
    assert_eq!(
        env.api.get_object("pods", Some("default"), "p").unwrap()["spec"]["nodeName"],
        "n1"
    );
    // A dropped connection is retried too.
    let q = create(&env.api, pending_pod("q", "4"));
    env.api
        .inject(binding_fault("q", FaultAction::DropConnection));
    assert_eq!(bind(env.addr(), &q, "n1").await.0, 200);
    let (_, b) = get(env.addr(), "/metrics").await;
    assert!(b.contains("gpushare_extender_bind_retries_total"), "{b}");
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [8, 0]);
    env.ext.stop().await;
}

#[tokio::test]
async fn a_binding_that_fails_for_good_is_rolled_back() {
    let env = Env::with_nodes(config(), &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "10"));
    // Refused for certain (422 Invalid: never applied). A 5xx would be an unknown outcome
    // instead (settle::a_binding_answered_500_and_applied_later_keeps_its_memory).
    env.api
        .inject(binding_fault("p", FaultAction::Status(422)).times(1000));
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500);
    assert!(
        r["Error"]
            .as_str()
            .unwrap()
            .contains("binding pod default/p"),
        "{r}"
    );
    env.api.clear_faults();
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [0], "{r}");
    // The memory is free for the next pod at once.
    let q = create(&env.api, pending_pod("q", "10"));
    assert_eq!(bind(env.addr(), &q, "n1").await.0, 200);
    // A permanent error (403) is not retried.
    let r2 = create(&env.api, pending_pod("r", "2"));
    env.api
        .inject(Fault::new(Some(Method::PATCH), "/pods/r", FaultAction::Status(403)).times(5));
    assert_eq!(bind(env.addr(), &r2, "n1").await.0, 500);
    assert_eq!(
        env.api
            .requests()
            .iter()
            .filter(|x| x.method == Method::PATCH && x.path.ends_with("/pods/r"))
            .count(),
        1
    );
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [10]);
    eventually("a GpuShareBindFailed event", || async {
        env.api
            .list_objects("events.events.k8s.io", Some("default"))
            .iter()
            .any(|e| e["reason"] == "GpuShareBindFailed")
    })
    .await;
    env.ext.stop().await;
}

#[tokio::test]
async fn a_slow_api_times_out_inside_the_budget_and_the_ledger_converges() {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "6"));
    env.api.inject(binding_fault(
        "p",
        FaultAction::Delay(Duration::from_millis(1500)),
    ));
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500);
    assert!(r["Error"].as_str().unwrap().contains("timed out"), "{r}");
    // kube-scheduler retries. Whether the slow Binding landed late or not, the retry ends
    // with the pod bound to n1 (a 409 on the Binding is checked against the pod) and the
    // ledger counts it once.
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert!(
        s == 200
            || r["Error"]
                .as_str()
                .unwrap()
                .contains("already bound to node n1"),
        "{s} {r}"
    );
    assert_eq!(
        env.api.get_object("pods", Some("default"), "p").unwrap()["spec"]["nodeName"],
        "n1"
    );
    env.wait_used("ledger follows the API", "n1", &[6]).await;
    env.ext.stop().await;
}

#[tokio::test]
async fn a_pod_deleted_during_bind_gets_a_clean_error_and_no_reservation() {
    let env = Env::with_nodes(config(), &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "6"));
    env.api.inject(Fault::new(
        Some(Method::PATCH),
        "/pods/p",
        FaultAction::Delay(Duration::from_millis(400)),
    ));
    let addr = env.addr();
    let pc = p.clone();
    let binding = tokio::spawn(async move { bind(addr, &pc, "n1").await });
    eventually("the patch is in flight", || async {
        env.api
            .requests()
            .iter()
            .any(|r| r.method == Method::PATCH && r.path.ends_with("/pods/p"))
    })
    .await;
    env.api.delete_object("pods", Some("default"), "p").unwrap();
    let (s, r) = binding.await.unwrap();
    assert_eq!(s, 500);
    assert!(
        r["Error"].as_str().unwrap().contains("deleted during bind"),
        "{r}"
    );
    env.wait_used("nothing held", "n1", &[0]).await;
    // A UID mismatch is refused with upstream's words.
    let q = create(&env.api, pending_pod("q", "6"));
    let (s, r) = post(
        env.addr(),
        "/gpushare-scheduler/bind",
        &json!({"PodName": "q", "PodNamespace": "default", "PodUID": "not-the-uid", "Node": "n1"}),
    )
    .await;
    assert_eq!(s, 500);
    let want = format!(
        "The pod q in ns default's uid is {}, and it's not equal with expected not-the-uid",
        q["metadata"]["uid"].as_str().unwrap()
    );
    assert_eq!(r["Error"], want);
    env.ext.stop().await;
}

// ---------------------------------------------------------------- concurrency

/// 200 pods scheduled concurrently over 20 nodes (filter then bind, retrying elsewhere when a
/// bind loses a race): no GPU is ever over-committed, in the ledger nor in the annotations.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_binds_never_overcommit() {
    // Correctness, not speed: a debug build on a small machine needs a generous budget.
    let mut c = config();
    c.extender.bind_timeout_ms = 60_000;
    let env = Env::start_with(c, |api| {
        for n in 0..20 {
            create(api, gpu_node(&format!("n{n:02}"), 4, 16));
        }
    })
    .await;
    let names: Vec<String> = (0..20).map(|n| format!("n{n:02}")).collect();
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let p = create(&env.api, pending_pod(&format!("p{i:03}"), 1 + i % 7));
        let addr = env.addr();
        let names = names.clone();
        tasks.push(tokio::spawn(async move {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            for attempt in 0..20 {
                let (s, r) = filter(addr, &p, &refs).await;
                assert_eq!(s, 200);
                let passing = r["NodeNames"].as_array().cloned().unwrap_or_default();
                if passing.is_empty() {
                    return false;
                }
                let pick = passing[(i as usize + attempt) % passing.len()]
                    .as_str()
                    .unwrap()
                    .to_string();
                let (s, r) = bind(addr, &p, &pick).await;
                if s == 200 {
                    return true;
                }
                // Lost a race for the last room on that node: try again.
                assert!(r["Error"].as_str().unwrap().contains("can't place"), "{r}");
            }
            false
        }));
    }
    let mut bound = 0;
    for t in tasks {
        if t.await.unwrap() {
            bound += 1;
        }
    }
    // 200 pods × avg 4 = ~800 units on 1280 units of capacity: everything fits.
    assert_eq!(bound, 200);
    let i = inspect(env.addr()).await;
    for n in i["nodes"].as_array().unwrap() {
        for d in n["devs"].as_array().unwrap() {
            assert!(d["usedGPU"].as_u64() <= d["totalGPU"].as_u64(), "{n}");
        }
    }
    // Recompute from the API server's pods.
    let mut per_gpu: BTreeMap<(String, String), u64> = BTreeMap::new();
    for p in env.api.list_objects("pods", Some("default")) {
        let node = p["spec"]["nodeName"]
            .as_str()
            .expect("every pod bound")
            .to_string();
        let a = &p["metadata"]["annotations"];
        let mem: u64 = a["ALIYUN_COM_GPU_MEM_POD"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        *per_gpu
            .entry((
                node,
                a["ALIYUN_COM_GPU_MEM_IDX"].as_str().unwrap().to_string(),
            ))
            .or_default() += mem;
    }
    assert!(per_gpu.values().all(|u| *u <= 16), "{per_gpu:?}");
    let total: u64 = per_gpu.values().sum();
    let ledger_total: u64 = i["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["usedGPU"].as_u64().unwrap())
        .sum();
    assert_eq!(total, ledger_total);
    env.ext.stop().await;
}

// ---------------------------------------------------------------- hostile input

#[tokio::test]
async fn hostile_and_malformed_input_gets_clear_4xx_answers() {
    let mut c = config();
    c.extender.max_body_bytes = 64 * 1024;
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let addr = env.addr();
    let raw = |path: &'static str, body: &'static str| async move {
        let (s, b) = request(addr, Method::POST, path, body.as_bytes().to_vec()).await;
        (
            s,
            serde_json::from_str::<Value>(&b).expect("error bodies are JSON"),
        )
    };
    let (s, r) = raw("/gpushare-scheduler/filter", "{not json").await;
    assert_eq!(s, 400);
    assert!(r["Error"].as_str().unwrap().contains("not valid JSON"));
    let (s, r) = raw(
        "/gpushare-scheduler/filter",
        r#"{"Pod": {"spec": {"containers": 5}}, "NodeNames": ["n1"]}"#,
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        r["Error"].as_str().unwrap().starts_with("ExtenderArgs.Pod"),
        "{r}"
    );
    let (s, r) = raw(
        "/gpushare-scheduler/filter",
        r#"{"Pod": {}, "NodeNames": "n1"}"#,
    )
    .await;
    assert_eq!(s, 400);
    assert!(r["Error"].as_str().unwrap().contains("NodeNames"));
    let (s, r) = raw("/gpushare-scheduler/bind", r#"{"PodName": 1}"#).await;
    assert_eq!(s, 400);
    assert!(r["Error"].as_str().unwrap().contains("PodName"));
    // Absurd or malformed quantities.
    for q in ["10T", "-3", "1.5", "lots"] {
        let (s, r) = filter(addr, &pending_pod("x", q), &["n1"]).await;
        assert_eq!(s, 400, "{q}");
        assert!(
            r["Error"].as_str().unwrap().contains("aliyun.com/gpu-mem"),
            "{r}"
        );
    }
    // 10G is ten billion units: valid but it never fits anywhere.
    let (s, r) = filter(addr, &pending_pod("x", "10G"), &["n1"]).await;
    assert_eq!(s, 200);
    assert!(r["FailedAndUnresolvableNodes"]["n1"].is_string());
    // Lowercase keys (kube-scheduler ≤ 1.15).
    let (s, r) = post(
        addr,
        "/gpushare-scheduler/filter",
        &json!({"pod": pending_pod("x", "4"), "nodenames": ["n1"]}),
    )
    .await;
    assert_eq!((s, &r["NodeNames"]), (200, &json!(["n1"])));
    // A pod without gpu-mem passes everywhere.
    let (_, r) = filter(
        addr,
        &json!({"metadata": {"name": "cpu"}, "spec": {"containers": []}}),
        &["n1", "x"],
    )
    .await;
    assert_eq!(r["NodeNames"], json!(["n1", "x"]));
    // Too large.
    let huge = vec![b' '; 100 * 1024];
    let (s, b) = request(addr, Method::POST, "/gpushare-scheduler/filter", huge).await;
    assert_eq!(s, 413, "{b}");
    // Paths and methods.
    let (s, b) = get(addr, "/gpushare-scheduler/nope").await;
    assert_eq!(s, 404);
    assert!(b.contains("\"Error\""));
    let (s, b) = get(addr, "/gpushare-scheduler/filter").await;
    assert_eq!(s, 405);
    assert!(b.contains("\"Error\""));
    assert_eq!(
        request(
            addr,
            Method::POST,
            "/gpushare-scheduler/inspect",
            Vec::new()
        )
        .await
        .0,
        405
    );
    let (s, b) = get(addr, "/gpushare-scheduler/inspect/unknown-node").await;
    assert_eq!(s, 404);
    assert!(b.contains("unknown-node"));
    let (s, b) = get(addr, "/version").await;
    assert_eq!((s, b.as_str()), (200, env!("CARGO_PKG_VERSION")));
    assert_eq!(get(addr, "/readyz").await.0, 200);
    let (s, b) = get(addr, "/metrics").await;
    assert_eq!(s, 200);
    for m in [
        "gpushare_extender_requests_total",
        "gpushare_extender_request_duration_seconds",
        "gpushare_extender_filter_rejections_total",
        "gpushare_extender_gpu_memory_bytes",
        "gpushare_extender_gpu_memory_allocated_bytes",
        "gpushare_extender_assumed_pods",
        "gpushare_extender_ledger_synced 1",
    ] {
        assert!(b.contains(m), "{m} missing from\n{b}");
    }
    // Still alive and correct after all of it.
    let p = create(&env.api, pending_pod("ok", "4"));
    assert_eq!(bind(addr, &p, "n1").await.0, 200);
    env.ext.stop().await;
}

#[tokio::test]
async fn scheduling_verbs_answer_503_until_synced_and_while_not_serving() {
    let api = ApiServer::start().await.unwrap();
    create(&api, gpu_node("n1", 1, 16));
    // Hold the first pod list back so the ledger cannot be synced yet.
    api.inject(Fault::new(
        Some(Method::GET),
        "/api/v1/pods?",
        FaultAction::Delay(Duration::from_millis(1500)),
    ));
    let ext = extender::start(&config(), api.admin_client(), Shutdown::never())
        .await
        .unwrap();
    let (s, r) = filter(ext.addr, &pending_pod("x", "4"), &["n1"]).await;
    assert_eq!(s, 503);
    assert!(r["Error"].as_str().unwrap().contains("not synced"));
    assert_eq!(get(ext.addr, "/readyz").await.0, 503);
    assert_eq!(get(ext.addr, "/healthz").await.0, 200);
    ext.wait_ready().await.unwrap();
    assert_eq!(
        filter(ext.addr, &pending_pod("x", "4"), &["n1"]).await.0,
        200
    );
    ext.state().set_serving(false);
    assert_eq!(
        filter(ext.addr, &pending_pod("x", "4"), &["n1"]).await.0,
        503
    );
    assert_eq!(get(ext.addr, "/readyz").await.0, 503);
    ext.state().set_serving(true);
    assert_eq!(get(ext.addr, "/readyz").await.0, 200);
    // The port is taken: a second extender on it fails at once.
    let mut c = config();
    c.extender.port = ext.addr.port();
    let err = extender::start(&c, api.admin_client(), Shutdown::never())
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("cannot listen"), "{err:#}");
    ext.stop().await;
}

#[tokio::test]
async fn watch_restarts_neither_lose_nor_double_count_pods() {
    let env = Env::start_with(config(), |api| {
        create(api, gpu_node("n1", 2, 16));
        create(api, bound_pod("a", "n1", 0, 3, MIB_GPU));
        create(api, bound_pod("b", "n1", 1, 5, MIB_GPU));
    })
    .await;
    // Cut the pod watch, churn while it is down, and force a 410 on resume.
    env.api.set_history_limit(1);
    env.api.inject(Fault::new(
        Some(Method::GET),
        "/pods?",
        FaultAction::CutWatch,
    ));
    env.api.delete_object("pods", Some("default"), "a").unwrap();
    create(&env.api, bound_pod("c", "n1", 0, 7, MIB_GPU));
    env.api.set_pod_phase("default", "b", "Failed").unwrap();
    create(&env.api, bound_pod("d", "n1", 1, 2, MIB_GPU));
    env.wait_used("ledger equals the API", "n1", &[7, 2]).await;
    env.ext.stop().await;
}

/// With `tls_cert`/`tls_key` the extender serves HTTPS (scheduler `enableHTTPS: true`).
#[tokio::test]
async fn tls_serves_https_with_the_given_certificate() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .args([
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .output();
    if !made.is_ok_and(|o| o.status.success()) {
        crate::support::clients::skip("openssl is not available (apt-get install openssl)");
        return;
    }
    let mut c = config();
    c.extender.tls_cert = cert.display().to_string();
    c.extender.tls_key = key.display().to_string();
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_file_iter(&cert).unwrap() {
        roots.add(der.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls));
    let tcp = tokio::net::TcpStream::connect(env.addr()).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let mut stream = connector.connect(name, tcp).await.expect("TLS handshake");
    stream
        .write_all(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.ok();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with(env!("CARGO_PKG_VERSION")), "{answer}");
    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(env.addr()).await.unwrap();
    plain
        .write_all(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    plain.read_to_end(&mut buf).await.ok();
    assert!(!String::from_utf8_lossy(&buf).contains("200 OK"));
    env.ext.stop().await;
}
