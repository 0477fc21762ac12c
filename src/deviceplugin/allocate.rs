//! Allocate and GetPreferredAllocation: find the pod the container belongs to
//! ([`matching`](super::matching)), answer with its GPU's envs, and record the progress on the
//! pod.
//!
//! What a container is handed (the `ALIYUN_COM_GPU_MEM_*` envs, `NVIDIA_VISIBLE_DEVICES`, the
//! MPS envs and mounts, the strategy's mounts, device specs and CDI names) is the node's
//! container contract ([`crate::node::contract`]); this module turns it into the Allocate
//! answer. While the MPS daemon does not serve, every Allocate is refused with a gRPC error
//! that says why and what to do: no container starts without its limit.
//!
//! A container is claimed in the [`Records`](super::records::Records) (keyed by pod UID) the
//! moment it is matched, under a mutex held for that in-memory step only. The answer is then
//! made durable on the node ([`super::journal`], one small file on tmpfs) and returned: the
//! pod's annotations (`gpushare.io/allocated-containers`, and ASSIGNED=true with the
//! allocation time once its last GPU container is served) are written after, in the
//! background, with retries until the API server takes them ([`super::writeback`]). So
//! Allocate never waits on the API server: a slow or unreachable one delays only the
//! annotations, and a plugin that stops in between finishes the write at its next start,
//! where the journal's containers count as answered before kubelet can ask for another.
//! Without a usable state directory, the pod is merge-patched before the answer, under that
//! pod's own lock (a slow PATCH holds up no other pod), within the Allocate deadline
//! ([`ALLOCATE_DEADLINE`]): a PATCH the API refused fails the call and drops the claim; one
//! whose outcome is unknown fails the call but keeps the claim.
//!
//! kubelet may ask again for a container it was answered before (a restart before its
//! checkpoint, a cancelled call): the same device IDs find their record (trusted only after a
//! fresh pod list: kubelet reuses the IDs of deleted pods); other IDs find the
//! latest served container of that size that kubelet's PodResources shows no devices for
//! ([`matching::find_repeat`]). Either way the same GPU is answered.
//!
//! The answer is shaped by the `--device-list-strategy` (the contract's
//! [`hand_over`](crate::node::contract::hand_over): env, volume mounts, CDI annotations or CDI
//! devices, device specs) before the pod is patched, so a GPU without its CDI device never
//! marks the pod; with a CDI strategy the node's CDI specs are read at every Allocate.
//!
//! Under driver enforcement ([`crate::node::enforcement`]) each GPU answer also names the limit
//! device `gpushare.io/memory-limit=<uuid>_<bytes>` (its spec, carrying the hook that sets the
//! container's limit, written first: a spec that cannot be written fails the call) and carries
//! NVIDIA's `NVIDIA_GPU_MEMORY_REQUEST/LIMIT`. Under the CUDA memory limiter each answer gets
//! the limiter's mounts instead ([`super::limiter`]).
//!
//! No match: on a one-GPU node the upstream fallback (that GPU, no patch); otherwise the
//! upstream failure envs or, with `--allocate-failure error`, a gRPC error that names the pods
//! considered; either way a Warning Event on the node.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Status;

use super::matching::{self, Match, NotMatched};
use super::records::PodId;
use super::{Plugin, reconcile};
use crate::config::{AllocateFailure, VisibleDevices};
use crate::core::{GpuMem, PodGpuAnnotations};
use crate::gpu::cdi::Registry;
use crate::k8s::retry::{RetryError, retry_until};
use crate::k8s::write::now_ns;
use crate::kubelet_api::deviceplugin::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, DeviceSpec, Mount, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use crate::node::api::bounded;
use crate::node::contract::{self, ContainerEdits, Target};
use crate::node::enforcement::Mechanism;
use crate::node::paths::ServingPath;

/// How long one Allocate may take in all (waiting for the pod list, the PATCH and its
/// retries); kubelet turns a failed Allocate into a Failed pod, so this is generous.
pub(crate) const ALLOCATE_DEADLINE: Duration = Duration::from_secs(8);
/// How long Allocate waits for the watch's first pod list before it reads the API itself
/// (registration waits for that list, so this is for the unexpected).
const SYNC_WAIT: Duration = Duration::from_secs(2);

