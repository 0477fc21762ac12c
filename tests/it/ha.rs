//! High availability: Lease leader election between replicas, against the sandbox API server.
//!
//! Elector-level tests use sub-second timings (lease 2 s, renew deadline 1 s, retry 200 ms);
//! waits are on the leading flags or on polled conditions with a deadline, never sleeps.

use std::time::Duration;

use gpushare::extender::ExtenderHandle;
use gpushare::extender::leader::{AdjustableClock, LeaderElector, Leadership, LeaseTiming};
use gpushare::shutdown::{self, Trigger};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};
use tokio::sync::watch;

use crate::support::extender_cluster::{
    bind_via, extender_config, sandbox, start_extender, wait_http_ok,
};
use crate::support::extender_http::http;
use crate::support::ledger_truth::{assert_not_overcommitted, converge, truth};
use crate::support::objects::pending_pod;
use crate::support::wait::{DEADLINE, wait_until};

const NS: &str = "kube-system";
const LEASE: &str = "gpushare-ha-test";

fn timing() -> LeaseTiming {
    LeaseTiming::new(
        Duration::from_secs(2),
        Duration::from_secs(1),
        Duration::from_millis(200),
    )
    .expect("valid timing")
}

struct Candidate {
    id: &'static str,
    trigger: Trigger,
    leadership: Leadership,
}

fn candidate(api: &ApiServer, id: &'static str) -> Candidate {
    let (trigger, handle) = shutdown::channel();
    let leadership =
        LeaderElector::new(api.admin_client(), NS, LEASE, id.to_string(), timing()).spawn(handle);
    Candidate {
        id,
        trigger,
        leadership,
    }
}

/// Waits until `rx` reads `want`, or fails after [`DEADLINE`].
async fn wait_flag(rx: &mut watch::Receiver<bool>, want: bool, what: &str) {
    // (`wait_for`'s `Ref` holds the channel's read lock: drop it at once.)
    let waited = matches!(
        tokio::time::timeout(DEADLINE, rx.wait_for(|v| *v == want)).await,
        Ok(Ok(_))
    );
    assert!(waited, "timed out waiting for {what} to become {want}");
}

/// Waits for whichever of two flags turns true first; returns its index.
async fn first_leader(a: &mut watch::Receiver<bool>, b: &mut watch::Receiver<bool>) -> usize {
    let race = async {
        tokio::select! {
            _ = a.wait_for(|v| *v) => 0,
            _ = b.wait_for(|v| *v) => 1,
        }
    };
    tokio::time::timeout(DEADLINE, race)
        .await
        .expect("someone becomes leader")
}

