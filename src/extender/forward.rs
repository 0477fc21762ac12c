//! Standby replicas hand the scheduling verbs to the leader: one HTTP/1.1 request per
//! forwarded call to the base URL the leader publishes in its Lease
//! ([`super::leader::ANN_LEADER_ADDRESS`]), over TLS when this extender serves TLS (the
//! leader must present the same certificate as ours: the replicas share one key pair, so the
//! certificate is pinned and no host name check is needed). Over TLS the standby presents
//! that same certificate as its client certificate, which a leader checking client
//! certificates (`extender.tls_client_ca`) accepts as one of its own replicas
//! ([`crate::tls::ClientCa`]).
//!
//! What this module guarantees: a forwarded request carries [`FORWARDED_BY`], and a replica
//! never forwards a request that carries it (no loops while two replicas disagree on who
//! leads); an error says whether the request surely never reached the leader
//! ([`ForwardError::NotSent`]) or whether its outcome is unknown ([`ForwardError::Lost`]) —
//! the caller settles a lost bind by reading the pod ([`settle_bind`]), never by assuming it
//! failed.
//!
//! What it does not do: choose the leader (the election does), retry a bind (the scheduler
//! does, after the settled answer), or pool connections.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;

use super::leader::KnownLeader;
use super::verb_error::VerbError;
use crate::k8s::retry::{RetryError, Transient, retry_until};
use crate::tls::ServingCert;

/// Why a standby has no leader to forward a scheduling verb to (HTTP 503: the scheduler asks
/// again, and the Service routes to a ready replica).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NoLeader {
    /// The election has no live holder yet.
    #[error("no extender replica is known to lead (leader election in progress)")]
    Unknown,
    /// This replica has just won the election and is rebuilding its ledger.
    #[error("this replica has just become the leader; its ledger is being rebuilt")]
    Rebuilding,
    /// The leader publishes no address in its Lease.
    #[error(
        "the leader {0} publishes no address to forward to (set --advertise-address or POD_IP there)"
    )]
    NoAddress(String),
}

impl VerbError for NoLeader {
    fn status(&self) -> StatusCode {
        StatusCode::SERVICE_UNAVAILABLE
    }
    fn label(&self) -> &'static str {
        match self {
            NoLeader::Unknown => "no_leader",
            NoLeader::Rebuilding => "leader_rebuilding",
            NoLeader::NoAddress(_) => "leader_without_address",
        }
    }
}

/// The leader's identity and base URL, from what the election knows of it.
pub(crate) fn leader_url(known: KnownLeader) -> Result<(String, String), NoLeader> {
    match known {
        KnownLeader::Unknown => Err(NoLeader::Unknown),
        KnownLeader::Me => Err(NoLeader::Rebuilding),
        KnownLeader::Other {
            identity,
            address: None,
        } => Err(NoLeader::NoAddress(identity)),
        KnownLeader::Other {
            identity,
            address: Some(url),
        } => Ok((identity, url)),
    }
}

/// Why a lost bind could not be settled: the pod could not be read in time. The outcome stays
/// unknown (HTTP 500, the scheduler asks again).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettleError {
    /// The API answered reads of the pod with an error that is not transient.
    #[error("reading pod {namespace}/{name}: {source}")]
    Read {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What the API said.
        source: kube::Error,
    },
    /// The pod could not be read before the deadline.
    #[error("pod {namespace}/{name} could not be read before the deadline")]
    Deadline {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
}

/// Header naming the replica that forwarded a request.
pub(crate) const FORWARDED_BY: &str = "x-gpushare-forwarded-by";
/// Header naming the replica whose ledger an answer shows.
pub(crate) const VIEW_OF: &str = "x-gpushare-view";

/// The leader's answer, as it came.
#[derive(Debug, Clone)]
pub struct Forwarded {
    /// Its status.
    pub status: StatusCode,
    /// Its `Content-Type`, if any.
    pub content_type: Option<header::HeaderValue>,
    /// Its `X-Gpushare-View`, if any.
    pub view: Option<header::HeaderValue>,
    /// Its body.
    pub body: Bytes,
}