/// How a container's request was matched.
enum Choice {
    /// A pod's next container (`repeat`: one answered before, asked again).
    Matched { m: Match, seq: u64, repeat: bool },
    /// Nothing waits for this size.
    Unmatched(Vec<NotMatched>),
}

/// Why recording an allocation on the pod did not succeed.
struct NotRecorded {
    message: String,
    unknown: bool,
}

/// The contract's container edits as a device plugin container answer.
fn allocate_response(edits: ContainerEdits) -> ContainerAllocateResponse {
    ContainerAllocateResponse {
        envs: edits.envs,
        mounts: edits
            .mounts
            .into_iter()
            .map(|m| Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: m.read_only,
            })
            .collect(),
        devices: edits
            .device_nodes
            .into_iter()
            .map(|path| DeviceSpec {
                container_path: path.clone(),
                host_path: path,
                permissions: "rw".to_string(),
            })
            .collect(),
        annotations: edits.annotations,
        cdi_devices: edits
            .cdi_devices
            .into_iter()
            .map(|name| CdiDevice { name })
            .collect(),
    }
}

impl Plugin {
    /// The envvar answer that gives a container `units` of GPU `index`.
    fn grant(
        &self,
        index: u32,
        visible_uuid: bool,
        pod_total: GpuMem,
        units: GpuMem,
    ) -> ContainerEdits {
        let Some(gpu) = self.gpu_by_index(index) else {
            return ContainerEdits::default();
        };
        contract::grant(
            self.agent.config(),
            self.agent.traits(),
            gpu,
            visible_uuid,
            pod_total,
            units,
        )
    }

    /// The upstream failure answer: `no-gpu-has-<N><unit>-to-run`, IDX -1.
    fn failure_envs(&self, units: GpuMem) -> ContainerEdits {
        let dev = self.gpus.first().map(|g| g.units).unwrap_or_default();
        contract::refusal(self.agent.config(), self.agent.traits(), dev, units)
    }

    /// The strategy's answer for one container (the contract's hand-over): reads the CDI
    /// specs off the runtime when a CDI strategy is on; a failure is logged, announced as a
    /// Warning Event on the node and returned as FailedPrecondition.
    pub(crate) async fn hand_over(
        &self,
        gpu_index: Option<u32>,
        base: ContainerEdits,
    ) -> Result<ContainerAllocateResponse, Status> {
        let node = self.agent.config();
        let specs = if node.device_list_strategy.any_cdi() && gpu_index.is_some() {
            let dirs: Vec<PathBuf> = node.cdi_spec_dirs.clone();
            let read = tokio::task::spawn_blocking(move || Registry::read(Path::new("/"), &dirs));
            Some(read.await.map_err(|e| {
                Status::internal(format!("reading the CDI specs did not finish: {e}"))
            })?)
        } else {
            None
        };
        let target = match gpu_index.and_then(|i| self.gpu_by_index(i)) {
            Some(gpu) => Target::Gpu(gpu),
            None => Target::Refusal,
        };
        match contract::hand_over(node, specs.as_ref(), target, base) {
            Ok(edits) => Ok(allocate_response(edits)),
            Err(e) => {
                let msg = e.to_string();
                tracing::error!("Allocate: {msg}");
                self.metrics.allocation("handover_failed");
                self.agent
                    .events()
                    .warn_soon("Allocate", "GpuShareNoCdiDevice", msg.clone());
                Err(Status::failed_precondition(msg))
            }
        }
    }

