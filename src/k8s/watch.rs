//! The one watch driver: lists, then watches from the list's version, restarting after errors
//! with a backoff, and hands every event to the caller (`Init`, `InitApply`…, `InitDone`, then
//! `Apply` and `Delete`).
//!
//! How a list reads the API server is the caller's choice ([`ListFrom`]):
//! - [`ListFrom::Cache`], the informer contract (client-go's reflector): the first list at
//!   `resourceVersion=0`, answered by the API server's watch cache with whatever it holds
//!   (possibly a little behind etcd) in one answer — the page size sent with it is ignored
//!   there and honoured only by a server that reads etcd (its watch cache off), whose continue
//!   tokens are then followed without a version, as upstream requires. A list again after
//!   `410 Gone` asks for a version not older than the last one seen (the cache again); where
//!   the cache cannot serve that, a consistent paged list. For readers that settle with reads
//!   of their own what the cache may not show yet (the device plugin: a miss reads the API).
//! - [`ListFrom::Fresh`]: at least as fresh as the moment the list starts, as a consistent
//!   list is, but served by the watch cache: a consistent read of one object (`limit=1`) gives
//!   the collection's current resourceVersion, then one list at that version or newer
//!   (`resourceVersionMatch=NotOlderThan`, no limit). Where the cache cannot catch up in time
//!   (504 "Too large resource version") or the version is gone (410), a consistent paged
//!   list. For the extender's ledger, which must count every pod bound before it started or
//!   took over.
//! - [`ListFrom::Consistent`]: a consistent list, [`PAGE_SIZE`] objects a page (the way every
//!   list read before): for small collections, where it is one request.
//!
//! A list is read as its bytes arrive ([`super::list_body`]): one object at a time is decoded
//! and handed over, so the largest list is never held whole. Then a watch from the list's
//! version, with bookmarks; a watch that ends, or stays silent past its timeout, is opened
//! again from the last version seen; `410 Gone` lists again.
//!
//! What else it owns: the restart policy (the backoff is the caller's choice: [`FastBackoff`]
//! where a failing watch must be noticed within seconds, or kube-runtime's
//! [`DefaultBackoff`]), the hooks for errors (where the caller logs and counts them), and the
//! tracking of failing streaks ([`WatchHealth`]) from which a caller judges that what it
//! built from a watch is stale.
//!
//! What it does not do: decide what a re-list means. The caller keeps what it was listed
//! between `Init` and `InitDone` and reconciles at `InitDone` (the extender's ledger keeps
//! reservations newer than the re-list's start; the device plugin replaces its pod store and
//! registers only after the first list).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use http_body_util::BodyExt as _;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use kube::Api;
use kube::api::{ListParams, VersionMatch, WatchEvent, WatchParams};
pub use kube::runtime::watcher::DefaultBackoff;
use kube::runtime::watcher::Event;
use tokio::time::Instant;

use super::list_body::{ListBody, ListBodyError, Piece};
use crate::shutdown::Shutdown;

/// Objects asked for per page of a list that may be paged (what client-go asks for).
pub const PAGE_SIZE: u32 = 500;
/// `timeoutSeconds` of a watch: the API server ends it then, and it is opened again.
const WATCH_TIMEOUT_SECS: u32 = 290;
/// A watch silent this long past its timeout is taken for dead and opened again.
const IDLE_MARGIN: Duration = Duration::from_secs(5);
/// How long a list at a version waits for the watch cache to serve it (the first answer,
/// kube-rs's retries of "Too large resource version" included; upstream's API server itself
/// waits 3 s for its cache before it answers that) before a consistent paged list is read
/// instead. Only the wait for the answer's start is bounded, not the reading of a long list.
pub const CACHE_WAIT: Duration = Duration::from_secs(5);

/// How a watch's lists read the API server (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListFrom {
    /// The watch cache's state, whatever its age (`resourceVersion=0`).
    Cache,
    /// The state when the list starts, served by the watch cache.
    Fresh,
    /// A consistent list, paged.
    Consistent,
}

/// What one watch lists and watches.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    list_from: ListFrom,
    fields: Option<String>,
}

