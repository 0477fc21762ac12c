//! `gpushare demo`: the newcomer's walkthrough must hold every expectation, in-process and as
//! the real binary.

use crate::support::{run, stderr, stdout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_scenario_holds_every_expectation() {
    let mut out = Vec::new();
    let outcome = gpushare::demo::run_scenario("2x16GiB", &mut out, false)
        .await
        .expect("the demo runs");
    let text = String::from_utf8_lossy(&out);
    assert!(
        outcome.failures.is_empty(),
        "{:?}\n{text}",
        outcome.failures
    );
    assert_eq!(outcome.checks, 5, "{text}");
    assert!(text.contains("bind chose GPU 1"), "{text}");
    assert!(
        text.contains("0/1 nodes are available: 1 Insufficient GPU Memory in one device."),
        "{text}"
    );
    assert!(text.contains("24/32 (75%)"), "{text}");
}

#[test]
fn the_demo_binary_exits_zero_and_rejects_bad_gpus() {
    let out = run(&["demo"]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("All 5 expectations held."),
        "{}",
        stdout(&out)
    );
    let out = run(&["demo", "--fake-gpus", "1x16GiB"]);
    assert_eq!(out.status.code(), Some(1));
    // A value that is no GPU description is a bad command line.
    let out = run(&["demo", "--fake-gpus", "lots"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(stderr(&out).contains("--fake-gpus"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_managed_demo_routes_a_gpu_pod_and_refuses_a_malformed_one() {
    let mut out = Vec::new();
    let outcome = gpushare::demo::run_managed_scenario(&mut out)
        .await
        .expect("the managed demo runs");
    let text = String::from_utf8_lossy(&out);
    assert!(
        outcome.failures.is_empty(),
        "{:?}\n{text}",
        outcome.failures
    );
    assert_eq!(outcome.checks, 6, "{text}");
    assert!(
        text.contains("stored with spec.schedulerName: gpushare-scheduler"),
        "{text}"
    );
    assert!(
        text.contains("requests (2) differ from limits (4)"),
        "{text}"
    );
    let out = run(&["demo", "--managed"]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("All 6 expectations held."),
        "{}",
        stdout(&out)
    );
}
