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
//!   the condition `PodScheduled=False` (`Unschedulable`) with the reason;
//! - claims reserved for pods that are gone or finished are released: the pod leaves
//!   `reservedFor`, an unreserved claim is deallocated, and a claim generated for a pod that
//!   is gone is deleted (the garbage collector's part).
//!
//! [`allocate_pod`] is first fit, as upstream's allocator: nodes in the order their slices
//! list, devices in slice order, the first device that satisfies a request is taken (with
//! backtracking when a constraint fails). What it honours: the newest generation of each
//! pool; DeviceClass and request selectors that are conjunctions (`&&`) of
//! `device.driver == "<name>"`, `has(device.attributes["<domain>"].<name>)` and
//! `device.attributes["<domain>"].<name> == <literal>` (a
//! string, integer or boolean literal) ([`parse_selector`]);
//! `allowMultipleAllocations` with `capacity.requests` and the capacity's `requestPolicy`
//! (default, valid values, valid range with min/max/step, rounding up as upstream), several
//! requests of one claim sharing a device; exclusive use of devices without
//! `allowMultipleAllocations`; `matchAttribute` and `distinctAttribute` constraints; device
//! taints with `NoSchedule`/`NoExecute` unless tolerated; `allocationMode: ExactCount` with
//! `count`. What it refuses with a typed reason ([`Unallocatable`]): other CEL expressions,
//! `firstAvailable`, `allocationMode: All`, `adminAccess`. What it does not do: scoring,
//! preemption, partitionable devices (shared counters), binding conditions, device status,
//! `extendedResourceName`, claim configuration (`config` is not copied).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodResourceClaimStatus,
};
use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceAllocationResult, DeviceAttribute, DeviceCapacity, DeviceClass,
    DeviceRequestAllocationResult, DeviceTaint, DeviceToleration, ExactDeviceRequest,
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus, ResourceClaimTemplate,
    ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::task::JoinHandle;

use gpushare_core::{QuantityError, parse_whole_quantity};

/// The annotation the resourceclaim controller puts on a claim it made from a template: the
/// name of the pod's claim entry (`spec.resourceClaims[].name`).
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// Why the claims of a pod cannot be allocated (the reason a pod stays pending).
#[derive(Debug, thiserror::Error)]
pub enum Unallocatable {
    /// A request names a DeviceClass that does not exist.
    #[error("claim {claim}: request {request}: DeviceClass {class:?} not found")]
    MissingClass {
        /// The claim's name.
        claim: String,
        /// The request's name.
        request: String,
        /// The class it names.
        class: String,
    },
    /// A selector the sandbox cannot evaluate (it has no CEL interpreter).
    #[error(
        "claim {claim}: request {request}: selector {expression:?} is not supported by the sandbox allocator (only device.driver == \"<name>\")"
    )]
    UnsupportedSelector {
        /// The claim's name.
        claim: String,
        /// The request's name.
        request: String,
        /// The CEL expression.
        expression: String,
    },
    /// A request shape the sandbox allocator does not implement.
    #[error("claim {claim}: request {request}: {what} is not supported by the sandbox allocator")]
    UnsupportedRequest {
        /// The claim's name.
        claim: String,
        /// The request's name.
        request: String,
        /// What it asks for.
        what: &'static str,
    },
    /// A quantity (a capacity request, a device's capacity or policy) that cannot be read.
    #[error("claim {claim}: {field}: {source}")]
    Quantity {
        /// The claim's name.
        claim: String,
        /// Which quantity.
        field: String,
        /// Why.
        #[source]
        source: QuantityError,
    },
    /// No node has devices for every request of every claim of the pod.
    #[error("no node has devices for the pod's claims ({nodes} node(s) with slices tried)")]
    NoFit {
        /// How many nodes were tried.
        nodes: usize,
    },
}

/// `(driver, pool, device)`: a device's identity in allocation results.
pub type DeviceKey = (String, String, String);

/// One device of a published slice, with where it lives.
#[derive(Clone, Debug)]
pub struct SliceDevice {
    /// The slice's driver.
    pub driver: String,
    /// The slice's pool.
    pub pool: String,
    /// The slice's node (`spec.nodeName`), `None` for `allNodes` slices.
    pub node: Option<String>,
    /// The device as published.
    pub device: Device,
}

impl SliceDevice {
    fn key(&self) -> DeviceKey {
        (
            self.driver.clone(),
            self.pool.clone(),
            self.device.name.clone(),
        )
    }

    fn shared(&self) -> bool {
        self.device.allow_multiple_allocations == Some(true)
    }
}

/// Every allocatable device, in slice order: slices by name (the order the API lists them),
/// devices in their slice's order; only the newest generation of each pool counts.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    /// The devices, in first-fit order.
    pub devices: Vec<SliceDevice>,
}

