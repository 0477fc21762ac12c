//! The one way the integration tests wait: poll a condition until it holds, or fail the test
//! when a deadline passes, naming what never happened and the last state seen. Never a sleep
//! as synchronisation: the pause between polls only paces the polling.
//!
//! Waits on a watch channel (`tokio::sync::watch::Receiver::wait_for`) need no polling and do
//! not come here.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

/// How long a wait lasts before it fails the test.
pub(crate) const DEADLINE: Duration = Duration::from_secs(30);

/// The pause between two polls.
const PACE: Duration = Duration::from_millis(20);

/// Polls `probe` until it answers `Ok`, and returns that; fails the test after `limit` with
/// `what` and the last `Err` (the state seen instead).
pub(crate) async fn poll<T, E, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let end = tokio::time::Instant::now() + limit;
    loop {
        let last = match probe().await {
            Ok(done) => return done,
            Err(last) => last,
        };
        assert!(
            tokio::time::Instant::now() < end,
            "timed out after {limit:?} waiting for {what}; last seen: {last:?}"
        );
        tokio::time::sleep(PACE).await;
    }
}

/// Polls `cond` until it holds, or fails the test after [`DEADLINE`].
pub(crate) async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    wait_until_within(what, DEADLINE, &mut cond).await;
}

/// Polls `cond` until it holds, or fails the test after `limit`.
pub(crate) async fn wait_until_within(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    poll(what, limit, || {
        let held = cond();
        async move { if held { Ok(()) } else { Err("not yet") } }
    })
    .await;
}

/// Polls the async `cond` until it holds, or fails the test after [`DEADLINE`].
pub(crate) async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(what, DEADLINE, || {
        let fut = cond();
        async move { if fut.await { Ok(()) } else { Err("not yet") } }
    })
    .await;
}
