//! Prepare and unprepare of claims, the plugin's core ([`Core`]): each claim under its own
//! lock, read from the API with a deadline, checked against the served devices and the
//! checkpoint ([`crate::dra::claims`]), handed to the [`Preparer`], recorded and saved before
//! the answer; unprepare from the checkpoint alone; the reconcile after a start; the devices'
//! health. It speaks no gRPC ([`super::services`]) and binds no socket ([`super::sockets`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{Api, Client};
use tokio::sync::{Mutex, watch};

use super::interface::{
    CLAIM_READ_TIMEOUT, ClaimFailure, PluginConfig, PluginHooks, PrepareError, Prepared, Preparer,
    Reconciled, Served,
};
use crate::dra::checkpoint::{
    Checkpoint, CheckpointError, PreparedClaim, PreparedDevice, PreparedShare,
};
use crate::dra::claims::{ClaimDevices, admit, read_claim};
use crate::kubelet_api::pluginregistration::RegistrationStatus;
use crate::node::api::bounded_for;

/// Whether `claim` is allocated with a result of `driver` in pool `pool` (this node).
fn allocated_here(claim: &ResourceClaim, driver: &str, pool: &str) -> bool {
    crate::k8s::project::claim_results(claim)
        .is_some_and(|rs| rs.iter().any(|r| r.driver == driver && r.pool == pool))
}

pub(super) struct Core {
    pub(super) config: PluginConfig,
    pub(super) client: Client,
    pub(super) served: watch::Receiver<Served>,
    pub(super) preparer: Arc<dyn Preparer>,
    /// The prepared claims. Held for the checks against them, the preparer's local writes and
    /// the save; never across an API call.
    pub(super) checkpoint: Mutex<Checkpoint>,
    /// One lock per claim uid, held for that claim's whole prepare or unprepare (its API read
    /// included): a claim is never prepared and unprepared at once, and no other claim waits
    /// on it.
    pub(super) claim_locks: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    pub(super) registration: watch::Sender<Option<RegistrationStatus>>,
    pub(super) hooks: PluginHooks,
}

/// One claim as kubelet names it.
pub(super) struct ClaimRef {
    pub(super) namespace: String,
    pub(super) uid: String,
    pub(super) name: String,
}

/// Why unprepare of one claim failed (its error in the answer to kubelet, which retries).
#[derive(Debug, thiserror::Error)]
enum UnprepareFailure {
    /// The preparer could not undo.
    #[error("unpreparing claim {claim}: {source}")]
    Undo {
        /// `namespace/name`, or the uid when unknown.
        claim: String,
        /// Why.
        source: PrepareError,
    },
    /// Undone, but the checkpoint could not record it: kept as prepared until a retry records it.
    #[error("unpreparing claim {claim}: undone, but not recorded (kubelet retries): {source}")]
    NotRecorded {
        /// `namespace/name`.
        claim: String,
        /// Why.
        #[source]
        source: CheckpointError,
    },
}

impl Core {
    /// The lock of claim `uid`'s prepare and unprepare.
    fn claim_lock(&self, uid: &str) -> Arc<Mutex<()>> {
        let mut locks = self.claim_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(uid.to_string()).or_default().clone()
    }

    /// Forgets the locks nobody holds.
    fn prune_claim_locks(&self) {
        let mut locks = self.claim_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.retain(|_, lock| Arc::strong_count(lock) > 1);
    }

    fn count_prepare(&self, outcome: &str) {
        if let Some(m) = &self.hooks.metrics {
            m.prepare(outcome);
        }
    }

    fn count_unprepare(&self, outcome: &str) {
        if let Some(m) = &self.hooks.metrics {
            m.unprepare(outcome);
        }
    }

    fn prepared_now(&self, cp: &Checkpoint) {
        if let Some(m) = &self.hooks.metrics {
            m.prepared_claims
                .set(i64::try_from(cp.claims.len()).unwrap_or(i64::MAX));
        }
    }

