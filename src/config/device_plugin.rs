//! `[device_plugin]`: the kubelet protocol of `gpushare device-plugin` and its checks. The
//! node concerns it held before are `[node]` ([`super::node`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::error::{Check, Error};

/// What Allocate answers when no pod matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AllocateFailure {
    /// The upstream `no-gpu-has-<N><unit>-to-run` env (container start fails in the runtime).
    #[default]
    Env,
    /// A gRPC error that explains which pods were considered.
    Error,
}

/// `[device_plugin]`: the kubelet protocol of `gpushare device-plugin`. The node concerns it
/// held before (node name, memory unit, hand-over strategies, health, MPS) are in `[node]`;
/// their old `device_plugin.<key>` spellings still work ([`super::NODE_KEYS`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginConfig {
    /// kubelet's device-plugin directory.
    pub device_plugin_dir: PathBuf,
    /// kubelet's pod-resources socket (used when it exists).
    pub pod_resources_socket: PathBuf,
    /// env | error.
    pub allocate_failure: AllocateFailure,
    /// Address of /healthz, /readyz and /metrics; empty disables them.
    pub admin_address: String,
    /// Where Allocate's answers are made durable before they are returned, until the pods'
    /// annotations say so (one file per pod). On tmpfs, as long-lived as the node's
    /// containers; not writable: each answer waits for its write to the API server.
    pub state_dir: PathBuf,
}

/// The device plugin's default state directory (tmpfs).
pub const DEFAULT_DEVICE_PLUGIN_STATE_DIR: &str = "/var/run/gpushare/device-plugin";

impl Default for DevicePluginConfig {
    fn default() -> Self {
        DevicePluginConfig {
            device_plugin_dir: PathBuf::from(crate::core::wire::DEFAULT_DEVICE_PLUGIN_DIR),
            pod_resources_socket: PathBuf::from(crate::core::wire::DEFAULT_POD_RESOURCES_SOCKET),
            allocate_failure: AllocateFailure::Env,
            admin_address: "0.0.0.0:9101".to_string(),
            state_dir: PathBuf::from(DEFAULT_DEVICE_PLUGIN_STATE_DIR),
        }
    }
}

impl DevicePluginConfig {
    /// The `[device_plugin]` checks.
    pub fn validate(&self, check: &Check<'_>) -> Result<(), Error> {
        let d = self;
        if !d.admin_address.is_empty() && d.admin_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(check.invalid(
                "device_plugin.admin_address",
                format!("{:?}: expected HOST:PORT or empty", d.admin_address),
            ));
        }
        Ok(())
    }
}
