//! Cross-check with kubelet's PodResources API: kubelet's record of which pod got which device
//! IDs is the truth about which pod an Allocate call was for.
//!
//! Every Allocate is remembered ([`AllocationRecord`]: device IDs, the GPU handed out, the pod
//! matched). Shortly after each Allocate (and every 30 s) the reconciler lists PodResources
//! (when the socket exists) and looks the recorded device IDs up:
//! - kubelet gave them to the pod we matched: consistent;
//! - kubelet gave them to ANOTHER pod P (two pods with equal requests started in another order
//!   than their assume times — kubelet does not tell the plugin which pod it allocates for):
//!   a swap. It is logged, counted (`gpushare_device_plugin_swaps_corrected`), reported as a
//!   node Event, and CORRECTED in the annotations, which then say what really runs: P gets
//!   `ALIYUN_COM_GPU_MEM_IDX` = the GPU its container was given (the one in its
//!   `NVIDIA_VISIBLE_DEVICES`), `_DEV`, that container in `gpushare.io/allocated-containers`, and
//!   ASSIGNED=true once all its GPU containers are served; the pod we had mistaken loses that
//!   container from its progress (ASSIGNED=false again if it was set) and takes P's former
//!   GPU index, so the per-GPU totals the extender counts stay the same, and the next Allocate
//!   for it matches it correctly.
//!
//! Device IDs kubelet reports that are not in the records (allocated before this process
//! started) are only compared by UUID and reported (`mismatches_seen`), never patched: the
//! GPU a container uses is the one in its env, which only the records know.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Endpoint, Uri};

use super::Plugin;
use super::node::warn_event;
use crate::core::wire::{
    ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, POD_ANN_ALLOCATED_CONTAINERS,
    RESOURCE_GPU_MEM, parse_fake_device_id,
};
use crate::k8s::retry::retry_attempts;
use crate::k8s::write::now_ns;
use crate::kubelet_api::podresources::ListPodResourcesRequest;
use crate::kubelet_api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::shutdown::Shutdown;

/// Period of the background check.
const PERIOD: Duration = Duration::from_secs(30);
/// Retry interval while an allocation is not yet visible in PodResources.
const FOLLOW_UP: Duration = Duration::from_millis(200);
/// How long after an Allocate the reconciler keeps looking for it.
const FOLLOW_UP_FOR: Duration = Duration::from_secs(10);

/// (namespace, pod, container) kubelet recorded for a device ID.
type Holder = (String, String, String);

/// Reads kubelet's device assignments of `aliyun.com/gpu-mem`: device ID → holder.
pub async fn list_assignments(socket: &std::path::Path) -> anyhow::Result<HashMap<String, Holder>> {
    let path = socket.to_path_buf();
    let channel = Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move { UnixStream::connect(p).await.map(TokioIo::new) }
        }))
        .await?;
    let list = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await?
        .into_inner();
    let mut out = HashMap::new();
    for pod in list.pod_resources {
        for c in pod.containers {
            for d in c.devices {
                if d.resource_name != RESOURCE_GPU_MEM {
                    continue;
                }
                for id in d.device_ids {
                    out.insert(
                        id,
                        (pod.namespace.clone(), pod.name.clone(), c.name.clone()),
                    );
                }
            }
        }
    }
    Ok(out)
}

/// The reconciler task.
pub(crate) async fn run(plugin: Arc<Plugin>, stop: Shutdown) {
    let mut follow_until: Option<Instant> = None;
    let mut reported: HashSet<Holder> = HashSet::new();
    loop {
        let wait = if follow_until.is_some() {
            FOLLOW_UP
        } else {
            PERIOD
        };
        tokio::select! {
            _ = stop.clone().wait() => return,
            _ = plugin.reconcile_now.notified() => {
                follow_until = Some(Instant::now() + FOLLOW_UP_FOR);
                // Give kubelet a moment to record the allocation it just received.
                tokio::time::sleep(FOLLOW_UP).await;
            }
            _ = tokio::time::sleep(wait) => {}
        }
        if !plugin.config.pod_resources_socket.exists() {
            follow_until = None;
            continue;
        }
        match reconcile_once(&plugin, &mut reported).await {
            Ok(0) => follow_until = None,
            Ok(_) => {
                if follow_until.is_some_and(|t| Instant::now() > t) {
                    follow_until = None;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "PodResources check failed");
                follow_until = None;
            }
        }
    }
}

#[derive(Debug, Default)]
struct Desired {
    gpu: Option<u32>,
    swap_gpu: Option<u32>,
    add: BTreeSet<String>,
    remove: BTreeSet<String>,
}

