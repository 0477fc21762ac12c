//! The systemd units pass `systemd-analyze verify`, and say what the issue asks of them.
//!
//! `systemd-analyze verify` insists that every Exec binary exists and is executable, so the
//! test copies the units into a temporary directory with `/usr/local/bin/gpushare` rewritten
//! to the binary cargo built (`CARGO_BIN_EXE_gpushare`). Any warning counts as a failure.
//! Without `systemd-analyze` (package `systemd`; `.ci/run` installs it) the test prints SKIPPED
//! (and fails under CI).

use std::collections::BTreeMap;
use std::process::Command;

use crate::support::assert_cli_accepts;
use crate::support::source_tree::{read, repo_path};

const INSTALLED_BIN: &str = "/usr/local/bin/gpushare";
const UNITS: [&str; 3] = [
    "gpushare-extender.service",
    "gpushare-device-plugin.service",
    "gpushare-doctor.service",
];

/// `key -> values` of one section of a unit file (keys may repeat).
fn section(unit: &str, name: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = String::new();
    for line in unit.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') {
            current = line.trim_matches(['[', ']']).to_string();
            continue;
        }
        if current == name
            && let Some((k, v)) = line.split_once('=')
        {
            out.entry(k.trim().to_string())
                .or_default()
                .push(v.trim().to_string());
        }
    }
    out
}

