//! The readback's published state ([`Status`]): the rows of the last cycle (watched by the
//! roles), the per-container metrics and the counters of violations, cleanups and cycles.
//!
//! A module of its own below [`super::Enforcer`], which holds the status, and
//! [`super::readback`], which fills it with the enforcer's rows: neither imports the other
//! through it. It reads nothing back itself.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use super::report::{ContainerMemory, LimitState};
use crate::admin::AdminState;

/// Labels of a container's metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContainerLabels {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod.
    pub pod: String,
    /// The container.
    pub container: String,
    /// The GPU's UUID.
    pub gpu: String,
}

/// Label of the per-state metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `enforced`, `missing`, `mismatch`, `unreadable`.
    pub state: String,
}

/// Label of the cleanup counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `cleared` (before the cgroup went), `missed` (it was gone first), `failed`.
    pub outcome: String,
}

/// The readback's published state.
#[derive(Debug)]
pub struct Status {
    rows: watch::Sender<Arc<Vec<ContainerMemory>>>,
    used: Family<ContainerLabels, Gauge>,
    limit: Family<ContainerLabels, Gauge>,
    containers: Family<StateLabel, Gauge>,
    violations: Family<StateLabel, Counter>,
    cleanups: Family<OutcomeLabel, Counter>,
    cycles: Counter,
    last: Mutex<BTreeMap<(String, String, String, String), LimitState>>,
}

impl Default for Status {
    fn default() -> Self {
        Status {
            rows: watch::Sender::new(Arc::new(Vec::new())),
            used: Family::default(),
            limit: Family::default(),
            containers: Family::default(),
            violations: Family::default(),
            cleanups: Family::default(),
            cycles: Counter::default(),
            last: Mutex::default(),
        }
    }
}

impl Status {
    /// The rows of the last cycle.
    pub fn rows(&self) -> Arc<Vec<ContainerMemory>> {
        self.rows.borrow().clone()
    }

    /// The rows now and on every change.
    pub fn watch(&self) -> watch::Receiver<Arc<Vec<ContainerMemory>>> {
        self.rows.subscribe()
    }

    /// Readback cycles completed.
    pub fn cycles(&self) -> u64 {
        self.cycles.get()
    }

    /// Rows that turned bad, by state, since start.
    pub fn violations(&self, state: LimitState) -> u64 {
        self.violations
            .get_or_create(&StateLabel {
                state: state.as_str().to_string(),
            })
            .get()
    }

    /// Registers the metrics with a role's admin registry.
    pub fn register(&self, admin: &AdminState) {
        admin.with_registry(|r| {
            r.register(
                "gpushare_container_gpu_memory_used_bytes",
                "GPU memory a container uses on a GPU: its cgroup's, as the driver reads it back (driver enforcement), or its processes' together, from its ledger (the CUDA memory limiter)",
                self.used.clone(),
            );
            r.register(
                "gpushare_container_gpu_memory_limit_bytes",
                "GPU memory limit of a container on a GPU: its cgroup's hard limit read back (driver enforcement), or the limit its processes hold (the CUDA memory limiter)",
                self.limit.clone(),
            );
            r.register(
                "gpushare_enforcement_containers",
                "Served containers by the state of their GPU memory limit (enforced, missing, mismatch, unreadable)",
                self.containers.clone(),
            );
            r.register(
                "gpushare_enforcement_violations",
                "Containers whose GPU memory limit turned missing, mismatched or unreadable",
                self.violations.clone(),
            );
            r.register(
                "gpushare_enforcement_cleanups",
                "Limits of stopped containers: cleared before the cgroup went, missed (already gone) or failed",
                self.cleanups.clone(),
            );
            r.register(
                "gpushare_enforcement_readback_cycles",
                "Readback cycles of every served container's GPU memory limit",
                self.cycles.clone(),
            );
        });
    }

    pub(super) fn cleanup(&self, outcome: &str) {
        self.cleanups
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Publishes `rows`; returns the rows that turned bad since the last cycle.
    pub(super) fn publish(&self, rows: Vec<ContainerMemory>) -> Vec<ContainerMemory> {
        self.used.clear();
        self.limit.clear();
        self.containers.clear();
        let mut per_state: BTreeMap<LimitState, i64> = BTreeMap::new();
        let mut now = BTreeMap::new();
        let mut turned = Vec::new();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        for row in &rows {
            let labels = ContainerLabels {
                namespace: row.namespace.clone(),
                pod: row.pod.clone(),
                container: row.container.clone(),
                gpu: row.gpu.clone(),
            };
            if let Some(used) = row.used {
                self.used
                    .get_or_create(&labels)
                    .set(i64::try_from(used).unwrap_or(i64::MAX));
            }
            if let Some(limit) = row.limit {
                self.limit
                    .get_or_create(&labels)
                    .set(i64::try_from(limit).unwrap_or(i64::MAX));
            }
            *per_state.entry(row.state).or_default() += 1;
            let key = (
                row.namespace.clone(),
                row.pod.clone(),
                row.container.clone(),
                row.gpu.clone(),
            );
            if row.state != LimitState::Enforced && last.get(&key) != Some(&row.state) {
                self.violations
                    .get_or_create(&StateLabel {
                        state: row.state.as_str().to_string(),
                    })
                    .inc();
                turned.push(row.clone());
            }
            now.insert(key, row.state);
        }
        for state in [
            LimitState::Enforced,
            LimitState::Missing,
            LimitState::Mismatch,
            LimitState::Unreadable,
        ] {
            self.containers
                .get_or_create(&StateLabel {
                    state: state.as_str().to_string(),
                })
                .set(per_state.get(&state).copied().unwrap_or(0));
        }
        *last = now;
        drop(last);
        self.cycles.inc();
        self.rows.send_replace(Arc::new(rows));
        turned
    }
}
