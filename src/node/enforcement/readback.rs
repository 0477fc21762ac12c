//! Verified, not assumed: every `enforcement_check_secs` the node agent reads back the limit of
//! every container the hook recorded ([`super::record`]), through the same way to the driver
//! the hook used (`GetMemoryLimits_v1`: soft, hard, used), and looks for served containers the
//! hook never saw; under the CUDA memory limiter it reads each served container's ledger
//! instead ([`super::limiter::usage`], the same rows).
//!
//! Each (container, GPU) becomes a [`ContainerMemory`] row: `enforced` (soft = hard = the
//! share), `missing` (no limit: cleared, or the hook never ran — a device-plugin container of a
//! driver-enforced path that is running without a record), `mismatch` (another limit) or
//! `unreadable`. The rows are published ([`Status`]): as metrics
//! (`gpushare_container_gpu_memory_used_bytes`, `…_limit_bytes`, containers per state), as the
//! node annotation `gpushare.io/container-gpu-memory` that `inspect` reads, and to the roles (the
//! DRA plugin turns them into health messages on its devices). A row that turns bad raises a
//! Warning Event on its pod and is counted (`gpushare_enforcement_violations_total`).
//!
//! Cleanup: a recorded cgroup that holds no process any more (`populated 0`: the container
//! stopped, its cgroup not yet removed) has its limits cleared (soft 0, no hard limit) before
//! the runtime removes it — noticed at once through inotify on its `cgroup.events`
//! ([`watch_stops`]), and by every cycle as well — under dmem a soft limit left on a removed cgroup stays counted in
//! its ancestors — and the record is removed; a cgroup already gone is counted as a missed
//! cleanup. The first cycle runs at start, so a restarted node agent reconciles what happened
//! while it was down.
//!
//! It does not set limits for containers (the hook does) or decide the mechanism.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use super::record::{self, LimitRecord};
use super::report::{ContainerMemory, LimitState};
pub use super::status::{ContainerLabels, OutcomeLabel, StateLabel, Status};
use super::{Enforcer, Mechanism};
use crate::cgroup::Leaf;
use crate::core::MemoryUnit;
use crate::core::wire::{DEVICE_PLUGIN_COMPONENT, NODE_ANN_CONTAINER_GPU_MEMORY};
use crate::gpu::limits::{LimitError, MemoryLimits, NO_LIMIT};
use crate::k8s::events::{Events, Severity, pod_reference};
use crate::node::gpus::ServedGpu;
use crate::node::paths::ServingPath;
use crate::shutdown::Shutdown;

/// What one cycle needs of the node agent.
#[derive(Clone, Debug)]
pub struct Scope {
    /// This node.
    pub node: String,
    /// The served GPUs.
    pub gpus: Vec<ServedGpu>,
    /// The node's memory unit.
    pub unit: MemoryUnit,
}

/// The state of one recorded container's limit on one GPU.
fn judge(
    expected: u64,
    read: Result<crate::gpu::limits::LimitReading, LimitError>,
) -> (LimitState, Option<u64>, Option<u64>, String) {
    match read {
        Ok(r) if r.soft == expected && r.hard == expected => (
            LimitState::Enforced,
            Some(r.hard),
            Some(r.used),
            String::new(),
        ),
        Ok(r) if r.is_unlimited() => (
            LimitState::Missing,
            None,
            Some(r.used),
            "no limit on the container's cgroup (cleared, or never set)".to_string(),
        ),
        Ok(r) => (
            LimitState::Mismatch,
            (r.hard != NO_LIMIT).then_some(r.hard),
            Some(r.used),
            format!(
                "soft {} and hard {} bytes instead of {expected}",
                r.soft,
                if r.hard == NO_LIMIT {
                    "none".to_string()
                } else {
                    r.hard.to_string()
                }
            ),
        ),
        // The misc backend answers Not Supported for a cgroup no limit reaches.
        Err(LimitError::NotSupported(e)) => (
            LimitState::Missing,
            None,
            None,
            format!("no limit reaches the container's cgroup ({e})"),
        ),
        Err(e) => (LimitState::Unreadable, None, None, e.to_string()),
    }
}

