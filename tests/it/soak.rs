//! `make soak`: pods created, bound and deleted concurrently over many nodes while faults are
//! injected at random — a PATCH or Binding applied only after the bind timeout (5% of pods), a
//! scheduler hanging up mid-bind and a Binding whose connection drops (2% each), a forced
//! re-list (cut watch + compacted history → 410) about every 500 events, and three extender
//! restarts (at a quarter, half and three quarters of the pods) with late PATCHes and
//! Bindings still in flight at the API server: the new process must count what the old one
//! reserved (`gpushare.io/reservation` on the pods) until the late writes land or expire. Throughout, no GPU is over-committed in the API's annotations nor in the
//! ledger; at the end the ledger equals the annotations and no reservation is left. Prints
//! the counts.
//!
//! `#[ignore]`d: `make soak` runs it (SOAK_PODS, default 2000; SOAK_NODES, default 50;
//! SOAK_SEED). CI runs a shorter version.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use gpushare::config::Config;
use gpushare::extender::{self, ExtenderHandle};
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};
use http::Method;
use serde_json::{Value, json};

use crate::support::extender_http::http;
use crate::support::objects::{gpu_node, pending_pod};
use crate::support::soak::{Rng, env_num};
use crate::support::wait::poll;

const GPUS_PER_NODE: u64 = 4;
const GPU_UNITS: u64 = 16;
const WORKERS: usize = 32;
/// Live pods per worker before it deletes its oldest: keeps the cluster near full.
const LIVE_PER_WORKER: usize = 20;
const BIND_TIMEOUT_MS: u64 = 1000;

#[derive(Default)]
struct Counts {
    created: AtomicUsize,
    bound: AtomicUsize,
    deleted: AtomicUsize,
    unschedulable: AtomicUsize,
    bind_calls: AtomicUsize,
    bind_errors: AtomicUsize,
    late_faults: AtomicUsize,
    hang_ups: AtomicUsize,
    dropped: AtomicUsize,
    relists: AtomicUsize,
    restarts: AtomicUsize,
    in_flight_at_restart: AtomicUsize,
    overcommit_checks: AtomicUsize,
}

fn config() -> Config {
    let mut c = Config::default();
    c.extender.bind_address = [127, 0, 0, 1].into();
    c.extender.port = 0;
    c.extender.bind_timeout_ms = BIND_TIMEOUT_MS;
    c.extender.bind_settle_ms = 5_000;
    c.doctor.skip = true;
    c
}

async fn start(api: &ApiServer) -> ExtenderHandle {
    let ext = extender::start(&config(), api.admin_client(), Shutdown::never())
        .await
        .expect("extender starts");
    ext.wait_ready().await.expect("extender becomes ready");
    ext
}

