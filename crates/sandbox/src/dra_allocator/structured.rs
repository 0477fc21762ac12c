//! The allocation of a pod's claims on one node, as upstream's structured-parameters allocator
//! (`k8s.io/dynamic-resource-allocation/structured`, the `incubating` implementation that
//! kube-scheduler uses once consumable capacity is on) decides it: an exhaustive first-fit
//! search, claim after claim, request after request, device after device, over the pools in
//! their order ([`super::pools`]). A request of several devices continues after the device it
//! took, so it never takes one device twice (and tries combinations, not permutations).
//!
//! What it honours: DeviceClass and request CEL selectors ([`crate::dra_cel`]; a compile or
//! runtime error stops the allocation with an error, as upstream, rather than skipping the
//! device), `allocationMode` `ExactCount` and `All`, `firstAvailable` subrequests, `adminAccess`,
//! `matchAttribute` and `distinctAttribute` constraints, device taints and request tolerations,
//! consumable capacity (`allowMultipleAllocations`, capacity requests, request policies; see
//! [`super::capacity`]), partitionable devices (shared counters and their consumption),
//! per-device node selection, binding conditions (copied into results), the 32-device limit of
//! a claim, class and claim configuration copied into the result, the result's node selector.
//! What it does not do: scoring (the first solution wins), list-type attributes in
//! constraints, derived attributes, extended resources.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, CapacityRequirements, Device, DeviceAllocationConfiguration,
    DeviceAllocationResult, DeviceAttribute, DeviceClass, DeviceRequestAllocationResult,
    DeviceSelector, DeviceTaint, DeviceToleration, ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;

use super::capacity::{self, Consumed};
use super::pools::{self, NodeView, Pool};
use super::{DeviceKey, Features, Unallocatable, Usage};
use crate::dra_cel;

/// Upstream's `AllocationResultsMaxSize`.
const MAX_RESULTS: usize = 32;

/// Allocates `claims` (none allocated yet) on `node`: one result per claim, `Ok(None)` when
/// they do not fit there, `Err` when the allocation cannot go on anywhere (a selector error,
/// a missing class, a malformed request), or, with [`Unallocatable::InvalidPools`], when it
/// fails on this node only because of invalid pools.
pub fn allocate(
    claims: &[ResourceClaim],
    classes: &[DeviceClass],
    slices: &[ResourceSlice],
    usage: &Usage,
    node: &NodeView,
    features: &Features,
    share_id: &mut dyn FnMut() -> String,
) -> Result<Option<Vec<AllocationResult>>, Unallocatable> {
    let mut stats = Stats::default();
    allocate_counted(
        claims, classes, slices, usage, node, features, share_id, &mut stats,
    )
}

/// How much searching an allocation took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Steps of the search (upstream's `numAllocateOneInvocations`): trying combinations of
    /// devices, not their permutations, keeps it small.
    pub allocate_one_invocations: u64,
}

/// [`allocate`], counting the search's steps into `stats`.
#[allow(clippy::too_many_arguments)]
pub fn allocate_counted(
    claims: &[ResourceClaim],
    classes: &[DeviceClass],
    slices: &[ResourceSlice],
    usage: &Usage,
    node: &NodeView,
    features: &Features,
    share_id: &mut dyn FnMut() -> String,
    stats: &mut Stats,
) -> Result<Option<Vec<AllocationResult>>, Unallocatable> {
    let pools = pools::gather(slices, node, features);
    let mut alloc = Allocation {
        claims,
        classes,
        pools,
        usage,
        node,
        features,
        requests: HashMap::new(),
        constraints: Vec::new(),
        allocating: HashMap::new(),
        allocating_capacity: HashMap::new(),
        allocating_shares: HashMap::new(),
        consumed_counters: HashMap::new(),
        results: vec![Vec::new(); claims.len()],
        matches: HashMap::new(),
        selectors: HashMap::new(),
        share_id,
        steps: 0,
    };
    alloc.prepare()?;
    let outcome = alloc.one(Slot::default(), false, Loc::default());
    stats.allocate_one_invocations = alloc.steps;
    match outcome {
        Ok(true) => Ok(Some(alloc.finish())),
        Ok(false) | Err(Stop::MaxSize) => {
            if alloc.pools.iter().any(|p| p.invalid) {
                return Err(Unallocatable::InvalidPools);
            }
            Ok(None)
        }
        Err(Stop::Fatal(e)) => Err(e),
    }
}

/// A request or subrequest, read uniformly.
#[derive(Clone, Copy)]
struct Request<'a> {
    name: &'a str,
    class: &'a str,
    mode: &'a str,
    count: i64,
    admin: bool,
    selectors: &'a [DeviceSelector],
    tolerations: &'a [DeviceToleration],
    capacity: Option<&'a CapacityRequirements>,
}

impl Request<'_> {
    fn capacity_requests(&self) -> Option<&BTreeMap<String, ApiQuantity>> {
        self.capacity.and_then(|c| c.requests.as_ref())
    }
}

/// `(claim, request, subrequest)`.
type RequestKey = (usize, usize, usize);

