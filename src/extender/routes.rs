//! The HTTP surface: routing, methods (404/405), body limit (413), JSON errors. The server
//! loop (TLS, deadlines, connection cap, drain) is the shared [`crate::http_server`].
//!
//! Paths: `POST {prefix}/filter|prioritize|bind`, `GET {prefix}/inspect[/{node}]`,
//! `GET /version`, `/healthz`, `/readyz`, `/metrics`. Every error body is `{"Error": "..."}`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::state::ExtenderState;
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

/// Answers one request. Never fails: every problem is a status and a JSON body.
pub async fn handle(
    state: Arc<ExtenderState>,
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
        Route::Readyz => match state.unavailable_reason() {
            None => (
                text(StatusCode::OK, "ok\n".into(), "text/plain; charset=utf-8"),
                "",
            ),
            Some(why) => (
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("{why}\n"),
                    "text/plain; charset=utf-8",
                ),
                "",
            ),
        },
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
        Route::Inspect(node) => match node {
            None => (
                json(StatusCode::OK, &inspect::inspect(&state.cache().views())),
                "ok",
            ),
            Some(n) => match state.cache().node_view(n) {
                Some(v) => (
                    json(StatusCode::OK, &inspect::inspect(std::slice::from_ref(&v))),
                    "ok",
                ),
                None => (
                    error(
                        StatusCode::NOT_FOUND,
                        format!("node {n:?} is not known to the extender"),
                    ),
                    "not_found",
                ),
            },
        },
        Route::Filter | Route::Prioritize | Route::Bind => {
            scheduling(&state, &limits, route, req).await
        }
    };
    if !outcome.is_empty() {
        state
            .metrics()
            .observe(route.verb(), outcome, started.elapsed().as_secs_f64());
    }
    Ok(resp)
}

async fn scheduling(
    state: &Arc<ExtenderState>,
    limits: &http_server::Limits,
    route: Route<'_>,
    req: Request<Incoming>,
) -> (Resp, &'static str) {
    if let Some(why) = state.unavailable_reason() {
        return (error(StatusCode::SERVICE_UNAVAILABLE, why), "unavailable");
    }
    let body =
        match http_server::read_body(req, state.config().max_body_bytes, limits.body_read).await {
            Ok(b) => b,
            Err(e @ http_server::BodyError::TooLarge { .. }) => {
                return (
                    error(e.status(), format!("{e} (extender.max_body_bytes)")),
                    "bad_request",
                );
            }
            Err(e) => return (error(e.status(), e.to_string()), "bad_request"),
        };
    match route {
        Route::Filter | Route::Prioritize => {
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
                    Err(e) => (error(StatusCode::BAD_REQUEST, e), "bad_request"),
                }
            } else {
                match prioritize::prioritize(state, &args) {
                    Ok(r) => (json(StatusCode::OK, &r), "ok"),
                    Err(e) => (error(StatusCode::BAD_REQUEST, e), "bad_request"),
                }
            }
        }
        _ => {
            let args = match decode_binding_args(&body) {
                Ok(a) => a,
                Err(e) => return (error(StatusCode::BAD_REQUEST, e.0), "bad_request"),
            };
            match bind::bind(state, &args).await {
                Ok(msg) => {
                    tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, "bound: {msg}");
                    (error(StatusCode::OK, ""), "ok")
                }
                Err(why) => {
                    tracing::warn!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, "bind failed: {why}");
                    (error(StatusCode::INTERNAL_SERVER_ERROR, why), "error")
                }
            }
        }
    }
}

/// Builds the TLS acceptor from PEM files.
pub fn tls_acceptor(cert: &str, key: &str) -> anyhow::Result<TlsAcceptor> {
    use anyhow::Context;
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading TLS certificate {cert}"))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing TLS certificate {cert}"))?;
    if certs.is_empty() {
        anyhow::bail!("TLS certificate {cert} holds no certificate");
    }
    let key =
        PrivateKeyDer::from_pem_file(key).with_context(|| format!("reading TLS key {key}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("TLS certificate and key do not match")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves the extender on `listener` until `shutdown` (the shared [`http_server`] loop).
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    state: Arc<ExtenderState>,
    limits: http_server::Limits,
    shutdown: Shutdown,
) {
    let metrics = http_server::ServerMetrics::register(state.admin());
    let handler = move |req| {
        let state = state.clone();
        async move {
            match handle(state, limits, req).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        }
    };
    http_server::serve(
        "extender", listener, tls, limits, metrics, handler, shutdown,
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