/// One pass over the records (blocking): clears the limits of stopped containers and drops
/// gone ones, reads back the rest. Returns the rows and the container ids recorded.
pub fn check_records(
    enforcer: &Enforcer,
    limits: &dyn MemoryLimits,
    scope: &Scope,
) -> (Vec<ContainerMemory>, BTreeSet<String>) {
    let dir = enforcer.state_dir();
    let (records, errors) = record::read_all(dir);
    for e in errors {
        tracing::warn!(error = %e, "unreadable limit record");
    }
    let root = &enforcer.config().cgroup_root;
    let dmem = enforcer.support().backend == Some("dmem");
    let mut rows = Vec::new();
    let mut ids = BTreeSet::new();
    for rec in records {
        let leaf = match Leaf::at(root, &rec.cgroup) {
            Ok(leaf) => leaf,
            Err(e) => {
                tracing::warn!(container = rec.container_id, error = %e, "limit record with a refused cgroup; dropped");
                let _ = record::remove(dir, &rec.container_id);
                continue;
            }
        };
        if !leaf.exists() {
            if dmem && rec.limits.values().any(|b| *b > 0) {
                tracing::warn!(
                    pod = format!("{}/{}", rec.namespace, rec.pod),
                    container = rec.container,
                    cgroup = rec.cgroup,
                    "the container's cgroup went before its soft limit was cleared: under dmem its \
                     ancestors keep counting it until they go (docs/enforcement.md)"
                );
                enforcer.status().cleanup("missed");
            }
            let _ = record::remove(dir, &rec.container_id);
            continue;
        }
        if crate::cgroup::populated(&leaf.path) == Some(false) {
            clear(enforcer, limits, &rec, &leaf);
            continue;
        }
        ids.insert(rec.container_id.clone());
        for (uuid, bytes) in &rec.limits {
            let index = scope
                .gpus
                .iter()
                .find(|g| &g.uuid == uuid)
                .map_or(u32::MAX, |g| g.index);
            let (state, limit, used, detail) = judge(*bytes, limits.get(uuid, &leaf.path));
            rows.push(ContainerMemory {
                namespace: rec.namespace.clone(),
                pod: rec.pod.clone(),
                container: rec.container.clone(),
                gpu: uuid.clone(),
                index,
                expected: *bytes,
                limit,
                used,
                state,
                detail,
                mechanism: Mechanism::Driver.as_str().to_string(),
            });
        }
    }
    (rows, ids)
}

/// Clears a stopped container's limits and drops its record (once: a record already dropped,
/// by the other of the readback and the watch, is left alone).
fn clear(enforcer: &Enforcer, limits: &dyn MemoryLimits, rec: &LimitRecord, leaf: &Leaf) {
    if record::read(enforcer.state_dir(), &rec.container_id).is_none() {
        return;
    }
    let mut failed = false;
    for uuid in rec.limits.keys() {
        if let Err(e) = limits.set(uuid, &leaf.path, 0, NO_LIMIT)
            && leaf.exists()
        {
            tracing::warn!(gpu = uuid, cgroup = %leaf.path.display(), error = %e, "could not clear a stopped container's limit");
            failed = true;
        }
    }
    let outcome = if failed {
        "failed"
    } else if leaf.exists() {
        "cleared"
    } else {
        "missed"
    };
    enforcer.status().cleanup(outcome);
    tracing::info!(
        pod = format!("{}/{}", rec.namespace, rec.pod),
        container = rec.container,
        outcome,
        "stopped container: limits cleared"
    );
    let _ = record::remove(enforcer.state_dir(), &rec.container_id);
}

/// Clears the limits of a recorded container the moment its cgroup empties (inotify on
/// `cgroup.events`), between the readback's cycles, so the runtime's removal of the cgroup
/// rarely comes first. Re-reads the records every second; returns when `stop` is set.
#[cfg(target_os = "linux")]
pub fn watch_stops(
    enforcer: Arc<Enforcer>,
    limits: Arc<dyn MemoryLimits>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut watch = match crate::cgroup::EventsWatch::new() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "no inotify: stopped containers are cleared by the readback only");
            return;
        }
    };
    let root = enforcer.config().cgroup_root.clone();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let (records, _) = record::read_all(enforcer.state_dir());
        let leaves: BTreeMap<std::path::PathBuf, (LimitRecord, Leaf)> = records
            .into_iter()
            .filter_map(|r| {
                let leaf = Leaf::at(&root, &r.cgroup).ok()?;
                Some((leaf.path.clone(), (r, leaf)))
            })
            .collect();
        let paths: Vec<std::path::PathBuf> = leaves.keys().cloned().collect();
        // A cgroup that emptied before it was watched is looked at once.
        let added = watch.set(&paths);
        for changed in added.into_iter().chain(watch.wait(Duration::from_secs(1))) {
            if let Some((rec, leaf)) = leaves.get(&changed)
                && crate::cgroup::populated(&leaf.path) == Some(false)
            {
                clear(&enforcer, limits.as_ref(), rec, leaf);
            }
        }
    }
}

