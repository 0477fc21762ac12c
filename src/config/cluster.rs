//! `[cluster]`: how every role reaches the API server. Nothing here is checked beyond its type.

use serde::{Deserialize, Serialize};

/// `[cluster]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Kubeconfig file; empty means `KUBECONFIG`, then the in-cluster service account.
    pub kubeconfig: String,
    /// How long a role starting up waits for an unreachable API server (no connection,
    /// timeout, 429, 5xx), in seconds, before it gives up; 0 gives up at once. A refusal
    /// (401, 403) or a broken kubeconfig is never waited for.
    pub api_wait_secs: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            kubeconfig: String::new(),
            api_wait_secs: 300,
        }
    }
}