struct RequestData<'a> {
    request: Request<'a>,
    /// The name of the request holding this subrequest.
    parent: Option<&'a str>,
    class: &'a DeviceClass,
    num_devices: usize,
    /// The devices an `All` request takes.
    all: Vec<Loc>,
}

impl RequestData<'_> {
    fn full_name(&self) -> String {
        match self.parent {
            Some(p) => format!("{p}/{}", self.request.name),
            None => self.request.name.to_string(),
        }
    }
}

/// Where the search is: a device of a request (or subrequest) of a claim.
#[derive(Clone, Copy, Default, Debug)]
struct Slot {
    claim: usize,
    request: usize,
    sub: usize,
    device: usize,
}

/// A device's place: pool, slice, device.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq, Hash)]
struct Loc {
    pool: usize,
    slice: usize,
    device: usize,
}

enum Stop {
    /// A claim would get more than 32 devices: backtrack further.
    MaxSize,
    Fatal(Unallocatable),
}

impl From<Unallocatable> for Stop {
    fn from(e: Unallocatable) -> Stop {
        Stop::Fatal(e)
    }
}

#[derive(Clone)]
struct Chosen {
    request: String,
    loc: Loc,
    share_id: Option<String>,
    consumed: Option<Consumed>,
    admin: bool,
    tolerations: Vec<DeviceToleration>,
}

enum ConstraintKind {
    Match {
        value: Option<DeviceAttribute>,
    },
    Distinct {
        values: BTreeMap<String, DeviceAttribute>,
    },
}

struct Constraint {
    requests: HashSet<String>,
    attribute: String,
    kind: ConstraintKind,
    devices: usize,
}

impl Constraint {
    fn applies(&self, request: &str, sub: Option<&str>) -> bool {
        self.requests.is_empty()
            || self.requests.contains(request)
            || sub.is_some_and(|s| self.requests.contains(&format!("{request}/{s}")))
    }

    /// Whether the device may join; it joins when it may.
    fn add(&mut self, request: &str, sub: Option<&str>, device: &Device, driver: &str) -> bool {
        if !self.applies(request, sub) {
            return true;
        }
        let Some(attr) = lookup_attribute(device, driver, &self.attribute) else {
            return false;
        };
        match &mut self.kind {
            ConstraintKind::Match { value } => {
                if self.devices > 0 && !same_value(value.as_ref(), attr) {
                    return false;
                }
                if self.devices == 0 {
                    *value = Some(attr.clone());
                }
            }
            ConstraintKind::Distinct { values } => {
                // As upstream: kept per request name, so a request's later device replaces its
                // earlier one in the comparison.
                if self.devices > 0 && values.values().any(|v| same_scalar(v, attr)) {
                    return false;
                }
                values.insert(request.to_string(), attr.clone());
            }
        }
        self.devices += 1;
        true
    }

    fn remove(&mut self, request: &str, sub: Option<&str>) {
        if !self.applies(request, sub) {
            return;
        }
        if let ConstraintKind::Distinct { values } = &mut self.kind {
            values.remove(request);
        }
        self.devices = self.devices.saturating_sub(1);
    }
}

/// `matchAttribute`: the same type and value (an unknown type never matches).
fn same_value(first: Option<&DeviceAttribute>, attr: &DeviceAttribute) -> bool {
    let Some(first) = first else { return false };
    if attr.string.is_some() {
        first.string == attr.string
    } else if attr.int.is_some() {
        first.int == attr.int
    } else if attr.bool.is_some() {
        first.bool == attr.bool
    } else if attr.version.is_some() {
        first.version == attr.version
    } else {
        false
    }
}

/// `distinctAttribute`: a duplicate of the same type and value.
fn same_scalar(a: &DeviceAttribute, b: &DeviceAttribute) -> bool {
    (b.string.is_some() && a.string == b.string)
        || (b.int.is_some() && a.int == b.int)
        || (b.bool.is_some() && a.bool == b.bool)
        || (b.version.is_some() && a.version == b.version)
}

/// A device attribute by its fully qualified name; in the driver's own domain the short name
/// the slice may use matches too.
pub(crate) fn lookup_attribute<'d>(
    device: &'d Device,
    driver: &str,
    qualified: &str,
) -> Option<&'d DeviceAttribute> {
    let attrs = device.attributes.as_ref()?;
    if let Some(a) = attrs.get(qualified) {
        return Some(a);
    }
    let (domain, id) = qualified.split_once('/')?;
    (domain == driver).then(|| attrs.get(id)).flatten()
}

/// Upstream's `ToleratesTaint`.
fn tolerates(t: &DeviceToleration, taint: &DeviceTaint) -> bool {
    if t.effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
    {
        return false;
    }
    if t.key
        .as_deref()
        .is_some_and(|k| !k.is_empty() && k != taint.key)
    {
        return false;
    }
    match t.operator.as_deref().unwrap_or("Equal") {
        "" | "Equal" => t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        "Exists" => true,
        _ => false,
    }
}

fn taint_prevents(device: &Device, request: &Request<'_>) -> bool {
    device.taints.iter().flatten().any(|taint| {
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !request.tolerations.iter().any(|t| tolerates(t, taint))
    })
}

