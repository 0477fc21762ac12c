//! The pure domain of gpushare: memory units, every wire name, the pod-annotation codec, a
//! pod's GPU request, the per-node ledger and placement.
//!
//! Nothing here performs I/O or imports kube, k8s-openapi, hyper, tonic or NVML: the
//! allocation rules can be read, reviewed and property-tested on their own. The extender,
//! the device plugin and `inspect` all build on these types, so they agree by construction.

pub mod annotations;
pub mod holding;
pub mod ledger;
pub mod memory;
pub mod placement;
pub mod request;
pub mod resource_name;
pub mod wire;

#[cfg(test)]
mod proptests;

pub use annotations::{AnnotationError, BindReservation, PodGpuAnnotations};
pub use holding::pod_holding;
pub use ledger::{GpuSpec, LedgerPod, NodeLedger, PodState};
pub use memory::{GpuMem, MemoryUnit, UnitError};
pub use placement::{GpuPolicy, NoFit, NodePolicy};
pub use request::{ContainerGpuRequest, PodGpuRequest, QuantityError, parse_whole_quantity};
