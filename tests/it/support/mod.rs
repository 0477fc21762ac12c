//! Shared test harness: running the built binary, fixture paths.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub mod clients;
pub mod extender_http;
pub mod mps;

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
