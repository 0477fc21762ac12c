//! Zero over-commit under faults and ambiguous outcomes (issue 15, extender items 1–8), over
//! real HTTP against the sandbox API server and its fault injection: a Binding that lands
//! after the bind timeout, a scheduler that hangs up mid-bind, a lost answer, a re-list while
//! binds go on, native sidecars, stale annotations copied from another pod, absurd foreign
//! annotation values, a watch that keeps failing, and 300 slow clients.
//!
//! No sleeps as synchronisation: every wait is a bounded poll of a condition.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, Hold};
use http::Method;
use serde_json::json;

use crate::support::extender_http::{get, inspect};
use crate::support::extender_sandbox::{
    Env, annotations, bind, binding_fault, config, create, extender_over, filter, stored, used,
};
use crate::support::objects::{gpu_node, pending_pod};
use crate::support::wait::eventually;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(30);

/// Memory per (node, GPU index) as the API server's annotations of bound pods say.
fn annotated_per_gpu(api: &ApiServer) -> BTreeMap<(String, String), u64> {
    let mut per_gpu = BTreeMap::new();
    for p in api.list_objects("pods", None) {
        let (Some(node), Some(idx), Some(mem)) = (
            p["spec"]["nodeName"].as_str(),
            p["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"].as_str(),
            p["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_POD"].as_str(),
        ) else {
            continue;
        };
        *per_gpu
            .entry((node.to_string(), idx.to_string()))
            .or_default() += mem.parse::<u64>().unwrap_or(u64::MAX);
    }
    per_gpu
}

fn bound_to(api: &ApiServer, name: &str) -> Option<String> {
    stored(api, name)["spec"]["nodeName"]
        .as_str()
        .map(str::to_string)
}

async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, body) = get(addr, "/metrics").await;
    body.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// ---------------------------------------------------------------- item 1

/// A Binding our side gave up on (bind timeout) that lands later never lets its memory go to
/// another pod: no 10 + 10 on a 16-unit GPU.
#[tokio::test]
async fn a_binding_that_lands_after_the_bind_timeout_keeps_its_memory() {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "10"));
    env.api
        .inject(binding_fault("p", FaultAction::ApplyLate(Duration::from_millis(1500))).times(1));
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500, "{r}");
    assert!(
        r["Error"].as_str().unwrap_or("").contains("timed out"),
        "{r}"
    );
    // While the slow Binding is still on its way, nobody else gets that memory.
    let q = create(&env.api, pending_pod("q", "10"));
    let (s, r) = filter(env.addr(), &q, &["n1"]).await;
    assert_eq!(s, 200);
    assert_eq!(r["NodeNames"], json!([]), "{r}");
    let (s, r) = bind(env.addr(), &q, "n1").await;
    assert_eq!(s, 500, "{r}");
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [10]);
    // It lands; the ledger and the API agree, and no GPU is over its size.
    eventually("p bound to n1", || async {
        bound_to(&env.api, "p").as_deref() == Some("n1")
    })
    .await;
    env.wait_used("ledger equals the annotations", "n1", &[10])
        .await;
    assert_eq!(bound_to(&env.api, "q"), None);
    assert!(annotated_per_gpu(&env.api).values().all(|u| *u <= 16));
    assert!(metric(env.addr(), "gpushare_extender_bind_unknown_outcomes_total").await >= 1.0);
    // kube-scheduler's retry of p gets the same answer: success.
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 200, "{r}");
    env.ext.stop().await;
}

// ---------------------------------------------------------------- item 2

