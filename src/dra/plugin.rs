//! The DRA kubelet plugin's gRPC side: registration, `DRAPlugin` v1 and v1beta1, and
//! `DRAResourceHealth` v1 and v1alpha1, on unix sockets through the one unix-socket server
//! (`kubelet_api::unix_server`, which accepts every `:authority` a kubelet or grpcio sends).
//!
//! - `<registry_dir>/<driver>-reg.sock` serves `pluginregistration.Registration`: `GetInfo`
//!   answers type `DRAPlugin`, the driver name, the service socket
//!   `<plugin_dir>/dra.sock` and the services listed in [`SERVICES`];
//!   `NotifyRegistrationStatus` is kept ([`RunningPlugin::registration`]).
//! - `NodePrepareResources` (each claim on its own): a
//!   claim already in the checkpoint is answered from it (idempotent); else the claim is read
//!   from the API, its results for this driver checked against the served devices and what
//!   prepared claims hold ([`super::claims`]), handed to the [`Preparer`] (which writes what
//!   the containers get, and names the CDI devices), recorded, and the checkpoint saved before
//!   the answer. Each claim gets its own answer; a claim's failure changes nothing else.
//!   A recorded claim whose CDI spec file is gone (the CDI directory was cleared, the state
//!   directory was not) gets it written again from the recorded shares before the answer.
//! - `NodeUnprepareResources` works from the checkpoint alone (the claim may be gone): the
//!   [`Preparer`] undoes, the claim leaves the checkpoint. A claim the checkpoint does not
//!   know is undone by its uid alone (the CDI spec has a deterministic name), so nothing
//!   leaks when the checkpoint was lost.
//! - `NodeWatchResources` streams the complete device list with `HEALTHY`/`UNHEALTHY` on every
//!   change of [`Served`].
//!
//! - A socket removed under the running plugin is served again (kubelet's plugin watcher then
//!   registers it again); until kubelet has, the plugin counts as not registered.
//! - The checkpoint is settled against the API and the preparer's files once after a start
//!   ([`RunningPlugin::reconcile`]).
//!
//! Locks: one per claim (held across that claim's API read, so a claim is never prepared and
//! unprepared at once) and the checkpoint's (held only for local work: checks, the preparer's
//! writes, the save). No lock is held across an API call, and every claim read has a
//! deadline ([`CLAIM_READ_TIMEOUT`]): prepare and unprepare of unrelated claims never wait
//! for each other.
//!
//! What it does not do: decide the container edits or write CDI specs (the [`Preparer`]), build
//! or publish ResourceSlices ([`super::slices`]), watch GPUs, re-register after a kubelet
//! restart (kubelet's plugin watcher finds the socket again), or rolling-update sockets.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{Api, Client};
use tokio::net::UnixListener;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use super::checkpoint::{
    Checkpoint, CheckpointError, PreparedClaim, PreparedDevice, PreparedShare,
};
use super::claims::{ClaimDevices, ClaimError, KindDeviceRef, NodeDevice, admit, read_claim};
use super::kinds::KindDevice;
use super::metrics::DraMetrics;
use super::slices::{SliceGpu, device_name, published_memory};
use crate::core::MemoryUnit;
use crate::kubelet_api::dra::{health_v1, health_v1alpha1, v1, v1beta1};
use crate::kubelet_api::pluginregistration::registration_server::{
    Registration, RegistrationServer,
};
use crate::kubelet_api::pluginregistration::{
    DRA_PLUGIN_TYPE, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use crate::node::api::{ApiCallError, bounded_for};
use crate::node::monitor::NodeMonitor;
use crate::node::mps::MpsNotServing;
use crate::shutdown::Shutdown;

/// The services `GetInfo` lists, newest first.
pub const SERVICES: [&str; 4] = [
    v1::SERVICE,
    v1beta1::SERVICE,
    health_v1::SERVICE,
    health_v1alpha1::SERVICE,
];
/// `health_check_timeout_seconds` of every device in `NodeWatchResources`.
const HEALTH_TIMEOUT_SECONDS: i64 = 60;

/// Where and as whom the plugin serves.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// The driver name (`gpushare.io`).
    pub driver: String,
    /// This node's name (the pool's name).
    pub node: String,
    /// kubelet's plugin registry directory (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// The plugin's own directory (`/var/lib/kubelet/plugins/<driver>`), for `dra.sock`.
    pub plugin_dir: PathBuf,
    /// The checkpoint file (`<state dir>/checkpoint.json`).
    pub checkpoint: PathBuf,
    /// The memory unit of the node.
    pub unit: MemoryUnit,
}

