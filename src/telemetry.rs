//! Logging setup: `tracing` with text or JSON lines on stderr, level from the configuration
//! unless `RUST_LOG` is set. Log fields are structured and named consistently across roles
//! (`node`, `pod`, `namespace`, `gpu`, `mem`).
//!
//! Colour (ANSI escapes) only when the output is a terminal and `NO_COLOR` is unset or empty
//! (<https://no-color.org>): files, journald and `kubectl logs` get plain text. This module
//! does not decide where logs go beyond stderr, nor rotate them.

use std::ffi::OsStr;
use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat, LogLevel};

/// Installs the global subscriber; a second call is a no-op (tests, demo).
pub fn init(log: &LogConfig) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => {
            EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new(level_directive(log.level)))
        }
        _ => EnvFilter::new(level_directive(log.level)),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour(std::io::stderr().is_terminal()))
        .with_target(false);
    let _ = match log.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Whether output to a stream may carry ANSI colour: only on a terminal, and only while
/// `NO_COLOR` is unset or empty. Every coloured output of the binary asks here.
pub fn colour(is_terminal: bool) -> bool {
    colour_with(is_terminal, std::env::var_os("NO_COLOR").as_deref())
}

fn colour_with(is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    is_terminal && no_color.is_none_or(OsStr::is_empty)
}

/// The filter directive of a level: ours at that level, dependencies one level quieter.
/// Below debug, the kube client's per-request failure lines are off: every failed call is
/// returned to the caller, which retries, logs or reports it once, in its own words.
fn level_directive(level: LogLevel) -> String {
    let (ours, deps) = match level {
        LogLevel::Trace => ("trace", "debug"),
        LogLevel::Debug => ("debug", "info"),
        LogLevel::Info => ("info", "warn"),
        LogLevel::Warn => ("warn", "warn"),
        LogLevel::Error => ("error", "error"),
    };
    let quiet = match level {
        LogLevel::Trace | LogLevel::Debug => "",
        _ => ",kube_client::client::builder=off",
    };
    format!("{deps},gpushare={ours}{quiet}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_parse() {
        for level in [
            LogLevel::Trace,
            LogLevel::Debug,
            LogLevel::Info,
            LogLevel::Warn,
            LogLevel::Error,
        ] {
            assert!(EnvFilter::try_new(level_directive(level)).is_ok());
        }
        assert_eq!(level_directive(LogLevel::Debug), "info,gpushare=debug");
        assert_eq!(
            level_directive(LogLevel::Info),
            "warn,gpushare=info,kube_client::client::builder=off"
        );
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_with(true, None));
        assert!(
            colour_with(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
        assert!(!colour_with(true, Some(OsStr::new("1"))));
        assert!(
            !colour_with(false, None),
            "a file, a pipe, journald: no colour"
        );
        assert!(!colour_with(false, Some(OsStr::new("1"))));
    }
}
