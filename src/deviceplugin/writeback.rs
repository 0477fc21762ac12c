//! Writes what Allocate answered to the pods' annotations after the answer: the container in
//! `gpushare.io/allocated-containers`, and `ALIYUN_COM_GPU_MEM_ASSIGNED=true` with the
//! allocation time once the pod's last GPU container was answered.
//!
//! Allocate claims the container in the [`Records`](super::records::Records), makes the answer
//! durable on the node ([`super::journal`]) and hands it to [`Writeback::submit`]; kubelet has
//! its answer at once, whatever the API server does. Here one task per pod then PATCHes the
//! annotations the records and the pod's current annotations call for (so a correction of the
//! reconciler is never written over), guarded by the pod's UID (a JSON patch `test`: a pod
//! re-created under the name is not written), under the pod's lock (one writer per pod at a
//! time), each try bounded by the request timeout. An unknown outcome or a 5xx is tried again
//! (100 ms doubling to 5 s) for as long as it takes: with the API server down, containers
//! start and the annotations land once it answers again. A refusal (a 4xx other than the pod
//! being gone) is logged, announced as a Warning Event on the node, and tried again every
//! 30 s. A pod that is gone ends its write. Once the write lands, the journal record is
//! cleared and the records say the annotations have it.
//!
//! At start, [`Writeback::replay`] reads the journal back before the plugin registers: the
//! containers it names are claimed again (no other pod's container matches them) and their
//! writes are finished.
//!
//! It does not match containers or decide what a pod's annotations should be beyond the
//! answers (the reconciler corrects swaps), and with no usable journal directory it accepts
//! nothing: Allocate then writes before it answers, as a plugin without a node state must.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::Plugin;
use super::journal::{AnsweredContainer, PendingWrite};
use super::matching::Match;
use super::pending::{NotAccepted, Writeback};
use super::records::PodId;
use crate::node::api::bounded;

/// First pause after a failed try; doubles up to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// Longest pause between tries of a write whose outcome was unknown.
const MAX_RETRY: Duration = Duration::from_secs(5);
/// Pause between tries of a write the API server refused.
const REFUSED_RETRY: Duration = Duration::from_secs(30);

enum Landed {
    /// The API server has the annotations (or they said it already, or the records hold none
    /// of the answers any more).
    Written,
    /// The pod is gone (deleted, or re-created under its name).
    Gone,
    /// The plugin stops; the journal keeps the record for the next start.
    Stopped,
}

impl Writeback {
    /// Takes the answer `m` (container `m.container` given `device_ids`): durable in the
    /// journal when this returns `Ok`, written to the pod in the background.
    pub fn submit(
        &self,
        plugin: &Arc<Plugin>,
        m: &Match,
        device_ids: &[String],
    ) -> Result<(), NotAccepted> {
        let journal = self
            .journal
            .as_ref()
            .map_err(|e| NotAccepted::NoJournal(e.to_string()))?;
        let spawn = {
            let mut state = self.state();
            let generation = state.next_generation + 1;
            let mut write = state.pending.get(&m.uid).cloned().unwrap_or(PendingWrite {
                uid: m.uid.clone(),
                namespace: m.namespace.clone(),
                name: m.name.clone(),
                answered: Vec::new(),
                generation,
            });
            write.answered.retain(|a| a.container != m.container);
            write.answered.push(AnsweredContainer {
                container: m.container.clone(),
                device_ids: device_ids.to_vec(),
                gpu_index: m.gpu_index,
            });
            write.generation = generation;
            // Durable first: only then is the answer kubelet's.
            journal.record(&write)?;
            state.next_generation = generation;
            state.pending.insert(m.uid.clone(), write);
            self.publish_pending(&state);
            state.running.insert(m.uid.clone())
        };
        if spawn {
            tokio::spawn(run_pod(plugin.clone(), m.uid.clone()));
        }
        Ok(())
    }

    /// Reads the journal back (at start, before registration): each container it names is
    /// claimed in the records again, and its pod's write is finished in the background.
    /// Returns how many pods it names.
    pub fn replay(&self, plugin: &Arc<Plugin>) -> usize {
        let Ok(journal) = &self.journal else {
            return 0;
        };
        let (writes, bad) = journal.load();
        for (path, why) in bad {
            tracing::error!(file = %path.display(), error = why, "an unreadable device-plugin journal record is left in place");
        }
        let mut spawn = Vec::new();
        {
            let mut state = self.state();
            let mut records = plugin.records();
            for write in writes {
                let pod = PodId {
                    uid: write.uid.clone(),
                    namespace: write.namespace.clone(),
                    name: write.name.clone(),
                };
                for a in &write.answered {
                    records.claim(&pod, &a.container, &a.device_ids, a.gpu_index);
                }
                state.next_generation = state.next_generation.max(write.generation);
                if state.running.insert(write.uid.clone()) {
                    spawn.push(write.uid.clone());
                }
                state.pending.insert(write.uid.clone(), write);
            }
            self.publish_pending(&state);
        }
        let replayed = spawn.len();
        if replayed > 0 {
            tracing::info!(
                pods = replayed,
                "answers made before the restart and not yet on the pods: claimed again, their writes resumed"
            );
        }
        for uid in spawn {
            tokio::spawn(run_pod(plugin.clone(), uid));
        }
        replayed
    }
}

