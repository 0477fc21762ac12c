//! The extender's ledger of the cluster: per node, its GPUs (from the Node object, the device
//! plugin's published devices and the `unhealthy-gpu-<node>` ConfigMap) and a
//! [`NodeLedger`] of the pods holding memory on them; plus a slim per-pod index
//! (`uid → node, GPU, memory, state, namespace/name`). Whole Pod objects are never kept.
//!
//! Locking: the node map is a `RwLock<HashMap<name, Arc<NodeSlot>>>` and every node has its
//! own `RwLock<NodeEntry>`. Filter and prioritize take read locks only (map, then node) and
//! never wait for a bind's API calls: a bind holds the node's entry lock only for the moment
//! it takes to choose and reserve a GPU, so concurrent binds to one node each reserve what
//! is still free. Every mutation takes the pod index lock first, then the map, then a node
//! entry — one order, so no deadlock.
//!
//! The settle rules. A record is either *observed* (the watch showed the pod bound with our
//! annotations) or a *reservation* made by bind, identified by a token and owned by exactly
//! one task (`bind`'s owner) that settles it by reading the API: it [`Cache::confirm`]s it
//! when the Binding landed and [`Cache::release`]s it when the API shows the pod gone, bound
//! elsewhere or finished, or the Binding was refused for certain. A reservation ends when the
//! watch shows the pod bound (it becomes observed), deleted or finished, or by its owner —
//! never by a timeout and never by a re-list: a re-list drops only observed pods it did not
//! list again (their events are older than the list), because a reservation may be newer
//! than the list's snapshot. A watch event that shows a pod unbound never removes anything:
//! `spec.nodeName` is never unset, so such an event is older than what we know.
//!
//! This module does no I/O: `sync` feeds it from watches, `bind` from the API calls it makes.
//! Its read-only views (a node with its GPUs and pods, the counters for metrics) are in
//! `views`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::core::placement::{self, NoFit};
use crate::core::{GpuMem, GpuPolicy, GpuSpec, LedgerPod, NodeLedger, NodePolicy, PodState};
use crate::k8s::NodeGpus;

mod views;
pub use views::{CacheStats, GpuView, NodeView, PodView};

/// A pod UID, shared between the index and the node ledgers.
pub type Uid = Arc<str>;

fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// Where a counted pod sits and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Node name.
    pub node: String,
    /// GPU index on the node.
    pub gpu: u32,
    /// Memory held.
    pub mem: GpuMem,
    /// Assumed or assigned.
    pub state: PodState,
}

/// What a pod event says about one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `Some` when the pod holds GPU memory on a node; `None` when it holds nothing (not
    /// bound, no valid annotation, finished).
    pub placement: Option<Placement>,
    /// The pod is bound to a node or finished: without a placement it holds nothing, not
    /// even a reservation of ours (it finished, possibly while the watch was down).
    pub settled: bool,
    /// The pod is not bound, but a bind promised it `placement` (the
    /// `gpushare.io/reservation` annotation, this value): a Binding of unknown outcome may
    /// still land, so it is counted until the API settles it.
    pub reservation: Option<String>,
}

/// What [`Cache::observe_pod_after_list`] did with a pod event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Observed {
    /// The pod is counted now.
    pub counted: bool,
    /// It showed a reservation first seen after the term's first list: backed by nothing.
    pub unbacked: bool,
}

/// Why a record is in the index.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Hold {
    /// Seen bound with a valid annotation in the watch.
    Observed,
    /// Reserved by the bind with this token; `bound` once the Binding is known to have landed.
    Reserved { token: u64, bound: bool },
    /// Found on an unbound pod (`gpushare.io/reservation`, this value), written by a bind of
    /// another process or of an earlier life of this one: counted from `since` (this
    /// process's clock) until the watch shows the pod bound or deleted, or it has stayed
    /// unbound for the settle window, read from the API ([`Cache::expire_found`]).
    Found {
        reservation: Arc<str>,
        since: Instant,
    },
}

#[derive(Debug, Clone)]
struct PodRecord {
    node: Arc<str>,
    gpu: u32,
    mem: GpuMem,
    state: PodState,
    namespace: Box<str>,
    name: Box<str>,
    hold: Hold,
}

/// One node as the extender knows it.
#[derive(Debug, Default)]
struct NodeEntry {
    /// Whether the Node object exists (false: only orphan pods or a ConfigMap point here).
    exists: bool,
    /// GPUs as the Node object describes them.
    gpus: NodeGpus,
    /// GPU indices the `unhealthy-gpu-<node>` ConfigMap lists.
    unhealthy: BTreeSet<u32>,
    /// The ledger.
    ledger: NodeLedger<Uid>,
}

impl NodeEntry {
    fn refresh(&mut self) {
        let specs: Vec<GpuSpec> = if self.exists {
            self.gpus
                .gpus
                .iter()
                .enumerate()
                .map(|(i, g)| GpuSpec {
                    total: g.total,
                    healthy: g.healthy && !self.unhealthy.contains(&(i as u32)),
                })
                .collect()
        } else {
            Vec::new()
        };
        self.ledger.set_gpus(&specs);
    }

