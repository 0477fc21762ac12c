//! Durable reservations: the `gpushare.io/reservation` annotation a bind writes on the pod
//! (node, GPU, since when) before it sends the Binding, and how the ledger settles one that
//! no live owner of this process holds.
//!
//! A Binding of unknown outcome may land long after the process that sent it stopped,
//! crashed or lost the lease. Its reservation therefore lives in the API, not only in that
//! process's memory: every replica's watch counts an unbound pod that carries the annotation
//! against the promised GPU ([`super::cache`]'s *found* reservations). One ends when the watch
//! shows the pod bound (then the Binding counts) or deleted, or when — read from the API here
//! — the pod has stayed unbound with the same reservation for `extender.bind_settle_ms` on
//! this process's clock (restarted when it wins the lease), past which the API server has
//! given up on any Binding still in flight. A serving replica then removes the annotation
//! (guarded by the pod's resourceVersion and the exact value, so a newer bind's reservation
//! is never touched).
//!
//! A found reservation is backed by a Binding only if the annotation patch carrying it was
//! answered before its writer's term (or life) ended: the writer sends the Binding after that
//! answer, fenced by its term. While the writer lives, a patch in doubt keeps its reservation
//! (`bind`); one whose answer never came before the writer's end may still land later — after
//! a successor began serving and gave the GPU to other pods. Two rules follow:
//! - a reservation first seen after the first (fresh) list of pods of this serving term was
//!   written after the term began: nothing backs it, it is never counted
//!   (`Cache::observe_pod_after_list`, fed by `sync`);
//! - one that was on the pod at that list but does not fit its GPU beside what is counted there
//!   (a patch the API server kept past `bind_settle_ms`, landing after its own process had
//!   settled it as released) was never backed either: a bind of the pod drops it and reserves afresh instead of taking it
//!   over (`Cache::drop_found_over_capacity`).
//!
//! This module does not bind or finish binds (kube-scheduler retries the pod: its filter
//! passes the reserved node and its bind there takes the reservation over, `bind`) and does
//! not settle reservations that an owner task of this process holds (`bind` does).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

use super::state::ExtenderState;
use crate::core::wire::POD_ANN_RESERVATION;
use crate::k8s::write::patch_pod_annotation_changes;
use crate::shutdown::Shutdown;

/// Settles found reservations once they are due, until `shutdown`.
pub(crate) async fn settle_found(state: Arc<ExtenderState>, shutdown: Shutdown) {
    let window = Duration::from_millis(state.config().bind_settle_ms);
    let period = (window / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut tick = tokio::time::interval(period);
    let stop = shutdown.wait();
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        for (uid, namespace, name, value) in state.cache().found_due(window) {
            settle_one(&state, &uid, &namespace, &name, &value).await;
        }
    }
}

/// Reads the pod of one due reservation and settles it by what the API shows.
async fn settle_one(state: &ExtenderState, uid: &str, namespace: &str, name: &str, value: &str) {
    let pods: Api<Pod> = Api::namespaced(state.client().clone(), namespace);
    let budget = Duration::from_millis(state.config().bind_timeout_ms.max(1));
    let Ok(Ok(pod)) = tokio::time::timeout(budget, pods.get_opt(name)).await else {
        return; // Not read: try again on the next tick.
    };
    let pod = pod.filter(|p| p.metadata.uid.as_deref() == Some(uid));
    let Some(pod) = pod else {
        // Deleted or replaced: the watch's delete follows.
        state.cache().expire_found(uid, value);
        return;
    };
    let bound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    let carries = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_ANN_RESERVATION))
        .is_some_and(|v| v == value);
    if !bound && carries && !crate::k8s::pod_is_terminal(&pod) {
        if state.cache().expire_found(uid, value) {
            state.metrics().count_settled("released");
            tracing::info!(
                pod = %format!("{namespace}/{name}"),
                "reservation found on the pod released: it stayed unbound for extender.bind_settle_ms"
            );
            if state.is_serving() {
                clear_from(state, &pod, value).await;
            }
        }
        return;
    }
    if crate::k8s::pod_is_terminal(&pod) {
        state.cache().expire_found(uid, value);
    }
    // Bound or re-reserved since: the watch shows it (a read applied here could be older than
    // a deletion the watch has already applied, and would count a pod that is gone).
}

/// Removes the reservation `value` from the pod `namespace/name` (UID `uid`) if the API still
/// shows it there on the unbound pod. Best effort: a failure only means successors count the
/// reservation for one more settle window.
pub(crate) async fn clear(
    state: &ExtenderState,
    namespace: &str,
    name: &str,
    uid: &str,
    value: &str,
) {
    let pods: Api<Pod> = Api::namespaced(state.client().clone(), namespace);
    let budget = Duration::from_millis(state.config().bind_timeout_ms.max(1));
    let Ok(Ok(Some(pod))) = tokio::time::timeout(budget, pods.get_opt(name)).await else {
        return;
    };
    if pod.metadata.uid.as_deref() == Some(uid) {
        clear_from(state, &pod, value).await;
    }
}

async fn clear_from(state: &ExtenderState, pod: &Pod, value: &str) {
    let unbound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_none_or(str::is_empty);
    let carries = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_ANN_RESERVATION))
        .is_some_and(|v| v == value);
    if !unbound || !carries {
        return;
    }
    let (Some(namespace), Some(name)) = (
        pod.metadata.namespace.as_deref(),
        pod.metadata.name.as_deref(),
    ) else {
        return;
    };
    let changes = BTreeMap::from([(POD_ANN_RESERVATION.to_string(), None)]);
    let budget = Duration::from_millis(state.config().bind_timeout_ms.max(1));
    let patched = tokio::time::timeout(
        budget,
        patch_pod_annotation_changes(
            state.client(),
            namespace,
            name,
            &changes,
            pod.metadata.resource_version.as_deref(),
        ),
    )
    .await;
    if !matches!(patched, Ok(Ok(_))) {
        tracing::debug!(
            pod = %format!("{namespace}/{name}"),
            "could not remove a settled reservation annotation; successors count it for one more settle window"
        );
    }
}
