//! Cross-check with kubelet's PodResources API: kubelet's record of which pod got which device
//! IDs is the truth about which pod an Allocate call was for.
//!
//! Every Allocate is remembered in the [`Records`](super::records::Records), by pod UID.
//! Shortly after each Allocate (and every 30 s) the reconciler lists PodResources (when the
//! socket exists) and looks the recorded device IDs up:
//! - kubelet gave them to the pod we matched: consistent (and if the pod's annotations do not
//!   say so yet, after a PATCH whose outcome was unknown, they are written);
//! - kubelet gave them to ANOTHER pod P (two pods with equal requests started in another order
//!   than their assume times — kubelet does not tell the plugin which pod it allocates for):
//!   a swap. It is logged, counted (`gpushare_device_plugin_swaps_corrected`), reported as a
//!   node Event, and CORRECTED in the annotations, which then say what really runs: P gets
//!   `ALIYUN_COM_GPU_MEM_IDX` = the GPU its container was given (the one in its
//!   `NVIDIA_VISIBLE_DEVICES`), `_DEV`, that container in `gpushare.io/allocated-containers`, and
//!   ASSIGNED=true once all its GPU containers are served; the pod we had mistaken loses that
//!   container from its progress (ASSIGNED=false again if it was set) and takes P's former
//!   GPU index, so the per-GPU totals the extender counts stay the same, and the next Allocate
//!   for it matches it correctly;
//! - kubelet ran the containers of ONE pod on devices of DIFFERENT GPUs (a split): no
//!   annotation of that pod, nor of any pod swapped with it, is rewritten — whatever index
//!   they were given, the per-GPU totals would be wrong. It is logged, counted
//!   (`gpushare_device_plugin_split_pods`) and reported as a node Event
//!   (`GpuShareAllocationSplit`), once per pod;
//! - an answer kubelet does not show yet (the pod is mid-admission, or the Allocate failed):
//!   where that container runs is not known, so that pod and the pods swapped with it wait
//!   for a later pass.
//!
//! Records of pods that are gone (deleted, re-created under the same name with another UID,
//! finished) are dropped first, so a stale record never moves another pod. Device IDs
//! kubelet reports that are not in the records (allocated before this process started) are
//! only compared by UUID and reported (`mismatches_seen`), never patched: the GPU a container
//! uses is the one in its env, which only the records know.
//!
//! The records are planned under their mutex (no await); the PATCHes run after, each under
//! its pod's lock, with a request timeout.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Endpoint, Uri};

use super::Plugin;
use super::matching::PodSnapshot;
use super::records::{PodId, Records};
use super::reported::{Holder, Reported};
use crate::core::wire::{
    ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, POD_ANN_ALLOCATED_CONTAINERS,
    RESOURCE_GPU_MEM, parse_fake_device_id,
};
use crate::k8s::retry::retry_attempts;
use crate::k8s::write::now_ns;
use crate::kubelet_api::podresources::ListPodResourcesRequest;
use crate::kubelet_api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::node::api::bounded;
use crate::shutdown::Shutdown;

/// Period of the background check.
const PERIOD: Duration = Duration::from_secs(30);
/// Retry interval while an allocation is not yet visible in PodResources.
const FOLLOW_UP: Duration = Duration::from_millis(200);
/// How long after an Allocate the reconciler keeps looking for it.
const FOLLOW_UP_FOR: Duration = Duration::from_secs(10);