/// Why a forwarded request has no answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The leader's address cannot be used.
    #[error("the leader's address {0:?} is not an http(s)://HOST:PORT URL")]
    BadAddress(String),
    /// The request never reached the leader (connect or TLS handshake failed).
    #[error("cannot reach the leader at {url}: {why}")]
    NotSent {
        /// Where.
        url: String,
        /// Why.
        why: String,
    },
    /// The request may have reached the leader, but no answer came: unknown outcome.
    #[error("the leader at {url} did not answer: {why}")]
    Lost {
        /// Where.
        url: String,
        /// Why.
        why: String,
    },
}

/// Sends requests to the leader.
#[derive(Clone)]
pub struct Forwarder {
    identity: String,
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("identity", &self.identity)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// Accepts exactly the certificate this replica serves now (all replicas share one key pair).
#[derive(Debug)]
struct PinnedCertificate {
    ours: Arc<ServingCert>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for PinnedCertificate {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if self.ours.is_ours(end_entity.as_ref()) {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the leader presents a certificate other than this replica's".to_string(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

impl Forwarder {
    /// A forwarder for replica `identity`; `serving` (none for plain HTTP) is the certificate
    /// this replica serves: the leader must present it, and this replica presents it as its
    /// client certificate.
    pub fn new(identity: &str, serving: Option<Arc<ServingCert>>) -> anyhow::Result<Forwarder> {
        use anyhow::Context;
        let tls = match serving {
            None => None,
            Some(serving) => {
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let verifier = Arc::new(PinnedCertificate {
                    ours: serving.clone(),
                    provider: provider.clone(),
                });
                let mut config = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .context("TLS protocol versions")?
                    .dangerous()
                    .with_custom_certificate_verifier(verifier)
                    .with_client_cert_resolver(serving);
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                Some(TlsConnector::from(Arc::new(config)))
            }
        };
        Ok(Forwarder {
            identity: identity.to_string(),
            tls,
        })
    }

    /// Sends `method path_and_query` with `body` to the leader at `base` and reads the whole
    /// answer, all within `timeout`.
    pub async fn send(
        &self,
        base: &str,
        method: Method,
        path_and_query: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError> {
        let url = format!("{}{path_and_query}", base.trim_end_matches('/'));
        let (https, authority) = match base.split_once("://") {
            Some(("http", a)) => (false, a.trim_end_matches('/')),
            Some(("https", a)) => (true, a.trim_end_matches('/')),
            _ => return Err(ForwardError::BadAddress(base.to_string())),
        };
        let host = match authority.rsplit_once(':') {
            Some((h, p)) if p.parse::<u16>().is_ok() => {
                h.trim_start_matches('[').trim_end_matches(']')
            }
            _ => return Err(ForwardError::BadAddress(base.to_string())),
        };
        let deadline = Instant::now() + timeout;
        let not_sent = |why: String| ForwardError::NotSent {
            url: url.clone(),
            why,
        };
        let lost = |why: String| ForwardError::Lost {
            url: url.clone(),
            why,
        };
        let connect = async {
            let tcp = TcpStream::connect(authority)
                .await
                .map_err(|e| not_sent(e.to_string()))?;
            let _ = tcp.set_nodelay(true);
            let io: Box<dyn Io> = match (https, &self.tls) {
                (false, _) => Box::new(tcp),
                (true, None) => {
                    return Err(not_sent(
                        "the leader serves HTTPS but this replica has no TLS certificate"
                            .to_string(),
                    ));
                }
                (true, Some(connector)) => {
                    let name = rustls::pki_types::ServerName::try_from(host.to_string())
                        .map_err(|e| not_sent(e.to_string()))?;
                    Box::new(
                        connector
                            .connect(name, tcp)
                            .await
                            .map_err(|e| not_sent(format!("TLS: {e}")))?,
                    )
                }
            };
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(io))
                .await
                .map_err(|e| not_sent(e.to_string()))
        };
        let (mut sender, conn) = match tokio::time::timeout_at(deadline, connect).await {
            Ok(r) => r?,
            Err(_) => return Err(not_sent(format!("no connection within {timeout:?}"))),
        };
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(header::HOST, authority)
            .header(header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_BY, self.identity.as_str())
            .body(Full::new(body))
            .map_err(|e| not_sent(e.to_string()))?;
        // From here on the leader may have the request: every failure is a lost answer.
        let exchange = async {
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| lost(e.to_string()))?;
            let status = resp.status();
            let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
            let view = resp.headers().get(VIEW_OF).cloned();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| lost(e.to_string()))?
                .to_bytes();
            Ok(Forwarded {
                status,
                content_type,
                view,
                body,
            })
        };
        let result = match tokio::time::timeout_at(deadline, exchange).await {
            Ok(r) => r,
            Err(_) => Err(lost(format!("no answer within {timeout:?}"))),
        };
        driver.abort();
        result
    }
}

/// What reading the pod says about a bind whose answer was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settled {
    /// The pod (same UID) is bound to the node asked for.
    Bound,
    /// The pod is bound elsewhere, gone, or replaced.
    Refused(String),
    /// The pod is still unbound after the leader's bind deadline: the bind did not happen.
    NotBound,
    /// The pod is still unbound but carries a bind's reservation for the node: the leader's
    /// owner of an unknown outcome may still finish it, so the outcome is unknown.
    Reserved,
}

#[derive(Debug)]
enum Read {
    Kube(kube::Error),
    NotYet,
}

impl Transient for Read {
    fn is_transient(&self) -> bool {
        match self {
            Read::Kube(e) => e.is_transient(),
            Read::NotYet => true,
        }
    }
}

/// Settles a forwarded bind whose answer was lost: reads the pod until it is bound, or until
/// `settle_at` — a moment after which the leader's fence forbids any write of that bind —
/// has passed with the pod still unbound. Gives up (`Err`) only if the pod cannot be read
/// by `give_up`.
pub(crate) async fn settle_bind(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    uid: &str,
    node: &str,
    settle_at: Instant,
    give_up: Instant,
) -> Result<Settled, SettleError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let outcome = retry_until(
        give_up,
        |_| {},
        || async {
            let pod = pods.get_opt(name).await.map_err(Read::Kube)?;
            let Some(pod) = pod else {
                return Ok(Settled::Refused(format!(
                    "pod {namespace}/{name} was deleted"
                )));
            };
            if !uid.is_empty() && pod.metadata.uid.as_deref() != Some(uid) {
                return Ok(Settled::Refused(format!(
                    "pod {namespace}/{name} was replaced"
                )));
            }
            match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                Some(n) if n == node => Ok(Settled::Bound),
                Some(n) if !n.is_empty() => Ok(Settled::Refused(format!(
                    "pod {namespace}/{name} is bound to node {n}"
                ))),
                _ if Instant::now() >= settle_at => {
                    let reserved = pod
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| crate::core::BindReservation::decode(a).ok().flatten())
                        .is_some_and(|r| r.node == node);
                    Ok(if reserved {
                        Settled::Reserved
                    } else {
                        Settled::NotBound
                    })
                }
                _ => Err(Read::NotYet),
            }
        },
    )
    .await;
    match outcome {
        Ok(s) => Ok(s),
        Err(RetryError::Failed(Read::Kube(source))) => Err(SettleError::Read {
            namespace: namespace.to_string(),
            name: name.to_string(),
            source,
        }),
        Err(RetryError::Failed(Read::NotYet)) | Err(RetryError::DeadlineExceeded) => {
            Err(SettleError::Deadline {
                namespace: namespace.to_string(),
                name: name.to_string(),
            })
        }
    }
}
