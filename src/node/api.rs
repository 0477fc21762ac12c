//! The node side's calls to the API server (the node agent's and the device plugin's), each
//! bounded by a request timeout, and what their errors mean: a definite answer (the API said no) or an unknown outcome (no answer in
//! time, a dropped connection), which is never taken for a failure.
//!
//! It does not retry (that is [`crate::k8s::retry`]) and does not decide what to do with an
//! unknown outcome (the caller settles it by reading the API).

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;

use crate::k8s::retry::Transient;

/// How long one API request may take before it is given up (its outcome then unknown).
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Why an API call of the node agent or a node role did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ApiCallError {
    /// The API server (or the connection to it) answered with an error.
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// No answer within the request timeout: the request may still land.
    #[error("no answer from the API server within {0:?}")]
    TimedOut(Duration),
}

impl ApiCallError {
    /// Whether the request may have taken effect although it did not succeed here: anything
    /// but an answer that refuses it (no answer, a broken connection, a 5xx that may still be
    /// committed).
    pub fn outcome_unknown(&self) -> bool {
        match self {
            ApiCallError::TimedOut(_) => true,
            ApiCallError::Kube(e) => !crate::k8s::write::refused_for_certain(e),
        }
    }
}

impl Transient for ApiCallError {
    fn is_transient(&self) -> bool {
        match self {
            ApiCallError::TimedOut(_) => true,
            ApiCallError::Kube(e) => e.is_transient(),
        }
    }
}

/// Runs one API request, giving up after [`REQUEST_TIMEOUT`].
pub(crate) async fn bounded<T>(
    request: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiCallError> {
    bounded_for(REQUEST_TIMEOUT, request).await
}

/// Runs one API request, giving up after `timeout` (a read whose caller has a deadline of
/// its own, such as a claim read inside kubelet's call).
pub(crate) async fn bounded_for<T>(
    timeout: Duration,
    request: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiCallError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(result) => result.map_err(ApiCallError::Kube),
        Err(_) => Err(ApiCallError::TimedOut(timeout)),
    }
}

/// One LIST of `node`'s pods, bounded by the request timeout.
pub(crate) async fn list_node_pods(
    client: &kube::Client,
    node: &str,
) -> Result<Vec<Pod>, ApiCallError> {
    let api: Api<Pod> = Api::all(client.clone());
    let params = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    Ok(bounded(api.list(&params)).await?.items)
}
