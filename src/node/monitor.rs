//! What every node role serves of the node agent, whichever kubelet path it speaks: the node
//! metrics (the memory-unit refusal, unhealthy GPUs, unattributed XIDs, and with MPS the
//! daemon's state and restarts), the readiness that follows the MPS daemon, and the refusal
//! while the daemon does not serve ([`NodeMonitor::check_mps`]).
//!
//! A role builds one [`NodeMonitor`] on its own admin state (its `/metrics` and `/readyz`),
//! names itself ([`NodeRole`]: the metrics carry the role's prefix, so the device plugin's names
//! stay what they were), and tells it its own readiness condition (registered with kubelet):
//! `/readyz` answers ready while that holds AND, with MPS, while the daemon serves. The
//! monitor's task follows the agent's health view and MPS state until stop.
//!
//! What it does not do: speak any kubelet protocol, follow health into a role's device list
//! (ListAndWatch, the ResourceSlice: the roles do), or count a role's own calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::NodeAgent;
use super::health::HealthView;
use super::mps::{MpsNotServing, MpsState};
use crate::admin::AdminState;
use crate::shutdown::Shutdown;

/// The node role a monitor serves (the prefix of its metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRole {
    /// `gpushare device-plugin`: `gpushare_device_plugin_*`.
    DevicePlugin,
    /// `gpushare dra-plugin`: `gpushare_dra_plugin_*`.
    DraPlugin,
}

/// The node metrics of one role.
#[derive(Clone, Debug, Default)]
pub struct NodeMetrics {
    /// 1 while a change of `--memory-unit` is refused because pods placed under the unit the
    /// node had still run.
    pub memory_unit_change_refused: Gauge,
    /// GPUs currently unhealthy.
    pub unhealthy_gpus: Gauge,
    /// XIDs at a PCI address that is none of the served GPUs (marked no GPU).
    pub unattributed_xids: Counter,
    /// With `--mps`: 1 while the MPS control daemon answers and has its defaults.
    pub mps_daemon_up: Gauge,
    /// With `--mps`: restarts of the MPS control daemon after it stopped answering.
    pub mps_daemon_restarts: Counter,
}

const HELP_UNIT: &str =
    "1 while a memory unit change is refused because pods placed under the old unit run";
const HELP_UNHEALTHY: &str = "GPUs currently marked unhealthy";
const HELP_UNATTRIBUTED: &str =
    "XIDs at a PCI address that is none of the served GPUs (NVSwitch/NVLink); they mark no GPU";
const HELP_MPS_UP: &str =
    "1 while the CUDA MPS control daemon answers get_server_list and has its defaults (--mps)";
const HELP_MPS_RESTARTS: &str =
    "Restarts of the CUDA MPS control daemon after it stopped answering (--mps)";

impl NodeMetrics {
    /// New metrics, registered with `admin`'s registry under `role`'s names.
    pub fn new(admin: &AdminState, role: NodeRole) -> NodeMetrics {
        let m = NodeMetrics::default();
        admin.with_registry(|r| match role {
            NodeRole::DevicePlugin => {
                r.register(
                    "gpushare_device_plugin_memory_unit_change_refused",
                    HELP_UNIT,
                    m.memory_unit_change_refused.clone(),
                );
                r.register(
                    "gpushare_device_plugin_unhealthy_gpus",
                    HELP_UNHEALTHY,
                    m.unhealthy_gpus.clone(),
                );
                r.register(
                    "gpushare_device_plugin_unattributed_xids",
                    HELP_UNATTRIBUTED,
                    m.unattributed_xids.clone(),
                );
                r.register(
                    "gpushare_device_plugin_mps_daemon_up",
                    HELP_MPS_UP,
                    m.mps_daemon_up.clone(),
                );
                r.register(
                    "gpushare_device_plugin_mps_daemon_restarts",
                    HELP_MPS_RESTARTS,
                    m.mps_daemon_restarts.clone(),
                );
            }
            NodeRole::DraPlugin => {
                r.register(
                    "gpushare_dra_plugin_memory_unit_change_refused",
                    HELP_UNIT,
                    m.memory_unit_change_refused.clone(),
                );
                r.register(
                    "gpushare_dra_plugin_unhealthy_gpus",
                    HELP_UNHEALTHY,
                    m.unhealthy_gpus.clone(),
                );
                r.register(
                    "gpushare_dra_plugin_unattributed_xids",
                    HELP_UNATTRIBUTED,
                    m.unattributed_xids.clone(),
                );
                r.register(
                    "gpushare_dra_plugin_mps_daemon_up",
                    HELP_MPS_UP,
                    m.mps_daemon_up.clone(),
                );
                r.register(
                    "gpushare_dra_plugin_mps_daemon_restarts",
                    HELP_MPS_RESTARTS,
                    m.mps_daemon_restarts.clone(),
                );
            }
        });
        m
    }
}

