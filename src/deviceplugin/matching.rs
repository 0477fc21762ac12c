//! Which pod an Allocate call is for (kubelet does not say), decided per container.
//!
//! A candidate is a pod on this node that the extender bound (`ALIYUN_COM_GPU_MEM_IDX` set,
//! `ASSIGNED=false`), not finished, whose NEXT not-yet-allocated GPU container (init
//! containers first, then app containers, in spec order, minus those listed in
//! `gpushare.io/allocated-containers`) requests exactly the units kubelet asked for. The
//! oldest assume time wins; ties are broken by namespace/name so the choice is deterministic.
//! Upstream compared the pod's total with a container's request, so pods with two GPU
//! containers never matched (EXT#143).
//!
//! Pure: works on [`PodSnapshot`]s, never talks to the API.

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;

use crate::core::wire::parse_fake_device_id;
use crate::core::{GpuMem, PodGpuAnnotations, PodGpuRequest};
use crate::k8s::{pod_annotations, pod_gpu_request, pod_is_terminal};

/// What matching needs to know about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSnapshot {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub resource_version: Option<String>,
    /// Its GPU request, or why it could not be read.
    pub request: Result<PodGpuRequest, String>,
    /// Its gpushare annotations.
    pub annotations: PodGpuAnnotations,
    /// Succeeded or Failed.
    pub terminal: bool,
}

impl PodSnapshot {
    /// The snapshot of `pod`.
    pub fn from_pod(pod: &Pod) -> Self {
        PodSnapshot {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            resource_version: pod.metadata.resource_version.clone(),
            request: pod_gpu_request(pod).map_err(|e| e.to_string()),
            annotations: pod_annotations(pod).0,
            terminal: pod_is_terminal(pod),
        }
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether it asks for GPU memory at all.
    pub fn is_gpu_pod(&self) -> bool {
        self.request.as_ref().is_ok_and(PodGpuRequest::is_gpu_pod)
    }
}

/// The pod and container an Allocate call is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match {
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

/// Finds the pod whose next GPU container asks for `units`; `gpu_known(idx)` says whether the
/// node has GPU `idx`. On failure, every GPU pod considered with its reason (sorted by name).
pub fn find_match<'a>(
    pods: impl IntoIterator<Item = &'a PodSnapshot>,
    units: GpuMem,
    gpu_known: impl Fn(u32) -> bool,
) -> Result<Match, Vec<NotMatched>> {
    let mut found: Vec<(u64, &PodSnapshot, Match)> = Vec::new();
    let mut rejected = Vec::new();
    for pod in pods {
        let reject = |reason: String| NotMatched {
            pod: pod.key(),
            reason,
        };
        let request = match &pod.request {
            Ok(r) if r.is_gpu_pod() => r,
            Ok(_) => continue,
            Err(e) => {
                rejected.push(reject(format!("unreadable request: {e}")));
                continue;
            }
        };
        if pod.terminal {
            rejected.push(reject("finished".to_string()));
            continue;
        }
        let ann = &pod.annotations;
        let Some(gpu_index) = ann.gpu_index else {
            rejected.push(reject(
                "not bound by the extender (no ALIYUN_COM_GPU_MEM_IDX)".to_string(),
            ));
            continue;
        };
        if ann.assigned != Some(false) {
            rejected.push(reject(match ann.assigned {
                Some(true) => "already allocated (ASSIGNED=true)".to_string(),
                _ => "ALIYUN_COM_GPU_MEM_ASSIGNED is not \"false\"".to_string(),
            }));
            continue;
        }
        let done: BTreeSet<&str> = ann
            .allocated_containers
            .iter()
            .map(String::as_str)
            .collect();
        let mut remaining = request
            .all_containers()
            .filter(|c| !done.contains(c.name.as_str()));
        let Some(next) = remaining.next() else {
            rejected.push(reject(
                "every GPU container is already allocated".to_string(),
            ));
            continue;
        };
        if next.mem != units {
            rejected.push(reject(format!(
                "next GPU container {:?} requests {}, not {}",
                next.name, next.mem, units
            )));
            continue;
        }
        if !gpu_known(gpu_index) {
            rejected.push(reject(format!(
                "ALIYUN_COM_GPU_MEM_IDX={gpu_index} names no GPU of this node"
            )));
            continue;
        }
        let complete = remaining.next().is_none();
        let mut allocated_after: Vec<String> = request
            .all_containers()
            .filter(|c| done.contains(c.name.as_str()))
            .map(|c| c.name.clone())
            .collect();
        allocated_after.push(next.name.clone());
        found.push((
            ann.assume_time_ns.unwrap_or(0),
            pod,
            Match {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                container: next.name.clone(),
                units,
                gpu_index,
                pod_total: crate::core::pod_holding(Some(request), ann),
                allocated_after,
                complete,
            },
        ));
    }
    found.sort_by(|a, b| (a.0, &a.1.namespace, &a.1.name).cmp(&(b.0, &b.1.namespace, &b.1.name)));
    match found.into_iter().next() {
        Some((_, _, m)) => Ok(m),
        None => {
            rejected.sort_by(|a, b| a.pod.cmp(&b.pod));
            Err(rejected)
        }
    }
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
pub fn preferred_ids(
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
        let m = find_match(&pods, GpuMem::new(2), ANY_GPU).unwrap();
        assert_eq!((m.name.as_str(), m.gpu_index), ("z", 1));
        let m = find_match(&pods[..2], GpuMem::new(2), ANY_GPU).unwrap();
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
        let m = find_match([&p], GpuMem::new(4), ANY_GPU).unwrap();
        assert_eq!(m.container, "init");
        assert!(!m.complete);
        assert_eq!(m.pod_total, GpuMem::new(5));
        assert!(find_match([&p], GpuMem::new(2), ANY_GPU).is_err());
        p.annotations.allocated_containers = vec!["init".to_string()];
        let m = find_match([&p], GpuMem::new(2), ANY_GPU).unwrap();
        assert_eq!(m.container, "x");
        p.annotations.allocated_containers.push("x".to_string());
        let m = find_match([&p], GpuMem::new(3), ANY_GPU).unwrap();
        assert!(m.complete);
        assert_eq!(m.allocated_after, vec!["init", "x", "y"]);
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
        let why = find_match(&pods, GpuMem::new(2), ANY_GPU).unwrap_err();
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
