//! The start-up wait for the API server: a role whose API server is briefly unreachable (a
//! control-plane upgrade, a restarting apiserver, a slow load balancer) waits for it with
//! backoff, logging each try, instead of exiting into CrashLoopBackOff on every node.
//!
//! What it waits out: no connection, a timeout, 429 and 5xx (what [`super::retry`] calls
//! transient). What it does not: 401 / 403 and every other answer, and client configuration
//! that cannot work (no kubeconfig, an unreadable token) — those are set-up mistakes and are
//! reported at once. The wait is bounded by `cluster.api_wait_secs` (0: no wait). It checks
//! reachability only (`GET /version`); permissions are the doctor's `rbac` check.

use std::time::Duration;

use tokio::time::Instant;

use super::client::{ClientOptions, client};
use super::error_text::describe;
use super::retry::{Backoff, RetryError, Transient, retry_until_with};
use crate::failure::one_line;

/// Deadline of one try (connecting included).
pub const TRY_TIMEOUT: Duration = Duration::from_secs(5);

/// The waits between tries: 200 ms doubling to 5 s.
pub const STARTUP_BACKOFF: Backoff = Backoff {
    first: Duration::from_millis(200),
    max: Duration::from_secs(5),
};

/// Why the API server could not be used at start-up.
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    /// It stayed unreachable for the whole wait.
    #[error(
        "the API server stayed unreachable for {waited_secs} s (cluster.api_wait_secs) over {tries} tries; last: {last}"
    )]
    GaveUp {
        /// Seconds waited.
        waited_secs: u64,
        /// How many tries were made.
        tries: u32,
        /// The last error.
        last: String,
    },
    /// It answered, but not as a working set-up would (401, 403, ...): waiting will not help.
    #[error("the API server refused: {0} (check the credentials this role runs with)")]
    Refused(String),
    /// It answered something else no waiting will change (404: not the API server's
    /// address, or not an API server at all).
    #[error("the API server answered, and waiting will not help: {0}")]
    Unexpected(String),
    /// No client can be built (no kubeconfig, an unreadable one): waiting will not help.
    #[error("{}", one_line(.0.as_ref()))]
    Config(#[source] anyhow::Error),
}

/// An answer that waiting will not change: a refusal of the credentials, or something else.
fn answered(err: &kube::Error) -> Unreachable {
    match err {
        kube::Error::Api(status) if matches!(status.code, 401 | 403) => {
            Unreachable::Refused(describe(err))
        }
        _ => Unreachable::Unexpected(describe(err)),
    }
}

/// Whether `err` is worth waiting out at start-up.
pub fn worth_waiting(err: &kube::Error) -> bool {
    err.is_transient()
}

/// Asks `GET /version` through `kubeconfig` (empty: `KUBECONFIG`, then in-cluster) until it
/// answers, the answer is a set-up mistake, or `wait` has passed (`Duration::ZERO`: one
/// try). Each try has [`TRY_TIMEOUT`] and no retry of kube's own, so each is logged. `what`
/// names the role in the log lines.
pub async fn wait_for_api(kubeconfig: &str, wait: Duration, what: &str) -> Result<(), Unreachable> {
    let client = client(&ClientOptions {
        kubeconfig: Some(kubeconfig),
        context: None,
        timeout: Some(TRY_TIMEOUT),
        without_kube_retry: true,
    })
    .await
    .map_err(Unreachable::Config)?;
    let started = Instant::now();
    if wait.is_zero() {
        return match client.apiserver_version().await {
            Ok(_) => Ok(()),
            Err(e) if worth_waiting(&e) => Err(Unreachable::GaveUp {
                waited_secs: 0,
                tries: 1,
                last: describe(&e),
            }),
            Err(e) => Err(answered(&e)),
        };
    }
    let mut tries = 1u32;
    let on_retry = |e: &kube::Error, next: Duration| {
        tracing::warn!(
            role = what,
            error = %describe(e),
            tries,
            retry_in = ?next,
            waiting_up_to_secs = wait.as_secs(),
            "the API server is not reachable yet; waiting for it (cluster.api_wait_secs)"
        );
        tries += 1;
    };
    let outcome = retry_until_with(started + wait, STARTUP_BACKOFF, on_retry, || {
        client.apiserver_version()
    })
    .await;
    let waited_secs = started.elapsed().as_secs();
    match outcome {
        Ok(_) => {
            if tries > 1 {
                tracing::info!(role = what, tries, waited_secs, "the API server answers");
            }
            Ok(())
        }
        Err(RetryError::Failed(e)) if worth_waiting(&e) => Err(Unreachable::GaveUp {
            waited_secs,
            tries,
            last: describe(&e),
        }),
        Err(RetryError::Failed(e)) => Err(answered(&e)),
        Err(RetryError::DeadlineExceeded) => Err(Unreachable::GaveUp {
            waited_secs,
            tries,
            last: "the last try was still waiting for an answer".to_string(),
        }),
    }
}
