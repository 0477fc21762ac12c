//! Build script: generates the kubelet gRPC code from `proto/` and records build facts
//! (`BUILD_GIT_COMMIT`, `BUILD_TARGET_TRIPLE`) for `gpushare version`.
//!
//! `protoc` comes from the `protoc-bin-vendored` crate unless `PROTOC` is set, so a machine
//! with only the Rust toolchain can build.

use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    if std::env::var_os("PROTOC").is_none() {
        config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    }
    let root = PathBuf::from("proto");
    let deviceplugin = root.join("k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto");
    let podresources = root.join("k8s.io/kubelet/pkg/apis/podresources/v1/api.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &[deviceplugin, podresources], &[root])?;
    println!("cargo:rerun-if-changed=proto");

    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=BUILD_GIT_COMMIT={commit}");
    println!(
        "cargo:rustc-env=BUILD_TARGET_TRIPLE={}",
        std::env::var("TARGET").unwrap_or_default()
    );
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-env-changed=PROTOC");
    Ok(())
}
