//! A throwaway cluster for tests and `gpushare demo` — never for production.
//!
//! - [`apiserver::ApiServer`]: an in-process Kubernetes API server over real HTTP with an
//!   in-memory store, a kubeconfig file, and fault injection.
//! - [`kubelet::Kubelet`]: a fake kubelet serving the device-plugin Registration service on a
//!   unix socket and driving a plugin as kubelet does (and, optionally, PodResources).
//! - [`dra_allocator::DraAllocator`]: what kube-scheduler and the resourceclaim controller do
//!   for DRA pods (claims from templates, upstream's structured-parameters allocation,
//!   binding, release).
//! - [`dra_cel`]: the CEL environment of DeviceClass and request selectors, on the `cel`
//!   crate; [`quantity`]: Kubernetes quantities, exactly.
//! - [`dra_kubelet::DraKubelet`]: a fake kubelet's DRA side: plugin registration on a
//!   registry directory, `NodePrepareResources` / `NodeUnprepareResources` (v1, else v1beta1)
//!   for its node's pods, `NodeWatchResources`.
//! - [`nvml_stub`]: builds a stub `libnvidia-ml.so.1` whose GPUs and XID events come from a
//!   file, for testing the NVML backend through nvml-wrapper.

pub mod apiserver;
pub mod dra_allocator;
pub mod dra_cel;
pub mod dra_kubelet;
pub mod kubelet;
pub mod nvml_stub;
pub mod quantity;