    /// Prepares each claim, each on its own (one claim's slow read holds up no other); the
    /// answer per claim uid: the shares with their CDI ids, or why not.
    pub(super) async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<PreparedClaim, ClaimFailure>> {
        let started = std::time::Instant::now();
        if let Some(Err(refused)) = self.hooks.node.as_ref().map(|n| n.check_mps()) {
            tracing::error!("NodePrepareResources refused: {refused}");
            return claims
                .into_iter()
                .map(|c| {
                    self.count_prepare("mps_not_serving");
                    (c.uid, Err(ClaimFailure::Mps(refused.clone())))
                })
                .collect();
        }
        let answers = futures::future::join_all(claims.into_iter().map(|c| async move {
            let answer = self.prepare_claim(&c).await;
            (c.uid, answer)
        }))
        .await;
        self.prune_claim_locks();
        if let Some(m) = &self.hooks.metrics {
            m.prepare_seconds.observe(started.elapsed().as_secs_f64());
        }
        answers.into_iter().collect()
    }

    /// Prepares one claim under its own lock: answered from the checkpoint when recorded;
    /// else read from the API (no other lock held), then checked, prepared, recorded and
    /// saved under the checkpoint's lock.
    async fn prepare_claim(&self, c: &ClaimRef) -> Result<PreparedClaim, ClaimFailure> {
        let lock = self.claim_lock(&c.uid);
        let _claim = lock.lock().await;
        {
            let mut cp = self.checkpoint.lock().await;
            if let Some(p) = cp.claims.get(&c.uid).cloned() {
                let answer = self.answer_recorded(&mut cp, &c.uid, p);
                self.count_prepare(if answer.is_ok() {
                    "repeated"
                } else {
                    "refused"
                });
                return answer;
            }
        }
        let id = format!("{}/{}", c.namespace, c.name);
        let api = Api::<ResourceClaim>::namespaced(self.client.clone(), &c.namespace);
        let claim = match bounded_for(CLAIM_READ_TIMEOUT, api.get(&c.name)).await {
            Ok(claim) => claim,
            Err(source) => {
                self.count_prepare("read_failed");
                return Err(ClaimFailure::Read { claim: id, source });
            }
        };
        let mut cp = self.checkpoint.lock().await;
        let answer = self.prepare_read(&id, c, &claim, &mut cp);
        self.count_prepare(match &answer {
            Ok(_) => "prepared",
            Err(ClaimFailure::Checkpoint(_)) => "not_recorded",
            Err(_) => "refused",
        });
        self.prepared_now(&cp);
        answer
    }

