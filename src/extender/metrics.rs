//! The extender's Prometheus metrics: requests and latency per verb and outcome, filter
//! rejections by reason, bind retries, and — refreshed from the ledger at every scrape —
//! total and allocated memory per node and GPU in bytes, pods held, assumed pods, the sync
//! state and whether this replica leads (so dashboards summing over replicas can keep to the
//! leader's numbers: `... * on(instance) gpushare_extender_leader`); binds whose outcome was
//! unknown and how reservations were settled; annotation values of ours that could not be
//! used; watch errors and whether the ledger is stale; requests answered with an error, by
//! the error's kind.
//!
//! Registered in the role's [`AdminState`] registry; rendering is `AdminState::render_metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use super::cache::Cache;
use crate::admin::AdminState;
use crate::core::MemoryUnit;

/// Labels of the request metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// filter | prioritize | bind | inspect.
    pub verb: &'static str,
    /// ok | rejected | error | bad_request | unavailable.
    pub outcome: &'static str,
}

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// filter | prioritize | bind.
    pub verb: &'static str,
    /// The error's kind (`VerbError::label`): bad_pod_request, no_fit, unknown_outcome, ….
    pub kind: &'static str,
}

/// Labels of the rejection counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// not_for_gpu_share | insufficient_in_one_device | larger_than_any_gpu | reserved_elsewhere.
    pub reason: &'static str,
}

/// Labels of the bad-annotation counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLabels {
    /// The annotation key.
    pub key: &'static str,
}

/// Labels of the watch error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLabels {
    /// pod | node | ConfigMap.
    pub watch: &'static str,
}

/// Labels of the settle counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SettleLabels {
    /// bound (confirmed from the API) | released.
    pub outcome: &'static str,
}

/// Labels of the per-GPU gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct GpuLabels {
    /// Node name.
    pub node: String,
    /// GPU index.
    pub gpu: String,
}

fn latency_histogram() -> Histogram {
    // 50 µs … ~3.3 s.
    Histogram::new(exponential_buckets(0.00005, 2.0, 17))
}

/// The metric handles.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// `gpushare_extender_requests_total{verb,outcome}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `gpushare_extender_request_duration_seconds{verb,outcome}`.
    pub latency: Family<RequestLabels, Histogram, fn() -> Histogram>,
    /// `gpushare_extender_errors_total{verb,kind}`: requests answered with an error.
    pub errors: Family<ErrorLabels, Counter>,
    /// `gpushare_extender_filter_rejections_total{reason}`.
    pub rejections: Family<ReasonLabels, Counter>,
    /// `gpushare_extender_bind_retries_total`.
    pub bind_retries: Counter,
    /// `gpushare_extender_bind_unknown_outcomes_total`: binds whose Binding may or may not
    /// have landed when the request's budget ran out (settled later by reading the API).
    pub bind_unknown: Counter,
    /// `gpushare_extender_reservations_settled_total{outcome}`: unknown outcomes settled.
    pub settled: Family<SettleLabels, Counter>,
    /// `gpushare_extender_bad_annotations_total{key}`: values of our annotations that could
    /// not be used (garbage, absurdly large), read as absent.
    pub bad_annotations: Family<KeyLabels, Counter>,
    /// `gpushare_extender_watch_errors_total{watch}`.
    pub watch_errors: Family<WatchLabels, Counter>,
    /// `gpushare_extender_ledger_stale`: 1 while a watch keeps failing (not ready).
    pub stale: Gauge,
    gpu_total: Family<GpuLabels, Gauge>,
    gpu_used: Family<GpuLabels, Gauge>,
    pods: Gauge,
    assumed: Gauge,
    nodes: Gauge,
    synced: Gauge,
    leader: Gauge,
}

impl Metrics {
    /// Counts one reservation settled with `outcome` (`bound` or `released`).
    pub(crate) fn count_settled(&self, outcome: &'static str) {
        self.settled.get_or_create(&SettleLabels { outcome }).inc();
    }