/// One request; `None` when the extender cannot be reached (restarting) or the client gave
/// up after `patience`.
async fn post(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    patience: Duration,
) -> Option<(u16, Value)> {
    let url = format!("http://{addr}{path}");
    let answer = tokio::time::timeout(
        patience,
        http(Method::POST, &url, Some(body.to_string().into_bytes())),
    )
    .await;
    let (status, body) = answer.ok().flatten()?;
    Some((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// Memory per (node, GPU) from the annotations of bound, running pods.
fn annotated(api: &ApiServer) -> BTreeMap<(String, u64), u64> {
    let mut per_gpu = BTreeMap::new();
    for p in api.list_objects("pods", None) {
        let a = &p["metadata"]["annotations"];
        let (Some(node), Some(idx), Some(mem)) = (
            p["spec"]["nodeName"].as_str(),
            a["ALIYUN_COM_GPU_MEM_IDX"]
                .as_str()
                .and_then(|v| v.parse().ok()),
            a["ALIYUN_COM_GPU_MEM_POD"]
                .as_str()
                .and_then(|v| v.parse::<u64>().ok()),
        ) else {
            continue;
        };
        if matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")) {
            continue;
        }
        *per_gpu.entry((node.to_string(), idx)).or_default() += mem;
    }
    per_gpu
}

async fn ledger(addr: SocketAddr) -> Option<BTreeMap<(String, u64), u64>> {
    let url = format!("http://{addr}/gpushare-scheduler/inspect");
    let (_, body) = http(Method::GET, &url, None).await?;
    let v: Value = serde_json::from_slice(&body).ok()?;
    let mut per_gpu = BTreeMap::new();
    for n in v["nodes"].as_array()? {
        for d in n["devs"].as_array()? {
            let used = d["usedGPU"].as_u64()?;
            assert!(used <= d["totalGPU"].as_u64()?, "ledger over capacity: {n}");
            if used > 0 {
                per_gpu.insert((n["name"].as_str()?.to_string(), d["id"].as_u64()?), used);
            }
        }
    }
    Some(per_gpu)
}

/// The pods `/inspect` shows that the API's annotations do not count where it does, with what
/// the API holds for each (for the failure message).
async fn ledger_only(api: &ApiServer, addr: SocketAddr) -> String {
    let url = format!("http://{addr}/gpushare-scheduler/inspect");
    let Some((_, body)) = http(Method::GET, &url, None).await else {
        return String::new();
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut out = Vec::new();
    for n in v["nodes"].as_array().into_iter().flatten() {
        for d in n["devs"].as_array().into_iter().flatten() {
            for p in d["pods"].as_array().into_iter().flatten() {
                let name = p["name"].as_str().unwrap_or_default();
                let obj = api.get_object("pods", Some("default"), name);
                let here = obj.as_ref().is_some_and(|o| {
                    o["spec"]["nodeName"] == n["name"]
                        && o["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"]
                            .as_str()
                            .and_then(|i| i.parse::<u64>().ok())
                            == d["id"].as_u64()
                });
                if !here {
                    out.push(format!(
                        "{}/{} {name} {p} -> API: {}",
                        n["name"],
                        d["id"],
                        obj.map_or("absent".to_string(), |o| format!(
                            "nodeName {} annotations {}",
                            o["spec"]["nodeName"], o["metadata"]["annotations"]
                        ))
                    ));
                }
            }
        }
    }
    out.join("\n")
}

fn assert_no_overcommit(api: &ApiServer) {
    for (gpu, used) in annotated(api) {
        assert!(
            used <= GPU_UNITS,
            "GPU {gpu:?} over-committed in the API: {used}; its pods:\n{}",
            pods_on(api, &gpu)
        );
    }
}

/// The pods the API shows on `gpu`, one line each (name, units, assume time, version), for a
/// failure message.
fn pods_on(api: &ApiServer, gpu: &(String, u64)) -> String {
    let mut lines = Vec::new();
    for p in api.list_objects("pods", None) {
        let a = &p["metadata"]["annotations"];
        let idx = a["ALIYUN_COM_GPU_MEM_IDX"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok());
        if p["spec"]["nodeName"].as_str() == Some(gpu.0.as_str()) && idx == Some(gpu.1) {
            lines.push(format!(
                "  {} units {} assumed {} rv {} phase {}",
                p["metadata"]["name"],
                a["ALIYUN_COM_GPU_MEM_POD"],
                a["ALIYUN_COM_GPU_MEM_ASSUME_TIME"],
                p["metadata"]["resourceVersion"],
                p["status"]["phase"]
            ));
        }
    }
    lines.join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long: make soak"]
async fn soak_no_overcommit_under_random_faults() {
    let pods = env_num("SOAK_PODS", 2000) as usize;
    let nodes = env_num("SOAK_NODES", 50) as usize;
    let seed = env_num("SOAK_SEED", 0x005e_ed15);
    let started = std::time::Instant::now();
    let api = ApiServer::start().await.expect("sandbox API server starts");
    api.set_history_limit(200);
    let names: Vec<String> = (0..nodes).map(|n| format!("n{n:03}")).collect();
    for n in &names {
        api.create_object(gpu_node(n, GPUS_PER_NODE, GPU_UNITS))
            .expect("node created");
    }
    let first = start(&api).await;
    let addr = Arc::new(RwLock::new(first.addr));
    let ext = Arc::new(tokio::sync::Mutex::new(Some(first)));
    let counts = Arc::new(Counts::default());
    let next_pod = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let unknown_before_restart = Arc::new(AtomicU64::new(0));

    // Forced re-lists about every 500 events, and the over-commit watchdog.
    let chaos = {
        let (api, counts, done) = (api.clone(), counts.clone(), done.clone());
        tokio::spawn(async move {
            let mut last = api.resource_version();
            while !done.load(Ordering::SeqCst) {
                let rv = api.resource_version();
                if rv >= last + 500 {
                    last = rv;
                    api.inject(Fault::new(
                        Some(Method::GET),
                        "/api/v1/pods?",
                        FaultAction::CutWatch,
                    ));
                    counts.relists.fetch_add(1, Ordering::Relaxed);
                }
                assert_no_overcommit(&api);
                counts.overcommit_checks.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        })
    };

    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (api, addr, counts, next_pod, ext, names, unknown_before_restart) = (
            api.clone(),
            addr.clone(),
            counts.clone(),
            next_pod.clone(),
            ext.clone(),
            names.clone(),
            unknown_before_restart.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut rng = Rng((seed ^ (w as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1);
            let mut live: std::collections::VecDeque<String> = Default::default();
            loop {
                let i = next_pod.fetch_add(1, Ordering::SeqCst);
                if i >= pods {
                    break;
                }
                if pods >= 4 && [pods / 4, pods / 2, 3 * pods / 4].contains(&i) {
                    // An extender restart with the old one's late writes still in flight at
                    // the API server: they land after the new one listed.
                    let mut slot = ext.lock().await;
                    if let Some(old) = slot.take() {
                        let old_addr = *addr.read().unwrap_or_else(|p| p.into_inner());
                        unknown_before_restart
                            .fetch_add(unknown_of(old_addr).await, Ordering::SeqCst);
                        counts
                            .in_flight_at_restart
                            .fetch_add(api.late_in_flight(), Ordering::Relaxed);
                        old.stop().await;
                        let new = start(&api).await;
                        *addr.write().unwrap_or_else(|p| p.into_inner()) = new.addr;
                        *slot = Some(new);
                        counts.restarts.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let name = format!("p{i:05}");
                let mem = 1 + rng.below(8);
                let pod = api
                    .create_object(pending_pod(&name, mem))
                    .expect("pod created");
                counts.created.fetch_add(1, Ordering::Relaxed);
                // Faults for this pod.
                let late = Duration::from_millis(BIND_TIMEOUT_MS + 100 + rng.below(300));
                let mut hang_up = false;
                if rng.chance(5) {
                    let (method, path) = if rng.chance(50) {
                        (Method::PATCH, format!("/pods/{name}"))
                    } else {
                        (Method::POST, format!("/pods/{name}/binding"))
                    };
                    api.inject(Fault::new(Some(method), path, FaultAction::ApplyLate(late)));
                    counts.late_faults.fetch_add(1, Ordering::Relaxed);
                } else if rng.chance(2) {
                    api.inject(Fault::new(
                        Some(Method::POST),
                        format!("/pods/{name}/binding"),
                        FaultAction::ApplyLate(Duration::from_millis(150)),
                    ));
                    hang_up = true;
                    counts.hang_ups.fetch_add(1, Ordering::Relaxed);
                } else if rng.chance(2) {
                    let action = if rng.chance(50) {
                        FaultAction::DropConnection
                    } else {
                        FaultAction::ApplyThenDrop
                    };
                    api.inject(Fault::new(
                        Some(Method::POST),
                        format!("/pods/{name}/binding"),
                        action,
                    ));
                    counts.dropped.fetch_add(1, Ordering::Relaxed);
                }
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let mut placed = false;
                for attempt in 0..40 {
                    if api
                        .get_object("pods", Some("default"), &name)
                        .is_some_and(|p| p["spec"]["nodeName"].is_string())
                    {
                        placed = true;
                        break;
                    }
                    let a = *addr.read().unwrap_or_else(|p| p.into_inner());
                    let patience = if hang_up && attempt == 0 {
                        Duration::from_millis(50)
                    } else {
                        Duration::from_secs(30)
                    };
                    let Some((200, r)) = post(
                        a,
                        "/gpushare-scheduler/filter",
                        &json!({"Pod": pod, "NodeNames": refs}),
                        Duration::from_secs(30),
                    )
                    .await
                    else {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    };
                    let passing: Vec<String> = r["NodeNames"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|n| n.as_str().map(str::to_string))
                        .collect();
                    if passing.is_empty() {
                        // Full for now: make room, then try again.
                        if let Some(old) = live.pop_front() {
                            let _ = api.delete_object("pods", Some("default"), &old);
                            counts.deleted.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    let pick = &passing[rng.below(passing.len() as u64) as usize];
                    counts.bind_calls.fetch_add(1, Ordering::Relaxed);
                    let answer = post(
                        a,
                        "/gpushare-scheduler/bind",
                        &json!({"PodName": name, "PodNamespace": "default",
                                "PodUID": pod["metadata"]["uid"], "Node": pick}),
                        patience,
                    )
                    .await;
                    if matches!(answer, Some((200, _))) {
                        placed = true;
                        break;
                    }
                    counts.bind_errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(10 + rng.below(40))).await;
                }
                if placed {
                    counts.bound.fetch_add(1, Ordering::Relaxed);
                    live.push_back(name);
                    while live.len() > LIVE_PER_WORKER {
                        if let Some(old) = live.pop_front() {
                            let _ = api.delete_object("pods", Some("default"), &old);
                            counts.deleted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                } else {
                    counts.unschedulable.fetch_add(1, Ordering::Relaxed);
                    let _ = api.delete_object("pods", Some("default"), &name);
                    counts.deleted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for w in workers {
        w.await.expect("worker finished");
    }
    done.store(true, Ordering::SeqCst);
    chaos.await.expect("chaos task finished");
    api.clear_faults();
    assert_no_overcommit(&api);

    // The ledger converges to the annotations and no reservation is left.
    let handle = ext.lock().await.take().expect("an extender runs");
    let a = handle.addr;
    poll(
        "the ledger to converge with no reservation left",
        Duration::from_secs(60),
        || async {
            let l = ledger(a).await;
            let want = annotated(&api);
            let owners = handle.state().binds().len();
            if l.as_ref() == Some(&want) && owners == 0 {
                Ok(())
            } else {
                Err(format!(
                    "ledger {l:?}, annotations {want:?}, owners left {owners}; pods the ledger \
                     counts that the annotations do not: {}",
                    ledger_only(&api, a).await
                ))
            }
        },
    )
    .await;
    let unknown = unknown_before_restart.load(Ordering::SeqCst) + unknown_of(a).await;
    let held: u64 = annotated(&api).values().sum();
    let c = &counts;
    let n = |x: &AtomicUsize| x.load(Ordering::Relaxed);
    println!(
        "soak: {pods} pods over {nodes} nodes in {:.1} s: created {}, bound {}, deleted {}, \
         unschedulable {}; bind calls {}, bind errors {}; faults: late {}, hang-ups {}, dropped {}; \
         unknown outcomes {unknown}; forced re-lists {}, restarts {} (late writes in flight at them: {}); \
         over-commit checks {} (0 failed); \
         end: {held} units held, ledger = annotations",
        started.elapsed().as_secs_f64(),
        n(&c.created),
        n(&c.bound),
        n(&c.deleted),
        n(&c.unschedulable),
        n(&c.bind_calls),
        n(&c.bind_errors),
        n(&c.late_faults),
        n(&c.hang_ups),
        n(&c.dropped),
        n(&c.relists),
        n(&c.restarts),
        n(&c.in_flight_at_restart),
        n(&c.overcommit_checks),
    );
    assert_eq!(n(&c.created), pods);
    assert_eq!(n(&c.restarts), if pods >= 4 { 3 } else { 0 });
    handle.stop().await;
}

/// `gpushare_extender_bind_unknown_outcomes_total` of the extender at `addr` (0 if unreachable).
async fn unknown_of(addr: SocketAddr) -> u64 {
    let Some((_, body)) = http(Method::GET, &format!("http://{addr}/metrics"), None).await else {
        return 0;
    };
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with("gpushare_extender_bind_unknown_outcomes_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}