    /// Checks claim `c` as read (`claim`) against the served devices and what `cp` holds,
    /// prepares it, records it and saves the checkpoint; not saved means not prepared (undone).
    fn prepare_read(
        &self,
        id: &str,
        c: &ClaimRef,
        claim: &ResourceClaim,
        cp: &mut Checkpoint,
    ) -> Result<PreparedClaim, ClaimFailure> {
        let found = claim.metadata.uid.clone().unwrap_or_default();
        if found != c.uid {
            return Err(ClaimFailure::Uid {
                claim: id.to_string(),
                wanted: c.uid.clone(),
                found,
            });
        }
        let served = self.served.borrow().clone();
        let held = read_claim(
            claim,
            &self.config.driver,
            &self.config.node,
            &served.devices,
            &served.others,
            self.config.unit,
        )?;
        if let Some(why) = held
            .gpus
            .iter()
            .find_map(|s| served.held_back.get(&s.device))
        {
            return Err(ClaimFailure::HeldBack {
                claim: id.to_string(),
                why: why.clone(),
            });
        }
        let others_hold = cp.held(Some(&c.uid)).map_err(|e| e.for_claim(id))?;
        admit(id, &held, &others_hold, &served.devices, &served.others)?;
        let prepared =
            self.preparer
                .prepare(&c.uid, &held)
                .map_err(|source| ClaimFailure::Prepare {
                    claim: id.to_string(),
                    source,
                })?;
        let record = match record(id, &c.namespace, &c.name, held, prepared) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.preparer.unprepare(&c.uid, None);
                return Err(e);
            }
        };
        cp.claims.insert(c.uid.clone(), record.clone());
        if let Err(e) = cp.save(&self.config.checkpoint) {
            // Not recorded means not prepared: undo, and tell kubelet (it retries).
            cp.claims.remove(&c.uid);
            let _ = self.preparer.unprepare(&c.uid, Some(&record));
            return Err(ClaimFailure::Checkpoint(Arc::new(e)));
        }
        Ok(record)
    }

    /// The answer for a recorded claim: the record, after writing what the preparer no longer
    /// finds where it writes now (a CDI spec gone, or left in another CDI directory) again
    /// from the recorded shares.
    fn answer_recorded(
        &self,
        cp: &mut Checkpoint,
        uid: &str,
        p: PreparedClaim,
    ) -> Result<PreparedClaim, ClaimFailure> {
        let Some(again) = self.restore(uid, &p)? else {
            return Ok(p);
        };
        cp.claims.insert(uid.to_string(), again.clone());
        if let Err(e) = cp.save(&self.config.checkpoint) {
            // The claim stays recorded either way; only its spec's path is stale on disk, and
            // a stale path is written again the same way after a restart.
            tracing::warn!(error = %e, "the DRA checkpoint could not be saved after a CDI spec was written again");
        }
        Ok(again)
    }

    /// A recorded claim whose CDI spec is not where the preparer writes now (the CDI directory
    /// was cleared while the state directory was not, or `--cdi-dir` changed): the spec written
    /// again from the recorded shares, the old one removed. `None` when it is current.
    fn restore(&self, uid: &str, p: &PreparedClaim) -> Result<Option<PreparedClaim>, ClaimFailure> {
        if self.preparer.is_current(uid, p) {
            return Ok(None);
        }
        let id = format!("{}/{}", p.namespace, p.name);
        let held = ClaimDevices {
            gpus: p.shares.iter().map(|s| s.share.clone()).collect(),
            devices: p.devices.iter().map(|d| d.share.clone()).collect(),
        };
        tracing::info!(claim = %id, spec = ?p.cdi_spec, "the CDI spec of a prepared claim is not where it is written now: writing it again");
        let again = self
            .preparer
            .prepare(uid, &held)
            .map_err(|source| ClaimFailure::Prepare {
                claim: id.clone(),
                source,
            })?;
        let again = record(&id, &p.namespace, &p.name, held, again)?;
        if let Some(old) = &p.cdi_spec
            && again.cdi_spec.as_ref() != Some(old)
            && let Err(e) = crate::gpu::cdi::remove_spec_file(old)
        {
            tracing::warn!(error = %e, "could not remove the claim's CDI spec from where it was written before");
        }
        Ok(Some(again))
    }

    /// Unprepares each claim, each on its own; the error per claim uid (empty when done).
    pub(super) async fn unprepare(&self, uids: Vec<String>) -> BTreeMap<String, String> {
        let answers = futures::future::join_all(uids.into_iter().map(|uid| async move {
            let answer = self.unprepare_claim(&uid).await;
            self.count_unprepare(if answer.is_ok() {
                "unprepared"
            } else {
                "failed"
            });
            let error = answer.err().map(|e| e.to_string()).unwrap_or_default();
            (uid, error)
        }))
        .await;
        self.prune_claim_locks();
        answers.into_iter().collect()
    }

    /// Undoes one claim from its record (or by its uid alone when none) and records that it
    /// is gone; a record that cannot be saved stays, and the claim's answer is an error.
    async fn unprepare_claim(&self, uid: &str) -> Result<(), UnprepareFailure> {
        let lock = self.claim_lock(uid);
        let _claim = lock.lock().await;
        let mut cp = self.checkpoint.lock().await;
        let recorded = cp.claims.get(uid).cloned();
        let claim = recorded.as_ref().map_or_else(
            || uid.to_string(),
            |p| format!("{}/{}", p.namespace, p.name),
        );
        self.preparer
            .unprepare(uid, recorded.as_ref())
            .map_err(|source| UnprepareFailure::Undo {
                claim: claim.clone(),
                source,
            })?;
        let Some(recorded) = recorded else {
            return Ok(());
        };
        cp.claims.remove(uid);
        let saved = cp.save(&self.config.checkpoint);
        if let Err(source) = saved {
            // Still prepared as far as the file knows: keep the record, so that kubelet's
            // retry undoes it again (idempotently) and saves.
            cp.claims.insert(uid.to_string(), recorded);
            return Err(UnprepareFailure::NotRecorded { claim, source });
        }
        self.prepared_now(&cp);
        Ok(())
    }

    /// Settles the checkpoint against the API and the preparer's files once, after a
    /// restart: a recorded claim the API no longer has (gone, another uid, no longer allocated
    /// on this node) is undone and forgotten; what the preparer wrote for a uid the checkpoint
    /// does not record is undone. A claim whose read has no definite answer is kept.
    pub(super) async fn reconcile(&self) -> Reconciled {
        let recorded: Vec<(String, String, String)> = {
            let cp = self.checkpoint.lock().await;
            cp.claims
                .iter()
                .map(|(uid, p)| (uid.clone(), p.namespace.clone(), p.name.clone()))
                .collect()
        };
        let mut done = Reconciled::default();
        for (uid, namespace, name) in recorded {
            let lock = self.claim_lock(&uid);
            let _claim = lock.lock().await;
            let api = Api::<ResourceClaim>::namespaced(self.client.clone(), &namespace);
            let stale = match bounded_for(CLAIM_READ_TIMEOUT, api.get_opt(&name)).await {
                Ok(None) => true,
                Ok(Some(claim)) => {
                    claim.metadata.uid.as_deref() != Some(uid.as_str())
                        || !allocated_here(&claim, &self.config.driver, &self.config.node)
                }
                Err(e) => {
                    tracing::info!(claim = %format!("{namespace}/{name}"), error = %e, "cannot check a recorded claim against the API: kept");
                    false
                }
            };
            if !stale {
                continue;
            }
            let mut cp = self.checkpoint.lock().await;
            let Some(p) = cp.claims.remove(&uid) else {
                continue;
            };
            let undone = self.preparer.unprepare(&uid, Some(&p));
            let saved = cp.save(&self.config.checkpoint);
            match (undone, saved) {
                (Ok(()), Ok(())) => {
                    tracing::info!(claim = %format!("{namespace}/{name}"), "a recorded claim the API no longer holds on this node: unprepared");
                    done.forgotten.push(uid.clone());
                }
                (undone, saved) => {
                    tracing::warn!(claim = %format!("{namespace}/{name}"), undo = ?undone.err(), save = ?saved.err(), "a stale recorded claim could not be forgotten (kept)");
                    cp.claims.insert(uid.clone(), p);
                }
            }
            self.prepared_now(&cp);
        }
        let cp = self.checkpoint.lock().await;
        for uid in self.preparer.written() {
            if cp.claims.contains_key(&uid) {
                continue;
            }
            match self.preparer.unprepare(&uid, None) {
                Ok(()) => {
                    tracing::info!(claim_uid = %uid, "removed what was written for a claim the checkpoint does not record");
                    done.orphans.push(uid);
                }
                Err(e) => {
                    tracing::warn!(claim_uid = %uid, error = %e, "cannot remove what was written for an unrecorded claim")
                }
            }
        }
        drop(cp);
        self.prune_claim_locks();
        done
    }

    pub(super) fn health(&self) -> Vec<(String, bool, String)> {
        let served = self.served.borrow();
        served
            .devices
            .keys()
            .filter(|d| !served.held_back.contains_key(*d))
            .chain(served.others.keys())
            .map(|d| match served.unhealthy.get(d) {
                Some(why) => (d.clone(), false, why.clone()),
                None => (
                    d.clone(),
                    true,
                    served.notes.get(d).cloned().unwrap_or_default(),
                ),
            })
            .collect()
    }
}

