//! The extender's HTTP side as the integration tests drive it: the one plain HTTP client of
//! the tests ([`http`]: `None` when nothing answers), the scheduling verbs' JSON and
//! `/inspect`. The objects they send come from
//! [`super::objects`].

use std::net::SocketAddr;

use bytes::Bytes;
use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::wait::DEADLINE;

/// One HTTP/1.1 request; `(status, body)`, or `None` when the connection failed or no
/// answer came within [`DEADLINE`] (a stopped replica).
pub(crate) async fn http(
    method: http::Method,
    url: &str,
    body: Option<Vec<u8>>,
) -> Option<(u16, Vec<u8>)> {
    http_as(method, url, body, None).await
}

/// [`http`] with `Authorization: Bearer <token>` when a token is given (the sandbox API
/// server's raw answers, as a client holding that token gets them).
pub(crate) async fn http_as(
    method: http::Method,
    url: &str,
    body: Option<Vec<u8>>,
    bearer: Option<&str>,
) -> Option<(u16, Vec<u8>)> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = http::Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::CONTENT_TYPE, "application/json");
    if let Some(token) = bearer {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .ok()?;
    let resp = tokio::time::timeout(DEADLINE, client.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes().to_vec();
    Some((status, body))
}

/// One request to the extender at `addr`, which must answer: `(status, body text)`.
pub(crate) async fn request(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Vec<u8>,
) -> (u16, String) {
    let url = format!("http://{addr}{path}");
    let (status, body) = http(method, &url, Some(body))
        .await
        .unwrap_or_else(|| panic!("the extender at {addr} does not answer {path}"));
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