impl Inventory {
    /// The inventory of these slices.
    pub fn from_slices(slices: &[ResourceSlice]) -> Inventory {
        let mut newest: HashMap<(&str, &str), i64> = HashMap::new();
        for s in slices {
            let g = newest
                .entry((s.spec.driver.as_str(), s.spec.pool.name.as_str()))
                .or_insert(s.spec.pool.generation);
            *g = (*g).max(s.spec.pool.generation);
        }
        let mut ordered: Vec<&ResourceSlice> = slices.iter().collect();
        ordered.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let mut devices = Vec::new();
        for s in ordered {
            let key = (s.spec.driver.as_str(), s.spec.pool.name.as_str());
            if newest.get(&key) != Some(&s.spec.pool.generation) {
                continue;
            }
            let node = if s.spec.all_nodes == Some(true) {
                None
            } else {
                match &s.spec.node_name {
                    Some(n) => Some(n.clone()),
                    // Node selectors are not evaluated: such slices are skipped.
                    None => continue,
                }
            };
            for d in s.spec.devices.iter().flatten() {
                devices.push(SliceDevice {
                    driver: s.spec.driver.clone(),
                    pool: s.spec.pool.name.clone(),
                    node: node.clone(),
                    device: d.clone(),
                });
            }
        }
        Inventory { devices }
    }

    /// The nodes with node-local devices, in the order their first device appears.
    pub fn nodes(&self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.devices
            .iter()
            .filter_map(|d| d.node.clone())
            .filter(|n| seen.insert(n.clone()))
            .collect()
    }
}

/// What allocated claims already hold.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    /// Devices held whole (no `allowMultipleAllocations`), or by a result without
    /// `consumedCapacity`.
    pub exclusive: HashSet<DeviceKey>,
    /// Capacity consumed on shared devices, per capacity name, in the capacity's base unit.
    pub consumed: HashMap<DeviceKey, BTreeMap<String, u64>>,
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
                let key = (r.driver.clone(), r.pool.clone(), r.device.clone());
                match (&r.share_id, &r.consumed_capacity) {
                    (Some(_), Some(consumed)) => {
                        let held = usage.consumed.entry(key).or_default();
                        for (name, q) in consumed {
                            // A stored result was written by an allocator; an unreadable one
                            // counts as nothing rather than stopping every allocation.
                            let v = parse_whole_quantity(&q.0).unwrap_or(0);
                            *held.entry(name.clone()).or_default() += v;
                        }
                    }
                    (Some(_), None) => {
                        usage.consumed.entry(key).or_default();
                    }
                    (None, _) => {
                        usage.exclusive.insert(key);
                    }
                }
            }
        }
        usage
    }
}

/// One device to find: one of `count` of a request.
struct Slot<'a> {
    claim: usize,
    request: &'a str,
    exact: &'a ExactDeviceRequest,
    /// Every term of every selector of the class and the request (all must hold).
    terms: Vec<SelectorTerm>,
    /// Requested capacity, base units.
    capacity: BTreeMap<String, u64>,
}

/// A pure first-fit allocation of `claims` (none allocated yet) on one node: the node and
/// one allocation per claim, in order. `node` restricts the choice (a pod already bound);
/// `share_id` makes the `shareID` of each result on a shared device.
pub fn allocate_pod(
    claims: &[ResourceClaim],
    classes: &[DeviceClass],
    inventory: &Inventory,
    usage: &Usage,
    node: Option<&str>,
    share_id: &mut dyn FnMut() -> String,
) -> Result<(String, Vec<AllocationResult>), Unallocatable> {
    let slots = slots(claims, classes)?;
    let nodes: Vec<String> = match node {
        Some(n) => vec![n.to_string()],
        None => inventory.nodes(),
    };
    for n in &nodes {
        let candidates: Vec<&SliceDevice> = inventory
            .devices
            .iter()
            .filter(|d| d.node.as_deref().is_none_or(|dn| dn == n))
            .collect();
        let mut search = Search {
            claims,
            slots: &slots,
            candidates: &candidates,
            usage: usage.clone(),
            chosen: Vec::new(),
        };
        if search.run(0)? {
            let mut results: Vec<Vec<DeviceRequestAllocationResult>> =
                vec![Vec::new(); claims.len()];
            for (slot, choice) in slots.iter().zip(&search.chosen) {
                let d = candidates[choice.device];
                let shared = d.shared();
                results[slot.claim].push(DeviceRequestAllocationResult {
                    request: slot.request.to_string(),
                    driver: d.driver.clone(),
                    pool: d.pool.clone(),
                    device: d.device.name.clone(),
                    share_id: shared.then(&mut *share_id),
                    consumed_capacity: shared.then(|| {
                        choice
                            .consumed
                            .iter()
                            .map(|(k, v)| (k.clone(), Quantity(format_quantity(*v))))
                            .collect()
                    }),
                    tolerations: slot.exact.tolerations.clone(),
                    ..Default::default()
                });
            }
            let allocations = results
                .into_iter()
                .map(|results| AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        config: None,
                    }),
                    node_selector: Some(node_selector(n)),
                    allocation_timestamp: None,
                })
                .collect();
            return Ok((n.clone(), allocations));
        }
    }
    Err(Unallocatable::NoFit { nodes: nodes.len() })
}

/// Upstream's node selector for an allocation from node-local slices.
fn node_selector(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".into(),
                operator: "In".into(),
                values: Some(vec![node.to_string()]),
            }]),
            match_expressions: None,
        }],
    }
}

