//! The device kinds beside the GPU on the device-plugin path: each kind the node agent holds
//! ([`crate::node::kinds`]: RDMA HCAs, each generic declaration) is its own extended resource,
//! served on its own socket `<dir>/gpushare-<resource>.sock` (`/` as `_`) and registered
//! through the same loop as the GPU resource ([`super::registration`]), re-registered after a
//! kubelet restart.
//!
//! - ListAndWatch: one fake device `<device>-_-<n>` per share, all `Healthy`;
//! - Allocate: per container, the hand-over of exactly the devices its ids name
//!   ([`crate::devices::handover`]: device nodes, mounts, environment); an id naming no device
//!   of the kind is an `InvalidArgument` error, never mapped to another device;
//! - GetPreferredAllocation: for RDMA, the HCAs nearest the GPU of the pod being admitted
//!   ([`crate::rdma::preferred_allocation`]); kubelet does not say which pod it asks for, so
//!   the pod is guessed from the pod watch ([`pod_gpu`]); advice only, it never refuses.
//!
//! It does not match an Allocate to a pod (a kind's devices carry no per-pod state), write pod
//! annotations or follow health.

use std::sync::Arc;

use tokio::sync::watch;
use tonic::Status;

use super::Plugin;
use super::matching::PodSnapshot;
use super::service::Endpoint;
use crate::core::wire::HEALTHY;
use crate::devices::handover::HandOverError;
use crate::kubelet_api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    ListAndWatchResponse, PreferredAllocationRequest, PreferredAllocationResponse,
};
use crate::node::kinds::{DeviceKind, KindDevices};

/// The socket a kind serving `resource` listens on, inside the device-plugin dir:
/// `gpushare-gpushare.io_rdma.sock`.
pub fn socket_name(resource: &str) -> String {
    format!("gpushare-{}.sock", resource.replace('/', "_"))
}

/// One device kind served to kubelet.
#[derive(Debug)]
pub(crate) struct KindPlugin {
    /// The GPU plugin: device-plugin dir, pod store, node agent.
    pub(crate) gpu: Arc<Plugin>,
    /// The kind.
    pub(crate) kind: DeviceKind,
    devices_tx: watch::Sender<Arc<ListAndWatchResponse>>,
}

impl KindPlugin {
    /// The kind's plugin, its device list built.
    pub(crate) fn new(gpu: Arc<Plugin>, kind: DeviceKind) -> KindPlugin {
        let devices = kind
            .share_ids()
            .into_iter()
            .map(|id| Device {
                id,
                health: HEALTHY.to_string(),
                topology: None,
            })
            .collect();
        let (devices_tx, _) = watch::channel(Arc::new(ListAndWatchResponse { devices }));
        KindPlugin {
            gpu,
            kind,
            devices_tx,
        }
    }

    /// [`pod_gpu`] over the pod watch; on a miss, once more after reading the node's pods
    /// (the pod kubelet admits may be newer than the watch).
    async fn pod_gpu(&self, count: u64) -> Option<u32> {
        let find = || {
            self.gpu
                .pods
                .with_pods(|pods| pod_gpu(pods, &self.kind.resource, count))
        };
        if let Some(g) = find() {
            return Some(g);
        }
        let agent = &self.gpu.agent;
        if let Err(e) = self
            .gpu
            .pods
            .refresh(agent.client(), agent.node_name())
            .await
        {
            tracing::debug!(error = %e, "pod refresh after a miss failed");
        }
        find()
    }

    /// Allocate: each container gets exactly the devices its ids name.
    fn hand_over(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let mut container_responses = Vec::with_capacity(request.container_requests.len());
        for creq in &request.container_requests {
            let handed = self.kind.hand_over(&creq.devices_ids).map_err(|e| {
                tracing::warn!(resource = %self.kind.resource, error = %e, "Allocate refused");
                match e {
                    HandOverError::UnknownDevice { .. } => {
                        Status::invalid_argument(format!("{}: {e}", self.kind.resource))
                    }
                    _ => Status::failed_precondition(format!("{}: {e}", self.kind.resource)),
                }
            })?;
            tracing::info!(
                resource = %self.kind.resource,
                ids = ?creq.devices_ids,
                devices = ?handed.devices.iter().map(|d| d.host_path.as_str()).collect::<Vec<_>>(),
                "allocated"
            );
            container_responses.push(handed.to_allocate_response());
        }
        Ok(AllocateResponse {
            container_responses,
        })
    }

