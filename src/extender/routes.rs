//! The HTTP surface: routing, methods (404/405), body limit (413), JSON errors. The server
//! loop (TLS, deadlines, connection cap, drain) is the shared [`crate::http_server`].
//!
//! Paths: `POST {prefix}/filter|prioritize|bind`, `GET {prefix}/inspect[/{node}]`,
//! `GET /version`, `/healthz`, `/readyz`, `/metrics`. Every error body is `{"Error": "..."}`.
//! With leader election, a standby forwards the verbs and `inspect` to the leader
//! ([`super::forward`]); a bind is admitted under the leader's term before its body is read.
//!
//! With `extender.tls_client_ca`, the scheduling verbs and `inspect` answer 403 to a
//! connection that presented no client certificate (the TLS layer already refused any
//! certificate the CA does not vouch for); `/healthz`, `/readyz`, `/version` and `/metrics`
//! stay open to probes and Prometheus.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::forward::{self, FORWARDED_BY, ForwardError, Forwarded, Forwarder, Settled, VIEW_OF};
use super::state::ExtenderState;
use super::verb_error::VerbError;
use super::wire::{ErrorBody, decode_binding_args, decode_extender_args};
use super::{bind, filter, inspect, prioritize};
use crate::http_server;
use crate::shutdown::Shutdown;

type Resp = Response<Full<Bytes>>;

fn json<T: Serialize>(status: StatusCode, value: &T) -> Resp {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

fn error(status: StatusCode, message: impl Into<String>) -> Resp {
    json(
        status,
        &ErrorBody {
            error: message.into(),
        },
    )
}

fn text(status: StatusCode, body: String, content_type: &str) -> Resp {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

/// The routes, resolved against the configured prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route<'a> {
    Filter,
    Prioritize,
    Bind,
    Inspect(Option<&'a str>),
    Version,
    Healthz,
    Readyz,
    Metrics,
}

impl Route<'_> {
    fn method(&self) -> Method {
        match self {
            Route::Filter | Route::Prioritize | Route::Bind => Method::POST,
            _ => Method::GET,
        }
    }
    /// Whether the route needs a client certificate when client certificates are checked.
    fn needs_client_certificate(&self) -> bool {
        matches!(
            self,
            Route::Filter | Route::Prioritize | Route::Bind | Route::Inspect(_)
        )
    }

    fn verb(&self) -> &'static str {
        match self {
            Route::Filter => "filter",
            Route::Prioritize => "prioritize",
            Route::Bind => "bind",
            Route::Inspect(_) => "inspect",
            _ => "admin",
        }
    }
}

fn route<'a>(prefix: &str, path: &'a str) -> Option<Route<'a>> {
    match path {
        "/version" => return Some(Route::Version),
        "/healthz" => return Some(Route::Healthz),
        "/readyz" => return Some(Route::Readyz),
        "/metrics" => return Some(Route::Metrics),
        _ => {}
    }
    let rest = path.strip_prefix(prefix)?;
    match rest {
        "/filter" => Some(Route::Filter),
        "/prioritize" => Some(Route::Prioritize),
        "/bind" => Some(Route::Bind),
        "/inspect" | "/inspect/" => Some(Route::Inspect(None)),
        _ => {
            let node = rest.strip_prefix("/inspect/")?;
            (!node.is_empty() && !node.contains('/')).then_some(Route::Inspect(Some(node)))
        }
    }
}

