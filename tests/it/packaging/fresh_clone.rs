//! The README's way in, from a fresh clone: `make test` first installs the pinned Python
//! clients (`tests/clients/install.sh --best-effort`), and every test whose client is still
//! missing prints `SKIPPED: <test>: <why>` on a line of its own, never failing and never
//! silent; under `CI=true` such a skip fails.
//!
//! Two checks run in the suite (a `git clone` of this repository's HEAD, the install step with
//! no python3 on PATH; this test binary itself re-run without the Helm engine); the whole walk
//! (`make test` and `make demo` in a fresh clone, its clients fetched from PyPI, built in
//! `target/fresh-clone`) is `#[ignore]`d: `make fresh-clone`, which CI runs. What is not
//! committed is not in the clone.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::support::source_tree::repo_path;

/// A `git clone` of the repository's HEAD in a temporary directory.
fn fresh_clone() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let clone = dir.path().join("gpushare");
    let out = Command::new("git")
        .args(["clone", "--quiet", "--no-hardlinks"])
        .arg(repo_path("."))
        .arg(&clone)
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git clone: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, clone)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A directory holding only `bash`: a PATH on which python3, promtool and pip are missing.
fn bare_path(dir: &Path) -> PathBuf {
    let bin = dir.join("bare-bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    std::os::unix::fs::symlink("/bin/bash", bin.join("bash")).expect("symlink bash");
    bin
}

#[test]
fn the_install_step_of_a_fresh_clone_names_what_it_cannot_install() {
    let (dir, clone) = fresh_clone();
    let bin = bare_path(dir.path());
    let install = |ci: &str| {
        Command::new("/bin/bash")
            .arg(clone.join("tests/clients/install.sh"))
            .arg("--best-effort")
            .current_dir(&clone)
            .env_clear()
            .env("PATH", &bin)
            .env("CI", ci)
            .output()
            .expect("install.sh runs")
    };
    let out = install("");
    let said = text(&out);
    assert!(out.status.success(), "best effort never fails: {said}");
    for what in [
        "clients: NOT INSTALLED: python3 is missing (tests/clients/requirements.txt",
        "clients: NOT INSTALLED: python3 is missing (tests/clients/requirements-checkov.txt",
        "clients: NOT INSTALLED: promtool",
    ] {
        assert!(
            said.lines().any(|l| l.starts_with(what)),
            "no line `{what}…`: {said}"
        );
    }
    assert!(!clone.join(".venv").exists(), "no venv without python3");

    let out = install("true");
    assert!(
        !out.status.success(),
        "under CI a missing client fails the install step: {}",
        text(&out)
    );
}

/// This test binary, re-run on `filter` with the Helm engine missing.
fn rerun_without_helm(filter: &str, ci: &str) -> Output {
    Command::new(std::env::current_exe().expect("the test binary"))
        .arg(filter)
        .env("GPUSHARE_TEST_PYTHON", "/nonexistent/python3")
        .env("CI", ci)
        .env_remove("GPUSHARE_TEST_NO_SKIP")
        .env("RUST_TEST_THREADS", "2")
        .output()
        .expect("the test binary runs")
}

#[test]
fn a_test_whose_client_is_missing_prints_skipped_and_fails_under_ci() {
    let out = rerun_without_helm("packaging::ha_chart::", "");
    let said = text(&out);
    assert!(out.status.success(), "skips do not fail: {said}");
    let skipped: Vec<&str> = said
        .lines()
        .filter(|l| l.starts_with("SKIPPED: packaging::ha_chart::"))
        .collect();
    assert_eq!(skipped.len(), 4, "one SKIPPED line per test: {said}");
    for line in &skipped {
        assert!(
            line.contains(": client `python with helm_python` not found: "),
            "the line names the test and why: {line}"
        );
    }

    let out = rerun_without_helm("packaging::ha_chart::", "true");
    let said = text(&out);
    assert!(!out.status.success(), "under CI a skip fails: {said}");
    assert!(said.contains("4 failed"), "{said}");
}

#[test]
#[ignore = "builds the whole workspace in a fresh clone and fetches the clients from PyPI: make fresh-clone"]
fn fresh_clone_make_test_installs_its_clients_and_passes() {
    let (_dir, clone) = fresh_clone();
    // Knobs for a quicker walk (the default is the whole of both commands):
    // GPUSHARE_FRESH_CLONE_TARGET, the build directory (default target/fresh-clone: kept
    // between runs, so a rerun builds only what changed); GPUSHARE_FRESH_CLONE_TEST_ARGS, what
    // `make test` passes on to cargo test (e.g. `-- packaging::`).
    let target = std::env::var_os("GPUSHARE_FRESH_CLONE_TARGET")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_path("target/fresh-clone"));
    let test_args = std::env::var("GPUSHARE_FRESH_CLONE_TEST_ARGS").unwrap_or_default();
    let make = |goal: &str| {
        let out = Command::new("make")
            .arg(goal)
            .arg(format!("TEST_ARGS={test_args}"))
            .current_dir(&clone)
            .env("CARGO_TARGET_DIR", &target)
            .env_remove("CI")
            .env_remove("GPUSHARE_TEST_PYTHON")
            .env_remove("GPUSHARE_TEST_CHECKOV")
            .env_remove("GPUSHARE_TEST_NO_SKIP")
            .env_remove("VIRTUAL_ENV")
            .env_remove("GPUSHARE_TEST_PROMTOOL")
            .env_remove("GPUSHARE_TEST_KUBECTL")
            .output()
            .expect("make runs");
        let said = text(&out);
        println!("--- make {goal} in a fresh clone:\n{said}");
        assert!(out.status.success(), "make {goal} in a fresh clone failed");
        said
    };
    let said = make("test");
    // The install step put the pinned clients into the clone's own .venv.
    let imports = Command::new(clone.join(".venv/bin/python3"))
        .args(["-c", "import grpc, grpc_tools, helm_python"])
        .status()
        .expect("the clone's .venv");
    assert!(imports.success(), "make test installed the Python clients");
    let summary = said
        .lines()
        .find(|l| l.starts_with("tests: "))
        .expect("make test's summary line");
    assert!(!summary.contains(" 0 passed"), "{summary}");
    // Under CI every client is there (the clone fetched its own, promtool is a system
    // package): the walk must then check everything.
    if crate::support::clients::under_ci() {
        assert!(summary.contains("none SKIPPED"), "{summary}");
    }
    // Every skip is a line of its own with the test's name and the reason.
    for line in said.lines().filter(|l| l.contains("SKIPPED")) {
        if line.starts_with("SKIPPED: ") {
            assert!(line.splitn(3, ": ").count() == 3, "{line}");
        }
    }
    make("demo");
}