    /// Under driver enforcement, adds the limit device for `units` of GPU `gpu_index` (its spec
    /// written first) and NVIDIA's envs to `response`; a spec that cannot be written fails the
    /// call, so no container starts without its limit.
    async fn enforce(
        &self,
        gpu_index: u32,
        units: GpuMem,
        pod: Option<&Match>,
        device_ids: &[String],
        mut response: ContainerAllocateResponse,
    ) -> Result<ContainerAllocateResponse, Status> {
        let enforcer = self.agent.enforcement().clone();
        let Some(gpu) = self.gpu_by_index(gpu_index) else {
            return Ok(response);
        };
        let bytes = self.agent.unit().to_bytes(units);
        match enforcer.mechanism(ServingPath::DevicePlugin) {
            Mechanism::Driver => {}
            Mechanism::Limiter => {
                return self
                    .limiter_mounts(gpu, bytes, pod, device_ids, response)
                    .await;
            }
            Mechanism::Mps | Mechanism::None => return Ok(response),
        }
        let (uuid, writer) = (gpu.uuid.clone(), enforcer.clone());
        let written = tokio::task::spawn_blocking(move || writer.device_plugin_limit(&uuid, bytes))
            .await
            .map_err(|e| Status::internal(format!("writing the limit spec did not finish: {e}")))?;
        let name = written.map_err(|e| {
            let msg = format!(
                "GPU {} ({}): cannot write the CDI spec carrying the memory-limit hook: {e}; no \
                 container starts without its limit",
                gpu.index, gpu.uuid
            );
            tracing::error!("Allocate: {msg}");
            self.metrics.allocation("limit_spec_failed");
            self.agent
                .events()
                .warn_soon("Allocate", "GpuShareLimitSpecFailed", msg.clone());
            Status::failed_precondition(msg)
        })?;
        response
            .envs
            .extend(crate::node::enforcement::limit_envs(bytes));
        let (cri, annotation) = enforcer.device_plugin_strategies();
        if cri {
            response.cdi_devices.push(CdiDevice { name: name.clone() });
        }
        if annotation {
            response
                .annotations
                .insert(enforcer.limit_annotation_key(), name);
        }
        Ok(response)
    }

