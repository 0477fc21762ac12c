//! A sandbox stand-in for what kube-scheduler's DRA plugin and kube-controller-manager's
//! resourceclaim controller do, for tests and `gpushare demo` — never for production.
//!
//! One pass ([`DraAllocator::reconcile`]) over the sandbox API server, as those components
//! would act:
//! - for every pod with `spec.resourceClaims`, claims named by a `resourceClaimTemplateName`
//!   are created from their template as the resourceclaim controller does (`generateName`
//!   `<pod>-<claim>-`, the `resource.kubernetes.io/pod-claim-name` annotation, the pod as
//!   controlling owner) and recorded in the pod's `status.resourceClaimStatuses`; a claim of
//!   an earlier pass whose answer was lost is found again by its owner and annotation, never
//!   created twice;
//! - a pending pod whose claims exist is placed: the unallocated claims are allocated on one
//!   node ([`allocate_pod`], pure), written to `resourceclaims/status` with `reservedFor` the
//!   pod, and the pod is bound to that node (`pods/binding`). A pod that cannot be placed gets
//!   the condition `PodScheduled=False` (`Unschedulable`) with the reason: upstream's
//!   `0/N nodes are available: N cannot allocate all claims.`, or the allocation error that
//!   stops kube-scheduler on every node (a selector's CEL compile or runtime error, a missing
//!   DeviceClass), which it retries for ever;
//! - claims reserved for pods that are gone or finished are released: the pod leaves
//!   `reservedFor`, an unreserved claim is deallocated, and a claim generated for a pod that
//!   is gone is deleted (the garbage collector's part).
//!
//! The allocation on one node is upstream's structured-parameters allocator, re-expressed in
//! [`structured`] (pools and their order in [`pools`], consumable capacity in [`capacity`]).
//! Nodes are tried in the order their node-local slices first appear (slices by name), then the
//! other Node objects by name; the first node where every claim fits wins. What it does not do:
//! scoring and preemption (kube-scheduler scores the nodes that fit; here the first wins),
//! binding conditions beyond copying them into results, device status, extended resources.

mod capacity;
pub mod pools;
pub mod structured;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Node, Pod, PodResourceClaimStatus};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceClass, ResourceClaim, ResourceClaimConsumerReference,
    ResourceClaimStatus, ResourceClaimTemplate, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::task::JoinHandle;

pub use pools::NodeView;

use crate::quantity::Quantity;

/// The annotation the resourceclaim controller puts on a claim it made from a template: the
/// name of the pod's claim entry (`spec.resourceClaims[].name`).
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// `(driver, pool, device)`: a device's identity in allocation results.
pub type DeviceKey = (String, String, String);

/// The allocator features kube-scheduler turns on from its feature gates (upstream's
/// `structured.Features`); [`Features::default`] is Kubernetes 1.37's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// `DRAAdminAccess`.
    pub admin_access: bool,
    /// `DRAPrioritizedList`: `firstAvailable`.
    pub prioritized_list: bool,
    /// `DRAPartitionableDevices`: shared counters, per-device node selection.
    pub partitionable_devices: bool,
    /// `DRADeviceTaints`: taints keep devices from requests that do not tolerate them.
    pub device_taints: bool,
    /// `DRADeviceBindingConditions` + `DRAResourceClaimDeviceStatus`.
    pub device_binding_and_status: bool,
    /// `DRAConsumableCapacity`: `allowMultipleAllocations`, capacity requests.
    pub consumable_capacity: bool,
}

impl Features {
    /// Every feature off (upstream's allocator tests start from this).
    pub const NONE: Features = Features {
        admin_access: false,
        prioritized_list: false,
        partitionable_devices: false,
        device_taints: false,
        device_binding_and_status: false,
        consumable_capacity: false,
    };
}

impl Default for Features {
    fn default() -> Self {
        Features {
            admin_access: true,
            prioritized_list: true,
            partitionable_devices: true,
            device_taints: true,
            device_binding_and_status: true,
            consumable_capacity: true,
        }
    }
}

