//! `[dra]`: the kubelet side of `gpushare dra-plugin` (driver name, kubelet directories, GPU
//! policy, admin address) and its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::error::{Check, Error};
use crate::core::GpuPolicy;

/// `[dra]`: the kubelet side of `gpushare dra-plugin`. The node concerns (node name, memory
/// unit, device-id strategy, health, MPS) are `[node]`, shared with the device plugin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DraConfig {
    /// The DRA driver name (the slices' `driver`, the DeviceClass selects on it).
    pub driver_name: String,
    /// kubelet's plugin registry directory (`<driver_name>-reg.sock` is created there).
    pub registry_dir: PathBuf,
    /// The plugin's own directory (`dra.sock`); empty:
    /// `/var/lib/kubelet/plugins/<driver_name>`.
    pub plugin_dir: PathBuf,
    /// Where the checkpoint of prepared claims is kept (`checkpoint.json`); empty:
    /// `/var/run/gpushare/<driver_name>`. It should live as long as `cdi_dir` (both on tmpfs:
    /// a reboot clears both, and kubelet prepares every claim again).
    pub state_dir: PathBuf,
    /// Where the transient CDI spec of each prepared claim is written.
    pub cdi_dir: PathBuf,
    /// binpack | spread: the order of the devices in the slice (first fit follows it).
    pub gpu_policy: GpuPolicy,
    /// Address of /healthz, /readyz and /metrics; empty disables them.
    pub admin_address: String,
}

impl Default for DraConfig {
    fn default() -> Self {
        DraConfig {
            driver_name: crate::core::wire::DRA_DRIVER_NAME.to_string(),
            registry_dir: PathBuf::from(DEFAULT_DRA_REGISTRY_DIR),
            plugin_dir: PathBuf::new(),
            state_dir: PathBuf::new(),
            cdi_dir: PathBuf::from(DEFAULT_DRA_CDI_DIR),
            gpu_policy: GpuPolicy::Binpack,
            admin_address: "0.0.0.0:9102".to_string(),
        }
    }
}

/// kubelet's plugin registry directory.
pub const DEFAULT_DRA_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The parent of the DRA plugin's own directory (`<this>/<driver>`).
pub const DEFAULT_DRA_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Where prepared claims' transient CDI specs go.
pub const DEFAULT_DRA_CDI_DIR: &str = "/var/run/cdi";
/// The parent of the DRA plugin's state directory (`<this>/<driver>`, the checkpoint).
pub const DEFAULT_DRA_STATE_DIR: &str = "/var/run/gpushare";

impl DraConfig {
    /// The `[dra]` checks.
    pub fn validate(&self, check: &Check<'_>) -> Result<(), Error> {
        let d = self;
        if !d.admin_address.is_empty() && d.admin_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(check.invalid(
                "dra.admin_address",
                format!("{:?}: expected HOST:PORT or empty", d.admin_address),
            ));
        }
        let label = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        if d.driver_name.len() > 63
            || !d.driver_name.contains('.')
            || !d.driver_name.split('.').all(label)
        {
            return Err(check.invalid(
                "dra.driver_name",
                format!(
                    "{:?}: expected a DNS subdomain such as gpushare.io",
                    d.driver_name
                ),
            ));
        }
        Ok(())
    }

    /// The plugin directory: `plugin_dir`, or `/var/lib/kubelet/plugins/<driver_name>`.
    pub fn plugin_dir(&self) -> PathBuf {
        if self.plugin_dir.as_os_str().is_empty() {
            PathBuf::from(DEFAULT_DRA_PLUGINS_DIR).join(&self.driver_name)
        } else {
            self.plugin_dir.clone()
        }
    }

    /// The state directory: `state_dir`, or `/var/run/gpushare/<driver_name>`.
    pub fn state_dir(&self) -> PathBuf {
        if self.state_dir.as_os_str().is_empty() {
            PathBuf::from(DEFAULT_DRA_STATE_DIR).join(&self.driver_name)
        } else {
            self.state_dir.clone()
        }
    }
}
