//! The real-world corpus (`tests/fixtures/realdata/`, copied from `../shared/realdata/`, every
//! file with its `.source`): every file of every category is run through the parser or check
//! that reads it in production and compared with what a careful tool concludes, as written in
//! `EXPECTED.json` (per file) and, for nvidia-smi XML and kernel logs, `DERIVED.json` (values
//! extracted by Python's ElementTree and `re`, `derive.py`, never by our parsers). The kernel
//! logs are replayed through the configurable kernel-log source (`--kmsg-path`, a file and a
//! FIFO) with the GPU set of `REPLAY.json`. The device plugin is run over the corpus' MIG
//! outputs (MIG GPUs not advertised, `gpushare.io/excluded-gpus` saying why) and fed the
//! GB200 NVLink Xid (counted, marks no GPU).
//!
//! A file added to the corpus is picked up without code changes: the walk fails until it has
//! an expectation (and, for XML and logs, a `derive.py` run).

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare::config::{Config, GpuBackendKind, GpuConfig};
use gpushare::doctor::gpus::{self, Probe};
use gpushare::doctor::host::HostRoot;
use gpushare::doctor::report::{Check, Status};
use gpushare::doctor::{runtime, scheduler};
use gpushare::gpu::nvidia_smi::{NvidiaSmiBackend, NvidiaSmiOptions, parse_xml};
use gpushare::gpu::{ExclusionReason, GpuBackend, HealthEvent, Inventory};
use gpushare::node::health::HealthTracker;
use serde_json::Value;

use crate::support::extender_http::request;
use crate::support::extender_sandbox::{self, Env};
use crate::support::fixture;
use crate::support::wait::wait_until_within;

/// Hang guard for one awaited event; never a timing assertion.
const EVENT_DEADLINE: Duration = Duration::from_secs(30);

const CATEGORIES: [&str; 8] = [
    "nvidia-smi-xml",
    "kmsg-xid",
    "docker-daemon",
    "containerd",
    "crio",
    "scheduler-config",
    "driver-version",
    "extender-args",
];

fn corpus() -> PathBuf {
    fixture("realdata")
}

fn json_file(name: &str) -> Value {
    let path = corpus().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The data files of `category` (not the `.source` sidecars), sorted, as `category/name` keys.
fn files(category: &str) -> Vec<(String, PathBuf)> {
    let dir = corpus().join(category);
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_none_or(|x| x != "source"))
        .map(|p| {
            let name = p.file_name().expect("name").to_string_lossy().into_owned();
            (format!("{category}/{name}"), p)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "{category} is empty");
    out
}

fn entry<'a>(table: &'a Value, key: &str, table_name: &str) -> &'a Value {
    table.get(key).unwrap_or_else(|| {
        panic!("{key} has no entry in {table_name}: describe the new file there")
    })
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

fn status_name(s: Status) -> &'static str {
    match s {
        Status::Ok => "ok",
        Status::Warn => "warn",
        Status::Fail => "fail",
        Status::Skip => "skip",
    }
}