    /// Creates the metrics and registers them with `admin`.
    pub fn register(admin: &AdminState) -> Metrics {
        let m = Metrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            errors: Family::default(),
            rejections: Family::default(),
            bind_retries: Counter::default(),
            bind_unknown: Counter::default(),
            settled: Family::default(),
            bad_annotations: Family::default(),
            watch_errors: Family::default(),
            stale: Gauge::default(),
            gpu_total: Family::default(),
            gpu_used: Family::default(),
            pods: Gauge::default(),
            assumed: Gauge::default(),
            nodes: Gauge::default(),
            synced: Gauge::default(),
            leader: Gauge::default(),
        };
        admin.with_registry(|r| {
            r.register(
                "gpushare_extender_requests",
                "Scheduling and inspect requests by verb and outcome",
                m.requests.clone(),
            );
            r.register(
                "gpushare_extender_request_duration_seconds",
                "Time to answer a request, by verb and outcome",
                m.latency.clone(),
            );
            r.register(
                "gpushare_extender_errors",
                "Scheduling requests answered with an error, by verb and the error's kind",
                m.errors.clone(),
            );
            r.register(
                "gpushare_extender_filter_rejections",
                "Nodes rejected by filter, by reason",
                m.rejections.clone(),
            );
            r.register(
                "gpushare_extender_bind_retries",
                "API calls of bind retried after a transient error",
                m.bind_retries.clone(),
            );
            r.register(
                "gpushare_extender_bind_unknown_outcomes",
                "Binds whose Binding may or may not have landed when their budget ran out",
                m.bind_unknown.clone(),
            );
            r.register(
                "gpushare_extender_reservations_settled",
                "Reservations of unknown outcome settled by reading the API, by outcome",
                m.settled.clone(),
            );
            r.register(
                "gpushare_extender_bad_annotations",
                "Values of gpushare pod annotations that could not be used, by key",
                m.bad_annotations.clone(),
            );
            r.register(
                "gpushare_extender_watch_errors",
                "Errors of the pod, node and ConfigMap watches",
                m.watch_errors.clone(),
            );
            r.register(
                "gpushare_extender_ledger_stale",
                "1 while a watch has kept failing for longer than extender.watch_stale_after_ms",
                m.stale.clone(),
            );
            r.register(
                "gpushare_extender_gpu_memory_bytes",
                "GPU memory per node and GPU in bytes (the device plugin's units times its unit; GiB when the node declares none)",
                m.gpu_total.clone(),
            );
            r.register(
                "gpushare_extender_gpu_memory_allocated_bytes",
                "GPU memory held by pods per node and GPU in bytes",
                m.gpu_used.clone(),
            );
            r.register(
                "gpushare_extender_pods",
                "Pods holding GPU memory in the ledger",
                m.pods.clone(),
            );
            r.register(
                "gpushare_extender_assumed_pods",
                "Pods bound by the extender that the device plugin has not allocated yet",
                m.assumed.clone(),
            );
            r.register(
                "gpushare_extender_nodes",
                "Nodes known to the ledger",
                m.nodes.clone(),
            );
            r.register(
                "gpushare_extender_ledger_synced",
                "1 once the ledger holds a full sync of pods, nodes and ConfigMaps",
                m.synced.clone(),
            );
            r.register(
                "gpushare_extender_leader",
                "1 while this replica leads (or runs without leader election), 0 on a standby",
                m.leader.clone(),
            );
        });
        m
    }

    /// Counts one request and its duration.
    pub(crate) fn observe(&self, verb: &'static str, outcome: &'static str, seconds: f64) {
        let labels = RequestLabels { verb, outcome };
        self.requests.get_or_create(&labels).inc();
        self.latency.get_or_create(&labels).observe(seconds);
    }

    /// Counts one request answered with an error of `kind`.
    pub(crate) fn count_error(&self, verb: &'static str, kind: &'static str) {
        self.errors.get_or_create(&ErrorLabels { verb, kind }).inc();
    }

    /// Refreshes the ledger gauges (called at scrape time); `leader`: this replica serves the
    /// scheduling verbs.
    pub fn refresh(&self, cache: &Cache, synced: bool, leader: bool) {
        self.gpu_total.clear();
        self.gpu_used.clear();
        for (node, gpu, total, used, unit) in cache.gpu_rows() {
            let unit = unit.unwrap_or(MemoryUnit::GIB);
            let labels = GpuLabels {
                node,
                gpu: gpu.to_string(),
            };
            self.gpu_total
                .get_or_create(&labels)
                .set(clamp(unit.to_bytes(total)));
            self.gpu_used
                .get_or_create(&labels)
                .set(clamp(unit.to_bytes(used)));
        }
        let stats = cache.stats();
        self.pods.set(clamp(stats.pods as u64));
        self.assumed.set(clamp(stats.assumed as u64));
        self.nodes.set(clamp(stats.nodes as u64));
        self.synced.set(i64::from(synced));
        self.leader.set(i64::from(leader));
    }
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
