//! `[devices]`: the device kinds beside the GPU as configured — where the host's sysfs and
//! `/dev` are read, `[devices.rdma]` and each `[[devices.generic]]` declaration — and their
//! checks ([`DevicesConfig::validate`], run at load: a refused section is exit status 78).
//!
//! Only the settings live here; discovery and the hand-over are [`crate::rdma`] and
//! [`crate::devices`], which re-export these types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
        DevicesConfig {
            sysfs_root: std::path::PathBuf::from("/sys"),
            dev_root: std::path::PathBuf::from("/dev"),
            rdma: RdmaConfig::default(),
            generic: Vec::new(),
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

/// The RDMA device kind's configuration (later `[devices.rdma]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaConfig {
    /// Offer the node's HCAs.
    pub enabled: bool,
    /// The extended resource the HCAs are offered as.
    pub resource: String,
    /// Pods that may hold one HCA at once (1: handed out whole; more: shared, as the RDMA
    /// shared device plugin does).
    pub shares_per_hca: u32,
    /// Offer only HCAs with at least one ACTIVE port.
    pub require_active_port: bool,
    /// Hand the `umad` devices over too (MAD tools such as `ibstat` in the pod).
    pub umad: bool,
}

/// Default resource of the RDMA kind.
pub const DEFAULT_RESOURCE: &str = "gpushare.io/rdma";

impl Default for RdmaConfig {
    fn default() -> RdmaConfig {
        RdmaConfig {
            enabled: false,
            resource: DEFAULT_RESOURCE.to_string(),
            shares_per_hca: 1,
            require_active_port: true,
            umad: true,
        }
    }
}

/// Why the RDMA configuration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RdmaConfigError {
    /// `shares_per_hca` is 0.
    #[error("devices.rdma.shares_per_hca must be at least 1")]
    ZeroShares,
    /// More shares than one ListAndWatch answer can carry sensibly.
    #[error("devices.rdma.shares_per_hca {0} is above {max}", max = MAX_SHARES)]
    TooManyShares(u32),
    /// The resource name is not an extended resource name.
    #[error("devices.rdma.resource: {0}")]
    Resource(#[from] crate::core::resource_name::ResourceNameError),
}

/// Most shares of one device (per HCA, per generic device).
pub const MAX_SHARES: u32 = 1024;

impl RdmaConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<(), RdmaConfigError> {
        crate::core::resource_name::check_resource_name(&self.resource)?;
        match self.shares_per_hca {
            0 => Err(RdmaConfigError::ZeroShares),
            n if n > MAX_SHARES => Err(RdmaConfigError::TooManyShares(n)),
            _ => Ok(()),
        }
    }
}

/// One `[[devices.generic]]` declaration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenericDeviceConfig {
    /// The extended resource (`example.com/fuse`).
    pub resource: String,
    /// The device nodes, by glob under `/dev`.
    pub paths: Vec<DevicePathConfig>,
    /// Pods that may hold one device at once.
    #[serde(default = "one")]
    pub shares: u32,
    /// Environment handed to a container with the device.
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    /// Host paths mounted into a container with the device.
    #[serde(default)]
    pub mounts: Vec<MountConfig>,
}

fn one() -> u32 {
    1
}

fn rw() -> String {
    "rw".to_string()
}

/// One device-node glob.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicePathConfig {
    /// Absolute glob under `/dev` (`*`, `?` and `[…]` within one path component).
    pub path: String,
    /// Where the node appears in the container [default: the host path]; only for a path
    /// without glob characters.
    #[serde(default)]
    pub container_path: Option<String>,
    /// Cgroup device permissions, one or more of `r`, `w`, `m`.
    #[serde(default = "rw")]
    pub permissions: String,
    /// The device exists without this node (several paths only).
    #[serde(default)]
    pub optional: bool,
}