/// Checks a doctor check against an EXPECTED entry's `status`, `mention`, `mention_any` and
/// `forbid` (regexes over detail + hint).
fn assert_check(key: &str, check: &Check, exp: &Value) {
    let text = format!("{}\n{}", check.detail, check.hint);
    let lower = text.to_lowercase();
    let statuses = strings(exp.get("status"));
    assert!(
        statuses.iter().any(|s| s == status_name(check.status)),
        "{key}: status {:?}, expected one of {statuses:?}\n{text}",
        check.status
    );
    for m in strings(exp.get("mention")) {
        assert!(
            lower.contains(&m.to_lowercase()),
            "{key}: {m:?} not in\n{text}"
        );
    }
    let any = strings(exp.get("mention_any"));
    if !any.is_empty() {
        assert!(
            any.iter().any(|m| lower.contains(&m.to_lowercase())),
            "{key}: none of {any:?} in\n{text}"
        );
    }
    for f in strings(exp.get("forbid")) {
        let re = regex::RegexBuilder::new(&f)
            .case_insensitive(true)
            .build()
            .expect("forbid regex");
        assert!(!re.is_match(&text), "{key}: /{f}/ matches\n{text}");
    }
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    write(&path, &format!("#!/bin/sh\n{body}\n"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

// ------------------------------------------------------------------ the corpus itself

#[test]
fn every_file_has_its_source_and_an_expectation() {
    let expected = json_file("EXPECTED.json");
    let derived = json_file("DERIVED.json");
    let replay = json_file("REPLAY.json");
    let mut seen = BTreeSet::new();
    for category in CATEGORIES {
        for (key, path) in files(category) {
            let source = PathBuf::from(format!("{}.source", path.display()));
            let provenance = std::fs::read_to_string(&source)
                .unwrap_or_else(|e| panic!("{key}: no provenance {}: {e}", source.display()));
            assert!(!provenance.trim().is_empty(), "{key}: empty .source");
            entry(&expected, &key, "EXPECTED.json");
            if matches!(category, "nvidia-smi-xml" | "kmsg-xid") {
                entry(&derived, &key, "DERIVED.json (run derive.py)");
            }
            if category == "kmsg-xid" {
                entry(&replay, &key, "REPLAY.json");
            }
            seen.insert(key);
        }
    }
    let described: BTreeSet<String> = expected
        .as_object()
        .expect("object")
        .keys()
        .filter(|k| !k.starts_with('_'))
        .cloned()
        .collect();
    let missing: Vec<_> = described.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "described but not in the corpus: {missing:?}"
    );
    assert_eq!(
        seen.len(),
        127,
        "the corpus had 127 files when this was written"
    );
}

// ------------------------------------------------------------------ nvidia-smi XML

struct DerivedGpu {
    index: u32,
    uuid: String,
    name: String,
    mib: u64,
    mig: bool,
}

fn derived_gpus(d: &Value) -> Vec<DerivedGpu> {
    d.get("gpus")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|g| DerivedGpu {
            index: g["index"].as_u64().expect("index") as u32,
            uuid: g["uuid"].as_str().expect("uuid").to_string(),
            name: g["name"].as_str().expect("name").to_string(),
            mib: g["mib"].as_u64().expect("mib"),
            mig: g["mig"].as_bool().expect("mig"),
        })
        .collect()
}

#[test]
fn nvidia_smi_xml_yields_exactly_the_derived_gpus() {
    let expected = json_file("EXPECTED.json");
    let derived = json_file("DERIVED.json");
    for (key, path) in files("nvidia-smi-xml") {
        let exp = entry(&expected, &key, "EXPECTED.json");
        let d = entry(&derived, &key, "DERIVED.json");
        let text = std::fs::read_to_string(&path).expect("read");
        let result = parse_xml(&text);
        if d.get("error").is_some() {
            let err = result.expect_err(&key).to_string();
            assert!(!err.is_empty(), "{key}");
            continue;
        }
        if let Some(dup) = d.get("duplicate_uuid").and_then(Value::as_str) {
            let err = result
                .expect_err(&format!("{key}: duplicate UUIDs must be refused"))
                .to_string();
            assert!(
                err.contains("same UUID") && err.contains(dup),
                "{key}: {err}"
            );
            continue;
        }
        let inv = result.unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(
            inv.driver_version,
            d["driver"].as_str().expect("driver"),
            "{key}"
        );
        let gpus = derived_gpus(d);
        let offered: Vec<_> = gpus.iter().filter(|g| !g.mig).collect();
        assert_eq!(inv.devices.len(), offered.len(), "{key}: {inv:?}");
        for (dev, want) in inv.devices.iter().zip(&offered) {
            assert_eq!(dev.index, want.index, "{key}");
            assert_eq!(dev.uuid, want.uuid, "{key}");
            assert_eq!(dev.name, want.name, "{key}");
            assert_eq!(dev.memory_bytes, want.mib << 20, "{key}");
        }
        let mig: Vec<(u32, &str)> = gpus
            .iter()
            .filter(|g| g.mig)
            .map(|g| (g.index, g.uuid.as_str()))
            .collect();
        let excluded_mig: Vec<(u32, &str)> = inv
            .excluded
            .iter()
            .filter(|g| g.reason == ExclusionReason::MigEnabled)
            .map(|g| (g.index, g.uuid.as_str()))
            .collect();
        assert_eq!(excluded_mig, mig, "{key}: MIG GPUs must be left out");
        if exp.get("negative").and_then(Value::as_bool) == Some(true) {
            assert!(inv.devices.is_empty(), "{key}: a negative offers nothing");
        }
    }
}

fn smi_config(program: &Path) -> GpuConfig {
    GpuConfig {
        backend: GpuBackendKind::NvidiaSmi,
        nvidia_smi: program.display().to_string(),
        kmsg_path: String::new(),
        ..GpuConfig::default()
    }
}

#[tokio::test]
async fn doctor_reads_every_nvidia_smi_output_through_a_fake_nvidia_smi() {
    let derived = json_file("DERIVED.json");
    let dir = tempfile::tempdir().expect("tempdir");
    let empty_root = HostRoot::new(dir.path().join("root"));
    for (key, path) in files("nvidia-smi-xml") {
        let d = entry(&derived, &key, "DERIVED.json");
        let program = script(
            dir.path(),
            "nvidia-smi",
            &format!("cat '{}'", path.display()),
        );
        let config = smi_config(&program);
        let probe = gpus::probe(&config).await;
        let access = gpus::gpu_access(&probe, &config);
        let detail = &access.detail;
        let gpus_here = derived_gpus(d);
        let offered: Vec<_> = gpus_here.iter().filter(|g| !g.mig).collect();
        if d.get("error").is_some() || (offered.is_empty() && gpus_here.is_empty()) {
            assert_eq!(access.status, Status::Fail, "{key}: {detail}");
            assert!(detail.contains("nvidia-smi"), "{key}: {detail}");
            continue;
        }
        if let Some(dup) = d.get("duplicate_uuid").and_then(Value::as_str) {
            assert_eq!(access.status, Status::Fail, "{key}: {detail}");
            assert!(
                detail.contains("duplicate") && detail.contains(dup),
                "{key}: {detail}"
            );
            assert!(access.hint.contains("own UUID"), "{key}: {}", access.hint);
            continue;
        }
        let driver = d["driver"].as_str().expect("driver");
        let shown = if driver.is_empty() { "unknown" } else { driver };
        assert!(
            detail.contains(&format!("driver {shown}")),
            "{key}: {detail}"
        );
        for g in &offered {
            let line = format!("GPU {}: {}, {} MiB, {}", g.index, g.name, g.mib, g.uuid);
            assert!(
                detail.lines().any(|l| l == line),
                "{key}: {line:?} in\n{detail}"
            );
        }
        if gpus_here.iter().any(|g| g.mig) {
            assert!(detail.contains("MIG"), "{key}: {detail}");
            let want = if offered.is_empty() {
                Status::Fail
            } else {
                Status::Warn
            };
            assert_eq!(access.status, want, "{key}: {detail}");
            assert!(access.hint.contains("MIG"), "{key}: {}", access.hint);
        } else {
            assert_eq!(access.status, Status::Ok, "{key}: {detail}");
        }
        let version = gpus::driver_version(&empty_root, &probe);
        if driver.is_empty() {
            assert_eq!(version.status, Status::Warn, "{key}: {version:?}");
            assert!(version.detail.contains("unknown"), "{key}: {version:?}");
        } else {
            // Every driver in the corpus is 361.93 or newer.
            assert_eq!(version.status, Status::Ok, "{key}: {version:?}");
            assert!(version.detail.starts_with(driver), "{key}: {version:?}");
        }
    }
}

// ------------------------------------------------------------------ kernel logs

/// `0019:01:00` -> `00000019:01:00.0`, as nvidia-smi prints a bus id.
fn smi_bus_id(pci: &str) -> String {
    let (domain, rest) = pci.split_once(':').expect("domain:bus:dev");
    format!("0000{domain}:{rest}.0").to_uppercase()
}

fn replay_uuid(i: usize) -> String {
    format!("GPU-00000000-0000-0000-0000-{i:012}")
}

/// nvidia-smi XML listing one GPU per address of `gpus`.
fn replay_xml(gpus: &[String]) -> String {
    let mut xml = String::from(
        "<?xml version=\"1.0\" ?>\n<nvidia_smi_log>\n<driver_version>550.54.15</driver_version>\n",
    );
    for (i, pci) in gpus.iter().enumerate() {
        let bus = smi_bus_id(pci);
        xml.push_str(&format!(
            "<gpu id=\"{bus}\"><product_name>Replay GPU</product_name><uuid>{}</uuid>\
             <minor_number>{i}</minor_number><pci><pci_bus_id>{bus}</pci_bus_id></pci>\
             <fb_memory_usage><total>16384 MiB</total></fb_memory_usage></gpu>\n",
            replay_uuid(i)
        ));
    }
    xml.push_str("</nvidia_smi_log>\n");
    xml
}

const SENTINEL_XID: u64 = 999_999;

/// Events from the backend until the sentinel XID (appended after the recorded lines, so
/// everything before it has been read).
async fn events_until_sentinel(
    rx: &mut tokio::sync::mpsc::Receiver<HealthEvent>,
    key: &str,
) -> Vec<HealthEvent> {
    let mut out = Vec::new();
    loop {
        let ev = tokio::time::timeout(EVENT_DEADLINE, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{key}: the sentinel never arrived; got {out:?}"))
            .unwrap_or_else(|| panic!("{key}: channel closed; got {out:?}"));
        match ev {
            HealthEvent::Xid { xid, .. } if xid == SENTINEL_XID => return out,
            HealthEvent::Lost { .. } => {}
            other => out.push(other),
        }
    }
}

struct Replay {
    gpus: Vec<String>,
    xids: Vec<(String, u64)>,
    unhealthy: BTreeSet<String>,
}

fn replay_case(key: &str) -> Replay {
    let r = entry(&json_file("REPLAY.json"), key, "REPLAY.json").clone();
    let d = entry(&json_file("DERIVED.json"), key, "DERIVED.json").clone();
    Replay {
        gpus: strings(r.get("gpus")),
        xids: d["xids"]
            .as_array()
            .expect("xids")
            .iter()
            .map(|x| {
                (
                    x[0].as_str().expect("pci").to_string(),
                    x[1].as_u64().expect("xid"),
                )
            })
            .collect(),
        unhealthy: strings(r.get("unhealthy")).into_iter().collect(),
    }
}

impl Replay {
    fn uuid_of(&self, pci: &str) -> Option<String> {
        self.gpus.iter().position(|g| g == pci).map(replay_uuid)
    }

    /// Each derived XID as the event it must become: its GPU's, or unattributed.
    fn expected_events(&self) -> Vec<HealthEvent> {
        self.xids
            .iter()
            .map(|(pci, xid)| match self.uuid_of(pci) {
                Some(uuid) => HealthEvent::Xid {
                    uuid: Some(uuid),
                    xid: *xid,
                },
                None => HealthEvent::Unattributed {
                    pci: pci.clone(),
                    xid: *xid,
                },
            })
            .collect()
    }

    fn check(&self, key: &str, got: Vec<HealthEvent>) {
        let got: Vec<HealthEvent> = got
            .into_iter()
            .map(|e| match e {
                HealthEvent::Unattributed { pci, xid } => HealthEvent::Unattributed {
                    pci: pci.to_lowercase(),
                    xid,
                },
                other => other,
            })
            .collect();
        assert_eq!(got, self.expected_events(), "{key}");
        let mut tracker = HealthTracker::new(
            (0..self.gpus.len()).map(replay_uuid),
            Duration::from_secs(300),
        );
        let now = tokio::time::Instant::now();
        for e in &got {
            tracker.apply(e, now);
        }
        let down: BTreeSet<String> = tracker.unhealthy().into_iter().collect();
        let want: BTreeSet<String> = self
            .unhealthy
            .iter()
            .map(|pci| {
                self.uuid_of(pci)
                    .expect("an unhealthy GPU is in the inventory")
            })
            .collect();
        assert_eq!(down, want, "{key}: unhealthy GPUs");
    }

    fn backend(&self, dir: &Path, kmsg: &Path) -> NvidiaSmiBackend {
        let xml = dir.join("replay.xml");
        write(&xml, &replay_xml(&self.gpus));
        let program = script(dir, "nvidia-smi", &format!("cat '{}'", xml.display()));
        let config = GpuConfig {
            kmsg_path: kmsg.display().to_string(),
            kmsg_replay: true,
            ..smi_config(&program)
        };
        let mut options = NvidiaSmiOptions::from_config(&config);
        options.poll_interval = Duration::from_secs(3600);
        NvidiaSmiBackend::open(options).expect("the replay nvidia-smi works")
    }

    fn sentinel(&self) -> String {
        let first = self.gpus.first().expect("a GPU");
        format!("NVRM: Xid (PCI:{first}): {SENTINEL_XID}, end of replay\n")
    }
}

#[tokio::test]
async fn recorded_kernel_logs_replay_from_a_file_and_mark_the_right_gpus() {
    for (key, path) in files("kmsg-xid") {
        let case = replay_case(&key);
        let dir = tempfile::tempdir().expect("tempdir");
        let kmsg = dir.path().join("kmsg.log");
        let mut text = std::fs::read_to_string(&path).expect("read");
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&case.sentinel());
        write(&kmsg, &text);
        let backend = case.backend(dir.path(), &kmsg);
        let mut rx = backend.watch_health().expect("watch");
        let got = events_until_sentinel(&mut rx, &key).await;
        case.check(&key, got);
    }
}

#[tokio::test]
async fn a_fifo_feeds_the_kernel_log_source() {
    let key = "kmsg-xid/xid-lines-from-issues.txt";
    let case = replay_case(key);
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("kmsg.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let backend = case.backend(dir.path(), &fifo);
    // The reader is open (non-blocking) before anything is written, as on a host where
    // `journalctl -kf > fifo` starts later.
    let mut rx = backend.watch_health().expect("watch");
    let mut text = std::fs::read_to_string(corpus().join(key)).expect("read");
    text.push_str(&case.sentinel());
    let writer = std::thread::spawn(move || {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo)
            .expect("open the FIFO for writing");
        f.write_all(text.as_bytes()).expect("write");
    });
    let got = events_until_sentinel(&mut rx, key).await;
    writer.join().expect("writer");
    case.check(key, got);
}

// ------------------------------------------------------------------ container runtimes

/// Where the NVIDIA Container Toolkit, runc and crun install themselves (EXPECTED.json
/// `_rules.container-runtime`): empty executables in every test root.
const INSTALLED: &[&str] = &[
    "/usr/bin/nvidia-container-runtime",
    "/usr/bin/nvidia-container-runtime.cdi",
    "/usr/bin/nvidia-container-runtime.legacy",
    "/usr/bin/nvidia-container-runtime-hook",
    "/usr/bin/nvidia-container-toolkit",
    "/usr/bin/nvidia-ctk",
    "/usr/bin/runc",
    "/usr/bin/crun",
    "/usr/local/bin/crun",
    "/usr/local/nvidia/toolkit/nvidia-container-runtime",
    "/run/current-system/sw/bin/nvidia-container-runtime",
    "/run/current-system/sw/bin/nvidia-container-runtime.cdi",
    "/usr/libexec/crio/conmon",
];

fn runtime_root(place: &str, text: &str, exp: &Value, bins: &[String]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let at = |p: &str| dir.path().join(p.trim_start_matches('/'));
    for bin in INSTALLED
        .iter()
        .copied()
        .chain(bins.iter().map(String::as_str))
    {
        write(&at(bin), "");
        std::fs::set_permissions(at(bin), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    write(&at(place), text);
    for extra in exp
        .get("extra")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let path = extra["path"].as_str().expect("extra path");
        let body = match (extra.get("text"), extra.get("from")) {
            (Some(t), _) => t.as_str().expect("text").to_string(),
            (None, Some(from)) => {
                std::fs::read_to_string(corpus().join(from.as_str().expect("from"))).expect("from")
            }
            _ => panic!("extra without text or from"),
        };
        write(&at(path), &body);
    }
    dir
}

/// A handlebars template rendered the way EXPECTED.json's rule says: `{{#…}}…{{/…}}` blocks
/// dropped (optional settings unset), other `{{…}}` replaced by a literal.
fn render_handlebars(text: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let before = &rest[..start];
        if depth == 0 {
            out.push_str(before);
        }
        let Some(end) = rest[start..].find("}}") else {
            break;
        };
        let tag = &rest[start + 2..start + end];
        let tag = tag.trim_start_matches('{').trim_start_matches('~');
        if tag.starts_with('#') {
            depth += 1;
        } else if tag.starts_with('/') {
            depth = depth.saturating_sub(1);
        } else if depth == 0 {
            out.push_str("rendered");
        }
        rest = &rest[start + end + 2..];
        rest = rest.strip_prefix('}').unwrap_or(rest);
    }
    if depth == 0 {
        out.push_str(rest);
    }
    out
}

#[test]
fn every_runtime_configuration_gets_the_verdict_its_engine_would() {
    let expected = json_file("EXPECTED.json");
    let mut checked = 0;
    for category in ["docker-daemon", "containerd", "crio"] {
        for (key, path) in files(category) {
            let exp = entry(&expected, &key, "EXPECTED.json");
            let place = exp["place"].as_str().expect("place");
            let text = std::fs::read_to_string(&path).expect("read");
            let root = runtime_root(place, &text, exp, &[]);
            let check = runtime::check(&HostRoot::new(root.path()));
            assert_check(&key, &check, exp);
            if let Some(rendered) = exp.get("rendered") {
                let place = rendered["place"].as_str().expect("place");
                let bins = strings(rendered.get("bins"));
                let root = runtime_root(place, &render_handlebars(&text), rendered, &bins);
                let check = runtime::check(&HostRoot::new(root.path()));
                assert_check(&format!("{key} (rendered)"), &check, rendered);
                assert!(
                    !check.hint.contains("nvidia-ctk") && !check.hint.contains("systemctl"),
                    "{key}: no such commands on Bottlerocket: {}",
                    check.hint
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 41);
}

#[test]
fn a_bottlerocket_template_at_the_config_path_fails_without_impossible_fixes() {
    let key = "containerd/bottlerocket-k8s-nvidia-v2.toml.hbs";
    let text = std::fs::read_to_string(corpus().join(key)).expect("read");
    let root = runtime_root("/etc/containerd/config.toml", &text, &Value::Null, &[]);
    let check = runtime::check(&HostRoot::new(root.path()));
    assert_eq!(check.status, Status::Fail, "{check:?}");
    assert!(check.detail.contains("template"), "{check:?}");
    assert!(
        !check.hint.contains("nvidia-ctk") && !check.hint.contains("systemctl"),
        "{}",
        check.hint
    );
    assert!(check.hint.contains("Bottlerocket"), "{}", check.hint);
}

// ------------------------------------------------------------------ driver versions

#[test]
fn every_driver_version_file_is_read_and_judged() {
    let expected = json_file("EXPECTED.json");
    let fake = Probe {
        configured: GpuBackendKind::Fake,
        result: Ok(Inventory {
            backend: "fake",
            driver_version: "fake".to_string(),
            devices: Vec::new(),
            excluded: Vec::new(),
        }),
        notes: Vec::new(),
    };
    for (key, path) in files("driver-version") {
        let exp = entry(&expected, &key, "EXPECTED.json");
        let dir = tempfile::tempdir().expect("tempdir");
        let text = std::fs::read_to_string(&path).expect("read");
        write(&dir.path().join("proc/driver/nvidia/version"), &text);
        let version = exp["version"].as_str().expect("version");
        assert_eq!(
            gpus::proc_driver_version(&text).as_deref(),
            Some(version),
            "{key}"
        );
        let check = gpus::driver_version(&HostRoot::new(dir.path()), &fake);
        assert!(check.detail.contains(version), "{key}: {check:?}");
        assert_check(&key, &check, exp);
    }
}

// ------------------------------------------------------------------ scheduler configurations

/// The urlPrefix of the extender managing aliyun.com/gpu-mem, found in the raw text (JSON or
/// YAML) without a YAML parser: the first urlPrefix before a `aliyun.com/gpu-mem`.
fn gpushare_url_in(text: &str) -> Option<String> {
    let at = text.find("aliyun.com/gpu-mem")?;
    let re = regex::Regex::new(r#""?urlPrefix"?\s*:\s*"?([^"\s,]+)"?"#).expect("regex");
    re.captures_iter(&text[..at])
        .last()
        .map(|c| c[1].to_string())
}

#[test]
fn every_scheduler_configuration_is_judged_like_kube_scheduler() {
    let expected = json_file("EXPECTED.json");
    for (key, path) in files("scheduler-config") {
        let exp = entry(&expected, &key, "EXPECTED.json");
        let dir = tempfile::tempdir().expect("tempdir");
        let host = HostRoot::new(dir.path());
        let manifest = exp.get("manifest").and_then(Value::as_bool) == Some(true);
        let (check, url) = if manifest {
            write(
                &host.path(scheduler::SCHEDULER_MANIFEST),
                &std::fs::read_to_string(&path).expect("read"),
            );
            for extra in exp
                .get("extra")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let from = corpus().join(extra["from"].as_str().expect("from"));
                write(
                    &host.path(extra["path"].as_str().expect("path")),
                    &std::fs::read_to_string(from).expect("read"),
                );
            }
            scheduler::scheduler_config(&host, None, None)
        } else {
            scheduler::scheduler_config(&host, Some(&path), None)
        };
        assert_check(&key, &check, exp);
        let gpushare = exp["gpushare"].as_bool().expect("gpushare");
        if gpushare {
            let source = if manifest {
                corpus().join(exp["extra"][0]["from"].as_str().expect("from"))
            } else {
                path.clone()
            };
            let want = gpushare_url_in(&std::fs::read_to_string(source).expect("read"));
            assert!(want.is_some(), "{key}: the test found no urlPrefix");
            assert_eq!(url, want, "{key}");
            let u = url.as_deref().unwrap_or_default();
            assert!(
                check.detail.contains(u),
                "{key}: {u} not in {}",
                check.detail
            );
        } else {
            assert_eq!(url, None, "{key}");
            let not_a_config = exp.get("not_a_config").and_then(Value::as_bool) == Some(true);
            let says_missing = check.detail.contains("the gpushare extender is not in it");
            let says_not_config = check.detail.contains("not a KubeSchedulerConfiguration")
                || check.detail.contains("none a KubeSchedulerConfiguration");
            assert!(
                says_missing || (not_a_config && says_not_config),
                "{key}: must say the gpushare extender is missing:\n{}",
                check.detail
            );
        }
    }
}

// ------------------------------------------------------------------ extender bodies

/// A POST of `body` (a GET when it is empty) to the extender at `addr`.
async fn post_raw(addr: std::net::SocketAddr, path: &str, body: Vec<u8>) -> (u16, String) {
    let method = if body.is_empty() {
        http::Method::GET
    } else {
        http::Method::POST
    };
    request(addr, method, path, body).await
}

/// The response files describe themselves: a check of the check's reading of them.
fn validate_response(key: &str, kind: &str, v: &Value) {
    let has = |v: &Value, keys: &[&str]| {
        v.as_object()
            .is_some_and(|o| keys.iter().all(|k| o.contains_key(*k)))
    };
    match kind {
        "filter-result" => assert!(has(v, &["NodeNames", "FailedNodes", "Error"]), "{key}"),
        "filter-result-map" => {
            let map = v.as_object().expect("a map");
            assert!(!map.is_empty(), "{key}");
            for result in map.values() {
                let result: Value = match result {
                    Value::String(s) => serde_json::from_str(s).expect("an encoded result"),
                    other => other.clone(),
                };
                assert!(
                    has(&result, &["Nodes", "FailedNodes", "Error"]),
                    "{key}: {result}"
                );
            }
        }
        "binding-result" => assert!(has(v, &["Error"]), "{key}"),
        "preemption-result" => assert!(has(v, &["NodeNameToMetaVictims"]), "{key}"),
        "host-priority" => assert!(has(v, &["Host", "Score"]), "{key}"),
        other => panic!("{key}: unknown validator {other}"),
    }
}

#[tokio::test]
async fn every_extender_body_gets_the_answer_kube_scheduler_expects() {
    let expected = json_file("EXPECTED.json");
    let env = Env::start_with(extender_sandbox::config(), |_| {}).await;
    let addr = env.addr();
    for (key, path) in files("extender-args") {
        let exp = entry(&expected, &key, "EXPECTED.json");
        let body = std::fs::read(&path).expect("read");
        if let Some(kind) = exp.get("validate").and_then(Value::as_str) {
            let v: Value = serde_json::from_slice(&body).expect("valid JSON");
            validate_response(&key, kind, &v);
        }
        for post in exp["post"].as_array().expect("post") {
            let verb = post["verb"].as_str().expect("verb");
            let (status, text) =
                post_raw(addr, &format!("/gpushare-scheduler/{verb}"), body.clone()).await;
            let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let what = format!("{key} -> {verb}: {status} {text}");
            match post["expect"].as_str().expect("expect") {
                "filter-ok" => {
                    assert_eq!(status, 200, "{what}");
                    assert_eq!(answer["Error"].as_str(), Some(""), "{what}");
                    let names = strings(answer.get("NodeNames"));
                    let nodes: Vec<String> = answer["Nodes"]["items"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string))
                        .collect();
                    let pass = post["pass"].as_object().expect("pass");
                    let by_names = pass["NodeNames"].as_str().expect("name");
                    let by_nodes = pass["Nodes"].as_str().expect("name");
                    assert!(
                        names.iter().any(|n| n == by_names) || nodes.iter().any(|n| n == by_nodes),
                        "{what}"
                    );
                }
                "priorities-ok" => {
                    assert_eq!(status, 200, "{what}");
                    let hosts = strings(post.get("hosts"));
                    let list = answer.as_array().expect("a HostPriorityList");
                    assert!(!list.is_empty(), "{what}");
                    for p in list {
                        let host = p["Host"].as_str().expect("Host");
                        assert!(hosts.iter().any(|h| h == host), "{what}");
                        let score = p["Score"].as_i64().expect("Score");
                        assert!((0..=10).contains(&score), "{what}");
                    }
                }
                "bind-error" => {
                    let error = answer["Error"].as_str().unwrap_or("");
                    assert!(
                        (400..500).contains(&status)
                            || (matches!(status, 200 | 500) && !error.is_empty()),
                        "{what}"
                    );
                }
                "4xx-or-preemption-ok" => {
                    assert!((400..500).contains(&status) || status == 200, "{what}");
                }
                "4xx" => {
                    assert!((400..500).contains(&status), "{what}");
                    // The refusal names the field at fault.
                    assert!(text.contains("Pod") || text.contains("Node"), "{what}");
                }
                other => panic!("{key}: unknown expectation {other}"),
            }
        }
        let (status, _) = post_raw(addr, "/version", Vec::new()).await;
        assert_eq!(status, 200, "{key}: /version after the body");
    }
}

// ------------------------------------------------------------------ MIG in the device plugin

/// Starts the device plugin on the sandbox over the nvidia-smi backend reading `xml`.
async fn plugin_over_xml(
    dir: &Path,
    xml: &str,
) -> (
    gpushare_sandbox::apiserver::ApiServer,
    gpushare_sandbox::kubelet::Kubelet,
    anyhow::Result<gpushare::deviceplugin::DevicePluginHandle>,
) {
    let api = gpushare_sandbox::apiserver::ApiServer::start()
        .await
        .expect("sandbox API server");
    api.seed_yaml(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: mig-node\n  labels:\n    gpushare: \"true\"\n",
    )
    .expect("node");
    let kubelet = gpushare_sandbox::kubelet::Kubelet::start(dir)
        .await
        .expect("sandbox kubelet");
    let file = dir.join("smi.xml");
    write(&file, xml);
    let program = script(dir, "nvidia-smi", &format!("cat '{}'", file.display()));
    let mut config = Config {
        gpu: smi_config(&program),
        ..Config::default()
    };
    config.node.node_name = "mig-node".to_string();
    config.device_plugin.state_dir = dir.join("state");
    // A real backend's GPUs: a lock directory of this test's own (not the host's).
    config.node.gpu_lock_dir = dir.join("locks");
    config.device_plugin.device_plugin_dir = kubelet.device_plugin_dir();
    config.device_plugin.pod_resources_socket = kubelet.pod_resources_socket();
    config.device_plugin.admin_address = String::new();
    config.node.health_check = false;
    config.doctor.skip = true;
    let backend = gpushare::gpu::open(&config.gpu).expect("the nvidia-smi backend opens");
    let plugin = gpushare::deviceplugin::start(
        &config,
        api.admin_client(),
        backend,
        gpushare::shutdown::Shutdown::never(),
    )
    .await;
    (api, kubelet, plugin)
}

#[tokio::test]
async fn mig_enabled_gpus_are_not_advertised_and_the_node_says_why() {
    use gpushare::core::wire;
    let dir = tempfile::Builder::new()
        .prefix("mig")
        .tempdir_in("/tmp")
        .expect("a short temp dir for the sockets");
    // The 8-GPU H100 box of the corpus with MIG turned on for GPU 3 (the 4th <mig_mode>).
    let h100 = std::fs::read_to_string(corpus().join("nvidia-smi-xml/gpuid-h100x8-570.86.15.xml"))
        .expect("read");
    let mut parts: Vec<&str> = h100.split("<current_mig>Disabled</current_mig>").collect();
    assert_eq!(parts.len(), 9, "one <current_mig> per GPU");
    let tail = parts.split_off(4);
    let xml = format!(
        "{}<current_mig>Enabled</current_mig>{}",
        parts.join("<current_mig>Disabled</current_mig>"),
        tail.join("<current_mig>Disabled</current_mig>")
    );
    let inv = parse_xml(&xml).expect("parses");
    let mig_uuid = inv.excluded[0].uuid.clone();
    assert_eq!(inv.excluded[0].index, 3);
    let (api, kubelet, plugin) = plugin_over_xml(dir.path(), &xml).await;
    let plugin = plugin.expect("the plugin starts with the 7 other GPUs");
    kubelet
        .wait_registered(wire::RESOURCE_GPU_MEM)
        .await
        .expect("registers");
    let devices = kubelet
        .wait_devices(wire::RESOURCE_GPU_MEM, |d| !d.is_empty())
        .await
        .expect("lists devices");
    // 7 × 80 GiB (81559 MiB → 79 GiB units), none of the MIG GPU's.
    assert_eq!(
        devices.len(),
        7 * 79,
        "one device ID per GiB of each non-MIG GPU"
    );
    assert!(devices.iter().all(|d| !d.id.starts_with(&mig_uuid)));
    let node = api
        .get_as::<k8s_openapi::api::core::v1::Node>("nodes", None, "mig-node")
        .expect("node");
    let ann = node.metadata.annotations.expect("annotations");
    let excluded: Value =
        serde_json::from_str(&ann[wire::NODE_ANN_EXCLUDED_GPUS]).expect("excluded JSON");
    assert_eq!(excluded[0]["index"], 3);
    assert_eq!(excluded[0]["uuid"], mig_uuid.as_str());
    assert!(
        excluded[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("MIG mode is enabled")),
        "{excluded}"
    );
    let published: Vec<gpushare::k8s::project::PublishedGpu> =
        serde_json::from_str(&ann[wire::NODE_ANN_DEVICES]).expect("devices JSON");
    let indexes: Vec<u32> = published.iter().map(|g| g.index).collect();
    assert_eq!(indexes, [0, 1, 2, 4, 5, 6, 7]);
    plugin.stop().await;
    kubelet.stop().await;
    api.shutdown().await;
}

#[tokio::test]
async fn a_node_whose_only_gpu_is_in_mig_mode_refuses_to_start_and_says_why() {
    let dir = tempfile::Builder::new()
        .prefix("mig")
        .tempdir_in("/tmp")
        .expect("a short temp dir for the sockets");
    let xml = std::fs::read_to_string(corpus().join("nvidia-smi-xml/netdata-a100-sxm4-mig.xml"))
        .expect("read");
    let (api, kubelet, plugin) = plugin_over_xml(dir.path(), &xml).await;
    let err = plugin.expect_err("nothing to share").to_string();
    assert!(err.contains("MIG mode is enabled"), "{err}");
    kubelet.stop().await;
    api.shutdown().await;
}

#[tokio::test]
async fn the_device_plugin_counts_an_unattributed_xid_and_marks_no_gpu() {
    use gpushare::core::wire;
    use gpushare::gpu::fake::{FakeBackend, fake_uuid};
    let dir = tempfile::Builder::new()
        .prefix("xid")
        .tempdir_in("/tmp")
        .expect("a short temp dir for the sockets");
    let api = gpushare_sandbox::apiserver::ApiServer::start()
        .await
        .expect("sandbox API server");
    api.seed_yaml("apiVersion: v1\nkind: Node\nmetadata:\n  name: gb200\n")
        .expect("node");
    let kubelet = gpushare_sandbox::kubelet::Kubelet::start(dir.path())
        .await
        .expect("sandbox kubelet");
    let mut config = Config::default();
    config.node.node_name = "gb200".to_string();
    config.device_plugin.state_dir = dir.path().join("state");
    config.device_plugin.device_plugin_dir = kubelet.device_plugin_dir();
    config.device_plugin.pod_resources_socket = kubelet.pod_resources_socket();
    config.device_plugin.admin_address = String::new();
    config.doctor.skip = true;
    let backend = FakeBackend::from_spec("2x16GiB").expect("fake GPUs");
    let health = backend.health();
    let plugin = gpushare::deviceplugin::start(
        &config,
        api.admin_client(),
        std::sync::Arc::new(backend),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("plugin starts");
    kubelet
        .wait_devices(wire::RESOURCE_GPU_MEM, |d| !d.is_empty())
        .await
        .expect("lists devices");
    // A bounded poll on a condition (the health task subscribing), not a timing assumption.
    wait_until_within("a health watcher", EVENT_DEADLINE, || {
        health.subscribers() > 0
    })
    .await;
    // The GB200 NVLink Xid of the corpus, then a fatal Xid on GPU 1: events are handled in
    // order, so once GPU 1 is down the first has been handled.
    health.inject(HealthEvent::Unattributed {
        pci: "0000:00:00".to_string(),
        xid: 149,
    });
    health.inject(HealthEvent::Xid {
        uuid: Some(fake_uuid(1)),
        xid: 79,
    });
    let unhealthy = |d: &[gpushare::kubelet_api::deviceplugin::Device], uuid: &str| {
        d.iter()
            .filter(|x| x.id.starts_with(uuid))
            .all(|x| x.health != wire::HEALTHY)
    };
    let devices = kubelet
        .wait_devices(wire::RESOURCE_GPU_MEM, |d| unhealthy(d, &fake_uuid(1)))
        .await
        .expect("GPU 1 down");
    assert!(
        devices
            .iter()
            .filter(|x| x.id.starts_with(&fake_uuid(0)))
            .all(|x| x.health == wire::HEALTHY),
        "the unattributed Xid marked GPU 0"
    );
    assert_eq!(plugin.node_metrics().unattributed_xids.get(), 1);
    assert_eq!(plugin.node_metrics().unhealthy_gpus.get(), 1);
    plugin.stop().await;
    kubelet.stop().await;
    api.shutdown().await;
}
