//! `/healthz`, `/readyz` and `/metrics` for the server roles: a readiness flag and a
//! Prometheus registry rendered in the text exposition format.
//!
//! The extender serves these on its own port next to the scheduling verbs; the device plugin
//! serves them on `device_plugin.admin_address`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::registry::Registry;

/// Shared health state and metrics of one role.
#[derive(Debug)]
pub struct AdminState {
    ready: AtomicBool,
    registry: std::sync::Mutex<Registry>,
}

impl Default for AdminState {
    fn default() -> Self {
        AdminState {
            ready: AtomicBool::new(false),
            registry: std::sync::Mutex::new(Registry::default()),
        }
    }
}

impl AdminState {
    /// A new state, not ready, with an empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(AdminState::default())
    }

    /// Marks the role ready or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether the role is ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Registers metrics with the registry.
    pub fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        let mut guard = match self.registry.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }

    /// The metrics in the Prometheus text format.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        self.with_registry(|r| {
            let _ = prometheus_client::encoding::text::encode(&mut out, r);
        });
        out
    }
}

/// Content type of the Prometheus text format.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn readiness_and_metrics() {
        let state = AdminState::new();
        assert!(!state.is_ready());
        state.set_ready(true);
        assert!(state.is_ready());
        let c: Counter = Counter::default();
        state.with_registry(|r| r.register("gpushare_test", "a test counter", c.clone()));
        c.inc();
        let text = state.render_metrics();
        assert!(text.contains("gpushare_test_total 1"), "{text}");
    }
}
