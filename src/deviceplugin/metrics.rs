//! The device plugin's Prometheus metrics of its kubelet side, registered with the role's
//! `AdminState`: allocations, matching corrections, registration. The node metrics (unhealthy
//! GPUs, the memory-unit refusal, MPS) are the node agent's ([`crate::node::monitor`]).
//!
//! Does not serve them: `crate::admin::serve` does.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::admin::AdminState;

/// Label of the allocation counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `matched`, `repeated` (the same container asked again), `single_gpu_fallback`,
    /// `no_candidate`, `patch_failed` (the API refused), `patch_unknown` (no answer in time),
    /// `mps_not_serving` (refused while the MPS control daemon does not serve), `held_back`
    /// (the pod's GPU is held back by the path's gate: another path serves it),
    /// `limit_spec_failed` (the CDI spec carrying the memory-limit hook could not be written).
    pub outcome: String,
}

/// Every metric the device plugin keeps.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Container allocations by outcome.
    pub allocations: Family<OutcomeLabel, Counter>,
    /// Allocate call latency in seconds.
    pub allocate_seconds: Histogram,
    /// Allocations kubelet recorded for another pod than the one matched, corrected.
    pub swaps_corrected: Counter,
    /// Mismatches between kubelet's record and the annotations that were only reported.
    pub mismatches_seen: Counter,
    /// Pods whose containers kubelet ran on devices of different GPUs (reported, never
    /// corrected).
    pub split_pods: Counter,
    /// 1 while registered with kubelet.
    pub registered: Gauge,
    /// Registrations with kubelet (1 + re-registrations after kubelet restarts).
    pub registrations: Counter,
}

impl Metrics {
    /// New metrics, registered with `admin`'s registry.
    pub fn new(admin: &AdminState) -> Self {
        let m = Metrics {
            allocations: Family::default(),
            allocate_seconds: Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
            swaps_corrected: Counter::default(),
            mismatches_seen: Counter::default(),
            split_pods: Counter::default(),
            registered: Gauge::default(),
            registrations: Counter::default(),
        };
        admin.with_registry(|r| {
            r.register(
                "gpushare_device_plugin_allocations",
                "Container allocations by outcome",
                m.allocations.clone(),
            );
            r.register(
                "gpushare_device_plugin_allocate_seconds",
                "Latency of kubelet Allocate calls",
                m.allocate_seconds.clone(),
            );
            r.register(
                "gpushare_device_plugin_swaps_corrected",
                "Allocations kubelet recorded for another pod than matched, corrected in the annotations",
                m.swaps_corrected.clone(),
            );
            r.register(
                "gpushare_device_plugin_mismatches_seen",
                "GPU mismatches between kubelet PodResources and pod annotations that were reported only",
                m.mismatches_seen.clone(),
            );
            r.register(
                "gpushare_device_plugin_split_pods",
                "Pods whose containers got devices of different GPUs; reported, not corrected",
                m.split_pods.clone(),
            );
            r.register(
                "gpushare_device_plugin_registered",
                "1 while registered with kubelet",
                m.registered.clone(),
            );
            r.register(
                "gpushare_device_plugin_registrations",
                "Registrations with kubelet",
                m.registrations.clone(),
            );
        });
        m
    }

    /// Counts one container allocation with `outcome`.
    pub fn allocation(&self, outcome: &str) {
        self.allocations
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Allocations counted with `outcome` so far.
    pub fn allocations_with(&self, outcome: &str) -> u64 {
        self.allocations
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .get()
    }
}