/// The node metrics and readiness of one role (see the module docs).
#[derive(Debug)]
pub struct NodeMonitor {
    agent: Arc<NodeAgent>,
    admin: Arc<AdminState>,
    metrics: NodeMetrics,
    role_ready: AtomicBool,
}

impl NodeMonitor {
    /// A monitor of `agent` for `role`, its metrics registered with `admin`, filled with the
    /// state now; not ready until [`NodeMonitor::set_role_ready`]. [`NodeMonitor::follow`]
    /// keeps it current.
    pub fn new(agent: Arc<NodeAgent>, admin: Arc<AdminState>, role: NodeRole) -> Arc<NodeMonitor> {
        let metrics = NodeMetrics::new(&admin, role);
        metrics
            .memory_unit_change_refused
            .set(i64::from(agent.unit_refused().is_some()));
        let monitor = Arc::new(NodeMonitor {
            agent,
            admin,
            metrics,
            role_ready: AtomicBool::new(false),
        });
        let view = monitor.agent.health().borrow().clone();
        monitor.health(&view, 0);
        if let Some(mps) = monitor.agent.mps() {
            let now = *mps.subscribe().borrow();
            monitor.mps(now, 0);
        }
        monitor.update_ready();
        monitor
    }

    /// The metrics.
    pub fn metrics(&self) -> &NodeMetrics {
        &self.metrics
    }

    /// The role's own readiness condition (registered with kubelet); `/readyz` answers ready
    /// while it holds and, with MPS, the daemon serves.
    pub fn set_role_ready(&self, ready: bool) {
        self.role_ready.store(ready, Ordering::SeqCst);
        self.update_ready();
    }

    /// With MPS, refuses while the daemon does not serve.
    pub fn check_mps(&self) -> Result<(), MpsNotServing> {
        self.agent.mps().map_or(Ok(()), |m| m.check_serving())
    }

    fn update_ready(&self) {
        let mps = self.agent.mps().is_none_or(|m| m.serving());
        self.admin
            .set_ready(self.role_ready.load(Ordering::SeqCst) && mps);
    }

    /// Puts `view` into the metrics (the unattributed XIDs after `unattributed_seen`); returns
    /// the unattributed XIDs seen now.
    fn health(&self, view: &HealthView, unattributed_seen: u64) -> u64 {
        let unhealthy = self
            .agent
            .gpus()
            .iter()
            .filter(|g| !view.is_healthy(&g.uuid))
            .count();
        self.metrics
            .unhealthy_gpus
            .set(i64::try_from(unhealthy).unwrap_or(i64::MAX));
        let new = view.unattributed_xids.saturating_sub(unattributed_seen);
        if new > 0 {
            self.metrics.unattributed_xids.inc_by(new);
        }
        view.unattributed_xids.max(unattributed_seen)
    }

    /// Puts the MPS daemon's state into the metrics (the restarts after `restarts_seen`);
    /// returns the restarts seen now.
    fn mps(&self, now: MpsState, restarts_seen: u64) -> u64 {
        self.metrics.mps_daemon_up.set(i64::from(now.serving));
        let new = now.restarts.saturating_sub(restarts_seen);
        if new > 0 {
            self.metrics.mps_daemon_restarts.inc_by(new);
        }
        now.restarts.max(restarts_seen)
    }

    /// Follows the agent's health view and MPS state into the metrics and the readiness
    /// until `stop`.
    pub fn follow(self: &Arc<Self>, stop: Shutdown) -> JoinHandle<()> {
        let monitor = self.clone();
        let mut health = self.agent.health();
        let mut unattributed_seen = health.borrow_and_update().unattributed_xids;
        let mut mps: Option<watch::Receiver<MpsState>> = self.agent.mps().map(|m| m.subscribe());
        let mut restarts_seen = mps.as_mut().map_or(0, |rx| rx.borrow_and_update().restarts);
        tokio::spawn(async move {
            let stop_fut = stop.wait();
            tokio::pin!(stop_fut);
            loop {
                let mps_changed = async {
                    match mps.as_mut() {
                        Some(rx) => rx.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = &mut stop_fut => return,
                    changed = health.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let view = health.borrow_and_update().clone();
                        unattributed_seen = monitor.health(&view, unattributed_seen);
                    }
                    open = mps_changed => {
                        if !open {
                            return;
                        }
                        if let Some(rx) = mps.as_mut() {
                            let now = *rx.borrow_and_update();
                            restarts_seen = monitor.mps(now, restarts_seen);
                            monitor.update_ready();
                        }
                    }
                }
            }
        })
    }
}
