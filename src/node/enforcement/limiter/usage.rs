//! What the node agent reads back of the limiter, every `enforcement_check_secs`, into the
//! same rows as the driver's readback ([`ContainerMemory`]: the metrics, the node annotation,
//! `inspect`): each served container's usage per GPU from its ledger
//! (`gpushare_limiter_contract::read_gpu`), and the cleanup of containers that are gone.
//!
//! A row is `enforced` when the limit the container's processes read equals its share (or no
//! process has used the GPU yet and the limits file says the share), `mismatch` when they read
//! another, `unreadable` when the ledger cannot be read (the container owns its state
//! directory: the reader trusts nothing in it), `missing` when the limits file is gone, or for
//! a running container of the device-plugin path that got no limiter at all (started before
//! the node agent served it with the limiter: a restart gives it one).
//!
//! Cleanup ([`sweep`]): a device-plugin container's directory goes once its pod is gone from
//! the node or finished (Succeeded, Failed: no container of it starts again), a fallback
//! container's (its pod unknown) once no unfinished pod on the node asks for GPU memory; never
//! while a live process holds memory in its ledger, and only from a pod list taken after the
//! directories were read (a directory is written before its container's pod could be missing
//! from a later list). DRA shares' directories go when their claim is unprepared
//! ([`super::Limiter::release_claim`]), which kubelet repeats until it succeeds, and at the
//! DRA plugin's start for claims its checkpoint no longer holds
//! ([`super::Limiter::release_claims_except`]).
//!
//! A DRA share's directory is written before its pod is known (a claim names no pod); its pod
//! and container are found here from the node's pods (`status.resourceClaimStatuses`, the
//! containers' `resources.claims`) and the claims' UIDs, and written into its owner file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use gpushare_limiter_contract::{GpuUuid, Limits, read_gpu};
use k8s_openapi::api::core::v1::Pod;

use super::containers::{self, Key, Owner, PATH_DEVICE_PLUGIN, PATH_DRA};
use crate::node::enforcement::report::{ContainerMemory, LimitState};
use crate::node::gpus::ServedGpu;

/// The `mechanism` of the limiter's rows.
pub const MECHANISM: &str = "limiter";

/// Whether a live process of container `key` holds a slot in one of its ledgers (a ledger that
/// cannot be read counts as live: nothing is removed on a guess).
pub fn live(run_dir: &Path, key: &Key) -> bool {
    let state = containers::files(run_dir, key).state;
    match gpushare_limiter_contract::read_container(&state) {
        Ok(gpus) => gpus.iter().any(|g| !g.processes.is_empty()),
        Err(gpushare_limiter_contract::ReadError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            false
        }
        Err(_) => true,
    }
}

fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The entries [`sweep`] removes, given the node's pods (listed after the entries were read):
/// pure.
pub fn gone(entries: &[(Key, Owner)], pods: &[Pod]) -> Vec<Key> {
    let running: BTreeSet<&str> = pods
        .iter()
        .filter(|p| !finished(p))
        .filter_map(|p| p.metadata.uid.as_deref())
        .collect();
    let any_gpu_pod = pods
        .iter()
        .filter(|p| !finished(p))
        .any(|p| crate::k8s::project::pod_gpu_request(p).is_ok_and(|r| r.is_gpu_pod()));
    entries
        .iter()
        .filter(|(_, o)| o.path == PATH_DEVICE_PLUGIN)
        .filter(|(_, o)| {
            if o.pod_uid.is_empty() {
                !any_gpu_pod
            } else {
                !running.contains(o.pod_uid.as_str())
            }
        })
        .map(|(k, _)| k.clone())
        .collect()
}

