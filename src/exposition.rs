//! What a Prometheus scrape of any role gets: the format (text 0.0.4 unless the scraper asks
//! for OpenMetrics), the rendering of a prometheus-client registry in that format, and the
//! metrics every role carries: `gpushare_build_info{version,commit,target}` and the standard
//! `process_*` metrics read from `/proc/self`.
//!
//! prometheus-client writes OpenMetrics only; [`openmetrics_to_text`] turns that into the
//! Prometheus text format 0.0.4 that `promtool check metrics` and every Prometheus parses
//! (counters named `<name>_total` in HELP/TYPE, `info` as a gauge, no `# UNIT`, no `# EOF`).
//!
//! It does not serve HTTP (`crate::admin` and the extender's routes do) and defines no role
//! metrics.

use std::fmt::Write as _;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::buildinfo;

/// Content type of the Prometheus text format 0.0.4.
pub(crate) const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Content type of OpenMetrics 1.0.
pub(crate) const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The exposition format of one scrape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4 (the default).
    Text,
    /// OpenMetrics 1.0, when the scraper prefers it.
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header asks for: OpenMetrics when it names
    /// `application/openmetrics-text` with a quality at least that of `text/plain` (and above
    /// zero); otherwise text 0.0.4 (no header, `*/*`, anything else).
    pub(crate) fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let mut openmetrics = 0.0f32;
        let mut text = 0.0f32;
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.trim().strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "text/plain" => text = text.max(q),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }

    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => TEXT_CONTENT_TYPE,
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
        }
    }
}

/// `registry` in `format`.
pub fn render(registry: &Registry, format: Format) -> String {
    let mut om = String::new();
    // Writing into a String cannot fail; an encoder error would leave a partial page, which
    // the scraper reports, rather than no page.
    let _ = prometheus_client::encoding::text::encode(&mut om, registry);
    match format {
        Format::OpenMetrics => om,
        Format::Text => openmetrics_to_text(&om),
    }
}

/// Registers what every role exposes: build info and the process metrics.
pub(crate) fn register_common(registry: &mut Registry) {
    registry.register(
        "gpushare_build",
        "The gpushare build: version, git commit and target triple (value 1)",
        Info::new(vec![
            ("version", buildinfo::VERSION),
            ("commit", buildinfo::GIT_COMMIT),
            ("target", buildinfo::TARGET_TRIPLE),
        ]),
    );
    registry.register_collector(Box::new(ProcessCollector));
}

/// The OpenMetrics text prometheus-client writes, as Prometheus text format 0.0.4.
pub(crate) fn openmetrics_to_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<(&str, &str)> = None;
    // The family being written: its OpenMetrics name and type.
    let mut family: (&str, &str) = ("", "");
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (exposed, text_kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (name.to_string(), kind),
                "gaugehistogram" => (name.to_string(), "histogram"),
                "stateset" => (name.to_string(), "gauge"),
                _ => (name.to_string(), "untyped"),
            };
            if let Some((help_name, text)) = help.take()
                && help_name == name
            {
                let _ = writeln!(out, "# HELP {exposed} {text}");
            }
            let _ = writeln!(out, "# TYPE {exposed} {text_kind}");
            family = (name, kind);
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        // A sample: drop counters' `_created` and any exemplar (` # {...} value`).
        let sample_name = line.split(['{', ' ']).next().unwrap_or("");
        if family.1 == "counter" && sample_name.strip_prefix(family.0) == Some("_created") {
            continue;
        }
        let sample = match line.find(" # {") {
            Some(at) => &line[..at],
            None => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// The process metrics of the Prometheus client libraries, from `/proc/self` at scrape time.
#[derive(Debug)]
struct ProcessCollector;

/// USER_HZ, the unit of the CPU times in `/proc/<pid>/stat`: 100 on every Linux architecture
/// we build for (Prometheus's own procfs reader fixes it to 100 too).
const USER_HZ: f64 = 100.0;

#[derive(Debug, Default, PartialEq)]
struct ProcessSample {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<i64>,
    virtual_bytes: Option<i64>,
    open_fds: Option<i64>,
    max_fds: Option<i64>,
    start_time_seconds: Option<f64>,
}

impl ProcessSample {
    fn read() -> ProcessSample {
        let stat = std::fs::read_to_string("/proc/self/stat").ok();
        let status = std::fs::read_to_string("/proc/self/status").ok();
        let limits = std::fs::read_to_string("/proc/self/limits").ok();
        let boot = std::fs::read_to_string("/proc/stat").ok();
        let fields = stat.as_deref().map(stat_fields).unwrap_or_default();
        let field = |n: usize| fields.get(n).and_then(|f| f.parse::<u64>().ok());
        // Fields after the command: index 0 is field 3 (state) of proc(5).
        let cpu_seconds = match (field(11), field(12)) {
            (Some(utime), Some(stime)) => Some((utime + stime) as f64 / USER_HZ),
            _ => None,
        };
        let btime = boot.as_deref().and_then(|b| {
            b.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        });
        let start_time_seconds = match (btime, field(19)) {
            (Some(btime), Some(ticks)) => Some(btime as f64 + ticks as f64 / USER_HZ),
            _ => None,
        };
        ProcessSample {
            cpu_seconds,
            resident_bytes: status.as_deref().and_then(|s| status_kib(s, "VmRSS:")),
            virtual_bytes: status.as_deref().and_then(|s| status_kib(s, "VmSize:")),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|d| i64::try_from(d.count()).unwrap_or(i64::MAX)),
            max_fds: limits.as_deref().and_then(max_open_files),
            start_time_seconds,
        }
    }
}

