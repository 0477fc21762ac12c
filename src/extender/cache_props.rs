//! Property test of the extender's ledger ([`Cache`]) under the settle rules: random
//! interleavings of binds whose outcome is landed, refused or unknown (a timeout whose
//! Binding lands later or never, a dropped connection), watch events delivered late and in
//! order, re-lists that drop the events in between, pod deletions and finished pods, and the
//! reservations' owners reading the API. At every step no GPU is over-committed — neither in
//! the ledger nor in what the API server's annotations say — and once the watch has caught
//! up and every owner has settled, the ledger equals the annotations.
//!
//! The API server and the owners are modelled here with the same decisions `bind` makes;
//! only the ledger is the real code.

use std::collections::{BTreeMap, HashSet, VecDeque};

use proptest::prelude::*;

use super::cache::{Cache, Placement, PodFacts};
use crate::core::{GpuMem, GpuPolicy, GpuSpec, PodState};
use crate::k8s::NodeGpus;

const NODES: [&str; 2] = ["a", "b"];
const GPU: u64 = 16;

/// A pod as the API server holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ApiPod {
    mem: u64,
    node: Option<&'static str>,
    /// (GPU, memory) from the bind's annotation patch.
    annotation: Option<(u32, u64)>,
    finished: bool,
}

/// What happens to a bind's Binding.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// Lands and is answered.
    Landed,
    /// Refused for certain (answered errors only).
    Refused,
    /// Times out; lands later (when [`Op::LandLate`] comes).
    LandsLate,
    /// Lost: the connection dropped before the API server applied it.
    NeverLands,
}

#[derive(Clone, Debug)]
enum Op {
    Create {
        mem: u64,
    },
    Bind {
        pod: usize,
        node: usize,
        outcome: Outcome,
    },
    LandLate {
        pod: usize,
    },
    Watch {
        events: usize,
    },
    RelistStart,
    RelistEnd,
    Owner {
        pod: usize,
    },
    Delete {
        pod: usize,
    },
    Finish {
        pod: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let outcome = prop_oneof![
        3 => Just(Outcome::Landed),
        1 => Just(Outcome::Refused),
        2 => Just(Outcome::LandsLate),
        1 => Just(Outcome::NeverLands),
    ];
    prop_oneof![
        3 => (1u64..=12).prop_map(|mem| Op::Create { mem }),
        4 => (0usize..16, 0usize..2, outcome).prop_map(|(pod, node, outcome)| Op::Bind { pod, node, outcome }),
        2 => (0usize..16).prop_map(|pod| Op::LandLate { pod }),
        4 => (1usize..6).prop_map(|events| Op::Watch { events }),
        1 => Just(Op::RelistStart),
        1 => Just(Op::RelistEnd),
        3 => (0usize..16).prop_map(|pod| Op::Owner { pod }),
        1 => (0usize..16).prop_map(|pod| Op::Delete { pod }),
        1 => (0usize..16).prop_map(|pod| Op::Finish { pod }),
    ]
}

/// A watch event: the pod's state at the time, or its deletion.
#[derive(Clone, Debug)]
enum WatchEvent {
    Apply(String, ApiPod),
    Delete(String),
}

/// One reservation's owner.
#[derive(Clone, Debug)]
struct Owner {
    node: &'static str,
    gpu: u32,
    token: u64,
    /// A Binding of unknown outcome that may still land.
    late: bool,
}

struct World {
    cache: Cache,
    api: BTreeMap<String, ApiPod>,
    events: VecDeque<WatchEvent>,
    owners: BTreeMap<String, Owner>,
    /// A re-list in progress: the API as its snapshot saw it (answered later).
    snapshot: Option<(BTreeMap<String, ApiPod>, u64)>,
    next: usize,
}

fn facts(uid: &str, p: &ApiPod) -> PodFacts {
    let placement = match (p.node, p.annotation) {
        (Some(node), Some((gpu, mem))) if !p.finished => Some(Placement {
            node: node.to_string(),
            gpu,
            mem: GpuMem::new(mem),
            state: PodState::Assumed,
        }),
        _ => None,
    };
    PodFacts {
        uid: uid.to_string(),
        namespace: "ns".to_string(),
        name: uid.to_string(),
        placement,
        settled: p.node.is_some() || p.finished,
        reservation: None,
    }
}

impl World {
    fn new() -> World {
        let cache = Cache::new();
        for n in NODES {
            cache.apply_node(
                n,
                NodeGpus {
                    gpus: vec![
                        GpuSpec {
                            total: GpuMem::new(GPU),
                            healthy: true
                        };
                        2
                    ],
                    capacity: GpuMem::new(2 * GPU),
                    unit: None,
                    published: false,
                    address: None,
                },
            );
        }
        World {
            cache,
            api: BTreeMap::new(),
            events: VecDeque::new(),
            owners: BTreeMap::new(),
            snapshot: None,
            next: 0,
        }
    }

