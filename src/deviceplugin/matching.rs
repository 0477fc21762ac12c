//! Which pod an Allocate call is for (kubelet does not say), decided per container.
//!
//! A candidate is a pod on this node that the extender bound (`ALIYUN_COM_GPU_MEM_IDX` set,
//! `ASSIGNED=false`), not finished, whose NEXT not-yet-allocated GPU container (init
//! containers first, then app containers, in spec order, minus those listed in
//! `gpushare.io/allocated-containers` or already answered by this process, see
//! [`Records`]) requests exactly the units kubelet asked for. A pod whose containers are half
//! allocated comes first: kubelet admits one pod at a time and asks for its containers in
//! order, so the next call is for that pod, and finishing it keeps all its containers on one
//! GPU. Then the oldest assume time wins; ties are broken by namespace/name so the choice is
//! deterministic. Upstream compared the pod's total with a container's request, so pods with
//! two GPU containers never matched (EXT#143).
//!
//! [`find_repeat`] recognises kubelet asking again for a container it was answered before
//! (a restart before its checkpoint, a cancelled call): the latest such container that
//! kubelet's PodResources shows no devices for.
//!
//! Pure: works on [`PodSnapshot`]s and [`Records`], never talks to the API.

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;

use super::records::Records;
use crate::core::request::RequestError;
use crate::core::wire::parse_fake_device_id;
use crate::core::{GpuMem, PodGpuAnnotations, PodGpuRequest};
use crate::k8s::{pod_annotations, pod_gpu_request, pod_is_terminal};

/// What matching needs to know about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PodSnapshot {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub resource_version: Option<String>,
    /// Its GPU request, or why it could not be read.
    pub request: Result<PodGpuRequest, RequestError>,
    /// Its gpushare annotations.
    pub annotations: PodGpuAnnotations,
    /// Succeeded or Failed.
    pub terminal: bool,
    /// Each container's (init containers too) requests of extended resources other than the
    /// GPU's: `(resource, count)`, for the device kinds beside the GPU ([`super::kinds`]).
    pub extended: Vec<(String, u64)>,
}

impl PodSnapshot {
    /// The snapshot of `pod`.
    pub(crate) fn from_pod(pod: &Pod) -> Self {
        PodSnapshot {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            resource_version: pod.metadata.resource_version.clone(),
            request: pod_gpu_request(pod),
            annotations: pod_annotations(pod).0,
            terminal: pod_is_terminal(pod),
            extended: extended_requests(pod),
        }
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Every container's limits of resources with a domain (`example.com/x`), as `(resource,
/// count)`; quantities that are not whole numbers are left out.
fn extended_requests(pod: &Pod) -> Vec<(String, u64)> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .filter_map(|c| c.resources.as_ref()?.limits.as_ref())
        .flat_map(|limits| limits.iter())
        .filter(|(name, _)| name.contains('/'))
        .filter_map(|(name, q)| Some((name.clone(), q.0.trim().parse::<u64>().ok()?)))
        .collect()
}

/// The pod and container an Allocate call is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Match {
    /// Pod UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The container being allocated.
    pub container: String,
    /// Its request.
    pub units: GpuMem,
    /// The GPU the extender chose.
    pub gpu_index: u32,
    /// The pod's total (max of the largest init container and the sum of app containers).
    pub pod_total: GpuMem,
    /// GPU containers allocated once this one is (for `gpushare.io/allocated-containers`).
    pub allocated_after: Vec<String>,
    /// Whether this is the pod's last GPU container (then ASSIGNED becomes true).
    pub complete: bool,
}

/// A pod that was considered and why it did not match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotMatched {
    /// `namespace/name`.
    pub pod: String,
    /// Why.
    pub reason: String,
}

impl fmt::Display for NotMatched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.pod, self.reason)
    }
}

/// The GPU containers of `pod` already served: listed in its annotations or answered by this
/// process.
fn served<'a>(pod: &'a PodSnapshot, records: &'a Records) -> BTreeSet<&'a str> {
    pod.annotations
        .allocated_containers
        .iter()
        .map(String::as_str)
        .chain(
            records
                .containers_of(&pod.uid)
                .map(|g| g.container.as_str()),
        )
        .collect()
}

/// The GPU a pod's containers are given: the one its earlier containers got (so a pod never
/// spans two GPUs), else the extender's choice.
fn gpu_of(pod: &PodSnapshot, records: &Records) -> Option<u32> {
    records
        .containers_of(&pod.uid)
        .next()
        .map(|g| g.gpu_index)
        .or(pod.annotations.gpu_index)
}

