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

/// Resource names no device kind may take: gpushare's own and NVIDIA's GPU resources.
pub const RESERVED_RESOURCES: &[&str] = &[
    crate::core::wire::RESOURCE_GPU_MEM,
    crate::core::wire::RESOURCE_GPU_COUNT,
    "nvidia.com/gpu",
];

/// Why a resource name is not a usable extended resource name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceNameError {
    /// No `domain/` prefix.
    #[error("{0:?} has no domain: write it as <domain>/<name>, e.g. example.com/fuse")]
    NoDomain(String),
    /// The domain is not a DNS subdomain, or is kubernetes.io's.
    #[error("{0:?}: the domain must be a DNS subdomain outside kubernetes.io")]
    BadDomain(String),
    /// The name part is empty, too long or has other characters than `[A-Za-z0-9._-]`.
    #[error(
        "{0:?}: the name after the domain must be 1-63 of [A-Za-z0-9._-], starting and ending alphanumeric"
    )]
    BadName(String),
    /// One of [`RESERVED_RESOURCES`].
    #[error("{0} is a GPU resource; pick another name")]
    Reserved(String),
}

/// Checks `name` is an extended resource name a device kind may register.
pub fn check_resource_name(name: &str) -> Result<(), ResourceNameError> {
    if RESERVED_RESOURCES.contains(&name) {
        return Err(ResourceNameError::Reserved(name.to_string()));
    }
    let (domain, rest) = name
        .split_once('/')
        .ok_or_else(|| ResourceNameError::NoDomain(name.to_string()))?;
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if domain.len() > 253
        || !domain.split('.').all(label_ok)
        || domain == "kubernetes.io"
        || domain.ends_with(".kubernetes.io")
    {
        return Err(ResourceNameError::BadDomain(name.to_string()));
    }
    let alnum = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    if rest.is_empty()
        || rest.len() > 63
        || !rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        || !alnum(rest.bytes().next())
        || !alnum(rest.bytes().last())
    {
        return Err(ResourceNameError::BadName(name.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names_are_checked() {
        assert_eq!(check_resource_name("example.com/fuse"), Ok(()));
        assert_eq!(check_resource_name("gpushare.io/rdma"), Ok(()));
        assert!(matches!(
            check_resource_name("fuse"),
            Err(ResourceNameError::NoDomain(_))
        ));
        assert!(matches!(
            check_resource_name("Example.com/x"),
            Err(ResourceNameError::BadDomain(_))
        ));
        assert!(matches!(
            check_resource_name("kubernetes.io/x"),
            Err(ResourceNameError::BadDomain(_))
        ));
        assert!(matches!(
            check_resource_name("example.com/"),
            Err(ResourceNameError::BadName(_))
        ));
        assert!(matches!(
            check_resource_name("example.com/a b"),
            Err(ResourceNameError::BadName(_))
        ));
        assert!(matches!(
            check_resource_name("aliyun.com/gpu-mem"),
            Err(ResourceNameError::Reserved(_))
        ));
        assert!(matches!(
            check_resource_name("nvidia.com/gpu"),
            Err(ResourceNameError::Reserved(_))
        ));
    }
}
