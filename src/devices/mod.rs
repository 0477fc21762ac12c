//! Device kinds beside the GPU: their configuration ([`DevicesConfig`], later `[devices]` of
//! the configuration file), generic devices declared there ([`generic`]), and the hand-over
//! of a pod's devices of either kind to its container ([`handover`]). RDMA HCAs are
//! discovered by [`crate::rdma`].
//!
//! What lives here is pure or reads only files: it registers no device plugin, publishes no
//! DRA device and talks to no API server. The node agent, the device plugin (one extended
//! resource per kind) and the DRA plugin are wired onto these pieces.

pub mod generic;
pub mod handover;

use serde::{Deserialize, Serialize};

use crate::rdma::{RdmaConfig, RdmaConfigError, Roots};
use generic::{GenericConfigError, GenericDeviceConfig};

/// `[devices]`: where the host is read, the RDMA kind and the generic devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesConfig {
    /// The host's `/sys` as this process sees it (`--sysfs-root`).
    pub sysfs_root: std::path::PathBuf,
    /// The host's `/dev` as this process sees it (`--dev-root`).
    pub dev_root: std::path::PathBuf,
    /// `[devices.rdma]`.
    pub rdma: RdmaConfig,
    /// `[[devices.generic]]`.
    pub generic: Vec<GenericDeviceConfig>,
}

impl Default for DevicesConfig {
    fn default() -> DevicesConfig {
        let r = Roots::default();
        DevicesConfig {
            sysfs_root: r.sysfs,
            dev_root: r.dev,
            rdma: RdmaConfig::default(),
            generic: Vec::new(),
        }
    }
}

impl DevicesConfig {
    /// The sysfs and dev roots.
    pub fn roots(&self) -> Roots {
        Roots {
            sysfs: self.sysfs_root.clone(),
            dev: self.dev_root.clone(),
        }
    }
}

/// Why `[devices]` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevicesConfigError {
    /// `[devices.rdma]`.
    #[error(transparent)]
    Rdma(#[from] RdmaConfigError),
    /// `[[devices.generic]]`.
    #[error(transparent)]
    Generic(#[from] GenericConfigError),
    /// Two kinds claim one resource name.
    #[error("devices: resource {0} is declared twice")]
    DuplicateResource(String),
}

impl DevicesConfig {
    /// Checks every kind, and that no two claim one resource.
    pub fn validate(&self) -> Result<(), DevicesConfigError> {
        let mut seen = std::collections::BTreeSet::new();
        if self.rdma.enabled {
            self.rdma.validate()?;
            seen.insert(self.rdma.resource.clone());
        }
        for g in &self.generic {
            g.validate()?;
            if !seen.insert(g.resource.clone()) {
                return Err(DevicesConfigError::DuplicateResource(g.resource.clone()));
            }
        }
        Ok(())
    }
}

pub use crate::core::resource_name::{RESERVED_RESOURCES, ResourceNameError, check_resource_name};