    fn shares_gpus(&self) -> bool {
        self.exists && !self.gpus.capacity.is_zero() && !self.ledger.gpus().is_empty()
    }

    fn is_droppable(&self) -> bool {
        !self.exists && self.ledger.pod_count() == 0 && self.unhealthy.is_empty()
    }
}

/// A node's entry.
#[derive(Debug)]
pub struct NodeSlot {
    entry: RwLock<NodeEntry>,
}

impl NodeSlot {
    fn new() -> Arc<NodeSlot> {
        Arc::new(NodeSlot {
            entry: RwLock::new(NodeEntry::default()),
        })
    }

    /// Whether a pod requesting `request` fits this node now.
    pub fn fit(&self, request: GpuMem) -> Fit {
        let e = read(&self.entry);
        if !e.shares_gpus() {
            return Fit::NotForGpuShare;
        }
        match placement::check_fit(&e.ledger, request) {
            Ok(()) => Fit::Fits,
            Err(no) => Fit::NoFit(no),
        }
    }

    /// The prioritize score of `request` on this node (0 when it does not fit).
    pub fn score(&self, request: GpuMem, policy: NodePolicy) -> u8 {
        let e = read(&self.entry);
        if !e.shares_gpus() {
            return 0;
        }
        placement::node_score(&e.ledger, request, policy)
    }
}

/// The filter verdict for one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Some healthy GPU has room.
    Fits,
    /// The node offers no shared GPUs (unknown node, no `aliyun.com/gpu-mem`).
    NotForGpuShare,
    /// The node has GPUs, but none fits.
    NoFit(NoFit),
}

/// Why a reservation could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// The node is unknown or offers no shared GPUs.
    #[error("the node {0} is not for GPU share")]
    NotForGpuShare(String),
    /// No GPU fits.
    #[error("{0}")]
    NoFit(String),
    /// The pod already holds memory (seen bound, or reserved by a bind that still settles).
    #[error("pod {namespace}/{name} already holds GPU {gpu} on node {node}")]
    AlreadyPlaced {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Node.
        node: String,
        /// GPU.
        gpu: u32,
    },
}

/// A reservation made for a bind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// GPU index.
    pub gpu: u32,
    /// That GPU's total memory (the DEV annotation).
    pub device_total: GpuMem,
    /// Identifies this reservation to its owner's [`Cache::confirm`] and [`Cache::release`].
    pub token: u64,
    /// `Some` when the bind took over the pod's own reservation found on it (an earlier
    /// bind's, whose Binding may still be in flight): since when this process counts it.
    pub taken_over: Option<Instant>,
}

/// The ledger of the whole cluster.
#[derive(Debug, Default)]
pub struct Cache {
    pods: RwLock<HashMap<Uid, PodRecord>>,
    nodes: RwLock<HashMap<Arc<str>, Arc<NodeSlot>>>,
    next_token: std::sync::atomic::AtomicU64,
    /// Pods an owner saw gone or finished in the API before the watch did: a watch event
    /// older than that read must not count them again. Cleared by the watch's own delete
    /// (or a re-list begun after them that no longer lists them). Each with its stamp.
    gone: RwLock<HashMap<Uid, u64>>,
    /// Reservations (annotation values) settled as never landing: a watch event that still
    /// shows one on the unbound pod must not count it again. Cleared by the pod's deletion,
    /// a new bind of it, or a re-list that no longer lists it.
    released: RwLock<HashMap<Uid, Arc<str>>>,
}

impl Cache {
    /// An empty cache.
    pub fn new() -> Self {
        Cache::default()
    }

    /// The slot of `node`, if known.
    pub fn slot(&self, node: &str) -> Option<Arc<NodeSlot>> {
        read(&self.nodes).get(node).cloned()
    }