/// Answers one request. Never fails: every problem is a status and a JSON body. A standby
/// (leader election on, not leading) forwards the scheduling verbs and `inspect` to the
/// leader through `forwarder`.
pub async fn handle(
    state: Arc<ExtenderState>,
    forwarder: Arc<Forwarder>,
    limits: http_server::Limits,
    req: Request<Incoming>,
) -> Result<Resp, Infallible> {
    let started = Instant::now();
    let prefix = state.config().url_prefix.trim_end_matches('/').to_string();
    let path = req.uri().path().to_string();
    let Some(route) = route(&prefix, &path) else {
        return Ok(error(
            StatusCode::NOT_FOUND,
            format!("no such path {path:?}"),
        ));
    };
    if req.method() != route.method()
        && !(route.method() == Method::GET && req.method() == Method::HEAD)
    {
        let mut r = error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!(
                "method {} not allowed on {path}; use {}",
                req.method(),
                route.method()
            ),
        );
        if let Ok(v) = header::HeaderValue::from_str(route.method().as_str()) {
            r.headers_mut().insert(header::ALLOW, v);
        }
        return Ok(r);
    }
    if route.needs_client_certificate()
        && !state.config().tls_client_ca.is_empty()
        && req
            .extensions()
            .get::<http_server::PeerCertificate>()
            .is_none()
    {
        state.metrics().observe(
            route.verb(),
            "unauthenticated",
            started.elapsed().as_secs_f64(),
        );
        return Ok(error(
            StatusCode::FORBIDDEN,
            format!(
                "{path} needs a client certificate signed by the extender's client CA \
                 (extender.tls_client_ca): give kube-scheduler's extender tlsConfig a certFile \
                 and keyFile, or `gpushare inspect --from-extender` --extender-cert and \
                 --extender-key"
            ),
        ));
    }
    let (resp, outcome) = match route {
        Route::Version => (
            text(
                StatusCode::OK,
                env!("CARGO_PKG_VERSION").to_string(),
                "text/plain; charset=utf-8",
            ),
            "",
        ),
        Route::Healthz => (
            text(StatusCode::OK, "ok\n".into(), "text/plain; charset=utf-8"),
            "",
        ),
        Route::Readyz => (readyz(&state, &forwarder).await, ""),
        Route::Metrics => {
            state
                .metrics()
                .refresh(state.cache(), state.is_synced(), state.is_serving());
            let format = crate::exposition::Format::negotiate(
                req.headers()
                    .get(header::ACCEPT)
                    .and_then(|v| v.to_str().ok()),
            );
            (
                text(
                    StatusCode::OK,
                    state.admin().render_metrics_as(format),
                    format.content_type(),
                ),
                "",
            )
        }
        Route::Inspect(node) => {
            let path_and_query = req
                .uri()
                .path_and_query()
                .map_or(path.clone(), |p| p.as_str().to_string());
            inspect_route(&state, &forwarder, &req, node, &path_and_query).await
        }
        Route::Filter | Route::Prioritize | Route::Bind => {
            scheduling(&state, &forwarder, &limits, route, req).await
        }
    };
    if !outcome.is_empty() {
        state
            .metrics()
            .observe(route.verb(), outcome, started.elapsed().as_secs_f64());
    }
    Ok(resp)
}

/// Whether this replica answers the verbs itself: no election, or it serves (leads), or the
/// request was already forwarded once (never forwarded again).
fn answers_locally(state: &ExtenderState, req: &Request<Incoming>) -> bool {
    !state.fence().is_elected() || state.is_serving() || req.headers().contains_key(FORWARDED_BY)
}

/// How long a forwarded request may take (the bind: the leader's deadline and a second).
fn forward_timeout(
    state: &ExtenderState,
    limits: &http_server::Limits,
    route: Route<'_>,
) -> Duration {
    let cap = limits.request.saturating_sub(Duration::from_millis(500));
    let want = match route {
        Route::Bind => {
            Duration::from_millis(state.config().bind_timeout_ms) + Duration::from_secs(1)
        }
        _ => Duration::from_secs(10),
    };
    want.min(cap).max(Duration::from_millis(100))
}

/// The leader's base URL, or why there is none to forward to.
fn leader_url(state: &ExtenderState) -> Result<(String, String), forward::NoLeader> {
    forward::leader_url(state.fence().leader())
}

/// Answers a scheduling verb's typed error: its status and `{"Error": ...}`, counted by kind
/// in `gpushare_extender_errors_total`; the outcome label for the request metric.
fn failed(state: &ExtenderState, verb: &'static str, e: &impl VerbError) -> (Resp, &'static str) {
    state.metrics().count_error(verb, e.label());
    (error(e.status(), e.to_string()), e.outcome())
}