/// Why a GPU pod is no candidate for a container's Allocate (the reason matching reports
/// for it in the failed Allocate's explanation).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NotCandidate {
    /// Its `aliyun.com/gpu-mem` limits cannot be read.
    #[error("unreadable request: {0}")]
    UnreadableRequest(RequestError),
    /// Succeeded or Failed.
    #[error("finished")]
    Finished,
    /// The extender has not bound it (no GPU index annotation).
    #[error("not bound by the extender (no ALIYUN_COM_GPU_MEM_IDX)")]
    NotBoundByExtender,
}

/// A bound, unfinished GPU pod with a readable request, or why it is not one (`None`: not a
/// GPU pod at all).
fn bound_request(pod: &PodSnapshot) -> Option<Result<&PodGpuRequest, NotCandidate>> {
    let request = match &pod.request {
        Ok(r) if r.is_gpu_pod() => r,
        Ok(_) => return None,
        Err(e) => return Some(Err(NotCandidate::UnreadableRequest(e.clone()))),
    };
    if pod.terminal {
        return Some(Err(NotCandidate::Finished));
    }
    if pod.annotations.gpu_index.is_none() {
        return Some(Err(NotCandidate::NotBoundByExtender));
    }
    Some(Ok(request))
}

/// Why a GPU pod is not a candidate for an Allocate of some size (turned into words only when
/// no pod matches: the hit path allocates nothing for the pods it passes over).
enum Passed<'a> {
    NotCandidate(NotCandidate),
    Assigned(Option<bool>),
    AllServed,
    OtherSize(&'a str, GpuMem),
    UnknownGpu(Option<u32>),
}

impl Passed<'_> {
    fn reason(&self, units: GpuMem) -> String {
        match self {
            Passed::NotCandidate(why) => why.to_string(),
            Passed::Assigned(Some(true)) => "already allocated (ASSIGNED=true)".to_string(),
            Passed::Assigned(_) => "ALIYUN_COM_GPU_MEM_ASSIGNED is not \"false\"".to_string(),
            Passed::AllServed => "every GPU container is already allocated".to_string(),
            Passed::OtherSize(name, mem) => {
                format!("next GPU container {name:?} requests {mem}, not {units}")
            }
            Passed::UnknownGpu(idx) => format!(
                "ALIYUN_COM_GPU_MEM_IDX={} names no GPU of this node",
                idx.map(|i| i.to_string()).unwrap_or_default()
            ),
        }
    }
}

/// A pod whose next GPU container has the size asked for.
struct Candidate<'a> {
    pod: &'a PodSnapshot,
    request: &'a PodGpuRequest,
    next: &'a str,
    gpu_index: u32,
    /// Whether nothing of it is served yet (a half-allocated pod comes first).
    fresh: bool,
}

impl Candidate<'_> {
    /// The order among candidates: half allocated first, then the oldest assume time, then
    /// namespace/name.
    fn rank(&self) -> (bool, u64, &str, &str) {
        (
            self.fresh,
            self.pod.annotations.assume_time_ns.unwrap_or(0),
            &self.pod.namespace,
            &self.pod.name,
        )
    }
}

/// Whether container `name` of `pod` is served: listed in its annotations or answered by this
/// process.
fn is_served(pod: &PodSnapshot, records: &Records, name: &str) -> bool {
    pod.annotations
        .allocated_containers
        .iter()
        .any(|c| c == name)
        || records.containers_of(&pod.uid).any(|g| g.container == name)
}

/// Whether `pod` is a candidate for `units`, or why not (`None`: not a GPU pod).
fn consider<'a>(
    pod: &'a PodSnapshot,
    records: &Records,
    units: GpuMem,
    gpu_known: &impl Fn(u32) -> bool,
) -> Option<Result<Candidate<'a>, Passed<'a>>> {
    let request = match bound_request(pod)? {
        Err(why) => return Some(Err(Passed::NotCandidate(why))),
        Ok(r) => r,
    };
    let ann = &pod.annotations;
    if ann.assigned != Some(false) {
        return Some(Err(Passed::Assigned(ann.assigned)));
    }
    let Some(next) = request
        .all_containers()
        .find(|c| !is_served(pod, records, &c.name))
    else {
        return Some(Err(Passed::AllServed));
    };
    if next.mem != units {
        return Some(Err(Passed::OtherSize(&next.name, next.mem)));
    }
    let Some(gpu_index) = gpu_of(pod, records).filter(|i| gpu_known(*i)) else {
        return Some(Err(Passed::UnknownGpu(ann.gpu_index)));
    };
    let fresh =
        ann.allocated_containers.is_empty() && records.containers_of(&pod.uid).next().is_none();
    Some(Ok(Candidate {
        pod,
        request,
        next: &next.name,
        gpu_index,
        fresh,
    }))
}