    /// GetPreferredAllocation: for RDMA, the HCAs nearest the GPU of the pod being admitted.
    async fn nearest(&self, request: PreferredAllocationRequest) -> PreferredAllocationResponse {
        let mut container_responses = Vec::with_capacity(request.container_requests.len());
        for creq in &request.container_requests {
            let size = usize::try_from(creq.allocation_size.max(0)).unwrap_or(0);
            let gpu = match &self.kind.devices {
                KindDevices::Rdma { .. } => self.pod_gpu(size as u64).await,
                KindDevices::Generic { .. } => None,
            };
            let place = gpu.and_then(|g| self.gpu.agent.device_kinds().gpu_places.get(&g));
            let picks = self.kind.preferred(
                place,
                &creq.available_device_i_ds,
                &creq.must_include_device_i_ds,
                size,
            );
            if let Some(g) = gpu {
                tracing::info!(
                    resource = %self.kind.resource,
                    gpu = g,
                    picks = ?picks.iter().map(|(id, p)| format!("{id} ({})", p.name())).collect::<Vec<_>>(),
                    "preferred the devices nearest the pod's GPU"
                );
            }
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: picks.into_iter().map(|(id, _)| id).collect(),
            });
        }
        PreferredAllocationResponse {
            container_responses,
        }
    }
}

/// The gpushare GPU (its index) of the pod kubelet is most likely admitting with `count` of
/// `resource`: among this node's pods that are not finished, hold a GPU from the extender
/// (`ALIYUN_COM_GPU_MEM_IDX`) and have a container asking exactly `count` of `resource`, a
/// pod whose GPU is not handed over yet (`ASSIGNED=false`) first, the oldest assume time
/// first; then the pod assumed last (its GPU was just handed over). `None`: no such pod.
pub(crate) fn pod_gpu<'a>(
    pods: impl Iterator<Item = &'a PodSnapshot>,
    resource: &str,
    count: u64,
) -> Option<u32> {
    let mut candidates: Vec<&PodSnapshot> = pods
        .filter(|p| !p.terminal && p.annotations.gpu_index.is_some())
        .filter(|p| p.extended.iter().any(|(r, n)| r == resource && *n == count))
        .collect();
    candidates.sort_by(|a, b| {
        let pending = |p: &PodSnapshot| p.annotations.assigned != Some(false);
        let t = |p: &PodSnapshot| p.annotations.assume_time_ns.unwrap_or(0);
        pending(a)
            .cmp(&pending(b))
            .then_with(|| {
                if pending(a) {
                    t(b).cmp(&t(a))
                } else {
                    t(a).cmp(&t(b))
                }
            })
            .then_with(|| a.key().cmp(&b.key()))
    });
    candidates.first().and_then(|p| p.annotations.gpu_index)
}

impl Endpoint for KindPlugin {
    fn plugin(&self) -> &Plugin {
        &self.gpu
    }

    fn socket_name(&self) -> String {
        socket_name(&self.kind.resource)
    }

    fn resource(&self) -> String {
        self.kind.resource.clone()
    }

    fn set_registered(&self, registered: bool) {
        if !registered {
            tracing::info!(resource = %self.kind.resource, "not registered with kubelet any more");
        }
    }

    fn devices(&self) -> &watch::Sender<Arc<ListAndWatchResponse>> {
        &self.devices_tx
    }

    async fn allocate(
        self: &Arc<Self>,
        request: AllocateRequest,
    ) -> Result<AllocateResponse, Status> {
        self.hand_over(request)
    }

    async fn preferred_allocation(
        self: &Arc<Self>,
        request: PreferredAllocationRequest,
    ) -> PreferredAllocationResponse {
        self.nearest(request).await
    }
}
