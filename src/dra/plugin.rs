//! The DRA kubelet plugin's gRPC side: registration, `DRAPlugin` v1 and v1beta1, and
//! `DRAResourceHealth` v1 and v1alpha1, on unix sockets through the one unix-socket server
//! (`kubelet_api::unix_server`, which accepts every `:authority` a kubelet or grpcio sends).
//!
//! - `<registry_dir>/<driver>-reg.sock` serves `pluginregistration.Registration`: `GetInfo`
//!   answers type `DRAPlugin`, the driver name, the service socket
//!   `<plugin_dir>/dra.sock` and the services listed in [`SERVICES`];
//!   `NotifyRegistrationStatus` is kept ([`RunningPlugin::registration`]).
//! - `NodePrepareResources` (one call at a time: the checkpoint is locked for the call): a
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
//! What it does not do: decide the container edits or write CDI specs (the [`Preparer`]), build
//! or publish ResourceSlices ([`super::slices`]), watch GPUs, re-register after a kubelet
//! restart (kubelet's plugin watcher finds the socket again), or rolling-update sockets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

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
use super::slices::{SliceGpu, device_name, published_memory};
use crate::core::MemoryUnit;
use crate::kubelet_api::dra::{health_v1, health_v1alpha1, v1, v1beta1};
use crate::kubelet_api::pluginregistration::registration_server::{
    Registration, RegistrationServer,
};
use crate::kubelet_api::pluginregistration::{
    DRA_PLUGIN_TYPE, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
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
        source: kube::Error,
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
    checkpoint: Mutex<Checkpoint>,
    registration: watch::Sender<Option<RegistrationStatus>>,
}

/// One claim as kubelet names it.
struct ClaimRef {
    namespace: String,
    uid: String,
    name: String,
}

impl Core {
    /// Prepares each claim; the answer per claim uid: the shares with their CDI ids, or why not.
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<PreparedClaim, ClaimFailure>> {
        let mut cp = self.checkpoint.lock().await;
        let mut out = BTreeMap::new();
        let mut fresh = Vec::new();
        let mut restored = false;
        for c in claims {
            if let Some(p) = cp.claims.get(&c.uid) {
                let answer = match self.restore(&c.uid, p) {
                    Ok(None) => Ok(p.clone()),
                    Ok(Some(again)) => {
                        cp.claims.insert(c.uid.clone(), again.clone());
                        restored = true;
                        Ok(again)
                    }
                    Err(e) => Err(e),
                };
                out.insert(c.uid, answer);
                continue;
            }
            match self.prepare_one(&c, &cp).await {
                Ok(p) => {
                    out.insert(c.uid.clone(), Ok(p.clone()));
                    cp.claims.insert(c.uid.clone(), p);
                    fresh.push(c.uid);
                }
                Err(e) => {
                    out.insert(c.uid, Err(e));
                }
            }
        }
        if !fresh.is_empty()
            && let Err(e) = cp.save(&self.config.checkpoint)
        {
            // Not recorded means not prepared: undo, and tell kubelet (it retries).
            let e = Arc::new(e);
            for uid in fresh {
                if let Some(p) = cp.claims.remove(&uid) {
                    let _ = self.preparer.unprepare(&uid, Some(&p));
                }
                out.insert(uid, Err(ClaimFailure::Checkpoint(e.clone())));
            }
        } else if restored
            && fresh.is_empty()
            && let Err(e) = cp.save(&self.config.checkpoint)
        {
            // The claims stay recorded either way; only their CDI ids may be stale on disk.
            tracing::warn!(error = %e, "the DRA checkpoint could not be saved after a CDI spec was restored");
        }
        out
    }

