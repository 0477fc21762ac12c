//! `gpushare demo`: the newcomer's walkthrough must hold every expectation, in-process and as
//! the real binary.

use crate::support::{run, stderr, stdout};

/// Asserts that none of a scenario's expectations failed (`failures`), that it checked
/// `checks` of them (`Some((want, checked))`) and that the text it printed into `out` says
/// each of `wants`.
fn held(failures: &[String], out: &[u8], checks: Option<(usize, usize)>, wants: &[&str]) {
    let text = String::from_utf8_lossy(out).into_owned();
    assert!(failures.is_empty(), "{failures:?}\n{text}");
    if let Some((want, checked)) = checks {
        assert_eq!(checked, want, "{text}");
    }
    for want in wants {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
}

/// The binary's `gpushare demo <args>` exits 0 saying that all its `checks` expectations held.
fn binary_holds(args: &[&str], checks: usize) {
    let out = run(&[&["demo"], args].concat());
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    let said = format!("All {checks} expectations held.");
    assert!(text.contains(&said), "{said:?} not in:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_scenario_holds_every_expectation() {
    let mut out = Vec::new();
    let outcome = gpushare::demo::run_scenario("2x16GiB", &mut out, false)
        .await
        .expect("the demo runs");
    held(
        &outcome.failures,
        &out,
        Some((5, outcome.checks)),
        &[
            "bind chose GPU 1",
            "0/1 nodes are available: 1 Insufficient GPU Memory in one device.",
            "24/32 (75%)",
        ],
    );
}

#[test]
fn the_demo_binary_exits_zero_and_rejects_bad_gpus() {
    binary_holds(&[], 5);
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
    held(
        &outcome.failures,
        &out,
        Some((6, outcome.checks)),
        &[
            "stored with spec.schedulerName: gpushare-scheduler",
            "requests (2) differ from limits (4)",
        ],
    );
    binary_holds(&["--managed"], 6);
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
    held(
        &outcome.failures,
        &out,
        Some((4, outcome.checks)),
        &["binpack-3 runs on GPU 1"],
    );
    binary_holds(&["--dra"], 4);
    // GPUs of three sizes: the slice's order makes first fit place each claim where the
    // extender's best fit would (the smallest GPU that fits first).
    let mut out = Vec::new();
    let outcome = gpushare::demo::run_dra_scenario("8GiB,32GiB,4GiB", &mut out)
        .await
        .expect("the DRA demo runs");
    held(&outcome.failures, &out, None, &["binpack-1 runs on GPU 2"]);
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
