//! Packaging: the Helm chart and the plain manifests rendered from it, the scheduler
//! configuration, the kubeadm install script, the systemd units, the image and the krew
//! manifest. Nothing here needs a cluster, Docker or a running systemd; the chart is rendered
//! by the real Helm engine as a library (helm-python-sdk, see `support::clients`).

mod admission_policy;
mod chart;
mod chart_dedicated;
mod chart_mps;
mod chart_production;
mod checkov;
mod ha_chart;
mod image;
mod kubeadm;
mod systemd;
mod systemd_security;

use std::path::PathBuf;

/// A path in the source tree.
fn repo_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Text of a file in the source tree.
fn read(rel: &str) -> String {
    let path = repo_path(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The YAML documents of `text`, empty documents left out (as `kubectl apply` and Helm do).
fn yaml_documents(name: &str, text: &str) -> Vec<yaml_serde::Value> {
    use serde::Deserialize;
    yaml_serde::Deserializer::from_str(text)
        .map(|d| {
            yaml_serde::Value::deserialize(d).unwrap_or_else(|e| panic!("{name}: bad YAML: {e}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// Asserts that the real `gpushare` command line accepts `args` (a subcommand and its flags,
/// as a manifest or unit writes them): clap validates every flag before `--help` stops it.
fn assert_cli_accepts(args: &[String], what: &str) {
    let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
    argv.push("--help");
    let out = crate::support::run(&argv);
    assert!(
        out.status.success(),
        "{what}: gpushare rejects {args:?}:\n{}",
        crate::support::stderr(&out)
    );
}