    /// `per_node` of each of `names`' slots (`None`: unknown node), in order, under one
    /// read lock of the map (no slot is cloned out; each node's entry is read-locked by
    /// `per_node` itself, as filter and prioritize do).
    pub(crate) fn map_slots<'a, T>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
        mut per_node: impl FnMut(Option<&NodeSlot>) -> T,
    ) -> Vec<T> {
        let map = read(&self.nodes);
        names
            .into_iter()
            .map(|n| per_node(map.get(n).map(|s| &**s)))
            .collect()
    }

    /// The filter verdict for `node`.
    pub fn fit(&self, node: &str, request: GpuMem) -> Fit {
        match self.slot(node) {
            Some(s) => s.fit(request),
            None => Fit::NotForGpuShare,
        }
    }

    fn slot_or_create(map: &mut HashMap<Arc<str>, Arc<NodeSlot>>, node: &str) -> Arc<NodeSlot> {
        if let Some(s) = map.get(node) {
            return s.clone();
        }
        let s = NodeSlot::new();
        map.insert(Arc::from(node), s.clone());
        s
    }

    fn drop_if_empty(map: &mut HashMap<Arc<str>, Arc<NodeSlot>>, node: &str) {
        if map.get(node).is_some_and(|s| read(&s.entry).is_droppable()) {
            map.remove(node);
        }
    }

    /// Removes `uid` from the node ledger it sits in (index lock held by the caller).
    fn unplace(map: &mut HashMap<Arc<str>, Arc<NodeSlot>>, uid: &Uid, rec: &PodRecord) {
        if let Some(slot) = map.get(&*rec.node) {
            write(&slot.entry).ledger.remove_pod(&**uid);
        }
        Self::drop_if_empty(map, &rec.node);
    }

    /// Applies what a pod event says. Returns whether the pod is now counted.
    pub fn observe_pod(&self, facts: PodFacts) -> bool {
        self.observe(facts, false).counted
    }

    /// [`Cache::observe_pod`] after the serving term's first list of pods: a reservation value
    /// not known yet is backed by nothing (`reservations`), settled at once, never counted.
    pub(crate) fn observe_pod_after_list(&self, facts: PodFacts) -> Observed {
        self.observe(facts, true)
    }

    fn observe(&self, facts: PodFacts, after_list: bool) -> Observed {
        let unbacked = false;
        let counted = |counted| Observed { counted, unbacked };
        let mut pods = write(&self.pods);
        if read(&self.gone).contains_key(facts.uid.as_str()) {
            return counted(false);
        }
        let mut map = write(&self.nodes);
        let key: Uid = match pods.get_key_value(facts.uid.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(facts.uid.as_str()),
        };
        let mut hold = Hold::Observed;
        if let (Some(_), Some(value)) = (&facts.placement, &facts.reservation) {
            // An unbound pod a bind promised a GPU.
            if read(&self.released)
                .get(&key)
                .is_some_and(|v| **v == **value)
            {
                return counted(pods.contains_key(&key));
            }
            match pods.get(&key).map(|r| &r.hold) {
                // Ours (its owner settles it), or known bound (never unbound again).
                Some(Hold::Reserved { .. } | Hold::Observed) => return counted(true),
                Some(Hold::Found { reservation, .. }) if **reservation == **value => {
                    return counted(true);
                }
                _ => {}
            }
            if after_list {
                // A reservation found earlier that the pod no longer carries is over too.
                self.settle_found(&mut pods, &mut map, &key, Arc::from(value.as_str()));
                return Observed {
                    counted: false,
                    unbacked: true,
                };
            }
            hold = Hold::Found {
                reservation: Arc::from(value.as_str()),
                since: Instant::now(),
            };
        }
        let Some(p) = facts.placement else {
            // An unbound, unfinished pod: an event older than what we know (a pod is never
            // unbound again), or one our own bind is about to place. It changes nothing —
            // but a reservation found earlier that the pod no longer carries is over.
            if !facts.settled {
                if pods
                    .get(&key)
                    .is_some_and(|r| matches!(r.hold, Hold::Found { .. }))
                    && let Some(rec) = pods.remove(&key)
                {
                    Self::unplace(&mut map, &key, &rec);
                    return counted(false);
                }
                return counted(pods.contains_key(&key));
            }
            if let Some(rec) = pods.remove(&key) {
                Self::unplace(&mut map, &key, &rec);
            }
            return counted(false);
        };
        if let Some(old) = pods.get(&key).cloned()
            && *old.node != *p.node
        {
            Self::unplace(&mut map, &key, &old);
        }
        let slot = Self::slot_or_create(&mut map, &p.node);
        write(&slot.entry).ledger.apply_pod(
            key.clone(),
            LedgerPod {
                gpu: p.gpu,
                mem: p.mem,
                state: p.state,
            },
        );
        let node: Arc<str> = match map.get_key_value(p.node.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(p.node.as_str()),
        };
        pods.insert(
            key,
            PodRecord {
                node,
                gpu: p.gpu,
                mem: p.mem,
                state: p.state,
                namespace: facts.namespace.into(),
                name: facts.name.into(),
                hold,
            },
        );
        counted(true)
    }

    /// Ends `key`'s found reservation `value` for good (no later event counts it again); the
    /// caller holds both locks (index, then map).
    fn settle_found(
        &self,
        pods: &mut HashMap<Uid, PodRecord>,
        map: &mut HashMap<Arc<str>, Arc<NodeSlot>>,
        key: &Uid,
        value: Arc<str>,
    ) {
        write(&self.released).insert(key.clone(), value);
        if let Some(rec) = pods.remove(key) {
            Self::unplace(map, key, &rec);
        }
    }

    /// The pod is gone (watch delete): release whatever it held, reservations included.
    pub(crate) fn forget_pod(&self, uid: &str) {
        let mut pods = write(&self.pods);
        write(&self.gone).remove(uid);
        write(&self.released).remove(uid);
        if let Some((key, rec)) = pods.remove_entry(uid) {
            let mut map = write(&self.nodes);
            Self::unplace(&mut map, &key, &rec);
        }
    }

    /// A re-list of pods begins (before its list is asked for): the mark to hand to
    /// [`Cache::retain_pods`] at its end.
    pub(crate) fn relist_mark(&self) -> u64 {
        self.tick()
    }

    fn tick(&self) -> u64 {
        self.next_token
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// After a full re-list of pods begun at `mark`: forget every observed pod (and every
    /// reservation found on a pod) not in `seen`. Reservations of our own binds stay whatever
    /// the list says: one may be newer than the list's snapshot, and each has an owner that
    /// settles it by reading the API.
    pub(crate) fn retain_pods(&self, seen: &HashSet<String>, mark: u64) -> usize {
        let mut pods = write(&self.pods);
        let mut map = write(&self.nodes);
        let gone: Vec<Uid> = pods
            .iter()
            .filter(|(uid, rec)| {
                !seen.contains(&***uid) && matches!(rec.hold, Hold::Observed | Hold::Found { .. })
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in &gone {
            if let Some(rec) = pods.remove(uid) {
                Self::unplace(&mut map, uid, &rec);
            }
        }
        // Gone before the list began and not listed: no older event can come any more.
        write(&self.gone).retain(|uid, stamp| *stamp > mark || seen.contains(&**uid));
        write(&self.released).retain(|uid, _| seen.contains(&**uid));
        gone.len()
    }

    /// A Node was added or changed: re-read its GPUs.
    pub fn apply_node(&self, name: &str, gpus: NodeGpus) {
        let _pods = read(&self.pods);
        let mut map = write(&self.nodes);
        let slot = Self::slot_or_create(&mut map, name);
        let mut e = write(&slot.entry);
        e.exists = true;
        e.gpus = gpus;
        e.refresh();
    }

    /// A Node was deleted: its pods stay (as pending) until they are deleted too.
    pub(crate) fn remove_node(&self, name: &str) {
        let _pods = read(&self.pods);
        let mut map = write(&self.nodes);
        if let Some(slot) = map.get(name) {
            let mut e = write(&slot.entry);
            e.exists = false;
            e.gpus = NodeGpus::default();
            e.refresh();
        }
        Self::drop_if_empty(&mut map, name);
    }

    /// After a full re-list of nodes: every node not in `seen` is deleted.
    pub(crate) fn retain_nodes(&self, seen: &HashSet<String>) {
        let gone: Vec<String> = read(&self.nodes)
            .iter()
            .filter(|(n, s)| !seen.contains(&***n) && read(&s.entry).exists)
            .map(|(n, _)| n.to_string())
            .collect();
        for n in gone {
            self.remove_node(&n);
        }
    }

    /// Sets the GPUs the `unhealthy-gpu-<node>` ConfigMap lists (empty clears).
    pub(crate) fn set_unhealthy(&self, node: &str, gpus: BTreeSet<u32>) {
        let _pods = read(&self.pods);
        let mut map = write(&self.nodes);
        if gpus.is_empty() && !map.contains_key(node) {
            return;
        }
        let slot = Self::slot_or_create(&mut map, node);
        {
            let mut e = write(&slot.entry);
            e.unhealthy = gpus;
            e.refresh();
        }
        Self::drop_if_empty(&mut map, node);
    }

    /// After a full re-list of the ConfigMaps: clear the nodes not in `seen`.
    pub(crate) fn retain_unhealthy(&self, seen: &HashSet<String>) {
        let stale: Vec<String> = read(&self.nodes)
            .iter()
            .filter(|(n, s)| !seen.contains(&***n) && !read(&s.entry).unhealthy.is_empty())
            .map(|(n, _)| n.to_string())
            .collect();
        for n in stale {
            self.set_unhealthy(&n, BTreeSet::new());
        }
    }

    /// Chooses a GPU of `node` for the pod and reserves it (as Assumed); the caller owns the
    /// reservation (its token) until it is confirmed-and-observed or released.
    pub(crate) fn reserve(
        &self,
        uid: &str,
        namespace: &str,
        name: &str,
        node: &str,
        request: GpuMem,
        policy: GpuPolicy,
    ) -> Result<Reservation, ReserveError> {
        let mut pods = write(&self.pods);
        if let Some(rec) = pods.get_mut(uid) {
            // The pod's own reservation, found on it (an earlier bind of another process, or
            // of an earlier life of this one), on this node: this bind takes it over, on the
            // same GPU. Its owner settles it from now on, knowing an earlier Binding may
            // still land.
            if let Hold::Found { since, .. } = rec.hold
                && *rec.node == *node
            {
                let device_total = read(&self.nodes)
                    .get(node)
                    .and_then(|slot| {
                        read(&slot.entry)
                            .ledger
                            .gpus()
                            .get(rec.gpu as usize)
                            .map(|g| g.total)
                    })
                    .unwrap_or_default();
                let token = self.tick();
                rec.hold = Hold::Reserved {
                    token,
                    bound: false,
                };
                return Ok(Reservation {
                    gpu: rec.gpu,
                    device_total,
                    token,
                    taken_over: Some(since),
                });
            }
            // Held elsewhere (or by a live bind): until it is settled, no second one.
            return Err(ReserveError::AlreadyPlaced {
                namespace: namespace.to_string(),
                name: name.to_string(),
                node: rec.node.to_string(),
                gpu: rec.gpu,
            });
        }
        let map = read(&self.nodes);
        let Some((node_key, slot)) = map.get_key_value(node) else {
            return Err(ReserveError::NotForGpuShare(node.to_string()));
        };
        let mut e = write(&slot.entry);
        if !e.shares_gpus() {
            return Err(ReserveError::NotForGpuShare(node.to_string()));
        }
        let gpu = placement::choose_gpu(&e.ledger, request, policy)
            .map_err(|no| ReserveError::NoFit(no.reason(request)))?;
        let device_total = e
            .ledger
            .gpus()
            .get(gpu as usize)
            .map(|g| g.total)
            .unwrap_or_default();
        let key: Uid = Arc::from(uid);
        let token = self.tick();
        write(&self.released).remove(uid);
        e.ledger.apply_pod(
            key.clone(),
            LedgerPod {
                gpu,
                mem: request,
                state: PodState::Assumed,
            },
        );
        pods.insert(
            key,
            PodRecord {
                node: node_key.clone(),
                gpu,
                mem: request,
                state: PodState::Assumed,
                namespace: namespace.into(),
                name: name.into(),
                hold: Hold::Reserved {
                    token,
                    bound: false,
                },
            },
        );
        Ok(Reservation {
            gpu,
            device_total,
            token,
            taken_over: None,
        })
    }

    /// Drops (settles) the pod's own reservation found on it for `node` if its GPU cannot hold
    /// it beside what is counted there, returning its value: no Binding backs it (`reservations`).
    pub(crate) fn drop_found_over_capacity(&self, uid: &str, node: &str) -> Option<String> {
        let mut pods = write(&self.pods);
        let rec = pods.get(uid)?;
        let Hold::Found { reservation, .. } = &rec.hold else {
            return None;
        };
        if *rec.node != *node {
            return None;
        }
        let mut map = write(&self.nodes);
        let fits = map.get(node).is_some_and(|slot| {
            read(&slot.entry)
                .ledger
                .gpus()
                .get(rec.gpu as usize)
                .is_some_and(|g| g.used <= g.total)
        });
        if fits {
            return None;
        }
        let value: Arc<str> = reservation.clone();
        let key = pods.get_key_value(uid)?.0.clone();
        self.settle_found(&mut pods, &mut map, &key, value.clone());
        Some(value.to_string())
    }

    /// The Binding landed: keep the reservation until the watch shows the pod bound.
    pub(crate) fn confirm(&self, uid: &str, token: u64) {
        if let Some(rec) = write(&self.pods).get_mut(uid)
            && matches!(rec.hold, Hold::Reserved { token: t, .. } if t == token)
        {
            rec.hold = Hold::Reserved { token, bound: true };
        }
    }

    /// Whether `uid`'s record is still the reservation `token`.
    pub fn holds(&self, uid: &str, token: u64) -> bool {
        read(&self.pods)
            .get(uid)
            .is_some_and(|rec| matches!(rec.hold, Hold::Reserved { token: t, .. } if t == token))
    }

    /// The API showed, for certain, that the reservation holds nothing (the pod is gone,
    /// bound elsewhere, finished, or the Binding was refused): drop it if it is still
    /// reservation `token`. Returns whether it was dropped.
    pub fn release(&self, uid: &str, token: u64) -> bool {
        let mut pods = write(&self.pods);
        if !pods
            .get(uid)
            .is_some_and(|rec| matches!(rec.hold, Hold::Reserved { token: t, .. } if t == token))
        {
            return false;
        }
        if let Some((key, rec)) = pods.remove_entry(uid) {
            let mut map = write(&self.nodes);
            Self::unplace(&mut map, &key, &rec);
        }
        true
    }

    /// The owner read the pod gone or finished: [`Cache::release`], and ignore older watch
    /// events that still show it running until the watch shows its deletion.
    pub(crate) fn release_gone(&self, uid: &str, token: u64) -> bool {
        if !self.holds(uid, token) {
            return false;
        }
        let stamp = self.tick();
        write(&self.gone).insert(Arc::from(uid), stamp);
        self.release(uid, token)
    }

    /// The reservation `value` of `uid` (the pod's `gpushare.io/reservation`) is settled as
    /// never landing: watch events that still show it on the unbound pod count nothing.
    pub(crate) fn mark_released(&self, uid: &str, value: &str) {
        write(&self.released).insert(Arc::from(uid), Arc::from(value));
    }

    /// Reservations found on pods that have been counted for at least `window`: (UID,
    /// namespace, name, annotation value) of each, for [`Cache::expire_found`] after a read of
    /// the pod.
    pub(crate) fn found_due(&self, window: Duration) -> Vec<(String, String, String, String)> {
        read(&self.pods)
            .iter()
            .filter_map(|(uid, rec)| match &rec.hold {
                Hold::Found { reservation, since } if since.elapsed() >= window => Some((
                    uid.to_string(),
                    rec.namespace.to_string(),
                    rec.name.to_string(),
                    reservation.to_string(),
                )),
                _ => None,
            })
            .collect()
    }

    /// The API shows the pod still unbound with the found reservation `value` after the
    /// settle window: it ends (and is not counted again). Returns whether it was dropped.
    pub(crate) fn expire_found(&self, uid: &str, value: &str) -> bool {
        let mut pods = write(&self.pods);
        if !pods.get(uid).is_some_and(
            |r| matches!(&r.hold, Hold::Found { reservation, .. } if **reservation == *value),
        ) {
            return false;
        }
        let Some(key) = pods.get_key_value(uid).map(|(k, _)| k.clone()) else {
            return false;
        };
        let mut map = write(&self.nodes);
        self.settle_found(&mut pods, &mut map, &key, Arc::from(value));
        true
    }

    /// This process begins to serve (it won the lease): every reservation found on a pod is
    /// counted for a full settle window from now, since the Binding of the replica that wrote
    /// it may have been sent up to the end of that replica's term.
    pub(crate) fn restart_found_clocks(&self) {
        let now = Instant::now();
        for rec in write(&self.pods).values_mut() {
            if let Hold::Found { since, .. } = &mut rec.hold {
                *since = now;
            }
        }
    }

    /// The node and GPU of the pod's own reservation, while it is unbound and one is held
    /// for it (a live bind's, or one found on it): what its filter passes.
    pub(crate) fn own_reservation(&self, uid: &str) -> Option<(String, u32)> {
        read(&self.pods).get(uid).and_then(|r| match r.hold {
            Hold::Found { .. } | Hold::Reserved { bound: false, .. } => {
                Some((r.node.to_string(), r.gpu))
            }
            _ => None,
        })
    }

    /// Where the pod `uid` is counted.
    pub(crate) fn pod_placement(&self, uid: &str) -> Option<Placement> {
        read(&self.pods).get(uid).map(|r| Placement {
            node: r.node.to_string(),
            gpu: r.gpu,
            mem: r.mem,
            state: r.state,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(totals: &[u64]) -> NodeGpus {
        NodeGpus {
            gpus: totals
                .iter()
                .map(|t| GpuSpec {
                    total: GpuMem::new(*t),
                    healthy: true,
                })
                .collect(),
            capacity: GpuMem::new(totals.iter().sum()),
            unit: None,
            published: false,
            address: None,
        }
    }

    fn facts(uid: &str, node: &str, gpu: u32, mem: u64) -> PodFacts {
        PodFacts {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
            placement: Some(Placement {
                node: node.into(),
                gpu,
                mem: GpuMem::new(mem),
                state: PodState::Assigned,
            }),
            settled: true,
            reservation: None,
        }
    }

    fn used(c: &Cache, node: &str) -> Vec<u64> {
        c.node_view(node)
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.used.units())
            .collect()
    }

    /// An unbound pod carrying the reservation `value` for (node, gpu).
    fn found(uid: &str, node: &str, gpu: u32, mem: u64, value: &str) -> PodFacts {
        let mut f = facts(uid, node, gpu, mem);
        f.settled = false;
        f.reservation = Some(value.into());
        if let Some(p) = f.placement.as_mut() {
            p.state = PodState::Assumed;
        }
        f
    }

    /// A bind of the pod to the node its own found reservation holds takes it over: the same
    /// GPU, counted once, owned by that bind from now on.
    #[tokio::test(start_paused = true)]
    async fn a_bind_to_the_reserved_node_takes_the_pods_own_reservation_over() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16, 16]));
        c.observe_pod(found("p", "a", 1, 10, "r1"));
        assert_eq!(c.own_reservation("p"), Some(("a".to_string(), 1)));
        let r = c
            .reserve("p", "ns", "p", "a", GpuMem::new(10), GpuPolicy::Binpack)
            .expect("taken over");
        assert_eq!(r.gpu, 1, "the same GPU");
        assert!(r.taken_over.is_some());
        assert_eq!(r.device_total, GpuMem::new(16));
        assert_eq!(used(&c, "a"), [0, 10], "counted once");
        assert!(c.holds("p", r.token));
        assert!(
            c.found_due(Duration::ZERO).is_empty(),
            "no longer a found one"
        );
        // A watch event still showing the old reservation changes nothing.
        c.observe_pod(found("p", "a", 1, 10, "r1"));
        assert!(c.holds("p", r.token));
        c.confirm("p", r.token);
        assert_eq!(c.own_reservation("p"), None, "bound: no longer held for it");
    }

    /// After this term's first list, a reservation value not known yet is backed by nothing:
    /// never counted, and a later event or re-list showing it counts nothing either; one known
    /// from the list still counts.
    #[test]
    fn a_reservation_first_seen_after_the_list_is_not_counted() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16]));
        c.observe_pod(found("b", "a", 0, 8, "listed"));
        let seen = c.observe_pod_after_list(found("b", "a", 0, 8, "listed"));
        assert_eq!(
            seen,
            Observed {
                counted: true,
                unbacked: false
            }
        );
        let late = c.observe_pod_after_list(found("p", "a", 0, 8, "late"));
        assert_eq!(
            late,
            Observed {
                counted: false,
                unbacked: true
            }
        );
        assert_eq!(used(&c, "a"), [8]);
        assert!(!c.observe_pod(found("p", "a", 0, 8, "late")), "a re-list");
        assert_eq!(c.own_reservation("p"), None);
        // The pod bound later is an ordinary pod.
        assert!(c.observe_pod_after_list(facts("p", "a", 0, 8)).counted);
        assert_eq!(used(&c, "a"), [16]);
    }

    /// A found reservation that its GPU cannot hold beside what is counted there (its patch
    /// landed after its bind had settled it as released) is dropped, not taken over; one that
    /// fits stays.
    #[test]
    fn a_found_reservation_over_capacity_is_dropped_not_taken_over() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16, 16]));
        let q = c
            .reserve("q", "ns", "q", "a", GpuMem::new(10), GpuPolicy::Binpack)
            .expect("q fits");
        c.observe_pod(found("p", "a", q.gpu, 10, "late"));
        assert_eq!(used(&c, "a")[q.gpu as usize], 20, "counted, over capacity");
        assert_eq!(c.drop_found_over_capacity("p", "b"), None, "another node");
        assert_eq!(
            c.drop_found_over_capacity("p", "a").as_deref(),
            Some("late")
        );
        assert_eq!(used(&c, "a")[q.gpu as usize], 10);
        // A watch event still showing it counts nothing; the pod reserves afresh.
        c.observe_pod(found("p", "a", q.gpu, 10, "late"));
        assert_eq!(c.own_reservation("p"), None);
        let r = c
            .reserve("p", "ns", "p", "a", GpuMem::new(10), GpuPolicy::Binpack)
            .expect("the other GPU");
        assert_ne!(r.gpu, q.gpu);
        assert!(r.taken_over.is_none());
        // One that fits is left for the takeover.
        c.observe_pod(found("s", "a", q.gpu, 6, "fits"));
        assert_eq!(c.drop_found_over_capacity("s", "a"), None);
        assert_eq!(c.own_reservation("s"), Some(("a".to_string(), q.gpu)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reservation_found_on_a_pod_counts_until_bound_deleted_or_expired() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16]));
        assert!(c.observe_pod(found("p", "a", 0, 10, "r1")));
        assert_eq!(used(&c, "a"), [10]);
        // No second reservation of the pod elsewhere while it counts, and the GPU is taken.
        assert!(matches!(
            c.reserve("p", "ns", "p", "b", GpuMem::new(10), GpuPolicy::Binpack),
            Err(ReserveError::AlreadyPlaced { .. })
        ));
        assert!(
            c.reserve("q", "ns", "q", "a", GpuMem::new(10), GpuPolicy::Binpack)
                .is_err()
        );
        // Not due before the window; due after it; expired only for the same value.
        let window = Duration::from_secs(60);
        assert!(c.found_due(window).is_empty());
        tokio::time::advance(window).await;
        assert_eq!(c.found_due(window).len(), 1);
        // A new term counts a full window again.
        c.restart_found_clocks();
        assert!(c.found_due(window).is_empty());
        assert!(!c.expire_found("p", "other"));
        assert!(c.expire_found("p", "r1"));
        assert_eq!(used(&c, "a"), [0]);
        // A late event still showing that reservation counts nothing; a new one counts.
        c.observe_pod(found("p", "a", 0, 10, "r1"));
        assert_eq!(used(&c, "a"), [0]);
        c.observe_pod(found("p", "a", 0, 6, "r2"));
        assert_eq!(used(&c, "a"), [6]);
        // Bound: an ordinary pod; an older unbound event changes nothing.
        c.observe_pod(facts("p", "a", 0, 6));
        c.observe_pod(found("p", "a", 0, 6, "r2"));
        assert_eq!(
            c.pod_placement("p").map(|p| p.state),
            Some(PodState::Assigned)
        );
        c.forget_pod("p");
        assert_eq!(used(&c, "a"), [0]);
        // An unbound pod whose reservation was removed holds nothing any more.
        c.observe_pod(found("s", "a", 0, 4, "r3"));
        let mut cleared = found("s", "a", 0, 4, "r3");
        cleared.placement = None;
        cleared.reservation = None;
        assert!(!c.observe_pod(cleared));
        assert_eq!(used(&c, "a"), [0]);
    }

    #[test]
    fn our_own_reservation_is_not_taken_over_by_its_annotation() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16]));
        let r = c
            .reserve("u", "ns", "p", "a", GpuMem::new(4), GpuPolicy::Binpack)
            .unwrap();
        // The watch shows our own patch (unbound, with the reservation): the owner keeps it.
        c.observe_pod(found("u", "a", 0, 4, "mine"));
        assert!(c.holds("u", r.token));
        // Released as not landing: the annotation seen later counts nothing.
        c.mark_released("u", "mine");
        assert!(c.release("u", r.token));
        c.observe_pod(found("u", "a", 0, 4, "mine"));
        assert_eq!(used(&c, "a"), [0]);
    }

    #[test]
    fn pods_count_once_and_move_between_nodes() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16, 16]));
        c.apply_node("b", gpus(&[16]));
        assert!(c.observe_pod(facts("p", "a", 1, 4)));
        assert!(c.observe_pod(facts("p", "a", 1, 4)));
        assert_eq!(used(&c, "a"), [0, 4]);
        c.observe_pod(facts("p", "b", 0, 4));
        assert_eq!(used(&c, "a"), [0, 0]);
        assert_eq!(used(&c, "b"), [4]);
        c.forget_pod("p");
        assert_eq!(used(&c, "b"), [0]);
        assert_eq!(c.stats().pods, 0);
    }

    #[test]
    fn node_changes_are_picked_up_and_deleted_nodes_keep_pods_pending() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16, 16]));
        c.observe_pod(facts("p", "a", 1, 4));
        c.apply_node("a", gpus(&[8]));
        let v = c.node_view("a").unwrap();
        assert_eq!(v.gpus.len(), 1);
        assert_eq!(v.pending.len(), 1);
        c.remove_node("a");
        assert_eq!(c.fit("a", GpuMem::new(1)), Fit::NotForGpuShare);
        assert!(c.views().is_empty());
        assert_eq!(c.node_view("a").unwrap().pending.len(), 1);
        c.forget_pod("p");
        assert!(
            c.node_view("a").is_none(),
            "empty unknown nodes are dropped"
        );
        // A pod pointing at a node never seen is kept pending, nothing panics.
        c.observe_pod(facts("q", "ghost", 3, 4));
        assert_eq!(c.fit("ghost", GpuMem::new(1)), Fit::NotForGpuShare);
        c.apply_node("ghost", gpus(&[16; 4]));
        assert_eq!(used(&c, "ghost"), [0, 0, 0, 4]);
    }

    #[test]
    fn unhealthy_gpus_are_skipped() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16, 16]));
        c.set_unhealthy("a", BTreeSet::from([0]));
        let r = c
            .reserve("u", "ns", "p", "a", GpuMem::new(4), GpuPolicy::Binpack)
            .unwrap();
        assert_eq!(r.gpu, 1);
        assert_eq!(
            c.fit("a", GpuMem::new(16)),
            Fit::NoFit(NoFit::InsufficientInOneDevice)
        );
        c.set_unhealthy("a", BTreeSet::from([0, 1]));
        assert_eq!(
            c.fit("a", GpuMem::new(16)),
            Fit::NoFit(NoFit::LargerThanAnyGpu {
                largest: GpuMem::ZERO
            })
        );
        c.retain_unhealthy(&HashSet::new());
        assert_eq!(c.fit("a", GpuMem::new(16)), Fit::Fits);
    }

    #[test]
    fn reservations_end_only_by_their_owner_or_the_watch() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16, 16]));
        let r = c
            .reserve("u", "ns", "p", "a", GpuMem::new(10), GpuPolicy::Binpack)
            .unwrap();
        assert_eq!(r.device_total, GpuMem::new(16));
        // The watch sees the annotated but not yet bound pod: the reservation stays.
        let unbound = PodFacts {
            placement: None,
            settled: false,
            reservation: None,
            ..facts("u", "a", 0, 10)
        };
        assert!(c.observe_pod(unbound.clone()));
        assert_eq!(c.fit("a", GpuMem::new(10)), Fit::Fits);
        let r2 = c
            .reserve("v", "ns", "q", "a", GpuMem::new(10), GpuPolicy::Binpack)
            .unwrap();
        assert_ne!(r.gpu, r2.gpu);
        assert_eq!(
            c.fit("a", GpuMem::new(10)),
            Fit::NoFit(NoFit::InsufficientInOneDevice)
        );
        // A re-list that misses reservations keeps them, confirmed or not: they may be newer
        // than its snapshot.
        c.confirm("u", r.token);
        assert_eq!(c.retain_pods(&HashSet::new(), c.relist_mark()), 0);
        assert!(c.holds("u", r.token) && c.holds("v", r2.token));
        // Only the owner's token releases.
        assert!(!c.release("v", r.token));
        assert!(c.release("v", r2.token));
        assert!(!c.release("v", r2.token));
        // The watch shows u bound: observed; an older unbound event changes nothing.
        c.observe_pod(facts("u", "a", r.gpu, 10));
        assert!(!c.holds("u", r.token));
        assert!(c.observe_pod(unbound));
        assert_eq!(used(&c, "a").iter().sum::<u64>(), 10);
        // A settled pod without a placement (finished, bound without annotations) holds nothing.
        c.observe_pod(PodFacts {
            placement: None,
            settled: true,
            reservation: None,
            ..facts("u", "a", 0, 10)
        });
        assert_eq!(used(&c, "a"), [0, 0]);
        assert!(matches!(
            c.reserve("w", "ns", "w", "nope", GpuMem::new(1), GpuPolicy::Binpack),
            Err(ReserveError::NotForGpuShare(_))
        ));
    }

    #[test]
    fn relists_drop_pods_and_nodes_not_seen_again() {
        let c = Cache::new();
        c.apply_node("a", gpus(&[16]));
        c.apply_node("b", gpus(&[16]));
        c.observe_pod(facts("p", "a", 0, 4));
        c.observe_pod(facts("q", "a", 0, 4));
        assert_eq!(
            c.retain_pods(&HashSet::from(["q".to_string()]), c.relist_mark()),
            1
        );
        assert_eq!(used(&c, "a"), [4]);
        c.retain_nodes(&HashSet::from(["a".to_string()]));
        assert_eq!(c.node_names(), ["a"]);
    }
}
