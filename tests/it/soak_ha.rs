//! `make soak` (HA): three extender replicas, each in a runtime of its own, and a
//! kube-scheduler played by tasks that filter and bind batches of pods through any live
//! replica. Three times, while binds are in flight (Bindings held at the API server), the
//! leader is killed (its runtime dropped: no drain, the Lease kept, as after `kill -9`) and a
//! fresh replica joins. The first and third rounds' held Bindings never land (their client is
//! gone); the second round's land late. Every pod of a batch fits (a batch asks at most half
//! the cluster), so every one must be bound; the time from the new leader's first answer until
//! the last pod of the batch is bound is measured and printed (no timing is asserted: the
//! window a stuck pod would wait out, `bind_settle_ms`, is 60 s). Throughout, no GPU is
//! over-committed in the API's annotations; at the end the leader's ledger equals them.
//!
//! `#[ignore]`d: `make soak` runs it (SOAK_HA_PODS per batch, default 40; SOAK_SEED).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, Hold};
use serde_json::{Value, json};

use crate::support::extender_cluster::{bind_via, extender_config, sandbox};
use crate::support::extender_http::http;
use crate::support::isolated_extender::Isolated;
use crate::support::ledger_truth::{assert_not_overcommitted, converge};
use crate::support::objects::pending_pod;
use crate::support::soak::{Rng, env_num};
use crate::support::wait::poll;

const NODES: usize = 8;
const GPUS: u64 = 2;
const UNITS: u64 = 16;
const DRIVERS: usize = 6;

/// The replicas alive now.
#[derive(Default)]
struct Live(RwLock<Vec<(String, Isolated)>>);

impl Live {
    fn addrs(&self) -> Vec<SocketAddr> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(_, r)| r.addr)
            .collect()
    }

    /// The identity and address of the replica that leads (synced), if one does.
    fn leader(&self) -> Option<(String, SocketAddr)> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(_, r)| r.state.is_ready())
            .map(|(id, r)| (id.clone(), r.addr))
    }

    fn kill(&self, identity: &str) {
        let mut live = self.0.write().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = live.iter().position(|(id, _)| id == identity) {
            let (_, r) = live.remove(i);
            r.kill();
        }
    }
}

fn node_names() -> Vec<String> {
    (0..NODES).map(|n| format!("node-{n}")).collect()
}

fn bound(api: &ApiServer, name: &str) -> bool {
    api.get_object("pods", Some("default"), name)
        .is_some_and(|p| {
            p["spec"]["nodeName"]
                .as_str()
                .is_some_and(|n| !n.is_empty())
        })
}

/// One scheduling attempt of pod `name` as kube-scheduler makes it: filter through `via`,
/// then bind to the first node that passes. Whether it bound.
async fn schedule(api: &ApiServer, via: SocketAddr, name: &str) -> bool {
    let Some(pod) = api.get_object("pods", Some("default"), name) else {
        return false;
    };
    let body = json!({ "Pod": pod, "NodeNames": node_names() });
    let url = format!("http://{via}/gpushare-scheduler/filter");
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        http(
            http::Method::POST,
            &url,
            Some(serde_json::to_vec(&body).unwrap_or_default()),
        ),
    )
    .await;
    let Ok(Some((200, body))) = answer else {
        return false;
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(node) = v["NodeNames"]
        .as_array()
        .and_then(|n| n.first())
        .and_then(Value::as_str)
    else {
        return false;
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), bind_via(api, via, name, node)).await,
        Ok(Some(200))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long: make soak"]