/// The slots of every claim, in claim then request order.
fn slots<'a>(
    claims: &'a [ResourceClaim],
    classes: &[DeviceClass],
) -> Result<Vec<Slot<'a>>, Unallocatable> {
    let mut out = Vec::new();
    for (ci, claim) in claims.iter().enumerate() {
        let cname = claim.metadata.name.clone().unwrap_or_default();
        let requests = claim
            .spec
            .as_ref()
            .and_then(|s| s.devices.as_ref())
            .and_then(|d| d.requests.as_ref());
        for r in requests.into_iter().flatten() {
            let unsupported = |what| Unallocatable::UnsupportedRequest {
                claim: cname.clone(),
                request: r.name.clone(),
                what,
            };
            let exact = match (&r.exactly, &r.first_available) {
                (Some(e), _) => e,
                (None, Some(_)) => return Err(unsupported("firstAvailable")),
                (None, None) => return Err(unsupported("a request without `exactly`")),
            };
            if exact.admin_access == Some(true) {
                return Err(unsupported("adminAccess"));
            }
            let count = match exact.allocation_mode.as_deref() {
                None | Some("ExactCount") => exact.count.unwrap_or(1).max(1),
                Some(_) => return Err(unsupported("an allocationMode other than ExactCount")),
            };
            let class = classes
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(exact.device_class_name.as_str()))
                .ok_or_else(|| Unallocatable::MissingClass {
                    claim: cname.clone(),
                    request: r.name.clone(),
                    class: exact.device_class_name.clone(),
                })?;
            let mut terms = Vec::new();
            let selectors = class
                .spec
                .as_ref()
                .and_then(|s| s.selectors.as_ref())
                .into_iter()
                .flatten()
                .chain(exact.selectors.iter().flatten());
            for s in selectors {
                let Some(cel) = &s.cel else { continue };
                match parse_selector(&cel.expression) {
                    Some(t) => terms.extend(t),
                    None => {
                        return Err(Unallocatable::UnsupportedSelector {
                            claim: cname.clone(),
                            request: r.name.clone(),
                            expression: cel.expression.clone(),
                        });
                    }
                }
            }
            let mut capacity = BTreeMap::new();
            for (name, q) in exact
                .capacity
                .as_ref()
                .and_then(|c| c.requests.as_ref())
                .into_iter()
                .flatten()
            {
                let v = parse_whole_quantity(&q.0).map_err(|source| Unallocatable::Quantity {
                    claim: cname.clone(),
                    field: format!("request {} capacity {name}", r.name),
                    source,
                })?;
                capacity.insert(name.clone(), v);
            }
            for _ in 0..count {
                out.push(Slot {
                    claim: ci,
                    request: &r.name,
                    exact,
                    terms: terms.clone(),
                    capacity: capacity.clone(),
                });
            }
        }
    }
    Ok(out)
}

/// The driver named by a `device.driver == "<name>"` expression (either quote), else `None`.
pub fn driver_selector(expression: &str) -> Option<String> {
    let rest = expression
        .trim()
        .strip_prefix("device.driver")?
        .trim_start();
    let rest = rest.strip_prefix("==")?.trim();
    let quote = rest.chars().next().filter(|c| *c == '"' || *c == '\'')?;
    let inner = rest.strip_prefix(quote)?.strip_suffix(quote)?;
    (!inner.contains(quote) && !inner.contains('\\')).then(|| inner.to_string())
}

/// A literal a selector compares an attribute with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Literal {
    /// `"text"` or `'text'`.
    String(String),
    /// `42`.
    Int(i64),
    /// `true` / `false`.
    Bool(bool),
}

/// One term of a selector the sandbox evaluates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SelectorTerm {
    /// `device.driver == "<name>"`.
    Driver(String),
    /// `device.attributes["<domain>"].<name> == <literal>`: the qualified name
    /// `<domain>/<name>` and the literal.
    Attribute(String, Literal),
    /// `has(device.attributes["<domain>"].<name>)`: the device has the attribute.
    Has(String),
}

impl SelectorTerm {
    fn holds(&self, d: &SliceDevice) -> bool {
        match self {
            SelectorTerm::Driver(x) => *x == d.driver,
            SelectorTerm::Has(name) => attribute(d, name).is_some(),
            SelectorTerm::Attribute(name, want) => attribute(d, name).is_some_and(|a| match want {
                Literal::String(v) => a.string.as_deref() == Some(v.as_str()),
                Literal::Int(v) => a.int == Some(*v),
                Literal::Bool(v) => a.bool == Some(*v),
            }),
        }
    }
}

