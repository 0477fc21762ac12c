//! Feeds the ledger from the cluster: watches of Pods (all namespaces, decoded slim as
//! [`WatchedPod`]), Nodes, and the
//! `unhealthy-gpu-<node>` ConfigMaps in `kube-system`, projected into cache operations.
//!
//! The pod and node lists are read fresh from the API server's watch cache
//! ([`ListFrom::Fresh`]: at least as new as the moment they start, in one answer each, never
//! an older state of the cache), the ConfigMaps consistently. Each watch applies its first
//! full list, then events; on a re-list (after a 410 Gone or a
//! dropped stream, kube-runtime's `Init … InitDone`) objects not listed again are removed, so
//! nothing is lost or counted twice. The ledger is "synced" once all three watches have
//! completed their first list. The watches run on the one driver, `k8s::watch`, with its
//! fast backoff. Watch errors are logged, counted and retried with backoff;
//! they never stop the extender, but a watch that keeps failing for
//! `extender.watch_stale_after_ms` makes the ledger *stale*: `/readyz` and the scheduling
//! verbs answer 503 (with the reason) until it recovers, so nothing is placed from a ledger
//! known to be out of date.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::Api;
use kube::runtime::watcher::Event;
use tokio::sync::watch;
use tokio::time::Instant;

use super::cache::{Placement, PodFacts};
use super::state::ExtenderState;
use crate::core::wire::{
    POD_ANN_RESERVATION, UNHEALTHY_CONFIGMAP_KEY, UNHEALTHY_CONFIGMAP_NAMESPACE,
    UNHEALTHY_CONFIGMAP_PREFIX,
};
use crate::core::{AnnotationError, BindReservation, PodState, pod_holding};
use crate::k8s::watch::{FastBackoff, ListFrom, WatchConfig};
use crate::k8s::{WatchedPod, node_gpus, pod_annotations, pod_gpu_request, pod_is_terminal};
use crate::shutdown::Shutdown;

/// What a pod event means for the ledger. `on_bad` sees every annotation of ours whose
/// value could not be used (read as absent) on a pod that holds memory.
pub(crate) fn pod_facts(pod: &Pod, mut on_bad: impl FnMut(&AnnotationError)) -> Option<PodFacts> {
    let uid = pod.metadata.uid.clone()?;
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let (ann, errors) = pod_annotations(pod);
    let request = match pod_gpu_request(pod) {
        Ok(r) => Some(r),
        Err(e) => {
            if ann.gpu_index.is_some() {
                tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "unreadable gpu-mem limit");
            }
            None
        }
    };
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .filter(|n| !n.is_empty());
    let settled = node.is_some() || pod_is_terminal(pod);
    // An unbound pod a bind promised a GPU (its Binding may still land): counted as reserved.
    let mut reservation = None;
    if !settled && let Some(all) = pod.metadata.annotations.as_ref() {
        match BindReservation::decode(all) {
            Ok(Some(r)) => {
                let mem = pod_holding(request.as_ref(), &ann);
                if !mem.is_zero() {
                    reservation = Some((
                        Placement {
                            node: r.node,
                            gpu: r.gpu,
                            mem,
                            state: PodState::Assumed,
                        },
                        all.get(POD_ANN_RESERVATION).cloned().unwrap_or_default(),
                    ));
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "bad gpushare annotation, read as absent");
                on_bad(&e);
            }
        }
    }
    if let Some((placement, value)) = reservation {
        return Some(PodFacts {
            uid,
            namespace,
            name,
            placement: Some(placement),
            settled,
            reservation: Some(value),
        });
    }
    let placement = match (node, ann.gpu_index) {
        (Some(node), Some(gpu)) if !pod_is_terminal(pod) => {
            let mem = pod_holding(request.as_ref(), &ann);
            (!mem.is_zero()).then_some(Placement {
                node,
                gpu,
                mem,
                state: if ann.assigned == Some(true) {
                    PodState::Assigned
                } else {
                    PodState::Assumed
                },
            })
        }
        _ => None,
    };
    if settled {
        for e in &errors {
            tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "bad gpushare annotation, read as absent");
            on_bad(e);
        }
    }
    Some(PodFacts {
        uid,
        namespace,
        name,
        placement,
        settled,
        reservation: None,
    })
}

