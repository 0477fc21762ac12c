//! Why a bind failed ([`BindError`], answered with HTTP 500 and counted by kind) and why one
//! of its API calls gave up ([`CallError`], retried while transient). A module of its own so
//! that the bind verb (`bind`) stays the bind: what it does, not how it fails.
//!
//! Not here: the bind itself, its retries and its owners (`bind`, `bind_owners`).

use http::StatusCode;

use super::cache::ReserveError;
use super::verb_error::{PodRequestError, VerbError};
use crate::k8s::retry::Transient;

/// Why an API call of bind gave up.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The API answered with an error (or the connection failed).
    #[error("{0}")]
    Kube(kube::Error),
    /// The pod's state rules the bind out for certain (deleted, replaced, bound elsewhere).
    #[error("{0}")]
    Definitive(String),
    /// The bind's time budget ran out.
    #[error("timed out (extender.bind_timeout_ms)")]
    Timeout,
}

impl CallError {
    pub(super) fn is_not_found(&self) -> bool {
        matches!(self, CallError::Kube(kube::Error::Api(s)) if s.code == 404)
    }
    pub(super) fn describe(&self, what: &str) -> String {
        format!("{what}: {self}")
    }
}

/// Why a bind failed or has no outcome yet. Every kind is answered with HTTP 500 and
/// `{"Error": "<Display>"}` (upstream's contract; kube-scheduler re-queues the pod); the
/// kind is the `kind` label of `gpushare_extender_errors_total{verb="bind"}`.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Reading the pod failed or ran out of time.
    #[error("getting pod {namespace}/{name}: {source}")]
    GetPod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What the API said.
        source: CallError,
    },
    /// The pod does not exist.
    #[error("pod {namespace}/{name} not found")]
    PodNotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The pod was replaced by another of the same name (upstream wording).
    #[error(
        "The pod {name} in ns {namespace}'s uid is {uid}, and it's not equal with expected {expected}"
    )]
    UidMismatch {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The UID the API holds.
        uid: String,
        /// The UID the scheduler sent.
        expected: String,
    },
    /// The pod is bound to another node already.
    #[error("pod {namespace}/{name} is already bound to node {node}")]
    AlreadyBound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The node it is bound to.
        node: String,
    },
    /// The pod's GPU request cannot be read.
    #[error("pod {namespace}/{name}: {source}")]
    PodRequest {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Why.
        source: PodRequestError,
    },
    /// The pod asks for no GPU memory.
    #[error("pod {namespace}/{name} requests no {resource}", resource = crate::core::wire::RESOURCE_GPU_MEM)]
    NoRequest {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The node offers no shared GPUs.
    #[error("the node {0} is not for GPU share")]
    NotForGpuShare(String),
    /// No GPU of the node has room.
    #[error("The node {node} can't place the pod {name} in ns {namespace}: {reason}")]
    NoFit {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Node.
        node: String,
        /// Why no GPU fits.
        reason: String,
    },
    /// The ledger refused the reservation (the pod holds memory already, the node vanished).
    #[error("{0}")]
    Reserve(ReserveError),
    /// The owner of the reservation found that the pod is certainly not bound by us.
    #[error("{0}")]
    Refused(String),
    /// The owner's first round ended with the outcome unknown; it keeps settling it.
    #[error("{0}")]
    Unknown(String),
    /// The request's budget ran out before the owner's first outcome.
    #[error(
        "binding pod {namespace}/{name} to node {node}: timed out (extender.bind_timeout_ms); \
         the outcome is unknown and the extender settles it by reading the API"
    )]
    TimedOut {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Node.
        node: String,
    },
    /// A retried bind found an earlier bind of the pod still settling an unknown outcome.
    #[error(
        "an earlier bind of pod {namespace}/{name} to node {node} has an unknown outcome; \
         the extender is settling it by reading the API"
    )]
    EarlierUnknown {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The node the earlier bind chose.
        node: String,
    },
}

impl VerbError for BindError {
    fn status(&self) -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }
    fn label(&self) -> &'static str {
        match self {
            BindError::GetPod { .. } => "api_error",
            BindError::PodNotFound { .. } => "pod_not_found",
            BindError::UidMismatch { .. } => "uid_mismatch",
            BindError::AlreadyBound { .. } => "already_bound",
            BindError::PodRequest { .. } => "bad_pod_request",
            BindError::NoRequest { .. } => "no_gpu_request",
            BindError::NotForGpuShare(_) => "not_for_gpu_share",
            BindError::NoFit { .. } => "no_fit",
            BindError::Reserve(_) => "reserve_refused",
            BindError::Refused(_) => "refused",
            BindError::Unknown(_)
            | BindError::TimedOut { .. }
            | BindError::EarlierUnknown { .. } => "unknown_outcome",
        }
    }
}

impl Transient for CallError {
    fn is_transient(&self) -> bool {
        matches!(self, CallError::Kube(k) if k.is_transient())
    }
}