/// Sets the flag when dropped (the watch thread's stop).
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The container id of a status's `containerID` (`containerd://<id>`, `cri-o://<id>`).
fn container_id(raw: &str) -> &str {
    raw.split_once("://").map_or(raw, |(_, id)| id)
}

/// Rows for the device-plugin path's running GPU containers that no record names: the hook
/// never ran for them (a runtime that ignores CDI while the envvar strategy hands the GPU over).
pub fn unrecorded(
    pods: &[Pod],
    recorded: &BTreeSet<String>,
    scope: &Scope,
) -> Vec<ContainerMemory> {
    let mut rows = Vec::new();
    for pod in pods {
        let (ann, _) = crate::k8s::project::pod_annotations(pod);
        if ann.assigned != Some(true) {
            continue;
        }
        let Some(gpu) = ann
            .gpu_index
            .and_then(|i| scope.gpus.iter().find(|g| g.index == i))
        else {
            continue;
        };
        let Ok(request) = crate::k8s::project::pod_gpu_request(pod) else {
            continue;
        };
        let statuses = pod
            .status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten());
        for status in statuses {
            let running = status.state.as_ref().is_some_and(|s| s.running.is_some());
            let Some(raw) = status.container_id.as_deref().filter(|_| running) else {
                continue;
            };
            let Some(want) = request
                .all_containers()
                .find(|c| c.name == status.name && !c.mem.is_zero())
            else {
                continue;
            };
            if recorded.contains(container_id(raw)) {
                continue;
            }
            rows.push(ContainerMemory {
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                pod: pod.metadata.name.clone().unwrap_or_default(),
                container: status.name.clone(),
                gpu: gpu.uuid.clone(),
                index: gpu.index,
                expected: scope.unit.to_bytes(want.mem),
                limit: None,
                used: None,
                state: LimitState::Missing,
                detail: "no limit was set: the hook did not run for this container (does the \
                         runtime apply CDI devices? run `gpushare doctor --role node`)"
                    .to_string(),
                mechanism: Mechanism::Driver.as_str().to_string(),
            });
        }
    }
    rows
}

/// The annotation's rows: used memory rounded down to MiB, so a node is not patched for every
/// byte a container allocates.
fn for_annotation(rows: &[ContainerMemory]) -> Vec<ContainerMemory> {
    rows.iter()
        .map(|r| ContainerMemory {
            used: r.used.map(|u| u & !((1 << 20) - 1)),
            ..r.clone()
        })
        .collect()
}