/// Watches two flags and records whether they were ever both true at once.
fn never_both(
    mut a: watch::Receiver<bool>,
    mut b: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<bool> {
    tokio::spawn(async move {
        loop {
            if *a.borrow_and_update() && *b.borrow_and_update() {
                return false;
            }
            tokio::select! {
                r = a.changed() => if r.is_err() { return true },
                r = b.changed() => if r.is_err() { return true },
            }
        }
    })
}

fn lease_field(api: &ApiServer, field: &str) -> serde_json::Value {
    api.get_object("leases", Some(NS), LEASE)
        .and_then(|l| l.get("spec").and_then(|s| s.get(field)).cloned())
        .unwrap_or(serde_json::Value::Null)
}

/// Two candidates on one lease once one of them leads: the leader, the follower, and the
/// watch that answers whether both ever led at once.
async fn two_candidates(api: &ApiServer) -> (Candidate, Candidate, tokio::task::JoinHandle<bool>) {
    let a = candidate(api, "replica-a");
    let b = candidate(api, "replica-b");
    let overlap = never_both(a.leadership.subscribe(), b.leadership.subscribe());
    let (mut ra, mut rb) = (a.leadership.subscribe(), b.leadership.subscribe());
    let first = first_leader(&mut ra, &mut rb).await;
    let (leader, follower) = if first == 0 { (a, b) } else { (b, a) };
    (leader, follower, overlap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_leads_and_the_other_takes_over_when_the_leader_stops() {
    let api = ApiServer::start().await.expect("api server");
    let (leader, follower, overlap) = two_candidates(&api).await;
    assert!(!follower.leadership.is_leader());
    assert_eq!(lease_field(&api, "holderIdentity"), leader.id);
    assert_eq!(lease_field(&api, "leaseDurationSeconds"), 2);
    let renew = lease_field(&api, "renewTime");
    let renew = renew.as_str().unwrap_or_default();
    let micros = renew
        .strip_suffix('Z')
        .and_then(|s| s.rsplit_once('.'))
        .map(|(_, frac)| frac.len());
    assert_eq!(
        micros,
        Some(6),
        "renewTime {renew:?} is RFC 3339 with microseconds"
    );

    // Stop the leader: it releases the lease and the follower takes over.
    let mut follower_rx = follower.leadership.subscribe();
    leader.trigger.trigger();
    let leader_rx = leader.leadership.subscribe();
    tokio::time::timeout(DEADLINE, leader.leadership.join())
        .await
        .expect("the stopped leader's election task ends");
    assert!(!*leader_rx.borrow(), "a stopped replica does not lead");
    wait_flag(&mut follower_rx, true, "the follower's leading flag").await;
    assert_eq!(lease_field(&api, "holderIdentity"), follower.id);
    assert!(
        lease_field(&api, "leaseTransitions").as_i64().unwrap_or(0) >= 1,
        "a takeover counts as a transition"
    );
    follower.trigger.trigger();
    tokio::time::timeout(DEADLINE, follower.leadership.join())
        .await
        .expect("election task ends");
    assert!(overlap.await.unwrap_or(false), "two replicas led at once");
    // The last leader released the lease on its way out.
    assert_eq!(lease_field(&api, "holderIdentity"), serde_json::Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_steps_down_and_the_other_takes_over() {
    let api = ApiServer::start().await.expect("api server");
    let (leader, follower, overlap) = two_candidates(&api).await;

    // Every lease write of the leader fails from now on (its reads still work).
    api.inject(
        Fault::new(
            Some(http::Method::PUT),
            format!("fieldManager={}", leader.id),
            FaultAction::Status(500),
        )
        .times(100_000),
    );
    let mut leader_rx = leader.leadership.subscribe();
    let mut follower_rx = follower.leadership.subscribe();
    wait_flag(&mut leader_rx, false, "the partitioned leader's flag").await;
    wait_flag(&mut follower_rx, true, "the follower's flag").await;
    assert_eq!(lease_field(&api, "holderIdentity"), follower.id);

    // Heal the partition: the old leader sees a live lease held by another and follows.
    api.clear_faults();
    let lease_path = format!("/leases/{LEASE}");
    let lease_reads = |api: &ApiServer| {
        api.requests()
            .iter()
            .filter(|r| r.method == http::Method::GET && r.path.ends_with(&lease_path))
            .count()
    };
    let before = lease_reads(&api);
    wait_until("ten more lease reads after the heal", || {
        lease_reads(&api) >= before + 10
    })
    .await;
    assert!(!leader.leadership.is_leader());
    assert!(follower.leadership.is_leader());
    leader.trigger.trigger();
    follower.trigger.trigger();
    leader.leadership.join().await;
    follower.leadership.join().await;
    assert!(overlap.await.unwrap_or(false), "two replicas led at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_lease_of_a_stranger_is_respected_until_released() {
    let api = ApiServer::start().await.expect("api server");
    let now = k8s_openapi::jiff::Timestamp::now();
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(now);
    let stamp = serde_json::to_value(&now).expect("micro time");
    api.create_object(serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": { "name": LEASE, "namespace": NS },
        "spec": { "holderIdentity": "stranger", "leaseDurationSeconds": 3600,
                  "acquireTime": stamp, "renewTime": stamp },
    }))
    .expect("seed lease");
    let me = candidate(&api, "replica-a");
    let lease_path = format!("/leases/{LEASE}");
    wait_until("three reads of the lease", || {
        api.requests()
            .iter()
            .filter(|r| r.method == http::Method::GET && r.path.ends_with(&lease_path))
            .count()
            >= 3
    })
    .await;
    assert!(!me.leadership.is_leader());
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.method == http::Method::PUT && r.path.ends_with(&lease_path)),
        "a live foreign lease is never written"
    );
    // The stranger releases it (clears holderIdentity in place, as client-go's release does;
    // deleting and re-creating it would race our own create): we take it.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(api.admin_client(), NS);
    leases
        .patch(
            LEASE,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"holderIdentity": null}})),
        )
        .await
        .expect("release the stranger's lease");
    let mut rx = me.leadership.subscribe();
    wait_flag(&mut rx, true, "our flag").await;
    assert_eq!(lease_field(&api, "holderIdentity"), me.id);
    me.trigger.trigger();
    me.leadership.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_clock_is_20_s_behind_keeps_its_lease() {
    // Expiry is judged by each candidate's own clock since it saw the record change; the
    // holder's renewTime (20 s "old" here) is never compared with a wall clock. Before, a
    // renewTime 20 s behind looked expired to everyone, and so did any lease to a candidate
    // whose clock ran ahead.
    let api = ApiServer::start().await.expect("api server");
    let behind = AdjustableClock::new();
    behind.set_wall_offset(k8s_openapi::jiff::SignedDuration::from_secs(-20));
    let (holder_stop, handle) = shutdown::channel();
    let holder = LeaderElector::new(api.admin_client(), NS, LEASE, "slow-clock".into(), timing())
        .with_clock(behind)
        .spawn(handle);
    let mut rx = holder.subscribe();
    wait_flag(&mut rx, true, "the slow-clocked holder's flag").await;
    let ahead = AdjustableClock::new();
    ahead.set_wall_offset(k8s_openapi::jiff::SignedDuration::from_secs(20));
    let (fast_stop, handle) = shutdown::channel();
    let fast = LeaderElector::new(api.admin_client(), NS, LEASE, "fast-clock".into(), timing())
        .with_clock(ahead)
        .spawn(handle);
    let plain = candidate(&api, "plain-clock");
    let overlap_fast = never_both(holder.subscribe(), fast.subscribe());
    let overlap_plain = never_both(holder.subscribe(), plain.leadership.subscribe());
    // Five lease durations' worth of rounds by the two challengers (retry 200 ms, lease 2 s).
    let lease_path = format!("/leases/{LEASE}");
    let reads = |api: &ApiServer| {
        api.requests()
            .iter()
            .filter(|r| r.method == http::Method::GET && r.path.ends_with(&lease_path))
            .count()
    };
    let before = reads(&api);
    wait_until("100 more lease reads", || reads(&api) >= before + 100).await;
    assert!(holder.is_leader(), "the holder kept its lease");
    assert!(!fast.is_leader() && !plain.leadership.is_leader());
    assert_eq!(lease_field(&api, "holderIdentity"), "slow-clock");
    assert_eq!(
        lease_field(&api, "leaseTransitions"),
        0,
        "nobody took it over"
    );
    holder_stop.trigger();
    fast_stop.trigger();
    plain.trigger.trigger();
    holder.join().await;
    fast.join().await;
    plain.leadership.join().await;
    assert!(
        overlap_fast.await.unwrap_or(false),
        "two replicas led at once"
    );
    assert!(
        overlap_plain.await.unwrap_or(false),
        "two replicas led at once"
    );
}