/// The record of claim `id` (`namespace/name`) holding `held`, prepared as `prepared`: each
/// result with its CDI ids; a preparer that named CDI devices for another number of results
/// is refused.
fn record(
    id: &str,
    namespace: &str,
    name: &str,
    held: ClaimDevices,
    prepared: Prepared,
) -> Result<PreparedClaim, ClaimFailure> {
    if prepared.cdi_device_ids.len() != held.gpus.len()
        || prepared.device_cdi_ids.len() != held.devices.len()
    {
        return Err(ClaimFailure::Shape {
            claim: id.to_string(),
            got: prepared.cdi_device_ids.len() + prepared.device_cdi_ids.len(),
            want: held.gpus.len() + held.devices.len(),
        });
    }
    Ok(PreparedClaim {
        namespace: namespace.to_string(),
        name: name.to_string(),
        shares: held
            .gpus
            .into_iter()
            .zip(prepared.cdi_device_ids)
            .map(|(share, cdi_device_ids)| PreparedShare {
                share,
                cdi_device_ids,
            })
            .collect(),
        devices: held
            .devices
            .into_iter()
            .zip(prepared.device_cdi_ids)
            .map(|(share, cdi_device_ids)| PreparedDevice {
                share,
                cdi_device_ids,
            })
            .collect(),
        cdi_spec: prepared.cdi_spec,
    })
}