    fn known(&self) -> impl Fn(u32) -> bool + '_ {
        |i| self.gpu_by_index(i).is_some()
    }

    /// Matches `ids` from the store and claims the container in the records (one in-memory
    /// step under the records mutex).
    fn claim(&self, ids: &[String], units: GpuMem) -> Result<(Match, u64), Vec<NotMatched>> {
        let known = self.known();
        self.pods.with_pods(|pods| {
            let mut records = self.records();
            let m = matching::find_match(pods, &records, units, known)?;
            let seq = records.claim(&pod_id(&m), &m.container, ids, m.gpu_index);
            Ok((m, seq))
        })
    }

    /// The same device IDs asked again: the container they were answered for.
    fn same_ids(&self, ids: &[String]) -> Option<(Match, u64, bool)> {
        let (pod, grant) = self.records().for_ids(ids)?;
        let snap = self
            .pods
            .get(&pod.namespace, &pod.name)
            .filter(|s| s.uid == pod.uid)?;
        let mut records = self.records();
        let m = matching::match_for(&snap, &records, &grant.container, grant.gpu_index)?;
        if grant.recorded {
            return Some((m, grant.seq, true));
        }
        let seq = records.claim(&pod, &grant.container, ids, grant.gpu_index);
        Some((m, seq, false))
    }

    /// A container answered before that kubelet does not show (it asks again with other IDs).
    async fn repeat(&self, ids: &[String], units: GpuMem) -> Option<(Match, u64)> {
        let socket = &self.config.pod_resources_socket;
        if !socket.exists() {
            return None;
        }
        let truth = match tokio::time::timeout(
            crate::node::api::REQUEST_TIMEOUT,
            reconcile::list_assignments(socket),
        )
        .await
        {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "PodResources unavailable to recognise a repeat");
                return None;
            }
            Err(_) => return None,
        };
        let held: HashSet<(&str, &str, &str)> = truth
            .values()
            .map(|(ns, pod, c)| (ns.as_str(), pod.as_str(), c.as_str()))
            .collect();
        let known = self.known();
        self.pods.with_pods(|pods| {
            let mut records = self.records();
            let m = matching::find_repeat(
                pods,
                &records,
                units,
                |ns, pod, c| held.contains(&(ns, pod, c)),
                known,
            )?;
            let seq = records.claim(&pod_id(&m), &m.container, ids, m.gpu_index);
            Some((m, seq))
        })
    }

    /// Matches one container request: a pod's next container; else, after one LIST (the watch
    /// may lag), a pod's next container, the container these very IDs were answered for
    /// (kubelet asking again) or a container asked again with other IDs. A pod waiting for
    /// this size comes before a repeat: kubelet reuses the IDs of gone containers, so the same
    /// IDs alone do not prove a repeat.
    async fn choose(&self, ids: &[String], units: GpuMem) -> Choice {
        let matched = |(m, seq): (Match, u64)| Choice::Matched {
            m,
            seq,
            repeat: false,
        };
        if let Ok(found) = self.claim(ids, units) {
            return matched(found);
        }
        // The store is refreshed before the same IDs are trusted: a lagging store may still
        // show a deleted pod whose freed IDs kubelet hands to a new one.
        if let Err(e) = self
            .pods
            .refresh(self.agent.client(), self.agent.node_name())
            .await
        {
            tracing::debug!(error = %e, "pod refresh after a miss failed");
        }
        let rejected = match self.claim(ids, units) {
            Ok(found) => return matched(found),
            Err(rejected) => rejected,
        };
        if let Some((m, seq, recorded)) = self.same_ids(ids) {
            return Choice::Matched {
                m,
                seq,
                repeat: recorded,
            };
        }
        match self.repeat(ids, units).await {
            Some(found) => matched(found),
            None => Choice::Unmatched(rejected),
        }
    }

    /// Merge-patches the pod after matching `m` (answer `seq`), under the pod's lock, within
    /// `deadline`; the updated pod goes into the store. A refused PATCH drops the claim; one
    /// whose outcome is unknown keeps it.
    async fn record_on_pod(
        &self,
        m: &Match,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), NotRecorded> {
        let lock = self.pod_lock(&m.uid);
        let _pod_locked = lock.lock().await;
        let patch = PodGpuAnnotations::allocated_patch(&m.allocated_after, m.complete, now_ns());
        let outcome = retry_until(
            deadline,
            |e| tracing::debug!(error = %e, pod = m.name, "pod patch failed, retrying"),
            || {
                bounded(crate::k8s::write::patch_pod_annotations(
                    self.agent.client(),
                    &m.namespace,
                    &m.name,
                    &patch,
                ))
            },
        )
        .await;
        match outcome {
            Ok(pod) => {
                self.pods.apply(&pod);
                self.records().mark_recorded(&m.uid, &m.container, seq);
                Ok(())
            }
            Err(RetryError::Failed(e)) if !e.outcome_unknown() => {
                self.records().release(&m.uid, &m.container, seq);
                Err(NotRecorded {
                    message: e.to_string(),
                    unknown: false,
                })
            }
            Err(RetryError::Failed(e)) => Err(NotRecorded {
                message: format!("{e} (outcome unknown)"),
                unknown: true,
            }),
            Err(RetryError::DeadlineExceeded) => Err(NotRecorded {
                message: format!(
                    "no answer within the Allocate deadline of {ALLOCATE_DEADLINE:?} (outcome \
                     unknown)"
                ),
                unknown: true,
            }),
        }
    }

    /// Records the answer `m` (answer number `seq`, for `device_ids`): durable on the node
    /// and written to the pod in the background ([`super::writeback`]), so the answer never
    /// waits on the API server; without a usable state directory, written to the pod before
    /// the answer ([`Plugin::record_on_pod`]).
    async fn record(
        self: &Arc<Self>,
        m: &Match,
        seq: u64,
        device_ids: &[String],
        deadline: Instant,
    ) -> Result<(), NotRecorded> {
        match self.writeback.submit(self, m, device_ids) {
            Ok(()) => Ok(()),
            Err(e @ super::pending::NotAccepted::Journal(_)) => {
                tracing::warn!(error = %e, "the answer could not be made durable on the node; writing it to the pod first");
                self.record_on_pod(m, seq, deadline).await
            }
            Err(super::pending::NotAccepted::NoJournal(_)) => {
                self.record_on_pod(m, seq, deadline).await
            }
        }
    }

    /// Waits for the watch's first pod list; past [`SYNC_WAIT`] reads the API itself.
    async fn ensure_pods(&self, deadline: Instant) -> Result<(), Status> {
        if self.pods.is_synced()
            || tokio::time::timeout(SYNC_WAIT, self.pods.synced())
                .await
                .is_ok()
        {
            return Ok(());
        }
        retry_until(
            deadline,
            |_| {},
            || {
                self.pods
                    .refresh(self.agent.client(), self.agent.node_name())
            },
        )
        .await
        .map_err(|e| {
            Status::unavailable(format!(
                "the device plugin could not read this node's pods: {e:?}"
            ))
        })
    }

    /// Serves one Allocate call, container by container, within [`ALLOCATE_DEADLINE`].
    pub(crate) async fn allocate(
        self: &Arc<Self>,
        request: AllocateRequest,
    ) -> Result<AllocateResponse, Status> {
        let started = std::time::Instant::now();
        let deadline = Instant::now() + ALLOCATE_DEADLINE;
        let result = self.allocate_within(request, deadline).await;
        self.reconcile_now.notify_one();
        self.metrics
            .allocate_seconds
            .observe(started.elapsed().as_secs_f64());
        result
    }

    async fn allocate_within(
        self: &Arc<Self>,
        request: AllocateRequest,
        deadline: Instant,
    ) -> Result<AllocateResponse, Status> {
        self.refuse_without_mps(request.container_requests.len())?;
        self.ensure_pods(deadline).await?;
        let visible_uuid = self.agent.config().visible_devices == VisibleDevices::Uuid;
        let mut responses = Vec::with_capacity(request.container_requests.len());
        for creq in &request.container_requests {
            let units = GpuMem::new(creq.devices_ids.len() as u64);
            match self.choose(&creq.devices_ids, units).await {
                Choice::Matched { m, seq, repeat } => {
                    self.refuse_held_back(m.gpu_index)?;
                    let base = self.grant(m.gpu_index, visible_uuid, m.pod_total, units);
                    let response = self.hand_over(Some(m.gpu_index), base).await?;
                    let response = self
                        .enforce(m.gpu_index, units, Some(&m), &creq.devices_ids, response)
                        .await?;
                    if !repeat
                        && let Err(e) = self.record(&m, seq, &creq.devices_ids, deadline).await
                    {
                        self.metrics.allocation(if e.unknown {
                            "patch_unknown"
                        } else {
                            "patch_failed"
                        });
                        let msg = format!(
                            "matched pod {}/{} container {:?} to GPU {}, but recording it on the \
                             pod failed: {}; not handing out a GPU the API does not know about",
                            m.namespace, m.name, m.container, m.gpu_index, e.message
                        );
                        tracing::error!("{msg}");
                        return Err(Status::unavailable(msg));
                    }
                    tracing::info!(
                        pod = format!("{}/{}", m.namespace, m.name),
                        container = m.container,
                        gpu = m.gpu_index,
                        units = units.units(),
                        complete = m.complete,
                        repeat,
                        "allocated"
                    );
                    self.metrics
                        .allocation(if repeat { "repeated" } else { "matched" });
                    responses.push(response);
                }
                Choice::Unmatched(rejected) if self.gpus.len() == 1 => {
                    let gpu = &self.gpus[0];
                    self.refuse_held_back(gpu.index)?;
                    tracing::info!(
                        units = units.units(),
                        considered = rejected.len(),
                        "no pod matched; single-GPU node: giving its only GPU (upstream fallback)"
                    );
                    self.metrics.allocation("single_gpu_fallback");
                    let base = self.grant(gpu.index, true, units, units);
                    let response = self.hand_over(Some(gpu.index), base).await?;
                    responses.push(
                        self.enforce(gpu.index, units, None, &creq.devices_ids, response)
                            .await?,
                    );
                }
                Choice::Unmatched(rejected) => {
                    self.metrics.allocation("no_candidate");
                    let amount = self.agent.unit().format_amount(units);
                    let why = matching::explain(&amount, &rejected);
                    tracing::warn!("Allocate: {why}");
                    self.allocate_failed_event(format!("Allocate of {amount} failed: {why}"));
                    match self.config.allocate_failure {
                        AllocateFailure::Env => {
                            responses.push(self.hand_over(None, self.failure_envs(units)).await?)
                        }
                        AllocateFailure::Error => return Err(Status::failed_precondition(why)),
                    }
                }
            }
        }
        Ok(AllocateResponse {
            container_responses: responses,
        })
    }

    /// With `--mps`, refuses while the MPS control daemon does not serve: a container started
    /// now would run without its memory limit (or not reach the daemon at all). Nothing is
    /// claimed; kubelet fails the pod with this message.
    fn refuse_without_mps(self: &Arc<Self>, containers: usize) -> Result<(), Status> {
        let Err(refused) = self.node.check_mps() else {
            return Ok(());
        };
        for _ in 0..containers.max(1) {
            self.metrics.allocation("mps_not_serving");
        }
        let msg = refused.to_string();
        tracing::error!("Allocate refused: {msg}");
        self.allocate_failed_event(msg.clone());
        Err(Status::unavailable(msg))
    }

    /// Refuses GPU `index` while the path's gate holds it back (another path serves it, or
    /// that path's pods still hold memory on it): nothing is claimed; kubelet fails the pod
    /// with the reason.
    fn refuse_held_back(self: &Arc<Self>, index: u32) -> Result<(), Status> {
        let Some(why) = self.offer.borrow().held_back.get(&index).cloned() else {
            return Ok(());
        };
        self.metrics.allocation("held_back");
        let msg = format!(
            "GPU {index} is not offered on the device-plugin path now: {why}; no GPU is handed \
             out that another path may count too"
        );
        tracing::error!("Allocate refused: {msg}");
        self.allocate_failed_event(msg.clone());
        Err(Status::unavailable(msg))
    }

    /// The node's Warning Event `GpuShareAllocateFailed` with `message`, sent in a task of its
    /// own so that Allocate never waits for the API server.
    fn allocate_failed_event(self: &Arc<Self>, message: String) {
        self.agent
            .events()
            .warn_soon("Allocate", "GpuShareAllocateFailed", message);
    }

    /// Prefers device IDs of the GPU of the pod the next Allocate of this size will match, so
    /// kubelet's checkpoint and PodResources name the real GPU. Takes no lock across an API
    /// call and claims nothing.
    pub(crate) async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> PreferredAllocationResponse {
        let _ = tokio::time::timeout(SYNC_WAIT, self.pods.synced()).await;
        let mut container_responses = Vec::with_capacity(request.container_requests.len());
        for creq in &request.container_requests {
            let size = usize::try_from(creq.allocation_size.max(0)).unwrap_or(0);
            let units = GpuMem::new(size as u64);
            let target = || {
                let known = self.known();
                self.pods.with_pods(|pods| {
                    let records = self.records();
                    matching::find_match(pods, &records, units, known)
                        .ok()
                        .map(|m| m.gpu_index)
                })
            };
            let mut gpu = target();
            if gpu.is_none() {
                if let Err(e) = self
                    .pods
                    .refresh(self.agent.client(), self.agent.node_name())
                    .await
                {
                    tracing::debug!(error = %e, "pod refresh after a miss failed");
                }
                gpu = target();
            }
            let ids = matching::preferred_ids(
                &creq.available_device_i_ds,
                &creq.must_include_device_i_ds,
                size,
                gpu.and_then(|g| self.gpu_by_index(g))
                    .map(|g| g.uuid.as_str()),
            );
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        PreferredAllocationResponse {
            container_responses,
        }
    }
}

fn pod_id(m: &Match) -> PodId {
    PodId {
        uid: m.uid.clone(),
        namespace: m.namespace.clone(),
        name: m.name.clone(),
    }
}
