//! The one HTTP/1.1 server of gpushare: the extender's scheduling verbs and admin paths and
//! the device plugin's admin paths all run on [`serve`], and every request body is read by
//! [`read_body`].
//!
//! What it guarantees to a role, whatever the clients do: a deadline for the request headers,
//! one for the body, one for the whole request; a cap on open connections (the ones over it
//! are closed at once and counted, so the kernel backlog never fills with clients we will not
//! serve); back-off when `accept` fails (EMFILE and the like) instead of a hot loop; an
//! optional TLS handshake with its own deadline; and a bounded graceful drain on shutdown.
//! It does not route, authorise or know any path: the role's handler does. With a TLS
//! acceptor that checks client certificates ([`crate::tls::ServerTls`]), every request of a
//! connection whose client presented an accepted certificate carries [`PeerCertificate`] in
//! its extensions; the handler decides which paths need it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::config::HttpConfig;
use crate::shutdown::Shutdown;

/// Request extension: the connection's client presented a certificate the TLS acceptor
/// verified (a connection without one carries nothing): its chain, end entity first, so a
/// role can check it again against trust that changed since the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCertificate(pub Arc<[tokio_rustls::rustls::pki_types::CertificateDer<'static>]>);

/// A finished response: every handler answers with a whole body.
pub type Reply = Response<Full<Bytes>>;

/// The deadlines and caps of one server (from `[http]` in the configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// From accepting a connection (or the end of the previous request) to the end of the
    /// request headers.
    pub header_read: Duration,
    /// For the request body, once the handler starts reading it.
    pub body_read: Duration,
    /// For the whole request, handler included: past it the client gets a 503.
    pub request: Duration,
    /// For the TLS handshake.
    pub tls_handshake: Duration,
    /// Open connections at most; more are closed at once.
    pub max_connections: usize,
    /// How long open connections may finish after shutdown begins.
    pub drain: Duration,
}

impl Limits {
    /// The limits configured under `[http]`.
    pub fn from_config(http: &HttpConfig) -> Limits {
        Limits {
            header_read: Duration::from_millis(http.header_read_timeout_ms),
            body_read: Duration::from_millis(http.body_read_timeout_ms),
            request: Duration::from_millis(http.request_timeout_ms),
            tls_handshake: Duration::from_millis(http.header_read_timeout_ms),
            max_connections: http.max_connections,
            drain: Duration::from_secs(10),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::from_config(&HttpConfig::default())
    }
}

/// What the server counts, registered as `gpushare_http_*` metrics.
#[derive(Clone, Debug, Default)]
pub struct ServerMetrics {
    rejected: Counter,
    deadlines: Family<DeadlineLabel, Counter>,
}

/// Which deadline a request ran past.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct DeadlineLabel {
    deadline: &'static str,
}

impl ServerMetrics {
    /// New counters, registered with `registry` (a role's `AdminState` registry).
    pub fn register(registry: &mut prometheus_client::registry::Registry) -> ServerMetrics {
        let m = ServerMetrics::default();
        registry.register(
            "gpushare_http_connections_rejected",
            "Connections closed at once because max_connections were open",
            m.rejected.clone(),
        );
        registry.register(
            "gpushare_http_deadline_exceeded",
            "Requests that ran past a deadline (body: reading the body; request: the whole request)",
            m.deadlines.clone(),
        );
        m
    }

    fn deadline(&self, which: &'static str) {
        self.deadlines
            .get_or_create(&DeadlineLabel { deadline: which })
            .inc();
    }
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The body (or its Content-Length) is over the limit.
    #[error("request body larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// The client did not send the whole body in time.
    #[error("request body not received within {0:?}")]
    TimedOut(Duration),
    /// The connection failed while the body was read.
    #[error("could not read the request body: {0}")]
    Failed(String),
}

