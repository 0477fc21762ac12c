//! The gate a GPU passes before a node role offers it on its path, at start and continuously:
//! one path per GPU across the node, whichever processes serve it.
//!
//! A role starts a gate for its path ([`super::NodeAgent::open_path`]); for each GPU the gate
//! 1. takes the GPU in this process ([`super::paths::Assignments`]: another role of the same
//!    process may hold it) and across processes ([`super::gpu_locks`]: the lock file in the
//!    host directory both DaemonSets mount, held for as long as the role serves the GPU);
//! 2. checks that the other path holds no memory on it, in the API:
//!    - for the DRA plugin: no pod of this node placed by the extender holds memory on it
//!      (bound, not finished, `ALIYUN_COM_GPU_MEM_IDX` naming it), and the Node advertises no
//!      allocatable `aliyun.com/gpu-mem` or `nvidia.com/gpu` (a device plugin still registered
//!      with kubelet: an older one without locks, NVIDIA's);
//!    - for the device plugin: no ResourceSlice of this node publishes it (a device with its
//!      UUID as an attribute, of any driver: kubelet removes a stopped DRA plugin's slices a
//!      little later), and no ResourceClaim is allocated on its device in this node's pool;
//! 3. offers it only when both hold, and keeps checking (every second while it holds a GPU
//!    back, every 30 s once it offers them all): a GPU whose check fails (an API read that
//!    does not answer) keeps its last decision, and a GPU not decided yet stays held back.
//!
//! What the gate decided is a `watch` of [`Offer`] the role follows (the slice, the device
//! list), and on the Node the annotation of the path (`gpushare.io/device-plugin-gpus`,
//! `gpushare.io/dra-gpus`: the GPUs offered and those held back, with why). The held-back
//! GPUs of the device-plugin path are also published unhealthy in `gpushare.io/devices`, so the
//! extender places nothing on them. Closing the gate lets go of every lock and removes the
//! annotation.
//!
//! What it does not do: speak a kubelet protocol, or stop the other path (it waits for it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::ListParams;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::NodeAgent;
use super::api::{ApiCallError, bounded, list_node_pods};
use super::gpu_locks::{GpuLock, GpuLocks, LockError, path_name};
use super::gpus::ServedGpu;
use super::paths::ServingPath;
use crate::core::resource_name::gpu_device_name;
use crate::core::wire::{NODE_ANN_DEVICE_PLUGIN_GPUS, NODE_ANN_DRA_GPUS, RESOURCE_GPU_MEM};
use crate::shutdown::Shutdown;

/// How often the gate checks again while it holds a GPU back.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How often it checks again while it offers every GPU (the locks keep the other role off;
/// the API is read for what takes no lock: NVIDIA's plugins, an older gpushare).
pub const STEADY_INTERVAL: Duration = Duration::from_secs(30);

/// What a role offers now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offer {
    /// The GPUs offered, by index.
    pub offered: BTreeSet<u32>,
    /// The GPUs held back, by index, and why.
    pub held_back: BTreeMap<u32, String>,
}

impl Offer {
    /// Whether GPU `index` is offered.
    pub fn is_offered(&self, index: u32) -> bool {
        self.offered.contains(&index)
    }
}

/// What the gate needs beside the agent.
#[derive(Clone, Debug)]
pub struct GateSettings {
    /// The DRA driver whose claims hold the node's GPUs on the DRA path (`dra.driver_name`).
    pub dra_driver: String,
}

/// An open gate: the role's offer, kept current until [`PathGate::close`].
#[derive(Debug)]
pub struct PathGate {
    offer: watch::Receiver<Offer>,
    stop: crate::shutdown::Trigger,
    task: Option<JoinHandle<()>>,
}

impl PathGate {
    /// The offer now, and every change after.
    pub fn offer(&self) -> watch::Receiver<Offer> {
        self.offer.clone()
    }