/// Writes pod `uid`'s answers until they land, the pod is gone, or the plugin stops.
async fn run_pod(plugin: Arc<Plugin>, uid: String) {
    loop {
        let Some(write) = plugin.writeback.state().pending.get(&uid).cloned() else {
            plugin.writeback.state().running.remove(&uid);
            return;
        };
        match land(&plugin, &write).await {
            Landed::Stopped => return,
            Landed::Gone => {
                tracing::debug!(
                    pod = format!("{}/{}", write.namespace, write.name),
                    "the pod is gone; its answers are not written"
                );
                if plugin.writeback.finish(&uid, write.generation) {
                    return;
                }
            }
            Landed::Written => {
                plugin
                    .records()
                    .mark_pod_recorded(&uid, write.answered.iter().map(|a| a.container.as_str()));
                if plugin.writeback.finish(&uid, write.generation) {
                    return;
                }
            }
        }
    }
}

/// The JSON patch of `annotations` onto pod `uid` only (its first operation tests the UID).
fn guarded_patch(
    uid: &str,
    annotations: &std::collections::BTreeMap<String, String>,
) -> serde_json::Value {
    let escape = |k: &str| k.replace('~', "~0").replace('/', "~1");
    let mut ops = vec![json!({ "op": "test", "path": "/metadata/uid", "value": uid })];
    ops.extend(annotations.iter().map(|(k, v)| {
        json!({ "op": "add", "path": format!("/metadata/annotations/{}", escape(k)), "value": v })
    }));
    serde_json::Value::Array(ops)
}

/// Tries `write` until it lands, its pod is gone, or the plugin stops.
async fn land(plugin: &Arc<Plugin>, write: &PendingWrite) -> Landed {
    let pod = format!("{}/{}", write.namespace, write.name);
    let mut pause = FIRST_RETRY;
    let mut refusals = 0u32;
    loop {
        if plugin.stopping.is_triggered() {
            return Landed::Stopped;
        }
        let tried = {
            let lock = plugin.pod_lock(&write.uid);
            let _pod_locked = lock.lock().await;
            // Only the answers the records still hold: one the reconciler found swapped or
            // kubelet gave away, or whose pod is gone, is not written back over its correction.
            let added: std::collections::BTreeSet<String> = {
                let records = plugin.records();
                write
                    .answered
                    .iter()
                    .filter(|a| {
                        records
                            .containers_of(&write.uid)
                            .any(|g| g.container == a.container)
                    })
                    .map(|a| a.container.clone())
                    .collect()
            };
            if added.is_empty() {
                return Landed::Written;
            }
            match super::reconcile::annotations_after(plugin, &write.uid, added) {
                // Not in the store: the watch may not have it yet, or it is gone.
                None if plugin.pods.get(&write.namespace, &write.name).is_none() => None,
                None => return Landed::Written,
                Some(annotations) => {
                    let pods: Api<k8s_openapi::api::core::v1::Pod> =
                        Api::namespaced(plugin.agent.client().clone(), &write.namespace);
                    match serde_json::from_value::<json_patch::Patch>(guarded_patch(
                        &write.uid,
                        &annotations,
                    )) {
                        Ok(patch) => Some(
                            bounded(pods.patch(
                                &write.name,
                                &PatchParams::default(),
                                &Patch::<()>::Json(patch),
                            ))
                            .await,
                        ),
                        // Cannot happen (the operations are built above); never a silent skip.
                        Err(e) => {
                            tracing::error!(pod, error = %e, "building the allocation write failed");
                            return Landed::Stopped;
                        }
                    }
                }
            }
        };
        match tried {
            Some(Ok(updated)) => {
                plugin.pods.apply(&updated);
                return Landed::Written;
            }
            Some(Err(e)) if e.outcome_unknown() => {
                tracing::debug!(pod, error = %e, "writing the pod's allocation failed; trying again");
            }
            Some(Err(e)) => {
                if pod_gone(plugin, write).await {
                    return Landed::Gone;
                }
                if refusals.is_multiple_of(20) {
                    let msg = format!(
                        "the API server refused the allocation annotations of pod {pod}: {e}; \
                         trying again every {} s",
                        REFUSED_RETRY.as_secs()
                    );
                    tracing::error!("{msg}");
                    plugin.agent.events().warn_soon(
                        "Allocate",
                        "GpuShareAllocationNotWritten",
                        msg,
                    );
                }
                refusals += 1;
                pause = REFUSED_RETRY;
            }
            None => {
                if pod_gone(plugin, write).await {
                    return Landed::Gone;
                }
            }
        }
        tokio::select! {
            _ = plugin.stopping.clone().wait() => return Landed::Stopped,
            _ = tokio::time::sleep(pause) => {}
        }
        if refusals == 0 {
            pause = (pause * 2).min(MAX_RETRY);
        }
    }
}

/// Whether the API shows pod `write` gone (not found, or another UID under its name). An
/// unanswered read says no.
async fn pod_gone(plugin: &Plugin, write: &PendingWrite) -> bool {
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(plugin.agent.client().clone(), &write.namespace);
    match bounded(pods.get_opt(&write.name)).await {
        Ok(None) => true,
        Ok(Some(p)) => p.metadata.uid.as_deref() != Some(write.uid.as_str()),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_tests_the_uid_first_and_escapes_keys() {
        let ann = std::collections::BTreeMap::from([
            (
                "gpushare.io/allocated-containers".to_string(),
                "a,b".to_string(),
            ),
            (
                "ALIYUN_COM_GPU_MEM_ASSIGNED".to_string(),
                "true".to_string(),
            ),
        ]);
        let patch = guarded_patch("u-1", &ann);
        assert_eq!(
            patch,
            json!([
                {"op": "test", "path": "/metadata/uid", "value": "u-1"},
                {"op": "add", "path": "/metadata/annotations/ALIYUN_COM_GPU_MEM_ASSIGNED", "value": "true"},
                {"op": "add", "path": "/metadata/annotations/gpushare.io~1allocated-containers", "value": "a,b"},
            ])
        );
    }
}
