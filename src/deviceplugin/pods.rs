//! The pods of this node, kept current by one watch (field selector `spec.nodeName=<node>`),
//! so that Allocate never LISTs pods (upstream listed every pod per call, DP#39).
//!
//! The device plugin's own patches are applied to the store at once (with the object the API
//! returned), so the next Allocate sees them even before the watch delivers the update; an
//! older object arriving later from the watch does not overwrite a newer one.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::watcher::Event;
use tokio::sync::watch;

use super::matching::PodSnapshot;
use crate::k8s::watch::{FastBackoff, ListFrom, WatchConfig};
use crate::node::api::{ApiCallError, list_node_pods};
use crate::shutdown::Shutdown;

/// Pods of one node by `namespace/name`.
#[derive(Clone, Debug)]
pub(crate) struct PodStore {
    pods: Arc<RwLock<BTreeMap<String, PodSnapshot>>>,
    synced_tx: Arc<watch::Sender<bool>>,
}

impl Default for PodStore {
    fn default() -> Self {
        PodStore {
            pods: Arc::default(),
            synced_tx: Arc::new(watch::channel(false).0),
        }
    }
}

fn newer_or_equal(new: Option<&str>, old: Option<&str>) -> bool {
    match (
        new.and_then(|v| v.parse::<u64>().ok()),
        old.and_then(|v| v.parse::<u64>().ok()),
    ) {
        (Some(n), Some(o)) => n >= o,
        _ => true,
    }
}

impl PodStore {
    /// Inserts or updates `pod` unless the store holds a newer version.
    pub fn apply(&self, pod: &Pod) {
        let snap = PodSnapshot::from_pod(pod);
        let mut pods = self.pods.write().unwrap_or_else(|p| p.into_inner());
        let key = snap.key();
        let keep_old = pods.get(&key).is_some_and(|old| {
            old.uid == snap.uid
                && !newer_or_equal(
                    snap.resource_version.as_deref(),
                    old.resource_version.as_deref(),
                )
        });
        if !keep_old {
            pods.insert(key, snap);
        }
    }

    /// Removes `pod`.
    pub fn delete(&self, pod: &Pod) {
        let snap = PodSnapshot::from_pod(pod);
        let mut pods = self.pods.write().unwrap_or_else(|p| p.into_inner());
        if pods.get(&snap.key()).is_some_and(|old| old.uid == snap.uid) {
            pods.remove(&snap.key());
        }
    }

    /// Replaces everything (after a watch re-list).
    pub fn replace(&self, list: &[Pod]) {
        let fresh: BTreeMap<String, PodSnapshot> = list
            .iter()
            .map(PodSnapshot::from_pod)
            .map(|s| (s.key(), s))
            .collect();
        *self.pods.write().unwrap_or_else(|p| p.into_inner()) = fresh;
    }

    /// Runs `f` over the pods without copying them (a read lock is held meanwhile: `f` must
    /// not block).
    pub(crate) fn with_pods<T>(
        &self,
        f: impl FnOnce(std::collections::btree_map::Values<'_, String, PodSnapshot>) -> T,
    ) -> T {
        let pods = self.pods.read().unwrap_or_else(|p| p.into_inner());
        f(pods.values())
    }

    /// A copy of every pod.
    pub fn snapshot(&self) -> Vec<PodSnapshot> {
        self.pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// One pod.
    pub fn get(&self, namespace: &str, name: &str) -> Option<PodSnapshot> {
        self.pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&format!("{namespace}/{name}"))
            .cloned()
    }

    /// Number of pods.
    pub fn len(&self) -> usize {
        self.pods.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether the store is empty.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the first list has completed.
    pub(crate) fn is_synced(&self) -> bool {
        *self.synced_tx.borrow()
    }

    /// Waits until the first list has completed.
    pub async fn synced(&self) {
        let mut rx = self.synced_tx.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Catches up with the API by one LIST of `node`'s pods (when a match missed: the watch
    /// may lag behind a pod bound a moment ago), bounded by the request timeout.
    pub async fn refresh(&self, client: &kube::Client, node: &str) -> Result<(), ApiCallError> {
        for pod in list_node_pods(client, node).await? {
            self.apply(&pod);
        }
        Ok(())
    }

    /// Runs the watch of `node`'s pods into this store until `shutdown`, on the one watch
    /// driver with its fast backoff (it may start before the API server answers: the first
    /// list then follows within 2 s of its return, not kube-runtime's 30 s), its lists read
    /// from the API server's watch cache. A re-list replaces the store; the first one marks
    /// it synced (the plugin registers with kubelet only after that).
    pub async fn run(self, client: kube::Client, node: String, shutdown: Shutdown) {
        let api: Api<Pod> = Api::all(client);
        // From the watch cache, as kubelet reads its pods: a match that misses reads the API
        // itself (`refresh`), so a cache a little behind costs no wrong answer.
        let config = WatchConfig::new(ListFrom::Cache).fields(&format!("spec.nodeName={node}"));
        let mut buffer: Vec<Pod> = Vec::new();
        crate::k8s::watch::drive(
            api,
            config,
            FastBackoff::default(),
            shutdown,
            |e| tracing::warn!(error = %e, node, "pod watch error (retrying)"),
            |event| match event {
                Event::Init => buffer.clear(),
                Event::InitApply(pod) => buffer.push(pod),
                Event::InitDone => {
                    self.replace(&buffer);
                    buffer.clear();
                    self.synced_tx.send_replace(true);
                    tracing::debug!(pods = self.len(), node, "pod store synced");
                }
                Event::Apply(pod) => self.apply(&pod),
                Event::Delete(pod) => self.delete(&pod),
            },
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str, rv: &str, idx: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some("ns".to_string()),
                uid: Some(format!("uid-{name}")),
                resource_version: Some(rv.to_string()),
                annotations: Some(
                    [(
                        crate::core::wire::ANN_GPU_INDEX.to_string(),
                        idx.to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn older_versions_do_not_overwrite_newer_ones() {
        let store = PodStore::default();
        store.apply(&pod("a", "10", "1"));
        store.apply(&pod("a", "9", "0"));
        assert_eq!(store.get("ns", "a").unwrap().annotations.gpu_index, Some(1));
        store.apply(&pod("a", "11", "0"));
        assert_eq!(store.get("ns", "a").unwrap().annotations.gpu_index, Some(0));
        store.delete(&pod("a", "12", "0"));
        assert!(store.is_empty());
    }
}