/// `/readyz`: the leader (or a single replica) once its ledger is synced; a standby while
/// it can reach a leader that is ready. 503 otherwise, with the reason.
async fn readyz(state: &ExtenderState, forwarder: &Forwarder) -> Resp {
    const TEXT: &str = "text/plain; charset=utf-8";
    if !state.fence().is_elected() || state.is_serving() {
        return match state.unavailable_reason() {
            None => text(StatusCode::OK, "ok\n".into(), TEXT),
            Some(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"), TEXT),
        };
    }
    let (leader, url) = match leader_url(state) {
        Ok(l) => l,
        Err(why) => return text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"), TEXT),
    };
    match forwarder
        .send(
            &url,
            Method::GET,
            "/readyz",
            Bytes::new(),
            Duration::from_secs(2),
        )
        .await
    {
        Ok(r) if r.status == StatusCode::OK => text(
            StatusCode::OK,
            format!("ok (standby; the leader {leader} at {url} is ready)\n"),
            TEXT,
        ),
        Ok(r) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the leader {leader} at {url} is not ready: {}\n",
                String::from_utf8_lossy(&r.body).trim()
            ),
            TEXT,
        ),
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n"), TEXT),
    }
}

/// Sets `X-Gpushare-View` on `resp`.
fn with_view(mut resp: Resp, view: &str) -> Resp {
    if let Ok(v) = header::HeaderValue::from_str(view) {
        resp.headers_mut().insert(VIEW_OF, v);
    }
    resp
}

/// The leader's answer, passed through.
fn passed_through(r: Forwarded) -> Resp {
    let mut resp = Response::builder()
        .status(r.status)
        .body(Full::new(r.body))
        .unwrap_or_default();
    if let Some(ct) = r.content_type {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    if let Some(v) = r.view {
        resp.headers_mut().insert(VIEW_OF, v);
    }
    resp
}

/// `inspect`: the leader's ledger. A standby forwards; when the leader cannot be reached it
/// shows its own (warm, maybe stale) ledger and says so in `view`.
async fn inspect_route(
    state: &Arc<ExtenderState>,
    forwarder: &Forwarder,
    req: &Request<Incoming>,
    node: Option<&str>,
    path_and_query: &str,
) -> (Resp, &'static str) {
    let fence = state.fence();
    let mut note = None;
    if fence.is_elected() && !answers_locally(state, req) {
        match leader_url(state) {
            Ok((_, url)) => match forwarder
                .send(
                    &url,
                    Method::GET,
                    path_and_query,
                    Bytes::new(),
                    Duration::from_secs(10),
                )
                .await
            {
                Ok(r) => return (passed_through(r), "ok"),
                Err(e) => note = Some(format!("{e}; showing this standby's own ledger")),
            },
            Err(why) => note = Some(format!("{why}; showing this standby's own ledger")),
        }
    }
    let leading = fence.is_leading() && state.is_serving();
    let view = fence.is_elected().then(|| inspect::View {
        replica: fence.identity().to_string(),
        leader: leading,
        note,
    });
    let view_header = format!(
        "{} ({})",
        fence.identity(),
        if leading { "leader" } else { "standby" }
    );
    let (resp, outcome) = match node {
        None => {
            let mut answer = inspect::inspect(&state.cache().views());
            answer.view = view;
            (json(StatusCode::OK, &answer), "ok")
        }
        Some(n) => match state.cache().node_view(n) {
            Some(v) => {
                let mut answer = inspect::inspect(std::slice::from_ref(&v));
                answer.view = view;
                (json(StatusCode::OK, &answer), "ok")
            }
            None => (
                error(
                    StatusCode::NOT_FOUND,
                    format!("node {n:?} is not known to the extender"),
                ),
                "not_found",
            ),
        },
    };
    (with_view(resp, &view_header), outcome)
}

async fn read_request_body(
    state: &ExtenderState,
    limits: &http_server::Limits,
    req: Request<Incoming>,
) -> Result<Bytes, (Resp, &'static str)> {
    match http_server::read_body(req, state.config().max_body_bytes, limits.body_read).await {
        Ok(b) => Ok(b),
        Err(e @ http_server::BodyError::TooLarge { .. }) => Err((
            error(e.status(), format!("{e} (extender.max_body_bytes)")),
            "bad_request",
        )),
        Err(e) => Err((error(e.status(), e.to_string()), "bad_request")),
    }
}

async fn scheduling(
    state: &Arc<ExtenderState>,
    forwarder: &Forwarder,
    limits: &http_server::Limits,
    route: Route<'_>,
    req: Request<Incoming>,
) -> (Resp, &'static str) {
    if !answers_locally(state, &req) {
        return forward_verb(state, forwarder, limits, route, req).await;
    }
    if let Some(why) = state.unavailable_reason() {
        return (error(StatusCode::SERVICE_UNAVAILABLE, why), "unavailable");
    }
    // A bind is admitted under the current leadership term BEFORE its body is read: its
    // deadline counts from here, and a term that ends meanwhile fences its writes.
    let ticket = if route == Route::Bind {
        let timeout = Duration::from_millis(state.config().bind_timeout_ms.max(1));
        match state.fence().admit(timeout) {
            Ok(t) => Some(t),
            Err(e) => {
                return (
                    error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    "unavailable",
                );
            }
        }
    } else {
        None
    };
    let body = match read_request_body(state, limits, req).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    match (route, ticket) {
        (Route::Filter | Route::Prioritize, _) => {
            let args = match decode_extender_args(&body) {
                Ok(a) => a,
                Err(e) => return (error(StatusCode::BAD_REQUEST, e.0), "bad_request"),
            };
            if route == Route::Filter {
                match filter::filter(state, args) {
                    Ok(r) => {
                        let outcome = if r.node_names.as_ref().is_some_and(|n| n.is_empty())
                            || r.nodes.as_ref().is_some_and(|n| n.items.is_empty())
                        {
                            "rejected"
                        } else {
                            "ok"
                        };
                        (json(StatusCode::OK, &r), outcome)
                    }
                    Err(e) => failed(state, "filter", &e),
                }
            } else {
                match prioritize::prioritize(state, &args) {
                    Ok(r) => (json(StatusCode::OK, &r), "ok"),
                    Err(e) => failed(state, "prioritize", &e),
                }
            }
        }
        (_, Some(ticket)) => {
            let args = match decode_binding_args(&body) {
                Ok(a) => a,
                Err(e) => return (error(StatusCode::BAD_REQUEST, e.0), "bad_request"),
            };
            match bind::bind(state, &args, &ticket).await {
                Ok(msg) => {
                    tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, "bound: {msg}");
                    (error(StatusCode::OK, ""), "ok")
                }
                Err(why) => {
                    tracing::warn!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, kind = why.label(), "bind failed: {why}");
                    failed(state, "bind", &why)
                }
            }
        }
        (_, None) => (
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "a bind without admission",
            ),
            "error",
        ),
    }
}