impl WatchConfig {
    /// Every object of the collection, listed as `list_from` says.
    pub fn new(list_from: ListFrom) -> WatchConfig {
        WatchConfig {
            list_from,
            fields: None,
        }
    }

    /// Only the objects that match the field selector `selector` (`spec.nodeName=n1`).
    pub fn fields(mut self, selector: &str) -> WatchConfig {
        self.fields = Some(selector.to_string());
        self
    }
}

/// Why a list or a watch failed (each is retried after the backoff).
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The list request failed or was refused.
    #[error("listing failed: {0}")]
    List(#[source] kube::Error),
    /// The list answer was not a JSON list (or ended early).
    #[error("reading the list answer: {0}")]
    ListBody(#[source] ListBodyError),
    /// An object of the list could not be decoded.
    #[error("decoding an object of the list: {0}")]
    Decode(#[source] serde_json::Error),
    /// The list answer had no resourceVersion to watch from.
    #[error("the list answer carries no resourceVersion")]
    NoResourceVersion,
    /// The watch cache did not start answering a list at a version within [`CACHE_WAIT`].
    #[error("the watch cache did not serve the list within {0:?}")]
    CacheBehind(Duration),
    /// The watch request failed or was refused.
    #[error("starting the watch failed: {0}")]
    WatchStart(#[source] kube::Error),
    /// The watch stream broke.
    #[error("the watch failed: {0}")]
    Watch(#[source] kube::Error),
    /// The watch sent an error event (`410 Gone`: the version is too old; a list follows).
    #[error("the watch answered {} {}: {}", .0.code, .0.reason, .0.message)]
    WatchStatus(Box<kube::core::Status>),
}

/// Which read one list makes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Read {
    /// `resourceVersion=0`, with a page size (paged only if the server does).
    Any,
    /// A version not older than this one (from the watch cache).
    NotOlderThan(String),
    /// Not older than the collection's current version, read first (`limit=1`).
    Newest,
    /// A consistent paged list.
    Consistent,
}

impl Read {
    fn first(list_from: ListFrom) -> Read {
        match list_from {
            ListFrom::Cache => Read::Any,
            ListFrom::Fresh => Read::Newest,
            ListFrom::Consistent => Read::Consistent,
        }
    }

    /// The read after the watch from `version` answered `410 Gone`.
    fn after_gone(list_from: ListFrom, version: &str) -> Read {
        match list_from {
            ListFrom::Cache => Read::NotOlderThan(version.to_string()),
            other => Read::first(other),
        }
    }
}

/// Whether the API server answered that it cannot serve the version asked for: the cache has
/// not reached it in time (504 with the cause `ResourceVersionTooLarge`, or an older server's
/// message) or it is gone (410).
fn version_unavailable(e: &kube::Error) -> bool {
    let kube::Error::Api(status) = e else {
        return false;
    };
    status.code == 410
        || (status.code == 504
            && (status.message.contains("Too large resource version")
                || status.details.as_ref().is_some_and(|d| {
                    d.causes
                        .iter()
                        .any(|c| c.reason == "ResourceVersionTooLarge")
                })))
}

/// Drives the watch of `api` under `config` until `shutdown` fires. Every event goes to
/// `on_event`; every error to `on_error`, after which the list or watch is tried again once
/// `backoff` says so (a good event resets the backoff; a backoff that ends stops the watch).
pub async fn drive<K>(
    api: Api<K>,
    config: WatchConfig,
    mut backoff: impl kube::runtime::utils::Backoff + 'static,
    shutdown: Shutdown,
    mut on_error: impl FnMut(&WatchError),
    mut on_event: impl FnMut(Event<K>),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let stop = shutdown.wait();
    let mut stop = std::pin::pin!(stop);
    let mut read = Read::first(config.list_from);
    'relist: loop {
        let listed = tokio::select! {
            _ = &mut stop => return,
            listed = list(&api, &config, &read, &mut on_event) => listed,
        };
        let mut version = match listed {
            Ok(version) => {
                backoff.reset();
                version
            }
            Err(e) => {
                on_error(&e);
                let Some(wait) = backoff.next() else { return };
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(wait) => {}
                }
                continue 'relist;
            }
        };
        let params = WatchParams {
            field_selector: config.fields.clone(),
            timeout: Some(WATCH_TIMEOUT_SECS),
            bookmarks: true,
            ..WatchParams::default()
        };
        let idle = Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS)) + IDLE_MARGIN;
        loop {
            let opened = tokio::select! {
                _ = &mut stop => return,
                opened = super::watch_stream::open(&api, &params, &version) => opened,
            };
            let failure = match opened {
                Err(e) => WatchError::WatchStart(e),
                Ok(stream) => {
                    let mut stream = std::pin::pin!(stream);
                    loop {
                        let next = tokio::select! {
                            _ = &mut stop => return,
                            next = tokio::time::timeout(idle, stream.next()) => next,
                        };
                        match next {
                            // Ended or silent: open it again from the last version seen.
                            Ok(None) | Err(_) => break,
                            Ok(Some(Ok(WatchEvent::Added(obj) | WatchEvent::Modified(obj)))) => {
                                if let Some(v) = obj.meta().resource_version.as_deref() {
                                    version = v.to_string();
                                }
                                backoff.reset();
                                on_event(Event::Apply(obj));
                            }
                            Ok(Some(Ok(WatchEvent::Deleted(obj)))) => {
                                if let Some(v) = obj.meta().resource_version.as_deref() {
                                    version = v.to_string();
                                }
                                backoff.reset();
                                on_event(Event::Delete(obj));
                            }
                            Ok(Some(Ok(WatchEvent::Bookmark(b)))) => {
                                version = b.metadata.resource_version;
                            }
                            Ok(Some(Ok(WatchEvent::Error(status)))) => {
                                let gone = status.code == 410;
                                on_error(&WatchError::WatchStatus(status));
                                if gone {
                                    read = Read::after_gone(config.list_from, &version);
                                    continue 'relist;
                                }
                                break;
                            }
                            Ok(Some(Err(e))) => {
                                on_error(&WatchError::Watch(e));
                                break;
                            }
                        }
                    }
                    continue;
                }
            };
            on_error(&failure);
            let Some(wait) = backoff.next() else { return };
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// One list as `read` says (falling back to a consistent paged list where the cache cannot
/// serve the version asked for), handing its objects to `on_event` between `Init` and
/// `InitDone`; returns the version to watch from.
async fn list<K>(
    api: &Api<K>,
    config: &WatchConfig,
    read: &Read,
    on_event: &mut impl FnMut(Event<K>),
) -> Result<String, WatchError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let at = match read {
        Read::Newest => {
            let params = ListParams {
                field_selector: config.fields.clone(),
                limit: Some(1),
                ..ListParams::default()
            };
            let newest = api.list(&params).await.map_err(WatchError::List)?;
            match newest.metadata.resource_version.filter(|v| !v.is_empty()) {
                Some(v) => Some(v),
                None => return pages(api, config, &Read::Consistent, on_event).await,
            }
        }
        Read::NotOlderThan(v) => Some(v.clone()),
        Read::Any | Read::Consistent => None,
    };
    let Some(at) = at else {
        return pages(api, config, read, on_event).await;
    };
    match pages(api, config, &Read::NotOlderThan(at.clone()), on_event).await {
        Err(WatchError::List(e)) if version_unavailable(&e) => {
            tracing::debug!(version = %at, error = %e, "the watch cache cannot serve the version; listing consistently");
            pages(api, config, &Read::Consistent, on_event).await
        }
        Err(e @ WatchError::CacheBehind(_)) => {
            tracing::debug!(version = %at, error = %e, "listing consistently");
            pages(api, config, &Read::Consistent, on_event).await
        }
        other => other,
    }
}

/// The pages of one list (one, unless the server pages it), streamed into `on_event`.
async fn pages<K>(
    api: &Api<K>,
    config: &WatchConfig,
    read: &Read,
    on_event: &mut impl FnMut(Event<K>),
) -> Result<String, WatchError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned,
{
    let mut continue_token: Option<String> = None;
    let mut first = true;
    loop {
        let mut params = ListParams {
            field_selector: config.fields.clone(),
            ..ListParams::default()
        };
        // Continuing carries neither the version nor the match (upstream refuses them).
        let limit = match (&continue_token, read) {
            (Some(token), _) => {
                params.continue_token = Some(token.clone());
                Some(PAGE_SIZE)
            }
            (None, Read::Any) => {
                params.resource_version = Some("0".to_string());
                Some(PAGE_SIZE)
            }
            (None, Read::NotOlderThan(v)) => {
                params.resource_version = Some(v.clone());
                params.version_match = Some(VersionMatch::NotOlderThan);
                None
            }
            (None, Read::Consistent | Read::Newest) => Some(PAGE_SIZE),
        };
        let meta = page(api, &params, limit, &mut first, on_event).await?;
        match meta.continue_.filter(|c| !c.is_empty()) {
            Some(token) => continue_token = Some(token),
            None => {
                let version = meta
                    .resource_version
                    .filter(|v| !v.is_empty())
                    .ok_or(WatchError::NoResourceVersion)?;
                on_event(Event::InitDone);
                return Ok(version);
            }
        }
    }
}

/// One page: the request (`limit` added to the query: kube-rs drops `resourceVersion=0` when
/// a limit is set), then its objects as they arrive; `Init` before the first object of the
/// first page. Returns the page's metadata.
async fn page<K>(
    api: &Api<K>,
    params: &ListParams,
    limit: Option<u32>,
    first: &mut bool,
    on_event: &mut impl FnMut(Event<K>),
) -> Result<ListMeta, WatchError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned,
{
    let request = kube::core::Request::new(api.resource_url())
        .list(params)
        .map_err(|e| WatchError::List(kube::Error::BuildRequest(e)))?;
    let request = match limit {
        None => request,
        Some(n) => {
            let (mut parts, body) = request.into_parts();
            let uri = parts.uri.to_string();
            let joined = if uri.ends_with('?') {
                format!("{uri}limit={n}")
            } else {
                format!("{uri}&limit={n}")
            };
            parts.uri = joined.parse().map_err(|e: http::uri::InvalidUri| {
                WatchError::List(kube::Error::HttpError(e.into()))
            })?;
            http::Request::from_parts(parts, body)
        }
    };
    let client = api.clone().into_client();
    let sent = client.send(request.map(kube::client::Body::from));
    // A list at a version may wait on the cache: bounded (see CACHE_WAIT).
    let response = if params.version_match == Some(VersionMatch::NotOlderThan) {
        tokio::time::timeout(CACHE_WAIT, sent)
            .await
            .map_err(|_| WatchError::CacheBehind(CACHE_WAIT))?
    } else {
        sent.await
    }
    .map_err(WatchError::List)?;
    let status = response.status();
    let mut body = response.into_body();
    if !status.is_success() {
        let bytes = body.collect().await.map_err(WatchError::List)?.to_bytes();
        let refused = serde_json::from_slice::<kube::core::Status>(&bytes).unwrap_or_else(|_| {
            kube::core::Status::failure(String::from_utf8_lossy(&bytes).trim(), "")
                .with_code(status.as_u16())
        });
        return Err(WatchError::List(kube::Error::Api(Box::new(refused))));
    }
    if std::mem::take(first) {
        on_event(Event::Init);
    }
    let mut reader = ListBody::default();
    let mut meta = ListMeta::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(WatchError::List)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        reader.push(&data);
        loop {
            let object = match reader.next_piece().map_err(WatchError::ListBody)? {
                None => break,
                Some(Piece::Metadata(bytes)) => {
                    meta = super::decode::from_bytes(bytes).map_err(WatchError::Decode)?;
                    continue;
                }
                Some(Piece::Item(bytes)) => {
                    super::decode::from_bytes::<K>(bytes).map_err(WatchError::Decode)?
                }
            };
            on_event(Event::InitApply(object));
        }
    }
    reader.finish().map_err(WatchError::ListBody)?;
    Ok(meta)
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
