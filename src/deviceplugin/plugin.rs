//! The device plugin's shared state ([`Plugin`]): its configuration, the node agent, the GPUs
//! served, the device list sent to kubelet, the pod store, the allocation records and the
//! per-pod write locks, what the reconciler has reported, the metrics and the readiness gate,
//! the background writer of Allocate's answers ([`Writeback`]);
//! and the allocations as the handle lists them ([`AllocationRecord`]).
//!
//! Not here: what is done with it: Allocate (`allocate`), the gRPC service (`service`), the
//! reconciler (`reconcile`), the serve loop (the parent module). A module of its own below
//! them all, so none of them reaches back into the parent.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::{Notify, watch};

use super::devices;
use super::metrics::Metrics;
use super::pending::Writeback;
use super::pods::PodStore;
use super::records::Records;
use super::reported::Reported;
use crate::admin::AdminState;
use crate::config::DevicePluginConfig;
use crate::core::wire::PLUGIN_SOCKET;
use crate::kubelet_api::deviceplugin::ListAndWatchResponse;
use crate::node::NodeAgent;
use crate::node::gpus::ServedGpu;
use crate::node::health::HealthView;
use crate::node::monitor::NodeMonitor;
use crate::node::path_gate::Offer;
use crate::shutdown::Shutdown;

/// One container allocation the plugin answered: which device IDs kubelet passed, which GPU
/// the container was given (its `NVIDIA_VISIBLE_DEVICES`), and the pod it was matched to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationRecord {
    /// UID of the pod matched.
    pub uid: String,
    /// The device IDs of the Allocate container request.
    pub device_ids: Vec<String>,
    /// The GPU handed out.
    pub gpu_index: u32,
    /// Namespace of the pod matched.
    pub namespace: String,
    /// Name of the pod matched.
    pub name: String,
    /// Container matched.
    pub container: String,
}

/// State shared by the gRPC service, the followers of the agent, the reconciler and the serve
/// loop.
pub(crate) struct Plugin {
    /// `[device_plugin]`: the kubelet side.
    pub(crate) config: DevicePluginConfig,
    /// The node agent: the GPUs, the unit, health, MPS, node publishing, the contract.
    pub(crate) agent: Arc<NodeAgent>,
    /// The node's GPUs, listed on this path; those the gate holds back are listed unhealthy
    /// and refused in Allocate.
    pub(crate) gpus: Vec<ServedGpu>,
    /// What the path's gate offers now ([`crate::node::path_gate`]).
    pub(crate) offer: watch::Receiver<Offer>,
    pub(crate) devices_tx: watch::Sender<Arc<ListAndWatchResponse>>,
    pub(crate) pods: PodStore,
    /// The allocations answered, by pod UID. Held for in-memory steps only, never across an
    /// await.
    pub(crate) records: std::sync::Mutex<Records>,
    /// One lock per pod, held across that pod's annotation PATCH (Allocate and the reconcile
    /// never write the same pod at once; other pods are not held up).
    pub(crate) pod_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(crate) reconcile_now: Notify,
    /// What the reconciler has reported already.
    pub(crate) reported: std::sync::Mutex<Reported>,
    pub(crate) metrics: Metrics,
    /// The node metrics, the readiness that follows MPS and the MPS refusal.
    pub(crate) node: Arc<NodeMonitor>,
    pub(crate) admin: Arc<AdminState>,
    /// Writes Allocate's answers to the pods after they are returned (durable on the node
    /// first).
    pub(crate) writeback: Writeback,
    /// Fires when the plugin stops (its background writes end; the journal keeps them).
    pub(crate) stopping: Shutdown,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("node", &self.agent.node_name())
            .field("gpus", &self.gpus)
            .field("socket", &self.socket_path())
            .finish_non_exhaustive()
    }
}

impl Plugin {
    pub(crate) fn records(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock of pod `uid`'s annotation writes.
    pub(crate) fn pod_lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.pod_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(uid.to_string()).or_default().clone()
    }

    /// Forgets the locks of pods that have no records and that nobody holds.
    pub(crate) fn prune_pod_locks(&self) {
        let records = self.records();
        let mut locks = self.pod_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.retain(|uid, lock| records.pod(uid).is_some() || Arc::strong_count(lock) > 1);
    }

    /// Every allocation answered, oldest first.
    pub(crate) fn allocation_records(&self) -> Vec<AllocationRecord> {
        let records = self.records();
        let mut out: Vec<(u64, AllocationRecord)> = records
            .pods()
            .flat_map(|(uid, pod)| {
                pod.containers.iter().map(move |c| {
                    (
                        c.seq,
                        AllocationRecord {
                            uid: uid.clone(),
                            device_ids: c.device_ids.clone(),
                            gpu_index: c.gpu_index,
                            namespace: pod.namespace.clone(),
                            name: pod.name.clone(),
                            container: c.container.clone(),
                        },
                    )
                })
            })
            .collect();
        out.sort_by_key(|(seq, _)| *seq);
        out.into_iter().map(|(_, r)| r).collect()
    }

    pub(crate) fn gpu_by_index(&self, index: u32) -> Option<&ServedGpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    pub(crate) fn gpu_by_uuid(&self, uuid: &str) -> Option<&ServedGpu> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// Re-sends the device list for the health `view` and the gate's offer: a GPU's devices
    /// are healthy when it is and the gate offers it.
    pub(crate) fn refresh_devices(&self, view: &HealthView) {
        let offer = self.offer.borrow().clone();
        let offered = |u: &str| {
            self.gpus
                .iter()
                .any(|g| g.uuid == u && offer.is_offered(g.index))
        };
        let msg =
            devices::list_and_watch_response(&self.gpus, |u| view.is_healthy(u) && offered(u));
        self.devices_tx.send_replace(Arc::new(msg));
    }

    pub(crate) fn socket_path(&self) -> PathBuf {
        self.config.device_plugin_dir.join(PLUGIN_SOCKET)
    }
}