impl PluginConfig {
    /// `<registry_dir>/<driver>-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{}-reg.sock", self.driver))
    }

    /// `<plugin_dir>/dra.sock`.
    pub fn service_socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }
}

/// The devices this node serves on the DRA path, as the slice publishes them, and the
/// unhealthy ones with the reason.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Served {
    /// The GPUs, by device name.
    pub devices: BTreeMap<String, NodeDevice>,
    /// The devices of other kinds (RDMA HCAs, generic devices), by device name.
    pub others: BTreeMap<String, KindDeviceRef>,
    /// Device name -> why it is unhealthy.
    pub unhealthy: BTreeMap<String, String>,
    /// Device name -> a note on a healthy device: containers whose GPU memory limit is not in
    /// force (driver enforcement's readback), the message of its health.
    pub notes: BTreeMap<String, String>,
    /// GPUs of the node not offered on the DRA path now (left out of the slice), by device
    /// name -> why.
    pub held_back: BTreeMap<String, String>,
}

impl Served {
    /// What the slice built from `gpus` publishes ([`super::slices::build_slices`]): the same
    /// device names, the memory in whole units, the unhealthy GPUs with their reason.
    pub fn from_gpus(gpus: &[SliceGpu], unit: MemoryUnit) -> Served {
        let mut served = Served::default();
        for g in gpus {
            let name = device_name(g);
            if let Some(why) = &g.unhealthy {
                served.unhealthy.insert(name.clone(), why.clone());
            }
            served.devices.insert(
                name,
                NodeDevice {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    memory_bytes: published_memory(g.memory_bytes, unit),
                },
            );
        }
        served
    }

    /// The same with the devices of other kinds `devices` ([`super::kinds::kind_devices`]).
    pub fn with_kinds(mut self, devices: &[KindDevice]) -> Served {
        for d in devices {
            self.others.insert(
                d.name.clone(),
                KindDeviceRef {
                    resource: d.resource.clone(),
                    id: d.id.clone(),
                    shares: d.shares,
                },
            );
        }
        self
    }
}

/// What the [`Preparer`] did for one claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    /// The CDI device ids of each GPU share, in the order of the shares.
    pub cdi_device_ids: Vec<Vec<String>>,
    /// The CDI device ids of each device of another kind, in the order of the devices.
    pub device_cdi_ids: Vec<Vec<String>>,
    /// The transient CDI spec written for the claim, if any.
    pub cdi_spec: Option<PathBuf>,
}

/// The preparer's own error.
pub type PrepareError = Box<dyn std::error::Error + Send + Sync>;

/// What makes a claim's shares reach its containers (the node agent's container contract and
/// CDI writer). Both calls must be idempotent, and what `prepare` writes for a claim must be
/// found again from its uid alone (a deterministic name), so that `unprepare` undoes it when
/// the checkpoint was lost.
pub trait Preparer: Send + Sync + 'static {
    /// Makes what claim `claim_uid` holds available (its GPU shares and its devices of other
    /// kinds); names their CDI devices. Also called for a recorded claim whose CDI spec is
    /// gone (written again from the record).
    fn prepare(&self, claim_uid: &str, claim: &ClaimDevices) -> Result<Prepared, PrepareError>;
    /// Undoes [`Preparer::prepare`] for claim `claim_uid`: `claim` is its record in the
    /// checkpoint, `None` when the checkpoint has none (never prepared, already unprepared, or
    /// the checkpoint was lost): undo whatever is found under the uid.
    fn unprepare(&self, claim_uid: &str, claim: Option<&PreparedClaim>)
    -> Result<(), PrepareError>;
    /// Whether what was prepared for recorded claim `claim` is where this preparer writes it
    /// now (else it is written again before the claim is answered). By default: its spec
    /// file, if any, exists.
    fn is_current(&self, claim_uid: &str, claim: &PreparedClaim) -> bool {
        let _ = claim_uid;
        claim.cdi_spec.as_ref().is_none_or(|f| f.exists())
    }
    /// The uids of the claims this preparer finds written (a restart undoes those the
    /// checkpoint does not record). By default none.
    fn written(&self) -> Vec<String> {
        Vec::new()
    }
}