/// kube-scheduler hangs up in the middle of a bind: the bind still completes, the reservation
/// does not leak, and a retry of the same pod attaches to it instead of answering "already
/// holds GPU". A lost answer (applied, connection dropped) settles the same way.
#[tokio::test]
async fn a_scheduler_hanging_up_mid_bind_cancels_nothing_and_retries_attach() {
    let env = Env::with_nodes(config(), &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "6"));
    env.api.inject(binding_fault(
        "p",
        FaultAction::ApplyLate(Duration::from_millis(800)),
    ));
    // The scheduler's httpTimeout is shorter than the bind: it hangs up.
    let hung_up =
        tokio::time::timeout(Duration::from_millis(150), bind(env.addr(), &p, "n1")).await;
    assert!(hung_up.is_err(), "the client gave up first");
    // Its retry attaches to the bind still running and gets its outcome.
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(bound_to(&env.api, "p").as_deref(), Some("n1"));
    env.wait_used("the ledger holds p once", "n1", &[6]).await;
    // A Binding applied whose answer is lost: settled as bound, not rolled back.
    let q = create(&env.api, pending_pod("q", "6"));
    env.api
        .inject(binding_fault("q", FaultAction::ApplyThenDrop));
    let (s, r) = bind(env.addr(), &q, "n1").await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(bound_to(&env.api, "q").as_deref(), Some("n1"));
    env.wait_used("the ledger holds p and q", "n1", &[12]).await;
    // The hung-up bind of a pod deleted meanwhile does not leak its reservation.
    let d = create(&env.api, pending_pod("d", "4"));
    env.api.inject(Fault::new(
        Some(Method::PATCH),
        "/pods/d",
        FaultAction::ApplyLate(Duration::from_millis(500)),
    ));
    let _ = tokio::time::timeout(Duration::from_millis(100), bind(env.addr(), &d, "n1")).await;
    env.api.delete_object("pods", Some("default"), "d").unwrap();
    eventually("d's reservation released", || async {
        used(&inspect(env.addr()).await, "n1") == [12] && env.ext.state().binds().is_empty()
    })
    .await;
    env.ext.stop().await;
}

// ---------------------------------------------------------------- item 3

/// A re-list (410 Gone after a cut watch) while binds go on: a pod bound after the list's
/// snapshot keeps its reservation until the watch shows it, so a bind in that window cannot
/// over-commit.
#[tokio::test]
async fn a_relist_keeps_reservations_newer_than_its_snapshot() {
    let env = Env::with_nodes(config(), &[("n1", 1, 16)]).await;
    env.api.set_history_limit(1);
    // The re-list's snapshot is taken at once but answered late; the watch after it is slow.
    env.api.inject(Fault::new(
        Some(Method::GET),
        "/api/v1/pods?&limit=",
        FaultAction::AnswerLate(Duration::from_millis(1000)),
    ));
    env.api.inject(
        Fault::new(
            Some(Method::GET),
            "/api/v1/pods?&watch=",
            FaultAction::Delay(Duration::from_millis(1500)),
        )
        .times(3),
    );
    let lists_before = pod_lists(&env.api);
    create(&env.api, pending_pod("filler-1", "0"));
    create(&env.api, pending_pod("filler-2", "0"));
    env.api.inject(Fault::new(
        Some(Method::GET),
        "/api/v1/pods?",
        FaultAction::CutWatch,
    ));
    eventually("the re-list's snapshot is taken", || async {
        pod_lists(&env.api) > lists_before
    })
    .await;
    let p = create(&env.api, pending_pod("p", "10"));
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 200, "{r}");
    let watches_before = pod_watches(&env.api);

    eventually(
        "the re-list is applied and the next watch asked for",
        || async { pod_watches(&env.api) > watches_before },
    )
    .await;
    // The watch has not shown p yet; its reservation must still count.
    assert_eq!(used(&inspect(env.addr()).await, "n1"), [10]);
    let q = create(&env.api, pending_pod("q", "10"));
    let (s, r) = bind(env.addr(), &q, "n1").await;
    assert_eq!(s, 500, "{r}");
    env.wait_used("ledger equals the annotations", "n1", &[10])
        .await;
    assert!(annotated_per_gpu(&env.api).values().all(|u| *u <= 16));
    env.ext.stop().await;
}

fn pod_lists(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.path == "/api/v1/pods" && !r.query.contains("watch"))
        .count()
}

fn pod_watches(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.path == "/api/v1/pods" && r.query.contains("watch"))
        .count()
}

// ---------------------------------------------------------------- item 4