/// Finds the pod whose next GPU container asks for `units`; `gpu_known(idx)` says whether the
/// node has GPU `idx`. On failure, every GPU pod considered with its reason (sorted by name).
pub(crate) fn find_match<'a>(
    pods: impl IntoIterator<Item = &'a PodSnapshot>,
    records: &Records,
    units: GpuMem,
    gpu_known: impl Fn(u32) -> bool,
) -> Result<Match, Vec<NotMatched>> {
    let mut best: Option<Candidate<'a>> = None;
    let mut passed: Vec<(&'a PodSnapshot, Passed<'a>)> = Vec::new();
    for pod in pods {
        match consider(pod, records, units, &gpu_known) {
            Some(Err(why)) if best.is_none() => passed.push((pod, why)),
            Some(Ok(c)) if best.as_ref().is_none_or(|b| c.rank() < b.rank()) => best = Some(c),
            _ => {}
        }
    }
    match best {
        Some(c) => Ok(c.into_match(records, units)),
        None => {
            let mut rejected: Vec<NotMatched> = passed
                .into_iter()
                .map(|(pod, why)| NotMatched {
                    pod: pod.key(),
                    reason: why.reason(units),
                })
                .collect();
            rejected.sort_by(|a, b| a.pod.cmp(&b.pod));
            Err(rejected)
        }
    }
}

impl Candidate<'_> {
    /// The match of the chosen candidate (the only pod whose names are copied).
    fn into_match(self, records: &Records, units: GpuMem) -> Match {
        let pod = self.pod;
        let mut allocated_after: Vec<String> = self
            .request
            .all_containers()
            .filter(|c| is_served(pod, records, &c.name))
            .map(|c| c.name.clone())
            .collect();
        allocated_after.push(self.next.to_string());
        let mut remaining = self
            .request
            .all_containers()
            .filter(|c| c.name != self.next && !is_served(pod, records, &c.name));
        Match {
            uid: pod.uid.clone(),
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            container: self.next.to_string(),
            units,
            gpu_index: self.gpu_index,
            pod_total: crate::core::pod_holding(Some(self.request), &pod.annotations),
            allocated_after,
            complete: remaining.next().is_none(),
        }
    }
}

/// The match of container `container` of `pod`, already served (kubelet asking again with
/// the same device IDs), on GPU `gpu_index`; `None` when the pod is no longer bound and
/// unfinished or has no such GPU container.
pub(crate) fn match_for(
    pod: &PodSnapshot,
    records: &Records,
    container: &str,
    gpu_index: u32,
) -> Option<Match> {
    let Some(Ok(request)) = bound_request(pod) else {
        return None;
    };
    let c = request.all_containers().find(|c| c.name == container)?;
    let mut done = served(pod, records);
    done.insert(container);
    Some(Match {
        uid: pod.uid.clone(),
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        container: c.name.clone(),
        units: c.mem,
        gpu_index,
        pod_total: request.total(),
        allocated_after: request
            .all_containers()
            .filter(|x| done.contains(x.name.as_str()))
            .map(|x| x.name.clone())
            .collect(),
        complete: request
            .all_containers()
            .all(|x| done.contains(x.name.as_str())),
    })
}

/// kubelet asking again for a container it was answered before: among the bound, unfinished
/// pods, the GPU containers of `units` already served (annotations or records) for which
/// `held(namespace, pod, container)` is false (kubelet's PodResources shows no devices for
/// them), the latest answered wins. The match names that container and the GPU it was given.
pub(crate) fn find_repeat<'a>(
    pods: impl IntoIterator<Item = &'a PodSnapshot>,
    records: &Records,
    units: GpuMem,
    held: impl Fn(&str, &str, &str) -> bool,
    gpu_known: impl Fn(u32) -> bool,
) -> Option<Match> {
    let mut best: Option<((u64, u64), Match)> = None;
    for pod in pods {
        let Some(Ok(request)) = bound_request(pod) else {
            continue;
        };
        let done = served(pod, records);
        let Some(gpu_index) = gpu_of(pod, records).filter(|i| gpu_known(*i)) else {
            continue;
        };
        for c in request.all_containers() {
            if c.mem != units
                || !done.contains(c.name.as_str())
                || held(&pod.namespace, &pod.name, &c.name)
            {
                continue;
            }
            let seq = records
                .containers_of(&pod.uid)
                .find(|g| g.container == c.name)
                .map_or(0, |g| g.seq);
            let rank = (seq, pod.annotations.assume_time_ns.unwrap_or(0));
            if best.as_ref().is_some_and(|(r, _)| *r >= rank) {
                continue;
            }
            if let Some(m) = match_for(pod, records, &c.name, gpu_index) {
                best = Some((rank, m));
            }
        }
    }
    best.map(|(_, m)| m)
}