/// The fields of `/proc/self/stat` after `(comm)` (which may contain spaces and parentheses).
fn stat_fields(stat: &str) -> Vec<&str> {
    match stat.rfind(')') {
        Some(at) => stat[at + 1..].split_whitespace().collect(),
        None => Vec::new(),
    }
}

/// A `Key:   123 kB` line of `/proc/self/status`, in bytes.
fn status_kib(status: &str, key: &str) -> Option<i64> {
    let line = status.lines().find_map(|l| l.strip_prefix(key))?;
    let kib: i64 = line.split_whitespace().next()?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The soft limit of `Max open files` in `/proc/self/limits`.
fn max_open_files(limits: &str) -> Option<i64> {
    let line = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    match line.split_whitespace().next()? {
        "unlimited" => Some(i64::MAX),
        soft => soft.parse().ok(),
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = ProcessSample::read();
        if let Some(v) = s.cpu_seconds {
            let m = ConstCounter::new(v);
            m.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                m.metric_type(),
            )?)?;
        }
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                s.max_fds,
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                let m = ConstGauge::new(v);
                m.encode(encoder.encode_descriptor(name, help, None, m.metric_type())?)?;
            }
        }
        if let Some(v) = s.start_time_seconds {
            let m = ConstGauge::new(v);
            m.encode(encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                None,
                m.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn accept_headers_choose_the_format() {
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Text);
        // What Prometheus 2.x sends.
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            )),
            Format::OpenMetrics
        );
        // Prometheus with scrape_protocols preferring text.
        assert_eq!(
            Format::negotiate(Some(
                "text/plain;version=0.0.4;q=1,application/openmetrics-text;version=1.0.0;q=0.5"
            )),
            Format::Text
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Text
        );
    }

    #[test]
    fn openmetrics_becomes_text_0_0_4() {
        let mut r = Registry::default();
        let c: Counter = Counter::default();
        c.inc();
        r.register("jobs", "Jobs done", c);
        r.register("build", "Build", Info::new(vec![("version", "1.2.3")]));
        let h = Histogram::new([0.5]);
        h.observe(0.1);
        r.register("wait_seconds", "Waits", h);
        let text = render(&r, Format::Text);
        assert_eq!(
            text,
            "# HELP jobs_total Jobs done.\n# TYPE jobs_total counter\njobs_total 1\n\
             # HELP build_info Build.\n# TYPE build_info gauge\nbuild_info{version=\"1.2.3\"} 1\n\
             # HELP wait_seconds Waits.\n# TYPE wait_seconds histogram\n\
             wait_seconds_sum 0.1\nwait_seconds_count 1\n\
             wait_seconds_bucket{le=\"0.5\"} 1\nwait_seconds_bucket{le=\"+Inf\"} 1\n"
        );
        let om = render(&r, Format::OpenMetrics);
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert!(om.contains("# TYPE jobs counter\n"), "{om}");
    }

    #[test]
    fn created_samples_and_exemplars_are_dropped() {
        let om = "# HELP x Some.\n# TYPE x counter\nx_total 3 # {trace=\"a\"} 1.0\nx_created 17.0\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(om),
            "# HELP x_total Some.\n# TYPE x_total counter\nx_total 3\n"
        );
    }

    #[test]
    fn process_sample_reads_proc() {
        let s = ProcessSample::read();
        assert!(s.resident_bytes.is_some_and(|b| b > 0), "{s:?}");
        assert!(s.open_fds.is_some_and(|n| n > 0), "{s:?}");
        assert!(s.cpu_seconds.is_some(), "{s:?}");
        assert!(s.start_time_seconds.is_some_and(|t| t > 1.0e9), "{s:?}");
        assert!(s.max_fds.is_some_and(|n| n > 0), "{s:?}");
    }

    #[test]
    fn proc_parsers() {
        assert_eq!(stat_fields("42 (a) b) c) S 1 2"), vec!["S", "1", "2"]);
        assert_eq!(stat_fields("garbage"), Vec::<&str>::new());
        assert_eq!(
            status_kib("VmRSS:\t  2048 kB\n", "VmRSS:"),
            Some(2048 * 1024)
        );
        assert_eq!(status_kib("VmRSS: x kB\n", "VmRSS:"), None);
        assert_eq!(
            max_open_files(
                "Max open files            1024                 524288               files\n"
            ),
            Some(1024)
        );
        assert_eq!(
            max_open_files("Max open files unlimited unlimited files\n"),
            Some(i64::MAX)
        );
    }
}