#[test]
fn units_pass_systemd_analyze_verify() {
    if crate::support::clients::systemd_analyze().is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = env!("CARGO_BIN_EXE_gpushare");
    let mut paths = Vec::new();
    for unit in UNITS {
        let text = read(&format!("systemd/{unit}"));
        assert!(text.contains(INSTALLED_BIN), "{unit} runs {INSTALLED_BIN}");
        let path = dir.path().join(unit);
        std::fs::write(&path, text.replace(INSTALLED_BIN, bin)).expect("write unit");
        paths.push(path);
    }
    for path in &paths {
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(path)
            .env("SYSTEMD_LOG_COLOR", "0")
            .output()
            .expect("systemd-analyze runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let complaints: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(
            out.status.success() && complaints.is_empty(),
            "systemd-analyze verify {}:\n{stderr}{}",
            path.display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The check has teeth: a typo is reported.
    let broken = dir.path().join("gpushare-broken.service");
    let text = read("systemd/gpushare-doctor.service")
        .replace(INSTALLED_BIN, bin)
        .replace("Type=oneshot", "Type=oneshot\nRestartSecc=5");
    std::fs::write(&broken, text).expect("write");
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&broken)
        .output()
        .expect("systemd-analyze runs");
    assert!(String::from_utf8_lossy(&out.stderr).contains("RestartSecc"));
}

#[test]
fn device_plugin_unit_leaves_the_preflight_to_the_role_and_reaches_the_kubelet() {
    let unit = read("systemd/gpushare-device-plugin.service");
    let u = section(&unit, "Unit");
    let s = section(&unit, "Service");
    assert!(u["After"].iter().any(|v| v.contains("kubelet.service")));
    assert!(u["Wants"].iter().any(|v| v.contains("kubelet.service")));
    // Only the MPS pipe directory: a doctor run here would fail the unit while the API
    // server is briefly away; the role's own preflight waits for it.
    assert_eq!(
        s["ExecStartPre"],
        ["+/bin/mkdir -p /tmp/nvidia-mps".to_string()]
    );
    assert!(s["ExecStart"][0].starts_with(&format!("{INSTALLED_BIN} device-plugin")));
    assert_eq!(s["Restart"], ["always"]);
    assert_eq!(s["RestartSec"], ["5"]);
    assert_eq!(s["EnvironmentFile"], ["-/etc/default/gpushare"]);
    assert_eq!(s["ProtectSystem"], ["strict"]);
    assert_eq!(
        s["ReadWritePaths"],
        [gpushare::core::wire::DEFAULT_DEVICE_PLUGIN_DIR]
    );
    assert_eq!(s["NoNewPrivileges"], ["yes"]);
    // Nothing that would hide the GPU device nodes or /dev/kmsg from nvidia-smi / XID reading.
    for forbidden in [
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "ProtectKernelLogs",
        "InaccessiblePaths",
    ] {
        assert!(
            !s.contains_key(forbidden),
            "{forbidden} would break GPU access"
        );
    }
}

#[test]
fn device_plugin_unit_can_run_the_mps_daemon() {
    let unit = read("systemd/gpushare-device-plugin.service");
    let s = section(&unit, "Service");
    // The pipe directory is the host's (made before the sandbox binds it in), the log
    // directory writable under ProtectSystem=strict.
    assert!(s["BindPaths"].iter().any(|p| p == "-/tmp/nvidia-mps"));
    assert!(s["ExecStartPre"][0].contains("mkdir -p /tmp/nvidia-mps"));
    assert_eq!(s["LogsDirectory"], ["nvidia-mps"]);
    let env = read("systemd/gpushare.env");
    let line = env
        .lines()
        .find(|l| l.contains("--mps"))
        .expect("the example names the MPS flags");
    let args: Vec<String> = std::iter::once("device-plugin".to_string())
        .chain(
            line.trim_start_matches('#')
                .trim_start_matches("GPUSHARE_DEVICE_PLUGIN_ARGS=")
                .split_whitespace()
                .map(str::to_string),
        )
        .collect();
    assert_cli_accepts(&args, "systemd/gpushare.env");
}

#[test]
fn extender_and_doctor_units() {
    let ext = read("systemd/gpushare-extender.service");
    let s = section(&ext, "Service");
    assert!(s["ExecStart"][0].starts_with(&format!("{INSTALLED_BIN} extender")));
    assert_eq!(s["Restart"], ["always"]);
    assert_eq!(s["EnvironmentFile"], ["-/etc/default/gpushare"]);
    assert!(s["Environment"].contains(&"PORT=12345".to_string()));
    assert_eq!(s["CapabilityBoundingSet"], [""]);

    let doc = read("systemd/gpushare-doctor.service");
    let s = section(&doc, "Service");
    assert_eq!(s["Type"], ["oneshot"]);
    assert!(s["ExecStart"][0].starts_with(&format!("{INSTALLED_BIN} doctor --role")));
    assert_eq!(s["EnvironmentFile"], ["-/etc/default/gpushare"]);

    // The example environment file names only variables the units or gpushare read.
    let env = read("systemd/gpushare.env");
    for line in env.lines().map(|l| l.trim_start_matches('#')) {
        if let Some((name, _)) = line.split_once('=')
            && !name.contains(' ')
        {
            let known = ["KUBECONFIG", "LOG_LEVEL", "NODE_NAME", "PORT"].contains(&name)
                || name.starts_with("GPUSHARE_");
            assert!(known, "unknown variable {name} in gpushare.env");
        }
    }
    assert!(repo_path("systemd/gpushare.env").is_file());
}

#[test]
fn the_binary_accepts_the_units_commands() {
    let role = |unit: &str| {
        section(unit, "Service")["Environment"]
            .iter()
            .find_map(|e| e.strip_prefix("GPUSHARE_DOCTOR_ROLE=").map(str::to_string))
    };
    for unit_name in UNITS {
        let unit = read(&format!("systemd/{unit_name}"));
        let s = section(&unit, "Service");
        let commands = s
            .get("ExecStartPre")
            .into_iter()
            .flatten()
            .chain(&s["ExecStart"])
            // Only gpushare's own commands (not the MPS pipe directory's mkdir).
            .filter(|c| c.contains(INSTALLED_BIN));
        for command in commands {
            // The units' argument variables are empty by default; the doctor role is `node`.
            let args: Vec<String> = command
                .split_whitespace()
                .skip(1)
                .filter(|w| !w.starts_with('$') || w.starts_with("${"))
                .map(|w| match w {
                    "${GPUSHARE_DOCTOR_ROLE}" => role(&unit).expect("a default role"),
                    w => w.to_string(),
                })
                .collect();
            assert_cli_accepts(&args, unit_name);
        }
    }
}

/// The serving units leave room for `http.max_connections`: the default soft limit of 1024
/// would make `accept` fail (EMFILE) before the connection cap engages.
#[test]
fn serving_units_set_an_open_file_limit_above_the_connection_cap() {
    let cap = gpushare::config::Config::default().http.max_connections as u64;
    for unit in [
        "gpushare-extender.service",
        "gpushare-device-plugin.service",
    ] {
        let text = read(&format!("systemd/{unit}"));
        let s = section(&text, "Service");
        let limit: u64 = s
            .get("LimitNOFILE")
            .and_then(|v| v.first())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(
            gpushare::fd_limit::cap_warning(cap as usize, limit).is_none(),
            "{unit}: LimitNOFILE={limit} leaves no room for {cap} connections"
        );
    }
}