async fn soak_ha_leader_killed_mid_binds_three_times() {
    let batch = env_num("SOAK_HA_PODS", 40) as usize;
    let seed = env_num("SOAK_SEED", 0x005e_ed15);
    let started = std::time::Instant::now();
    let api = sandbox(NODES, GPUS, UNITS).await;
    let config = extender_config(true);
    let live = Arc::new(Live::default());
    for i in 0..3 {
        let id = format!("replica-{i}");
        let r = Isolated::start(&api, &config, &id, None).await;
        live.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, r));
    }
    let mut rng = Rng(seed);
    let mut report = Vec::new();
    let binds = Arc::new(AtomicUsize::new(0));
    for round in 1..=3usize {
        poll("a synced leader", Duration::from_secs(60), || async {
            live.leader().ok_or("nobody leads")
        })
        .await;
        // A batch asks at most half the cluster (1-3 units each): every pod fits.
        let names: Vec<String> = (0..batch)
            .map(|i| {
                let name = format!("r{round}-{i:03}");
                api.create_object(pending_pod(&name, 1 + rng.below(3)))
                    .expect("a pod");
                name
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let names = Arc::new(names);
        let mut drivers = Vec::new();
        for d in 0..DRIVERS {
            let (api, live, names, stop, binds) = (
                api.clone(),
                live.clone(),
                names.clone(),
                stop.clone(),
                binds.clone(),
            );
            drivers.push(tokio::spawn(async move {
                let mut rng = Rng(seed ^ ((round * 16 + d) as u64 + 1));
                while !stop.load(Ordering::Relaxed) {
                    let pending: Vec<&String> = names
                        .iter()
                        .skip(d)
                        .step_by(DRIVERS)
                        .filter(|n| !bound(&api, n))
                        .collect();
                    if pending.is_empty() {
                        return;
                    }
                    for name in pending {
                        let addrs = live.addrs();
                        if addrs.is_empty() {
                            break;
                        }
                        let via = addrs[rng.below(addrs.len() as u64) as usize];
                        if schedule(&api, via, name).await {
                            binds.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // kube-scheduler's backoff before the unschedulable pods' next try.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }));
        }
        // Mid-binds: the next Bindings are held at the API server, then the leader dies.
        poll(
            "a third of the batch bound",
            Duration::from_secs(120),
            || async {
                let n = names.iter().filter(|n| bound(&api, n)).count();
                if n >= batch / 3 { Ok(()) } else { Err(n) }
            },
        )
        .await;
        let hold = Hold::new();
        let action = if round == 2 {
            FaultAction::ApplyOnRelease {
                hold: hold.clone(),
                answer: None,
            }
        } else {
            FaultAction::Hold(hold.clone())
        };
        api.inject(Fault::new(Some(http::Method::POST), "/binding", action).times(3));
        let _ = tokio::time::timeout(Duration::from_secs(20), hold.wait_reached(1)).await;
        let in_flight = hold.reached();
        let (old, _) = live.leader().expect("a leader");
        live.kill(&old);
        // The new leader's first answer.
        let (new, _) = poll("a new leader", Duration::from_secs(60), || async {
            live.leader().ok_or("nobody leads yet")
        })
        .await;
        let answered = std::time::Instant::now();
        let id = format!("replica-{}", 2 + round);
        let fresh = Isolated::start(&api, &config, &id, None).await;
        live.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, fresh));
        api.clear_faults();
        hold.release();
        poll(
            "every pod of the batch bound",
            Duration::from_secs(180),
            || async {
                assert_not_overcommitted(&api, UNITS);
                let left: Vec<&String> = names.iter().filter(|n| !bound(&api, n)).collect();
                if left.is_empty() {
                    Ok(())
                } else {
                    Err(format!(
                        "{} unbound: {:?}",
                        left.len(),
                        left.iter().take(5).collect::<Vec<_>>()
                    ))
                }
            },
        )
        .await;
        let took = answered.elapsed();
        stop.store(true, Ordering::Relaxed);
        for d in drivers {
            let _ = d.await;
        }
        assert_not_overcommitted(&api, UNITS);
        report.push(format!(
            "failover {round}: {old} killed with {in_flight} Binding(s) held at the API server \
             ({}); {new} leads; all {batch} pods of the batch bound {:.1} s after its first answer",
            if round == 2 {
                "landing late"
            } else {
                "never landing"
            },
            took.as_secs_f64()
        ));
        if round < 3 {
            for name in names.iter() {
                let _ = api.delete_object("pods", Some("default"), name);
            }
        }
    }
    let (_, leader) = live.leader().expect("a leader");
    converge(&api, leader).await;
    assert_not_overcommitted(&api, UNITS);
    for line in &report {
        eprintln!("soak (HA): {line}");
    }
    eprintln!(
        "soak (HA): {} binds answered 200 over three failovers on {NODES} nodes × {GPUS} GPUs; \
         0 over-commits; bind_settle_ms {} ms; {:.1} s",
        binds.load(Ordering::Relaxed),
        config.extender.bind_settle_ms,
        started.elapsed().as_secs_f64()
    );
    let replicas: Vec<(String, Isolated)> =
        std::mem::take(&mut *live.0.write().unwrap_or_else(|e| e.into_inner()));
    for (_, r) in replicas {
        r.stop().await;
    }
}