/// The explanation of a failed match, for the gRPC error and the node Event.
pub fn explain(units: &str, rejected: &[NotMatched]) -> String {
    const SHOWN: usize = 20;
    if rejected.is_empty() {
        return format!(
            "no pod on this node waits for a GPU container of {units}: none was bound by the \
             gpushare extender (is the scheduler configured to call it?)"
        );
    }
    let mut text = format!(
        "no pod on this node waits for a GPU container of {units}; considered: {}",
        rejected
            .iter()
            .take(SHOWN)
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    );
    if rejected.len() > SHOWN {
        text.push_str(&format!("; and {} more", rejected.len() - SHOWN));
    }
    text
}

/// The device IDs to prefer: `must_include` first, then available IDs of the GPU `target_uuid`
/// (the matched pod's GPU), then any other available ID, up to `size`, in the order given.
pub(crate) fn preferred_ids(
    available: &[String],
    must_include: &[String],
    size: usize,
    target_uuid: Option<&str>,
) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::with_capacity(size);
    let mut seen = BTreeSet::new();
    let on_target = |id: &str| {
        target_uuid.is_some_and(|t| parse_fake_device_id(id).is_some_and(|(u, _)| u == t))
    };
    let ordered = must_include
        .iter()
        .chain(available.iter().filter(|id| on_target(id)))
        .chain(available.iter().filter(|id| !on_target(id)));
    for id in ordered {
        if chosen.len() >= size {
            break;
        }
        if seen.insert(id.as_str()) {
            chosen.push(id.clone());
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ContainerGpuRequest;

    fn req(app: &[(&str, u64)], init: &[(&str, u64)]) -> PodGpuRequest {
        let c = |l: &[(&str, u64)]| {
            l.iter()
                .map(|(n, m)| ContainerGpuRequest {
                    name: n.to_string(),
                    mem: GpuMem::new(*m),
                    restartable: false,
                })
                .collect()
        };
        PodGpuRequest {
            containers: c(app),
            init_containers: c(init),
        }
    }

    fn pod(name: &str, request: PodGpuRequest, idx: Option<u32>, t: u64) -> PodSnapshot {
        PodSnapshot {
            namespace: "default".to_string(),
            name: name.to_string(),
            uid: format!("uid-{name}"),
            resource_version: None,
            request: Ok(request),
            extended: Vec::new(),
            annotations: PodGpuAnnotations {
                gpu_index: idx,
                pod_mem: None,
                device_mem: None,
                assigned: idx.map(|_| false),
                assume_time_ns: Some(t),
                allocated_containers: Vec::new(),
            },
            terminal: false,
        }
    }

    const ANY_GPU: fn(u32) -> bool = |i| i < 2;

    #[test]
    fn oldest_assume_time_wins_then_name() {
        let pods = [
            pod("b", req(&[("c", 2)], &[]), Some(1), 10),
            pod("a", req(&[("c", 2)], &[]), Some(0), 10),
            pod("z", req(&[("c", 2)], &[]), Some(1), 5),
        ];
        let m = find_match(&pods, &Records::default(), GpuMem::new(2), ANY_GPU).unwrap();
        assert_eq!((m.name.as_str(), m.gpu_index), ("z", 1));
        let m = find_match(&pods[..2], &Records::default(), GpuMem::new(2), ANY_GPU).unwrap();
        assert_eq!(m.name, "a");
        assert!(m.complete);
        assert_eq!(m.allocated_after, vec!["c".to_string()]);
    }

    #[test]
    fn multi_container_pods_match_container_by_container() {
        let mut p = pod(
            "multi",
            req(&[("x", 2), ("y", 3)], &[("init", 4)]),
            Some(0),
            1,
        );
        // Init container first.
        let m = find_match([&p], &Records::default(), GpuMem::new(4), ANY_GPU).unwrap();
        assert_eq!(m.container, "init");
        assert!(!m.complete);
        assert_eq!(m.pod_total, GpuMem::new(5));
        assert!(find_match([&p], &Records::default(), GpuMem::new(2), ANY_GPU).is_err());
        p.annotations.allocated_containers = vec!["init".to_string()];
        let m = find_match([&p], &Records::default(), GpuMem::new(2), ANY_GPU).unwrap();
        assert_eq!(m.container, "x");
        p.annotations.allocated_containers.push("x".to_string());
        let m = find_match([&p], &Records::default(), GpuMem::new(3), ANY_GPU).unwrap();
        assert!(m.complete);
        assert_eq!(m.allocated_after, vec!["init", "x", "y"]);
    }

    #[test]
    fn a_half_allocated_pod_comes_before_older_ones() {
        let older = pod("older", req(&[("c", 3)], &[]), Some(1), 1);
        let mut half = pod("half", req(&[("a", 2), ("b", 3)], &[]), Some(0), 9);
        half.annotations.allocated_containers = vec!["a".to_string()];
        let m = find_match(
            [&older, &half],
            &Records::default(),
            GpuMem::new(3),
            ANY_GPU,
        )
        .unwrap();
        assert_eq!((m.name.as_str(), m.gpu_index), ("half", 0));
        // Answered by this process but not yet in the annotations counts the same.
        let fresh = pod("half", req(&[("a", 2), ("b", 3)], &[]), Some(0), 9);
        let mut records = Records::default();
        let id = crate::deviceplugin::records::PodId {
            uid: fresh.uid.clone(),
            namespace: fresh.namespace.clone(),
            name: fresh.name.clone(),
        };
        records.claim(&id, "a", &["x".to_string(), "y".to_string()], 0);
        let m = find_match([&older, &fresh], &records, GpuMem::new(3), ANY_GPU).unwrap();
        assert_eq!((m.name.as_str(), m.container.as_str()), ("half", "b"));
        assert!(m.complete);
        // Asked again for "a", which kubelet does not show: the same container and GPU.
        let again = find_repeat(
            [&older, &fresh],
            &records,
            GpuMem::new(2),
            |_, _, _| false,
            ANY_GPU,
        )
        .expect("a repeat");
        assert_eq!((again.container.as_str(), again.gpu_index), ("a", 0));
        assert!(find_repeat([&fresh], &records, GpuMem::new(2), |_, _, _| true, ANY_GPU).is_none());
    }

    #[test]
    fn reasons_name_every_gpu_pod_considered() {
        let mut assigned = pod("done", req(&[("c", 2)], &[]), Some(0), 1);
        assigned.annotations.assigned = Some(true);
        let mut finished = pod("fin", req(&[("c", 2)], &[]), Some(0), 1);
        finished.terminal = true;
        let pods = [
            assigned,
            finished,
            pod("unbound", req(&[("c", 2)], &[]), None, 1),
            pod("size", req(&[("c", 3)], &[]), Some(0), 1),
            pod("badidx", req(&[("c", 2)], &[]), Some(7), 1),
            pod("cpu", req(&[], &[]), None, 1),
        ];
        let why = find_match(&pods, &Records::default(), GpuMem::new(2), ANY_GPU).unwrap_err();
        let names: Vec<&str> = why.iter().map(|n| n.pod.as_str()).collect();
        assert_eq!(
            names,
            [
                "default/badidx",
                "default/done",
                "default/fin",
                "default/size",
                "default/unbound"
            ]
        );
        let text = explain("2GiB", &why);
        assert!(text.contains("default/size: next GPU container \"c\" requests 3, not 2"));
        assert!(text.contains("ASSIGNED=true"));
    }

    #[test]
    fn preferred_ids_steer_to_the_target_gpu() {
        let ids: Vec<String> = [
            "GPU-a-_-0",
            "GPU-a-_-1",
            "GPU-b-_-0",
            "GPU-b-_-1",
            "GPU-b-_-2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            preferred_ids(&ids, &[], 2, Some("GPU-b")),
            vec!["GPU-b-_-0", "GPU-b-_-1"]
        );
        assert_eq!(
            preferred_ids(&ids, &[ids[0].clone()], 2, Some("GPU-b")),
            vec!["GPU-a-_-0", "GPU-b-_-0"]
        );
        assert_eq!(
            preferred_ids(&ids, &[], 2, None),
            vec!["GPU-a-_-0", "GPU-a-_-1"]
        );
        assert_eq!(preferred_ids(&ids, &[], 9, Some("GPU-b")).len(), 5);
    }
}