/// Removes the directories of gone device-plugin containers ([`gone`]) whose ledgers no live
/// process holds; returns the keys removed. Blocking.
pub fn sweep(run_dir: &Path, entries: &[(Key, Owner)], pods: &[Pod]) -> Vec<Key> {
    let mut removed = Vec::new();
    for key in gone(entries, pods) {
        if live(run_dir, &key) {
            tracing::debug!(container = %key, "its pod is gone but a process still holds GPU memory; kept");
            continue;
        }
        match containers::remove(run_dir, &key) {
            Ok(()) => removed.push(key),
            Err(e) => {
                tracing::warn!(container = %key, error = %e, "could not remove a gone container's limiter files")
            }
        }
    }
    removed
}

/// The rows of the containers in `entries` whose pod is known: usage per GPU from the ledger.
/// Blocking (reads the ledgers, with short waits on a held lock).
pub fn rows(run_dir: &Path, entries: &[(Key, Owner)], gpus: &[ServedGpu]) -> Vec<ContainerMemory> {
    let mut out = Vec::new();
    for (key, owner) in entries.iter().filter(|(_, o)| !o.pod.is_empty()) {
        let f = containers::files(run_dir, key);
        let file = std::fs::read_to_string(&f.limits)
            .map_err(|e| e.to_string())
            .and_then(|t| Limits::parse(&t).map_err(|e| e.to_string()));
        for (uuid, expected) in &owner.limits {
            let index = gpus
                .iter()
                .find(|g| &g.uuid == uuid)
                .map_or(u32::MAX, |g| g.index);
            let mut row = ContainerMemory {
                namespace: owner.namespace.clone(),
                pod: owner.pod.clone(),
                container: owner.container.clone(),
                gpu: uuid.clone(),
                index,
                expected: *expected,
                limit: None,
                used: None,
                state: LimitState::Enforced,
                detail: String::new(),
                mechanism: MECHANISM.to_string(),
            };
            let Ok(parsed) = GpuUuid::parse(uuid) else {
                continue;
            };
            let in_file = match &file {
                Ok(l) => l.get(&parsed),
                Err(e) => {
                    row.state = LimitState::Missing;
                    row.detail = format!(
                        "the container's limits file {} cannot be read ({e}): its processes \
                         refuse every allocation",
                        f.limits.display()
                    );
                    out.push(row);
                    continue;
                }
            };
            match read_gpu(&f.state, &parsed) {
                Ok(Some(usage)) => {
                    row.limit = Some(usage.limit_bytes);
                    row.used = Some(usage.used_bytes);
                    if usage.limit_bytes != *expected {
                        row.state = LimitState::Mismatch;
                        row.detail = format!(
                            "its processes hold a limit of {} bytes instead of {expected}",
                            usage.limit_bytes
                        );
                    }
                }
                Ok(None) => {
                    row.limit = in_file;
                    row.used = Some(0);
                    if in_file != Some(*expected) {
                        row.state = LimitState::Mismatch;
                        row.detail = format!(
                            "the limits file says {} instead of {expected} bytes",
                            in_file.map_or("nothing".to_string(), |b| b.to_string())
                        );
                    }
                }
                Err(e) => {
                    row.limit = in_file;
                    row.state = LimitState::Unreadable;
                    row.detail = e.to_string();
                }
            }
            out.push(row);
        }
    }
    out
}