/// The terms of a selector the sandbox can evaluate: `&&` of [`driver_selector`] terms and
/// `device.attributes["<domain>"].<name> == <literal>`; `None` for anything else (`||`,
/// `!=`, functions, capacity, a string holding `&&`).
pub fn parse_selector(expression: &str) -> Option<Vec<SelectorTerm>> {
    expression
        .split("&&")
        .map(|term| {
            let term = term.trim();
            if let Some(d) = driver_selector(term) {
                return Some(SelectorTerm::Driver(d));
            }
            if let Some(inner) = term.strip_prefix("has(").and_then(|t| t.strip_suffix(')')) {
                let (name, rest) = attribute_reference(inner.trim())?;
                return rest.trim().is_empty().then_some(SelectorTerm::Has(name));
            }
            let (name, rest) = attribute_reference(term)?;
            let rest = rest.trim_start().strip_prefix("==")?.trim();
            let literal = match rest {
                "true" => Literal::Bool(true),
                "false" => Literal::Bool(false),
                _ => match rest.chars().next()? {
                    q @ ('"' | '\'') => {
                        let inner = rest.strip_prefix(q)?.strip_suffix(q)?;
                        if inner.contains(q) || inner.contains('\\') {
                            return None;
                        }
                        Literal::String(inner.to_string())
                    }
                    _ => Literal::Int(rest.parse().ok()?),
                },
            };
            Some(SelectorTerm::Attribute(name, literal))
        })
        .collect()
}

/// `device.attributes["<domain>"].<name>` at the start of `term`: the qualified name and what
/// follows.
fn attribute_reference(term: &str) -> Option<(String, &str)> {
    let rest = term.strip_prefix("device.attributes[")?;
    let quote = rest.chars().next().filter(|c| *c == '"' || *c == '\'')?;
    let rest = &rest[1..];
    let end = rest.find(quote)?;
    let domain = &rest[..end];
    let rest = rest[end + 1..].strip_prefix("].")?;
    let name_end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = &rest[..name_end];
    if domain.is_empty() || name.is_empty() {
        return None;
    }
    Some((format!("{domain}/{name}"), &rest[name_end..]))
}

struct Choice {
    device: usize,
    consumed: BTreeMap<String, u64>,
}

struct Search<'a> {
    claims: &'a [ResourceClaim],
    slots: &'a [Slot<'a>],
    candidates: &'a [&'a SliceDevice],
    usage: Usage,
    chosen: Vec<Choice>,
}

impl Search<'_> {
    fn run(&mut self, i: usize) -> Result<bool, Unallocatable> {
        let Some(slot) = self.slots.get(i) else {
            return Ok(true);
        };
        for (di, d) in self.candidates.iter().enumerate() {
            if !slot.terms.iter().all(|t| t.holds(d)) || !tolerated(d, slot.exact) {
                continue;
            }
            if !self.constraints_hold(i, d) {
                continue;
            }
            let key = d.key();
            if self.usage.exclusive.contains(&key) {
                continue;
            }
            let cname = self.claims[slot.claim]
                .metadata
                .name
                .clone()
                .unwrap_or_default();
            let consumed = if d.shared() {
                match consumption(&cname, slot, d, self.usage.consumed.get(&key))? {
                    Some(c) => c,
                    None => continue,
                }
            } else {
                if self.usage.consumed.contains_key(&key) || !fits_whole(&cname, slot, d)? {
                    continue;
                }
                BTreeMap::new()
            };
            let before = self.usage.clone();
            if d.shared() {
                let held = self.usage.consumed.entry(key).or_default();
                for (k, v) in &consumed {
                    *held.entry(k.clone()).or_default() += v;
                }
            } else {
                self.usage.exclusive.insert(key);
            }
            self.chosen.push(Choice {
                device: di,
                consumed,
            });
            if self.run(i + 1)? {
                return Ok(true);
            }
            self.chosen.pop();
            self.usage = before;
        }
        Ok(false)
    }

    /// Whether `d` keeps the claim's `matchAttribute`/`distinctAttribute` constraints with
    /// the devices chosen so far for the same claim.
    fn constraints_hold(&self, i: usize, d: &SliceDevice) -> bool {
        let slot = &self.slots[i];
        let claim = &self.claims[slot.claim];
        let constraints = claim
            .spec
            .as_ref()
            .and_then(|s| s.devices.as_ref())
            .and_then(|x| x.constraints.as_ref());
        for c in constraints.into_iter().flatten() {
            let covers = |request: &str| {
                c.requests
                    .as_ref()
                    .is_none_or(|r| r.is_empty() || r.iter().any(|x| x == request))
            };
            if !covers(slot.request) {
                continue;
            }
            let others = self
                .chosen
                .iter()
                .zip(self.slots)
                .filter(|(_, s)| s.claim == slot.claim && covers(s.request));
            if let Some(name) = &c.match_attribute {
                let Some(mine) = attribute(d, name) else {
                    return false;
                };
                if others
                    .clone()
                    .any(|(ch, _)| attribute(self.candidates[ch.device], name) != Some(mine))
                {
                    return false;
                }
            }
            if let Some(name) = &c.distinct_attribute {
                let Some(mine) = attribute(d, name) else {
                    return false;
                };
                if others
                    .clone()
                    .any(|(ch, _)| attribute(self.candidates[ch.device], name) == Some(mine))
                {
                    return false;
                }
            }
        }
        true
    }
}

/// A device attribute by its qualified name; a name in the driver's own domain also matches
/// the short name the slice may use.
fn attribute<'a>(d: &'a SliceDevice, qualified: &str) -> Option<&'a DeviceAttribute> {
    let attrs = d.device.attributes.as_ref()?;
    if let Some(a) = attrs.get(qualified) {
        return Some(a);
    }
    let (domain, id) = qualified.split_once('/')?;
    (domain == d.driver).then(|| attrs.get(id)).flatten()
}

