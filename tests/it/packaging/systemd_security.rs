//! `systemd-analyze security --offline=yes` on each unit (systemd's own exposure score, 0 = most
//! sandboxed, 10 = none): the extender and the doctor must be "OK" (at most 4.0), and so is
//! the device plugin, MPS daemon included, and lower with the drop-in for nodes without MPS
//! (`systemd/gpushare-device-plugin-without-mps.conf`, scored on the unit with its lines added
//! to `[Service]`, as systemd merges a drop-in). The figure each file states in its comment and
//! the table of docs/security.md are the measured ones. Without `systemd-analyze` the tests print SKIPPED
//! (and fail under CI; package `systemd`, which `.ci/run` installs).

use std::process::Command;

use crate::support::source_tree::{read, repo_path};

/// (unit, highest exposure accepted).
const BOUNDS: [(&str, f64); 3] = [
    ("gpushare-extender.service", 4.0),
    ("gpushare-doctor.service", 4.0),
    // Root, the GPU device nodes, the kernel log and the MPS daemon: see the unit's comment.
    ("gpushare-device-plugin.service", 4.0),
];

const WITHOUT_MPS: &str = "gpushare-device-plugin-without-mps.conf";

/// The device plugin's unit with the lines of the no-MPS drop-in appended to `[Service]`.
fn device_plugin_without_mps(dir: &std::path::Path) -> std::path::PathBuf {
    let unit = read("systemd/gpushare-device-plugin.service");
    let drop_in = read(&format!("systemd/{WITHOUT_MPS}"));
    let (_, lines) = drop_in
        .split_once("[Service]\n")
        .expect("a [Service] section");
    let at = unit.find("[Install]").expect("[Install]");
    let path = dir.join("gpushare-device-plugin.service");
    std::fs::write(&path, format!("{}{lines}\n{}", &unit[..at], &unit[at..])).expect("write");
    path
}

fn exposure(unit: &str) -> String {
    exposure_of(&repo_path(&format!("systemd/{unit}")), unit)
}

fn exposure_of(path: &std::path::Path, unit: &str) -> String {
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(path)
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "systemd-analyze is not installed ({e}): install it (apt-get install -y \
                 systemd; .ci/run does this) and rerun"
            )
        });
    let text = String::from_utf8_lossy(&out.stdout);
    let marker = format!("Overall exposure level for {unit}: ");
    text.lines()
        .find_map(|l| l.split_once(&marker).map(|(_, rest)| rest.to_string()))
        .and_then(|rest| rest.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| {
            panic!(
                "no exposure level for {unit}:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

#[test]
fn units_are_sandboxed_to_an_ok_exposure() {
    if crate::support::clients::systemd_analyze().is_none() {
        return;
    }
    let readme = read("docs/security.md");
    for (unit, bound) in BOUNDS {
        let figure = exposure(unit);
        let value: f64 = figure.parse().expect("exposure is a number");
        assert!(
            value <= bound,
            "{unit}: exposure {value} above {bound} (systemd-analyze security --offline=yes)"
        );
        let stated = format!("security {unit}`: {figure} OK");
        assert!(
            read(&format!("systemd/{unit}")).contains(&stated),
            "the comment of {unit} must state the measured figure: `{stated}`"
        );
        let row = format!("| `{unit}` | {figure} |");
        assert!(
            readme.contains(&row),
            "docs/security.md's table of exposures must hold `{row}`"
        );
    }
    // Without MPS the drop-in takes the device plugin further.
    let dir = tempfile::tempdir().expect("tempdir");
    let unit = "gpushare-device-plugin.service";
    let figure = exposure_of(&device_plugin_without_mps(dir.path()), unit);
    let value: f64 = figure.parse().expect("exposure is a number");
    let with_mps: f64 = exposure(unit).parse().expect("exposure is a number");
    assert!(value < with_mps && value <= 3.0, "without MPS: {value}");
    let stated = format!("of the unit with this drop-in: {figure} OK");
    assert!(
        read(&format!("systemd/{WITHOUT_MPS}")).contains(&stated),
        "{WITHOUT_MPS} must state the measured figure: `{stated}`"
    );
    let row = format!("| `{unit}` + `{WITHOUT_MPS}` | {figure} |");
    assert!(
        readme.contains(&row),
        "docs/security.md's table of exposures must hold `{row}`"
    );
}

#[test]
fn a_loosened_unit_scores_worse() {
    if crate::support::clients::systemd_analyze().is_none() {
        return;
    }
    // The check has teeth: the extender without its sandbox is not OK.
    let text = read("systemd/gpushare-extender.service");
    let cut = text.find("ProtectSystem=strict").expect("sandbox section");
    let end = text.find("[Install]").expect("install section");
    let dir = tempfile::tempdir().expect("tempdir");
    let unit = "gpushare-extender.service";
    std::fs::write(
        dir.path().join(unit),
        format!("{}{}", &text[..cut], &text[end..]),
    )
    .expect("write unit");
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(dir.path().join(unit))
        .output()
        .expect("systemd-analyze runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let value: f64 = text
        .lines()
        .find_map(|l| {
            l.split_once(&format!("for {unit}: "))
                .map(|(_, r)| r.to_string())
        })
        .and_then(|r| r.split_whitespace().next().and_then(|v| v.parse().ok()))
        .expect("exposure");
    assert!(value > 4.0, "an unsandboxed unit scores {value}");
}
