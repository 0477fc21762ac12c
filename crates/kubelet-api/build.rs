//! Build script: generates the kubelet gRPC code from `proto/`.
//!
//! `protoc` comes from the `protoc-bin-vendored` crate unless `PROTOC` is set, so a machine
//! with only the Rust toolchain can build.

use std::path::PathBuf;

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
    println!("cargo:rerun-if-env-changed=PROTOC");
    Ok(())
}