/// Why the claims of a pod cannot be allocated (the reason a pod stays pending), in upstream's
/// words where it has them.
#[derive(Debug, thiserror::Error)]
pub enum Unallocatable {
    /// A request names a DeviceClass that does not exist.
    #[error(
        "claim {claim}, request {request}: could not retrieve device class {class}: deviceclass.resource.k8s.io \"{class}\" not found"
    )]
    MissingClass {
        /// The claim, `namespace/name`.
        claim: String,
        /// The request's name.
        request: String,
        /// The class it names.
        class: String,
    },
    /// A selector does not compile.
    #[error("{owner}: selector #{index}: CEL compile error: {message}")]
    SelectorCompile {
        /// `class <name>` or `claim <namespace>/<name>`.
        owner: String,
        /// The selector's index.
        index: usize,
        /// The compiler's message.
        message: String,
    },
    /// A selector failed on a device (a missing attribute, say): an allocation error, not a
    /// device that is not selected.
    #[error("{owner}: selector #{index} on device {device}: CEL runtime error: {message}")]
    SelectorRuntime {
        /// `class <name>` or `claim <namespace>/<name>`.
        owner: String,
        /// The selector's index.
        index: usize,
        /// `driver/pool/device`.
        device: String,
        /// The evaluator's message.
        message: String,
    },
    /// A request the allocator cannot serve as written.
    #[error("claim {claim}, request {request}: {what}")]
    Request {
        /// The claim, `namespace/name`.
        claim: String,
        /// The request's name.
        request: String,
        /// What is wrong.
        what: String,
    },
    /// A claim asks for more than 32 devices.
    #[error(
        "claim {claim}: number of requested devices {devices} exceeds the claim limit of {limit}"
    )]
    TooManyDevices {
        /// The claim, `namespace/name`.
        claim: String,
        /// How many.
        devices: usize,
        /// The limit.
        limit: usize,
    },
    /// A constraint with neither `matchAttribute` nor `distinctAttribute`.
    #[error("claim {claim}, constraint #{index}: empty constraint (unsupported constraint type?)")]
    EmptyConstraint {
        /// The claim, `namespace/name`.
        claim: String,
        /// The constraint's index.
        index: usize,
    },
    /// Nothing fit on this node, and some of its pools are invalid (a node's failure only).
    #[error("invalid resource pools were encountered")]
    InvalidPools,
    /// No node has devices for every request of every claim of the pod.
    #[error("0/{nodes} nodes are available: {nodes} cannot allocate all claims.")]
    NoFit {
        /// How many nodes were tried.
        nodes: usize,
    },
}

/// What allocated claims already hold (upstream's `AllocatedState`).
#[derive(Clone, Debug, Default)]
pub struct Usage {
    /// Devices held whole (results without `shareID`); admin-access results hold nothing.
    pub allocated: HashSet<DeviceKey>,
    /// Capacity consumed on shared devices (results with `shareID`), per capacity name.
    pub consumed: HashMap<DeviceKey, BTreeMap<String, Quantity>>,
}

impl Usage {
    /// The usage of every allocated claim in `claims`.
    pub fn from_claims<'a>(claims: impl IntoIterator<Item = &'a ResourceClaim>) -> Usage {
        let mut usage = Usage::default();
        for claim in claims {
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref());
            for r in results.into_iter().flatten() {
                if r.admin_access == Some(true) {
                    continue;
                }
                let key = (r.driver.clone(), r.pool.clone(), r.device.clone());
                if r.share_id.is_none() {
                    usage.allocated.insert(key);
                    continue;
                }
                let held = usage.consumed.entry(key).or_default();
                for (name, q) in r.consumed_capacity.iter().flatten() {
                    let q = capacity::read(q);
                    let now = match held.get(name) {
                        Some(h) => h.checked_add(&q).unwrap_or(*h),
                        None => q,
                    };
                    held.insert(name.clone(), now);
                }
            }
        }
        usage
    }

    /// Whether a device is allocated at all, whole or shared (`IsDeviceAllocated`).
    pub fn is_allocated(&self, key: &DeviceKey) -> bool {
        self.allocated.contains(key) || self.consumed.contains_key(key)
    }
}

/// The nodes to try: those of node-local slices in the order they first appear (slices by
/// name), then the other `nodes` by name.
pub fn candidate_nodes(slices: &[ResourceSlice], nodes: &[Node]) -> Vec<NodeView> {
    let labels = |name: &str| {
        nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .and_then(|n| n.metadata.labels.clone())
            .unwrap_or_default()
    };
    let mut ordered: Vec<&ResourceSlice> = slices.iter().collect();
    ordered.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let slice_nodes = ordered
        .iter()
        .filter_map(|s| s.spec.node_name.clone())
        .chain(
            ordered
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter_map(|d| d.node_name.clone()),
        );
    let mut node_names: Vec<String> = nodes
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    node_names.sort();
    for name in slice_nodes.chain(node_names) {
        if !name.is_empty() && seen.insert(name.clone()) {
            out.push(NodeView {
                labels: labels(&name),
                name,
            });
        }
    }
    out
}