async fn wait_ready_or_leading(a: &ExtenderHandle, b: &ExtenderHandle) -> usize {
    let (mut ra, mut rb) = (a.state().ready_watch(), b.state().ready_watch());
    first_leader(&mut ra, &mut rb).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_between_two_extenders_never_double_allocates() {
    const UNITS: u64 = 8;
    let api = sandbox(4, 2, UNITS).await;
    let config = extender_config(true);
    let a = start_extender(&api, &config).await;
    let b = start_extender(&api, &config).await;
    let first = wait_ready_or_leading(&a, &b).await;
    let (leader, standby) = if first == 0 { (a, b) } else { (b, a) };

    // The standby is Ready once it reaches the ready leader (it learns the new holder at its
    // next Lease read: wait for that, not for the leader's readiness alone), and then
    // forwards the scheduling verbs to it.
    let standby_url = format!("http://{}", standby.addr);
    wait_http_ok(&format!("{standby_url}/readyz")).await;
    let filter = http(
        http::Method::POST,
        &format!("{standby_url}/gpushare-scheduler/filter"),
        Some(br#"{"Pod":{"metadata":{"name":"x"}},"NodeNames":["node-0"]}"#.to_vec()),
    )
    .await;
    assert_eq!(filter.map(|r| r.0), Some(200));
    let healthz = http(http::Method::GET, &format!("{standby_url}/healthz"), None).await;
    assert_eq!(healthz.map(|r| r.0), Some(200));
    // The leader gauge tells dashboards which replica's ledger to count.
    for (addr, want) in [(standby.addr, "0"), (leader.addr, "1")] {
        let page = http(http::Method::GET, &format!("http://{addr}/metrics"), None)
            .await
            .map(|r| String::from_utf8_lossy(&r.1).into_owned())
            .unwrap_or_default();
        assert!(
            page.contains(&format!("\ngpushare_extender_leader {want}\n")),
            "{addr}: {page}"
        );
    }

    // 48 pods of 3 units for 4 nodes × 2 GPUs × 8 units: far more than fits.
    let names: Vec<String> = (0..48).map(|i| format!("job-{i:02}")).collect();
    for n in &names {
        api.create_object(pending_pod(n, 3)).expect("seed pod");
    }
    // Phase 1: the leader binds some.
    let mut ok_before = 0;
    for (i, n) in names[..8].iter().enumerate() {
        if bind_via(&api, leader.addr, n, &format!("node-{}", i % 4)).await == Some(200) {
            ok_before += 1;
        }
    }
    assert!(ok_before > 0, "the leader binds");

    // Phase 2: binds at both replicas while the leader stops.
    let api_for_binds = api.clone();
    let (leader_addr, standby_addr) = (leader.addr, standby.addr);
    let rest: Vec<String> = names[8..].to_vec();
    let driver = tokio::spawn(async move {
        let mut outcomes = Vec::new();
        for (i, n) in rest.iter().enumerate() {
            let node = format!("node-{}", i % 4);
            let at = if i % 2 == 0 {
                leader_addr
            } else {
                standby_addr
            };
            let first = bind_via(&api_for_binds, at, n, &node).await;
            // What kube-scheduler does after an error: try again (the Service now routes to
            // whoever is ready).
            let second = if first == Some(200) {
                None
            } else {
                let other = if at == leader_addr {
                    standby_addr
                } else {
                    leader_addr
                };
                bind_via(&api_for_binds, other, n, &node).await
            };
            outcomes.push((first, second));
        }
        outcomes
    });
    let mut standby_ready = standby.state().ready_watch();
    leader.stop().await;
    // (The `Ref` that `wait_for` returns holds the channel's read lock: never keep it.)
    let took_over = matches!(
        tokio::time::timeout(DEADLINE, standby_ready.wait_for(|r| *r)).await,
        Ok(Ok(_))
    );
    assert!(took_over, "the standby takes over");
    let outcomes = driver.await.expect("driver");
    for (first, second) in &outcomes {
        for s in [first, second].into_iter().flatten() {
            assert!(
                matches!(s, 200 | 500 | 503),
                "a bind answered {s}; expected 200, 500 (does not fit) or 503 (no leader reachable)"
            );
        }
    }
    // After the takeover, the new leader binds what still fits.
    let mut ok_after = 0;
    for (i, n) in names.iter().enumerate() {
        let bound = api
            .get_object("pods", Some("default"), n)
            .and_then(|p| p["spec"]["nodeName"].as_str().map(str::to_string));
        if bound.is_none()
            && bind_via(&api, standby.addr, n, &format!("node-{}", i % 4)).await == Some(200)
        {
            ok_after += 1;
        }
    }
    let holdings = truth(&api);
    let used: u64 = holdings.values().flat_map(|p| p.values()).sum();
    assert!(used > 0 && ok_after + ok_before > 0);
    assert_not_overcommitted(&api, UNITS);
    // The new leader's ledger is the annotations' truth.
    converge(&api, standby.addr).await;
    standby.stop().await;
}
