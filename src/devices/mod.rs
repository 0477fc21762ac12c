//! Device kinds beside the GPU: their configuration ([`DevicesConfig`], `[devices]` of the
//! configuration file, defined in [`crate::config::devices`]), generic devices declared there ([`generic`]), and the hand-over
//! of a pod's devices of either kind to its container ([`handover`]). RDMA HCAs are
//! discovered by [`crate::rdma`].
//!
//! What lives here is pure or reads only files: it registers no device plugin, publishes no
//! DRA device and talks to no API server. The node agent, the device plugin (one extended
//! resource per kind) and the DRA plugin are wired onto these pieces.

pub mod generic;
pub mod handover;

use crate::rdma::Roots;

pub use crate::config::devices::{DevicesConfig, DevicesConfigError};

/// `--sysfs-root` / `--dev-root`: where the host's sysfs and `/dev` are read (the one
/// definition `gpushare device-plugin` and `gpushare doctor` flatten).
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize)]
pub struct RootArgs {
    /// The host's /sys as gpushare sees it (a recorded tree in tests) [default:
    /// devices.sysfs_root, /sys; doctor: <root>/sys]
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<std::path::PathBuf>,
    /// The host's /dev as gpushare sees it [default: devices.dev_root, /dev; doctor: <root>/dev]
    #[arg(long, value_name = "DIR")]
    pub dev_root: Option<std::path::PathBuf>,
}

impl RootArgs {
    /// The flags as overrides of `devices.sysfs_root` / `devices.dev_root`.
    pub fn overrides(&self, flags: &mut crate::config::FlagOverrides) {
        flags.args("devices", self);
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

pub use crate::core::resource_name::{RESERVED_RESOURCES, ResourceNameError, check_resource_name};
