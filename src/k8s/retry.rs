//! The one retry loop for Kubernetes API calls.
//!
//! An operation is tried again while it fails with a transient error (409, 429, 5xx, a broken
//! connection), with doubling backoff, bounded by a number of attempts ([`retry_attempts`]) or
//! by a deadline ([`retry_until`], and [`retry_until_with`] with a [`Backoff`] of the caller's,
//! e.g. the start-up wait for the API server in [`super::reachable`]). All are the same loop.
//!
//! This module does not decide what a lost answer means: a caller whose write may have landed
//! settles that by reading the object, never by assuming it failed.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Whether an error is worth another try.
pub(crate) trait Transient {
    /// True for conflicts, throttling, server-side trouble and broken connections.
    fn is_transient(&self) -> bool;
}

impl Transient for kube::Error {
    fn is_transient(&self) -> bool {
        is_transient(self)
    }
}

/// Whether an API error is worth retrying (conflict, throttling, server-side trouble).
pub fn is_transient(err: &kube::Error) -> bool {
    match err {
        kube::Error::Api(status) => matches!(status.code, 409 | 429 | 500..=599),
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

/// How a deadline-bounded retry ended without success.
#[derive(Debug)]
pub(crate) enum RetryError<E> {
    /// The last try failed with this error (not transient, or no time left for another).
    Failed(E),
    /// The deadline passed while a try was in flight: its outcome is unknown.
    DeadlineExceeded,
}

/// The waits between tries: `first`, doubled after each failure up to `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// First wait.
    pub first: Duration,
    /// Longest wait.
    pub max: Duration,
}

impl Backoff {
    /// For calls on a request's path: 20 ms doubling to 500 ms.
    pub const CALL: Backoff = Backoff {
        first: Duration::from_millis(20),
        max: Duration::from_millis(500),
    };
}

/// Tries `op` at most `attempts` times while it fails with a transient error.
pub(crate) async fn retry_attempts<T, E, F, Fut>(attempts: u32, op: F) -> Result<T, E>
where
    E: Transient + std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    match retry_loop(Some(attempts.max(1)), None, Backoff::CALL, |_| {}, op).await {
        Ok(v) => Ok(v),
        Err(RetryError::Failed(e)) => Err(e),
        // No deadline was given, so none can pass.
        Err(RetryError::DeadlineExceeded) => unreachable_deadline(),
    }
}

/// Tries `op` until it succeeds, fails for good, or `deadline` passes; `on_retry` sees each
/// transient error that is followed by another try (for a metric or a log line).
pub(crate) async fn retry_until<T, E, F, Fut>(
    deadline: Instant,
    on_retry: impl FnMut(&E),
    op: F,
) -> Result<T, RetryError<E>>
where
    E: Transient + std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    retry_loop(None, Some(deadline), Backoff::CALL, on_retry, op).await
}

/// [`retry_until`] with the waits of `backoff`; `on_retry` also sees the wait before the next
/// try.
pub(crate) async fn retry_until_with<T, E, F, Fut>(
    deadline: Instant,
    backoff: Backoff,
    mut on_retry: impl FnMut(&E, Duration),
    op: F,
) -> Result<T, RetryError<E>>
where
    E: Transient + std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut delay = backoff.first;
    let on_retry = move |e: &E| {
        on_retry(e, delay);
        delay = (delay * 2).min(backoff.max);
    };
    retry_loop(None, Some(deadline), backoff, on_retry, op).await
}

async fn retry_loop<T, E, F, Fut>(
    attempts: Option<u32>,
    deadline: Option<Instant>,
    backoff: Backoff,
    mut on_retry: impl FnMut(&E),
    mut op: F,
) -> Result<T, RetryError<E>>
where
    E: Transient + std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut delay = backoff.first;
    let mut tried = 0u32;
    loop {
        tried += 1;
        let outcome = match deadline {
            Some(d) => match tokio::time::timeout_at(d, op()).await {
                Ok(outcome) => outcome,
                Err(_) => return Err(RetryError::DeadlineExceeded),
            },
            None => op().await,
        };
        let err = match outcome {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let out_of_tries = attempts.is_some_and(|n| tried >= n);
        let out_of_time = deadline.is_some_and(|d| Instant::now() + delay >= d);
        if !err.is_transient() || out_of_tries || out_of_time {
            return Err(RetryError::Failed(err));
        }
        tracing::debug!(error = ?err, tried, "transient API error, retrying");
        on_retry(&err);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(backoff.max);
    }
}

/// `retry_attempts` passes no deadline, so `DeadlineExceeded` cannot come back from it.
fn unreachable_deadline() -> ! {
    unreachable!("retry_attempts runs without a deadline")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[derive(Debug)]
    struct E(bool);
    impl Transient for E {
        fn is_transient(&self) -> bool {
            self.0
        }
    }

    #[tokio::test(start_paused = true)]
    async fn transient_errors_are_retried_up_to_the_attempts() {
        let calls = AtomicU32::new(0);
        let r: Result<(), E> = retry_attempts(3, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(E(true))
        })
        .await;
        assert!(matches!(r, Err(E(true))));
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_error_is_not_retried() {
        let calls = AtomicU32::new(0);
        let r: Result<(), E> = retry_attempts(5, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(E(false))
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn success_after_transient_failures_is_returned() {
        let calls = AtomicU32::new(0);
        let mut retries = 0;
        let r = retry_until(
            Instant::now() + Duration::from_secs(10),
            |_: &E| retries += 1,
            || async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 | 1 => Err(E(true)),
                    n => Ok(n),
                }
            },
        )
        .await;
        assert!(matches!(r, Ok(2)));
        assert_eq!(retries, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_callers_backoff_doubles_to_its_ceiling_and_is_reported() {
        let backoff = Backoff {
            first: Duration::from_millis(200),
            max: Duration::from_secs(1),
        };
        let mut waits = Vec::new();
        let calls = AtomicU32::new(0);
        let r = retry_until_with(
            Instant::now() + Duration::from_secs(60),
            backoff,
            |_: &E, next| waits.push(next),
            || async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0..=4 => Err(E(true)),
                    n => Ok(n),
                }
            },
        )
        .await;
        assert!(matches!(r, Ok(5)));
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [200, 400, 800, 1000, 1000]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_try_still_in_flight_at_the_deadline_is_an_unknown_outcome() {
        let r: Result<(), RetryError<E>> = retry_until(
            Instant::now() + Duration::from_millis(100),
            |_| {},
            std::future::pending,
        )
        .await;
        assert!(matches!(r, Err(RetryError::DeadlineExceeded)));
    }
}