/// Native sidecars count as kube-scheduler counts them: 16 + a 4-unit sidecar is 20.
#[tokio::test]
async fn native_sidecars_are_counted() {
    let env = Env::with_nodes(config(), &[("small", 1, 16), ("big", 1, 24)]).await;
    let mut s = pending_pod("s", "16");
    s["spec"]["initContainers"] = json!([{"name": "proxy", "image": "envoy",
        "restartPolicy": "Always", "resources": {"limits": {"aliyun.com/gpu-mem": "4"}}}]);
    let s = create(&env.api, s);
    let (code, r) = filter(env.addr(), &s, &["small", "big"]).await;
    assert_eq!(code, 200);
    assert_eq!(r["NodeNames"], json!(["big"]), "{r}");
    let (code, r) = bind(env.addr(), &s, "big").await;
    assert_eq!(code, 200, "{r}");
    assert_eq!(annotations(&env.api, "s")["ALIYUN_COM_GPU_MEM_POD"], "20");
    env.wait_used("the ledger holds 20", "big", &[20]).await;
    let t = create(&env.api, pending_pod("t", "5"));
    let (_, r) = filter(env.addr(), &t, &["big"]).await;
    assert_eq!(r["NodeNames"], json!([]), "{r}");
    env.ext.stop().await;
}

// ---------------------------------------------------------------- item 5

/// A pod created from another pod's YAML carries our annotations: bind removes them.
#[tokio::test]
async fn bind_writes_a_clean_slate() {
    let env = Env::with_nodes(config(), &[("n1", 1, 16)]).await;
    let mut p = pending_pod("copy", "4");
    p["metadata"]["annotations"] = json!({
        "gpushare.io/allocated-containers": "main",
        "scheduler.framework.gpushare.allocation": "{\"0\":{\"0\":9}}",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
        "ALIYUN_COM_GPU_MEM_IDX": "3",
        "keep.example.com/mine": "yes"
    });
    let p = create(&env.api, p);
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 200, "{r}");
    let a = annotations(&env.api, "copy");
    assert!(!a.contains_key("gpushare.io/allocated-containers"), "{a:?}");
    assert!(
        !a.contains_key("scheduler.framework.gpushare.allocation"),
        "{a:?}"
    );
    assert_eq!(a["ALIYUN_COM_GPU_MEM_ASSIGNED"], "false");
    assert_eq!(a["ALIYUN_COM_GPU_MEM_IDX"], "0");
    assert_eq!(
        a["keep.example.com/mine"], "yes",
        "foreign annotations stay"
    );
    env.ext.stop().await;
}

// ---------------------------------------------------------------- item 6

/// 300 slow clients (headers dribbling in, a body that never comes) do not stop `/healthz`
/// or filter from answering, and a slow body gets 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_hundred_slow_clients_do_not_stop_healthz_or_filter() {
    let mut c = config();
    c.http.header_read_timeout_ms = 5_000;
    c.http.body_read_timeout_ms = 300;
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let mut slow = Vec::new();
    for i in 0..300 {
        let mut s = tokio::net::TcpStream::connect(env.addr())
            .await
            .expect("slow client connects");
        let start = if i % 2 == 0 {
            // Headers that never end.
            "POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\n".to_string()
        } else {
            // A body that never comes.
            "POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{".to_string()
        };
        s.write_all(start.as_bytes()).await.expect("slow write");
        slow.push(s);
    }
    let (s, b) = get(env.addr(), "/healthz").await;
    assert_eq!((s, b.as_str()), (200, "ok\n"));
    let p = create(&env.api, pending_pod("p", "4"));
    let (s, r) = filter(env.addr(), &p, &["n1"]).await;
    assert_eq!(s, 200);
    assert_eq!(r["NodeNames"], json!(["n1"]), "{r}");
    // A slow body is answered 408 once its deadline passes.
    let mut body_client = slow.swap_remove(1);
    let mut answer = Vec::new();
    let read = tokio::time::timeout(DEADLINE, body_client.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the server closes a slow body's connection");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    drop(slow);
    env.ext.stop().await;
}

// ---------------------------------------------------------------- item 7

