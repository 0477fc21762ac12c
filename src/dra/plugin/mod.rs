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
//!
//! The parts: `interface` (the public types), `preparation` (claims prepared and unprepared),
//! `services` (the gRPC services), `sockets` (binding them, serving them again).

mod interface;
mod preparation;
mod services;
mod sockets;

use std::sync::Arc;

use kube::Client;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

pub use interface::{
    CLAIM_READ_TIMEOUT, ClaimFailure, PluginConfig, PluginHooks, PrepareError, Prepared, Preparer,
    Reconciled, Served, StartError,
};
pub use services::SERVICES;

use crate::dra::checkpoint::Checkpoint;
use crate::kubelet_api::pluginregistration::RegistrationStatus;
use crate::shutdown::Shutdown;
use preparation::Core;
use services::Service;
use sockets::{Socket, config_socket, listen, serve_sockets};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{GpuPolicy, MemoryUnit};
    use crate::dra::slices::SliceGpu;

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
