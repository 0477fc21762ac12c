//! Allocate and GetPreferredAllocation: find the pod the container belongs to
//! ([`matching`](super::matching)), answer with its GPU's envs, and record the progress on the
//! pod.
//!
//! Success envs (spec §2.3): `NVIDIA_VISIBLE_DEVICES` (NVML index, or UUID with
//! `--visible-devices uuid`), `ALIYUN_COM_GPU_MEM_IDX`, `_POD` (the pod's total), `_CONTAINER`,
//! `_DEV` (that GPU's units), `CGPU_DISABLE=true` when the node label asks for it; with `--mps`
//! also `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` (the container sees its one GPU as device
//! 0), `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PIPE_DIRECTORY` with the pipe
//! directory mounted.
//!
//! The answer is then shaped by the `--device-list-strategy` ([`handover`](super::handover):
//! env, volume mounts, CDI annotations or CDI devices, device specs).
//!
//! After a match the pod is merge-patched (`gpushare.io/allocated-containers`, and ASSIGNED=true
//! with the allocation time once its last GPU container is served). Transient API errors are
//! retried; if the patch still fails the call fails, so no GPU is handed out that the API does
//! not know about. No match: on a one-GPU node the upstream fallback (that GPU, no patch);
//! otherwise the upstream failure envs or, with `--allocate-failure error`, a gRPC error that
//! names the pods considered; either way a Warning Event on the node.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::Status;

use super::matching::{self, Match};
use super::node;
use super::{AllocationRecord, Plugin, RECORDS_KEPT};
use crate::config::{AllocateFailure, VisibleDevices};
use crate::core::wire::{
    ENV_CGPU_DISABLE, ENV_CONTAINER_MEM, ENV_DEVICE_MEM, ENV_GPU_INDEX,
    ENV_MPS_ACTIVE_THREAD_PERCENTAGE, ENV_MPS_PINNED_MEM_LIMIT, ENV_MPS_PIPE_DIRECTORY,
    ENV_POD_MEM, ENV_VISIBLE_DEVICES,
};
use crate::core::{GpuMem, PodGpuAnnotations};
use crate::k8s::retry::retry_attempts;
use crate::k8s::write::now_ns;
use crate::kubelet_api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Mount, PreferredAllocationRequest,
    PreferredAllocationResponse,
};

/// How long Allocate waits for the first pod list after a (re)start.
const SYNC_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Attempts of the pod patch on transient errors.
const PATCH_ATTEMPTS: u32 = 4;

impl Plugin {
    fn base_envs(
        &self,
        visible: String,
        index: String,
        pod: GpuMem,
        container: GpuMem,
        dev: GpuMem,
    ) -> HashMap<String, String> {
        let mut envs = HashMap::from([
            (ENV_VISIBLE_DEVICES.to_string(), visible),
            (ENV_GPU_INDEX.to_string(), index),
            (ENV_POD_MEM.to_string(), pod.to_string()),
            (ENV_CONTAINER_MEM.to_string(), container.to_string()),
            (ENV_DEVICE_MEM.to_string(), dev.to_string()),
        ]);
        if self.cgpu_disable {
            envs.insert(ENV_CGPU_DISABLE.to_string(), "true".to_string());
        }
        envs
    }

    /// The response that gives a container `units` of GPU `index`.
    fn grant(
        &self,
        index: u32,
        visible_uuid: bool,
        pod_total: GpuMem,
        units: GpuMem,
    ) -> ContainerAllocateResponse {
        let Some(gpu) = self.gpu_by_index(index) else {
            return ContainerAllocateResponse::default();
        };
        let visible = if visible_uuid {
            gpu.uuid.clone()
        } else {
            index.to_string()
        };
        let mut envs = self.base_envs(visible, index.to_string(), pod_total, units, gpu.units);
        let mut mounts = Vec::new();
        if self.config.mps {
            let mib = self.config.memory_unit.to_mib(units);
            envs.insert(ENV_MPS_PINNED_MEM_LIMIT.to_string(), format!("0={mib}M"));
            if self.config.mps_active_thread_percentage > 0 {
                envs.insert(
                    ENV_MPS_ACTIVE_THREAD_PERCENTAGE.to_string(),
                    self.config.mps_active_thread_percentage.to_string(),
                );
            }
            let dir = self.config.mps_pipe_dir.display().to_string();
            envs.insert(ENV_MPS_PIPE_DIRECTORY.to_string(), dir.clone());
            mounts.push(Mount {
                container_path: dir.clone(),
                host_path: dir,
                read_only: false,
            });
        }
        ContainerAllocateResponse {
            envs,
            mounts,
            ..ContainerAllocateResponse::default()
        }
    }

    /// The upstream failure answer: `no-gpu-has-<N><unit>-to-run`, IDX -1.
    fn failure_envs(&self, units: GpuMem) -> ContainerAllocateResponse {
        let dev = self.gpus.first().map(|g| g.units).unwrap_or_default();
        let visible = format!(
            "no-gpu-has-{}-to-run",
            self.config.memory_unit.format_amount(units)
        );
        ContainerAllocateResponse {
            envs: self.base_envs(visible, "-1".to_string(), units, units, dev),
            ..ContainerAllocateResponse::default()
        }
    }

    /// Matches from the store; on a miss, catches up with one LIST and tries again.
    async fn find_match(&self, units: GpuMem) -> Result<Match, Vec<matching::NotMatched>> {
        let known = |i: u32| self.gpu_by_index(i).is_some();
        match matching::find_match(&self.pods.snapshot(), units, known) {
            Ok(m) => Ok(m),
            Err(_) => {
                if let Err(e) = self.pods.refresh(&self.client, &self.node).await {
                    tracing::debug!(error = %e, "pod refresh after a miss failed");
                }
                matching::find_match(&self.pods.snapshot(), units, known)
            }
        }
    }

