//! Generated gRPC code for the kubelet APIs gpushare speaks (see `proto/README.md`):
//! the device plugin API v1beta1 and the pod resources API v1.
//!
//! Low in the house: the device plugin and the sandbox kubelet both build on it. Hand-written
//! beyond the module wrappers and a few constants: [`unix_server`], the one way these APIs
//! are served on a unix socket (it accepts the socket path as `:authority`, as kubelet
//! 1.11-1.25 sends it).

/// Kubelet device plugin API v1beta1 (`Registration`, `DevicePlugin`).
#[allow(clippy::all, missing_docs)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}

/// Kubelet pod resources API v1 (`PodResourcesLister`).
#[allow(clippy::all, missing_docs)]
pub mod podresources {
    tonic::include_proto!("v1");
}

#[cfg(unix)]
pub mod unix_server;

/// kubelet's default gRPC receive limit for ListAndWatch messages (4 MiB).
pub const KUBELET_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
