//! Watch reconnects never lose or double-count a pod: while pods are created, bound (by the
//! extender and by others), finished and deleted, the pod watch is cut again and again and
//! the API server keeps so little history that reconnects get `410 Gone` and re-list. Then
//! the extender's `/inspect` ledger must equal what the API server's pods say.

use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};

use crate::support::extender_cluster::{bind_via, extender_config, sandbox, start_extender};
use crate::support::ledger_truth::{converge, truth};
use crate::support::objects::{bound_pod, pending_pod};

const NODES: usize = 10;
const GPUS: u64 = 4;
const UNITS: u64 = 16;
const OPS: usize = 300;

/// A deterministic xorshift: the same churn every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x % n.max(1) as u64) as usize
    }
}

/// Someone else's pod `name` appears, already bound and annotated on a random node and GPU;
/// it is live from then on.
fn create_bound(api: &ApiServer, rng: &mut Rng, name: String, live: &mut Vec<String>) {
    let node = format!("node-{}", rng.below(NODES));
    let gpu = rng.below(GPUS as usize) as u32;
    api.create_object(bound_pod(&name, &node, gpu, 1, UNITS))
        .expect("create bound pod");
    live.push(name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_watches_and_410s_never_lose_or_double_count_a_pod() {
    let api = sandbox(NODES, GPUS, UNITS).await;
    // Reconnects from an old resourceVersion fall outside this history: 410 Gone, re-list.
    api.set_history_limit(8);
    let ext = start_extender(&api, &extender_config(false)).await;
    ext.wait_ready().await.expect("ready");

    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<String> = Vec::new();
    let mut pending: Vec<String> = Vec::new();
    let mut cuts = 0;
    for op in 0..OPS {
        match rng.below(10) {
            // Someone else's pod appears, already bound and annotated.
            0..=2 => {
                create_bound(&api, &mut rng, format!("other-{op}"), &mut live);
            }
            // A pod to schedule appears.
            3..=4 => {
                let name = format!("job-{op}");
                api.create_object(pending_pod(&name, 1 + rng.below(3) as u64))
                    .expect("create pending pod");
                pending.push(name);
            }
            // The extender binds one.
            5..=6 if !pending.is_empty() => {
                let name = pending.swap_remove(rng.below(pending.len()));
                let node = format!("node-{}", rng.below(NODES));
                let status = bind_via(&api, ext.addr, &name, &node).await;
                assert!(
                    matches!(status, Some(200) | Some(500)),
                    "bind answered {status:?}"
                );
                live.push(name);
            }
            // A pod finishes.
            7 if !live.is_empty() => {
                let name = live[rng.below(live.len())].clone();
                api.set_pod_phase("default", &name, "Succeeded")
                    .expect("finish pod");
            }
            // A pod is deleted.
            _ if !live.is_empty() => {
                let name = live.swap_remove(rng.below(live.len()));
                api.delete_object("pods", Some("default"), &name)
                    .expect("delete pod");
            }
            _ => {}
        }
        if op % 15 == 7 {
            // Hold the reconnect back a moment, cut the open pod watch, and make more events
            // than the server keeps meanwhile: the reconnect's resourceVersion is gone (410)
            // and the extender must re-list.
            api.inject(Fault::new(
                Some(http::Method::GET),
                "/api/v1/pods?",
                FaultAction::Delay(std::time::Duration::from_millis(300)),
            ));
            api.inject(Fault::new(None, "/api/v1/pods?", FaultAction::CutWatch));
            for burst in 0..12 {
                create_bound(&api, &mut rng, format!("burst-{op}-{burst}"), &mut live);
            }
            cuts += 1;
        }
    }
    assert!(cuts >= 10);
    api.clear_faults();
    converge(&api, ext.addr).await;
    // Something was actually counted: the comparison is not between two empty ledgers.
    assert!(!truth(&api).is_empty());
    // The watch really was cut and re-listed: more than one list of pods was served.
    let lists = api
        .requests()
        .iter()
        .filter(|r| r.path == "/api/v1/pods" && !r.query.contains("watch=true"))
        .count();
    assert!(lists > 1, "the pod watch never re-listed ({lists} lists)");
    ext.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_bound_and_finished_while_the_watch_is_down_releases_its_memory() {
    let api = sandbox(1, 1, UNITS).await;
    api.set_history_limit(4);
    let ext = start_extender(&api, &extender_config(false)).await;
    ext.wait_ready().await.expect("ready");
    api.create_object(pending_pod("short-job", 4))
        .expect("create pod");
    // The pod watch goes down and stays down (lists and watches of pods answer 500).
    api.inject(
        Fault::new(
            Some(http::Method::GET),
            "/api/v1/pods?",
            FaultAction::Status(500),
        )
        .times(1_000_000),
    );
    api.inject(Fault::new(None, "/api/v1/pods?", FaultAction::CutWatch));
    // Meanwhile the pod is bound by the extender, runs and finishes; more events than the
    // server keeps follow, so the reconnect must re-list and sees only the final state.
    assert_eq!(
        bind_via(&api, ext.addr, "short-job", "node-0").await,
        Some(200)
    );
    api.set_pod_phase("default", "short-job", "Succeeded")
        .expect("finish");
    for i in 0..8 {
        api.create_object(pending_pod(&format!("filler-{i}"), 1))
            .expect("filler");
    }
    api.clear_faults();
    // Nothing holds memory any more: the ledger must say so too.
    converge(&api, ext.addr).await;
    ext.stop().await;
}
