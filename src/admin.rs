//! `/healthz`, `/readyz` and `/metrics` for the server roles: a readiness flag, a
//! Prometheus registry (with the build info and process metrics of [`crate::exposition`])
//! rendered in the format the scraper asks for, and [`serve`], an admin-only endpoint on the
//! shared [`crate::http_server`].
//!
//! The extender answers these paths on its own port next to the scheduling verbs (its
//! readiness has reasons of its own); the device plugin serves them with [`serve`] on
//! `device_plugin.admin_address`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::Full;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::exposition::Format;
use crate::http_server::{self, Limits, Reply, ServerMetrics};
use crate::shutdown::Shutdown;

/// Shared health state and metrics of one role.
#[derive(Debug)]
pub struct AdminState {
    ready: AtomicBool,
    registry: std::sync::Mutex<Registry>,
}

impl Default for AdminState {
    fn default() -> Self {
        let mut registry = Registry::default();
        crate::exposition::register_common(&mut registry);
        AdminState {
            ready: AtomicBool::new(false),
            registry: std::sync::Mutex::new(registry),
        }
    }
}

impl AdminState {
    /// A new state, not ready, with a registry holding only build info and process metrics.
    pub fn new() -> Arc<Self> {
        Arc::new(AdminState::default())
    }

    /// Marks the role ready or not.
    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether the role is ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Registers metrics with the registry.
    pub(crate) fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        let mut guard = match self.registry.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }

    /// The metrics in the Prometheus text format 0.0.4.
    pub fn render_metrics(&self) -> String {
        self.render_metrics_as(Format::Text)
    }

    /// The metrics in `format`.
    pub(crate) fn render_metrics_as(&self, format: Format) -> String {
        self.with_registry(|r| crate::exposition::render(r, format))
    }
}

fn respond(status: StatusCode, content_type: &str, body: String) -> Reply {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

/// Answers one admin request: `/healthz` (alive), `/readyz` (200 when ready, else 503 with
/// `not_ready`), `/metrics` (in the format `accept` asks for). Other paths 404; methods other
/// than GET/HEAD 405.
pub fn route(
    state: &AdminState,
    not_ready: &str,
    method: &Method,
    path: &str,
    accept: Option<&str>,
) -> Reply {
    const TEXT: &str = "text/plain; charset=utf-8";
    if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return respond(StatusCode::NOT_FOUND, TEXT, "not found\n".to_string());
    }
    if method != Method::GET && method != Method::HEAD {
        let mut r = respond(
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "use GET\n".to_string(),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET"));
        return r;
    }
    match path {
        "/healthz" => respond(StatusCode::OK, TEXT, "ok\n".to_string()),
        "/readyz" if state.is_ready() => respond(StatusCode::OK, TEXT, "ready\n".to_string()),
        "/readyz" => respond(
            StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            format!("{not_ready}\n"),
        ),
        _ => {
            let format = Format::negotiate(accept);
            respond(
                StatusCode::OK,
                format.content_type(),
                state.render_metrics_as(format),
            )
        }
    }
}

/// Listens on `address` and serves the admin paths until `stop`; returns the bound address
/// and the server task, or `None` when `address` is empty (the admin server is off).
/// `not_ready` is the `/readyz` body while not ready.
pub async fn serve(
    address: &str,
    state: Arc<AdminState>,
    not_ready: &'static str,
    limits: Limits,
    stop: Shutdown,
) -> anyhow::Result<Option<(SocketAddr, JoinHandle<()>)>> {
    let address = address.trim();
    if address.is_empty() {
        return Ok(None);
    }
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| anyhow::anyhow!("admin address {address}: {e}"))?;
    let local = listener.local_addr()?;
    let metrics = state.with_registry(ServerMetrics::register);
    let handler = move |req: http::Request<hyper::body::Incoming>| {
        let accept = req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok());
        let reply = route(&state, not_ready, req.method(), req.uri().path(), accept);
        async move { reply }
    };
    let task = tokio::spawn(http_server::serve(
        "admin", listener, None, limits, metrics, handler, stop,
    ));
    Ok(Some((local, task)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn admin_routes_answer_health_readiness_and_metrics() {
        let state = AdminState::new();
        let status = |m: Method, p: &str| route(&state, "not registered", &m, p, None).status();
        assert_eq!(status(Method::GET, "/healthz"), StatusCode::OK);
        assert_eq!(
            status(Method::GET, "/readyz"),
            StatusCode::SERVICE_UNAVAILABLE
        );
        state.set_ready(true);
        assert_eq!(status(Method::GET, "/readyz"), StatusCode::OK);
        assert_eq!(status(Method::HEAD, "/metrics"), StatusCode::OK);
        assert_eq!(
            status(Method::POST, "/metrics"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(status(Method::GET, "/nope"), StatusCode::NOT_FOUND);
    }

    #[test]
    fn readiness_and_metrics() {
        let state = AdminState::new();
        assert!(!state.is_ready());
        state.set_ready(true);
        assert!(state.is_ready());
        let c: Counter = Counter::default();
        state.with_registry(|r| r.register("gpushare_test", "a test counter", c.clone()));
        c.inc();
        let text = state.render_metrics();
        assert!(text.contains("gpushare_test_total 1"), "{text}");
    }
}
