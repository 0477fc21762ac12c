//! checkov (PyPI; a scanner someone else wrote) over the chart as the real Helm engine renders
//! it (the defaults, every option on, and the dedicated mode without digests) and over the
//! source tree's `packaging/` (the plain manifests, the Dockerfile, the values): no finding is
//! left unexplained. What we accept is skipped in checkov's own form, next to the object:
//! `checkov.io/skipN: CHECK=reason` annotations written by the chart
//! (`templates/_checkov.tpl`), `# checkov:skip=CHECK: reason` comments in the Dockerfile, and
//! `.checkov.yaml` at the root for the recorded test fixtures. Every skip must carry a reason.
//!
//! checkov comes from `$GPUSHARE_TEST_CHECKOV`, else `.venv-checkov/bin/checkov` (`make
//! clients`; a venv of its own, see `tests/clients/requirements-checkov.txt`). Missing, the
//! test prints SKIPPED, and under `CI=true` it fails. `make checkov` runs the plain
//! `checkov -d .` over the whole tree (CI runs it).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::clients;
use crate::support::helm_chart::{EVERY_OPTION_ON, default_values, merged, render_by_path};
use crate::support::source_tree::repo_path;

fn checkov() -> Option<PathBuf> {
    let candidate = std::env::var_os("GPUSHARE_TEST_CHECKOV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_path(".venv-checkov/bin/checkov"));
    let ok = Command::new(&candidate)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Some(candidate)
    } else {
        clients::missing(
            "checkov",
            &format!(
                "`{} --version` failed (make clients, or set GPUSHARE_TEST_CHECKOV)",
                candidate.display()
            ),
        )
    }
}

/// Renders the chart with `values` into `dir` (one file per template, as `helm template
/// --output-dir` lays it out).
fn render_into(values: &yaml_serde::Value, dir: &Path) -> Option<()> {
    let manifests = render_by_path(values)?;
    assert!(!manifests.is_empty());
    for (path, text) in &manifests {
        if text.trim().is_empty() {
            continue;
        }
        let file = dir.join(path);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(&file, text).expect("write manifest");
    }
    Some(())
}

/// What one checkov run reported.
#[derive(Default)]
struct Report {
    /// (check, resource, file) of every failed check.
    failed: Vec<String>,
    /// (check, resource, reason) of every skipped check.
    skipped: Vec<(String, String, String)>,
    /// Resources scanned.
    resources: u64,
}

/// One plain checkov run (`-d dir`, from `cwd`, so that `.checkov.yaml` there is read), with
/// `extra` arguments.
fn scan(checkov: &Path, cwd: &Path, dir: &Path, extra: &[&str]) -> Report {
    let out = Command::new(checkov)
        .current_dir(cwd)
        .arg("-d")
        .arg(dir)
        .args(["--skip-download", "--compact", "-o", "json"])
        .args(extra)
        .env("BC_SKIP_MAPPING", "TRUE")
        .output()
        .expect("checkov runs");
    // Exit 1 means "findings"; anything else is checkov failing.
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "checkov failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "checkov's JSON: {e}\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    // One framework: an object (a list when several ran).
    let reports = match report {
        serde_json::Value::Array(list) => list,
        one => vec![one],
    };
    let mut seen = Report::default();
    for r in &reports {
        seen.resources += r["summary"]["resource_count"].as_u64().unwrap_or(0);
        let results = &r["results"];
        for f in results["failed_checks"].as_array().into_iter().flatten() {
            seen.failed.push(format!(
                "{} on {} ({})",
                f["check_id"].as_str().unwrap_or_default(),
                f["resource"].as_str().unwrap_or_default(),
                f["file_path"].as_str().unwrap_or_default()
            ));
        }
        for s in results["skipped_checks"].as_array().into_iter().flatten() {
            seen.skipped.push((
                s["check_id"].as_str().unwrap_or_default().to_string(),
                s["resource"].as_str().unwrap_or_default().to_string(),
                s["check_result"]["suppress_comment"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            ));
        }
    }
    seen
}

fn assert_explained(what: &str, report: &Report) {
    assert!(
        report.failed.is_empty(),
        "checkov findings over {what} (fix them, or skip them next to the object with the \
         reason):\n{}",
        report.failed.join("\n")
    );
    for (check, resource, reason) in &report.skipped {
        assert!(
            reason.trim().len() > 20,
            "{what}: {check} on {resource} is skipped without a reason ({reason:?})"
        );
    }
}

#[test]
fn checkov_finds_nothing_unexplained_in_the_rendered_chart() {
    let Some(checkov) = checkov() else {
        return;
    };
    let everything = merged(
        &default_values(),
        &yaml_serde::from_str(EVERY_OPTION_ON).expect("values parse"),
    );
    let dedicated = merged(
        &default_values(),
        &yaml_serde::from_str("scheduler: {mode: dedicated}").expect("values parse"),
    );
    for (render, values) in [
        ("defaults", default_values()),
        ("everything", everything),
        ("dedicated", dedicated),
    ] {
        // Not tempdir()'s `.tmp…`: checkov skips hidden directories.
        let dir = tempfile::Builder::new()
            .prefix("gpushare-checkov-")
            .tempdir()
            .expect("tempdir");
        if render_into(&values, dir.path()).is_none() {
            return;
        }
        let report = scan(
            &checkov,
            dir.path(),
            dir.path(),
            &["--framework", "kubernetes"],
        );
        assert!(
            report.resources >= 10,
            "checkov saw only {} resources in the `{render}` rendering",
            report.resources
        );
        assert_explained(&format!("the `{render}` rendering"), &report);
        // The skips are the chart's annotations: each is reported, with its reason.
        assert!(
            report
                .skipped
                .iter()
                .any(|(c, r, _)| c == "CKV_K8S_11" && r.contains("gpushare-schd-extender")),
            "{render}: the extender's CKV_K8S_11 skip is not seen"
        );
    }
}

#[test]
fn a_plain_checkov_over_packaging_finds_nothing_unexplained() {
    let Some(checkov) = checkov() else {
        return;
    };
    // What `checkov -d .` at the root reads of packaging/: the plain manifests, the
    // Dockerfile, the chart's values and templates, every framework checkov has.
    let report = scan(&checkov, &repo_path("."), Path::new("packaging"), &[]);
    assert_explained("packaging/", &report);
    for check in ["CKV_DOCKER_2", "CKV_K8S_11", "CKV_K8S_23"] {
        assert!(
            report.skipped.iter().any(|(c, _, _)| c == check),
            "{check} is not among the skips checkov reports over packaging/"
        );
    }
}
