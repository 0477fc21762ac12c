//! The webhook's HTTP routes, served over TLS by the shared [`crate::http_server`]:
//! `POST /mutate`, `POST /validate`, and the admin paths `/healthz`, `/readyz`, `/metrics`.
//!
//! A body that is not an AdmissionReview gets HTTP 400 with a JSON error; an AdmissionReview
//! always gets 200 with its verdict (that is how kube-apiserver expects a refusal).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::admission::{self, ReviewError, Verdict};
use super::dra_mode::DraMode;
use crate::admin::AdminState;
use crate::http_server::{self, Reply};

/// Largest AdmissionReview accepted (kube-apiserver's own request limit is 3 MiB).
pub(crate) const MAX_REVIEW_BYTES: u64 = 6 * 1024 * 1024;

/// Label of the reviews counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ReviewLabel {
    endpoint: &'static str,
    result: &'static str,
}

/// What the routes need.
#[derive(Debug)]
pub struct WebhookState {
    /// Health and metrics.
    pub admin: Arc<AdminState>,
    /// `webhook.scheduler_name`.
    pub scheduler_name: String,
    /// `webhook.max_gpu_mem`.
    pub max_gpu_mem: u64,
    /// `http.body_read_timeout_ms`.
    pub body_deadline: Duration,
    /// The DRA mode (namespace labels, the rewrite), when the webhook has the API.
    pub dra: Option<DraMode>,
    /// The limiter's host directories no gpu-mem pod may reach (`[node]`).
    pub limiter_guard: super::limiter_guard::LimiterGuard,
    reviews: Family<ReviewLabel, Counter>,
}

impl WebhookState {
    /// New state; registers `gpushare_webhook_reviews` with `admin`.
    pub fn new(
        admin: Arc<AdminState>,
        scheduler_name: String,
        max_gpu_mem: u64,
        body_deadline: Duration,
        dra: Option<DraMode>,
        limiter_guard: super::limiter_guard::LimiterGuard,
    ) -> Arc<WebhookState> {
        let reviews = Family::<ReviewLabel, Counter>::default();
        admin.with_registry(|r| {
            r.register(
                "gpushare_webhook_reviews",
                "AdmissionReviews answered, by endpoint and result (allowed, patched, denied, bad_request)",
                reviews.clone(),
            )
        });
        Arc::new(WebhookState {
            admin,
            scheduler_name,
            max_gpu_mem,
            body_deadline,
            dra,
            limiter_guard,
            reviews,
        })
    }

    fn count(&self, endpoint: &'static str, result: &'static str) {
        self.reviews
            .get_or_create(&ReviewLabel { endpoint, result })
            .inc();
    }
}

fn json_reply(status: StatusCode, body: &serde_json::Value) -> Reply {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_default()
}

/// Answers one request.
pub async fn handle(state: Arc<WebhookState>, req: Request<Incoming>) -> Reply {
    let path = req.uri().path().to_string();
    let endpoint: &'static str = match path.as_str() {
        "/mutate" => "mutate",
        "/validate" => "validate",
        "/healthz" | "/readyz" | "/metrics" => {
            let accept = req
                .headers()
                .get(hyper::header::ACCEPT)
                .and_then(|v| v.to_str().ok());
            return crate::admin::route(&state.admin, "not ready", req.method(), &path, accept);
        }
        _ => {
            return http_server::json_error(
                StatusCode::NOT_FOUND,
                &format!("no such path {path}: the webhook serves POST /mutate and POST /validate"),
            );
        }
    };
    if req.method() != Method::POST {
        let mut r = http_server::json_error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("use POST for /{endpoint}"),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
        return r;
    }
    let body = match http_server::read_body(req, MAX_REVIEW_BYTES, state.body_deadline).await {
        Ok(b) => b,
        Err(e) => {
            state.count(endpoint, "bad_request");
            return http_server::json_error(e.status(), &e.to_string());
        }
    };
    let decided = decide(&state, endpoint, &body).await;
    match decided {
        Ok((uid, verdict)) => {
            let result = if !verdict.allowed {
                "denied"
            } else if !verdict.patch.is_empty() {
                "patched"
            } else {
                "allowed"
            };
            state.count(endpoint, result);
            if !verdict.allowed {
                tracing::info!(
                    uid,
                    message = verdict.message.as_deref().unwrap_or(""),
                    "pod refused"
                );
            }
            json_reply(StatusCode::OK, &verdict.to_review(&uid))
        }
        Err(e) => {
            state.count(endpoint, "bad_request");
            http_server::json_error(StatusCode::BAD_REQUEST, &e.to_string())
        }
    }
}

/// The verdict on one request body, parsed here once (the decisions take the parsed review).
async fn decide(
    state: &WebhookState,
    endpoint: &str,
    body: &[u8],
) -> Result<(String, Verdict), ReviewError> {
    let review = admission::parse_review(body)?;
    let verdict = if endpoint == "mutate" {
        match &state.dra {
            Some(dra) => dra.mutate(&review, &state.scheduler_name).await?,
            None => admission::mutate_review(&review, &state.scheduler_name)?,
        }
    } else {
        admission::validate_review(&review, state.max_gpu_mem, &state.limiter_guard)?
    };
    Ok((review.uid, verdict))
}