    /// Lets go of every GPU (locks, the in-process offer, the Node annotation).
    pub async fn close(mut self) {
        self.stop.trigger();
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for PathGate {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}

/// Why the other path holds a GPU, by UUID (empty: it holds none).
type Held = BTreeMap<String, String>;

/// One gate's state, owned by its task.
struct Gate {
    agent: Arc<NodeAgent>,
    path: ServingPath,
    settings: GateSettings,
    locks: GpuLocks,
    held: BTreeMap<u32, GpuLock>,
    offer: watch::Sender<Offer>,
    /// What the last check of the other path found (kept when a check has no answer).
    other: Option<Held>,
    published: Option<Offer>,
}

impl NodeAgent {
    /// Opens the gate of `path` (see the module docs): its first pass is done when this
    /// returns, so the role's first device list already follows it.
    pub async fn open_path(
        self: &Arc<Self>,
        path: ServingPath,
        settings: GateSettings,
        shutdown: Shutdown,
    ) -> PathGate {
        let (trigger, stop) = shutdown.child();
        let (offer, rx) = watch::channel(Offer::default());
        let mut gate = Gate {
            agent: self.clone(),
            path,
            settings,
            locks: self.gpu_locks(),
            held: BTreeMap::new(),
            offer,
            other: None,
            published: None,
        };
        gate.pass().await;
        let task = tokio::spawn(async move {
            let stop_fut = stop.wait();
            tokio::pin!(stop_fut);
            loop {
                let wait = if gate.offer.borrow().held_back.is_empty() {
                    STEADY_INTERVAL
                } else {
                    CHECK_INTERVAL
                };
                tokio::select! {
                    _ = &mut stop_fut => break,
                    _ = tokio::time::sleep(wait) => {}
                }
                gate.pass().await;
            }
            gate.release().await;
        });
        PathGate {
            offer: rx,
            stop: trigger,
            task: Some(task),
        }
    }
}

impl Gate {
    /// One pass: take what can be taken, check the other path, publish the offer.
    async fn pass(&mut self) {
        let gpus: Vec<ServedGpu> = self.agent.gpus().to_vec();
        let mut held_back: BTreeMap<u32, String> = BTreeMap::new();
        for g in &gpus {
            if self.held.contains_key(&g.index) {
                continue;
            }
            if let Err(conflict) = self.agent.offer(self.path, [g.index]) {
                held_back.insert(g.index, conflict.to_string());
                continue;
            }
            match self.locks.try_take(&g.uuid, self.path) {
                Ok(lock) => {
                    tracing::info!(gpu = g.index, uuid = %g.uuid, path = %self.path, "GPU lock taken");
                    self.held.insert(g.index, lock);
                }
                Err(e) => {
                    self.agent.withdraw_one(self.path, g.index);
                    let why = match &e {
                        LockError::Held { .. } => format!("{e}: waiting until it stops"),
                        LockError::Io { .. } => {
                            format!("{e} (is {} mounted?)", self.locks.dir().display())
                        }
                    };
                    held_back.insert(g.index, why);
                }
            }
        }
        match self.other_path_holds(&gpus).await {
            Ok(found) => self.other = Some(found),
            Err(e) => {
                tracing::warn!(error = %e, path = %self.path, "cannot check what the other path holds (keeping the last decision)");
            }
        }
        let mut offer = Offer::default();
        for g in &gpus {
            if let Some(why) = held_back.remove(&g.index) {
                offer.held_back.insert(g.index, why);
                continue;
            }
            match &self.other {
                None => {
                    offer.held_back.insert(
                        g.index,
                        "what the other path holds on it could not be read yet".to_string(),
                    );
                }
                Some(other) => match other.get(&g.uuid) {
                    Some(why) => {
                        offer.held_back.insert(g.index, why.clone());
                    }
                    None => {
                        offer.offered.insert(g.index);
                    }
                },
            }
        }
        self.publish(offer).await;
    }

    /// What the other path holds, by GPU UUID (see the module docs).
    async fn other_path_holds(&self, gpus: &[ServedGpu]) -> Result<Held, ApiCallError> {
        let client = self.agent.client();
        let node = self.agent.node_name();
        let mut held = Held::new();
        match self.path {
            ServingPath::Dra => {
                let n: Node = bounded(Api::<Node>::all(client.clone()).get(node)).await?;
                let allocatable = n.status.and_then(|s| s.allocatable).unwrap_or_default();
                for resource in [RESOURCE_GPU_MEM, "nvidia.com/gpu"] {
                    let serving = allocatable
                        .get(resource)
                        .is_some_and(|q| !matches!(q.0.trim(), "" | "0"));
                    if serving {
                        for g in gpus {
                            held.entry(g.uuid.clone()).or_insert_with(|| {
                                format!(
                                    "the node advertises allocatable {resource}: a device \
                                     plugin is still registered with kubelet"
                                )
                            });
                        }
                    }
                }
                for pod in list_node_pods(client, node).await? {
                    if crate::k8s::project::pod_is_terminal(&pod) {
                        continue;
                    }
                    let (ann, _) = crate::k8s::project::pod_annotations(&pod);
                    let Some(index) = ann.gpu_index else {
                        continue;
                    };
                    let request = crate::k8s::project::pod_gpu_request(&pod).ok();
                    let units = crate::core::pod_holding(request.as_ref(), &ann);
                    if units.is_zero() {
                        continue;
                    }
                    if let Some(g) = gpus.iter().find(|g| g.index == index) {
                        held.entry(g.uuid.clone()).or_insert_with(|| {
                            format!(
                                "pod {}/{} placed by the extender holds {} units on it",
                                pod.metadata.namespace.as_deref().unwrap_or_default(),
                                pod.metadata.name.as_deref().unwrap_or_default(),
                                units.units()
                            )
                        });
                    }
                }
            }
            ServingPath::DevicePlugin => {
                let slices = Api::<ResourceSlice>::all(client.clone());
                let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
                for slice in dra_list(bounded(slices.list(&params)).await)? {
                    if slice.spec.node_name.as_deref() != Some(node) {
                        continue;
                    }
                    for device in slice.spec.devices.iter().flatten() {
                        let names_gpu = |uuid: &str| {
                            device
                                .attributes
                                .iter()
                                .flatten()
                                .any(|(_, a)| a.string.as_deref() == Some(uuid))
                        };
                        for g in gpus.iter().filter(|g| names_gpu(&g.uuid)) {
                            held.entry(g.uuid.clone()).or_insert_with(|| {
                                format!(
                                    "ResourceSlice {} (driver {}) publishes it: waiting until it \
                                     is removed (kubelet removes a stopped DRA plugin's slices)",
                                    slice.metadata.name.as_deref().unwrap_or_default(),
                                    slice.spec.driver
                                )
                            });
                        }
                    }
                }
                let pending: Vec<&ServedGpu> = gpus
                    .iter()
                    .filter(|g| !self.offer.borrow().is_offered(g.index))
                    .collect();
                if !pending.is_empty() {
                    let claims = Api::<ResourceClaim>::all(client.clone());
                    for claim in dra_list(bounded(claims.list(&ListParams::default())).await)? {
                        let results = crate::k8s::project::claim_results(&claim);
                        for r in results
                            .into_iter()
                            .flatten()
                            .filter(|r| r.driver == self.settings.dra_driver && r.pool == node)
                        {
                            for g in pending
                                .iter()
                                .filter(|g| gpu_device_name(&g.uuid, g.index) == r.device)
                            {
                                held.entry(g.uuid.clone()).or_insert_with(|| {
                                    format!(
                                        "ResourceClaim {}/{} is allocated on it (DRA path)",
                                        claim.metadata.namespace.as_deref().unwrap_or_default(),
                                        claim.metadata.name.as_deref().unwrap_or_default()
                                    )
                                });
                            }
                        }
                    }
                }
            }
        }
        Ok(held)
    }

    /// Publishes `offer` to the role, the Node and (device-plugin path) the agent's device
    /// annotations, when it changed.
    async fn publish(&mut self, offer: Offer) {
        self.offer.send_if_modified(|have| {
            if *have == offer {
                false
            } else {
                *have = offer.clone();
                true
            }
        });
        if self.published.as_ref() == Some(&offer) {
            return;
        }
        for (index, why) in &offer.held_back {
            if self
                .published
                .as_ref()
                .is_none_or(|p| p.held_back.get(index) != Some(why))
            {
                tracing::warn!(gpu = index, path = %self.path, why, "GPU held back");
            }
        }
        if self.path == ServingPath::DevicePlugin {
            let withheld: BTreeSet<String> = self
                .agent
                .gpus()
                .iter()
                .filter(|g| !offer.is_offered(g.index))
                .map(|g| g.uuid.clone())
                .collect();
            self.agent.set_withheld(withheld).await;
        }
        let value = json!({
            "offered": offer.offered,
            "heldBack": offer.held_back,
        });
        match self.annotate(Some(value.to_string())).await {
            Ok(()) => self.published = Some(offer),
            Err(e) => {
                tracing::warn!(error = %e, "cannot publish the GPUs of this path on the node (retrying)")
            }
        }
    }

    /// Sets (or with `None` removes) this path's annotation on the Node.
    async fn annotate(&self, value: Option<String>) -> Result<(), ApiCallError> {
        let key = match self.path {
            ServingPath::DevicePlugin => NODE_ANN_DEVICE_PLUGIN_GPUS,
            ServingPath::Dra => NODE_ANN_DRA_GPUS,
        };
        let nodes: Api<Node> = Api::all(self.agent.client().clone());
        let patch = json!({ "metadata": { "annotations": { key: value } } });
        bounded(nodes.patch(
            self.agent.node_name(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        ))
        .await?;
        Ok(())
    }

    /// Lets go of every GPU.
    async fn release(&mut self) {
        self.held.clear();
        self.agent.withdraw(self.path);
        if self.path == ServingPath::DevicePlugin {
            self.agent.set_withheld(BTreeSet::new()).await;
        }
        if let Err(e) = self.annotate(None).await {
            tracing::warn!(error = %e, "cannot remove the GPUs of this path from the node");
        }
        tracing::info!(path = path_name(self.path), "GPU locks let go");
    }
}

/// A list of a `resource.k8s.io` kind: none when the API server does not serve DRA (404), so
/// nothing of it can hold a GPU.
fn dra_list<K: Clone>(
    listed: Result<kube::core::ObjectList<K>, ApiCallError>,
) -> Result<Vec<K>, ApiCallError> {
    match listed {
        Ok(list) => Ok(list.items),
        Err(ApiCallError::Kube(kube::Error::Api(e))) if e.code == 404 => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}