/// Allocates `claims` (none allocated yet) on the first of `nodes` where they all fit (only
/// `node` when given: a pod pinned by a claim allocated earlier): the node and one allocation
/// per claim, in order. `share_id` makes the `shareID` of each result on a shared device.
#[allow(clippy::too_many_arguments)]
pub fn allocate_pod(
    claims: &[ResourceClaim],
    classes: &[DeviceClass],
    slices: &[ResourceSlice],
    nodes: &[NodeView],
    usage: &Usage,
    features: &Features,
    node: Option<&str>,
    share_id: &mut dyn FnMut() -> String,
) -> Result<(String, Vec<AllocationResult>), Unallocatable> {
    let pinned;
    let nodes: &[NodeView] = match node {
        Some(n) => {
            pinned = [nodes
                .iter()
                .find(|v| v.name == n)
                .cloned()
                .unwrap_or_else(|| NodeView {
                    name: n.to_string(),
                    labels: BTreeMap::new(),
                })];
            &pinned
        }
        None => nodes,
    };
    let mut invalid_pools = false;
    for n in nodes {
        match structured::allocate(claims, classes, slices, usage, n, features, share_id) {
            Ok(Some(results)) => return Ok((n.name.clone(), results)),
            Ok(None) => {}
            Err(Unallocatable::InvalidPools) => invalid_pools = true,
            Err(e) => return Err(e),
        }
    }
    if invalid_pools && nodes.len() == 1 {
        return Err(Unallocatable::InvalidPools);
    }
    Err(Unallocatable::NoFit { nodes: nodes.len() })
}

/// What one [`DraAllocator::reconcile`] pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Claims created from templates, `namespace/name`.
    pub created: Vec<String>,
    /// Pods placed, `namespace/name -> node`.
    pub bound: Vec<(String, String)>,
    /// Pods left pending, `namespace/name` with the reason.
    pub pending: Vec<(String, String)>,
    /// Claims deallocated or deleted because their pods are gone or finished.
    pub released: Vec<String>,
}

/// The sandbox's scheduler-and-controller for DRA pods (see the module docs).
#[derive(Clone)]
pub struct DraAllocator {
    client: Client,
    features: Features,
}

impl DraAllocator {
    /// An allocator acting through `client` (the sandbox API server's), with Kubernetes 1.37's
    /// allocator features.
    pub fn new(client: Client) -> DraAllocator {
        DraAllocator {
            client,
            features: Features::default(),
        }
    }

    /// The same allocator with other features (kube-scheduler's gates of another version).
    pub fn with_features(mut self, features: Features) -> DraAllocator {
        self.features = features;
        self
    }