impl BodyError {
    /// The HTTP status that answers it: 413, 408 or 400.
    pub fn status(&self) -> StatusCode {
        match self {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::TimedOut(_) => StatusCode::REQUEST_TIMEOUT,
            BodyError::Failed(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Reads the whole body of `req`: at most `limit` bytes, within `deadline`.
pub async fn read_body(
    req: Request<Incoming>,
    limit: u64,
    deadline: Duration,
) -> Result<Bytes, BodyError> {
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit
    {
        return Err(BodyError::TooLarge { limit });
    }
    let cap = usize::try_from(limit).unwrap_or(usize::MAX);
    match tokio::time::timeout(deadline, Limited::new(req.into_body(), cap).collect()).await {
        Err(_) => Err(BodyError::TimedOut(deadline)),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(BodyError::TooLarge { limit })
        }
        Ok(Err(e)) => Err(BodyError::Failed(e.to_string())),
    }
}

/// A JSON `{"Error": message}` reply, the error shape of every gpushare endpoint.
pub fn json_error(status: StatusCode, message: &str) -> Reply {
    let body = serde_json::json!({ "Error": message }).to_string();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

/// Back-off after failed `accept`s: 5 ms doubling to 1 s, reset by a success.
#[derive(Debug)]
struct AcceptBackoff {
    next: Duration,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_secs(1);

    fn new() -> Self {
        AcceptBackoff { next: Self::FIRST }
    }

    fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        wait
    }

    fn succeeded(&mut self) {
        self.next = Self::FIRST;
    }
}

/// The handler's `reply` within `limits.request` (503 past it), counting the deadlines that
/// ended it (the whole request's, the body's).
async fn reply_within<F>(reply: F, limits: Limits, metrics: &ServerMetrics) -> Reply
where
    F: Future<Output = Reply>,
{
    let reply = match tokio::time::timeout(limits.request, reply).await {
        Ok(reply) => reply,
        Err(_) => {
            metrics.deadline("request");
            json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!(
                    "the request did not finish within {:?} (http.request_timeout_ms)",
                    limits.request
                ),
            )
        }
    };
    if reply.status() == StatusCode::REQUEST_TIMEOUT {
        metrics.deadline("body");
    }
    reply
}

/// Serves connections from `listener` with `handler` until `shutdown`, then drains the open
/// ones for at most `limits.drain`. `name` labels the log lines.
pub async fn serve<H, F>(
    name: &'static str,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    metrics: ServerMetrics,
    handler: H,
    shutdown: Shutdown,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut backoff = AcceptBackoff::new();
    let stop = shutdown.wait();
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => {
                    backoff.succeeded();
                    a
                }
                Err(e) => {
                    let wait = backoff.failed();
                    tracing::warn!(server = name, error = %e, retry_in = ?wait, "accept failed");
                    tokio::select! {
                        _ = &mut stop => break,
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.rejected.inc();
            tracing::debug!(server = name, %peer, max = limits.max_connections, "connection cap reached; closing");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let metrics = metrics.clone();
        let tls = tls.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read)
                .keep_alive(true);
            let service = move |verified: Option<PeerCertificate>| {
                hyper::service::service_fn(move |mut req: Request<Incoming>| {
                    if let Some(peer) = &verified {
                        req.extensions_mut().insert(peer.clone());
                    }
                    let handler = handler.clone();
                    let metrics = metrics.clone();
                    async move {
                        let reply = reply_within(handler(req), limits, &metrics).await;
                        Ok::<_, std::convert::Infallible>(reply)
                    }
                })
            };
            let result = match tls {
                None => {
                    let conn = builder.serve_connection(TokioIo::new(stream), service(None));
                    watcher.watch(conn).await
                }
                Some(acceptor) => {
                    match tokio::time::timeout(limits.tls_handshake, acceptor.accept(stream)).await
                    {
                        Ok(Ok(s)) => {
                            let verified = s
                                .get_ref()
                                .1
                                .peer_certificates()
                                .filter(|c| !c.is_empty())
                                .map(|c| {
                                    PeerCertificate(
                                        c.iter().map(|d| d.clone().into_owned()).collect(),
                                    )
                                });
                            let conn = builder.serve_connection(TokioIo::new(s), service(verified));
                            watcher.watch(conn).await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(server = name, %peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(server = name, %peer, "TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(server = name, %peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            server = name,
            "connections still open after {:?}; closing them",
            limits.drain
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_a_ceiling_and_resets() {
        let mut b = AcceptBackoff::new();
        let waits: Vec<Duration> = (0..10).map(|_| b.failed()).collect();
        assert_eq!(waits[0], Duration::from_millis(5));
        assert_eq!(waits[1], Duration::from_millis(10));
        assert_eq!(
            *waits.last().unwrap_or(&Duration::ZERO),
            Duration::from_secs(1)
        );
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        b.succeeded();
        assert_eq!(b.failed(), Duration::from_millis(5));
    }

    #[test]
    fn body_errors_map_to_their_status() {
        assert_eq!(
            BodyError::TooLarge { limit: 1 }.status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            BodyError::TimedOut(Duration::from_secs(1)).status(),
            StatusCode::REQUEST_TIMEOUT
        );
        assert_eq!(
            BodyError::Failed("x".into()).status(),
            StatusCode::BAD_REQUEST
        );
    }
}
