//! The DRA path (`resource.k8s.io/v1`): the pure pieces of the `gpushare dra-plugin` role
//! and of the webhook's DRA mode.
//!
//! - [`slices`]: the ResourceSlice of a node (one device per served GPU, consumable `memory`,
//!   attributes, taints of unhealthy GPUs, device order by the GPU policy) and the pool
//!   generation that moves on every change;
//! - [`claims`]: what an allocated ResourceClaim gives this node's driver (device, share id,
//!   consumed memory), with a typed error per claim;
//! - [`checkpoint`]: the prepared claims, kept in a JSON file written atomically, so that
//!   `NodeUnprepareResources` works after a restart and after the claim is gone;
//! - [`rewrite`]: the webhook's DRA rewrite of an `aliyun.com/gpu-mem` pod into one claim
//!   from a ResourceClaimTemplate, one request per GPU container, all on one GPU.
//!
//! What is not here yet: the kubelet plugin server (registration, `DRAPlugin`,
//! `DRAResourceHealth`), publishing slices through the API, the CDI specs of prepared claims
//! (the node agent's container contract and CDI writer), and the flags of the role. Nothing
//! here performs network I/O; [`checkpoint`] and [`slices::pcie_root`] touch local files.

pub mod checkpoint;
pub mod claims;
pub mod rewrite;
pub mod slices;
