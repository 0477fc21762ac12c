//! Finding the clients that other people wrote (Python grpcio, the Helm engine through
//! helm-python-sdk, promtool, kubectl), deterministically.
//!
//! Where each comes from (`.ci/run` installs them):
//! - Python with `grpcio`, `grpcio-tools`, `helm-python-sdk` and `kubernetes-validate`:
//!   `$GPUSHARE_TEST_PYTHON`, else `<repo>/.venv/bin/python3`.
//! - promtool (Debian package `prometheus`): `$GPUSHARE_TEST_PROMTOOL`, else `promtool` on PATH.
//! - systemd-analyze (Debian package `systemd`): on PATH.
//! - kubectl: `$GPUSHARE_TEST_KUBECTL` (one binary), else every `kubectl` / `kubectl.1.*` on
//!   PATH, under `/usr/local/bin` and under `/usr/lib/google-cloud-sdk/bin` (where the Google
//!   Cloud SDK puts kubectl 1.27-1.33).
//!
//! A missing tool skips the test: [`skip`] prints `SKIPPED: <test>: <why>` on a line of its
//! own, straight to stderr (past libtest's capture, so `make test` shows it and counts it),
//! except under `CI` (set and not `false`/`0`) or `GPUSHARE_TEST_NO_SKIP=1` (what `make
//! test-cluster` and `make test-gpu` set), where the skip fails the test: a run that must
//! check something never passes by checking nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

/// True under CI (`CI` set to anything but empty, `0` or `false`).
pub fn under_ci() -> bool {
    flag("CI")
}

fn flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| !matches!(v.trim(), "" | "0" | "false"))
        .unwrap_or(false)
}

/// The line a skipped test prints (and `make test` counts): `SKIPPED: <test>: <why>`, the
/// test's name being libtest's name of the thread running it.
pub fn skip_line(why: &str) -> String {
    let current = std::thread::current();
    let test = current.name().unwrap_or("<unnamed test>");
    format!("SKIPPED: {test}: {}", why.replace('\n', " "))
}

/// Skips the calling test (the caller returns at once): prints [`skip_line`] on a line of its
/// own to stderr, uncaptured. Under CI or `GPUSHARE_TEST_NO_SKIP=1` it panics instead.
pub fn skip(why: &str) {
    use std::io::Write;
    let line = skip_line(why);
    assert!(
        !under_ci() && !flag("GPUSHARE_TEST_NO_SKIP"),
        "{line} (a skip fails under CI=true and GPUSHARE_TEST_NO_SKIP=1)"
    );
    // Not eprintln!: libtest captures that and shows it only for failed tests.
    let _ = writeln!(std::io::stderr().lock(), "\n{line}");
}

/// Skips (returns `None`, after [`skip`]'s line) or, under CI, panics.
pub fn missing<T>(tool: &str, how: &str) -> Option<T> {
    skip(&format!("client `{tool}` not found: {how}"));
    None
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A Python interpreter that imports every module in `modules`.
pub fn python_with(modules: &[&str]) -> Option<PathBuf> {
    let python = std::env::var_os("GPUSHARE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python3"));
    let import = format!("import {}", modules.join(", "));
    let ok = Command::new(&python)
        .args(["-c", &import])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        Some(python)
    } else {
        missing(
            &format!("python with {}", modules.join(", ")),
            &format!(
                "`{} -c '{import}'` failed (`make test` or `make clients` installs it into .venv; or set GPUSHARE_TEST_PYTHON)",
                python.display()
            ),
        )
    }
}

/// A Python interpreter with grpcio and its protoc (`grpc_tools`), as the Python kubelets
/// (`tests/clients/*_grpcio.py`) need; `None` after the `SKIPPED` line where there is none.
pub fn grpcio_python() -> Option<PathBuf> {
    python_with(&["grpc", "grpc_tools"])
}

/// The Python DRA kubelet's arguments for one full round with `:authority` `authority`
/// (`path`, `localhost`): `more` (e.g. `--api v1`), then prepare, the health stream and
/// unprepare of each of `claims` (`namespace/uid/name`).
pub fn grpcio_round(authority: &str, more: &[&str], claims: &[&str]) -> Vec<String> {
    let mut args = vec!["--authority", authority];
    args.extend_from_slice(more);
    args.extend(["--prepare", "--health", "--unprepare"]);
    for claim in claims {
        args.extend(["--claim", claim]);
    }
    args.into_iter().map(str::to_string).collect()
}

/// Runs the Python DRA kubelet (`tests/clients/dra_kubelet_grpcio.py`: grpcio with the
/// upstream protos) with `python` against the plugin registered at `socket`, with `args`
/// (`--prepare`, `--claim ns/uid/name`, …); its JSON report. The test fails when it runs
/// longer than a minute, prints no JSON or exits non-zero.
pub async fn dra_kubelet_grpcio(
    python: &Path,
    socket: &Path,
    args: &[String],
) -> serde_json::Value {
    let mut all = vec!["--socket".into(), socket.as_os_str().to_owned()];
    all.extend(args.iter().map(Into::into));
    let (code, report, stderr) = python_kubelet(python, "dra_kubelet_grpcio.py", &all).await;
    assert_eq!(code, Some(0), "{report}\n{stderr}");
    report
}