    fn uid(&self, i: usize) -> Option<String> {
        (self.next > 0).then(|| format!("p{}", i % self.next))
    }

    fn changed(&mut self, uid: &str) {
        let ev = match self.api.get(uid) {
            Some(p) => WatchEvent::Apply(uid.to_string(), p.clone()),
            None => WatchEvent::Delete(uid.to_string()),
        };
        self.events.push_back(ev);
    }

    /// The API server applies the bind's patch and Binding (if the pod is still unbound).
    fn land(&mut self, uid: &str, node: &'static str, gpu: u32) -> bool {
        let Some(p) = self.api.get_mut(uid) else {
            return false;
        };
        if p.node.is_some() || p.finished {
            return false;
        }
        p.annotation = Some((gpu, p.mem));
        p.node = Some(node);
        self.changed(uid);
        true
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Create { mem } => {
                let uid = format!("p{}", self.next);
                self.next += 1;
                self.api.insert(
                    uid.clone(),
                    ApiPod {
                        mem,
                        ..ApiPod::default()
                    },
                );
                self.changed(&uid);
            }
            Op::Bind { pod, node, outcome } => {
                let Some(uid) = self.uid(pod) else { return };
                let Some(p) = self.api.get(&uid).cloned() else {
                    return;
                };
                // bind reads the pod first: bound or finished pods are refused; a pod whose
                // owner still works is attached to, not reserved twice.
                if p.node.is_some() || p.finished || self.owners.contains_key(&uid) {
                    return;
                }
                let node = NODES[node];
                let Ok(r) = self.cache.reserve(
                    &uid,
                    "ns",
                    &uid,
                    node,
                    GpuMem::new(p.mem),
                    GpuPolicy::Binpack,
                ) else {
                    return;
                };
                let mut owner = Owner {
                    node,
                    gpu: r.gpu,
                    token: r.token,
                    late: false,
                };
                match outcome {
                    Outcome::Landed => {
                        if self.land(&uid, node, r.gpu) {
                            self.cache.confirm(&uid, r.token);
                        }
                    }
                    Outcome::Refused => {
                        self.cache.release(&uid, r.token);
                        return;
                    }
                    Outcome::LandsLate => owner.late = true,
                    Outcome::NeverLands => {}
                }
                self.owners.insert(uid, owner);
            }
            Op::LandLate { pod } => {
                let Some(uid) = self.uid(pod) else { return };
                if let Some(o) = self.owners.get_mut(&uid).filter(|o| o.late) {
                    o.late = false;
                    let (node, gpu) = (o.node, o.gpu);
                    self.land(&uid, node, gpu);
                }
            }
            Op::Watch { events } => {
                if self.snapshot.is_some() {
                    return; // the watcher is listing
                }
                for _ in 0..events {
                    match self.events.pop_front() {
                        Some(WatchEvent::Apply(uid, p)) => {
                            self.cache.observe_pod(facts(&uid, &p));
                        }
                        Some(WatchEvent::Delete(uid)) => self.cache.forget_pod(&uid),
                        None => break,
                    }
                }
            }
            Op::RelistStart => {
                // The events before the snapshot are lost; those after it come after the list.
                if self.snapshot.is_none() {
                    self.events.clear();
                    let mark = self.cache.relist_mark();
                    self.snapshot = Some((self.api.clone(), mark));
                }
            }
            Op::RelistEnd => {
                let Some((snapshot, mark)) = self.snapshot.take() else {
                    return;
                };
                let mut seen = HashSet::new();
                for (uid, p) in &snapshot {
                    seen.insert(uid.clone());
                    self.cache.observe_pod(facts(uid, p));
                }
                self.cache.retain_pods(&seen, mark);
            }
            Op::Owner { pod } => {
                let Some(uid) = self.uid(pod) else { return };
                self.settle(&uid);
            }
            Op::Delete { pod } => {
                let Some(uid) = self.uid(pod) else { return };
                if self.api.remove(&uid).is_some() {
                    self.changed(&uid);
                }
            }
            Op::Finish { pod } => {
                let Some(uid) = self.uid(pod) else { return };
                if let Some(p) = self.api.get_mut(&uid) {
                    p.finished = true;
                    self.changed(&uid);
                }
            }
        }
    }

