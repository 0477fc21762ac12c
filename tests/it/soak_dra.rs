//! `make soak` (DRA): claims of many pods prepared and unprepared on one node's DRA plugin
//! (in-process, on fake GPUs) by the sandbox DRA kubelet, allocated by the sandbox allocator,
//! while claim reads are held at the API server (a `Hold`) or answered 500, and the plugin is
//! killed (its runtime dropped: no shutdown, sockets and files left as after `kill -9`) and
//! started again three times. Throughout, no GPU holds more than it has, in the API's
//! allocations nor in the plugin's checkpoint; while a claim's read is held, a call for
//! another claim is answered (the held read is released only after it); at the end, once
//! every pod has finished, no CDI spec and no checkpoint record is left. Prints the counts.
//!
//! `#[ignore]`d: `make soak` runs it (SOAK_DRA_PODS, default 200; SOAK_SEED).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use gpushare::config::Config;
use gpushare::core::wire::DRA_DRIVER_NAME;
use gpushare::dra::checkpoint::Checkpoint;
use gpushare::dra::role;
use gpushare::gpu::fake::FakeBackend;
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, Hold};
use gpushare_sandbox::dra_allocator::DraAllocator;
use serde_json::Value;
use tokio::sync::oneshot;

use crate::support::dra_node::{self, NODE};
use crate::support::soak::{Rng, env_num};
use crate::support::wait::poll;

const GPUS: &str = "4x16GiB";
const GIB: u64 = 1 << 30;
const GPU_BYTES: u64 = 16 * GIB;
const WORKERS: usize = 8;
/// Live pods per worker before it finishes its oldest.
const LIVE_PER_WORKER: usize = 6;

#[derive(Default)]
struct Counts {
    created: AtomicUsize,
    finished: AtomicUsize,
    holds: AtomicUsize,
    holds_reached: AtomicUsize,
    probes_answered: AtomicUsize,
    errors_500: AtomicUsize,
    kills: AtomicUsize,
    overcommit_checks: AtomicUsize,
}

