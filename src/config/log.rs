//! `[log]`: verbosity and line format. Nothing here is checked beyond its type.

use serde::{Deserialize, Serialize};

/// Log verbosity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Everything.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    #[default]
    Info,
    /// Problems only.
    Warn,
    /// Failures only.
    Error,
}

/// Log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[log]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// trace | debug | info | warn | error (`RUST_LOG`, when set, wins).
    pub level: LogLevel,
    /// text | json.
    pub format: LogFormat,
}