/// Rows for the device-plugin path's running GPU containers that have no limiter files (they
/// started before the node agent served them with the limiter).
pub fn unserved(
    pods: &[Pod],
    entries: &[(Key, Owner)],
    gpus: &[ServedGpu],
    unit: crate::core::MemoryUnit,
) -> Vec<ContainerMemory> {
    let served: BTreeSet<(&str, &str)> = entries
        .iter()
        .filter(|(_, o)| o.path == PATH_DEVICE_PLUGIN)
        .map(|(_, o)| (o.pod_uid.as_str(), o.container.as_str()))
        .collect();
    let mut rows = Vec::new();
    for pod in pods {
        let (ann, _) = crate::k8s::project::pod_annotations(pod);
        if ann.assigned != Some(true) {
            continue;
        }
        let Some(gpu) = ann
            .gpu_index
            .and_then(|i| gpus.iter().find(|g| g.index == i))
        else {
            continue;
        };
        let Ok(request) = crate::k8s::project::pod_gpu_request(pod) else {
            continue;
        };
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let statuses = pod
            .status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten());
        for status in statuses {
            if status.state.as_ref().is_none_or(|s| s.running.is_none()) {
                continue;
            }
            let Some(want) = request
                .all_containers()
                .find(|c| c.name == status.name && !c.mem.is_zero())
            else {
                continue;
            };
            if served.contains(&(uid, status.name.as_str())) {
                continue;
            }
            rows.push(ContainerMemory {
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                pod: pod.metadata.name.clone().unwrap_or_default(),
                container: status.name.clone(),
                gpu: gpu.uuid.clone(),
                index: gpu.index,
                expected: unit.to_bytes(want.mem),
                limit: None,
                used: None,
                state: LimitState::Missing,
                detail: "the container runs without the limiter: it started before the node \
                         agent served it with the limiter; restart it to have it limited"
                    .to_string(),
                mechanism: MECHANISM.to_string(),
            });
        }
    }
    rows
}

/// For each pod on the node that uses claims: (namespace, claim name) → (pod, its name for
/// the claim), from `spec.resourceClaims` and `status.resourceClaimStatuses`.
fn claim_users(pods: &[Pod]) -> BTreeMap<(String, String), Vec<(&Pod, String)>> {
    let mut out: BTreeMap<(String, String), Vec<(&Pod, String)>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| !finished(p)) {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let spec_claims = pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten());
        for c in spec_claims {
            if let Some(name) = &c.resource_claim_name {
                out.entry((ns.clone(), name.clone()))
                    .or_default()
                    .push((pod, c.name.clone()));
            }
        }
        let statuses = pod
            .status
            .iter()
            .flat_map(|s| s.resource_claim_statuses.iter().flatten());
        for c in statuses {
            if let Some(name) = &c.resource_claim_name {
                out.entry((ns.clone(), name.clone()))
                    .or_default()
                    .push((pod, c.name.clone()));
            }
        }
    }
    out
}

/// The container of `pod` that uses `request` of its claim `pod_claim` (a container naming the
/// claim without a request uses all of it).
fn container_of(pod: &Pod, pod_claim: &str, request: &str) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let top = request.split('/').next().unwrap_or(request);
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .find(|c| {
            c.resources
                .iter()
                .flat_map(|r| r.claims.iter().flatten())
                .any(|rc| rc.name == pod_claim && rc.request.as_deref().is_none_or(|r| r == top))
        })
        .map(|c| c.name.clone())
}

