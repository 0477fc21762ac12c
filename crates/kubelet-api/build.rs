//! Build script: generates the kubelet gRPC code from `proto/`.
//!
//! `protoc` comes from the `protoc-bin-vendored` crate unless `PROTOC` is set, so a machine
//! with only the Rust toolchain can build.
//!
//! Two runs: the pod-resources API and the DRA health API v1 share the proto package `v1`
//! (their service paths are `/v1.PodResourcesLister/…` and `/v1.DRAResourceHealth/…`), and
//! prost writes one file per package, so the health API is generated into a folder of its own
//! and keeps a Rust module of its own.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from("proto");
    let apis = root.join("k8s.io/kubelet/pkg/apis");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    compile(
        &root,
        &out,
        &[
            apis.join("deviceplugin/v1beta1/api.proto"),
            apis.join("podresources/v1/api.proto"),
            apis.join("pluginregistration/v1/api.proto"),
            apis.join("dra/v1/api.proto"),
            apis.join("dra/v1beta1/api.proto"),
            apis.join("dra-health/v1alpha1/api.proto"),
        ],
    )?;
    let health_v1 = out.join("dra_health_v1");
    std::fs::create_dir_all(&health_v1)?;
    compile(&root, &health_v1, &[apis.join("dra-health/v1/api.proto")])?;
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-env-changed=PROTOC");
    Ok(())
}

fn compile(root: &Path, out: &Path, protos: &[PathBuf]) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    if std::env::var_os("PROTOC").is_none() {
        config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(out)
        .compile_with_config(config, protos, &[root.to_path_buf()])?;
    Ok(())
}