/// A standby's scheduling verb: the leader answers. A bind whose answer is lost is settled
/// by reading the pod once the leader's fence forbids that bind any further write.
async fn forward_verb(
    state: &Arc<ExtenderState>,
    forwarder: &Forwarder,
    limits: &http_server::Limits,
    route: Route<'_>,
    req: Request<Incoming>,
) -> (Resp, &'static str) {
    let (leader, url) = match leader_url(state) {
        Ok(l) => l,
        Err(why) => return failed(state, route.verb(), &why),
    };
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_string(), |p| p.as_str().to_string());
    let body = match read_request_body(state, limits, req).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    // A bind needs its pod for settling a lost answer: decode it here (the leader would
    // refuse the same body with the same 400).
    let binding = if route == Route::Bind {
        match decode_binding_args(&body) {
            Ok(a) => Some(a),
            Err(e) => return (error(StatusCode::BAD_REQUEST, e.0), "bad_request"),
        }
    } else {
        None
    };
    let timeout = forward_timeout(state, limits, route);
    match forwarder
        .send(&url, Method::POST, &path_and_query, body, timeout)
        .await
    {
        Ok(r) => {
            let outcome = if r.status.is_success() {
                "forwarded"
            } else {
                "forwarded_error"
            };
            (passed_through(r), outcome)
        }
        Err(e @ (ForwardError::NotSent { .. } | ForwardError::BadAddress(_))) => {
            tracing::warn!(%leader, error = %e, "could not forward to the leader");
            (
                error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                "unavailable",
            )
        }
        Err(e @ ForwardError::Lost { .. }) => {
            let Some(args) = binding else {
                // Filter and prioritize write nothing: the scheduler may simply ask again.
                return (
                    error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    "unavailable",
                );
            };
            // The leader admitted the bind no later than now; its fence forbids writes after
            // its bind_timeout_ms from admission. Past that (and a margin for a write in
            // flight), an unbound pod means the bind did not happen.
            let bind_timeout = Duration::from_millis(state.config().bind_timeout_ms);
            let settle_at = tokio::time::Instant::now() + bind_timeout + Duration::from_secs(1);
            let give_up = settle_at + Duration::from_secs(5);
            let settled = forward::settle_bind(
                state.client(),
                &args.pod_namespace,
                &args.pod_name,
                &args.pod_uid,
                &args.node,
                settle_at,
                give_up,
            )
            .await;
            let pod = format!("{}/{}", args.pod_namespace, args.pod_name);
            match settled {
                Ok(Settled::Bound) => {
                    tracing::info!(%pod, node = %args.node, %leader, "the leader's answer was lost; the pod is bound: success");
                    (error(StatusCode::OK, ""), "ok")
                }
                Ok(Settled::Refused(why)) => (
                    error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}; {why}")),
                    "error",
                ),
                Ok(Settled::NotBound) => (
                    error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "{e}; the pod {pod} is not bound to {}: the bind did not happen",
                            args.node
                        ),
                    ),
                    "error",
                ),
                Ok(Settled::Reserved) => (
                    error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "{e}; the pod {pod} is not bound yet but holds the leader's \
                             reservation on {}: the outcome is unknown and the leader settles it \
                             by reading the API",
                            args.node
                        ),
                    ),
                    "error",
                ),
                Err(why) => (
                    error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("{e}; outcome unknown: {why}"),
                    ),
                    "error",
                ),
            }
        }
    }
}