/// Reads kubelet's device assignments of `aliyun.com/gpu-mem`: device ID → holder.
pub(crate) async fn list_assignments(
    socket: &std::path::Path,
) -> anyhow::Result<HashMap<String, Holder>> {
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
            // No cross-check; the records of gone pods still go.
            if plugin.pods.is_synced() {
                let pods = plugin.pods.snapshot();
                drop_gone(&mut plugin.records(), |ns, name| {
                    pods.iter()
                        .find(|p| p.namespace == ns && p.name == name)
                        .cloned()
                });
                plugin.prune_pod_locks();
            }
            follow_until = None;
            continue;
        }
        match reconcile_once(&plugin).await {
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

/// One pass's decisions, taken without an await.
#[derive(Debug, Default)]
struct Plan {
    outstanding: usize,
    /// What the annotations of each pod (by UID) should say.
    desired: BTreeMap<String, Desired>,
    swaps: Vec<String>,
    splits: Vec<String>,
}

/// One pass; returns how many recent allocations kubelet does not show yet.
pub(crate) async fn reconcile_once(plugin: &Arc<Plugin>) -> anyhow::Result<usize> {
    let truth = list_assignments(&plugin.config.pod_resources_socket).await?;
    let plan = {
        let mut reported = plugin.reported.lock().unwrap_or_else(|p| p.into_inner());
        plan(plugin, &truth, &mut reported)
    };
    plugin.prune_pod_locks();
    for (uid, d) in plan.desired {
        // Under the pod's lock, against the pod as it is now (an Allocate may just have
        // written it).
        let lock = plugin.pod_lock(&uid);
        let _pod_locked = lock.lock().await;
        let Some((ns, name, patch)) = correction(plugin, &uid, &d) else {
            continue;
        };
        tracing::warn!(
            pod = format!("{ns}/{name}"),
            ?patch,
            "correcting the pod's GPU annotations to what kubelet allocated"
        );
        match retry_attempts(4, || {
            bounded(crate::k8s::write::patch_pod_annotations(
                plugin.agent.client(),
                &ns,
                &name,
                &patch,
            ))
        })
        .await
        {
            Ok(updated) => plugin.pods.apply(&updated),
            Err(e) => {
                tracing::error!(error = %e, pod = format!("{ns}/{name}"), "correction failed")
            }
        }
    }
    for swap in plan.swaps {
        plugin.metrics.swaps_corrected.inc();
        tracing::warn!("allocation swap corrected: {swap}");
        plugin
            .agent
            .events()
            .warn(
                "Reconcile",
                "GpuShareAllocationSwapped",
                &format!("{swap}; annotations corrected"),
            )
            .await;
    }
    for split in plan.splits {
        plugin.metrics.split_pods.inc();
        tracing::error!("allocation split: {split}");
        plugin
            .agent
            .events()
            .warn("Reconcile", "GpuShareAllocationSplit", &split)
            .await;
    }
    Ok(plan.outstanding)
}

/// Compares the records with kubelet's `truth`, updates the records, and says which
/// annotations to write and what to report.
fn plan(plugin: &Plugin, truth: &HashMap<String, Holder>, reported: &mut Reported) -> Plan {
    let mut out = Plan::default();
    // A copy of the store, taken before the records are locked (the store is never read
    // while the records are held).
    let pods: HashMap<(String, String), PodSnapshot> = plugin
        .pods
        .snapshot()
        .into_iter()
        .map(|p| ((p.namespace.clone(), p.name.clone()), p))
        .collect();
    let get = |ns: &str, name: &str| pods.get(&(ns.to_string(), name.to_string()));
    let mut records = plugin.records();
    // Records of pods that are gone go first: they must never move another pod.
    if plugin.pods.is_synced() {
        drop_gone(&mut records, |ns, name| get(ns, name).cloned());
    }
    let mut seen: Vec<Seen> = Vec::new();
    // Pods with an answer kubelet does not show yet (mid-admission, or an Allocate that
    // failed): where that container really runs is not known, so nothing about them, nor
    // about the pods swapped with them, is corrected in this pass.
    let mut unsettled: BTreeSet<String> = BTreeSet::new();
    for (uid, pod) in records.pods() {
        for grant in &pod.containers {
            let holders: BTreeSet<&Holder> = grant
                .device_ids
                .iter()
                .filter_map(|id| truth.get(id))
                .collect();
            let Some((ns, name, container)) = holders.iter().next().map(|h| (&h.0, &h.1, &h.2))
            else {
                out.outstanding += 1;
                unsettled.insert(uid.clone());
                continue;
            };
            if holders.len() > 1 {
                tracing::warn!(ids = ?grant.device_ids, ?holders, "kubelet split one allocation over several containers");
                continue;
            }
            let Some(holder) = get(ns, name) else {
                continue;
            };
            if (ns, name) == (&pod.namespace, &pod.name) && holder.uid != *uid {
                // The name now belongs to another pod: this record's pod is gone.
                continue;
            }
            seen.push(Seen {
                grant_uid: uid.clone(),
                grant_container: grant.container.clone(),
                gpu: grant.gpu_index,
                holder: PodId {
                    uid: holder.uid.clone(),
                    namespace: ns.clone(),
                    name: name.clone(),
                },
                holder_container: container.clone(),
            });
        }
    }
    let excluded = excluded_pods(&seen, unsettled, reported, &mut out.splits);
    let mut desired: BTreeMap<String, Desired> = BTreeMap::new();
    let mut moves = Vec::new();
    for s in seen.iter().filter(|s| !excluded.contains(&s.holder.uid)) {
        let d = desired.entry(s.holder.uid.clone()).or_default();
        d.gpu = Some(s.gpu);
        d.add.insert(s.holder_container.clone());
        if (s.grant_uid.as_str(), s.grant_container.as_str())
            == (s.holder.uid.as_str(), s.holder_container.as_str())
        {
            continue;
        }
        let (mistaken_ns, mistaken_name) = records
            .pod(&s.grant_uid)
            .map(|p| (p.namespace.clone(), p.name.clone()))
            .unwrap_or_default();
        let holder_gpu =
            get(&s.holder.namespace, &s.holder.name).and_then(|p| p.annotations.gpu_index);
        let mistaken = desired.entry(s.grant_uid.clone()).or_default();
        mistaken.remove.insert(s.grant_container.clone());
        mistaken.swap_gpu = holder_gpu;
        out.swaps.push(format!(
            "kubelet gave the devices of GPU {} to {}/{} container {:?}, matched as {}/{} \
             container {:?}",
            s.gpu,
            s.holder.namespace,
            s.holder.name,
            s.holder_container,
            mistaken_ns,
            mistaken_name,
            s.grant_container
        ));
        moves.push((
            s.grant_uid.clone(),
            s.grant_container.clone(),
            s.holder.clone(),
            s.holder_container.clone(),
        ));
    }
    report_earlier_assignments(plugin, truth, &records, reported, |ns, name| get(ns, name));
    records.reassign(&moves);
    out.desired = desired;
    out
}

/// One recorded grant and the container kubelet shows holding its devices.
struct Seen {
    grant_uid: String,
    grant_container: String,
    gpu: u32,
    holder: PodId,
    holder_container: String,
}

/// The pods whose annotations this pass leaves alone: those kubelet split over several GPUs
/// (each said once into `splits`), the `unsettled` ones, and every pod swapped with one of
/// them, directly or not.
fn excluded_pods(
    seen: &[Seen],
    unsettled: BTreeSet<String>,
    reported: &mut Reported,
    splits: &mut Vec<String>,
) -> BTreeSet<String> {
    // Splits: one pod's containers on devices of several GPUs.
    let mut gpus_of: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
    for s in seen {
        gpus_of
            .entry(s.holder.uid.as_str())
            .or_default()
            .insert(s.gpu);
    }
    let mut excluded: BTreeSet<String> = BTreeSet::new();
    for (uid, gpus) in &gpus_of {
        if gpus.len() < 2 {
            continue;
        }
        excluded.insert(uid.to_string());
        if reported.splits.insert(uid.to_string())
            && let Some(s) = seen.iter().find(|s| s.holder.uid == *uid)
        {
            splits.push(format!(
                "kubelet ran the containers of pod {}/{} on devices of GPUs {:?}; its annotations \
                 and those of the pods swapped with it are not corrected (the per-GPU totals \
                 would be wrong either way)",
                s.holder.namespace, s.holder.name, gpus
            ));
        }
    }
    // Every pod swapped (directly or not) with a split or unsettled pod is left alone too.
    excluded.extend(unsettled);
    loop {
        let before = excluded.len();
        for s in seen {
            if s.grant_uid != s.holder.uid
                && (excluded.contains(&s.grant_uid) || excluded.contains(&s.holder.uid))
            {
                excluded.insert(s.grant_uid.clone());
                excluded.insert(s.holder.uid.clone());
            }
        }
        if excluded.len() == before {
            break;
        }
    }
    excluded
}

/// Assignments made before this process started (kubelet's devices no record holds): compared
/// by UUID with the pod's annotation, a mismatch reported once, never corrected.
fn report_earlier_assignments<'a>(
    plugin: &Plugin,
    truth: &HashMap<String, Holder>,
    records: &Records,
    reported: &mut Reported,
    get: impl Fn(&str, &str) -> Option<&'a PodSnapshot>,
) {
    for (id, holder) in truth {
        if records.holds_id(id) || reported.holders.contains(holder) {
            continue;
        }
        let Some(gpu) = parse_fake_device_id(id).and_then(|(u, _)| plugin.gpu_by_uuid(u)) else {
            continue;
        };
        if let Some(pod) = get(&holder.0, &holder.1)
            && pod.annotations.gpu_index.is_some_and(|i| i != gpu.index)
        {
            plugin.metrics.mismatches_seen.inc();
            reported.holders.insert(holder.clone());
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
}

/// Drops the records of pods that are gone: `current(namespace, name)` is the pod of that
/// name now (another UID means the recorded one was deleted and re-created).
pub(crate) fn drop_gone(
    records: &mut Records,
    current: impl Fn(&str, &str) -> Option<PodSnapshot>,
) {
    let dropped = records.retain(|uid, p| {
        current(&p.namespace, &p.name).is_some_and(|s| s.uid == uid && !s.terminal)
    });
    if !dropped.is_empty() {
        tracing::debug!(pods = dropped.len(), "dropped the records of gone pods");
    }
}

/// The annotations to merge onto pod `uid` (as the store shows it) so that they list the
/// containers `added` as allocated too (and `ASSIGNED=true` once every GPU container is);
/// `None` when they say so already, or the store does not hold the pod.
pub(crate) fn annotations_after(
    plugin: &Plugin,
    uid: &str,
    added: BTreeSet<String>,
) -> Option<BTreeMap<String, String>> {
    let desired = Desired {
        add: added,
        ..Desired::default()
    };
    correction(plugin, uid, &desired).map(|(_, _, patch)| patch)
}

/// The annotations to merge onto pod `uid` so that they say `d`; `None` when they do.
fn correction(
    plugin: &Plugin,
    uid: &str,
    d: &Desired,
) -> Option<(String, String, BTreeMap<String, String>)> {
    let pod = plugin
        .pods
        .with_pods(|mut pods| pods.find(|p| p.uid == uid).cloned())?;
    let request = pod.request.as_ref().ok()?;
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
    (!patch.is_empty()).then(|| (pod.namespace.clone(), pod.name.clone(), patch))
}
