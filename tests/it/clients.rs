//! The roles against clients that other people wrote (see `support::clients` for where each
//! comes from): Python grpcio playing kubelet for the device plugin, with the socket path as
//! `:authority` as kubelet 1.11-1.25 sends it and with `localhost` as 1.26+ sends it; promtool
//! on every `/metrics` we serve. The chart is rendered by the real Helm engine in
//! `packaging::chart`, kubectl runs the plugin in `inspect`.

use std::sync::Arc;

use gpushare::config::Config;
use gpushare::core::wire;
use gpushare::deviceplugin;
use gpushare::gpu::fake::FakeBackend;
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::Value;

use crate::support::clients;
use crate::support::dra_node;
use crate::support::socket_dir::short_tempdir;

const NODE: &str = "gpu-node-1";

/// A sandbox API server with one GPU node and one pod bound by the extender to GPU 1 (4 GiB),
/// and the device plugin serving `dir` (the kubelet there is the caller's), with its admin
/// endpoint on a free port when `admin`.
async fn plugin_on(
    dir: &std::path::Path,
    admin: bool,
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
    config.node.node_name = NODE.to_string();
    config.device_plugin.device_plugin_dir = dir.to_path_buf();
    config.device_plugin.state_dir = dir.join("state");
    config.device_plugin.pod_resources_socket = dir.join("no-pod-resources.sock");
    config.device_plugin.admin_address = if admin {
        "127.0.0.1:0".to_string()
    } else {
        String::new()
    };
    config.doctor.skip = true;
    let backend = FakeBackend::from_spec("2x16GiB").expect("fake GPUs");
    let plugin = deviceplugin::start(
        &config,
        api.admin_client(),
        Arc::new(backend),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("the device plugin starts");
    (api, plugin)
}

/// Runs tests/clients/kubelet_grpcio.py against the plugin; its JSON report and exit code.
async fn python_kubelet(authority: &str) -> Option<(Option<i32>, Value, String)> {
    let python = clients::grpcio_python()?;
    let dir = short_tempdir();
    let (api, plugin) = plugin_on(dir.path(), false).await;
    let args = ["--authority", authority, "--units", "4"];
    let answer = clients::device_plugin_kubelet_grpcio(&python, dir.path(), &args).await;
    plugin.stop().await;
    api.shutdown().await;
    Some(answer)
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

/// A `GET path` over HTTP/1.1 with `accept`: (Content-Type, body).
async fn scrape(addr: std::net::SocketAddr, accept: Option<&str>) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}Connection: close\r\n\r\n").as_bytes(),
    )
    .await
    .expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("content-type:")
                .then(|| l["content-type:".len()..].trim().to_string())
        })
        .unwrap_or_default();
    (content_type, body.to_string())
}

/// What every role's page carries, and the page passes promtool; then the OpenMetrics variant.
async fn check_scrape(addr: std::net::SocketAddr, role: &str) -> String {
    let (content_type, text) = scrape(addr, None).await;
    assert_eq!(
        content_type, "text/plain; version=0.0.4; charset=utf-8",
        "{role}"
    );
    if let Some((ok, said)) = clients::promtool_check(&text) {
        assert!(
            ok,
            "promtool check metrics rejects the {role} page:\n{said}\n---\n{text}"
        );
    }
    let build = format!(
        "gpushare_build_info{{version=\"{}\",commit=\"{}\",target=\"{}\"}} 1\n",
        gpushare::buildinfo::VERSION,
        gpushare::buildinfo::GIT_COMMIT,
        gpushare::buildinfo::TARGET_TRIPLE
    );
    assert!(
        text.contains(&build),
        "{role}: {build} missing from\n{text}"
    );
    for family in [
        "# TYPE gpushare_build_info gauge",
        "# TYPE process_cpu_seconds_total counter",
        "# TYPE process_resident_memory_bytes gauge",
        "# TYPE process_open_fds gauge",
        "# TYPE process_start_time_seconds gauge",
    ] {
        assert!(
            text.contains(family),
            "{role}: {family} missing from\n{text}"
        );
    }
    assert!(
        !text.contains("# EOF") && !text.contains("# UNIT"),
        "{role}: {text}"
    );
    // What Prometheus 2.x asks for first: OpenMetrics.
    let (content_type, om) = scrape(
        addr,
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
    )
    .await;
    assert_eq!(
        content_type, "application/openmetrics-text; version=1.0.0; charset=utf-8",
        "{role}"
    );
    assert!(om.ends_with("# EOF\n"), "{role}: {om}");
    text
}