/// The GPU indices listed in an `unhealthy-gpu-<node>` ConfigMap value, parsed strictly:
/// bad entries are ignored with a warning (upstream read them as GPU 0).
pub(crate) fn parse_unhealthy(node: &str, value: &str) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.parse::<u32>() {
            Ok(i) => {
                out.insert(i);
            }
            Err(_) => tracing::warn!(
                node,
                entry,
                "ignoring a bad entry in the unhealthy-gpu ConfigMap (expected GPU indices like \"0,2\")"
            ),
        }
    }
    out
}

/// Which watches have completed their first list.
#[derive(Debug, Default)]
struct SyncFlags {
    pods: bool,
    nodes: bool,
    configmaps: bool,
}

/// Spawns the three watches; they stop when `shutdown` fires.
pub fn spawn(state: Arc<ExtenderState>, shutdown: Shutdown) -> Vec<tokio::task::JoinHandle<()>> {
    let (tx, rx) = watch::channel(SyncFlags::default());
    let tx = Arc::new(tx);
    let mut tasks = Vec::new();
    {
        let state = state.clone();
        let mut rx = rx;
        tasks.push(tokio::spawn(async move {
            // An error means the watches were stopped before they synced: not synced.
            if rx
                .wait_for(|f| f.pods && f.nodes && f.configmaps)
                .await
                .is_ok()
            {
                tracing::info!("ledger synced with the cluster");
                state.set_synced(true);
            }
        }));
    }
    tasks.push(tokio::spawn(watch_pods(
        state.clone(),
        tx.clone(),
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(watch_nodes(
        state.clone(),
        tx.clone(),
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(monitor_staleness(
        state.clone(),
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(super::reservations::settle_found(
        state.clone(),
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(watch_configmaps(state, tx, shutdown)));
    tasks
}

/// Marks the ledger stale while a watch keeps failing past `extender.watch_stale_after_ms`
/// (logged once per change, counted in `gpushare_extender_ledger_stale`).
async fn monitor_staleness(state: Arc<ExtenderState>, shutdown: Shutdown) {
    let after = Duration::from_millis(state.config().watch_stale_after_ms);
    let period = (after / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut tick = tokio::time::interval(period);
    let stop = shutdown.wait();
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        let now = state.watch_health().stale(Instant::now(), after);
        let was = state.stale_reason();
        if now.is_some() != was.is_some() {
            match &now {
                Some(why) => tracing::error!("ledger stale, refusing filter and bind: {why}"),
                None => tracing::info!("watches recovered; the ledger is fresh again"),
            }
            state.metrics().stale.set(i64::from(now.is_some()));
            state.set_stale(now);
        }
    }
}

/// Drives one watch with the extender's hooks: [`FastBackoff`], errors logged and counted in
/// `gpushare_extender_watch_errors_total{watch}`, failing streaks fed to the staleness
/// monitor through [`crate::k8s::watch::WatchHealth`]. Its lists read as `list_from` says.
async fn drive<K>(
    state: &ExtenderState,
    api: Api<K>,
    what: &'static str,
    list_from: ListFrom,
    shutdown: Shutdown,
    mut on_event: impl FnMut(Event<K>),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    crate::k8s::watch::drive(
        api,
        WatchConfig::new(list_from),
        FastBackoff::default(),
        shutdown,
        |e| {
            tracing::warn!(error = %e, "{what} watch failed; retrying");
            state
                .metrics()
                .watch_errors
                .get_or_create(&super::metrics::WatchLabels { watch: what })
                .inc();
            state.watch_health().failed(what, e.to_string());
        },
        |ev| {
            state.watch_health().succeeded(what);
            on_event(ev);
        },
    )
    .await;
}

async fn watch_pods(
    state: Arc<ExtenderState>,
    tx: Arc<watch::Sender<SyncFlags>>,
    shutdown: Shutdown,
) {
    // Slim: only the fields the ledger reads are decoded from the (large) pod list.
    let api: Api<WatchedPod> = Api::all(state.client().clone());
    let mut seen: HashSet<String> = HashSet::new();
    let mut mark = 0;
    // Past this spawn's first list (the watches are spawned again when this replica wins the
    // lease): a reservation first seen now was written after this term began.
    let mut listed = false;
    let metrics = state.metrics().clone();
    // Fresh: the ledger counts every pod bound before this process started or won the lease
    // (a list of the watch cache at the collection's current version, one answer).
    drive(&state, api, "pod", ListFrom::Fresh, shutdown, |ev| {
        let cache = state.cache();
        let bad = |e: &AnnotationError| {
            metrics
                .bad_annotations
                .get_or_create(&super::metrics::KeyLabels { key: e.key })
                .inc();
        };
        match ev {
            Event::Init => {
                seen.clear();
                mark = cache.relist_mark();
            }
            Event::InitApply(WatchedPod(pod)) => {
                if let Some(f) = pod_facts(&pod, bad) {
                    seen.insert(f.uid.clone());
                    observe(&state, f, listed);
                }
            }
            Event::InitDone => {
                let dropped = cache.retain_pods(&seen, mark);
                if dropped > 0 {
                    tracing::info!(dropped, "pods gone while the watch was down");
                }
                seen = HashSet::new();
                listed = true;
                tx.send_modify(|f| f.pods = true);
            }
            Event::Apply(WatchedPod(pod)) => {
                if let Some(f) = pod_facts(&pod, bad) {
                    observe(&state, f, listed);
                }
            }
            Event::Delete(WatchedPod(pod)) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    cache.forget_pod(uid);
                }
            }
        }
    })
    .await;
}

/// Applies one pod's facts; `listed`: seen after this spawn's first list. While serving, a
/// reservation first seen after that list is backed by nothing (see `reservations`): it is
/// settled at once, logged and counted as released.
fn observe(state: &ExtenderState, facts: PodFacts, listed: bool) {
    // Only an unbound pod carrying a reservation can be unbacked: every other event (nearly
    // all of them) takes the plain path, with nothing formatted.
    if !(listed && facts.reservation.is_some() && state.is_serving()) {
        state.cache().observe_pod(facts);
        return;
    }
    let pod = format!("{}/{}", facts.namespace, facts.name);
    if state.cache().observe_pod_after_list(facts).unbacked {
        state.metrics().count_settled("released");
        tracing::info!(
            pod = %pod,
            "a reservation written on the pod after this term began (a late annotation patch of \
             a bind whose process ended) is backed by no Binding: not counted"
        );
    }
}

async fn watch_nodes(
    state: Arc<ExtenderState>,
    tx: Arc<watch::Sender<SyncFlags>>,
    shutdown: Shutdown,
) {
    let api: Api<Node> = Api::all(state.client().clone());
    let mut seen: HashSet<String> = HashSet::new();
    drive(&state, api, "node", ListFrom::Fresh, shutdown, |ev| {
        let cache = state.cache();
        match ev {
            Event::Init => seen.clear(),
            Event::InitApply(node) | Event::Apply(node) => {
                if let Some(name) = node.metadata.name.as_deref() {
                    seen.insert(name.to_string());
                    cache.apply_node(name, node_gpus(&node, false));
                }
            }
            Event::InitDone => {
                cache.retain_nodes(&seen);
                seen = HashSet::new();
                tx.send_modify(|f| f.nodes = true);
            }
            Event::Delete(node) => {
                if let Some(name) = node.metadata.name.as_deref() {
                    cache.remove_node(name);
                }
            }
        }
    })
    .await;
}

fn configmap_node(cm: &ConfigMap) -> Option<&str> {
    cm.metadata
        .name
        .as_deref()?
        .strip_prefix(UNHEALTHY_CONFIGMAP_PREFIX)
        .filter(|n| !n.is_empty())
}

async fn watch_configmaps(
    state: Arc<ExtenderState>,
    tx: Arc<watch::Sender<SyncFlags>>,
    shutdown: Shutdown,
) {
    let api: Api<ConfigMap> =
        Api::namespaced(state.client().clone(), UNHEALTHY_CONFIGMAP_NAMESPACE);
    let mut seen: HashSet<String> = HashSet::new();
    // A few objects in one namespace: one consistent page.
    drive(
        &state,
        api,
        "ConfigMap",
        ListFrom::Consistent,
        shutdown,
        |ev| {
            let cache = state.cache();
            match ev {
                Event::Init => seen.clear(),
                Event::InitApply(cm) | Event::Apply(cm) => {
                    if let Some(node) = configmap_node(&cm) {
                        let value = cm
                            .data
                            .as_ref()
                            .and_then(|d| d.get(UNHEALTHY_CONFIGMAP_KEY))
                            .map(String::as_str)
                            .unwrap_or("");
                        seen.insert(node.to_string());
                        cache.set_unhealthy(node, parse_unhealthy(node, value));
                    }
                }
                Event::InitDone => {
                    cache.retain_unhealthy(&seen);
                    seen = HashSet::new();
                    tx.send_modify(|f| f.configmaps = true);
                }
                Event::Delete(cm) => {
                    if let Some(node) = configmap_node(&cm) {
                        cache.set_unhealthy(node, BTreeSet::new());
                    }
                }
            }
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhealthy_lists_are_strict() {
        assert_eq!(parse_unhealthy("n", "0,2"), BTreeSet::from([0, 2]));
        assert_eq!(
            parse_unhealthy("n", " 1 , x, -1,,3"),
            BTreeSet::from([1, 3])
        );
        assert!(parse_unhealthy("n", "").is_empty(), "never GPU 0");
        assert!(parse_unhealthy("n", "x").is_empty(), "never GPU 0");
    }

    fn pod_facts_of(pod: &Pod) -> Option<PodFacts> {
        pod_facts(pod, |_| {})
    }

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn pods_count_when_bound_with_an_index_and_not_finished() {
        let base = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "3",
                                "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c",
                "resources": {"limits": {"aliyun.com/gpu-mem": "5"}}}]},
            "status": {"phase": "Running"}
        });
        let f = pod_facts_of(&pod(base.clone())).unwrap();
        let p = f.placement.unwrap();
        assert_eq!(
            (p.node.as_str(), p.gpu, p.mem.units(), p.state),
            ("n1", 1, 5, PodState::Assigned),
            "the larger of the recorded 3 and the requested 5"
        );
        let mut b = base.clone();
        b["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_POD"] = "7".into();
        assert_eq!(
            pod_facts_of(&pod(b))
                .unwrap()
                .placement
                .unwrap()
                .mem
                .units(),
            7
        );
        // An absurd recorded value is counted as bad and read as absent.
        let mut b = base.clone();
        b["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_POD"] = "18446744073709551615".into();
        let mut bad = Vec::new();
        let p = pod_facts(&pod(b), |e| bad.push(e.key))
            .unwrap()
            .placement
            .unwrap();
        assert_eq!((p.mem.units(), bad), (5, vec!["ALIYUN_COM_GPU_MEM_POD"]));
        // Falls back to the spec's request without the POD annotation.
        let mut b = base.clone();
        b["metadata"]["annotations"] = serde_json::json!({"ALIYUN_COM_GPU_MEM_IDX": "0"});
        let p = pod_facts_of(&pod(b)).unwrap().placement.unwrap();
        assert_eq!((p.mem.units(), p.state), (5, PodState::Assumed));
        // Finished pods hold nothing; terminating ones keep their memory.
        let mut b = base.clone();
        b["status"]["phase"] = "Succeeded".into();
        assert!(pod_facts_of(&pod(b)).unwrap().placement.is_none());
        let mut b = base.clone();
        b["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z".into();
        assert!(pod_facts_of(&pod(b)).unwrap().placement.is_some());
        // Unbound, or bad index: nothing.
        let mut b = base.clone();
        b["spec"]["nodeName"] = serde_json::Value::Null;
        assert!(pod_facts_of(&pod(b)).unwrap().placement.is_none());
        let mut b = base;
        b["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] = "-1".into();
        assert!(pod_facts_of(&pod(b)).unwrap().placement.is_none());
    }
}
