//! A tiny HTTP/1 server for the device plugin's `/healthz` (process alive), `/readyz`
//! (registered with kubelet) and `/metrics` (Prometheus text), on
//! `device_plugin.admin_address`. Anything else is 404; methods other than GET/HEAD are 405.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::admin::{AdminState, METRICS_CONTENT_TYPE};
use crate::shutdown::Shutdown;

fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

/// Answers one admin request.
pub fn route(state: &AdminState, method: &Method, path: &str) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return respond(StatusCode::NOT_FOUND, TEXT, "not found\n".to_string());
    }
    if method != Method::GET && method != Method::HEAD {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "use GET\n".to_string(),
        );
    }
    match path {
        "/healthz" => respond(StatusCode::OK, TEXT, "ok\n".to_string()),
        "/readyz" if state.is_ready() => respond(StatusCode::OK, TEXT, "ready\n".to_string()),
        "/readyz" => respond(
            StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            "not registered with kubelet\n".to_string(),
        ),
        _ => respond(StatusCode::OK, METRICS_CONTENT_TYPE, state.render_metrics()),
    }
}

/// Listens on `address` and serves until `stop`; returns the bound address.
pub async fn serve(
    address: &str,
    state: Arc<AdminState>,
    stop: Shutdown,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| anyhow::anyhow!("admin address {address}: {e}"))?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let stopped = stop.wait();
        tokio::pin!(stopped);
        loop {
            let (stream, _) = tokio::select! {
                _ = &mut stopped => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::debug!(error = %e, "admin accept failed");
                        continue;
                    }
                },
            };
            let state = state.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let resp = route(&state, req.method(), req.uri().path());
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((local, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let state = AdminState::new();
        assert_eq!(
            route(&state, &Method::GET, "/healthz").status(),
            StatusCode::OK
        );
        assert_eq!(
            route(&state, &Method::GET, "/readyz").status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        state.set_ready(true);
        assert_eq!(
            route(&state, &Method::GET, "/readyz").status(),
            StatusCode::OK
        );
        assert_eq!(
            route(&state, &Method::GET, "/metrics").status(),
            StatusCode::OK
        );
        assert_eq!(
            route(&state, &Method::POST, "/metrics").status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            route(&state, &Method::GET, "/nope").status(),
            StatusCode::NOT_FOUND
        );
    }
}
