//! The DRA plugin's Prometheus metrics of its kubelet side, registered with the role's
//! `AdminState`: prepare and unprepare by outcome, prepare latency, the claims prepared now,
//! the registration with kubelet, and the GPUs held back from the slice. The node metrics
//! (unhealthy GPUs, the memory-unit refusal, MPS) are the node agent's
//! ([`crate::node::monitor`]), served on the same page.
//!
//! Does not serve them: `crate::admin::serve` does.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::admin::AdminState;

/// Label of the prepare and unprepare counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// See [`DraMetrics::prepares`] and [`DraMetrics::unprepares`].
    pub outcome: String,
}

/// Every metric of the DRA plugin's kubelet side.
#[derive(Clone, Debug)]
pub struct DraMetrics {
    /// Claims kubelet asked to prepare, by outcome: `prepared`, `repeated` (answered from the
    /// checkpoint), `refused` (the claim does not fit this node: its error names why),
    /// `read_failed` (the claim could not be read from the API: kubelet retries),
    /// `mps_not_serving`, `not_recorded` (the checkpoint could not be saved).
    pub prepares: Family<OutcomeLabel, Counter>,
    /// Claims kubelet asked to unprepare, by outcome: `unprepared`, `failed` (kubelet
    /// retries).
    pub unprepares: Family<OutcomeLabel, Counter>,
    /// Latency of NodePrepareResources calls.
    pub prepare_seconds: Histogram,
    /// Claims recorded as prepared on this node now.
    pub prepared_claims: Gauge,
    /// 1 while registered with kubelet.
    pub registered: Gauge,
    /// GPUs left out of the slice because another path serves them or its pods still hold
    /// memory on them.
    pub gpus_held_back: Gauge,
}

impl DraMetrics {
    /// New metrics, registered with `admin`'s registry.
    pub fn new(admin: &AdminState) -> DraMetrics {
        let m = DraMetrics {
            prepares: Family::default(),
            unprepares: Family::default(),
            prepare_seconds: Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            prepared_claims: Gauge::default(),
            registered: Gauge::default(),
            gpus_held_back: Gauge::default(),
        };
        admin.with_registry(|r| {
            r.register(
                "gpushare_dra_plugin_prepares",
                "Claims kubelet asked to prepare, by outcome",
                m.prepares.clone(),
            );
            r.register(
                "gpushare_dra_plugin_unprepares",
                "Claims kubelet asked to unprepare, by outcome",
                m.unprepares.clone(),
            );
            r.register(
                "gpushare_dra_plugin_prepare_seconds",
                "Latency of kubelet NodePrepareResources calls",
                m.prepare_seconds.clone(),
            );
            r.register(
                "gpushare_dra_plugin_prepared_claims",
                "Claims recorded as prepared on this node",
                m.prepared_claims.clone(),
            );
            r.register(
                "gpushare_dra_plugin_registered",
                "1 while registered with kubelet",
                m.registered.clone(),
            );
            r.register(
                "gpushare_dra_plugin_gpus_held_back",
                "GPUs left out of the slice: another path serves them or its pods hold memory on them",
                m.gpus_held_back.clone(),
            );
        });
        m
    }

    /// Counts one prepare with `outcome`.
    pub fn prepare(&self, outcome: &str) {
        self.prepares
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts one unprepare with `outcome`.
    pub fn unprepare(&self, outcome: &str) {
        self.unprepares
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Prepares counted with `outcome` so far.
    pub fn prepares_with(&self, outcome: &str) -> u64 {
        self.prepares
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .get()
    }
}