/// What the plugin is given beside its preparer: its metrics, and the node monitor whose MPS
/// refusal it answers.
#[derive(Clone, Debug, Default)]
pub struct PluginHooks {
    /// The kubelet side's metrics.
    pub metrics: Option<DraMetrics>,
    /// The node's monitor: with MPS, prepare is refused while the daemon does not serve.
    pub node: Option<Arc<NodeMonitor>>,
}

/// What one [`RunningPlugin::reconcile`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Recorded claims the API no longer holds on this node, undone and forgotten (uids).
    pub forgotten: Vec<String>,
    /// Claims the preparer had written and the checkpoint did not record, undone (uids).
    pub orphans: Vec<String>,
}

/// Whether `claim` is allocated with a result of `driver` in pool `pool` (this node).
fn allocated_here(claim: &ResourceClaim, driver: &str, pool: &str) -> bool {
    crate::k8s::project::claim_results(claim)
        .is_some_and(|rs| rs.iter().any(|r| r.driver == driver && r.pool == pool))
}

/// Why one claim was not prepared (its error in the answer to kubelet).
#[derive(Debug, thiserror::Error)]
pub enum ClaimFailure {
    /// The claim could not be read from the API (unknown outcome: kubelet retries).
    #[error("reading ResourceClaim {claim}: {source}")]
    Read {
        /// `namespace/name`.
        claim: String,
        /// Why.
        #[source]
        source: ApiCallError,
    },
    /// With MPS, the daemon does not serve: nothing is prepared (kubelet retries).
    #[error(transparent)]
    Mps(MpsNotServing),
    /// The claim holds a GPU this node does not offer on the DRA path now (another path
    /// serves it, or that path's pods still hold memory on it).
    #[error("claim {claim}: {why}")]
    HeldBack {
        /// `namespace/name`.
        claim: String,
        /// Why the GPU is held back.
        why: String,
    },
    /// The claim in the API is another one than kubelet named.
    #[error("ResourceClaim {claim} has uid {found}, not {wanted}")]
    Uid {
        /// `namespace/name`.
        claim: String,
        /// The uid kubelet sent.
        wanted: String,
        /// The uid in the API.
        found: String,
    },
    /// The claim's allocation does not fit this node.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The preparer failed.
    #[error("preparing claim {claim}: {source}")]
    Prepare {
        /// `namespace/name`.
        claim: String,
        /// Why.
        source: PrepareError,
    },
    /// The preparer named CDI devices for a different number of results.
    #[error("preparing claim {claim}: CDI devices for {got} results, the claim has {want}")]
    Shape {
        /// `namespace/name`.
        claim: String,
        /// What it answered.
        got: usize,
        /// The results.
        want: usize,
    },
    /// The checkpoint could not be saved: the claim is not prepared.
    #[error(transparent)]
    Checkpoint(#[from] Arc<CheckpointError>),
}

/// Why the plugin could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The checkpoint cannot be read: prepared claims would be forgotten.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A socket could not be bound.
    #[error("cannot listen on {path}: {source}")]
    Listen {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

struct Core {
    config: PluginConfig,
    client: Client,
    served: watch::Receiver<Served>,
    preparer: Arc<dyn Preparer>,
    /// The prepared claims. Held for the checks against them, the preparer's local writes and
    /// the save; never across an API call.
    checkpoint: Mutex<Checkpoint>,
    /// One lock per claim uid, held for that claim's whole prepare or unprepare (its API read
    /// included): a claim is never prepared and unprepared at once, and no other claim waits
    /// on it.
    claim_locks: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    registration: watch::Sender<Option<RegistrationStatus>>,
    hooks: PluginHooks,
}

/// One claim as kubelet names it.
struct ClaimRef {
    namespace: String,
    uid: String,
    name: String,
}

/// How long the read of one claim may take before its prepare fails (kubelet retries; its own
/// deadline for the whole call is 45 s).
pub const CLAIM_READ_TIMEOUT: Duration = Duration::from_secs(10);

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
    async fn prepare(
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
    async fn unprepare(&self, uids: Vec<String>) -> BTreeMap<String, String> {
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
    async fn reconcile(&self) -> Reconciled {
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

    fn health(&self) -> Vec<(String, bool, String)> {
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

/// One device of a prepared claim as kubelet is told of it.
struct Answered {
    request: String,
    device: String,
    cdi_device_ids: Vec<String>,
    share_id: Option<String>,
}

/// The devices of a prepared claim in the answer's order: its GPU shares, then its devices
/// of other kinds.
fn answered(p: PreparedClaim) -> impl Iterator<Item = Answered> {
    let gpus = p.shares.into_iter().map(|s| Answered {
        request: s.share.request,
        device: s.share.device,
        cdi_device_ids: s.cdi_device_ids,
        share_id: s.share.share_id,
    });
    let others = p.devices.into_iter().map(|d| Answered {
        request: d.share.request,
        device: d.share.device,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share.share_id,
    });
    gpus.chain(others)
}

fn claim_refs<I>(claims: I) -> Vec<ClaimRef>
where
    I: IntoIterator<Item = (String, String, String)>,
{
    claims
        .into_iter()
        .map(|(namespace, uid, name)| ClaimRef {
            namespace,
            uid,
            name,
        })
        .collect()
}

#[derive(Clone)]
struct Service(Arc<Core>);

#[tonic::async_trait]
impl Registration for Service {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: self.0.config.driver.clone(),
            endpoint: self.0.config.service_socket().display().to_string(),
            supported_versions: SERVICES.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.0.config.driver, "registered with kubelet");
        } else {
            tracing::warn!(driver = %self.0.config.driver, error = %status.error, "kubelet refused the registration");
        }
        self.0.registration.send_replace(Some(status));
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `DRAPlugin` of one protocol version (`v1`, `v1beta1`): the same prepare and unprepare,
/// answered in that version's types; `$device` builds one answered device (`v1` carries its
/// `share_id`, `v1beta1` has none).
macro_rules! dra_plugin_service {
    ($v:ident, $device:expr) => {
        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for Service {
            async fn node_prepare_resources(
                &self,
                request: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims = claim_refs(
                    request
                        .into_inner()
                        .claims
                        .into_iter()
                        .map(|c| (c.namespace, c.uid, c.name)),
                );
                let node = self.0.config.node.clone();
                let device: fn(Answered, String) -> $v::Device = $device;
                let claims = self
                    .0
                    .prepare(claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| {
                        let answer = match r {
                            Ok(p) => $v::NodePrepareResourceResponse {
                                devices: answered(p).map(|a| device(a, node.clone())).collect(),
                                error: String::new(),
                            },
                            Err(e) => $v::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: e.to_string(),
                            },
                        };
                        (uid, answer)
                    })
                    .collect();
                Ok(Response::new($v::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let uids = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| c.uid)
                    .collect();
                let claims = self
                    .0
                    .unprepare(uids)
                    .await
                    .into_iter()
                    .map(|(uid, error)| (uid, $v::NodeUnprepareResourceResponse { error }))
                    .collect();
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_plugin_service!(v1, |a, pool_name| v1::Device {
    request_names: vec![a.request],
    pool_name,
    device_name: a.device,
    cdi_device_ids: a.cdi_device_ids,
    share_id: a.share_id,
});
dra_plugin_service!(v1beta1, |a, pool_name| v1beta1::Device {
    request_names: vec![a.request],
    pool_name,
    device_name: a.device,
    cdi_device_ids: a.cdi_device_ids,
});

/// The health list on every change of [`Served`], as `(device, healthy, message)`.
fn health_stream(core: Arc<Core>) -> impl Stream<Item = Vec<(String, bool, String)>> + Send {
    let rx = core.served.clone();
    tokio_stream::wrappers::WatchStream::new(rx).map(move |_| core.health())
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// `DRAResourceHealth` of one protocol version (`health_v1`, `health_v1alpha1` for kubelets up
/// to 1.36): the complete device list with its health on every change of [`Served`].
macro_rules! dra_health_service {
    ($v:ident) => {
        #[tonic::async_trait]
        impl $v::dra_resource_health_server::DraResourceHealth for Service {
            type NodeWatchResourcesStream =
                Pin<Box<dyn Stream<Item = Result<$v::NodeWatchResourcesResponse, Status>> + Send>>;

            async fn node_watch_resources(
                &self,
                _: Request<$v::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                let pool = self.0.config.node.clone();
                let stream = health_stream(self.0.clone()).map(move |list| {
                    let now = unix_now();
                    Ok($v::NodeWatchResourcesResponse {
                        devices: list
                            .into_iter()
                            .map(|(device, healthy, message)| $v::DeviceHealth {
                                device: Some($v::DeviceIdentifier {
                                    pool_name: pool.clone(),
                                    device_name: device,
                                }),
                                health: if healthy {
                                    $v::HealthStatus::Healthy
                                } else {
                                    $v::HealthStatus::Unhealthy
                                } as i32,
                                last_updated_time: now,
                                health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                                message: message.chars().take(1024).collect(),
                            })
                            .collect(),
                    })
                });
                Ok(Response::new(Box::pin(stream)))
            }
        }
    };
}

dra_health_service!(health_v1);
dra_health_service!(health_v1alpha1);

/// A serving plugin; dropping it stops the servers (their sockets stay until the next start
/// removes them).
pub struct RunningPlugin {
    registration: watch::Receiver<Option<RegistrationStatus>>,
    core: Arc<Core>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for RunningPlugin {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl RunningPlugin {
    /// What kubelet said in `NotifyRegistrationStatus`, as it changes (`None` until it spoke).
    pub fn registration(&self) -> watch::Receiver<Option<RegistrationStatus>> {
        self.registration.clone()
    }

    /// Settles the checkpoint against the API and the preparer's files (what a start runs
    /// once in the background): see [`Reconciled`].
    pub async fn reconcile(&self) -> Reconciled {
        self.core.reconcile().await
    }

    /// The uids of the claims recorded as prepared now.
    pub async fn recorded(&self) -> Vec<String> {
        self.core
            .checkpoint
            .lock()
            .await
            .claims
            .keys()
            .cloned()
            .collect()
    }
}

fn listen(path: &Path) -> Result<UnixListener, StartError> {
    let fail = |source| StartError::Listen {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    UnixListener::bind(path).map_err(fail)
}

/// Starts serving: the service socket first (kubelet dials it right after `GetInfo`), then
/// the registration socket. Reads the checkpoint first: a checkpoint that cannot be read stops
/// the start rather than forget prepared claims.
pub fn start(
    config: PluginConfig,
    client: Client,
    served: watch::Receiver<Served>,
    preparer: Arc<dyn Preparer>,
    shutdown: Shutdown,
) -> Result<RunningPlugin, StartError> {
    start_with(
        config,
        client,
        served,
        preparer,
        PluginHooks::default(),
        shutdown,
    )
}

/// [`start`] with the plugin's metrics and the node's monitor. A start settles the checkpoint
/// against the API and the preparer's files in the background ([`RunningPlugin::reconcile`]).
pub fn start_with(
    config: PluginConfig,
    client: Client,
    served: watch::Receiver<Served>,
    preparer: Arc<dyn Preparer>,
    hooks: PluginHooks,
    shutdown: Shutdown,
) -> Result<RunningPlugin, StartError> {
    let checkpoint = Checkpoint::load(&config.checkpoint)?;
    let service_listener = listen(&config.service_socket())?;
    let registration_listener = listen(&config.registration_socket())?;
    let (registration, registration_rx) = watch::channel(None);
    let core = Arc::new(Core {
        config,
        client,
        served,
        preparer,
        checkpoint: Mutex::new(checkpoint),
        claim_locks: std::sync::Mutex::default(),
        registration,
        hooks,
    });
    if let Some(m) = &core.hooks.metrics
        && let Ok(cp) = core.checkpoint.try_lock()
    {
        m.prepared_claims
            .set(i64::try_from(cp.claims.len()).unwrap_or(i64::MAX));
    }
    let settle = {
        let core = core.clone();
        tokio::spawn(async move {
            let done = core.reconcile().await;
            if done != Reconciled::default() {
                tracing::info!(?done, "the DRA checkpoint settled against the API");
            }
        })
    };
    let svc = Service(core.clone());
    let serving = tokio::spawn(serve_sockets(
        svc,
        [
            (config_socket(&core, Socket::Service), service_listener),
            (
                config_socket(&core, Socket::Registration),
                registration_listener,
            ),
        ],
        shutdown,
    ));
    Ok(RunningPlugin {
        registration: registration_rx,
        core,
        tasks: vec![serving, settle],
    })
}

/// How often the plugin checks that its sockets are still there.
const SOCKET_CHECK: Duration = Duration::from_millis(500);

/// The two sockets of the plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Socket {
    /// `<plugin_dir>/dra.sock`: the DRA and health services.
    Service,
    /// `<registry_dir>/<driver>-reg.sock`: kubelet's registration.
    Registration,
}

fn config_socket(core: &Core, which: Socket) -> (Socket, PathBuf) {
    let path = match which {
        Socket::Service => core.config.service_socket(),
        Socket::Registration => core.config.registration_socket(),
    };
    (which, path)
}

/// The inode of the socket file at `path`, when there is one.
fn socket_inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::symlink_metadata(path).ok()?;
    m.file_type().is_socket().then(|| m.ino())
}

/// Serves `which` on `listener` until `stop`.
fn serve_socket(
    svc: Service,
    which: Socket,
    listener: UnixListener,
    stop: Shutdown,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let incoming = crate::kubelet_api::unix_server::incoming(listener);
        let served =
            match which {
                Socket::Service => Server::builder()
                    .add_service(v1::dra_plugin_server::DraPluginServer::new(svc.clone()))
                    .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
                        svc.clone(),
                    ))
                    .add_service(
                        health_v1::dra_resource_health_server::DraResourceHealthServer::new(
                            svc.clone(),
                        ),
                    )
                    .add_service(
                        health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                            svc,
                        ),
                    )
                    .serve_with_incoming_shutdown(incoming, stop.wait())
                    .await,
                Socket::Registration => {
                    Server::builder()
                        .add_service(RegistrationServer::new(svc))
                        .serve_with_incoming_shutdown(incoming, stop.wait())
                        .await
                }
            };
        if let Err(e) = served {
            tracing::warn!(error = %e, socket = ?which, "DRA plugin gRPC server ended with an error");
        }
    })
}

/// Serves both sockets until `stop`, and serves a socket again when its file is removed
/// under the plugin (a clean-up, a kubelet that wiped its registry): kubelet's plugin watcher
/// finds a new registration socket and registers the plugin again. Until it has, the plugin
/// counts as not registered (its readiness follows). A socket file replaced by another
/// process is left to it (a second plugin on the node; logged).
async fn serve_sockets(
    svc: Service,
    listeners: [((Socket, PathBuf), UnixListener); 2],
    stop: Shutdown,
) {
    let mut served: Vec<(Socket, PathBuf, Option<u64>, JoinHandle<()>)> = listeners
        .into_iter()
        .map(|((which, path), listener)| {
            let inode = socket_inode(&path);
            let task = serve_socket(svc.clone(), which, listener, stop.clone());
            (which, path, inode, task)
        })
        .collect();
    let stop_fut = stop.clone().wait();
    tokio::pin!(stop_fut);
    loop {
        tokio::select! {
            _ = &mut stop_fut => break,
            _ = tokio::time::sleep(SOCKET_CHECK) => {}
        }
        for (which, path, inode, task) in served.iter_mut() {
            let now = socket_inode(path);
            if now.is_some() && now == *inode {
                continue;
            }
            if now.is_some() {
                if inode.is_some() {
                    tracing::warn!(socket = %path.display(), "the plugin's socket was replaced by another process: leaving it");
                    *inode = None;
                }
                continue;
            }
            tracing::warn!(socket = %path.display(), "the plugin's socket is gone: serving it again");
            if *which == Socket::Registration {
                // kubelet deregistered the plugin when the socket went away.
                svc.0.registration.send_replace(None);
            }
            match listen(path) {
                Ok(listener) => {
                    task.abort();
                    *inode = socket_inode(path);
                    *task = serve_socket(svc.clone(), *which, listener, stop.clone());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot serve the plugin's socket again (retrying)")
                }
            }
        }
    }
    for (_, _, _, task) in served {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::GpuPolicy;

    /// The plugin checks claims against exactly what the slice publishes.
    #[test]
    fn served_devices_match_the_published_slice() {
        let gpus: Vec<SliceGpu> = (0..3)
            .map(|i| SliceGpu {
                index: i,
                uuid: format!("GPU-{i}"),
                product_name: "x".into(),
                memory_bytes: (15 << 30) + (900 << 20),
                place: None,
                unhealthy: (i == 2).then(|| "xid 48".to_string()),
                allocated_bytes: u64::from(i) << 30,
            })
            .collect();
        let unit = MemoryUnit::GIB;
        let served = Served::from_gpus(&gpus, unit);
        let slices = super::super::slices::build_slices(
            "n",
            "d",
            None,
            unit,
            GpuPolicy::Spread,
            &gpus,
            &[],
            1,
        );
        for d in slices[0].spec.devices.iter().flatten() {
            let s = &served.devices[&d.name];
            let cap = &d.capacity.as_ref().expect("capacity")["memory"];
            assert_eq!(cap.value.0, s.memory_bytes.to_string(), "{}", d.name);
            assert_eq!(d.taints.is_some(), served.unhealthy.contains_key(&d.name));
        }
        assert_eq!(served.devices.len(), 3);
        assert_eq!(served.devices["gpu-0"].memory_bytes, 15 << 30);
    }
}