#[tokio::test]
async fn promtool_accepts_the_extender_metrics() {
    use gpushare::extender;
    let api = ApiServer::start().await.expect("sandbox API server");
    let res = serde_json::json!({wire::RESOURCE_GPU_MEM: "32", wire::RESOURCE_GPU_COUNT: "2"});
    api.create_object(serde_json::json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1"}, "status": {"capacity": res, "allocatable": res}}))
        .expect("node");
    let mut config = Config::default();
    config.extender.bind_address = [127, 0, 0, 1].into();
    config.extender.port = 0;
    config.doctor.skip = true;
    let ext = extender::start(
        &config,
        api.admin_client(),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("extender starts");
    ext.wait_ready().await.expect("extender ready");
    // One filter, so the labelled counters and histograms have samples.
    let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "uid": "u1"},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {wire::RESOURCE_GPU_MEM: "4"}}}]}});
    let body = serde_json::json!({"Pod": pod, "NodeNames": ["n1", "nope"]}).to_string();
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(ext.addr)
            .await
            .expect("connect");
        s.write_all(
            format!(
                "POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .expect("write");
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.expect("read");
        assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    }
    let text = check_scrape(ext.addr, "extender").await;
    for sample in [
        "gpushare_extender_leader 1\n",
        // 2 GPUs of 16 units, GiB (the node declares no unit): 16 GiB each, in bytes.
        "gpushare_extender_gpu_memory_bytes{node=\"n1\",gpu=\"0\"} 17179869184\n",
        "gpushare_extender_gpu_memory_allocated_bytes{node=\"n1\",gpu=\"1\"} 0\n",
        "gpushare_extender_requests_total{verb=\"filter\",outcome=\"ok\"} 1\n",
    ] {
        assert!(text.contains(sample), "{sample} missing from\n{text}");
    }
    ext.stop().await;
    api.shutdown().await;
}

#[tokio::test]
async fn promtool_accepts_the_device_plugin_metrics() {
    use gpushare_sandbox::kubelet::Kubelet;
    let dir = short_tempdir();
    let kubelet = Kubelet::start(dir.path()).await.expect("sandbox kubelet");
    let (api, plugin) = plugin_on(&kubelet.device_plugin_dir(), true).await;
    kubelet
        .wait_registered(wire::RESOURCE_GPU_MEM)
        .await
        .expect("registered");
    kubelet
        .allocate_container(wire::RESOURCE_GPU_MEM, "default", "trainer", "main", 4)
        .await
        .expect("allocated");
    let addr = plugin.admin_addr().expect("admin server");
    let text = check_scrape(addr, "device plugin").await;
    for sample in [
        "gpushare_device_plugin_registered 1\n",
        "gpushare_device_plugin_allocations_total{outcome=\"matched\"} 1\n",
    ] {
        assert!(text.contains(sample), "{sample} missing from\n{text}");
    }
    plugin.stop().await;
    kubelet.stop().await;
    api.shutdown().await;
}

/// The DRA plugin's page: its kubelet side (a claim prepared) and the node metrics, promtool
/// clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_dra_plugin_metrics() {
    let node = dra_node::node(|cfg| cfg.dra.admin_address = "127.0.0.1:0".to_string()).await;
    let plugin = node.start().await;
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(wire::DRA_DRIVER_NAME)
        .await
        .expect("registers");
    dra_node::submit(&node.api, "p", 2, 1);
    crate::support::dra::allocate_one(&node.api).await;
    kubelet.prepare_pod("default", "p").await.expect("prepared");
    let addr = plugin.admin_addr().expect("admin server");
    let text = check_scrape(addr, "DRA plugin").await;
    for sample in [
        "gpushare_dra_plugin_registered 1\n",
        "gpushare_dra_plugin_prepares_total{outcome=\"prepared\"} 1\n",
        "gpushare_dra_plugin_prepared_claims 1\n",
        "gpushare_dra_plugin_unhealthy_gpus 0\n",
        "# TYPE gpushare_dra_plugin_prepare_seconds histogram",
    ] {
        assert!(text.contains(sample), "{sample} missing from\n{text}");
    }
    plugin.stop().await;
}
