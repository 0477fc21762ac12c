//! The API server's watch cache as its clients see it: which list reads it answers, and a
//! cache that falls behind on a test's command.
//!
//! How a list reads, from its `resourceVersion`, `resourceVersionMatch`, `continue` and
//! `limit` (upstream's "semantics for get and list", checked as `ValidateListOptions` checks
//! them: a match without a version, a match with `continue` and `Exact` at "0" are 422
//! `Invalid`; a version other than "0" with `continue` is 400):
//!
//! | parameters | read | served by |
//! | --- | --- | --- |
//! | no `resourceVersion` | consistent: the newest state | the store (upstream: etcd, or the cache once it has caught up with etcd) |
//! | `continue` | the rest of a paged list at its first page's version | the store |
//! | `resourceVersion=0` | any state, possibly old | the cache: the **limit is ignored**, one answer holds everything (upstream's `computeListLimit`); with the cache off, the store, paged |
//! | a version `v` with `NotOlderThan`, or without a match and without a limit | a state at `v` or newer | the cache, paged by the limit; `v` newer than the cache: 504 "Too large resource version" (upstream waits up to 3 s for the cache first) |
//! | a version `v` with `Exact`, or without a match but with a limit (the legacy rule) | the state at exactly `v` | the store at `v` only when `v` is the newest version; older: 410 `Expired` (the sandbox keeps no old states, as if compacted) |
//!
//! The sandbox's cache is its store, always current, unless a test holds it
//! ([`super::ApiServer::hold_watch_cache`]): then it stays at the version it was held at,
//! `F`. Lists at "0" answer the objects as they were at `F`; lists not older than a version
//! after `F` answer 504 "Too large resource version"; watches deliver no event after `F` until
//! [`super::ApiServer::release_watch_cache`]. Consistent lists still read the truth. This is
//! what a real cache that lags behind etcd (a busy API server, another replica of it) shows a
//! client that trusts a list at "0".
//!
//! It does not model the cache's own window of events (watches replay from the store's
//! history) nor several API server replicas.

use std::sync::Arc;

use tokio::sync::watch;

use super::field_errors::{FieldError, Path, invalid_status_of};
use super::store::{ApiError, Objects};

/// How one list reads (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ListRead {
    /// No resourceVersion: the newest state.
    Consistent,
    /// `continue`: the rest of a paged list.
    Continue,
    /// `resourceVersion=0`: any state the cache holds.
    Any,
    /// A state at this version or newer.
    NotOlderThan(u64),
    /// The state at exactly this version.
    Exact(u64),
}

impl ListRead {
    /// The read a list asks for, or upstream's refusal of its parameters.
    pub fn of(
        resource_version: Option<&str>,
        version_match: Option<&str>,
        continue_token: Option<&str>,
        limit: usize,
    ) -> Result<ListRead, ApiError> {
        let rv = resource_version.filter(|v| !v.is_empty());
        let continued = continue_token.is_some_and(|c| !c.is_empty());
        let mut errors = Vec::new();
        let field = Path::new("resourceVersionMatch");
        if let Some(m) = version_match.filter(|m| !m.is_empty()) {
            if rv.is_none() {
                errors.push(FieldError::forbidden(
                    &field,
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                ));
            }
            if continued {
                errors.push(FieldError::forbidden(
                    &field,
                    "resourceVersionMatch is forbidden when continue is provided",
                ));
            }
            if m != "Exact" && m != "NotOlderThan" {
                errors.push(FieldError::not_supported(
                    &field,
                    m,
                    &["Exact", "NotOlderThan", ""],
                ));
            }
            if m == "Exact" && rv == Some("0") {
                errors.push(FieldError::forbidden(
                    &field,
                    "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
                ));
            }
        }
        if !errors.is_empty() {
            return Err(invalid_status_of("ListOptions", "meta.k8s.io", "", &errors));
        }
        if continued {
            if rv.is_some_and(|v| v != "0") {
                return Err(ApiError::bad_request(
                    "specifying resource version is not allowed when using continue",
                ));
            }
            return Ok(ListRead::Continue);
        }
        let Some(rv) = rv else {
            return Ok(ListRead::Consistent);
        };
        let version = rv
            .parse::<u64>()
            .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv:?}")))?;
        Ok(match version_match.filter(|m| !m.is_empty()) {
            _ if version == 0 => ListRead::Any,
            Some("Exact") => ListRead::Exact(version),
            Some(_) => ListRead::NotOlderThan(version),
            None if limit > 0 => ListRead::Exact(version),
            None => ListRead::NotOlderThan(version),
        })
    }
}

