//! Standby replicas hand the scheduling verbs to the leader: one HTTP/1.1 request per
//! forwarded call to the base URL the leader publishes in its Lease
//! (its `gpushare.io/leader-address` annotation), over TLS when this extender serves TLS (the
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
//! failed. The requests go through the one outbound client ([`crate::outbound`]).
//!
//! What it does not do: choose the leader (the election does), retry a bind (the scheduler
//! does, after the settled answer), or pool connections.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::time::Instant;

use super::leader::KnownLeader;
use super::verb_error::VerbError;
use crate::k8s::retry::{RetryError, Transient, retry_until};
use crate::outbound::{self, Identity, TlsOptions, Trust};
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
    #[error("cannot reach the leader: {0}")]
    NotSent(#[source] outbound::Error),
    /// The request may have reached the leader, but no answer came: unknown outcome.
    #[error("the leader did not answer: {0}")]
    Lost(#[source] outbound::Error),
}

impl From<outbound::Error> for ForwardError {
    fn from(e: outbound::Error) -> ForwardError {
        if e.surely_unsent() {
            ForwardError::NotSent(e)
        } else {
            ForwardError::Lost(e)
        }
    }
}

/// Sends requests to the leader.
#[derive(Clone, Debug)]
pub struct Forwarder {
    identity: String,
    client: outbound::Client,
}

impl Forwarder {
    /// A forwarder for replica `identity`; `serving` (none for plain HTTP) is the certificate
    /// this replica serves: the leader must present it, and this replica presents it as its
    /// client certificate.
    pub fn new(
        identity: &str,
        serving: Option<Arc<ServingCert>>,
    ) -> Result<Forwarder, outbound::SetupError> {
        let client = match serving {
            None => outbound::Client::plain(),
            Some(serving) => outbound::Client::new(TlsOptions {
                trust: Trust::Pinned(serving.clone()),
                identity: Identity::Serving(serving),
                server_name: None,
            })?,
        };
        Ok(Forwarder {
            identity: identity.to_string(),
            client,
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
        let bad_address = || ForwardError::BadAddress(base.to_string());
        let authority = match base.split_once("://") {
            Some(("http" | "https", a)) => a.trim_end_matches('/'),
            _ => return Err(bad_address()),
        };
        if authority
            .rsplit_once(':')
            .is_none_or(|(_, p)| p.parse::<u16>().is_err())
        {
            return Err(bad_address());
        }
        let url = format!("{}{path_and_query}", base.trim_end_matches('/'));
        let request = Request::builder()
            .method(method)
            .uri(url)
            .header(header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_BY, self.identity.as_str())
            .body(body)
            .map_err(|_| bad_address())?;
        let resp = self.client.send(request, timeout).await?;
        Ok(Forwarded {
            status: resp.status,
            content_type: resp.headers.get(header::CONTENT_TYPE).cloned(),
            view: resp.headers.get(VIEW_OF).cloned(),
            body: resp.body,
        })
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