    /// A recorded claim whose CDI spec file is gone (a reboot cleared the CDI directory but
    /// not the state directory, or someone deleted it): the spec written again from the
    /// recorded shares before the answer. `None` when the spec is there (or none was written).
    fn restore(&self, uid: &str, p: &PreparedClaim) -> Result<Option<PreparedClaim>, ClaimFailure> {
        if p.cdi_spec.as_ref().is_none_or(|f| f.exists()) {
            return Ok(None);
        }
        let id = format!("{}/{}", p.namespace, p.name);
        let held = ClaimDevices {
            gpus: p.shares.iter().map(|s| s.share.clone()).collect(),
            devices: p.devices.iter().map(|d| d.share.clone()).collect(),
        };
        tracing::info!(claim = %id, "the CDI spec of a prepared claim is gone: writing it again");
        let again = self
            .preparer
            .prepare(uid, &held)
            .map_err(|source| ClaimFailure::Prepare {
                claim: id.clone(),
                source,
            })?;
        record(&id, &p.namespace, &p.name, held, again).map(Some)
    }

    async fn prepare_one(
        &self,
        c: &ClaimRef,
        cp: &Checkpoint,
    ) -> Result<PreparedClaim, ClaimFailure> {
        let id = format!("{}/{}", c.namespace, c.name);
        let claim = Api::<ResourceClaim>::namespaced(self.client.clone(), &c.namespace)
            .get(&c.name)
            .await
            .map_err(|source| ClaimFailure::Read {
                claim: id.clone(),
                source,
            })?;
        let found = claim.metadata.uid.clone().unwrap_or_default();
        if found != c.uid {
            return Err(ClaimFailure::Uid {
                claim: id,
                wanted: c.uid.clone(),
                found,
            });
        }
        let served = self.served.borrow().clone();
        let held = read_claim(
            &claim,
            &self.config.driver,
            &self.config.node,
            &served.devices,
            &served.others,
            self.config.unit,
        )?;
        admit(
            &id,
            &held,
            &cp.held(Some(&c.uid)),
            &served.devices,
            &served.others,
        )?;
        let prepared =
            self.preparer
                .prepare(&c.uid, &held)
                .map_err(|source| ClaimFailure::Prepare {
                    claim: id.clone(),
                    source,
                })?;
        record(&id, &c.namespace, &c.name, held, prepared)
    }

    /// Unprepares each claim; the error per claim uid (empty when done).
    async fn unprepare(&self, uids: Vec<String>) -> BTreeMap<String, String> {
        let mut cp = self.checkpoint.lock().await;
        let mut out = BTreeMap::new();
        let mut changed = false;
        for uid in uids {
            let recorded = cp.claims.get(&uid);
            let error = match self.preparer.unprepare(&uid, recorded) {
                Ok(()) => {
                    changed |= cp.claims.remove(&uid).is_some();
                    String::new()
                }
                Err(e) => match recorded {
                    Some(p) => format!("unpreparing claim {}/{}: {e}", p.namespace, p.name),
                    None => format!("unpreparing claim {uid}: {e}"),
                },
            };
            out.insert(uid, error);
        }
        if changed && let Err(e) = cp.save(&self.config.checkpoint) {
            // The claims are undone; a stale record is undone again (idempotently) later.
            tracing::warn!(error = %e, "the DRA checkpoint could not be saved after unprepare");
        }
        out
    }

    fn health(&self) -> Vec<(String, bool, String)> {
        let served = self.served.borrow();
        served
            .devices
            .keys()
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
        registration,
    });
    let svc = Service(core);
    let services = Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(svc.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
            svc.clone(),
        ))
        .add_service(
            health_v1::dra_resource_health_server::DraResourceHealthServer::new(svc.clone()),
        )
        .add_service(
            health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(svc.clone()),
        );
    let stop = shutdown.clone();
    let t1 = tokio::spawn(async move {
        if let Err(e) = services
            .serve_with_incoming_shutdown(
                crate::kubelet_api::unix_server::incoming(service_listener),
                stop.wait(),
            )
            .await
        {
            tracing::warn!(error = %e, "DRA plugin gRPC server ended with an error");
        }
    });
    let t2 = tokio::spawn(async move {
        if let Err(e) = Server::builder()
            .add_service(RegistrationServer::new(svc))
            .serve_with_incoming_shutdown(
                crate::kubelet_api::unix_server::incoming(registration_listener),
                shutdown.wait(),
            )
            .await
        {
            tracing::warn!(error = %e, "DRA registration gRPC server ended with an error");
        }
    });
    Ok(RunningPlugin {
        registration: registration_rx,
        tasks: vec![t1, t2],
    })
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
