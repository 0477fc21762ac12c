//! A configuration error ([`Error`]) and what names its source: the key, the layer it came
//! from (file, environment variable, flag, default) and what is allowed. [`Check`] is what each
//! section's `validate` builds its errors with. It reads no configuration itself.

use std::path::PathBuf;

use figment::{Figment, Metadata};

use super::devices;

/// A configuration problem: which key, from where, and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file named by `--config` does not exist or cannot be read.
    #[error("configuration file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// A key has a value that is not allowed.
    #[error("invalid configuration: {key} (from {source_name}): {message}")]
    Invalid {
        /// Dotted key, e.g. `extender.port`.
        key: String,
        /// Where the value came from (file path, env var, flag).
        source_name: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// `[devices]` is refused (a kind's settings, or two kinds claiming one resource).
    #[error("invalid configuration: devices: {0}")]
    Devices(#[from] devices::DevicesConfigError),
}

/// Builds a section's [`Error::Invalid`] naming where the key's value came from.
pub struct Check<'a>(pub &'a Figment);

impl Check<'_> {
    /// The error for `key` (dotted), with what is wrong and what is allowed.
    pub fn invalid(&self, key: &str, message: String) -> Error {
        Error::Invalid {
            key: key.to_string(),
            source_name: source_of(self.0, key),
            message,
        }
    }
}

/// Where the value of `key` came from, for error messages.
fn source_of(fig: &Figment, key: &str) -> String {
    match fig.find_metadata(key) {
        Some(md) => describe_metadata(md, key),
        None => "built-in default".to_string(),
    }
}

fn describe_metadata(md: &Metadata, key: &str) -> String {
    let path: Vec<&str> = key.split('.').collect();
    if md.name.contains("GPUSHARE_") {
        return format!(
            "environment variable GPUSHARE_{}",
            path.join("__").to_ascii_uppercase()
        );
    }
    if md.name.contains("environment") {
        let var = match key {
            "extender.port" => "PORT",
            "log.level" => "LOG_LEVEL",
            "node.node_name" => "NODE_NAME",
            "cluster.kubeconfig" => "KUBECONFIG",
            other => other,
        };
        return format!("environment variable {var}");
    }
    match &md.source {
        Some(figment::Source::File(p)) => format!("file {}", p.display()),
        _ if md.name.contains("flag") => {
            format!("flag --{}", path.last().unwrap_or(&key).replace('_', "-"))
        }
        _ => md.name.to_string(),
    }
}

pub fn describe(fig: &Figment, err: figment::Error) -> Error {
    let key = err
        .path
        .iter()
        .filter(|p| p.as_str() != "default" && p.as_str() != "global")
        .cloned()
        .collect::<Vec<_>>()
        .join(".");
    let source_name = match &err.metadata {
        Some(md) => describe_metadata(md, &key),
        None => source_of(fig, &key),
    };
    let message = err.kind.to_string();
    Error::Invalid {
        key: if key.is_empty() {
            "(file)".to_string()
        } else {
            key
        },
        source_name,
        message,
    }
}
