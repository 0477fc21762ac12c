//! The plugin's public types: where it serves ([`PluginConfig`]), the devices it serves
//! ([`Served`]), the [`Preparer`] it hands claims to and what that answers ([`Prepared`]), what
//! it is given beside ([`PluginHooks`]), what a reconcile did ([`Reconciled`]) and its errors
//! ([`ClaimFailure`], [`StartError`]). Types only: no serving, no claim handling.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::core::MemoryUnit;
use crate::dra::checkpoint::{CheckpointError, PreparedClaim};
use crate::dra::claims::{ClaimDevices, ClaimError, KindDeviceRef, NodeDevice};
use crate::dra::kinds::KindDevice;
use crate::dra::metrics::DraMetrics;
use crate::dra::slices::{SliceGpu, device_name, published_memory};
use crate::node::api::ApiCallError;
use crate::node::monitor::NodeMonitor;
use crate::node::mps::MpsNotServing;

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

/// How long the read of one claim may take before its prepare fails (kubelet retries; its own
/// deadline for the whole call is 45 s).
pub const CLAIM_READ_TIMEOUT: Duration = Duration::from_secs(10);

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