/// Runs the Python device-plugin kubelet (`tests/clients/kubelet_grpcio.py`) with `python`
/// on the device-plugin directory `dir`, with `args`: its exit status, JSON report and
/// stderr. The test fails when it runs longer than a minute or prints no JSON.
pub async fn device_plugin_kubelet_grpcio(
    python: &Path,
    dir: &Path,
    args: &[&str],
) -> (Option<i32>, serde_json::Value, String) {
    let mut all = vec!["--dir".into(), dir.as_os_str().to_owned()];
    all.extend(args.iter().map(Into::into));
    python_kubelet(python, "kubelet_grpcio.py", &all).await
}

/// Runs `tests/clients/<script>` with `python` and `args`: its exit status, the JSON report
/// it printed, its stderr.
async fn python_kubelet(
    python: &Path,
    script: &str,
    args: &[std::ffi::OsString],
) -> (Option<i32>, serde_json::Value, String) {
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::process::Command::new(python)
            .arg(repo_root().join("tests/clients").join(script))
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the python kubelet finishes within a minute")
    .expect("the python kubelet runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{script} printed no JSON ({e}): {stdout}\n{stderr}"));
    (out.status.code(), report, stderr)
}

/// promtool.
pub fn promtool() -> Option<PathBuf> {
    let promtool = std::env::var_os("GPUSHARE_TEST_PROMTOOL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("promtool"));
    let ok = Command::new(&promtool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        Some(promtool)
    } else {
        missing(
            "promtool",
            "apt-get install prometheus, or set GPUSHARE_TEST_PROMTOOL",
        )
    }
}

/// `promtool check metrics` on `text`: Some((passed, what it printed)), None when skipped.
pub fn promtool_check(text: &str) -> Option<(bool, String)> {
    use std::io::Write;
    let promtool = promtool()?;
    let mut child = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("promtool reads the page");
    let out = child.wait_with_output().expect("promtool finishes");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success() && said.trim().is_empty(), said))
}

/// systemd-analyze (Debian package `systemd`), or `None` after the SKIPPED line.
pub fn systemd_analyze() -> Option<()> {
    let ok = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Some(())
    } else {
        missing("systemd-analyze", "apt-get install systemd")
    }
}

/// Every kubectl binary found (deduplicated by canonical path), with its client version.
pub fn kubectls() -> Vec<(PathBuf, String)> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(one) = std::env::var_os("GPUSHARE_TEST_KUBECTL") {
        candidates.push(PathBuf::from(one));
    } else {
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.push(PathBuf::from("/usr/local/bin"));
        dirs.push(PathBuf::from("/usr/lib/google-cloud-sdk/bin"));
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut names: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n == "kubectl" || n.starts_with("kubectl.1."))
                })
                .collect();
            names.sort();
            candidates.extend(names);
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut found = Vec::new();
    for c in candidates {
        let Ok(real) = std::fs::canonicalize(&c) else {
            continue;
        };
        if !seen.insert(real) {
            continue;
        }
        if let Some(v) = kubectl_version(&c) {
            found.push((c, v));
        }
    }
    found
}

fn kubectl_version(kubectl: &Path) -> Option<String> {
    let out = Command::new(kubectl)
        .args(["version", "--client", "-o", "json"])
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v["clientVersion"]["gitVersion"]
        .as_str()
        .map(str::to_string)
}

/// Runs `binary` (a kubectl) against `kubeconfig` with `args`, with a cache and HOME of its own
/// and no `KUBECONFIG` from the environment, within 30 s: its output.
pub async fn kubectl_output(
    binary: &Path,
    kubeconfig: &Path,
    args: &[&str],
) -> std::process::Output {
    let cache = tempfile::tempdir().expect("a cache dir");
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        tokio::process::Command::new(binary)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cache-dir")
            .arg(cache.path())
            .args(args)
            .env("HOME", cache.path())
            .env_remove("KUBECONFIG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("kubectl finishes")
    .expect("kubectl runs")
}

/// One request to the real Helm engine (`tests/clients/helm_chart.py`, helm-python-sdk): see
/// that script for the request and answer. `None` when the SDK is missing (skipped; CI fails).
pub fn helm_chart(request: &serde_json::Value) -> Option<serde_json::Value> {
    let python = python_with(&["helm_python"])?;
    Some(json_script(&python, "helm_chart.py", request))
}

/// One request to kubernetes-validate (`tests/clients/kube_validate.py`): see that script for
/// the request and answer. `None` when the package is missing (skipped; CI fails).
pub fn kube_validate(request: &serde_json::Value) -> Option<serde_json::Value> {
    let python = python_with(&["kubernetes_validate"])?;
    Some(json_script(&python, "kube_validate.py", request))
}

/// Runs `tests/clients/<script>` with `python`, `request` as JSON on its stdin: its JSON answer
/// (a failed run fails the test with its stderr).
fn json_script(python: &Path, script: &str, request: &serde_json::Value) -> serde_json::Value {
    use std::io::Write;
    let mut child = Command::new(python)
        .arg(repo_root().join("tests/clients").join(script))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.to_string().as_bytes())
        .expect("request written");
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{script} finishes: {e}"));
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script} answers JSON: {e}"))
}
