//! The DRA path (`resource.k8s.io/v1`): the pieces of the `gpushare dra-plugin` role and of
//! the webhook's DRA mode.
//!
//! - [`slices`]: the ResourceSlice of a node (one device per served GPU, consumable `memory`,
//!   attributes, taints of unhealthy GPUs, device order by the GPU policy) and the pool
//!   generation that moves on every change;
//! - [`kinds`]: the node's other device kinds (RDMA HCAs, generic devices) as devices of the
//!   same slice, with the standard PCIe and NUMA attributes, and their hand-over;
//! - [`claims`]: what an allocated ResourceClaim gives this node's driver (device, share id,
//!   consumed memory), with a typed error per claim;
//! - [`checkpoint`]: the prepared claims, kept in a JSON file written atomically, so that
//!   `NodeUnprepareResources` works after a restart and after the claim is gone;
//! - [`plugin`]: the kubelet plugin's gRPC side (registration, `DRAPlugin` v1/v1beta1,
//!   `DRAResourceHealth` v1/v1alpha1) with checkpointed, idempotent prepare and unprepare;
//!   what containers get is left to a [`plugin::Preparer`];
//! - [`publish`]: one reconciling pass that makes the API hold exactly the node's slices;
//! - [`prepare`]: the [`plugin::Preparer`] that writes one transient CDI spec per claim from
//!   the node agent's container contract;
//! - [`claim_watch`]: the claims allocated on the node's pool followed, the memory each device
//!   holds;
//! - [`role`]: the `gpushare dra-plugin` role: the node agent's GPUs offered on the DRA path,
//!   the plugin served, the slice republished on every change of health or use;
//!
//! The rewrite of an `aliyun.com/gpu-mem` pod into one claim is the webhook's policy (its DRA
//! mode, `webhook::dra_rewrite`); this role serves the claims it makes.
//!
//! What is not here: the webhook's DRA mode (the webhook role). [`plugin`],
//! [`publish`] and [`role`] perform network I/O (serving kubelet, reading claims, writing
//! slices); [`checkpoint`] and [`prepare`] touch local files.

pub mod checkpoint;
#[cfg(unix)]
pub mod claim_watch;
pub mod claims;
pub mod kinds;
pub mod metrics;
// Unix sockets only (the kubelet plugin API is served on them); the Windows kubectl plugin
// build leaves it out.
#[cfg(unix)]
pub mod plugin;
#[cfg(unix)]
pub mod prepare;
pub mod publish;
#[cfg(unix)]
pub mod role;
pub mod slices;