struct Allocation<'a, 's> {
    claims: &'a [ResourceClaim],
    classes: &'a [DeviceClass],
    pools: Vec<Pool<'a>>,
    usage: &'a Usage,
    node: &'a NodeView,
    features: &'a Features,
    requests: HashMap<RequestKey, RequestData<'a>>,
    constraints: Vec<Vec<Constraint>>,
    /// Devices taken whole by this allocation: the claims taking them.
    allocating: HashMap<DeviceKey, HashSet<usize>>,
    /// Capacity this allocation takes of shared devices.
    allocating_capacity: HashMap<DeviceKey, Consumed>,
    /// How many shares of each shared device this allocation takes.
    allocating_shares: HashMap<DeviceKey, usize>,
    /// Counters this allocation consumes: pool → counter set → counter → amount.
    consumed_counters: HashMap<String, BTreeMap<String, Consumed>>,
    results: Vec<Vec<Chosen>>,
    matches: HashMap<(Loc, RequestKey), bool>,
    selectors: HashMap<String, Result<dra_cel::Selector, dra_cel::CompileError>>,
    share_id: &'s mut dyn FnMut() -> String,
    steps: u64,
}

/// A claim as upstream's logs and errors name it (`klog.KObj`): `namespace/name`, or the name
/// alone without a namespace.
fn claim_id(c: &ResourceClaim) -> String {
    let name = c.metadata.name.as_deref().unwrap_or("");
    match c.metadata.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_string(),
    }
}

