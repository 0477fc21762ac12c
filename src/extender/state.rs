//! The extender's shared state: configuration, the ledger, the owners of in-flight binds,
//! metrics, the API client, and the readiness gate (ready = ledger synced AND fresh AND
//! serving; fresh = no watch has kept failing past `extender.watch_stale_after_ms`).
//!
//! `serving` is the seam for leader election: it defaults to true when leader election is
//! off; the leader-election loop flips it with [`ExtenderState::set_serving`]. While not
//! serving, the scheduling verbs go to the leader (`forward`); while serving but not synced
//! they answer 503. The [`Fence`] is the leadership term binds are admitted under.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::bind_owners::BindOwners;
use super::cache::Cache;
use super::leader::Fence;
use super::metrics::Metrics;
use crate::admin::AdminState;
use crate::config::ExtenderConfig;
use crate::core::wire::EXTENDER_COMPONENT;
use crate::k8s::events::Events;
use crate::k8s::watch::WatchHealth;
use crate::shutdown::Shutdown;

/// Everything the request handlers and the watches share.
pub struct ExtenderState {
    config: ExtenderConfig,
    cache: Cache,
    binds: BindOwners,
    watch_health: WatchHealth,
    admin: Arc<AdminState>,
    metrics: Metrics,
    client: kube::Client,
    events: Events,
    synced: AtomicBool,
    serving: AtomicBool,
    stale: Mutex<Option<String>>,
    ready_tx: watch::Sender<bool>,
    shutdown: Shutdown,
    fence: Arc<Fence>,
}

impl std::fmt::Debug for ExtenderState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtenderState")
            .field("synced", &self.is_synced())
            .field("serving", &self.is_serving())
            .finish_non_exhaustive()
    }
}

impl ExtenderState {
    /// A new state: not synced; serving unless leader election is on; binds fenced by
    /// `fence`; `shutdown` stops the tasks that own reservations.
    pub fn new(
        config: ExtenderConfig,
        client: kube::Client,
        fence: Arc<Fence>,
        shutdown: Shutdown,
    ) -> Arc<ExtenderState> {
        let admin = AdminState::new();
        let metrics = Metrics::register(&admin);
        let serving = !config.leader_elect;
        let (ready_tx, _) = watch::channel(false);
        Arc::new(ExtenderState {
            config,
            cache: Cache::new(),
            binds: BindOwners::default(),
            watch_health: WatchHealth::default(),
            admin,
            metrics,
            events: Events::new(client.clone(), EXTENDER_COMPONENT, &instance_name()),
            client,
            synced: AtomicBool::new(false),
            serving: AtomicBool::new(serving),
            stale: Mutex::new(None),
            ready_tx,
            shutdown,
            fence,
        })
    }

    /// The `[extender]` configuration in force.
    pub fn config(&self) -> &ExtenderConfig {
        &self.config
    }

    /// The ledger.
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The owners of binds still settling.
    pub fn binds(&self) -> &BindOwners {
        &self.binds
    }

    /// The watches' failing streaks.
    pub fn watch_health(&self) -> &WatchHealth {
        &self.watch_health
    }

    /// Fires when the extender stops.
    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Why the ledger is stale (a watch keeps failing), if it is.
    pub(crate) fn stale_reason(&self) -> Option<String> {
        self.stale.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Marks the ledger stale (with the reason) or fresh again.
    pub(crate) fn set_stale(&self, reason: Option<String>) {
        *self.stale.lock().unwrap_or_else(|p| p.into_inner()) = reason;
        self.update_ready();
    }

    /// Health and the metrics registry.
    pub fn admin(&self) -> &Arc<AdminState> {
        &self.admin
    }

    /// The metric handles.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The API client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The Event publisher (events.k8s.io/v1, repeats aggregated).
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// The leadership term binds are admitted under, and who leads.
    pub(crate) fn fence(&self) -> &Arc<Fence> {
        &self.fence
    }

    /// Whether the first full sync of pods, nodes and ConfigMaps has been applied.
    pub(crate) fn is_synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// Whether this replica may serve the scheduling verbs (leader, or no election).
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }

    /// Ready: synced, fresh and serving.
    pub fn is_ready(&self) -> bool {
        self.is_synced() && self.is_serving() && self.stale_reason().is_none()
    }

    /// Opens or closes the serving gate (leader election).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::SeqCst);
        self.update_ready();
    }

    /// Marks the ledger synced or not.
    pub(crate) fn set_synced(&self, synced: bool) {
        self.synced.store(synced, Ordering::SeqCst);
        self.update_ready();
    }

    /// A receiver that follows readiness.
    pub fn ready_watch(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    fn update_ready(&self) {
        let ready = self.is_ready();
        self.admin.set_ready(ready);
        self.ready_tx.send_replace(ready);
    }

    /// Why the scheduling verbs are refused now, if they are.
    pub(crate) fn unavailable_reason(&self) -> Option<String> {
        if !self.is_synced() {
            Some("the extender's ledger is not synced with the cluster yet".to_string())
        } else if let Some(why) = self.stale_reason() {
            Some(format!("the extender's ledger is stale: {why}"))
        } else if !self.is_serving() {
            Some("this extender replica is not the leader".to_string())
        } else {
            None
        }
    }
}

/// This replica's name for the Events it reports: the pod name (`POD_NAME`, from the downward
/// API) or the host name, else empty (then the component name stands in).
fn instance_name() -> String {
    ["POD_NAME", "HOSTNAME"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .find(|v| !v.is_empty())
        .unwrap_or_default()
}