    /// One step of the owner of `uid`, as `bind`'s owner decides: ends when the reservation
    /// is no longer its; confirms when the API shows the pod bound here; releases when it is
    /// gone, finished or bound elsewhere, or unbound with nothing of ours left in flight.
    fn settle(&mut self, uid: &str) {
        let Some(o) = self.owners.get(uid).cloned() else {
            return;
        };
        if !self.cache.holds(uid, o.token) {
            self.owners.remove(uid);
            return;
        }
        match self.api.get(uid) {
            Some(p) if !p.finished && p.node == Some(o.node) => {
                self.cache.confirm(uid, o.token);
            }
            Some(p) if !p.finished && p.node.is_none() && o.late => {}
            Some(p) if !p.finished => {
                // Bound elsewhere, or unbound with nothing in flight.
                self.cache.release(uid, o.token);
                self.owners.remove(uid);
            }
            _ => {
                self.cache.release_gone(uid, o.token);
                self.owners.remove(uid);
            }
        }
    }

    fn check_capacity(&self) -> Result<(), TestCaseError> {
        for n in NODES {
            let view = self.cache.node_view(n).expect("the nodes exist");
            for g in &view.gpus {
                prop_assert!(g.used <= g.total, "ledger over capacity on {n}: {view:?}");
            }
        }
        for (key, used) in self.annotated() {
            prop_assert!(used <= GPU, "API over-committed on {key:?}: {used}");
        }
        Ok(())
    }

    /// Memory per (node, GPU) as the annotations of bound, running pods say.
    fn annotated(&self) -> BTreeMap<(&'static str, u32), u64> {
        let mut per_gpu = BTreeMap::new();
        for p in self.api.values() {
            if let (Some(node), Some((gpu, mem)), false) = (p.node, p.annotation, p.finished) {
                *per_gpu.entry((node, gpu)).or_default() += mem;
            }
        }
        per_gpu
    }

    fn ledger(&self) -> BTreeMap<(&'static str, u32), u64> {
        let mut per_gpu = BTreeMap::new();
        for n in NODES {
            for g in self.cache.node_view(n).expect("the nodes exist").gpus {
                if !g.used.is_zero() {
                    per_gpu.insert((n, g.index), g.used.units());
                }
            }
        }
        per_gpu
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_interleaving_overcommits_and_the_ledger_converges_to_the_annotations(
        ops in proptest::collection::vec(op(), 0..160),
    ) {
        let mut w = World::new();
        for op in ops {
            w.apply(op);
            w.check_capacity()?;
        }
        // Quiesce: late Bindings land or are given up, the watch catches up, owners settle.
        let late: Vec<String> = w.owners.iter().filter(|(_, o)| o.late).map(|(u, _)| u.clone()).collect();
        for uid in late {
            if let Some(o) = w.owners.get_mut(&uid) {
                o.late = false;
                let (node, gpu) = (o.node, o.gpu);
                w.land(&uid, node, gpu);
            }
            w.check_capacity()?;
        }
        w.apply(Op::RelistEnd);
        w.apply(Op::Watch { events: usize::MAX });
        let owners: Vec<String> = w.owners.keys().cloned().collect();
        for uid in owners {
            w.settle(&uid);
            w.check_capacity()?;
        }
        prop_assert_eq!(w.ledger(), w.annotated());
        prop_assert_eq!(w.cache.stats().pods, w.annotated_pods());
    }
}

impl World {
    fn annotated_pods(&self) -> usize {
        self.api
            .values()
            .filter(|p| p.node.is_some() && p.annotation.is_some() && !p.finished)
            .count()
    }
}
