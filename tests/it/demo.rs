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

/// Demo 1 and demo 2 on the DRA path: binpack puts the three half-GPU claims on GPU 0, GPU 0,
/// GPU 1 (first fit over the slice order), and a whole-GPU claim stays pending with 16 GiB
/// free on the node in two halves. The binary's `--dra` runs the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_demo_places_by_binpack_and_leaves_an_unfittable_claim_pending() {
    let mut out = Vec::new();
    let outcome = gpushare::demo::run_dra_scenario("2x16GiB", &mut out)
        .await
        .expect("the DRA demo runs");
    let text = String::from_utf8_lossy(&out);
    assert!(
        outcome.failures.is_empty(),
        "{:?}\n{text}",
        outcome.failures
    );
    assert_eq!(outcome.checks, 4, "{text}");
    assert!(text.contains("binpack-3 runs on GPU 1"), "{text}");
    let out = run(&["demo", "--dra"]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("All 4 expectations held."),
        "{}",
        stdout(&out)
    );
    // GPUs of three sizes: the slice's order makes first fit place each claim where the
    // extender's best fit would (the smallest GPU that fits first).
    let mut out = Vec::new();
    let outcome = gpushare::demo::run_dra_scenario("8GiB,32GiB,4GiB", &mut out)
        .await
        .expect("the DRA demo runs");
    let text = String::from_utf8_lossy(&out);
    assert!(
        outcome.failures.is_empty(),
        "{:?}\n{text}",
        outcome.failures
    );
    assert!(text.contains("binpack-1 runs on GPU 2"), "{text}");
}

/// `gpushare demo --keep-running` stopped by SIGTERM (systemd, `kill`, a closing terminal)
/// cleans up as Ctrl-C does: it exits 0 and its sandbox directory (the kubeconfig it printed)
/// is gone.
#[test]
fn the_kept_demo_cleans_up_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::sync::mpsc;
    use std::time::Duration;

    let mut child = Command::new(crate::support::bin())
        .args(["demo", "--keep-running"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the gpushare binary starts");
    let pid = child.id().to_string();
    let stdout = child.stdout.take().expect("piped stdout");
    let (lines, seen) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let kill = |signal: &str| {
        let _ = Command::new("kill").args([signal, &pid]).status();
    };
    let mut kubeconfig = None;
    while let Ok(line) = seen.recv_timeout(Duration::from_secs(120)) {
        if let Some(path) = line.trim().strip_prefix("export KUBECONFIG=") {
            kubeconfig = Some(std::path::PathBuf::from(path));
        }
        if line.starts_with("Press Ctrl-C") {
            break;
        }
    }
    let Some(kubeconfig) = kubeconfig else {
        kill("-KILL");
        panic!("the demo never said it keeps running");
    };
    assert!(kubeconfig.exists(), "{}", kubeconfig.display());
    kill("-TERM");
    let (done, exited) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait());
    });
    let status = match exited.recv_timeout(Duration::from_secs(60)) {
        Ok(status) => status.expect("waiting for the demo"),
        Err(_) => {
            kill("-KILL");
            panic!("the demo did not stop on SIGTERM");
        }
    };
    assert!(status.success(), "SIGTERM ended the demo with {status}");
    let sandbox = kubeconfig.parent().expect("the kubeconfig has a directory");
    assert!(
        !sandbox.exists(),
        "the sandbox directory {} is left behind",
        sandbox.display()
    );
}
