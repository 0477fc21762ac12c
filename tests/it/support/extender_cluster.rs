//! A sandbox API server with GPU nodes and whole extenders on loopback, as the HA, watch-churn
//! and hostile-input tests drive them: the Node and Pod objects they seed, the extender's
//! configuration for sub-minute lease timings, a plain HTTP client that reports a failed
//! connection as `None` (a stopped replica), bind through a given replica, and bounded waits.
//!
//! What the ledger must equal afterwards is in [`super::ledger_truth`].

use std::time::Duration;

use gpushare::config::Config;
use gpushare::core::wire::{
    ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, ANN_POD_MEM, RESOURCE_GPU_COUNT,
    RESOURCE_GPU_MEM,
};
use gpushare::extender::ExtenderHandle;
use gpushare::shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

/// How long a wait of these tests lasts before it fails the test.
pub(crate) const DEADLINE: Duration = Duration::from_secs(20);

/// Polls `cond` every 20 ms until it holds or [`DEADLINE`] passes.
pub(crate) async fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    wait_until_within(what, DEADLINE, cond).await;
}

/// Polls `cond` every 20 ms until it holds, or fails the test after `limit`.
pub(crate) async fn wait_until_within(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + limit;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A node object offering `gpus` GPUs of `units` each (the upstream even split).
pub(crate) fn gpu_node(name: &str, gpus: u64, units: u64) -> Value {
    let total = (gpus * units).to_string();
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name },
        "status": {
            "capacity": { RESOURCE_GPU_MEM: total, RESOURCE_GPU_COUNT: gpus.to_string() },
            "allocatable": { RESOURCE_GPU_MEM: total, RESOURCE_GPU_COUNT: gpus.to_string() },
        },
    })
}

/// A pending pod asking for `mem` units.
pub(crate) fn pending_pod(name: &str, mem: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "containers": [{ "name": "main", "image": "x",
            "resources": { "limits": { RESOURCE_GPU_MEM: mem.to_string() } } }] },
        "status": { "phase": "Pending" },
    })
}

/// A pod already bound to `node` and holding `mem` units of GPU `gpu`.
pub(crate) fn bound_pod(name: &str, node: &str, gpu: u32, mem: u64, units: u64) -> Value {
    let mut pod = pending_pod(name, mem);
    pod["spec"]["nodeName"] = json!(node);
    pod["status"]["phase"] = json!("Running");
    pod["metadata"]["annotations"] = json!({
        ANN_GPU_INDEX: gpu.to_string(), ANN_POD_MEM: mem.to_string(),
        ANN_DEVICE_MEM: units.to_string(), ANN_ASSIGNED: "true",
        ANN_ASSUME_TIME: "1700000000000000000",
    });
    pod
}

/// A sandbox API server with nodes `node-0..n` of `gpus` × `units`.
pub(crate) async fn sandbox(nodes: usize, gpus: u64, units: u64) -> ApiServer {
    let api = ApiServer::start().await.expect("api server");
    for n in 0..nodes {
        api.create_object(gpu_node(&format!("node-{n}"), gpus, units))
            .expect("seed node");
    }
    api
}

/// Extender configuration for loopback tests; with leader election, timings of 3/2/1 s (the
/// shortest the whole-second settings allow with retry < renew deadline < lease).
pub(crate) fn extender_config(leader_elect: bool) -> Config {
    let mut config = Config::default();
    config.extender.bind_address = [127, 0, 0, 1].into();
    config.extender.port = 0;
    config.extender.leader_elect = leader_elect;
    config.extender.lease_name = "gpushare-ha-extenders".to_string();
    config.extender.lease_duration_secs = 3;
    config.extender.renew_deadline_secs = 2;
    config.extender.retry_period_secs = 1;
    config.extender.bind_timeout_ms = 900;
    config
}

pub(crate) async fn start_extender(api: &ApiServer, config: &Config) -> ExtenderHandle {
    gpushare::extender::start(config, api.client(), shutdown::Shutdown::never())
        .await
        .expect("extender starts")
}

/// An extender whose replica identity is `identity` (its lease writes carry
/// `fieldManager=<identity>`, which fault filters can single out).
pub(crate) async fn start_named(
    api: &ApiServer,
    config: &Config,
    identity: &str,
) -> ExtenderHandle {
    let options = gpushare::extender::StartOptions {
        identity: Some(identity.to_string()),
        ..Default::default()
    };
    gpushare::extender::start_with(config, api.client(), shutdown::Shutdown::never(), options)
        .await
        .expect("extender starts")
}

/// One HTTP/1.1 request on a fresh connection; `(status, body)`, or `None` when the
/// connection failed.
pub(crate) async fn http(
    method: http::Method,
    url: &str,
    body: Option<Vec<u8>>,
) -> Option<(u16, Vec<u8>)> {
    let client: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(bytes::Bytes::from(body.unwrap_or_default())))
        .ok()?;
    let resp = tokio::time::timeout(DEADLINE, client.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes().to_vec();
    Some((status, body))
}

pub(crate) fn binding_args(api: &ApiServer, name: &str, node: &str) -> Vec<u8> {
    let uid = api
        .get_object("pods", Some("default"), name)
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_string))
        .unwrap_or_default();
    serde_json::to_vec(&json!({
        "PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node,
    }))
    .unwrap_or_default()
}

/// Binds `name` to `node` through the extender at `addr`; the HTTP status, `None` when the
/// connection failed (a stopped replica).
pub(crate) async fn bind_via(
    api: &ApiServer,
    addr: std::net::SocketAddr,
    name: &str,
    node: &str,
) -> Option<u16> {
    let url = format!("http://{addr}/gpushare-scheduler/bind");
    http(
        http::Method::POST,
        &url,
        Some(binding_args(api, name, node)),
    )
    .await
    .map(|(s, _)| s)
}

/// Polls `url` (GET) until it answers 200, or fails after [`DEADLINE`].
pub(crate) async fn wait_http_ok(url: &str) {
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        let got = http(http::Method::GET, url, None).await;
        if got.as_ref().map(|r| r.0) == Some(200) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "{url} never answered 200; last: {:?}",
            got.map(|(s, b)| (s, String::from_utf8_lossy(&b).into_owned()))
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
