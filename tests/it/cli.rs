//! The binary as an operator meets it: help, version, config errors, the kubectl alias.

use crate::support::{bin, run, run_with_env, stderr, stdout};

#[test]
fn every_subcommand_has_help() {
    for sub in [
        "extender",
        "device-plugin",
        "inspect",
        "doctor",
        "demo",
        "version",
    ] {
        let out = run(&[sub, "--help"]);
        assert!(
            out.status.success(),
            "{sub} --help failed: {}",
            stderr(&out)
        );
        assert!(
            stdout(&out).contains("Usage: gpushare"),
            "{sub}: {}",
            stdout(&out)
        );
    }
}

#[test]
fn version_reports_commit_target_and_linkage() {
    let out = run(&["version"]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("gpushare {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    for field in ["commit: ", "target: x86_64-unknown-linux-", "linkage: "] {
        assert!(text.contains(field), "missing {field}: {text}");
    }
    let out = run(&["--version"]);
    assert_eq!(
        stdout(&out).trim(),
        format!("gpushare {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn a_bad_configuration_exits_78_naming_key_and_source() {
    let out = run_with_env(&["doctor"], &[("GPUSHARE_EXTENDER__GPU_POLICY", "random")]);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("extender.gpu_policy"), "{err}");
    assert!(err.contains("GPUSHARE_EXTENDER__GPU_POLICY"), "{err}");
    let out = run(&["--config", "/nonexistent/gpushare.toml", "doctor"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(stderr(&out).contains("/nonexistent/gpushare.toml"));
    let out = run_with_env(&["doctor"], &[("PORT", "not-a-port")]);
    assert_eq!(out.status.code(), Some(78));
    assert!(
        stderr(&out).contains("environment variable PORT"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn usage_errors_exit_64() {
    let out = run(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(64));
}

#[test]
fn invoked_as_kubectl_plugin_it_is_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("kubectl-inspect-gpushare");
    std::os::unix::fs::symlink(bin(), &link).unwrap();
    let out = std::process::Command::new(&link)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Usage: kubectl inspect gpushare [flags] [NODE]"),
        "{text}"
    );
    assert!(text.starts_with("Show GPU memory allocation"), "{text}");
    assert!(!text.contains("plugin name`"), "{text}");
    // krew links it under this name.
    let krew = dir.path().join("kubectl-inspect_gpushare");
    std::os::unix::fs::symlink(bin(), &krew).unwrap();
    let out = std::process::Command::new(&krew)
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Usage: kubectl inspect gpushare [flags] [NODE]"),
        "{text}"
    );
    assert!(text.contains("--details"), "not inspect's help: {text}");
}

#[test]
fn the_upstream_device_plugin_command_line_is_accepted() {
    // DP:device-plugin-ds.yaml runs `gpushare-device-plugin-v2 -logtostderr --v=5 --memory-unit=GiB`.
    let out = run(&[
        "device-plugin",
        "-logtostderr",
        "--v=5",
        "--memory-unit=GiB",
        "--skip-doctor",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("node name"), "{}", stderr(&out));
}