/// A host path mounted into the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountConfig {
    /// Absolute host path.
    pub host_path: String,
    /// Absolute path in the container.
    pub container_path: String,
    /// Mount read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// Why a generic device declaration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenericConfigError {
    /// The resource name.
    #[error("devices.generic: {0}")]
    Resource(#[from] crate::core::resource_name::ResourceNameError),
    /// No `paths`.
    #[error("devices.generic {resource}: no paths")]
    NoPaths {
        /// The declaration.
        resource: String,
    },
    /// A path is not absolute under `/dev`, or climbs out of it.
    #[error(
        "devices.generic {resource}: path {path:?} must be an absolute path under /dev without '..'"
    )]
    PathNotUnderDev {
        /// The declaration.
        resource: String,
        /// The path.
        path: String,
    },
    /// Permissions other than one or more of `r`, `w`, `m`.
    #[error(
        "devices.generic {resource}: permissions {permissions:?} of {path} must be one or more of r, w, m"
    )]
    BadPermissions {
        /// The declaration.
        resource: String,
        /// The path.
        path: String,
        /// What was written.
        permissions: String,
    },
    /// `container_path` on a glob, or not absolute.
    #[error(
        "devices.generic {resource}: container_path {container_path:?} of {path}: only for a path without glob characters, and absolute"
    )]
    BadContainerPath {
        /// The declaration.
        resource: String,
        /// The path.
        path: String,
        /// What was written.
        container_path: String,
    },
    /// `optional` on the only path.
    #[error("devices.generic {resource}: optional needs more than one path")]
    OptionalAlone {
        /// The declaration.
        resource: String,
    },
    /// `shares` is 0 or too large.
    #[error("devices.generic {resource}: shares must be 1 to {max}, not {shares}", max = MAX_SHARES)]
    BadShares {
        /// The declaration.
        resource: String,
        /// What was written.
        shares: u32,
    },
    /// An environment variable name that is not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error("devices.generic {resource}: env name {name:?} is not [A-Za-z_][A-Za-z0-9_]*")]
    BadEnvName {
        /// The declaration.
        resource: String,
        /// The name.
        name: String,
    },
    /// A mount path that is not absolute.
    #[error(
        "devices.generic {resource}: mount paths must be absolute ({host_path:?} -> {container_path:?})"
    )]
    RelativeMount {
        /// The declaration.
        resource: String,
        /// Host path.
        host_path: String,
        /// Container path.
        container_path: String,
    },
}

/// Whether `s` has glob characters.
pub(crate) fn has_glob(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

impl GenericDeviceConfig {
    /// Checks the declaration.
    pub fn validate(&self) -> Result<(), GenericConfigError> {
        crate::core::resource_name::check_resource_name(&self.resource)?;
        let resource = || self.resource.clone();
        if self.paths.is_empty() {
            return Err(GenericConfigError::NoPaths {
                resource: resource(),
            });
        }
        if self.shares == 0 || self.shares > MAX_SHARES {
            return Err(GenericConfigError::BadShares {
                resource: resource(),
                shares: self.shares,
            });
        }
        for p in &self.paths {
            if relative_to_dev(&p.path).is_none() {
                return Err(GenericConfigError::PathNotUnderDev {
                    resource: resource(),
                    path: p.path.clone(),
                });
            }
            if p.permissions.is_empty() || !p.permissions.chars().all(|c| "rwm".contains(c)) {
                return Err(GenericConfigError::BadPermissions {
                    resource: resource(),
                    path: p.path.clone(),
                    permissions: p.permissions.clone(),
                });
            }
            if let Some(c) = &p.container_path
                && (has_glob(&p.path) || !c.starts_with('/'))
            {
                return Err(GenericConfigError::BadContainerPath {
                    resource: resource(),
                    path: p.path.clone(),
                    container_path: c.clone(),
                });
            }
            if p.optional && self.paths.len() == 1 {
                return Err(GenericConfigError::OptionalAlone {
                    resource: resource(),
                });
            }
        }
        for name in self.envs.keys() {
            let mut bytes = name.bytes();
            let first_ok = bytes
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
            if !first_ok || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(GenericConfigError::BadEnvName {
                    resource: resource(),
                    name: name.clone(),
                });
            }
        }
        for m in &self.mounts {
            if !m.host_path.starts_with('/') || !m.container_path.starts_with('/') {
                return Err(GenericConfigError::RelativeMount {
                    resource: resource(),
                    host_path: m.host_path.clone(),
                    container_path: m.container_path.clone(),
                });
            }
        }
        Ok(())
    }
}

/// `/dev/snd/*` as `snd/*`; `None` when not under `/dev` or climbing with `..`.
pub(crate) fn relative_to_dev(path: &str) -> Option<&str> {
    let rel = path.strip_prefix("/dev/")?;
    if rel.is_empty()
        || rel
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return None;
    }
    Some(rel)
}
