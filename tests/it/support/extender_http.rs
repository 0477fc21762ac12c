//! The extender's HTTP side as the integration tests drive it: one request helper, the
//! scheduling verbs' JSON, `/inspect`, a bounded wait on a condition, and the Node and Pod
//! objects the extender tests seed.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// How long [`eventually`] waits before it fails the test.
const DEADLINE: Duration = Duration::from_secs(30);

pub(crate) async fn request(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Vec<u8>,
) -> (u16, String) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request builds");
    let resp = client.request(req).await.expect("extender answers");
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("body reads")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

pub(crate) async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (s, b) = request(addr, Method::POST, path, body.to_string().into_bytes()).await;
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

pub(crate) async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    request(addr, Method::GET, path, Vec::new()).await
}

pub(crate) async fn inspect(addr: SocketAddr) -> Value {
    let (s, b) = get(addr, "/gpushare-scheduler/inspect").await;
    assert_eq!(s, 200, "{b}");
    serde_json::from_str(&b).expect("inspect is JSON")
}

pub(crate) async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        if cond().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) fn node(name: &str, gpus: u64, per_gpu: u64) -> Value {
    let res = json!({"aliyun.com/gpu-mem": (gpus * per_gpu).to_string(),
                     "aliyun.com/gpu-count": gpus.to_string(), "cpu": "8"});
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
           "status": {"capacity": res, "allocatable": res}})
}

pub(crate) fn pod(name: &str, mem: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default"},
           "spec": {"containers": [{"name": "main", "image": "cuda",
               "resources": {"limits": {"aliyun.com/gpu-mem": mem}}}]}})
}