/// Runs the readback until `stop`: a cycle at once, then every `enforcement_check_secs`: the
/// driver's limits of the hook's records, and the limiter's ledgers
/// ([`super::limiter::usage`]), into one set of rows.
pub async fn run(enforcer: Arc<Enforcer>, client: kube::Client, scope: Scope, stop: Shutdown) {
    let on = |m: Mechanism| {
        [ServingPath::DevicePlugin, ServingPath::Dra]
            .into_iter()
            .any(|p| enforcer.mechanism(p) == m)
    };
    let limits = enforcer.limits().cloned().filter(|_| on(Mechanism::Driver));
    let limiter = on(Mechanism::Limiter);
    if limits.is_none() && !limiter {
        return;
    }
    let dp_driver =
        limits.is_some() && enforcer.mechanism(ServingPath::DevicePlugin) == Mechanism::Driver;
    let dp_limiter = enforcer.mechanism(ServingPath::DevicePlugin) == Mechanism::Limiter;
    if dp_driver {
        let refreshed = {
            let enforcer = enforcer.clone();
            tokio::task::spawn_blocking(move || enforcer.refresh_limit_specs()).await
        };
        if let Ok(n) = refreshed
            && n > 0
        {
            tracing::info!(
                specs = n,
                "rewrote the device-plugin path's limit specs with the current hook"
            );
        }
    }
    let stop_watch = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _stop_watch = StopOnDrop(stop_watch.clone());
    #[cfg(target_os = "linux")]
    if let Some(limits) = &limits {
        let (enforcer, limits) = (enforcer.clone(), limits.clone());
        if let Err(e) = std::thread::Builder::new()
            .name("enforcement-stops".to_string())
            .spawn(move || watch_stops(enforcer, limits, stop_watch))
        {
            tracing::warn!(error = %e, "cannot start the cgroup watch: stopped containers are cleared by the readback only");
        }
    }
    let events = Events::new(client.clone(), DEVICE_PLUGIN_COMPONENT, &scope.node);
    let interval = Duration::from_secs(enforcer.config().enforcement_check_secs.max(1));
    let mut published: Option<String> = None;
    let stop_fut = stop.wait();
    tokio::pin!(stop_fut);
    loop {
        // The limiter's containers are read before the pods are listed: a container's files
        // are written after its pod exists, so a pod missing from this list is gone.
        let entries = if limiter {
            let run_dir = enforcer.limiter().run_dir().to_path_buf();
            tokio::task::spawn_blocking(move || super::limiter::containers::list(&run_dir))
                .await
                .ok()
        } else {
            None
        };
        let pods = if dp_driver || limiter {
            match crate::node::api::list_node_pods(&client, &scope.node).await {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::debug!(error = %e, "pods not listed; unrecorded containers not looked for and nothing cleaned up this cycle");
                    None
                }
            }
        } else {
            None
        };
        let mut rows = Vec::new();
        if let Some(limits) = &limits {
            let cycle = {
                let (enforcer, limits, scope) = (enforcer.clone(), limits.clone(), scope.clone());
                tokio::task::spawn_blocking(move || {
                    check_records(&enforcer, limits.as_ref(), &scope)
                })
                .await
            };
            if let Ok((driver_rows, ids)) = cycle {
                rows.extend(driver_rows);
                if let (true, Some(pods)) = (dp_driver, &pods) {
                    rows.extend(unrecorded(pods, &ids, &scope));
                }
            }
        }
        if let Some((entries, errors)) = entries {
            for e in errors {
                tracing::warn!(error = %e, "unreadable limiter owner file");
            }
            rows.extend(
                limiter_cycle(
                    &enforcer,
                    &client,
                    &scope,
                    entries,
                    pods.as_deref(),
                    dp_limiter,
                )
                .await,
            );
        }
        rows.sort();
        let turned = enforcer.status().publish(rows.clone());
        announce(&events, turned).await;
        publish_on_node(&client, &scope.node, &rows, &mut published).await;
        tokio::select! {
            _ = &mut stop_fut => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// Warns of each row whose state `turned` (a log line and an Event on its pod).
async fn announce(events: &Events, turned: Vec<ContainerMemory>) {
    for row in turned {
        let message = format!(
            "container {} on GPU {} ({}): GPU memory limit {}: {}",
            row.container,
            row.index,
            row.gpu,
            row.state.as_str(),
            row.detail
        );
        tracing::warn!(pod = format!("{}/{}", row.namespace, row.pod), "{message}");
        events
            .publish(
                &pod_reference(&row.namespace, &row.pod, None),
                Severity::Warning,
                "Enforce",
                reason(row.state),
                &message,
            )
            .await;
    }
}

/// Writes `rows` into node `node`'s annotation when they differ from what was `published`
/// last (which it updates once written).
async fn publish_on_node(
    client: &kube::Client,
    node: &str,
    rows: &[ContainerMemory],
    published: &mut Option<String>,
) {
    let value = super::report::to_annotation(&for_annotation(rows));
    if published.as_deref() == Some(value.as_str()) {
        return;
    }
    let ann = BTreeMap::from([(NODE_ANN_CONTAINER_GPU_MEMORY.to_string(), value.clone())]);
    match crate::node::api::bounded(crate::k8s::write::patch_node_annotations(
        client, node, &ann,
    ))
    .await
    {
        Ok(_) => *published = Some(value),
        Err(e) => tracing::debug!(error = %e, "container GPU memory not published on the node"),
    }
}

/// One cycle of the limiter's readback over `entries` (read before `pods` were listed): the
/// DRA shares' pods found, gone containers' files removed (only with a pod list), the rows.
async fn limiter_cycle(
    enforcer: &Arc<Enforcer>,
    client: &kube::Client,
    scope: &Scope,
    mut entries: Vec<(
        super::limiter::containers::Key,
        super::limiter::containers::Owner,
    )>,
    pods: Option<&[Pod]>,
    dp_limiter: bool,
) -> Vec<ContainerMemory> {
    use super::limiter::usage;
    let run_dir = enforcer.limiter().run_dir().to_path_buf();
    if let Some(pods) = pods {
        usage::resolve_dra(&run_dir, &mut entries, pods, |ns, name| {
            let api: kube::Api<k8s_openapi::api::resource::v1::ResourceClaim> =
                kube::Api::namespaced(client.clone(), &ns);
            async move {
                crate::node::api::bounded(api.get(&name))
                    .await
                    .ok()
                    .and_then(|c| c.metadata.uid)
            }
        })
        .await;
    }
    let pods_owned: Option<Vec<Pod>> = pods.map(<[Pod]>::to_vec);
    let gpus = scope.gpus.clone();
    let unit = scope.unit;
    tokio::task::spawn_blocking(move || {
        let mut rows = Vec::new();
        if let Some(pods) = &pods_owned {
            let removed = usage::sweep(&run_dir, &entries, pods);
            for key in &removed {
                tracing::info!(container = %key, "gone container: its limiter files removed");
            }
            entries.retain(|(k, _)| !removed.contains(k));
            if dp_limiter {
                rows.extend(usage::unserved(pods, &entries, &gpus, unit));
            }
        }
        rows.extend(usage::rows(&run_dir, &entries, &gpus));
        rows
    })
    .await
    .unwrap_or_default()
}

fn reason(state: LimitState) -> &'static str {
    match state {
        LimitState::Enforced => "GpuShareMemoryLimitEnforced",
        LimitState::Missing => "GpuShareMemoryLimitMissing",
        LimitState::Mismatch => "GpuShareMemoryLimitMismatch",
        LimitState::Unreadable => "GpuShareMemoryLimitUnreadable",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::limits::LimitReading;

    #[test]
    fn readings_are_judged_against_the_share() {
        let r = |soft, hard| {
            Ok(LimitReading {
                soft,
                hard,
                used: 7,
            })
        };
        assert_eq!(judge(4, r(4, 4)).0, LimitState::Enforced);
        assert_eq!(judge(4, r(0, NO_LIMIT)).0, LimitState::Missing);
        let (state, limit, _, detail) = judge(4, r(0, 8));
        assert_eq!((state, limit), (LimitState::Mismatch, Some(8)));
        assert!(detail.contains("instead of 4"), "{detail}");
        assert_eq!(
            judge(4, Err(LimitError::NotSupported("x".into()))).0,
            LimitState::Missing
        );
        assert_eq!(
            judge(4, Err(LimitError::Failed("x".into()))).0,
            LimitState::Unreadable
        );
        assert_eq!(container_id("containerd://abc"), "abc");
        assert_eq!(container_id("abc"), "abc");
    }

    #[test]
    fn a_row_turning_bad_is_counted_once() {
        let status = Status::default();
        let row = |state| ContainerMemory {
            namespace: "d".into(),
            pod: "p".into(),
            container: "c".into(),
            gpu: "GPU-1".into(),
            index: 0,
            expected: 4,
            limit: None,
            used: Some(1),
            state,
            detail: String::new(),
            mechanism: String::new(),
        };
        assert_eq!(status.publish(vec![row(LimitState::Missing)]).len(), 1);
        assert!(status.publish(vec![row(LimitState::Missing)]).is_empty());
        assert!(status.publish(vec![row(LimitState::Enforced)]).is_empty());
        assert_eq!(status.publish(vec![row(LimitState::Missing)]).len(), 1);
        assert_eq!(status.violations(LimitState::Missing), 2);
        assert_eq!(status.cycles(), 4);
    }
}
