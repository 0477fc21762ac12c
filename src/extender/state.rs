//! The extender's shared state: configuration, the ledger, metrics, the API client, and the
//! readiness gate (ready = ledger synced AND serving).
//!
//! `serving` is the seam for leader election: it defaults to true when leader election is
//! off; the leader-election loop flips it with [`ExtenderState::set_serving`]. While not
//! serving, the scheduling verbs go to the leader (`forward`); while serving but not synced
//! they answer 503. The [`Fence`] is the leadership term binds are admitted under.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use super::cache::Cache;
use super::leader::Fence;
use super::metrics::Metrics;
use crate::admin::AdminState;
use crate::config::ExtenderConfig;

/// Everything the request handlers and the watches share.
pub struct ExtenderState {
    config: ExtenderConfig,
    cache: Cache,
    admin: Arc<AdminState>,
    metrics: Metrics,
    client: kube::Client,
    synced: AtomicBool,
    serving: AtomicBool,
    ready_tx: watch::Sender<bool>,
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
    /// `fence`.
    pub fn new(
        config: ExtenderConfig,
        client: kube::Client,
        fence: Arc<Fence>,
    ) -> Arc<ExtenderState> {
        let admin = AdminState::new();
        let metrics = Metrics::register(&admin);
        let serving = !config.leader_elect;
        let (ready_tx, _) = watch::channel(false);
        Arc::new(ExtenderState {
            config,
            cache: Cache::new(),
            admin,
            metrics,
            client,
            synced: AtomicBool::new(false),
            serving: AtomicBool::new(serving),
            ready_tx,
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

    /// The leadership term binds are admitted under, and who leads.
    pub fn fence(&self) -> &Arc<Fence> {
        &self.fence
    }

    /// Whether the first full sync of pods, nodes and ConfigMaps has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// Whether this replica may serve the scheduling verbs (leader, or no election).
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }

    /// Ready: synced and serving.
    pub fn is_ready(&self) -> bool {
        self.is_synced() && self.is_serving()
    }

    /// Opens or closes the serving gate (leader election).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::SeqCst);
        self.update_ready();
    }

    /// Marks the ledger synced or not.
    pub fn set_synced(&self, synced: bool) {
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
    pub fn unavailable_reason(&self) -> Option<&'static str> {
        if !self.is_synced() {
            Some("the extender's ledger is not synced with the cluster yet")
        } else if !self.is_serving() {
            Some("this extender replica is not the leader")
        } else {
            None
        }
    }
}