/// Whether the request tolerates every scheduling taint of the device.
fn tolerated(d: &SliceDevice, exact: &ExactDeviceRequest) -> bool {
    d.device.taints.iter().flatten().all(|t| {
        !matches!(t.effect.as_str(), "NoSchedule" | "NoExecute")
            || exact
                .tolerations
                .iter()
                .flatten()
                .any(|tol| tolerates(tol, t))
    })
}

fn tolerates(tol: &DeviceToleration, t: &DeviceTaint) -> bool {
    let effect = tol
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == t.effect);
    let exists = tol.operator.as_deref() == Some("Exists");
    let key = tol.key.as_deref().is_none_or(|k| k.is_empty()) && exists
        || tol.key.as_deref() == Some(t.key.as_str());
    let value = exists || tol.value.as_deref().unwrap_or("") == t.value.as_deref().unwrap_or("");
    effect && key && value
}

fn read(claim: &str, field: impl FnOnce() -> String, q: &Quantity) -> Result<u64, Unallocatable> {
    parse_whole_quantity(&q.0).map_err(|source| Unallocatable::Quantity {
        claim: claim.to_string(),
        field: field(),
        source,
    })
}

/// What a slot consumes of a shared device (every capacity the device has), or `None` when
/// the request does not fit: a capacity the device lacks, a policy violation, or not enough
/// left.
fn consumption(
    claim: &str,
    slot: &Slot<'_>,
    d: &SliceDevice,
    held: Option<&BTreeMap<String, u64>>,
) -> Result<Option<BTreeMap<String, u64>>, Unallocatable> {
    let capacity = d.device.capacity.clone().unwrap_or_default();
    if slot.capacity.keys().any(|k| !capacity.contains_key(k)) {
        return Ok(None);
    }
    let mut out = BTreeMap::new();
    for (name, cap) in &capacity {
        let field = || format!("device {} capacity {name}", d.device.name);
        let total = read(claim, field, &cap.value)?;
        let Some(consumed) =
            consumed_capacity(claim, d, name, slot.capacity.get(name).copied(), cap)?
        else {
            return Ok(None);
        };
        let already = held.and_then(|h| h.get(name)).copied().unwrap_or(0);
        if already.saturating_add(consumed) > total {
            return Ok(None);
        }
        out.insert(name.clone(), consumed);
    }
    Ok(Some(out))
}

/// Upstream's `calculateConsumedCapacity` and policy check: no request takes the policy's
/// default (else the whole capacity); a request is rounded up to the next valid value, or
/// to `min` and then to `min + n × step`; `None` when the result violates the policy.
pub fn consumed_capacity(
    claim: &str,
    d: &SliceDevice,
    name: &str,
    requested: Option<u64>,
    cap: &DeviceCapacity,
) -> Result<Option<u64>, Unallocatable> {
    let q = |label: &'static str, v: &Quantity| {
        read(
            claim,
            || format!("device {} capacity {name} {label}", d.device.name),
            v,
        )
    };
    let policy = cap.request_policy.as_ref();
    let Some(requested) = requested else {
        return Ok(Some(match policy.and_then(|p| p.default.as_ref()) {
            Some(default) => q("default", default)?,
            None => q("value", &cap.value)?,
        }));
    };
    let Some(policy) = policy else {
        return Ok(Some(requested));
    };
    if let Some(values) = &policy.valid_values {
        let mut values = values
            .iter()
            .map(|v| q("validValues", v))
            .collect::<Result<Vec<_>, _>>()?;
        values.sort_unstable();
        return Ok(values.into_iter().find(|v| *v >= requested));
    }
    if let Some(range) = &policy.valid_range {
        let min = q("validRange.min", &range.min)?;
        let mut consumed = requested.max(min);
        if let Some(step) = &range.step {
            let step = q("validRange.step", step)?;
            if step > 0 {
                let added = consumed - min;
                let n = added.div_ceil(step);
                consumed = match n.checked_mul(step).and_then(|x| x.checked_add(min)) {
                    Some(c) => c,
                    None => return Ok(None),
                };
            }
        }
        if let Some(max) = &range.max
            && consumed > q("validRange.max", max)?
        {
            return Ok(None);
        }
        return Ok(Some(consumed));
    }
    Ok(Some(requested))
}