/// The plugin in a runtime and thread of its own: `kill` drops the runtime without any of the
/// role's shutdown.
struct IsolatedPlugin {
    kill: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IsolatedPlugin {
    async fn start(api: &ApiServer, config: &Config) -> IsolatedPlugin {
        let (started_tx, started) = oneshot::channel();
        let (kill, killed) = oneshot::channel::<()>();
        let (api, config) = (api.clone(), config.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let backend: Arc<dyn gpushare::gpu::GpuBackend> =
                    Arc::new(FakeBackend::from_spec(GPUS).expect("fake GPUs"));
                let handle = role::start(&config, api.admin_client(), backend, Shutdown::never())
                    .await
                    .expect("the DRA plugin starts");
                let _ = started_tx.send(());
                let _ = killed.await;
                // Killed: no stop.
                std::mem::forget(handle);
            });
            rt.shutdown_background();
        });
        started.await.expect("the plugin started");
        IsolatedPlugin {
            kill: Some(kill),
            thread: Some(thread),
        }
    }

    fn kill(mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Bytes allocated per device in the API (every allocated claim of the node's pool).
fn allocated(api: &ApiServer) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for c in api.list_objects("resourceclaims", None) {
        for r in c["status"]["allocation"]["devices"]["results"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if r["pool"] != NODE {
                continue;
            }
            let bytes = r["consumedCapacity"]["memory"]
                .as_str()
                .and_then(|m| gpushare::core::parse_whole_quantity(m).ok())
                .unwrap_or(GPU_BYTES);
            *out.entry(r["device"].as_str().unwrap_or_default().to_string())
                .or_default() += bytes;
        }
    }
    out
}

/// Bytes the plugin's checkpoint holds per device (empty when there is none yet).
fn recorded(path: &Path) -> BTreeMap<String, u64> {
    Checkpoint::load(path)
        .ok()
        .and_then(|cp| cp.held(None).ok())
        .unwrap_or_default()
}

fn assert_no_overcommit(api: &ApiServer, checkpoint: &Path, counts: &Counts) {
    for (device, bytes) in allocated(api) {
        assert!(
            bytes <= GPU_BYTES,
            "{device} over-committed in the API: {bytes} bytes"
        );
    }
    for (device, bytes) in recorded(checkpoint) {
        assert!(
            bytes <= GPU_BYTES,
            "{device} over-committed in the plugin's checkpoint: {bytes} bytes"
        );
    }
    counts.overcommit_checks.fetch_add(1, Ordering::Relaxed);
}

fn spec_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|e| {
            e.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long: make soak"]
async fn soak_dra_claims_under_hung_and_failing_reads_and_plugin_kills() {
    let pods = env_num("SOAK_DRA_PODS", 200) as usize;
    let seed = env_num("SOAK_SEED", 0x005e_ed15);
    let started = std::time::Instant::now();
    let node = dra_node::node_with(GPUS, |c| c.node.health_check = false).await;
    let api = node.api.clone();
    let checkpoint = node.checkpoint();
    let counts = Arc::new(Counts::default());
    let mut plugin = Some(IsolatedPlugin::start(&api, &node.config).await);
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("registers");
    let sync = kubelet.spawn_sync(Duration::from_millis(50));
    let allocator = DraAllocator::new(api.admin_client()).spawn(Duration::from_millis(50));
    let done = Arc::new(AtomicBool::new(false));

    // Workers: pods of one or two containers of 1-6 GiB; each finishes its oldest past a few.
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (api, counts, next) = (api.clone(), counts.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut rng = Rng(seed ^ (w as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut live: std::collections::VecDeque<String> = Default::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pods {
                    break;
                }
                let name = format!("p{i:05}");
                let mut containers = vec![("main", 1 + rng.below(6))];
                if rng.chance(30) {
                    containers.push(("side", 1 + rng.below(3)));
                }
                dra_node::submit_containers(&api, &name, &containers);
                counts.created.fetch_add(1, Ordering::Relaxed);
                live.push_back(name);
                if live.len() > LIVE_PER_WORKER
                    && let Some(old) = live.pop_front()
                {
                    let _ = api.set_pod_phase("default", &old, "Succeeded");
                    counts.finished.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50 + rng.below(150))).await;
            }
            live
        }));
    }

    // Faults on claim reads, and the probe: while one claim's read is held, a call for
    // another claim must be answered before the hold is released.
    let faults = {
        let (api, counts, kubelet, done) =
            (api.clone(), counts.clone(), kubelet.clone(), done.clone());
        tokio::spawn(async move {
            let mut rng = Rng(seed ^ 0xfa17);
            while !done.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(20 + rng.below(40))).await;
                // A claim allocated whose pod kubelet has not prepared yet: kubelet reads it,
                // then the plugin does (the fault lets kubelet's read through).
                let waiting: Vec<String> = api
                    .list_objects("pods", Some("default"))
                    .into_iter()
                    .filter(|p| {
                        p["spec"]["nodeName"] == NODE
                            && p["status"]["phase"] != "Succeeded"
                            && kubelet
                                .prepared(p["metadata"]["uid"].as_str().unwrap_or_default())
                                .is_none()
                    })
                    .filter_map(|p| {
                        p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .collect();
                if waiting.is_empty() {
                    continue;
                }
                let name = waiting[rng.below(waiting.len() as u64) as usize].clone();
                let path = format!("/resourceclaims/{name}");
                if rng.chance(50) {
                    api.inject(
                        Fault::new(Some(http::Method::GET), path, FaultAction::Status(500))
                            .after(1)
                            .times(2),
                    );
                    counts.errors_500.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let hold = Hold::new();
                api.inject(
                    Fault::new(
                        Some(http::Method::GET),
                        path,
                        FaultAction::Hold(hold.clone()),
                    )
                    .after(1),
                );
                counts.holds.fetch_add(1, Ordering::Relaxed);
                let reached =
                    tokio::time::timeout(Duration::from_secs(2), hold.wait_reached(1)).await;
                if reached.is_ok() {
                    counts.holds_reached.fetch_add(1, Ordering::Relaxed);
                    // A call for another claim (one nobody prepared: no side effect) is
                    // answered while the read is held.
                    let probe = (
                        "default".to_string(),
                        format!("probe-{}", rng.next()),
                        "probe".to_string(),
                    );
                    let answered = tokio::time::timeout(
                        Duration::from_secs(30),
                        kubelet.unprepare_claims(DRA_DRIVER_NAME, &[probe]),
                    )
                    .await;
                    // (A plugin killed meanwhile answers with an error at once: not a wait.)
                    assert!(
                        answered.is_ok(),
                        "a call for another claim waited on the held read of claim {name}"
                    );
                    counts.probes_answered.fetch_add(1, Ordering::Relaxed);
                }
                api.clear_faults();
                hold.release();
            }
        })
    };

    // Three kills, at a quarter, half and three quarters of the pods; the checks meanwhile.
    for k in 1..=3usize {
        while counts.created.load(Ordering::Relaxed) < pods * k / 4 {
            assert_no_overcommit(&api, &checkpoint, &counts);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if let Some(p) = plugin.take() {
            p.kill();
        }
        counts.kills.fetch_add(1, Ordering::Relaxed);
        assert_no_overcommit(&api, &checkpoint, &counts);
        plugin = Some(IsolatedPlugin::start(&api, &node.config).await);
    }
    let mut live = Vec::new();
    for w in workers {
        live.extend(w.await.expect("worker"));
    }
    done.store(true, Ordering::Relaxed);
    faults.await.expect("fault injector");
    api.clear_faults();
    for name in &live {
        let _ = api.set_pod_phase("default", name, "Succeeded");
        counts.finished.fetch_add(1, Ordering::Relaxed);
    }
    assert_no_overcommit(&api, &checkpoint, &counts);

    // Every pod finished: kubelet unprepares each, the allocator releases each claim.
    let cdi = node.cdi_dir();
    poll(
        "nothing left prepared",
        Duration::from_secs(120),
        || async {
            let left: Vec<Value> = api
                .list_objects("pods", Some("default"))
                .into_iter()
                .filter(|p| {
                    kubelet
                        .prepared(p["metadata"]["uid"].as_str().unwrap_or_default())
                        .is_some()
                })
                .collect();
            let specs = spec_files(&cdi);
            let records = Checkpoint::load(&checkpoint)
                .map(|c| c.claims.len())
                .unwrap_or(0);
            if left.is_empty() && specs.is_empty() && records == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{} pods prepared, {} specs ({:?}), {records} records",
                    left.len(),
                    specs.len(),
                    specs.iter().take(3).collect::<Vec<_>>()
                ))
            }
        },
    )
    .await;
    let unallocated = api
        .list_objects("resourceclaims", None)
        .iter()
        .filter(|c| !c["status"]["allocation"].is_null())
        .count();
    sync.abort();
    allocator.abort();
    if let Some(p) = plugin.take() {
        p.kill();
    }
    let c = &counts;
    eprintln!(
        "soak (DRA): {} pods created and finished on {GPUS} ({unallocated} claims still \
         allocated at the end); claim reads held {} times ({} reached while a prepare read \
         it; {} calls for other claims answered meanwhile), answered 500 twice {} times; the \
         plugin killed and started again {} times; {} over-commit checks, 0 over-commits; \
         0 leaked specs or records; {:.1} s",
        c.created.load(Ordering::Relaxed),
        c.holds.load(Ordering::Relaxed),
        c.holds_reached.load(Ordering::Relaxed),
        c.probes_answered.load(Ordering::Relaxed),
        c.errors_500.load(Ordering::Relaxed),
        c.kills.load(Ordering::Relaxed),
        c.overcommit_checks.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    assert!(
        c.holds_reached.load(Ordering::Relaxed) > 0,
        "no read was ever held mid-prepare"
    );
    assert!(c.probes_answered.load(Ordering::Relaxed) > 0);
}