impl<'a> Allocation<'a, '_> {
    fn device(&self, loc: Loc) -> (&'a ResourceSlice, &'a Device) {
        let slice = self.pools[loc.pool].slices[loc.slice];
        let device = &slice.spec.devices.as_deref().unwrap_or_default()[loc.device];
        (slice, device)
    }

    fn key(&self, loc: Loc) -> DeviceKey {
        let pool = &self.pools[loc.pool];
        let (_, device) = self.device(loc);
        (
            pool.driver.to_string(),
            pool.name.to_string(),
            device.name.clone(),
        )
    }

    /// Upstream's checks of every request before the search (`validateDeviceRequest`), the
    /// claim limit and the constraints.
    fn prepare(&mut self) -> Result<(), Unallocatable> {
        for (ci, claim) in self.claims.iter().enumerate() {
            let cid = claim_id(claim);
            let devices = claim.spec.as_ref().and_then(|s| s.devices.as_ref());
            let requests = devices
                .and_then(|d| d.requests.as_deref())
                .unwrap_or_default();
            let mut min_devices = 0;
            for (ri, r) in requests.iter().enumerate() {
                let subs = r.first_available.as_deref().unwrap_or_default();
                if !subs.is_empty() && !self.features.prioritized_list {
                    return Err(Unallocatable::Request {
                        claim: cid,
                        request: r.name.clone(),
                        what: "has subrequests, but the DRAPrioritizedList feature is disabled"
                            .into(),
                    });
                }
                if !self.features.consumable_capacity {
                    let exact_capacity = r.exactly.as_ref().is_some_and(|e| e.capacity.is_some());
                    if exact_capacity || subs.iter().any(|s| s.capacity.is_some()) {
                        return Err(Unallocatable::Request {
                            claim: cid,
                            request: r.name.clone(),
                            what: "has capacity requests, but the DRAConsumableCapacity feature is disabled".into(),
                        });
                    }
                }
                if !subs.is_empty() {
                    let mut fewest = usize::MAX;
                    for (si, s) in subs.iter().enumerate() {
                        let request = Request {
                            name: &s.name,
                            class: &s.device_class_name,
                            mode: s.allocation_mode.as_deref().unwrap_or("ExactCount"),
                            count: s.count.unwrap_or(1),
                            admin: false,
                            selectors: s.selectors.as_deref().unwrap_or_default(),
                            tolerations: s.tolerations.as_deref().unwrap_or_default(),
                            capacity: s.capacity.as_ref(),
                        };
                        let data = self.request_data(ci, (ci, ri, si), request, Some(&r.name))?;
                        fewest = fewest.min(data.num_devices);
                        self.requests.insert((ci, ri, si), data);
                    }
                    min_devices += fewest;
                } else if let Some(e) = &r.exactly {
                    let request = Request {
                        name: &r.name,
                        class: &e.device_class_name,
                        mode: e.allocation_mode.as_deref().unwrap_or("ExactCount"),
                        count: e.count.unwrap_or(1),
                        admin: e.admin_access == Some(true),
                        selectors: e.selectors.as_deref().unwrap_or_default(),
                        tolerations: e.tolerations.as_deref().unwrap_or_default(),
                        capacity: e.capacity.as_ref(),
                    };
                    if e.admin_access.is_some() && !self.features.admin_access {
                        return Err(Unallocatable::Request {
                            claim: cid,
                            request: r.name.clone(),
                            what: "admin access is requested, but the feature is disabled".into(),
                        });
                    }
                    let data = self.request_data(ci, (ci, ri, 0), request, None)?;
                    min_devices += data.num_devices;
                    self.requests.insert((ci, ri, 0), data);
                } else {
                    return Err(Unallocatable::Request {
                        claim: cid,
                        request: r.name.clone(),
                        what: "missing device class name (unsupported request type?)".into(),
                    });
                }
            }
            if min_devices > MAX_RESULTS {
                return Err(Unallocatable::TooManyDevices {
                    claim: cid,
                    devices: min_devices,
                    limit: MAX_RESULTS,
                });
            }
            let mut constraints = Vec::new();
            for (i, c) in devices
                .and_then(|d| d.constraints.as_deref())
                .unwrap_or_default()
                .iter()
                .enumerate()
            {
                let requests = c.requests.iter().flatten().cloned().collect();
                let (attribute, kind) = match (&c.match_attribute, &c.distinct_attribute) {
                    (Some(m), _) => (m.clone(), ConstraintKind::Match { value: None }),
                    (None, Some(d)) => (
                        d.clone(),
                        ConstraintKind::Distinct {
                            values: BTreeMap::new(),
                        },
                    ),
                    (None, None) => {
                        return Err(Unallocatable::EmptyConstraint {
                            claim: cid,
                            index: i,
                        });
                    }
                };
                constraints.push(Constraint {
                    requests,
                    attribute,
                    kind,
                    devices: 0,
                });
            }
            self.constraints.push(constraints);
        }
        Ok(())
    }

    fn request_data(
        &mut self,
        ci: usize,
        key: RequestKey,
        request: Request<'a>,
        parent: Option<&'a str>,
    ) -> Result<RequestData<'a>, Unallocatable> {
        let cid = claim_id(&self.claims[ci]);
        if let Some(i) = request.selectors.iter().position(|s| s.cel.is_none()) {
            return Err(Unallocatable::Request {
                claim: cid,
                request: request.name.to_string(),
                what: format!("selector #{i}: CEL expression empty (unsupported selector type?)"),
            });
        }
        if request.class.is_empty() {
            return Err(Unallocatable::Request {
                claim: cid,
                request: request.name.to_string(),
                what: "missing device class name (unsupported request type?)".into(),
            });
        }
        let class = self
            .classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(request.class))
            .ok_or_else(|| Unallocatable::MissingClass {
                claim: cid.clone(),
                request: request.name.to_string(),
                class: request.class.to_string(),
            })?;
        let mut data = RequestData {
            request,
            parent,
            class,
            num_devices: 0,
            all: Vec::new(),
        };
        match request.mode {
            "ExactCount" => {
                data.num_devices = usize::try_from(request.count.max(0)).unwrap_or(usize::MAX);
            }
            "All" => {
                for pi in 0..self.pools.len() {
                    let pool = &self.pools[pi];
                    if pool.incomplete || pool.invalid {
                        let state = if pool.incomplete {
                            "is currently being updated"
                        } else {
                            "is currently invalid"
                        };
                        return Err(Unallocatable::Request {
                            claim: cid,
                            request: request.name.to_string(),
                            what: format!(
                                "asks for all devices, but resource pool {} {state}",
                                pool.id()
                            ),
                        });
                    }
                    let slice_sizes: Vec<usize> = pool
                        .slices
                        .iter()
                        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                        .collect();
                    for (si, n) in slice_sizes.into_iter().enumerate() {
                        for di in 0..n {
                            let loc = Loc {
                                pool: pi,
                                slice: si,
                                device: di,
                            };
                            if !self.selectable(key, &data, loc)? {
                                continue;
                            }
                            if self.features.consumable_capacity
                                && self.capacity_fits(&data.request, loc) != Some(true)
                            {
                                continue;
                            }
                            data.all.push(loc);
                        }
                    }
                }
                data.num_devices = data.all.len();
            }
            other => {
                return Err(Unallocatable::Request {
                    claim: cid,
                    request: request.name.to_string(),
                    what: format!("unsupported count mode {other}"),
                });
            }
        }
        Ok(data)
    }

    /// Whether the device passes the class's and the request's selectors (and per-device node
    /// selection); a selector error is fatal.
    fn selectable(
        &mut self,
        key: RequestKey,
        data: &RequestData<'a>,
        loc: Loc,
    ) -> Result<bool, Unallocatable> {
        let (slice, device) = self.device(loc);
        if !self.features.device_binding_and_status
            && device
                .binding_conditions
                .as_ref()
                .is_some_and(|b| !b.is_empty())
        {
            return Ok(false);
        }
        if let Some(m) = self.matches.get(&(loc, key)) {
            return Ok(*m);
        }
        let device_id = format!(
            "{}/{}/{}",
            slice.spec.driver, slice.spec.pool.name, device.name
        );
        let class_name = data.class.metadata.name.clone().unwrap_or_default();
        let class_selectors = data
            .class
            .spec
            .as_ref()
            .and_then(|s| s.selectors.as_deref())
            .unwrap_or_default();
        let claim = claim_id(&self.claims[key.0]);
        let input = dra_cel::DeviceInput {
            driver: &slice.spec.driver,
            allow_multiple_allocations: device.allow_multiple_allocations,
            attributes: device.attributes.as_ref(),
            capacity: device.capacity.as_ref(),
        };
        let sets = [
            (format!("class {class_name}"), class_selectors),
            (format!("claim {claim}"), data.request.selectors),
        ];
        let mut ok = true;
        'sets: for (owner, selectors) in sets {
            for (i, s) in selectors.iter().enumerate() {
                let Some(cel) = &s.cel else { continue };
                let compiled = self
                    .selectors
                    .entry(cel.expression.clone())
                    .or_insert_with(|| {
                        dra_cel::compile(&cel.expression, dra_cel::Features::STORED)
                    });
                let selector = match compiled {
                    Ok(s) => s,
                    Err(e) => {
                        return Err(Unallocatable::SelectorCompile {
                            owner,
                            index: i,
                            message: e.0.clone(),
                        });
                    }
                };
                match selector.matches(&input) {
                    Ok(true) => {}
                    Ok(false) => {
                        ok = false;
                        break 'sets;
                    }
                    Err(e) => {
                        return Err(Unallocatable::SelectorRuntime {
                            owner,
                            index: i,
                            device: device_id,
                            message: e.0,
                        });
                    }
                }
            }
        }
        if ok && slice.spec.per_device_node_selection == Some(true) {
            ok = pools::node_matches(
                self.node,
                device.node_name.as_deref(),
                device.all_nodes,
                device.node_selector.as_ref(),
            );
        }
        self.matches.insert((loc, key), ok);
        Ok(ok)
    }

    /// `CmpRequestOverCapacity` for the device with what allocated claims and this allocation
    /// hold; `None` when the request asks a capacity the device lacks.
    fn capacity_fits(&self, request: &Request<'_>, loc: Loc) -> Option<bool> {
        let key = self.key(loc);
        let (_, device) = self.device(loc);
        capacity::fits(
            self.usage.consumed.get(&key),
            request.capacity_requests(),
            device.capacity.as_ref(),
            self.allocating_capacity.get(&key),
        )
    }

    fn in_use(&self, key: &DeviceKey) -> bool {
        self.usage.allocated.contains(key)
            || self.allocating.get(key).is_some_and(|c| !c.is_empty())
    }

    fn allocating_for_claim(&self, key: &DeviceKey, claim: usize) -> bool {
        self.allocating.get(key).is_some_and(|c| c.contains(&claim))
    }

    fn capacity_in_use(&self, key: &DeviceKey) -> bool {
        self.usage.consumed.contains_key(key)
            || self.allocating_shares.get(key).is_some_and(|n| *n > 0)
    }

    /// `allocateOne`: finds a device for `r` and everything after it; `start` is where a
    /// request's next device is looked for (after the one it took).
    fn one(&mut self, r: Slot, allocate_sub: bool, start: Loc) -> Result<bool, Stop> {
        self.steps += 1;
        let Some(claim) = self.claims.get(r.claim) else {
            return Ok(true);
        };
        let n_requests = claim
            .spec
            .as_ref()
            .and_then(|s| s.devices.as_ref())
            .and_then(|d| d.requests.as_ref())
            .map_or(0, Vec::len);
        if r.request >= n_requests {
            let next = Slot {
                claim: r.claim + 1,
                ..Slot::default()
            };
            return match self.one(next, false, Loc::default()) {
                Err(Stop::MaxSize) => Ok(false),
                other => other,
            };
        }
        let key = (r.claim, r.request, r.sub);
        let is_sub = self.requests.get(&key).is_some_and(|d| d.parent.is_some());
        if !allocate_sub && is_sub {
            let mut all_exceeded = true;
            for sub in 0.. {
                if !self.requests.contains_key(&(r.claim, r.request, sub)) {
                    return if all_exceeded {
                        Err(Stop::MaxSize)
                    } else {
                        Ok(false)
                    };
                }
                match self.one(Slot { sub, ..r }, true, Loc::default()) {
                    Err(Stop::MaxSize) => continue,
                    Err(e) => return Err(e),
                    Ok(true) => return Ok(true),
                    Ok(false) => all_exceeded = false,
                }
            }
        }
        let Some(data) = self.requests.get(&key) else {
            return Ok(false);
        };
        let request = data.request;
        let num_devices = data.num_devices;
        let all_mode = request.mode == "All";
        if all_mode && data.all.is_empty() {
            return Ok(false);
        }
        if r.device >= num_devices {
            let next = Slot {
                claim: r.claim,
                request: r.request + 1,
                ..Slot::default()
            };
            return self.one(next, false, Loc::default());
        }
        if self.results[r.claim].len() + num_devices - r.device > MAX_RESULTS {
            return Err(Stop::MaxSize);
        }
        let next = Slot {
            device: r.device + 1,
            ..r
        };
        if all_mode {
            let loc = data.all[r.device];
            let Some(undo) = self.take(r, loc, true)? else {
                return Ok(false);
            };
            let done = self.one(next, allocate_sub, Loc::default());
            if !matches!(done, Ok(true)) {
                self.undo(r, undo);
            }
            return done;
        }
        for pi in start.pool..self.pools.len() {
            if self.pools[pi].incomplete || self.pools[pi].invalid {
                continue;
            }
            let first_slice = if pi == start.pool { start.slice } else { 0 };
            for si in first_slice..self.pools[pi].slices.len() {
                let first_device = if pi == start.pool && si == start.slice {
                    start.device
                } else {
                    0
                };
                let n = self.pools[pi].slices[si]
                    .spec
                    .devices
                    .as_ref()
                    .map_or(0, Vec::len);
                for di in first_device..n {
                    let loc = Loc {
                        pool: pi,
                        slice: si,
                        device: di,
                    };
                    let dkey = self.key(loc);
                    if request.admin && self.allocating_for_claim(&dkey, r.claim) {
                        continue;
                    }
                    if !request.admin && self.in_use(&dkey) {
                        continue;
                    }
                    let data = self.requests.get(&key).map(|d| RequestData {
                        request: d.request,
                        parent: d.parent,
                        class: d.class,
                        num_devices: d.num_devices,
                        all: Vec::new(),
                    });
                    let Some(data) = data else { return Ok(false) };
                    if !self.selectable(key, &data, loc)? {
                        continue;
                    }
                    if self.features.consumable_capacity
                        && self.capacity_fits(&request, loc) != Some(true)
                    {
                        continue;
                    }
                    let Some(undo) = self.take(r, loc, false)? else {
                        continue;
                    };
                    let after = Loc {
                        pool: pi,
                        slice: si,
                        device: di + 1,
                    };
                    match self.one(next, allocate_sub, after) {
                        Ok(true) => return Ok(true),
                        other => {
                            self.undo(r, undo);
                            other?;
                        }
                    }
                }
            }
        }
        Ok(false)
    }

    /// `allocateDevice`: takes the device for the slot if it is free, untainted (or
    /// tolerated), has the counters and keeps the claim's constraints; `None` when not.
    fn take(&mut self, r: Slot, loc: Loc, must: bool) -> Result<Option<Undo>, Unallocatable> {
        let key = (r.claim, r.request, r.sub);
        let Some(data) = self.requests.get(&key) else {
            return Ok(None);
        };
        let request = data.request;
        let parent = data.parent;
        let full_name = data.full_name();
        let dkey = self.key(loc);
        let (slice, device) = self.device(loc);
        let shared =
            self.features.consumable_capacity && device.allow_multiple_allocations == Some(true);
        if !shared && request.admin && self.allocating_for_claim(&dkey, r.claim) {
            return Ok(None);
        }
        if !request.admin && self.in_use(&dkey) {
            return Ok(None);
        }
        let consumes = device
            .consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty());
        if !self.features.partitionable_devices && consumes {
            return Ok(None);
        }
        let skip_counters = shared && self.capacity_in_use(&dkey);
        let mut counted = false;
        if !skip_counters && consumes {
            if !self.take_counters(loc) {
                return Ok(None);
            }
            counted = true;
        }
        let release_counters = |me: &mut Self| {
            if counted {
                me.give_back_counters(loc);
            }
        };
        if self.features.device_taints && taint_prevents(device, &request) {
            release_counters(self);
            return Ok(None);
        }
        let (base, sub) = match parent {
            Some(p) => (p, Some(request.name)),
            None => (request.name, None),
        };
        let driver = slice.spec.driver.as_str();
        let constraints = &mut self.constraints[r.claim];
        for i in 0..constraints.len() {
            if !constraints[i].add(base, sub, device, driver) {
                for c in constraints.iter_mut().take(i) {
                    c.remove(base, sub);
                }
                release_counters(self);
                if must {
                    return Err(Unallocatable::Request {
                        claim: claim_id(&self.claims[r.claim]),
                        request: request.name.to_string(),
                        what: format!(
                            "cannot add device {} because a claim constraint would not be satisfied",
                            dkey.0.clone() + "/" + &dkey.1 + "/" + &dkey.2
                        ),
                    });
                }
                return Ok(None);
            }
        }
        let mut consumed = None;
        let mut share_id = None;
        if self.features.consumable_capacity {
            if self.capacity_fits(&request, loc) != Some(true) {
                for c in self.constraints[r.claim].iter_mut() {
                    c.remove(base, sub);
                }
                release_counters(self);
                return Ok(None);
            }
            if shared {
                let c =
                    capacity::consumed_by(request.capacity_requests(), device.capacity.as_ref());
                *self.allocating_shares.entry(dkey.clone()).or_default() += 1;
                let held = self.allocating_capacity.entry(dkey.clone()).or_default();
                for (name, q) in &c {
                    let now = match held.get(name) {
                        Some(h) => h.checked_add(q).unwrap_or(*h),
                        None => *q,
                    };
                    held.insert(name.clone(), now);
                }
                share_id = Some((self.share_id)());
                if !c.is_empty() {
                    consumed = Some(c);
                }
            }
        }
        if !shared {
            self.allocating
                .entry(dkey.clone())
                .or_default()
                .insert(r.claim);
        }
        self.results[r.claim].push(Chosen {
            request: full_name,
            loc,
            share_id,
            consumed: consumed.clone(),
            admin: request.admin,
            tolerations: request.tolerations.to_vec(),
        });
        Ok(Some(Undo {
            key: dkey,
            loc,
            shared,
            consumed,
            counted,
            base: base.to_string(),
            sub: sub.map(str::to_string),
        }))
    }

    fn undo(&mut self, r: Slot, undo: Undo) {
        for c in self.constraints[r.claim].iter_mut() {
            c.remove(&undo.base, undo.sub.as_deref());
        }
        if let Some(set) = self.allocating.get_mut(&undo.key) {
            set.remove(&r.claim);
        }
        if undo.shared {
            let shares = self.allocating_shares.entry(undo.key.clone()).or_default();
            *shares = shares.saturating_sub(1);
            let last = *shares == 0;
            if let Some(held) = self.allocating_capacity.get_mut(&undo.key) {
                for (name, q) in undo.consumed.iter().flatten() {
                    if let Some(h) = held.get_mut(name) {
                        *h = h.checked_sub(q).unwrap_or(*h);
                    }
                }
                if last {
                    self.allocating_capacity.remove(&undo.key);
                }
            }
        }
        if undo.counted {
            self.give_back_counters(undo.loc);
        }
        self.results[r.claim].pop();
    }

    /// `checkAvailableCounters`: the device's consumption added to this allocation's when the
    /// pool's counters (less what allocated devices consume) still cover it.
    fn take_counters(&mut self, loc: Loc) -> bool {
        let pool = &self.pools[loc.pool];
        let pool_name = pool.name.to_string();
        let mut available = pool.counter_sets.clone();
        for s in pool.slices.iter().chain(pool.other_slices.iter()) {
            for d in s.spec.devices.iter().flatten() {
                let key = (
                    s.spec.driver.clone(),
                    s.spec.pool.name.clone(),
                    d.name.clone(),
                );
                if !self.usage.is_allocated(&key) {
                    continue;
                }
                for c in d.consumes_counters.iter().flatten() {
                    let Some(set) = available.get_mut(&c.counter_set) else {
                        continue;
                    };
                    for (name, counter) in &c.counters {
                        if let Some(v) = set.get_mut(name) {
                            *v = v.checked_sub(&capacity::read(&counter.value)).unwrap_or(*v);
                        }
                    }
                }
            }
        }
        self.add_counters(loc, &pool_name, true);
        let consumed = self.consumed_counters.get(&pool_name);
        let over = available.iter().any(|(set, counters)| {
            counters.iter().any(|(name, avail)| {
                consumed
                    .and_then(|c| c.get(set))
                    .and_then(|c| c.get(name))
                    .is_some_and(|used| used > avail)
            })
        });
        if over {
            self.add_counters(loc, &pool_name, false);
            return false;
        }
        true
    }

    fn give_back_counters(&mut self, loc: Loc) {
        let pool_name = self.pools[loc.pool].name.to_string();
        self.add_counters(loc, &pool_name, false);
    }

    fn add_counters(&mut self, loc: Loc, pool_name: &str, add: bool) {
        let (_, device) = self.device(loc);
        let sets = self
            .consumed_counters
            .entry(pool_name.to_string())
            .or_default();
        for c in device.consumes_counters.iter().flatten() {
            let set = sets.entry(c.counter_set.clone()).or_default();
            for (name, counter) in &c.counters {
                let q = capacity::read(&counter.value);
                let now = match (set.get(name), add) {
                    (Some(v), true) => v.checked_add(&q).unwrap_or(*v),
                    (Some(v), false) => v.checked_sub(&q).unwrap_or(*v),
                    (None, true) => q,
                    (None, false) => continue,
                };
                set.insert(name.clone(), now);
            }
        }
    }

    /// The allocation results: devices, configuration, node selector, per claim.
    fn finish(&self) -> Vec<AllocationResult> {
        let mut out = Vec::new();
        for (ci, claim) in self.claims.iter().enumerate() {
            let chosen = &self.results[ci];
            let results = chosen
                .iter()
                .map(|c| {
                    let pool = &self.pools[c.loc.pool];
                    let (_, device) = self.device(c.loc);
                    let binding = self.features.device_binding_and_status;
                    DeviceRequestAllocationResult {
                        request: c.request.clone(),
                        driver: pool.driver.to_string(),
                        pool: pool.name.to_string(),
                        device: device.name.clone(),
                        admin_access: c.admin.then_some(true),
                        tolerations: (!c.tolerations.is_empty()).then(|| c.tolerations.clone()),
                        share_id: c.share_id.clone(),
                        consumed_capacity: c.consumed.as_ref().map(|m| {
                            m.iter()
                                .map(|(k, q)| (k.clone(), ApiQuantity(q.canonical())))
                                .collect()
                        }),
                        binding_conditions: device.binding_conditions.clone().filter(|_| binding),
                        binding_failure_conditions: device
                            .binding_failure_conditions
                            .clone()
                            .filter(|_| binding),
                        ..Default::default()
                    }
                })
                .collect();
            out.push(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: self.config(ci, claim),
                }),
                node_selector: self.node_selector(chosen),
                allocation_timestamp: None,
            });
        }
        out
    }

    /// The requests' class configuration (each class once) then the claim's, as upstream
    /// copies them; a configuration covering every request has no `requests`.
    fn config(
        &self,
        ci: usize,
        claim: &ResourceClaim,
    ) -> Option<Vec<DeviceAllocationConfiguration>> {
        let devices = claim.spec.as_ref().and_then(|s| s.devices.as_ref());
        let requests = devices
            .and_then(|d| d.requests.as_deref())
            .unwrap_or_default();
        let chosen_name = |ri: usize| -> String {
            // The request's name, or request/subrequest of the subrequest that was chosen.
            let sub = self.results[ci]
                .iter()
                .map(|c| c.request.as_str())
                .find(|n| n.split('/').next() == Some(requests[ri].name.as_str()));
            sub.map(str::to_string)
                .unwrap_or_else(|| requests[ri].name.clone())
        };
        let class_of = |ri: usize| -> Option<&DeviceClass> {
            let name = chosen_name(ri);
            let si = match name.split_once('/') {
                Some((_, sub)) => requests[ri]
                    .first_available
                    .iter()
                    .flatten()
                    .position(|s| s.name == sub)?,
                None => 0,
            };
            self.requests.get(&(ci, ri, si)).map(|d| d.class)
        };
        let mut out: Vec<DeviceAllocationConfiguration> = Vec::new();
        let mut class_ranges: HashMap<String, (usize, usize)> = HashMap::new();
        for ri in 0..requests.len() {
            let Some(class) = class_of(ri) else { continue };
            let class_name = class.metadata.name.clone().unwrap_or_default();
            let name = chosen_name(ri);
            if let Some((start, end)) = class_ranges.get(&class_name) {
                for c in &mut out[*start..*end] {
                    c.requests.get_or_insert_with(Vec::new).push(name.clone());
                }
                continue;
            }
            let start = out.len();
            for c in class
                .spec
                .as_ref()
                .and_then(|s| s.config.as_ref())
                .into_iter()
                .flatten()
            {
                out.push(DeviceAllocationConfiguration {
                    source: "FromClass".into(),
                    requests: Some(vec![name.clone()]),
                    opaque: c.opaque.clone(),
                });
            }
            class_ranges.insert(class_name, (start, out.len()));
        }
        for c in devices
            .and_then(|d| d.config.as_deref())
            .unwrap_or_default()
        {
            let wanted = c.requests.as_deref().unwrap_or_default();
            let applies = wanted.is_empty()
                || (0..requests.len()).any(|ri| {
                    wanted.contains(&requests[ri].name) || wanted.contains(&chosen_name(ri))
                });
            if applies {
                out.push(DeviceAllocationConfiguration {
                    source: "FromClaim".into(),
                    requests: c.requests.clone().filter(|r| !r.is_empty()),
                    opaque: c.opaque.clone(),
                });
            }
        }
        for c in &mut out {
            let Some(wanted) = &c.requests else { continue };
            let covers_all = (0..requests.len())
                .all(|ri| wanted.contains(&requests[ri].name) || wanted.contains(&chosen_name(ri)));
            if covers_all {
                c.requests = None;
            }
        }
        (!out.is_empty()).then_some(out)
    }

    /// `createNodeSelector`: the node itself once a device is node-local (or binds to the
    /// node), else the slices' one-term selectors merged, else none.
    fn node_selector(&self, chosen: &[Chosen]) -> Option<NodeSelector> {
        let mut fields: Vec<NodeSelectorRequirement> = Vec::new();
        let mut exprs: Vec<NodeSelectorRequirement> = Vec::new();
        for c in chosen {
            let (slice, device) = self.device(c.loc);
            let (node_name, selector) = if slice.spec.per_device_node_selection == Some(true) {
                (device.node_name.as_deref(), device.node_selector.as_ref())
            } else {
                (
                    slice.spec.node_name.as_deref(),
                    slice.spec.node_selector.as_ref(),
                )
            };
            if node_name.is_some() || device.binds_to_node == Some(true) {
                return Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_fields: Some(vec![NodeSelectorRequirement {
                            key: "metadata.name".into(),
                            operator: "In".into(),
                            values: Some(vec![self.node.name.clone()]),
                        }]),
                        match_expressions: None,
                    }],
                });
            }
            if let Some(term) = selector.and_then(|s| s.node_selector_terms.first()) {
                for r in term.match_fields.iter().flatten() {
                    if !fields.contains(r) {
                        fields.push(r.clone());
                    }
                }
                for r in term.match_expressions.iter().flatten() {
                    if !exprs.contains(r) {
                        exprs.push(r.clone());
                    }
                }
            }
        }
        if fields.is_empty() && exprs.is_empty() {
            return None;
        }
        Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: (!fields.is_empty()).then_some(fields),
                match_expressions: (!exprs.is_empty()).then_some(exprs),
            }],
        })
    }
}

/// What [`Allocation::take`] changed, for [`Allocation::undo`].
struct Undo {
    key: DeviceKey,
    loc: Loc,
    shared: bool,
    consumed: Option<Consumed>,
    counted: bool,
    base: String,
    sub: Option<String>,
}