/// Foreign or absurd values in our annotations are bounded, counted and never printed above
/// int64 by `/inspect`.
#[tokio::test]
async fn absurd_annotation_values_are_bounded_and_counted() {
    let env = Env::start_with(config(), |api| {
        create(api, gpu_node("n1", 1, 16));
        let mut p = pending_pod("foreign", "4");
        p["spec"]["nodeName"] = json!("n1");
        p["metadata"]["annotations"] = json!({
            "ALIYUN_COM_GPU_MEM_IDX": "0",
            "ALIYUN_COM_GPU_MEM_POD": "18446744073709551615",
            "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"});
        p["status"] = json!({"phase": "Running"});
        create(api, p);
    })
    .await;
    let i = inspect(env.addr()).await;
    assert_eq!(used(&i, "n1"), [4], "{i}");
    let text = i.to_string();
    assert!(!text.contains("18446744073709551615"), "{text}");
    let max = i64::MAX as u64;
    for n in i["nodes"].as_array().unwrap() {
        assert!(n["usedGPU"].as_u64().unwrap() <= max);
        assert!(n["totalGPU"].as_u64().unwrap() <= max);
    }
    assert!(
        metric(
            env.addr(),
            "gpushare_extender_bad_annotations_total{key=\"ALIYUN_COM_GPU_MEM_POD\"}"
        )
        .await
            >= 1.0
    );
    env.ext.stop().await;
}

// ---------------------------------------------------------------- item 8

