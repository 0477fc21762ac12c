//! How an error of a scheduling verb is answered: the HTTP status it carries (upstream's
//! contract: filter and prioritize refuse a bad request with 400, bind answers every failure
//! with 500, a standby without a leader to forward to with 503), the outcome label of
//! `gpushare_extender_requests_total`, and its kind for `gpushare_extender_errors_total`.
//! The body is always `{"Error": "<Display>"}`; routes.rs writes it. The error types
//! themselves live with the verb that raises them.

use http::StatusCode;

use crate::core::request::RequestError;

/// An error a scheduling verb answers with.
pub(crate) trait VerbError: std::fmt::Display {
    /// The HTTP status of the answer.
    fn status(&self) -> StatusCode;
    /// The kind, as the `kind` label of `gpushare_extender_errors_total`.
    fn label(&self) -> &'static str;
    /// The `outcome` label of `gpushare_extender_requests_total`.
    fn outcome(&self) -> &'static str {
        match self.status() {
            StatusCode::BAD_REQUEST => "bad_request",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            _ => "error",
        }
    }
}

/// The pod of a filter, prioritize or bind asks for GPU memory in a way that cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodRequestError {
    /// A container's `aliyun.com/gpu-mem` limit is not a whole number of units.
    #[error("ExtenderArgs.Pod: {0}")]
    Unreadable(#[from] RequestError),
}

impl VerbError for PodRequestError {
    fn status(&self) -> StatusCode {
        StatusCode::BAD_REQUEST
    }
    fn label(&self) -> &'static str {
        "bad_pod_request"
    }
}