    /// Runs [`DraAllocator::reconcile`] every `period` until the handle is aborted; a failed
    /// pass is logged and retried.
    pub fn spawn(self, period: Duration) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                if let Err(e) = self.reconcile().await {
                    tracing::debug!(error = %e, "sandbox DRA allocator pass failed");
                }
            }
        })
    }

    /// One pass: release, create claims from templates, place pending pods.
    pub async fn reconcile(&self) -> anyhow::Result<Pass> {
        let mut pass = Pass::default();
        let pods: Vec<Pod> = Api::<Pod>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing pods")?
            .items;
        self.release(&pods, &mut pass).await?;
        for pod in &pods {
            let has_claims = pod
                .spec
                .as_ref()
                .and_then(|s| s.resource_claims.as_ref())
                .is_some_and(|c| !c.is_empty());
            if !has_claims || finished(pod) {
                continue;
            }
            let names = self.ensure_claims(pod, &mut pass).await?;
            let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            if bound.is_some() {
                // A bound pod was placed by an earlier pass (or by hand): nothing to do.
                continue;
            }
            self.place(pod, &names, &mut pass).await?;
        }
        Ok(pass)
    }

    /// The pod's claim names, creating claims from templates where the pod has none yet.
    async fn ensure_claims(&self, pod: &Pod, pass: &mut Pass) -> anyhow::Result<Vec<String>> {
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let claims_api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &ns);
        let mut statuses: Vec<PodResourceClaimStatus> = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.clone())
            .unwrap_or_default();
        let mut changed = false;
        let mut names = Vec::new();
        for pc in pod
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .into_iter()
            .flatten()
        {
            if let Some(name) = &pc.resource_claim_name {
                names.push(name.clone());
                continue;
            }
            let Some(template) = &pc.resource_claim_template_name else {
                continue;
            };
            if let Some(name) = statuses
                .iter()
                .find(|s| s.name == pc.name)
                .and_then(|s| s.resource_claim_name.clone())
            {
                names.push(name);
                continue;
            }
            // An earlier pass may have created it and lost the answer: look first.
            let existing = claims_api
                .list(&ListParams::default())
                .await
                .context("listing claims")?
                .items
                .into_iter()
                .find(|c| {
                    owned_by(&c.metadata, &pod_uid)
                        && c.metadata
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get(POD_CLAIM_NAME_ANNOTATION))
                            == Some(&pc.name)
                });
            let name = match existing {
                Some(c) => c.metadata.name.unwrap_or_default(),
                None => {
                    let templates: Api<ResourceClaimTemplate> =
                        Api::namespaced(self.client.clone(), &ns);
                    let t = templates.get(template).await.with_context(|| {
                        format!("reading ResourceClaimTemplate {ns}/{template}")
                    })?;
                    let tspec = t.spec.unwrap_or_default();
                    let tmeta = tspec.metadata.unwrap_or_default();
                    let mut annotations = tmeta.annotations.unwrap_or_default();
                    annotations.insert(POD_CLAIM_NAME_ANNOTATION.into(), pc.name.clone());
                    let claim = ResourceClaim {
                        metadata: ObjectMeta {
                            generate_name: Some(format!("{pod_name}-{}-", pc.name)),
                            namespace: Some(ns.clone()),
                            labels: tmeta.labels,
                            annotations: Some(annotations),
                            owner_references: Some(vec![OwnerReference {
                                api_version: "v1".into(),
                                kind: "Pod".into(),
                                name: pod_name.clone(),
                                uid: pod_uid.clone(),
                                controller: Some(true),
                                block_owner_deletion: Some(true),
                            }]),
                            ..Default::default()
                        },
                        spec: tspec.spec,
                        status: None,
                    };
                    let made = claims_api
                        .create(&PostParams::default(), &claim)
                        .await
                        .context("creating a claim from its template")?;
                    let name = made.metadata.name.unwrap_or_default();
                    pass.created.push(format!("{ns}/{name}"));
                    name
                }
            };
            statuses.push(PodResourceClaimStatus {
                name: pc.name.clone(),
                resource_claim_name: Some(name.clone()),
            });
            changed = true;
            names.push(name);
        }
        if changed {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
            pods.patch_status(
                &pod_name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "resourceClaimStatuses": statuses } })),
            )
            .await
            .context("recording the pod's claims")?;
        }
        Ok(names)
    }

    async fn place(&self, pod: &Pod, names: &[String], pass: &mut Pass) -> anyhow::Result<()> {
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let id = format!("{ns}/{pod_name}");
        let claims_api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &ns);
        let mut mine = Vec::new();
        for n in names {
            match claims_api.get_opt(n).await.context("reading a claim")? {
                Some(c) => mine.push(c),
                None => {
                    return self
                        .unschedulable(pod, &format!("waiting for ResourceClaim {ns}/{n}"), pass)
                        .await;
                }
            }
        }
        let all_claims: Vec<ResourceClaim> = Api::<ResourceClaim>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing claims")?
            .items;
        let slices: Vec<ResourceSlice> = Api::<ResourceSlice>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing slices")?
            .items;
        let classes: Vec<DeviceClass> = Api::<DeviceClass>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing device classes")?
            .items;
        let nodes: Vec<Node> = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing nodes")?
            .items;
        // Claims allocated already (shared with another pod) pin the node.
        let pinned = mine.iter().find_map(|c| {
            c.status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.node_selector.as_ref())
                .and_then(|s| s.node_selector_terms.first())
                .and_then(|t| t.match_fields.as_ref())
                .and_then(|f| f.first())
                .and_then(|r| r.values.as_ref())
                .and_then(|v| v.first().cloned())
        });
        let todo: Vec<ResourceClaim> = mine
            .iter()
            .filter(|c| {
                c.status
                    .as_ref()
                    .and_then(|s| s.allocation.as_ref())
                    .is_none()
            })
            .cloned()
            .collect();
        let usage = Usage::from_claims(&all_claims);
        let candidates = candidate_nodes(&slices, &nodes);
        let placed = if todo.is_empty() {
            match pinned.clone() {
                Some(node) => Ok((node, Vec::new())),
                None => Err(Unallocatable::NoFit { nodes: 0 }),
            }
        } else {
            allocate_pod(
                &todo,
                &classes,
                &slices,
                &candidates,
                &usage,
                &self.features,
                pinned.as_deref(),
                &mut crate::apiserver::new_uid,
            )
        };
        let (node, allocations) = match placed {
            Ok(p) => p,
            Err(e) => return self.unschedulable(pod, &e.to_string(), pass).await,
        };
        let consumer = ResourceClaimConsumerReference {
            api_group: Some(String::new()),
            resource: "pods".into(),
            name: pod_name.clone(),
            uid: pod_uid.clone(),
        };
        let mut allocations = allocations.into_iter();
        for claim in &mine {
            let mut claim = claim.clone();
            let status = claim
                .status
                .get_or_insert_with(ResourceClaimStatus::default);
            if status.allocation.is_none() {
                status.allocation = allocations.next();
            }
            let reserved = status.reserved_for.get_or_insert_with(Vec::new);
            if !reserved.iter().any(|r| r.uid == pod_uid) {
                reserved.push(consumer.clone());
            }
            let name = claim.metadata.name.clone().unwrap_or_default();
            // The stored resourceVersion makes a concurrent writer's change a 409, not a
            // lost update; the next pass retries from what the API then holds.
            claims_api
                .replace_status(&name, &PostParams::default(), &claim)
                .await
                .with_context(|| format!("writing the allocation of {ns}/{name}"))?;
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let binding = json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": { "name": pod_name, "namespace": ns },
            "target": { "apiVersion": "v1", "kind": "Node", "name": node },
        });
        pods.create_subresource::<serde_json::Value, serde_json::Value>(
            "binding",
            &pod_name,
            &PostParams::default(),
            &binding,
        )
        .await
        .with_context(|| format!("binding {id} to {node}"))?;
        pass.bound.push((id, node));
        Ok(())
    }

    async fn unschedulable(&self, pod: &Pod, why: &str, pass: &mut Pass) -> anyhow::Result<()> {
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        pass.pending.push((format!("{ns}/{name}"), why.to_string()));
        let already = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "PodScheduled" && c.message.as_deref() == Some(why))
            });
        if already {
            return Ok(());
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        pods.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Strategic(json!({ "status": { "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": why,
            }] } })),
        )
        .await
        .context("marking a pod unschedulable")?;
        Ok(())
    }

    /// Drops finished or vanished pods from `reservedFor`; deallocates unreserved claims and
    /// deletes claims generated for pods that are gone or finished.
    async fn release(&self, pods: &[Pod], pass: &mut Pass) -> anyhow::Result<()> {
        let live: HashSet<&str> = pods
            .iter()
            .filter(|p| !finished(p))
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect();
        let claims: Vec<ResourceClaim> = Api::<ResourceClaim>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing claims")?
            .items;
        for claim in claims {
            let ns = claim.metadata.namespace.clone().unwrap_or_default();
            let name = claim.metadata.name.clone().unwrap_or_default();
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &ns);
            let generated_owner = claim
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(POD_CLAIM_NAME_ANNOTATION))
                .then(|| {
                    claim
                        .metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .find(|o| o.kind == "Pod" && o.controller == Some(true))
                        .map(|o| o.uid.clone())
                })
                .flatten();
            if let Some(owner) = &generated_owner
                && !live.contains(owner.as_str())
            {
                match api.delete(&name, &Default::default()).await {
                    Ok(_) => pass.released.push(format!("{ns}/{name}")),
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e).context("deleting a claim of a finished pod"),
                }
                continue;
            }
            let Some(status) = &claim.status else {
                continue;
            };
            let reserved = status.reserved_for.clone().unwrap_or_default();
            let kept: Vec<_> = reserved
                .iter()
                .filter(|r| r.resource != "pods" || live.contains(r.uid.as_str()))
                .cloned()
                .collect();
            if kept.len() == reserved.len() {
                continue;
            }
            let mut next = claim.clone();
            if let Some(s) = next.status.as_mut() {
                if kept.is_empty() {
                    s.allocation = None;
                    s.reserved_for = None;
                } else {
                    s.reserved_for = Some(kept);
                }
            }
            api.replace_status(&name, &PostParams::default(), &next)
                .await
                .with_context(|| format!("releasing {ns}/{name}"))?;
            pass.released.push(format!("{ns}/{name}"));
        }
        Ok(())
    }
}

fn owned_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == uid && o.controller == Some(true))
}

fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    ) || pod.metadata.deletion_timestamp.is_some()
}
