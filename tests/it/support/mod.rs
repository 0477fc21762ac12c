//! The one home of what the integration tests share: running the built binary and fixture
//! paths here; the sandbox fixtures, builders and waits in the modules below. Test modules
//! import from `support` only, never from each other (checked by `make layers`).

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub mod canned_http;
pub mod chart_install;
pub mod chart_workloads;
pub mod clients;
pub mod container_mapping;
pub mod deviceplugin_cluster;
pub mod doctor_node;
pub mod dra;
pub mod dra_node;
pub mod enforcement;
pub mod extender_cluster;
pub mod extender_http;
pub mod extender_sandbox;
pub mod helm_chart;
pub mod hgx;
pub mod https_client;
pub mod isolated_extender;
pub mod kube_validate;
pub mod ledger_truth;
pub mod limiter;
pub mod mps;
pub mod objects;
pub mod role_process;
pub mod soak;
pub mod socket_dir;
pub mod source_tree;
pub mod wait;

/// Path of the built `gpushare` binary.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpushare"))
}

/// Runs the binary with `args` and a clean environment (PATH kept), returning its output.
pub fn run(args: &[&str]) -> Output {
    run_with_env(args, &[])
}

/// Runs the binary with `args` and extra `env` on a clean environment (PATH, HOME kept).
pub fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args).env_clear();
    for keep in ["PATH", "HOME"] {
        if let Some(v) = std::env::var_os(keep) {
            cmd.env(keep, v);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the gpushare binary runs")
}

/// A fixture file under `tests/fixtures`.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// Text of stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Text of stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts that the real `gpushare` command line accepts `args` (a subcommand and its flags,
/// as a manifest or unit writes them): clap validates every flag before `--help` stops it.
pub fn assert_cli_accepts(args: &[String], what: &str) {
    let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
    argv.push("--help");
    let out = run(&argv);
    assert!(
        out.status.success(),
        "{what}: gpushare rejects {args:?}:\n{}",
        stderr(&out)
    );
}

/// A loopback port nothing listens on (bound, then let go).
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    port
}

/// A kubeconfig file whose one context talks to `server` with a token.
pub fn kubeconfig_for(server: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n\
         users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: ctx\n  context:\n    cluster: c\n    user: u\n\
         current-context: ctx\n"
    );
    std::fs::write(file.path(), text).expect("kubeconfig written");
    file
}
