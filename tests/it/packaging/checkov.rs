//! checkov (PyPI; a scanner someone else wrote) over the chart as the real Helm engine renders
//! it, once with the defaults and once with every option on: every finding must be listed,
//! with its reason, in `packaging/helm/checkov-skips.yaml` for that rendering.
//!
//! checkov comes from `$GPUSHARE_TEST_CHECKOV`, else `.venv-checkov/bin/checkov` (`make
//! clients`; a venv of its own, see `tests/clients/requirements-checkov.txt`). Missing, the
//! test skips loudly, and under `CI=true` it fails.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;

use crate::support::clients;
use crate::support::helm_chart::{EVERY_OPTION_ON, default_values, merged, render_by_path};
use crate::support::source_tree::{read, repo_path};

#[derive(Deserialize)]
struct SkipList {
    skips: Vec<Skip>,
}

#[derive(Deserialize)]
struct Skip {
    check: String,
    renders: Vec<String>,
    resources: Vec<String>,
    reason: String,
}

/// One failed check: (check id, resource).
type Finding = (String, String);

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

/// checkov's failed checks over `dir` (one run).
fn scan(checkov: &Path, dir: &Path) -> BTreeSet<Finding> {
    let out = Command::new(checkov)
        .arg("-d")
        .arg(dir)
        .args([
            "--framework",
            "kubernetes",
            "--skip-download",
            "--quiet",
            "--compact",
            "-o",
            "json",
        ])
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
    let mut findings = BTreeSet::new();
    let mut resources = 0;
    for r in &reports {
        resources += r["summary"]["resource_count"].as_u64().unwrap_or(0);
        for f in r["results"]["failed_checks"]
            .as_array()
            .into_iter()
            .flatten()
        {
            findings.insert((
                f["check_id"].as_str().expect("check_id").to_string(),
                f["resource"].as_str().expect("resource").to_string(),
            ));
        }
    }
    assert!(
        resources >= 10,
        "checkov saw only {resources} resources in {}: {reports:?}",
        dir.display()
    );
    findings
}

fn listed(skips: &SkipList, render: &str, (check, resource): &Finding) -> Option<usize> {
    skips.skips.iter().position(|s| {
        s.check == *check
            && s.renders.iter().any(|r| r == render)
            && s.resources
                .iter()
                .any(|r| resource == r || resource.starts_with(&format!("{r}.")))
    })
}

#[test]
fn checkov_finds_nothing_that_is_not_listed_with_a_reason() {
    let skips: SkipList = yaml_serde::from_str(&read("packaging/helm/checkov-skips.yaml"))
        .expect("checkov-skips.yaml parses");
    for s in &skips.skips {
        assert!(
            s.reason.trim().len() > 20 && !s.resources.is_empty() && !s.renders.is_empty(),
            "{}: every skip names its renders, resources and reason",
            s.check
        );
    }
    let Some(checkov) = checkov() else {
        return;
    };
    let everything = merged(
        &default_values(),
        &yaml_serde::from_str(EVERY_OPTION_ON).expect("values parse"),
    );
    let mut unlisted = Vec::new();
    let mut used = BTreeSet::new();
    for (render, values) in [("defaults", default_values()), ("everything", everything)] {
        // Not tempdir()'s `.tmp…`: checkov skips hidden directories.
        let dir = tempfile::Builder::new()
            .prefix("gpushare-checkov-")
            .tempdir()
            .expect("tempdir");
        if render_into(&values, dir.path()).is_none() {
            return;
        }
        for finding in scan(&checkov, dir.path()) {
            match listed(&skips, render, &finding) {
                Some(i) => {
                    used.insert((i, render));
                }
                None => unlisted.push(format!("{render}: {} on {}", finding.0, finding.1)),
            }
        }
    }
    assert!(
        unlisted.is_empty(),
        "checkov findings not in packaging/helm/checkov-skips.yaml (fix the chart, or list \
         them there with the reason):\n{}",
        unlisted.join("\n")
    );
    // An entry no finding needs any more is reported (not failed: a change elsewhere, such as
    // a NetworkPolicy, may settle a finding; then delete the entry).
    for (i, s) in skips.skips.iter().enumerate() {
        for r in &s.renders {
            if !used.contains(&(i, r.as_str())) {
                eprintln!(
                    "checkov-skips.yaml: {} is no longer reported for `{r}`: delete it",
                    s.check
                );
            }
        }
    }
}
