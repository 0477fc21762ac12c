//! The one watch driver: runs a kube-runtime watcher until shutdown or the end of its
//! stream, restarting it after errors with a backoff, and hands every event to the caller.
//!
//! What it owns: the restart policy (kube-runtime's watcher re-lists after a `410 Gone` or a
//! dropped stream, delivering `Init`, `InitApply`…, `InitDone`; the backoff is the caller's
//! choice: [`FastBackoff`] where a failing watch must be noticed within seconds, or
//! kube-runtime's [`DefaultBackoff`]), the hooks for errors (where the caller logs and counts
//! them), and the tracking of failing streaks ([`WatchHealth`]) from which a caller judges
//! that what it built from a watch is stale.
//!
//! What it does not do: decide what a re-list means. The caller keeps what it was listed
//! between `Init` and `InitDone` and reconciles at `InitDone` (the extender's ledger keeps
//! reservations newer than the re-list's start; the device plugin replaces its pod store and
//! registers only after the first list).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use kube::Api;
use kube::runtime::WatchStreamExt;
pub use kube::runtime::watcher::DefaultBackoff;
use kube::runtime::watcher::{self, Event};
use tokio::time::Instant;

use crate::shutdown::Shutdown;

/// Drives the watch of `api` under `config` until `shutdown` fires or the stream ends.
/// Every event goes to `on_event`; every error to `on_error`, after which the watcher
/// restarts once `backoff` says so (a good event resets the backoff).
pub async fn drive<K>(
    api: Api<K>,
    config: watcher::Config,
    backoff: impl kube::runtime::utils::Backoff + 'static,
    shutdown: Shutdown,
    mut on_error: impl FnMut(&watcher::Error),
    mut on_event: impl FnMut(Event<K>),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let stream = watcher::watcher(api, config).backoff(backoff);
    let mut stream = std::pin::pin!(stream);
    let stop = shutdown.wait();
    let mut stop = std::pin::pin!(stop);
    loop {
        let event = tokio::select! {
            _ = &mut stop => return,
            event = stream.next() => event,
        };
        match event {
            None => return,
            Some(Err(e)) => on_error(&e),
            Some(Ok(event)) => on_event(event),
        }
    }
}

/// Longest wait of [`FastBackoff`] between two tries of a failing watch.
pub(crate) const MAX_FAST_BACKOFF: Duration = Duration::from_secs(2);
/// A failing streak without an error for this long has ended (see [`WatchHealth::stale`]).
pub(crate) const QUIET: Duration = Duration::from_secs(6);

/// Doubling from 100 ms to [`MAX_FAST_BACKOFF`], reset by a good event: short enough that a
/// failing watch reports an error at least every few seconds, which [`WatchHealth`] needs.
#[derive(Debug)]
pub(crate) struct FastBackoff {
    next: Duration,
}

impl Default for FastBackoff {
    fn default() -> Self {
        FastBackoff {
            next: Duration::from_millis(100),
        }
    }
}

impl Iterator for FastBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let d = self.next;
        self.next = (self.next * 2).min(MAX_FAST_BACKOFF);
        Some(d)
    }
}

impl kube::runtime::utils::Backoff for FastBackoff {
    fn reset(&mut self) {
        *self = FastBackoff::default();
    }
}

/// A failing streak of one watch: since when, the last error and when it came.
#[derive(Debug, Clone)]
struct Streak {
    since: Instant,
    last: Instant,
    error: String,
}

/// The failing streaks of named watches (driven with [`FastBackoff`]), for judging staleness.
#[derive(Debug, Default)]
pub struct WatchHealth {
    streaks: Mutex<BTreeMap<&'static str, Streak>>,
}

impl WatchHealth {
    /// The watch `what` failed with `error`: a streak starts or goes on.
    pub fn failed(&self, what: &'static str, error: String) {
        let now = Instant::now();
        let mut s = self.streaks.lock().unwrap_or_else(|p| p.into_inner());
        let streak = s.entry(what).or_insert(Streak {
            since: now,
            last: now,
            error: String::new(),
        });
        streak.last = now;
        streak.error = error;
    }

    /// The watch `what` delivered an event: its streak ends.
    pub fn succeeded(&self, what: &'static str) {
        self.streaks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(what);
    }

    /// The reason for staleness at `now`, if a watch has kept failing for `after`.
    /// A streak ends with a good event, or when no error came for [`QUIET`] (a watch that
    /// resumed quietly: errors come at least every [`MAX_FAST_BACKOFF`] while it fails).
    pub fn stale(&self, now: Instant, after: Duration) -> Option<String> {
        let mut s = self.streaks.lock().unwrap_or_else(|p| p.into_inner());
        s.retain(|_, st| now.saturating_duration_since(st.last) < QUIET);
        s.iter()
            .find(|(_, st)| now.saturating_duration_since(st.since) >= after)
            .map(|(what, st)| {
                format!(
                    "the {what} watch has failed for {} s: {}",
                    now.saturating_duration_since(st.since).as_secs(),
                    st.error
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_backoff_doubles_to_its_ceiling_and_resets() {
        use kube::runtime::utils::Backoff as _;
        let mut b = FastBackoff::default();
        let first: Vec<u64> = b.by_ref().take(7).map(|d| d.as_millis() as u64).collect();
        assert_eq!(first, [100, 200, 400, 800, 1600, 2000, 2000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(100)));
    }

    #[test]
    fn a_streak_is_stale_after_its_limit_and_ends_with_a_good_event_or_quiet() {
        let health = WatchHealth::default();
        health.failed("pod", "connection refused".to_string());
        let start = Instant::now();
        assert_eq!(health.stale(start, Duration::from_secs(1)), None);
        let why = health
            .stale(start + Duration::from_secs(2), Duration::from_secs(1))
            .expect("stale after the limit");
        assert!(
            why.starts_with("the pod watch has failed for 2 s: connection refused"),
            "{why}"
        );
        // No error for QUIET: the streak has ended.
        assert_eq!(
            health.stale(
                start + QUIET + Duration::from_secs(1),
                Duration::from_secs(1)
            ),
            None
        );
        health.failed("node", "boom".to_string());
        health.succeeded("node");
        assert_eq!(
            health.stale(
                Instant::now() + Duration::from_secs(2),
                Duration::from_secs(1)
            ),
            None
        );
    }
}