    /// Merge-patches the pod after serving `m`; returns the updated pod into the store.
    async fn record_on_pod(&self, m: &Match) -> Result<(), kube::Error> {
        let patch = PodGpuAnnotations::allocated_patch(&m.allocated_after, m.complete, now_ns());
        let pod = retry_attempts(PATCH_ATTEMPTS, || {
            crate::k8s::write::patch_pod_annotations(&self.client, &m.namespace, &m.name, &patch)
        })
        .await?;
        self.pods.apply(&pod);
        Ok(())
    }

    /// Serves one Allocate call, container by container, under the allocation lock.
    pub(crate) async fn allocate(
        self: &Arc<Self>,
        request: AllocateRequest,
    ) -> Result<AllocateResponse, Status> {
        let started = std::time::Instant::now();
        let mut records = self.allocations.lock().await;
        if !self.pods.wait_synced(SYNC_WAIT).await {
            return Err(Status::unavailable(
                "the device plugin has not listed this node's pods yet; retry",
            ));
        }
        let visible_uuid = self.config.visible_devices == VisibleDevices::Uuid;
        let mut responses = Vec::with_capacity(request.container_requests.len());
        let mut result = Ok(());
        for creq in &request.container_requests {
            let units = GpuMem::new(creq.devices_ids.len() as u64);
            match self.find_match(units).await {
                Ok(m) => {
                    let base = self.grant(m.gpu_index, visible_uuid, m.pod_total, units);
                    let response = match self.hand_over(Some(m.gpu_index), base).await {
                        Ok(r) => r,
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    };
                    if let Err(e) = self.record_on_pod(&m).await {
                        self.metrics.allocation("patch_failed");
                        let msg = format!(
                            "matched pod {}/{} container {:?} to GPU {}, but recording it on the \
                             pod failed: {e}; not handing out a GPU the API does not know about",
                            m.namespace, m.name, m.container, m.gpu_index
                        );
                        tracing::error!("{msg}");
                        result = Err(Status::unavailable(msg));
                        break;
                    }
                    tracing::info!(
                        pod = format!("{}/{}", m.namespace, m.name),
                        container = m.container,
                        gpu = m.gpu_index,
                        units = units.units(),
                        complete = m.complete,
                        "allocated"
                    );
                    self.metrics.allocation("matched");
                    responses.push(response);
                    records.push_back(AllocationRecord {
                        device_ids: creq.devices_ids.clone(),
                        gpu_index: m.gpu_index,
                        namespace: m.namespace.clone(),
                        name: m.name.clone(),
                        container: m.container.clone(),
                    });
                    while records.len() > RECORDS_KEPT {
                        records.pop_front();
                    }
                }
                Err(rejected) if self.gpus.len() == 1 => {
                    let gpu = &self.gpus[0];
                    tracing::info!(
                        units = units.units(),
                        considered = rejected.len(),
                        "no pod matched; single-GPU node: giving its only GPU (upstream fallback)"
                    );
                    self.metrics.allocation("single_gpu_fallback");
                    let base = self.grant(gpu.index, true, units, units);
                    match self.hand_over(Some(gpu.index), base).await {
                        Ok(r) => responses.push(r),
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                Err(rejected) => {
                    self.metrics.allocation("no_candidate");
                    let amount = self.config.memory_unit.format_amount(units);
                    let why = matching::explain(&amount, &rejected);
                    tracing::warn!("Allocate: {why}");
                    let plugin = self.clone();
                    let event_msg = format!("Allocate of {amount} failed: {why}");
                    tokio::spawn(async move {
                        node::warn_event(
                            &plugin.events,
                            &plugin.node,
                            &plugin.node_uid,
                            "Allocate",
                            "GpuShareAllocateFailed",
                            &event_msg,
                        )
                        .await;
                    });
                    match self.config.allocate_failure {
                        AllocateFailure::Env => {
                            let refusal = self.hand_over(None, self.failure_envs(units)).await;
                            match refusal {
                                Ok(r) => responses.push(r),
                                Err(e) => {
                                    result = Err(e);
                                    break;
                                }
                            }
                        }
                        AllocateFailure::Error => {
                            result = Err(Status::failed_precondition(why));
                            break;
                        }
                    }
                }
            }
        }
        drop(records);
        self.reconcile_now.notify_one();
        self.metrics
            .allocate_seconds
            .observe(started.elapsed().as_secs_f64());
        result.map(|()| AllocateResponse {
            container_responses: responses,
        })
    }

    /// Prefers device IDs of the GPU of the pod the next Allocate of this size will match, so
    /// kubelet's checkpoint and PodResources name the real GPU.
    pub(crate) async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> PreferredAllocationResponse {
        let _serialised = self.allocations.lock().await;
        let _ = self.pods.wait_synced(SYNC_WAIT).await;
        let mut container_responses = Vec::with_capacity(request.container_requests.len());
        for creq in &request.container_requests {
            let size = usize::try_from(creq.allocation_size.max(0)).unwrap_or(0);
            let units = GpuMem::new(size as u64);
            let target = self
                .find_match(units)
                .await
                .ok()
                .and_then(|m| self.gpu_by_index(m.gpu_index))
                .map(|g| g.uuid.as_str());
            let ids = matching::preferred_ids(
                &creq.available_device_i_ds,
                &creq.must_include_device_i_ds,
                size,
                target,
            );
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        PreferredAllocationResponse {
            container_responses,
        }
    }
}