/// Upstream's answer to a read at a version the cache (or etcd) has not reached.
pub(crate) fn too_large(asked: u64, current: u64) -> ApiError {
    ApiError {
        code: 504,
        reason: "Timeout".into(),
        message: format!("Too large resource version: {asked}, current: {current}"),
        details: Some(serde_json::json!({
            "causes": [{ "reason": "ResourceVersionTooLarge", "message": "Too large resource version" }],
            "retryAfterSeconds": 1,
        })),
    }
}

/// The watch cache's state: on or off, and held at a version.
pub(crate) struct WatchCache {
    enabled: bool,
    held: Option<(u64, Arc<Objects>)>,
    /// The version the cache is held at (`None`: current), for the watches to wait on.
    held_tx: watch::Sender<Option<u64>>,
}

impl WatchCache {
    pub fn new() -> WatchCache {
        WatchCache {
            enabled: true,
            held: None,
            held_tx: watch::channel(None).0,
        }
    }

    /// Whether lists at "0" are served by the cache (else paged from the store).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
    }

    /// The version the cache is held at and its objects then, while held.
    pub fn held(&self) -> Option<(u64, Arc<Objects>)> {
        self.held.clone()
    }

    pub fn hold(&mut self, rv: u64, objects: Objects) {
        self.held = Some((rv, Arc::new(objects)));
        self.held_tx.send_replace(Some(rv));
    }

    pub fn release(&mut self) {
        self.held = None;
        self.held_tx.send_replace(None);
    }

    /// Follows the version the cache is held at (watches wait on it).
    pub fn subscribe(&self) -> watch::Receiver<Option<u64>> {
        self.held_tx.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(rv: Option<&str>, m: Option<&str>, c: Option<&str>, limit: usize) -> ListRead {
        ListRead::of(rv, m, c, limit).expect("a valid read")
    }

    fn refused(rv: Option<&str>, m: Option<&str>, c: Option<&str>) -> (u16, String) {
        let e = ListRead::of(rv, m, c, 500).expect_err("refused");
        (e.code, e.message)
    }

    #[test]
    fn reads_follow_upstreams_table() {
        assert_eq!(read(None, None, None, 500), ListRead::Consistent);
        assert_eq!(read(Some(""), None, None, 0), ListRead::Consistent);
        assert_eq!(read(Some("0"), None, None, 500), ListRead::Any);
        assert_eq!(
            read(Some("0"), Some("NotOlderThan"), None, 500),
            ListRead::Any
        );
        assert_eq!(
            read(Some("7"), Some("NotOlderThan"), None, 500),
            ListRead::NotOlderThan(7)
        );
        assert_eq!(read(Some("7"), None, None, 0), ListRead::NotOlderThan(7));
        assert_eq!(read(Some("7"), None, None, 500), ListRead::Exact(7));
        assert_eq!(read(Some("7"), Some("Exact"), None, 0), ListRead::Exact(7));
        assert_eq!(read(Some("0"), None, Some("tok"), 500), ListRead::Continue);
        assert_eq!(read(None, None, Some("tok"), 500), ListRead::Continue);
    }

    #[test]
    fn bad_combinations_are_refused_as_upstream_refuses_them() {
        let (code, msg) = refused(Some("0"), Some("NotOlderThan"), Some("tok"));
        assert_eq!(code, 422);
        assert_eq!(
            msg,
            "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: Forbidden: \
             resourceVersionMatch is forbidden when continue is provided"
        );
        let (code, msg) = refused(None, Some("NotOlderThan"), None);
        assert_eq!(code, 422);
        assert!(
            msg.contains("forbidden unless resourceVersion is provided"),
            "{msg}"
        );
        let (code, msg) = refused(Some("0"), Some("Exact"), None);
        assert_eq!(code, 422);
        assert!(
            msg.contains("\"exact\" is forbidden for resourceVersion \"0\""),
            "{msg}"
        );
        let (code, msg) = refused(Some("3"), Some("Newest"), None);
        assert_eq!(code, 422);
        assert!(msg.contains("Unsupported value: \"Newest\""), "{msg}");
        let (code, msg) = refused(Some("3"), None, Some("tok"));
        assert_eq!(
            (code, msg.as_str()),
            (
                400,
                "specifying resource version is not allowed when using continue"
            )
        );
        assert_eq!(refused(Some("x"), None, None).0, 400);
    }

    #[test]
    fn too_large_carries_upstreams_cause() {
        let e = too_large(9, 4);
        assert_eq!((e.code, e.reason.as_ref()), (504, "Timeout"));
        assert_eq!(e.message, "Too large resource version: 9, current: 4");
        let status = e.to_status();
        assert_eq!(
            status["details"]["causes"][0]["reason"],
            "ResourceVersionTooLarge"
        );
    }
}