/// Finds the pod and container of each DRA share in `entries` whose pod is not known yet, and
/// writes them into its owner file. `claim_uid` answers a claim's UID by namespace and name
/// (an API read; `None` when it cannot be read now). Returns how many were found.
pub async fn resolve_dra<F, Fut>(
    run_dir: &Path,
    entries: &mut [(Key, Owner)],
    pods: &[Pod],
    mut claim_uid: F,
) -> usize
where
    F: FnMut(String, String) -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    if !entries
        .iter()
        .any(|(_, o)| o.path == PATH_DRA && o.pod.is_empty())
    {
        return 0;
    }
    let users = claim_users(pods);
    let mut uids: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (ns, name) in users.keys() {
        if let Some(uid) = claim_uid(ns.clone(), name.clone()).await {
            uids.insert(uid, (ns.clone(), name.clone()));
        }
    }
    let mut found = 0;
    for (key, owner) in entries
        .iter_mut()
        .filter(|(_, o)| o.path == PATH_DRA && o.pod.is_empty())
    {
        let Some(claim) = uids.get(&owner.claim_uid) else {
            continue;
        };
        let Some((pod, container)) = users
            .get(claim)
            .into_iter()
            .flatten()
            .find_map(|(pod, n)| container_of(pod, n, &owner.request).map(|c| (*pod, c)))
        else {
            continue;
        };
        owner.namespace = claim.0.clone();
        owner.pod = pod.metadata.name.clone().unwrap_or_default();
        owner.pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        owner.container = container;
        if let Err(e) = containers::write_owner(run_dir, key, owner) {
            tracing::debug!(container = %key, error = %e, "the share's pod is known, its owner file not rewritten");
        }
        found += 1;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str, phase: &str, gpu: bool) -> Pod {
        let mut containers = json!([{ "name": "main", "image": "x" }]);
        if gpu {
            containers[0]["resources"] = json!({ "limits": { "aliyun.com/gpu-mem": "4" } });
        }
        serde_json::from_value(json!({
            "metadata": { "name": format!("p-{uid}"), "namespace": "default", "uid": uid },
            "spec": { "containers": containers },
            "status": { "phase": phase },
        }))
        .expect("pod")
    }

    fn dp(uid: &str) -> (Key, Owner) {
        let owner = Owner {
            path: PATH_DEVICE_PLUGIN.into(),
            pod_uid: uid.into(),
            container: "main".into(),
            ..Owner::default()
        };
        let key = if uid.is_empty() {
            Key::device_plugin_unmatched(&["a".into()])
        } else {
            Key::device_plugin(uid, "main").expect("key")
        };
        (key, owner)
    }

    #[test]
    fn a_device_plugin_container_goes_with_its_pod_and_a_fallback_with_the_last_gpu_pod() {
        let entries = vec![dp("u1"), dp("u2"), dp("u3"), dp("")];
        let pods = vec![pod("u1", "Running", true), pod("u2", "Succeeded", true)];
        let gone_keys = gone(&entries, &pods);
        assert_eq!(gone_keys, vec![entries[1].0.clone(), entries[2].0.clone()]);
        // The fallback stays while an unfinished GPU pod may be it.
        let only_done = vec![pod("u1", "Failed", true), pod("u9", "Running", false)];
        assert_eq!(gone(&entries, &only_done).len(), 4);
        let dra = (
            Key::dra("c", 0).expect("key"),
            Owner {
                path: PATH_DRA.into(),
                ..Owner::default()
            },
        );
        assert!(gone(&[dra], &[]).is_empty(), "DRA shares go at unprepare");
    }

    #[tokio::test]
    async fn a_dra_share_finds_its_pod_and_container() {
        let run = tempfile::tempdir().expect("dir");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": "p", "namespace": "ns", "uid": "pod-uid" },
            "spec": {
                "containers": [
                    { "name": "side", "image": "x" },
                    { "name": "main", "image": "x", "resources": { "claims": [{ "name": "gpu", "request": "main" }] } },
                ],
                "resourceClaims": [{ "name": "gpu", "resourceClaimTemplateName": "t" }],
            },
            "status": { "phase": "Pending", "resourceClaimStatuses": [{ "name": "gpu", "resourceClaimName": "p-gpu-x7" }] },
        }))
        .expect("pod");
        let key = Key::dra("claim-uid", 0).expect("key");
        let owner = Owner {
            path: PATH_DRA.into(),
            claim_uid: "claim-uid".into(),
            request: "main".into(),
            limits: BTreeMap::from([("GPU-00000000-0000-0000-0000-000000000001".into(), 1)]),
            ..Owner::default()
        };
        containers::create(run.path(), &key, &owner).expect("created");
        let mut entries = vec![(key.clone(), owner)];
        let asked = std::sync::Mutex::new(Vec::new());
        let n = resolve_dra(run.path(), &mut entries, &[pod], |ns, name| {
            asked.lock().expect("lock").push(format!("{ns}/{name}"));
            async { Some("claim-uid".to_string()) }
        })
        .await;
        assert_eq!(n, 1);
        assert_eq!(asked.into_inner().expect("lock"), ["ns/p-gpu-x7"]);
        let o = &entries[0].1;
        assert_eq!(
            (o.namespace.as_str(), o.pod.as_str(), o.container.as_str()),
            ("ns", "p", "main")
        );
        assert_eq!(containers::list(run.path()).0[0].1.pod, "p", "written down");
    }
}
