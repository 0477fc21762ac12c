//! A sandbox API server with GPU nodes and whole extenders on loopback, as the HA, watch-churn
//! and hostile-input tests drive them: the seeded sandbox, the extender's configuration for
//! sub-minute lease timings, bind through a given replica, and the wait for a replica to
//! answer. The objects come from [`super::objects`], the HTTP client from
//! [`super::extender_http`], the waits from [`super::wait`].
//!
//! What the ledger must equal afterwards is in [`super::ledger_truth`].

use gpushare::config::Config;
use gpushare::extender::ExtenderHandle;
use gpushare::shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::json;

use super::extender_http::http;
use super::objects::gpu_node;
use super::wait::{DEADLINE, poll};

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
    gpushare::extender::start(config, api.admin_client(), shutdown::Shutdown::never())
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
    gpushare::extender::start_with(
        config,
        api.admin_client(),
        shutdown::Shutdown::never(),
        options,
    )
    .await
    .expect("extender starts")
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
    poll(&format!("{url} to answer 200"), DEADLINE, || async {
        match http(http::Method::GET, url, None).await {
            Some((200, _)) => Ok(()),
            got => Err(got.map(|(s, b)| (s, String::from_utf8_lossy(&b).into_owned()))),
        }
    })
    .await;
}
