//! `[http]`: deadlines and caps of every HTTP server gpushare runs, and their checks.

use serde::{Deserialize, Serialize};

use super::error::{Check, Error};

/// `[http]`: deadlines and caps of every HTTP server gpushare runs (see `http_server`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Request headers must arrive within this (from connect, or from the previous request).
    pub header_read_timeout_ms: u64,
    /// A request body must arrive within this; a slower client gets 408.
    pub body_read_timeout_ms: u64,
    /// A whole request must finish within this; past it the client gets 503. Must exceed
    /// `extender.bind_timeout_ms`.
    pub request_timeout_ms: u64,
    /// Open connections per server at most; more are closed at once (and counted).
    pub max_connections: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            max_connections: 4096,
        }
    }
}

impl HttpConfig {
    /// The `[http]` checks of its own.
    pub fn validate(&self, check: &Check<'_>) -> Result<(), Error> {
        let h = self;
        for (key, ms) in [
            ("http.header_read_timeout_ms", h.header_read_timeout_ms),
            ("http.body_read_timeout_ms", h.body_read_timeout_ms),
            ("http.request_timeout_ms", h.request_timeout_ms),
        ] {
            if ms == 0 {
                return Err(check.invalid(key, "must be > 0".to_string()));
            }
        }
        if h.max_connections == 0 {
            return Err(check.invalid("http.max_connections", "must be > 0".to_string()));
        }
        Ok(())
    }
}