/// Serves the extender on `listener` until `shutdown` (the shared [`http_server`] loop);
/// a standby forwards through `forwarder`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<(TlsAcceptor, Arc<crate::tls::ServerTls>)>,
    forwarder: Forwarder,
    state: Arc<ExtenderState>,
    limits: http_server::Limits,
    shutdown: Shutdown,
) {
    let metrics = state
        .admin()
        .with_registry(http_server::ServerMetrics::register);
    let forwarder = Arc::new(forwarder);
    let (acceptor, material) = tls.unzip();
    let handler = move |mut req: http::Request<hyper::body::Incoming>| {
        let state = state.clone();
        let forwarder = forwarder.clone();
        // A certificate verified at the handshake counts only while the client CA in force
        // still trusts it (the CA file may have been replaced since).
        if let Some(peer) = req.extensions().get::<http_server::PeerCertificate>()
            && !material.as_ref().is_some_and(|m| m.still_trusts(&peer.0))
        {
            req.extensions_mut()
                .remove::<http_server::PeerCertificate>();
        }
        async move {
            match handle(state, forwarder, limits, req).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        }
    };
    http_server::serve(
        "extender", listener, acceptor, limits, metrics, handler, shutdown,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_resolve_under_the_prefix() {
        let p = "/gpushare-scheduler";
        assert_eq!(route(p, "/gpushare-scheduler/filter"), Some(Route::Filter));
        assert_eq!(route(p, "/gpushare-scheduler/bind"), Some(Route::Bind));
        assert_eq!(
            route(p, "/gpushare-scheduler/inspect"),
            Some(Route::Inspect(None))
        );
        assert_eq!(
            route(p, "/gpushare-scheduler/inspect/n1"),
            Some(Route::Inspect(Some("n1")))
        );
        assert_eq!(route(p, "/gpushare-scheduler/inspect/n1/x"), None);
        assert_eq!(route(p, "/gpushare-scheduler/filterx"), None);
        assert_eq!(route(p, "/filter"), None);
        assert_eq!(route(p, "/version"), Some(Route::Version));
        assert_eq!(route("", "/filter"), Some(Route::Filter));
    }
}