/// Whether an exclusive device satisfies the slot's capacity requests (each at most the
/// device's capacity).
fn fits_whole(claim: &str, slot: &Slot<'_>, d: &SliceDevice) -> Result<bool, Unallocatable> {
    let capacity = d.device.capacity.clone().unwrap_or_default();
    for (name, want) in &slot.capacity {
        let Some(cap) = capacity.get(name) else {
            return Ok(false);
        };
        if read(
            claim,
            || format!("device {} capacity {name}", d.device.name),
            &cap.value,
        )? < *want
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A byte count as Kubernetes writes it canonically: the largest binary suffix that divides
/// it exactly, else the plain number.
pub fn format_quantity(v: u64) -> String {
    const SUFFIXES: [(&str, u32); 6] = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ];
    if v == 0 {
        return "0".into();
    }
    for (suffix, shift) in SUFFIXES {
        if v.trailing_zeros() >= shift {
            return format!("{}{suffix}", v >> shift);
        }
    }
    v.to_string()
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
}

impl DraAllocator {
    /// An allocator acting through `client` (the sandbox API server's).
    pub fn new(client: Client) -> DraAllocator {
        DraAllocator { client }
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
        let inventory = Inventory::from_slices(&slices);
        let placed = if todo.is_empty() {
            match pinned.clone() {
                Some(node) => Ok((node, Vec::new())),
                None => Err(Unallocatable::NoFit { nodes: 0 }),
            }
        } else {
            allocate_pod(
                &todo,
                &classes,
                &inventory,
                &usage,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const GI: u64 = 1 << 30;

    fn slice(node: &str, generation: i64, devices: Value) -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": { "name": format!("{node}-gpushare.io") },
            "spec": { "driver": "gpushare.io", "nodeName": node,
                      "pool": { "name": node, "generation": generation, "resourceSliceCount": 1 },
                      "devices": devices },
        }))
        .expect("a slice")
    }

    fn gpu(name: &str, uuid: &str, gib: u64) -> Value {
        json!({
            "name": name, "allowMultipleAllocations": true,
            "attributes": { "uuid": { "string": uuid } },
            "capacity": { "memory": { "value": format!("{gib}Gi"),
                "requestPolicy": { "default": format!("{gib}Gi"),
                    "validRange": { "min": "1Gi", "max": format!("{gib}Gi"), "step": "1Gi" } } } },
        })
    }

    fn class() -> DeviceClass {
        serde_json::from_value(json!({
            "metadata": { "name": "gpu-mem.gpushare.io" },
            "spec": { "selectors": [{ "cel": { "expression": "device.driver == \"gpushare.io\"" } }] },
        }))
        .expect("a class")
    }

    /// A claim with one request per amount (`None`: no capacity request), optionally all on
    /// one GPU.
    fn claim(name: &str, amounts: &[Option<&str>], same_gpu: bool) -> ResourceClaim {
        let requests: Vec<Value> = amounts
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let mut exactly = json!({ "deviceClassName": "gpu-mem.gpushare.io" });
                if let Some(a) = a {
                    exactly["capacity"] = json!({ "requests": { "memory": a } });
                }
                json!({ "name": format!("r{i}"), "exactly": exactly })
            })
            .collect();
        let constraints = if same_gpu {
            json!([{ "matchAttribute": "gpushare.io/uuid" }])
        } else {
            json!([])
        };
        serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "devices": { "requests": requests, "constraints": constraints } },
        }))
        .expect("a claim")
    }

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("share-{n}")
        }
    }

    fn results(a: &AllocationResult) -> Vec<(String, String, Option<String>)> {
        a.devices
            .as_ref()
            .and_then(|d| d.results.as_ref())
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r.request.clone(),
                    r.device.clone(),
                    r.consumed_capacity
                        .as_ref()
                        .and_then(|c| c.get("memory"))
                        .map(|q| q.0.clone()),
                )
            })
            .collect()
    }

    fn allocate(
        claims: &[ResourceClaim],
        slices: &[ResourceSlice],
        usage: &Usage,
    ) -> Result<(String, Vec<AllocationResult>), Unallocatable> {
        allocate_pod(
            claims,
            &[class()],
            &Inventory::from_slices(slices),
            usage,
            None,
            &mut ids(),
        )
    }

    #[test]
    fn requests_round_up_as_upstream_and_no_request_takes_the_default() {
        let s = slice("n", 1, json!([gpu("gpu-0", "U0", 16)]));
        let d = &Inventory::from_slices(&[s]).devices[0];
        let cap = &d.device.capacity.as_ref().expect("capacity")["memory"];
        let c = |req: Option<u64>| consumed_capacity("c", d, "memory", req, cap).expect("reads");
        assert_eq!(c(None), Some(16 * GI), "the default: the whole GPU");
        assert_eq!(c(Some(1)), Some(GI), "below min: min");
        assert_eq!(c(Some(GI + 1)), Some(2 * GI), "rounded up to a step");
        assert_eq!(c(Some(4 * GI)), Some(4 * GI));
        assert_eq!(c(Some(17 * GI)), None, "above max");
        let values: DeviceCapacity = serde_json::from_value(json!({
            "value": "16Gi", "requestPolicy": { "validValues": ["8Gi", "2Gi", "4Gi"] } }))
        .expect("capacity");
        let v = |req| consumed_capacity("c", d, "memory", Some(req), &values).expect("reads");
        assert_eq!(v(3 * GI), Some(4 * GI), "the next valid value");
        assert_eq!(v(9 * GI), None, "beyond every valid value");
        let bare: DeviceCapacity = serde_json::from_value(json!({ "value": "16Gi" })).expect("c");
        assert_eq!(
            consumed_capacity("c", d, "memory", None, &bare).expect("reads"),
            Some(16 * GI),
            "no policy, no request: the whole capacity"
        );
    }

    /// Allocates `claim` against what `held` holds and records it there; the device of each
    /// result.
    fn place(
        held: &mut Vec<ResourceClaim>,
        slices: &[ResourceSlice],
        mut c: ResourceClaim,
    ) -> Result<Vec<(String, String, Option<String>)>, Unallocatable> {
        let usage = Usage::from_claims(held.iter());
        let (_, allocs) = allocate(std::slice::from_ref(&c), slices, &usage)?;
        let allocation = allocs.into_iter().next().expect("one per claim");
        let out = results(&allocation);
        c.status = Some(ResourceClaimStatus {
            allocation: Some(allocation),
            ..Default::default()
        });
        held.push(c);
        Ok(out)
    }

    #[test]
    fn first_fit_fills_the_first_gpu_then_the_next_then_refuses() {
        let slices = [slice(
            "n",
            1,
            json!([gpu("gpu-0", "U0", 16), gpu("gpu-1", "U1", 16)]),
        )];
        let mut held = Vec::new();
        let mut placed = Vec::new();
        for i in 0..4 {
            let r = place(
                &mut held,
                &slices,
                claim(&format!("c{i}"), &[Some("6Gi")], false),
            )
            .expect("fits");
            placed.push(r[0].1.clone());
            assert_eq!(r[0].2.as_deref(), Some("6Gi"));
        }
        assert_eq!(placed, ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]);
        let usage = Usage::from_claims(held.iter());
        let key = (
            "gpushare.io".to_string(),
            "n".to_string(),
            "gpu-0".to_string(),
        );
        assert_eq!(usage.consumed[&key]["memory"], 12 * GI);
        let err = place(&mut held, &slices, claim("c4", &[Some("6Gi")], false))
            .expect_err("4 GiB left on each GPU");
        assert!(matches!(err, Unallocatable::NoFit { nodes: 1 }), "{err}");
        // A smaller one still fits the first GPU; a claim with no request takes a whole one.
        let r = place(&mut held, &slices, claim("c5", &[Some("3Gi")], false)).expect("fits");
        assert_eq!(r[0].1, "gpu-0");
        let err =
            place(&mut held, &slices, claim("c6", &[None], false)).expect_err("no GPU is free");
        assert!(matches!(err, Unallocatable::NoFit { .. }));
    }

    #[test]
    fn share_ids_are_unique_per_result_and_results_follow_requests() {
        let slices = [slice("n", 1, json!([gpu("gpu-0", "U0", 16)]))];
        let c = claim("c", &[Some("2Gi"), Some("1500Mi")], true);
        let (node, allocs) = allocate(&[c], &slices, &Usage::default()).expect("fits");
        assert_eq!(node, "n");
        let a = &allocs[0];
        let r = a
            .devices
            .as_ref()
            .and_then(|d| d.results.clone())
            .expect("results");
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].request.as_str(), r[1].request.as_str()), ("r0", "r1"));
        assert_eq!(r[0].share_id.as_deref(), Some("share-1"));
        assert_eq!(r[1].share_id.as_deref(), Some("share-2"));
        assert_eq!(
            r[1].consumed_capacity
                .as_ref()
                .map(|c| c["memory"].0.clone()),
            Some("2Gi".into()),
            "1500Mi rounds up to the 1Gi step"
        );
        let sel = a.node_selector.as_ref().expect("node-local");
        assert_eq!(
            sel.node_selector_terms[0]
                .match_fields
                .as_ref()
                .expect("fields")[0]
                .values,
            Some(vec!["n".to_string()])
        );
    }

    #[test]
    fn match_attribute_backtracks_to_a_gpu_that_holds_every_request() {
        let slices = [slice(
            "n",
            1,
            json!([gpu("gpu-0", "U0", 16), gpu("gpu-1", "U1", 16)]),
        )];
        let mut held = Vec::new();
        place(&mut held, &slices, claim("big", &[Some("10Gi")], false)).expect("fits");
        // 6 GiB left on gpu-0: 4 + 4 fits only gpu-1 when both must share one GPU ...
        let r = place(
            &mut held,
            &slices,
            claim("pair", &[Some("4Gi"), Some("4Gi")], true),
        )
        .expect("fits");
        assert_eq!((r[0].1.as_str(), r[1].1.as_str()), ("gpu-1", "gpu-1"));
        // ... and splits across GPUs without the constraint.
        let r = place(
            &mut held,
            &slices,
            claim("loose", &[Some("4Gi"), Some("6Gi")], false),
        )
        .expect("fits");
        assert_eq!((r[0].1.as_str(), r[1].1.as_str()), ("gpu-0", "gpu-1"));
    }

    #[test]
    fn tainted_gpus_stale_pools_and_exclusive_devices_are_skipped() {
        let mut tainted = gpu("gpu-0", "U0", 16);
        tainted["taints"] = json!([{ "key": "gpushare.io/unhealthy", "effect": "NoSchedule" }]);
        let slices = [
            slice("n", 2, json!([tainted, gpu("gpu-1", "U1", 16)])),
            // An older generation of the same pool (its slice sorts later): ignored.
            {
                let mut old = slice("n", 1, json!([gpu("gpu-9", "U9", 80)]));
                old.metadata.name = Some("n-old".into());
                old
            },
        ];
        let inventory = Inventory::from_slices(&slices);
        assert_eq!(inventory.devices.len(), 2);
        let mut held = Vec::new();
        let r = place(&mut held, &slices, claim("c", &[Some("1Gi")], false)).expect("fits");
        assert_eq!(r[0].1, "gpu-1", "the tainted GPU is skipped");
        let mut tolerant = claim("t", &[Some("1Gi")], false);
        if let Some(e) = tolerant
            .spec
            .as_mut()
            .and_then(|s| s.devices.as_mut())
            .and_then(|d| d.requests.as_mut())
            .and_then(|r| r[0].exactly.as_mut())
        {
            e.tolerations = Some(vec![DeviceToleration {
                key: Some("gpushare.io/unhealthy".into()),
                operator: Some("Exists".into()),
                ..Default::default()
            }]);
        }
        let r = place(&mut held, &slices, tolerant).expect("fits");
        assert_eq!(r[0].1, "gpu-0", "a toleration lets it through");

        let whole = json!([{ "name": "gpu-0", "capacity": { "memory": { "value": "16Gi" } } }]);
        let slices = [slice("m", 1, whole)];
        let mut held = Vec::new();
        let r = place(&mut held, &slices, claim("a", &[Some("4Gi")], false)).expect("fits");
        assert_eq!(
            r[0],
            ("r0".into(), "gpu-0".into(), None),
            "no consumedCapacity"
        );
        assert!(place(&mut held, &slices, claim("b", &[Some("1Gi")], false)).is_err());
        assert!(
            held[0]
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref())
                .is_some_and(|r| r[0].share_id.is_none())
        );
    }

    #[test]
    fn what_the_sandbox_cannot_evaluate_is_refused_by_name() {
        assert_eq!(
            driver_selector("device.driver == \"a.b\""),
            Some("a.b".into())
        );
        assert_eq!(driver_selector(" device.driver=='x' "), Some("x".into()));
        assert_eq!(driver_selector("device.driver == \"a\" && true"), None);
        assert_eq!(driver_selector("device.attributes[\"x\"].y == 1"), None);
        assert_eq!(
            parse_selector(
                "device.driver == \"g.io\" && device.attributes[\"g.io\"].type == \"gpu\" && device.attributes['k8s.io'].n == 3"
            ),
            Some(vec![
                SelectorTerm::Driver("g.io".into()),
                SelectorTerm::Attribute("g.io/type".into(), Literal::String("gpu".into())),
                SelectorTerm::Attribute("k8s.io/n".into(), Literal::Int(3)),
            ])
        );
        assert_eq!(parse_selector("device.driver == \"a\" || true"), None);
        assert_eq!(parse_selector("device.attributes[\"x\"].y != 1"), None);
        assert_eq!(
            parse_selector("device.capacity[\"x\"].memory.compareTo(quantity(\"1Gi\")) >= 0"),
            None
        );
        let slices = [slice("n", 1, json!([gpu("gpu-0", "U0", 16)]))];
        let mut c = claim("c", &[Some("1Gi")], false);
        if let Some(e) = c
            .spec
            .as_mut()
            .and_then(|s| s.devices.as_mut())
            .and_then(|d| d.requests.as_mut())
            .and_then(|r| r[0].exactly.as_mut())
        {
            e.selectors = Some(vec![serde_json::from_value(
                json!({ "cel": { "expression": "device.capacity[\"gpushare.io\"].memory.compareTo(quantity(\"1Gi\")) > 0" } }),
            )
            .expect("selector")]);
        }
        let err = allocate(&[c], &slices, &Usage::default()).expect_err("refused");
        assert!(
            matches!(err, Unallocatable::UnsupportedSelector { .. }),
            "{err}"
        );
        let mut c = claim("c", &[Some("1Gi")], false);
        if let Some(e) = c
            .spec
            .as_mut()
            .and_then(|s| s.devices.as_mut())
            .and_then(|d| d.requests.as_mut())
            .and_then(|r| r[0].exactly.as_mut())
        {
            e.device_class_name = "nope".into();
        }
        let err = allocate(&[c], &slices, &Usage::default()).expect_err("refused");
        assert!(matches!(err, Unallocatable::MissingClass { .. }), "{err}");
        let err = allocate(
            &[claim("q", &[Some("lots")], false)],
            &slices,
            &Usage::default(),
        )
        .expect_err("refused");
        assert!(matches!(err, Unallocatable::Quantity { .. }), "{err}");
    }

    #[test]
    fn byte_counts_are_written_with_the_largest_exact_binary_suffix() {
        assert_eq!(format_quantity(0), "0");
        assert_eq!(format_quantity(GI), "1Gi");
        assert_eq!(format_quantity(1536 << 20), "1536Mi");
        assert_eq!(format_quantity(1000), "1000");
        assert_eq!(
            parse_whole_quantity(&format_quantity(12345 << 10)),
            Ok(12345 << 10)
        );
    }
}