/// A watch that keeps failing (403 after an RBAC change) makes `/readyz` 503 within a bounded
/// time, with the reason; filter and bind are refused meanwhile; it recovers by itself.
#[tokio::test]
async fn a_watch_that_keeps_failing_makes_the_extender_unready() {
    let mut c = config();
    c.extender.watch_stale_after_ms = 300;
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "4"));
    env.api.inject(
        Fault::new(Some(Method::GET), "/api/v1/pods?", FaultAction::Status(403)).times(100_000),
    );
    env.api.inject(Fault::new(
        Some(Method::GET),
        "/api/v1/pods?",
        FaultAction::CutWatch,
    ));
    eventually("/readyz answers 503", || async {
        get(env.addr(), "/readyz").await.0 == 503
    })
    .await;
    let (_, why) = get(env.addr(), "/readyz").await;
    assert!(why.contains("stale") && why.contains("pod watch"), "{why}");
    assert_eq!(filter(env.addr(), &p, &["n1"]).await.0, 503);
    assert_eq!(bind(env.addr(), &p, "n1").await.0, 503);
    assert_eq!(
        metric(env.addr(), "gpushare_extender_ledger_stale").await,
        1.0
    );
    assert!(metric(env.addr(), "gpushare_extender_watch_errors_total").await >= 1.0);
    // RBAC fixed: the watch resumes, the ledger is fresh again.
    env.api.clear_faults();
    create(&env.api, pending_pod("wake", "1"));
    eventually("/readyz answers 200 again", || async {
        get(env.addr(), "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(bind(env.addr(), &p, "n1").await.0, 200);
    env.ext.stop().await;
}

/// An annotation patch that times out is an unknown outcome, not a refusal: it carries the
/// durable reservation and may still land, so the bind keeps its GPU and finishes the bind
/// itself (a retried bind elsewhere cannot give the GPU's room away meanwhile), and the late
/// patch, fenced by the pod's resourceVersion, never lands over the writes that followed it.
/// Before: the GPU was released at once and p was bound to n2 while its patch for n1 was
/// still on its way.
#[tokio::test]
async fn an_annotation_patch_in_doubt_keeps_its_reservation_until_the_bind_is_settled() {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    let env = Env::start_with(c, |api| {
        create(api, gpu_node("n1", 2, 16));
        create(api, gpu_node("n2", 1, 16));
        let mut filler = pending_pod("filler", "8");
        filler["spec"]["nodeName"] = json!("n1");
        filler["metadata"]["annotations"] = json!({"ALIYUN_COM_GPU_MEM_IDX": "0",
            "ALIYUN_COM_GPU_MEM_POD": "8", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"});
        filler["status"] = json!({"phase": "Running"});
        create(api, filler);
    })
    .await;
    let p = create(&env.api, pending_pod("p", "10"));
    env.api.inject(Fault::new(
        Some(Method::PATCH),
        "/pods/p",
        FaultAction::ApplyLate(Duration::from_millis(700)),
    ));
    // n1 puts p on GPU 1; the patch saying so is slow: the bind's outcome is unknown.
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500, "{r}");
    assert!(r.to_string().contains("unknown"), "{r}");
    // A retried bind to n2 cannot take p elsewhere while its reservation on n1 is in doubt.
    let (s, r) = bind(env.addr(), &p, "n2").await;
    assert_eq!(s, 500, "{r}");
    eventually("the owner finished p's bind to n1 itself", || async {
        bound_to(&env.api, "p").as_deref() == Some("n1")
    })
    .await;
    eventually("the slow patch reached the API server", || async {
        env.api.late_in_flight() == 0
    })
    .await;
    let a = annotations(&env.api, "p");
    assert_eq!(a["ALIYUN_COM_GPU_MEM_IDX"], "1", "{a:?}");
    eventually(
        "the ledger holds p on n1's GPU 1, nothing on n2",
        || async {
            let i = inspect(env.addr()).await;
            used(&i, "n1") == [8, 10] && used(&i, "n2") == [0]
        },
    )
    .await;
    env.ext.stop().await;
}

// ---------------------------------------------------------------- durable reservations

/// Returns once the extender at `addr` has applied every pod event up to now: it creates a
/// bound pod of 4 units on `n2` (GPU 0, empty before) and waits for the ledger to count it (one
/// watch, in the API server's order).
async fn watch_past_now(api: &ApiServer, addr: SocketAddr) {
    let mut marker = pending_pod("marker", "4");
    marker["spec"]["nodeName"] = json!("n2");
    marker["metadata"]["annotations"] = json!({"ALIYUN_COM_GPU_MEM_IDX": "0",
        "ALIYUN_COM_GPU_MEM_POD": "4", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"});
    marker["status"] = json!({"phase": "Running"});
    create(api, marker);
    eventually("the extender's watch is past the marker pod", || async {
        used(&inspect(addr).await, "n2") == [4]
    })
    .await;
}

/// Pod p (10 units) on a one-GPU node n1 (16 units; n2 beside it, the same), whose bind
/// answered 500 while `fault` (around a held apply) keeps its writes of one kind at the API
/// server, then the extender restarted: the API
/// server, p, the hold and the restarted extender.
async fn held_across_a_restart(
    fault: impl FnOnce(FaultAction) -> Fault,
) -> (
    ApiServer,
    serde_json::Value,
    Hold,
    gpushare::extender::ExtenderHandle,
) {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    let env = Env::with_nodes(c.clone(), &[("n1", 1, 16), ("n2", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "10"));
    let hold = Hold::new();
    // Every try is held (the owner, its outcome unknown, tries again): none lands before the
    // restart.
    env.api.inject(
        fault(FaultAction::ApplyOnRelease {
            hold: hold.clone(),
            answer: None,
        })
        .times(usize::MAX),
    );
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500, "{r}");
    hold.wait_reached(1).await;
    let Env { api, ext } = env;
    ext.stop().await;
    let ext = extender_over(&api, &c).await;
    (api, p, hold, ext)
}

/// A Binding of unknown outcome survives a restart of the extender: the new process reads the
/// reservation from the pod (node, GPU, since when) and counts it, so the GPU is not handed out
/// again before the late Binding lands.
#[tokio::test]
async fn a_reservation_of_unknown_outcome_survives_a_restart() {
    // The process stops (a restart) with its Binding still held at the API server.
    let (api, _p, hold, ext) = held_across_a_restart(|held| binding_fault("p", held)).await;
    let q = create(&api, pending_pod("q", "10"));
    let (s, r) = bind(ext.addr, &q, "n1").await;
    assert_eq!(s, 500, "the restarted extender gave p's GPU away: {r}");
    assert_eq!(used(&inspect(ext.addr).await, "n1"), [10]);
    hold.release();
    eventually("p's late Binding lands", || async {
        bound_to(&api, "p").as_deref() == Some("n1")
    })
    .await;
    assert_eq!(bound_to(&api, "q"), None);
    assert!(annotated_per_gpu(&api).values().all(|u| *u <= 16));
    eventually("the ledger holds p once", || async {
        used(&inspect(ext.addr).await, "n1") == [10]
    })
    .await;
    ext.stop().await;
}

/// An annotation patch whose answer never came (the bind's process stopped with it in flight)
/// lands after a restart, when the restarted extender has given the GPU to another pod: the
/// reservation it carries was never backed by a Binding, so the pod's retried bind must not
/// take it over onto a GPU that cannot hold it (`make soak` over-committed this way).
#[tokio::test]
async fn a_late_patch_after_a_restart_cannot_take_a_gpu_given_away_meanwhile() {
    let (api, p, hold, ext) =
        held_across_a_restart(|held| Fault::new(Some(Method::PATCH), "/pods/p", held)).await;
    // The restarted extender knows nothing of p: q gets the GPU.
    let q = create(&api, pending_pod("q", "10"));
    let (s, r) = bind(ext.addr, &q, "n1").await;
    assert_eq!(s, 200, "{r}");
    // The patch lands now, promising p the same GPU.
    hold.release();
    eventually("p's late patch lands", || async {
        annotations(&api, "p").contains_key(gpushare::core::wire::POD_ANN_RESERVATION)
    })
    .await;
    watch_past_now(&api, ext.addr).await;
    // kube-scheduler retries p on the node its reservation names.
    let (s, r) = bind(ext.addr, &p, "n1").await;
    assert_eq!(s, 500, "p was bound onto q's GPU: {r}");
    assert_eq!(bound_to(&api, "p"), None);
    assert_eq!(
        metric(
            ext.addr,
            "gpushare_extender_reservations_settled_total{outcome=\"released\"}"
        )
        .await,
        1.0,
        "the dropped reservation is counted as released"
    );
    assert!(
        annotated_per_gpu(&api).values().all(|u| *u <= 16),
        "{:?}",
        annotated_per_gpu(&api)
    );
    eventually("the ledger holds q alone", || async {
        used(&inspect(ext.addr).await, "n1") == [10]
    })
    .await;
    ext.stop().await;
}

/// Two writes of two pods held across a restart, on one GPU: p's annotation patch (never
/// answered, so no Binding follows it) and b's Binding (its patch answered: b's reservation is
/// on the pod when the new process lists). The new process gives p's room to c; p's patch
/// lands after that list. b's retried bind must take b's own reservation over (its Binding may
/// land any moment), and p must get nothing there: p's reservation, first seen after the list,
/// was written after the old process's life, so nothing backs it.
#[tokio::test]
async fn a_reservation_first_seen_after_the_list_never_outranks_one_the_list_showed() {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    let env = Env::with_nodes(c.clone(), &[("n1", 1, 16), ("n2", 1, 16)]).await;
    let held = |api: &ApiServer, fault: Fault| {
        api.inject(fault);
    };
    let p = create(&env.api, pending_pod("p", "8"));
    let b = create(&env.api, pending_pod("b", "8"));
    let (hold_p, hold_b) = (Hold::new(), Hold::new());
    let on_release = |hold: &Hold| FaultAction::ApplyOnRelease {
        hold: hold.clone(),
        answer: None,
    };
    // Every try is held (each owner, its outcome unknown, tries again): none lands before the
    // restart.
    held(
        &env.api,
        Fault::new(Some(Method::PATCH), "/pods/p", on_release(&hold_p)).times(usize::MAX),
    );
    held(
        &env.api,
        binding_fault("b", on_release(&hold_b)).times(usize::MAX),
    );
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500, "{r}");
    let (s, r) = bind(env.addr(), &b, "n1").await;
    assert_eq!(s, 500, "{r}");
    hold_p.wait_reached(1).await;
    hold_b.wait_reached(1).await;
    let Env { api, ext } = env;
    ext.stop().await;
    let ext = extender_over(&api, &c).await;
    let q = create(&api, pending_pod("c", "8"));
    let (s, r) = bind(ext.addr, &q, "n1").await;
    assert_eq!(s, 200, "c takes the room b's reservation leaves: {r}");
    hold_p.release();
    eventually("p's late patch lands", || async {
        annotations(&api, "p").contains_key(gpushare::core::wire::POD_ANN_RESERVATION)
    })
    .await;
    // Once the new process's watch is past p's patch:
    watch_past_now(&api, ext.addr).await;
    // kube-scheduler retries b, then p; the API server answers again (the writes it holds
    // stay held).
    api.clear_faults();
    let (s, r) = bind(ext.addr, &b, "n1").await;
    assert_eq!(s, 200, "b's own reservation, listed after the restart: {r}");
    let (s, r) = bind(ext.addr, &p, "n1").await;
    assert_eq!(s, 500, "p was bound onto a full GPU: {r}");
    hold_b.release();
    eventually("b's held Binding reached the API server", || async {
        api.late_in_flight() == 0
    })
    .await;
    assert_eq!(bound_to(&api, "b").as_deref(), Some("n1"));
    assert_eq!(bound_to(&api, "p"), None);
    assert_eq!(
        annotated_per_gpu(&api).get(&("n1".to_string(), "0".to_string())),
        Some(&16),
        "{:?}",
        annotated_per_gpu(&api)
    );
    eventually("the ledger holds b and c", || async {
        used(&inspect(ext.addr).await, "n1") == [16]
    })
    .await;
    ext.stop().await;
}

/// A reservation found on a pod that never gets bound ends once the pod has stayed unbound
/// for `extender.bind_settle_ms`, read from the API; its annotation is cleared.
#[tokio::test]
async fn a_found_reservation_expires_after_the_settle_window() {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    c.extender.bind_settle_ms = 600;
    let env = Env::with_nodes(c.clone(), &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "10"));
    // The Binding is refused for good after the annotations were written, and the process
    // stops before it can clean up: a reservation is left on the pod.
    let hold = Hold::new();
    env.api
        .inject(binding_fault("p", FaultAction::Hold(hold.clone())));
    let (s, _) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500);
    env.ext.stop().await;
    assert!(
        annotations(&env.api, "p").contains_key(gpushare::core::wire::POD_ANN_RESERVATION),
        "{:?}",
        annotations(&env.api, "p")
    );
    let ext = extender_over(&env.api, &c).await;
    assert_eq!(used(&inspect(ext.addr).await, "n1"), [10]);
    eventually("the stale reservation expires", || async {
        used(&inspect(ext.addr).await, "n1") == [0]
    })
    .await;
    eventually("its annotation is cleared", || async {
        !annotations(&env.api, "p").contains_key(gpushare::core::wire::POD_ANN_RESERVATION)
    })
    .await;
    let q = create(&env.api, pending_pod("q", "10"));
    let (s, r) = bind(ext.addr, &q, "n1").await;
    assert_eq!(s, 200, "{r}");
    ext.stop().await;
}

/// A Binding answered 500 (`etcdserver: request timed out`) that etcd commits later is an
/// unknown outcome, not a refusal: the reservation stays until the API settles it.
#[tokio::test]
async fn a_binding_answered_500_and_applied_later_keeps_its_memory() {
    let mut c = config();
    c.extender.bind_timeout_ms = 300;
    let env = Env::with_nodes(c, &[("n1", 1, 16)]).await;
    let p = create(&env.api, pending_pod("p", "10"));
    let hold = Hold::new();
    env.api.inject(
        binding_fault(
            "p",
            FaultAction::ApplyOnRelease {
                hold: hold.clone(),
                answer: Some(500),
            },
        )
        .times(1_000),
    );
    let (s, r) = bind(env.addr(), &p, "n1").await;
    assert_eq!(s, 500, "{r}");
    let q = create(&env.api, pending_pod("q", "10"));
    let (s, r) = bind(env.addr(), &q, "n1").await;
    assert_eq!(s, 500, "p's memory was released on a 500: {r}");
    hold.release();
    eventually("p's Binding lands", || async {
        bound_to(&env.api, "p").as_deref() == Some("n1")
    })
    .await;
    assert_eq!(bound_to(&env.api, "q"), None);
    assert!(annotated_per_gpu(&env.api).values().all(|u| *u <= 16));
    env.wait_used("the ledger holds p once", "n1", &[10]).await;
    env.api.clear_faults();
    env.ext.stop().await;
}
