//! The roles against clients that other people wrote (see `support::clients` for where each
//! comes from): Python grpcio playing kubelet for the device plugin, with the socket path as
//! `:authority` as kubelet 1.11-1.25 sends it and with `localhost` as 1.26+ sends it; promtool
//! on every `/metrics` we serve. The chart is rendered by the real Helm engine in
//! `packaging::chart`, kubectl runs the plugin in `inspect`.

use std::sync::Arc;
use std::time::Duration;

use gpushare::config::Config;
use gpushare::core::wire;
use gpushare::deviceplugin;
use gpushare::gpu::fake::FakeBackend;
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::Value;

use crate::support::clients;

const NODE: &str = "gpu-node-1";

fn short_tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cl")
        .tempdir_in("/tmp")
        .expect("a temp dir under /tmp")
}

/// A sandbox API server with one GPU node and one pod bound by the extender to GPU 1 (4 GiB),
/// and the device plugin serving `dir` (no kubelet: the Python client is the kubelet).
async fn plugin_for_python_kubelet(
    dir: &std::path::Path,
) -> (ApiServer, deviceplugin::DevicePluginHandle) {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    gpushare: \"true\"\nstatus:\n  capacity:\n    aliyun.com/gpu-mem: \"32\"\n"
    ))
    .expect("node seeded");
    api.create_object(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "default", "annotations": {
            wire::ANN_GPU_INDEX: "1", wire::ANN_POD_MEM: "4", wire::ANN_DEVICE_MEM: "16",
            wire::ANN_ASSIGNED: "false", wire::ANN_ASSUME_TIME: "1"}},
        "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {wire::RESOURCE_GPU_MEM: "4"}}}]},
        "status": {"phase": "Pending"},
    }))
    .expect("pod created");
    let mut config = Config::default();
    config.device_plugin.node_name = NODE.to_string();
    config.device_plugin.device_plugin_dir = dir.to_path_buf();
    config.device_plugin.pod_resources_socket = dir.join("no-pod-resources.sock");
    config.device_plugin.admin_address = String::new();
    config.doctor.skip = true;
    let backend = FakeBackend::from_spec("2x16GiB").expect("fake GPUs");
    let plugin = deviceplugin::start(
        &config,
        api.client(),
        Arc::new(backend),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("the device plugin starts");
    (api, plugin)
}

/// Runs tests/clients/kubelet_grpcio.py against the plugin; its JSON report and exit code.
async fn python_kubelet(authority: &str) -> Option<(Option<i32>, Value, String)> {
    let python = clients::python_with(&["grpc", "grpc_tools"])?;
    let dir = short_tempdir();
    let (api, plugin) = plugin_for_python_kubelet(dir.path()).await;
    let script = clients::repo_root().join("tests/clients/kubelet_grpcio.py");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&python)
            .arg(&script)
            .arg("--dir")
            .arg(dir.path())
            .args(["--authority", authority, "--units", "4"])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the python kubelet finishes within a minute")
    .expect("the python kubelet runs");
    plugin.stop().await;
    api.shutdown().await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("python kubelet printed no JSON ({e}): {stdout}\n{stderr}"));
    Some((out.status.code(), report, stderr))
}

async fn grpcio_kubelet_drives_the_plugin(authority: &str) {
    let Some((code, report, stderr)) = python_kubelet(authority).await else {
        return;
    };
    assert_eq!(code, Some(0), "{report}\n{stderr}");
    assert_eq!(report["register"]["resource_name"], wire::RESOURCE_GPU_MEM);
    assert_eq!(report["register"]["endpoint"], wire::PLUGIN_SOCKET);
    assert_eq!(
        report["register"]["version"],
        wire::DEVICE_PLUGIN_API_VERSION
    );
    assert_eq!(
        report["options"]["get_preferred_allocation_available"],
        true
    );
    assert_eq!(report["devices"], 32, "{report}");
    assert_eq!(report["healthy"], 32, "{report}");
    let envs = &report["allocate"][0];
    assert_eq!(envs[wire::ENV_VISIBLE_DEVICES], "1", "{report}");
    assert_eq!(envs[wire::ENV_POD_MEM], "4", "{report}");
}

/// kubelet 1.11-1.25 (grpc-go dialing a bare path), grpcio and grpc-java send the socket path
/// as `:authority`; h2 alone answers RST_STREAM PROTOCOL_ERROR to it.
#[tokio::test]
async fn grpcio_kubelet_sending_the_socket_path_as_authority_registers_and_allocates() {
    grpcio_kubelet_drives_the_plugin("path").await;
}

/// kubelet 1.26+ sends `localhost`.
#[tokio::test]
async fn grpcio_kubelet_sending_localhost_as_authority_registers_and_allocates() {
    grpcio_kubelet_drives_the_plugin("localhost").await;
}