/// One pass; returns how many recent allocations kubelet does not show yet.
pub(crate) async fn reconcile_once(
    plugin: &Arc<Plugin>,
    reported: &mut HashSet<Holder>,
) -> anyhow::Result<usize> {
    let truth = list_assignments(&plugin.config.pod_resources_socket).await?;
    // Hold the allocation lock: no Allocate runs while the annotations are corrected.
    let mut records = plugin.allocations.lock().await;
    let mut desired: BTreeMap<(String, String), Desired> = BTreeMap::new();
    let mut outstanding = 0;
    let mut recorded_ids: HashSet<&str> = HashSet::new();
    let mut swaps = Vec::new();
    for rec in records.iter_mut() {
        let holders: BTreeSet<&Holder> = rec
            .device_ids
            .iter()
            .filter_map(|id| truth.get(id))
            .collect();
        let Some(holder) = holders.iter().next().copied() else {
            outstanding += 1;
            continue;
        };
        if holders.len() > 1 {
            tracing::warn!(ids = ?rec.device_ids, ?holders, "kubelet split one allocation over several containers");
            continue;
        }
        let (ns, name, container) = holder.clone();
        let actual = (ns.clone(), name.clone());
        desired.entry(actual.clone()).or_default().gpu = Some(rec.gpu_index);
        desired
            .entry(actual.clone())
            .or_default()
            .add
            .insert(container.clone());
        if (
            rec.namespace.as_str(),
            rec.name.as_str(),
            rec.container.as_str(),
        ) != (ns.as_str(), name.as_str(), container.as_str())
        {
            let actual_gpu = plugin
                .pods
                .get(&ns, &name)
                .and_then(|p| p.annotations.gpu_index);
            let mistaken = desired
                .entry((rec.namespace.clone(), rec.name.clone()))
                .or_default();
            mistaken.remove.insert(rec.container.clone());
            mistaken.swap_gpu = actual_gpu;
            swaps.push(format!(
                "kubelet gave the devices of GPU {} to {ns}/{name} container {container:?}, \
                 matched as {}/{} container {:?}",
                rec.gpu_index, rec.namespace, rec.name, rec.container
            ));
            rec.namespace = ns;
            rec.name = name;
            rec.container = container;
        }
    }
    for rec in records.iter() {
        recorded_ids.extend(rec.device_ids.iter().map(String::as_str));
    }
    // Assignments made before this process started: compare by UUID, report only.
    for (id, holder) in &truth {
        if recorded_ids.contains(id.as_str()) || reported.contains(holder) {
            continue;
        }
        let Some(gpu) = parse_fake_device_id(id).and_then(|(u, _)| plugin.gpu_by_uuid(u)) else {
            continue;
        };
        if let Some(pod) = plugin.pods.get(&holder.0, &holder.1)
            && pod.annotations.gpu_index.is_some_and(|i| i != gpu.index)
        {
            plugin.metrics.mismatches_seen.inc();
            reported.insert(holder.clone());
            tracing::warn!(
                pod = format!("{}/{}", holder.0, holder.1),
                container = holder.2,
                kubelet_gpu = gpu.index,
                annotated_gpu = ?pod.annotations.gpu_index,
                "kubelet's devices name another GPU than the pod's annotation (allocated before \
                 this plugin started; not corrected)"
            );
        }
    }
    // Apply the corrections (pods whose annotations differ from the desired state).
    for ((ns, name), d) in desired {
        let Some(pod) = plugin.pods.get(&ns, &name) else {
            continue;
        };
        let Ok(request) = &pod.request else { continue };
        let ann = &pod.annotations;
        let mut done: BTreeSet<String> = ann.allocated_containers.iter().cloned().collect();
        for c in &d.remove {
            done.remove(c);
        }
        done.extend(d.add.iter().cloned());
        let allocated: Vec<String> = request
            .all_containers()
            .filter(|c| done.contains(&c.name))
            .map(|c| c.name.clone())
            .collect();
        let complete = request.all_containers().all(|c| done.contains(&c.name));
        let gpu = d.gpu.or(d.swap_gpu).or(ann.gpu_index);
        let mut patch = BTreeMap::new();
        if gpu != ann.gpu_index
            && let Some(g) = gpu.and_then(|g| plugin.gpu_by_index(g))
        {
            patch.insert(ANN_GPU_INDEX.to_string(), g.index.to_string());
            patch.insert(ANN_DEVICE_MEM.to_string(), g.units.to_string());
        }
        if allocated != ann.allocated_containers {
            patch.insert(
                POD_ANN_ALLOCATED_CONTAINERS.to_string(),
                allocated.join(","),
            );
        }
        if ann.assigned != Some(complete) {
            patch.insert(ANN_ASSIGNED.to_string(), complete.to_string());
            if complete {
                patch.insert(ANN_ASSUME_TIME.to_string(), now_ns().to_string());
            }
        }
        if patch.is_empty() {
            continue;
        }
        tracing::warn!(
            pod = format!("{ns}/{name}"),
            ?patch,
            "correcting the pod's GPU annotations to what kubelet allocated"
        );
        match retry_attempts(4, || {
            crate::k8s::write::patch_pod_annotations(&plugin.client, &ns, &name, &patch)
        })
        .await
        {
            Ok(updated) => plugin.pods.apply(&updated),
            Err(e) => {
                tracing::error!(error = %e, pod = format!("{ns}/{name}"), "correction failed")
            }
        }
    }
    drop(records);
    for swap in swaps {
        plugin.metrics.swaps_corrected.inc();
        tracing::warn!("allocation swap corrected: {swap}");
        warn_event(
            &plugin.events,
            &plugin.node,
            &plugin.node_uid,
            "Reconcile",
            "GpuShareAllocationSwapped",
            &format!("{swap}; annotations corrected"),
        )
        .await;
    }
    Ok(outstanding)
}
