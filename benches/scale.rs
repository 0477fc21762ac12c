//! `make bench`: the extender at scale and the device plugin, each part in a process of its
//! own.
//!
//! With `--bench` (what `cargo bench` passes) this binary runs again per part (with
//! `GPUSHARE_BENCH_PART`), so that one part's teardown — the extender part drops a sandbox of
//! 1 GB — cannot land in another's percentiles; the parent collects the figures and prints
//! them next to their budgets:
//! - `extender`: 5,000 nodes × 8 GPUs and 150,000 bound, annotated pods seeded straight into
//!   the sandbox store, then the real `gpushare extender` binary started as a child process
//!   against it: time to ready (process start to full sync, and the extender's CPU time for
//!   it), the API requests that took, the extender's resident memory (its own process: peak
//!   `VmHWM` and current `VmRSS`; a ledger-only per-pod figure comes from building the ledger
//!   alone in this process first), filter and prioritize latency for 500 candidate
//!   `NodeNames` over one HTTP keep-alive connection, bind throughput with 1 ms of API latency
//!   injected on every PATCH and Binding;
//! - `failover`: the same cluster, three extender replicas: the leader stopped, then killed;
//! - `device-plugin`: registration from exec with the preflight on, the idle footprint, and
//!   kubelet's GetPreferredAllocation + Allocate with 110 pods on the node;
//! - `device-plugin-slow-api`: the same Allocates with 20 ms of latency on every API request,
//!   and when the last pod's ASSIGNED annotation lands.
//!
//! The table is printed and written as markdown to `target/bench-report.md` (or
//! `$CARGO_TARGET_DIR/bench-report.md`). `GPUSHARE_BENCH_SCALE=0.1` shrinks the cluster for a
//! quick look while profiling; `GPUSHARE_BENCH_ONLY=device-plugin,failover` runs only those
//! parts.
//!
//! Without `--bench` (`cargo test --all-targets` runs benches as tests) it runs a tiny smoke
//! version of the same parts (10 nodes) and exits, so the bench cannot rot unnoticed.
//!
//! It is not a timed test: figures depend on the machine; FAIL lines are reported, not fatal.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use gpushare::config::Config;
use gpushare::core::wire::{
    ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, ANN_POD_MEM, RESOURCE_GPU_COUNT,
    RESOURCE_GPU_MEM,
};
use gpushare::extender::cache::{Cache, Placement, PodFacts};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// GiB units per GPU.
const GPU_UNITS: u64 = 16;
const GPUS_PER_NODE: u64 = 8;

/// The sizes of one run.
#[derive(Clone, Copy, Debug)]
struct Size {
    nodes: usize,
    pods: usize,
    candidates: usize,
    filters: usize,
    prioritizes: usize,
    /// Filter and prioritize are timed in this many rounds of `filters` / `prioritizes`
    /// requests; the verdict takes the median round's p99, so one burst of the VM's
    /// neighbours does not decide it (every round's p99 is printed).
    rounds: usize,
    binds: usize,
    bind_concurrency: usize,
    dp_pods: usize,
}

impl Size {
    /// The budgeted size; `GPUSHARE_BENCH_SCALE` (a fraction, e.g. `0.1`) shrinks the
    /// cluster for a quick look while profiling (the verdicts then mean nothing).
    fn full() -> Size {
        let scale = std::env::var("GPUSHARE_BENCH_SCALE")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|f| *f > 0.0 && *f <= 1.0)
            .unwrap_or(1.0);
        Size {
            nodes: ((5_000.0 * scale) as usize).max(10),
            pods: ((150_000.0 * scale) as usize).max(10),
            candidates: 500,
            filters: 1_000,
            prioritizes: 400,
            rounds: 5,
            binds: 2_000,
            bind_concurrency: 64,
            dp_pods: 110,
        }
    }

    fn smoke() -> Size {
        Size {
            nodes: 10,
            pods: 50,
            candidates: 10,
            filters: 20,
            prioritizes: 10,
            rounds: 2,
            binds: 10,
            bind_concurrency: 4,
            dp_pods: 5,
        }
    }
}

/// One line of the report.
#[derive(serde::Serialize, serde::Deserialize)]
struct Figure {
    name: String,
    value: String,
    budget: String,
    /// `Some(pass)` when there is a budget.
    pass: Option<bool>,
}

impl Figure {
    fn new(name: impl Into<String>, value: impl Into<String>) -> Figure {
        Figure {
            name: name.into(),
            value: value.into(),
            budget: String::new(),
            pass: None,
        }
    }

    fn budget(mut self, budget: &str, pass: bool) -> Figure {
        self.budget = budget.to_string();
        self.pass = Some(pass);
        self
    }
}

/// The parts of the bench, each run in a process of its own (this binary again, with
/// `GPUSHARE_BENCH_PART`), so that one part's teardown (the extender part drops a sandbox of
/// 1 GB) cannot land in another's percentiles.
const PARTS: [&str; 4] = [
    "extender",
    "failover",
    "device-plugin",
    "device-plugin-slow-api",
];

fn main() -> std::process::ExitCode {
    let bench = std::env::args().any(|a| a == "--bench");
    let size = if bench { Size::full() } else { Size::smoke() };
    if let Ok(part) = std::env::var("GPUSHARE_BENCH_PART") {
        return run_part(&part, size);
    }
    // `GPUSHARE_BENCH_ONLY=<part>[,<part>]`: only those parts.
    let only = std::env::var("GPUSHARE_BENCH_ONLY").unwrap_or_default();
    let parts: Vec<&str> = PARTS
        .iter()
        .copied()
        .filter(|p| only.is_empty() || only.split(',').any(|o| o.trim() == *p))
        .collect();
    let mut figures = Vec::new();
    for part in parts {
        match part_in_its_own_process(part) {
            Ok(mut f) => figures.append(&mut f),
            Err(e) => {
                eprintln!("scale: part {part}: {e:#}");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    if !bench {
        // The budgets are for the full size; a smoke run only proves the path works.
        for f in &mut figures {
            f.pass = None;
        }
    }
    let table = render(&figures, size, bench);
    println!("{table}");
    if bench {
        let path = report_path();
        match std::fs::write(&path, &table) {
            Ok(()) => println!("written to {}", path.display()),
            Err(e) => eprintln!("scale: cannot write {}: {e}", path.display()),
        }
    }
    std::process::ExitCode::SUCCESS
}

/// Runs `part` in a child process (this binary, same arguments) and reads its figures back.
fn part_in_its_own_process(part: &str) -> anyhow::Result<Vec<Figure>> {
    let dir = tempfile::Builder::new()
        .prefix("gpushare-bench-part")
        .tempdir()
        .context("temporary folder")?;
    let out = dir.path().join("figures.json");
    let status = std::process::Command::new(std::env::current_exe().context("this binary")?)
        .args(std::env::args_os().skip(1))
        .env("GPUSHARE_BENCH_PART", part)
        .env("GPUSHARE_BENCH_FIGURES", &out)
        .status()
        .context("starting the part's process")?;
    if !status.success() {
        bail!("its process ended with {status}");
    }
    let text = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
    serde_json::from_slice(&text).context("decoding its figures")
}

/// The child's side: runs `part` and writes its figures to `GPUSHARE_BENCH_FIGURES`.
fn run_part(part: &str, size: Size) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("scale: cannot start a tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match part {
            "extender" => extender_figures(size).await,
            "failover" => {
                let api = seeded_cluster(size).await?.0;
                let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
                failover_figures(&api, &client, &Config::default()).await
            }
            "device-plugin" => device_plugin_figures(size, None).await,
            "device-plugin-slow-api" => {
                device_plugin_figures(size, Some(Duration::from_millis(20))).await
            }
            other => bail!("no part {other:?} (parts: {})", PARTS.join(", ")),
        }
    });
    let figures = match result {
        Ok(f) => f,
        Err(e) => {
            eprintln!("scale: {part}: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let written = std::env::var_os("GPUSHARE_BENCH_FIGURES")
        .context("GPUSHARE_BENCH_FIGURES is not set")
        .and_then(|path| {
            let json = serde_json::to_vec(&figures)?;
            std::fs::write(&path, json).context("writing the figures")
        });
    match written {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale: {part}: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn report_path() -> std::path::PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    dir.join("bench-report.md")
}

/// `VmRSS` of this process, in bytes.
fn rss_bytes() -> u64 {
    rss_of("/proc/self/status")
}

fn rss_of(status_path: &str) -> u64 {
    status_field(status_path, "VmRSS:")
}

/// A `kB` field of `/proc/<pid>/status`, in bytes (0 when unreadable).
fn status_field(status_path: &str, field: &str) -> u64 {
    std::fs::read_to_string(status_path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn node_name(i: usize) -> String {
    format!("gpu-node-{i:05}")
}

/// A deterministic xorshift, so runs are comparable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn node_object(i: usize) -> Value {
    node_named(&node_name(i))
}

fn node_named(name: &str) -> Value {
    let units = (GPU_UNITS * GPUS_PER_NODE).to_string();
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "gpushare": "true" } },
        "status": {
            "capacity": { RESOURCE_GPU_MEM: units, RESOURCE_GPU_COUNT: GPUS_PER_NODE.to_string(),
                          "cpu": "64", "memory": "512Gi", "pods": "110" },
            "allocatable": { RESOURCE_GPU_MEM: units, RESOURCE_GPU_COUNT: GPUS_PER_NODE.to_string(),
                             "cpu": "64", "memory": "512Gi", "pods": "110" },
        },
    })
}

fn pod_spec(mem: u64) -> Value {
    json!({
        "containers": [{ "name": "main", "image": "registry.local/train:1",
            "resources": { "limits": { RESOURCE_GPU_MEM: mem.to_string() } } }],
    })
}

/// A pod bound to `node` holding `mem` units of GPU `gpu`, as the device plugin leaves it.
fn bound_pod(i: usize, node: &str, gpu: u64, mem: u64) -> Value {
    let mut spec = pod_spec(mem);
    spec["nodeName"] = json!(node);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("job-{i:06}"), "namespace": "default",
            "annotations": {
                ANN_GPU_INDEX: gpu.to_string(), ANN_POD_MEM: mem.to_string(),
                ANN_DEVICE_MEM: GPU_UNITS.to_string(), ANN_ASSIGNED: "true",
                ANN_ASSUME_TIME: "1700000000000000000",
            },
        },
        "spec": spec,
        "status": { "phase": "Running" },
    })
}

fn pending_pod(name: &str, mem: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": pod_spec(mem),
        "status": { "phase": "Pending" },
    })
}

/// A pod as a real cluster's API server sends it (about 4 KiB): `managedFields` from three
/// managers, a sidecar, env, mounts, probes, volumes and container statuses.
fn realistic_pod(i: usize) -> Value {
    let mut pod = bound_pod(i, "gpu-node-00001", 1, 2);
    let container = |name: &str, gpu: bool| {
        let mut limits = json!({ "cpu": "4", "memory": "16Gi" });
        if gpu {
            limits[RESOURCE_GPU_MEM] = json!("2");
        }
        json!({
            "name": name, "image": format!("registry.local/team/{name}:2026.11.3"),
            "imagePullPolicy": "IfNotPresent",
            "args": ["--model", "/models/llm-7b", "--port", "8080", "--max-batch", "16"],
            "env": (0..12).map(|e| json!({ "name": format!("SETTING_{e}"), "value": format!("value-{e}-{i}") })).collect::<Vec<_>>(),
            "ports": [{ "containerPort": 8080, "name": "http", "protocol": "TCP" }],
            "resources": { "limits": limits.clone(), "requests": limits },
            "readinessProbe": { "httpGet": { "path": "/healthz", "port": 8080 }, "periodSeconds": 10 },
            "volumeMounts": [{ "name": "models", "mountPath": "/models", "readOnly": true },
                             { "name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true }],
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
        })
    };
    pod["metadata"]["labels"] =
        json!({ "app": "inference", "team": "ml", "pod-template-hash": "7d9f8c6b5" });
    pod["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
    pod["metadata"]["resourceVersion"] = json!("123456789");
    pod["metadata"]["ownerReferences"] = json!([{ "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "name": "inference-7d9f8c6b5", "uid": "11111111-2222-4333-8444-555555555555", "controller": true }]);
    pod["metadata"]["managedFields"] = json!(["kube-controller-manager", "kube-scheduler", "kubelet"]
        .iter()
        .map(|m| json!({ "manager": m, "operation": "Update", "apiVersion": "v1",
            "time": "2026-11-30T10:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": { "f:metadata": { "f:labels": { ".": {}, "f:app": {}, "f:team": {} } },
                          "f:spec": { "f:containers": { "k:{\"name\":\"main\"}": { ".": {}, "f:image": {}, "f:env": {} } } },
                          "f:status": { "f:conditions": { "k:{\"type\":\"Ready\"}": { ".": {}, "f:status": {} } } } } }))
        .collect::<Vec<_>>());
    pod["spec"]["containers"] =
        json!([container("main", true), container("metrics-sidecar", false)]);
    pod["spec"]["volumes"] = json!([{ "name": "models", "persistentVolumeClaim": { "claimName": "models" } },
        { "name": "kube-api-access", "projected": { "sources": [{ "serviceAccountToken": { "path": "token", "expirationSeconds": 3607 } }] } }]);
    pod["spec"]["tolerations"] =
        json!([{ "key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule" }]);
    let conditions: Vec<Value> = ["Initialized", "Ready", "ContainersReady", "PodScheduled"]
        .iter()
        .map(|t| json!({ "type": t, "status": "True", "lastTransitionTime": "2026-11-30T10:00:05Z" }))
        .collect();
    let statuses: Vec<Value> = ["main", "metrics-sidecar"]
        .iter()
        .map(|n| {
            json!({
                "name": n, "ready": true, "restartCount": 0, "started": true,
                "image": format!("registry.local/team/{n}:2026.11.3"),
                "imageID": format!("registry.local/team/{n}@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"),
                "containerID": "containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "state": { "running": { "startedAt": "2026-11-30T10:00:04Z" } },
            })
        })
        .collect();
    pod["status"] = json!({
        "phase": "Running", "podIP": "10.20.30.40", "hostIP": "192.168.1.10", "qosClass": "Guaranteed",
        "startTime": "2026-11-30T10:00:00Z",
        "conditions": conditions,
        "containerStatuses": statuses,
    });
    pod
}

/// Decodes `count` realistic pods as whole `k8s_openapi` Pods and as the extender's slim
/// `WatchedPod`, and reports both rates (the watch's full list is mostly this work).
fn pod_decode_figure(count: usize) -> anyhow::Result<Figure> {
    use gpushare::k8s::WatchedPod;
    use k8s_openapi::api::core::v1::Pod;
    let texts: Vec<String> = (0..64)
        .map(|i| serde_json::to_string(&realistic_pod(i)))
        .collect::<Result<_, _>>()?;
    let bytes = texts.iter().map(String::len).sum::<usize>() / texts.len();
    let time = |decode: &dyn Fn(&str) -> anyhow::Result<()>| -> anyhow::Result<Duration> {
        let started = Instant::now();
        for i in 0..count {
            decode(&texts[i % texts.len()])?;
        }
        Ok(started.elapsed())
    };
    let whole = time(&|t| {
        std::hint::black_box(serde_json::from_str::<Pod>(t)?);
        Ok(())
    })?;
    let slim = time(&|t| {
        std::hint::black_box(serde_json::from_str::<WatchedPod>(t)?);
        Ok(())
    })?;
    let per = |d: Duration| d.as_secs_f64() * 1e6 / count.max(1) as f64;
    Ok(Figure {
        name: format!("pod decode, {bytes} B of JSON each: whole Pod / WatchedPod (the watch's)"),
        value: format!(
            "{:.1} µs / {:.1} µs per pod ({:.1}× less work, {count} pods)",
            per(whole),
            per(slim),
            whole.as_secs_f64() / slim.as_secs_f64().max(1e-12)
        ),
        budget: String::new(),
        pass: None,
    })
}

/// The ledger alone, fed directly: its resident growth per pod.
fn ledger_only(size: Size) -> (u64, usize) {
    let before = rss_bytes();
    let cache = Cache::new();
    let specs: Vec<gpushare::core::GpuSpec> = (0..GPUS_PER_NODE)
        .map(|_| gpushare::core::GpuSpec {
            total: gpushare::core::GpuMem::new(GPU_UNITS),
            healthy: true,
        })
        .collect();
    for n in 0..size.nodes {
        cache.apply_node(
            &node_name(n),
            gpushare::k8s::NodeGpus {
                gpus: specs.clone(),
                capacity: gpushare::core::GpuMem::new(GPU_UNITS * GPUS_PER_NODE),
                ..Default::default()
            },
        );
    }
    for i in 0..size.pods {
        cache.observe_pod(PodFacts {
            uid: format!("00000000-0000-4000-8000-{i:012}"),
            namespace: "default".to_string(),
            name: format!("job-{i:06}"),
            placement: Some(Placement {
                node: node_name(i % size.nodes),
                gpu: (i as u64 % GPUS_PER_NODE) as u32,
                mem: gpushare::core::GpuMem::new(2),
                state: gpushare::core::PodState::Assigned,
            }),
            settled: true,
            reservation: None,
        });
    }
    let grown = rss_bytes().saturating_sub(before);
    let pods = cache.stats().pods;
    drop(cache);
    (grown, pods)
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn post(client: &HttpClient, url: &str, body: Bytes) -> anyhow::Result<(u16, Bytes)> {
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .context("building a request")?;
    send(client, req).await
}

async fn get(client: &HttpClient, url: &str) -> anyhow::Result<(u16, Bytes)> {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .context("building a request")?;
    send(client, req).await
}

/// Sends `req` and reads the whole answer: its status and body.
async fn send(
    client: &HttpClient,
    req: http::Request<Full<Bytes>>,
) -> anyhow::Result<(u16, Bytes)> {
    let resp = client.request(req).await.context("sending a request")?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .context("reading a response")?
        .to_bytes();
    Ok((status, body))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

/// Requests not timed before the timed ones: the connection is opened and warm, as
/// kube-scheduler's is.
const WARM_UP: usize = 50;

/// `count` sequential POSTs of `bodies` (round robin) to `url` over one keep-alive
/// connection, each timed from send to the last byte of the answer. The load generator runs
/// on a thread and single-threaded runtime of its own with `TCP_NODELAY` (as Go's client),
/// so the sandbox API server's tasks in this process do not sit between its wake-ups.
async fn timed_requests(
    url: &str,
    bodies: &[Bytes],
    count: usize,
) -> anyhow::Result<Vec<Duration>> {
    let (url, bodies) = (url.to_string(), bodies.to_vec());
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("a runtime for the load generator")?;
        runtime.block_on(async move {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            let client: HttpClient = Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1)
                .build(connector);
            let mut took = Vec::with_capacity(count);
            for i in 0..count + WARM_UP {
                let body = bodies[i % bodies.len()].clone();
                let started = Instant::now();
                let (status, resp) = post(&client, &url, body).await?;
                if i >= WARM_UP {
                    took.push(started.elapsed());
                }
                if status != 200 {
                    bail!(
                        "{url} answered {status}: {}",
                        String::from_utf8_lossy(&resp)
                    );
                }
            }
            took.sort();
            Ok(took)
        })
    })
    .await
    .context("the load generator panicked")?
}

/// Latencies timed in rounds, each round's sorted.
struct Rounds {
    rounds: Vec<Vec<Duration>>,
}

impl Rounds {
    /// Every round's latencies together, sorted.
    fn all(&self) -> Vec<Duration> {
        let mut all = self.rounds.concat();
        all.sort();
        all
    }

    /// The median of the rounds' p99s.
    fn median_p99(&self) -> Duration {
        let mut p99s: Vec<Duration> = self.rounds.iter().map(|r| percentile(r, 0.99)).collect();
        p99s.sort();
        p99s.get(p99s.len() / 2).copied().unwrap_or_default()
    }

    /// Every round's p99, in the order they ran.
    fn p99s(&self) -> String {
        self.rounds
            .iter()
            .map(|r| format!("{:.3}", percentile(r, 0.99).as_secs_f64() * 1000.0))
            .collect::<Vec<_>>()
            .join(" / ")
            + " ms"
    }
}

/// `rounds` runs of [`timed_requests`], one after the other on fresh connections.
async fn timed_rounds(
    url: &str,
    bodies: &[Bytes],
    per_round: usize,
    rounds: usize,
) -> anyhow::Result<Rounds> {
    let mut out = Rounds {
        rounds: Vec::with_capacity(rounds),
    };
    for _ in 0..rounds.max(1) {
        out.rounds
            .push(timed_requests(url, bodies, per_round).await?);
    }
    Ok(out)
}

/// The `gpushare` binary under test: `GPUSHARE_BENCH_BIN` (e.g. the static release binary
/// that ships, as `make bench` passes it), else the one cargo built with this bench.
fn gpushare_binary() -> std::path::PathBuf {
    std::env::var_os("GPUSHARE_BENCH_BIN")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_BIN_EXE_gpushare")))
}

/// `VmRSS` and `VmHWM` (peak) of a process, in bytes.
fn memory_of(status_path: &str) -> (u64, u64) {
    (
        status_field(status_path, "VmRSS:"),
        status_field(status_path, "VmHWM:"),
    )
}

/// User + system CPU time of a process from `/proc/<pid>/stat`, in seconds (the kernel
/// reports it in USER_HZ, which is 100 on every Linux ABI).
fn cpu_seconds_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the `(comm)`, which may hold spaces: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// `gpushare extender` as a child process against the sandbox API server, so its memory
/// and CPU are its own (the sandbox's store and list buffers live in this process).
struct Extender {
    child: tokio::process::Child,
    pid: u32,
    addr: std::net::SocketAddr,
    stderr: Option<tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>>,
}

impl Extender {
    /// Starts an extender; with `replica`, leader election on with that pod name.
    async fn start(api: &ApiServer, replica: Option<&str>) -> anyhow::Result<Extender> {
        // A port the kernel just handed out; the extender binds it right after.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("choosing a port")?
            .port();
        let mut child = tokio::process::Command::new(gpushare_binary())
            .arg("extender")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("KUBECONFIG", api.admin_kubeconfig_path())
            .env("LOG_LEVEL", "info")
            .env("GPUSHARE_DOCTOR__SKIP", "true")
            .env("GPUSHARE_EXTENDER__BIND_ADDRESS", "127.0.0.1")
            .env("GPUSHARE_EXTENDER__PORT", port.to_string())
            .env(
                "GPUSHARE_EXTENDER__LEADER_ELECT",
                if replica.is_some() { "true" } else { "false" },
            )
            .env("POD_NAME", replica.unwrap_or("bench"))
            .kill_on_drop(true)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("starting gpushare extender")?;
        let pid = child.id().context("the extender exited at once")?;
        let stderr = child.stderr.take().context("the extender's stderr")?;
        use tokio::io::AsyncBufReadExt as _;
        Ok(Extender {
            child,
            pid,
            addr: ([127, 0, 0, 1], port).into(),
            stderr: Some(tokio::io::BufReader::new(stderr).lines()),
        })
    }

    /// Waits for the extender's "ledger synced" log line, then drains its log in the
    /// background (warnings and errors are passed on, and the leadership and sync lines, whose
    /// timestamps show where a failover spends its time).
    async fn wait_synced(&mut self) -> anyhow::Result<()> {
        let mut lines = self.stderr.take().context("waited twice")?;
        let mut tail = Vec::new();
        let synced = tokio::time::timeout(Duration::from_secs(600), async {
            while let Some(line) = lines.next_line().await? {
                if line.contains("ledger synced") {
                    return Ok(true);
                }
                tail.push(line);
            }
            Ok::<bool, std::io::Error>(false)
        })
        .await
        .context("the extender did not sync within 600 s")?
        .context("reading the extender's log")?;
        if !synced {
            bail!("the extender exited before it synced:\n{}", tail.join("\n"));
        }
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if ["WARN", "ERROR", "leading", "ledger synced"]
                    .iter()
                    .any(|w| line.contains(w))
                {
                    eprintln!("extender: {line}");
                }
            }
        });
        Ok(())
    }

    fn memory(&self) -> (u64, u64) {
        memory_of(&format!("/proc/{}/status", self.pid))
    }

    fn cpu_seconds(&self) -> f64 {
        cpu_seconds_of(self.pid)
    }

    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// The extender's `/metrics` page.
async fn metrics_text(client: &HttpClient, url: &str) -> anyhow::Result<String> {
    let (status, body) = get(client, url).await?;
    if status != 200 {
        bail!("{url} answered {status}");
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// `gpushare_extender_pods` and `gpushare_extender_nodes` from `/metrics`.
async fn ledger_counts(client: &HttpClient, url: &str) -> anyhow::Result<(usize, usize)> {
    let text = metrics_text(client, url).await?;
    let gauge = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as usize)
    };
    match (
        gauge("gpushare_extender_pods"),
        gauge("gpushare_extender_nodes"),
    ) {
        (Some(pods), Some(nodes)) => Ok((pods, nodes)),
        _ => bail!("{url} has no gpushare_extender_pods / gpushare_extender_nodes"),
    }
}

/// Mean seconds the extender itself spent per `verb` request (its
/// `gpushare_extender_request_duration_seconds` sum over count, all outcomes), from `/metrics`.
async fn mean_inside(client: &HttpClient, url: &str, verb: &str) -> anyhow::Result<f64> {
    let text = metrics_text(client, url).await?;
    let total = |suffix: &str| -> f64 {
        let prefix = format!("gpushare_extender_request_duration_seconds_{suffix}{{");
        let label = format!("verb=\"{verb}\"");
        text.lines()
            .filter(|l| l.starts_with(&prefix) && l.contains(&label))
            .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum()
    };
    let count = total("count");
    if count == 0.0 {
        bail!("{url} has no {verb} requests in gpushare_extender_request_duration_seconds");
    }
    Ok(total("sum") / count)
}

/// The sandbox API server seeded straight into its store with `size`'s nodes and bound pods,
/// and the figure of its seeding.
async fn seeded_cluster(size: Size) -> anyhow::Result<(ApiServer, Figure)> {
    let rss_start = rss_bytes();
    let api = ApiServer::start().await?;
    let seeding = Instant::now();
    for n in 0..size.nodes {
        api.create_object(node_object(n))?;
    }
    let per_node = size.pods / size.nodes.max(1);
    for i in 0..size.pods {
        let node = node_name(i % size.nodes);
        // Two units each; at most per_node pods spread over the node's GPUs.
        let slot = (i / size.nodes) as u64;
        api.create_object(bound_pod(i, &node, slot % GPUS_PER_NODE, 2))?;
    }
    let seeded_in = seeding.elapsed();
    let rss_seeded = rss_bytes();
    let figure = Figure::new(
        "sandbox seeded (not the extender)",
        format!(
            "{} nodes, {} pods ({per_node}/node) in {:.1} s; store {:.0} MiB",
            size.nodes,
            size.pods,
            seeded_in.as_secs_f64(),
            mib(rss_seeded.saturating_sub(rss_start))
        ),
    );
    Ok((api, figure))
}

/// What the extender asked the API server for from its start to its "ledger synced": the
/// requests in all, and the lists of pods and of nodes.
fn requests_to_ready(
    requests: &[gpushare_sandbox::apiserver::RecordedRequest],
) -> (usize, usize, usize) {
    let lists = |path: &str| {
        requests
            .iter()
            .filter(|r| r.path == path && !r.query.contains("watch=true"))
            .count()
    };
    (
        requests.len(),
        lists("/api/v1/pods"),
        lists("/api/v1/nodes"),
    )
}

/// The extender's part: the ledger alone, pod decoding, then the real extender process over
/// the seeded cluster: time to ready (and the API requests it took), memory, filter,
/// prioritize and bind.
async fn extender_figures(size: Size) -> anyhow::Result<Vec<Figure>> {
    let mut figures = Vec::new();

    // 1. The ledger alone.
    let (ledger_grown, ledger_pods) = ledger_only(size);
    let per_pod_ledger = ledger_grown as f64 / ledger_pods.max(1) as f64;
    figures.push(
        Figure::new(
            "ledger alone: resident growth per pod",
            format!(
                "{per_pod_ledger:.0} B ({ledger_pods} pods, {:.1} MiB)",
                mib(ledger_grown)
            ),
        )
        .budget("< 1 KiB", per_pod_ledger < 1024.0),
    );

    // 2. Decoding a realistic pod (managedFields, env, volumes, statuses): whole vs slim.
    figures.push(pod_decode_figure(if size.pods >= 1_000 {
        20_000
    } else {
        50
    })?);

    // 3. The sandbox, seeded straight into its store.
    let (api, seeded) = seeded_cluster(size).await?;
    figures.push(seeded);

    // 4. The extender, in a process of its own: time to ready, its memory and CPU.
    let config = Config::default();
    let before = api.request_count();
    let mut extender = Extender::start(&api, None).await?;
    let started = Instant::now();
    extender.wait_synced().await?;
    let ready_in = started.elapsed();
    let (requests, pod_lists, node_lists) = requests_to_ready(&api.requests()[before..]);
    // What a consistent list paged 500 at a time (the way every list read before) takes.
    let pages = |n: usize| n.div_ceil(500).max(1);
    let paged = pages(size.pods) + pages(size.nodes) + 1;
    let base = format!("http://{}{}", extender.addr, config.extender.url_prefix);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(size.bind_concurrency.max(1))
        .build_http();
    // Ready follows the logged sync closely but not atomically: poll, bounded.
    let readyz = format!("http://{}/readyz", extender.addr);
    let ready_by = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = get(&client, &readyz).await?;
        if status == 200 {
            break;
        }
        if Instant::now() > ready_by {
            bail!("the extender logged its sync but /readyz still answered {status} 10 s later");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (pods, nodes) =
        ledger_counts(&client, &format!("http://{}/metrics", extender.addr)).await?;
    if pods != size.pods || nodes != size.nodes {
        bail!(
            "the ledger holds {pods} pods on {nodes} nodes, expected {} on {}",
            size.pods,
            size.nodes
        );
    }
    let (rss, peak) = extender.memory();
    figures.push(Figure {
        name: "time to ready (process start to full list of nodes and pods)".to_string(),
        value: format!(
            "{:.2} s (extender CPU {:.2} s)",
            ready_in.as_secs_f64(),
            extender.cpu_seconds()
        ),
        budget: "< 10 s".to_string(),
        pass: Some(ready_in < Duration::from_secs(10)),
    });
    figures.push(
        Figure::new(
            "API requests from the extender's start to ready",
            format!(
                "{requests} (pod lists {pod_lists}, node lists {node_lists}; lists paged 500 at a \
                 time took {paged} pages)"
            ),
        )
        .budget(&format!("< {paged}"), requests < paged),
    );
    figures.push(Figure {
        name: "extender resident memory once ready: peak (VmHWM) / now (VmRSS)".to_string(),
        value: format!(
            "{:.1} MiB / {:.1} MiB ({:.0} B per pod at peak)",
            mib(peak),
            mib(rss),
            peak as f64 / size.pods.max(1) as f64
        ),
        budget: "< 256 MiB".to_string(),
        pass: Some(peak > 0 && peak < 256 * 1024 * 1024),
    });

    // 5. Filter and prioritize over one keep-alive connection.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut bodies = Vec::new();
    for b in 0..16 {
        let names: Vec<String> = (0..size.candidates)
            .map(|_| node_name(rng.below(size.nodes)))
            .collect();
        // What kube-scheduler sends: the whole pending Pod, managedFields and all.
        let mut pod = realistic_pod(b);
        pod["metadata"]["name"] = json!(format!("probe-{b}"));
        pod["metadata"]["uid"] = json!(format!("probe-uid-{b}"));
        pod["metadata"]["annotations"] = json!({});
        pod["spec"]["nodeName"] = Value::Null;
        pod["status"] = json!({ "phase": "Pending" });
        let args = json!({ "Pod": pod, "NodeNames": names });
        bodies.push(Bytes::from(serde_json::to_vec(&args)?));
    }
    let filter = timed_rounds(
        &format!("{base}/filter"),
        &bodies,
        size.filters,
        size.rounds,
    )
    .await?;
    let p99 = filter.median_p99();
    let filter_all = filter.all();
    figures.push(Figure {
        name: format!(
            "filter latency p50 ({} NodeNames, HTTP keep-alive)",
            size.candidates
        ),
        value: ms(percentile(&filter_all, 0.50)),
        budget: String::new(),
        pass: None,
    });
    figures.push(Figure {
        name: "filter latency p99, median round".to_string(),
        value: format!(
            "{} (rounds of {}: {}; all {} requests: {})",
            ms(p99),
            size.filters,
            filter.p99s(),
            filter_all.len(),
            ms(percentile(&filter_all, 0.99))
        ),
        budget: "< 1 ms".to_string(),
        pass: Some(p99 < Duration::from_millis(1)),
    });
    let metrics_url = format!("http://{}/metrics", extender.addr);
    let filter_inside = mean_inside(&client, &metrics_url, "filter").await?;
    let prio = timed_rounds(
        &format!("{base}/prioritize"),
        &bodies,
        size.prioritizes,
        size.rounds,
    )
    .await?;
    let prio_inside = mean_inside(&client, &metrics_url, "prioritize").await?;
    figures.push(Figure {
        name: "prioritize latency p50 / p99 (median round)".to_string(),
        value: format!(
            "{} / {} (rounds of {}: {})",
            ms(percentile(&prio.all(), 0.50)),
            ms(prio.median_p99()),
            size.prioritizes,
            prio.p99s()
        ),
        budget: String::new(),
        pass: None,
    });
    figures.push(Figure {
        name: "of which inside the extender (its own histogram): filter / prioritize mean"
            .to_string(),
        value: format!(
            "{} / {} (the rest is HTTP, loopback and the load generator)",
            ms(Duration::from_secs_f64(filter_inside)),
            ms(Duration::from_secs_f64(prio_inside))
        ),
        budget: String::new(),
        pass: None,
    });

    // 6. Bind throughput with 1 ms of API latency on every PATCH and Binding.
    let mut targets = Vec::with_capacity(size.binds);
    for b in 0..size.binds {
        let name = format!("bind-{b:05}");
        let created = api.create_object(pending_pod(&name, 1))?;
        let uid = created["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let node = node_name(rng.below(size.nodes));
        let args =
            json!({ "PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node });
        targets.push(Bytes::from(serde_json::to_vec(&args)?));
    }
    let delay = FaultAction::Delay(Duration::from_millis(1));
    api.inject(
        Fault::new(Some(http::Method::PATCH), "/pods/", delay.clone()).times(usize::MAX / 2),
    );
    api.inject(Fault::new(Some(http::Method::POST), "/binding", delay).times(usize::MAX / 2));
    let targets = Arc::new(targets);
    let next = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(AtomicUsize::new(0));
    let bind_url: Arc<str> = Arc::from(format!("{base}/bind"));
    let bind_started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..size.bind_concurrency {
        let (targets, next, failures, client, url) = (
            targets.clone(),
            next.clone(),
            failures.clone(),
            client.clone(),
            bind_url.clone(),
        );
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(body) = targets.get(i) else { break };
                match post(&client, &url, body.clone()).await {
                    Ok((200, _)) => {}
                    _ => {
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    let bind_took = bind_started.elapsed();
    api.clear_faults();
    let failed = failures.load(Ordering::SeqCst);
    if failed > 0 {
        bail!("{failed} of {} binds failed", size.binds);
    }
    let rate = size.binds as f64 / bind_took.as_secs_f64().max(1e-9);
    figures.push(Figure {
        name: "bind throughput (1 ms API latency on PATCH and Binding)".to_string(),
        value: format!(
            "{rate:.0} binds/s ({} binds, {} concurrent)",
            size.binds, size.bind_concurrency
        ),
        budget: ">= 500 binds/s".to_string(),
        pass: Some(rate >= 500.0),
    });

    let (rss, peak) = extender.memory();
    figures.push(Figure {
        name: "extender resident memory after the run: peak / now".to_string(),
        value: format!("{:.1} MiB / {:.1} MiB", mib(peak), mib(rss)),
        budget: "< 256 MiB".to_string(),
        pass: Some(peak > 0 && peak < 256 * 1024 * 1024),
    });
    extender.stop().await;

    Ok(figures)
}

/// Every state the extenders' Lease goes through, (holder, renewTime), with the moment this
/// process saw it, from a watch of its own: a release followed at once by a takeover is two
/// entries, where polling the store could see only the second.
/// A Lease state as the log keeps it: (holderIdentity, renewTime).
type LeaseState = (String, String);

struct LeaseLog {
    entries: Arc<std::sync::Mutex<Vec<(LeaseState, Instant)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseLog {
    fn start(api: &ApiServer, config: &Config) -> LeaseLog {
        use futures::StreamExt as _;
        use k8s_openapi::api::coordination::v1::Lease;
        use kube::runtime::watcher;
        let leases: kube::Api<Lease> =
            kube::Api::namespaced(api.admin_client(), &config.extender.lease_namespace);
        let fields = format!("metadata.name={}", config.extender.lease_name);
        let entries = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = entries.clone();
        let task = tokio::spawn(async move {
            let mut stream =
                std::pin::pin!(watcher(leases, watcher::Config::default().fields(&fields)));
            while let Some(ev) = stream.next().await {
                let state = |l: &Lease| {
                    let spec = serde_json::to_value(&l.spec).unwrap_or(Value::Null);
                    (
                        spec["holderIdentity"].as_str().unwrap_or("").to_string(),
                        spec["renewTime"].as_str().unwrap_or("").to_string(),
                    )
                };
                let seen = match ev {
                    Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => state(&l),
                    Ok(watcher::Event::Delete(_)) => (String::new(), String::new()),
                    Ok(watcher::Event::Init | watcher::Event::InitDone) | Err(_) => continue,
                };
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                if log.last().map(|(s, _)| s) != Some(&seen) {
                    log.push((seen, Instant::now()));
                }
            }
        });
        LeaseLog { entries, task }
    }

    /// How many states have been seen so far: `wait` from here looks only at later ones.
    fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Waits for the first state at index `from` or later for which `done` holds; returns
    /// its index, the state and when it was seen.
    async fn wait(
        &self,
        from: usize,
        limit: Duration,
        mut done: impl FnMut(&(String, String)) -> bool,
    ) -> anyhow::Result<(usize, (String, String), Instant)> {
        let end = Instant::now() + limit;
        loop {
            {
                let log = self.entries.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((i, (state, at))) = log
                    .iter()
                    .enumerate()
                    .skip(from)
                    .find(|(_, (s, _))| done(s))
                {
                    return Ok((i, state.clone(), *at));
                }
                if Instant::now() > end {
                    let tail: Vec<_> = log.iter().skip(from).map(|(s, _)| s).collect();
                    bail!(
                        "the Lease did not reach the expected state within {limit:?}; states seen since: {tail:?}"
                    );
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl Drop for LeaseLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds a fresh probe pod through `replica` every 20 ms until one answers 200 (the old
/// leader is gone by then, so the answer is the new leader's own); returns when.
async fn first_own_bind(
    api: &ApiServer,
    client: &HttpClient,
    config: &Config,
    replica: &Extender,
    label: &str,
    limit: Duration,
) -> anyhow::Result<Instant> {
    let created = api.create_object(pending_pod(&format!("failover-{label}"), 1))?;
    let uid = created["metadata"]["uid"].as_str().unwrap_or_default();
    let body = Bytes::from(serde_json::to_vec(&json!({
        "PodName": format!("failover-{label}"), "PodNamespace": "default",
        "PodUID": uid, "Node": node_name(0),
    }))?);
    let url = format!("http://{}{}/bind", replica.addr, config.extender.url_prefix);
    let end = Instant::now() + limit;
    loop {
        if let Ok((200, _)) = post(client, &url, body.clone()).await {
            return Ok(Instant::now());
        }
        if Instant::now() > end {
            bail!("no bind through the new leader succeeded within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn failover_figures(
    api: &ApiServer,
    client: &HttpClient,
    config: &Config,
) -> anyhow::Result<Vec<Figure>> {
    let lease = Duration::from_secs(config.extender.lease_duration_secs);
    let limit = Duration::from_secs(600);
    let log = LeaseLog::start(api, config);
    let mut a = Extender::start(api, Some("bench-a")).await?;
    a.wait_synced().await?;
    let (led, _, _) = log
        .wait(0, limit, |(h, _)| h.starts_with("bench-a"))
        .await?;
    let mut b = Extender::start(api, Some("bench-b")).await?;
    b.wait_synced().await?;
    let standby_ready = format!("http://{}/readyz", b.addr);
    let end = Instant::now() + limit;
    while get(client, &standby_ready).await.map(|r| r.0).ok() != Some(200) {
        if Instant::now() > end {
            bail!("the standby never turned Ready");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut figures = Vec::new();

    // Stopped: SIGTERM, the leader drains and clears holderIdentity.
    // The release is the first state after a's own that a no longer holds (normally the
    // cleared holder, then b's takeover right after it).
    let (b_cpu, api_cpu) = (b.cpu_seconds(), cpu_seconds_of(std::process::id()));
    let _ = nix_signal(a.pid, "TERM");
    let (released, _, released_at) = log
        .wait(led, limit, |(h, _)| !h.starts_with("bench-a"))
        .await?;
    let served_at = first_own_bind(api, client, config, &b, "stopped", limit).await?;
    let (b_cpu, api_cpu) = (
        b.cpu_seconds() - b_cpu,
        cpu_seconds_of(std::process::id()) - api_cpu,
    );
    let (_, _, acquired_at) = log
        .wait(released, limit, |(h, _)| h.starts_with("bench-b"))
        .await?;
    let _ = a.child.wait().await;
    let stopped = served_at.saturating_duration_since(released_at);
    figures.push(Figure {
        name: "failover, leader stopped (SIGTERM releases the Lease): Lease free to the new leader's first bind".to_string(),
        value: format!(
            "{:.2} s (taken over after {:.2} s, then the rebuild: a fresh list of {} pods; CPU meanwhile: the new leader {b_cpu:.2} s, the API server and the load {api_cpu:.2} s)",
            stopped.as_secs_f64(),
            acquired_at.saturating_duration_since(released_at).as_secs_f64(),
            api.list_objects("pods", None).len()
        ),
        budget: "<= 5 s".to_string(),
        pass: Some(stopped <= Duration::from_secs(5)),
    });

    // Killed: SIGKILL, the Lease is free once it has not changed for its duration.
    let mut c = Extender::start(api, Some("bench-c")).await?;
    c.wait_synced().await?;
    let standby_ready = format!("http://{}/readyz", c.addr);
    let end = Instant::now() + limit;
    while get(client, &standby_ready).await.map(|r| r.0).ok() != Some(200) {
        if Instant::now() > end {
            bail!("the second standby never turned Ready");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Kill right after a renewal lands, so the Lease's last change is known to the ms.
    let (renewed, _, renewed_at) = log
        .wait(log.len(), limit, |(h, _)| h.starts_with("bench-b"))
        .await?;
    let _ = b.child.start_kill();
    let free_at = renewed_at + lease;
    let served_at = first_own_bind(api, client, config, &c, "killed", limit).await?;
    let (_, _, acquired_at) = log
        .wait(renewed, limit, |(h, _)| h.starts_with("bench-c"))
        .await?;
    let killed = served_at.saturating_duration_since(free_at);
    figures.push(Figure {
        name: format!(
            "failover, leader killed (SIGKILL): Lease expiry ({} s after its last renewal) to the new leader's first bind",
            lease.as_secs()
        ),
        value: format!(
            "{:.2} s (taken over {:.2} s after expiry; {:.2} s after the last renewal in all)",
            killed.as_secs_f64(),
            acquired_at.saturating_duration_since(free_at).as_secs_f64(),
            served_at.saturating_duration_since(renewed_at).as_secs_f64()
        ),
        budget: "<= 5 s".to_string(),
        pass: Some(killed <= Duration::from_secs(5)),
    });
    b.stop().await;
    c.stop().await;
    Ok(figures)
}

/// Sends `signal` (a `kill -s` name) to `pid`.
fn nix_signal(pid: u32, signal: &str) -> std::io::Result<std::process::ExitStatus> {
    std::process::Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
}

/// The real `gpushare device-plugin` binary in a process of its own (fake GPU backend,
/// 8 × 16 GiB), registering with a fresh sandbox kubelet in `dir`, against `api`, its state
/// directory (where its answers are durable before they are returned) `state_dir`; with
/// `preflight`, its node preflight (doctor) on, as it ships.
fn spawn_device_plugin(
    api: &ApiServer,
    kubelet: &gpushare_sandbox::kubelet::Kubelet,
    node: &str,
    state_dir: &std::path::Path,
    preflight: bool,
) -> anyhow::Result<tokio::process::Child> {
    let mut command = tokio::process::Command::new(gpushare_binary());
    command
        .arg("device-plugin")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("KUBECONFIG", api.admin_kubeconfig_path())
        .env("NODE_NAME", node)
        .env("LOG_LEVEL", "warn")
        .env("GPUSHARE_GPU__BACKEND", "fake")
        .env(
            "GPUSHARE_GPU__FAKE_GPUS",
            format!("{GPUS_PER_NODE}x{GPU_UNITS}GiB"),
        )
        .env(
            "GPUSHARE_DEVICE_PLUGIN__DEVICE_PLUGIN_DIR",
            kubelet.device_plugin_dir(),
        )
        .env(
            "GPUSHARE_DEVICE_PLUGIN__POD_RESOURCES_SOCKET",
            kubelet.pod_resources_socket(),
        )
        .env("GPUSHARE_DEVICE_PLUGIN__ADMIN_ADDRESS", "")
        .env("GPUSHARE_DEVICE_PLUGIN__STATE_DIR", state_dir)
        .kill_on_drop(true)
        .stdout(std::process::Stdio::null())
        // The preflight's report goes to stderr: not part of the figures.
        .stderr(if preflight {
            std::process::Stdio::null()
        } else {
            std::process::Stdio::inherit()
        });
    if !preflight {
        command.env("GPUSHARE_DOCTOR__SKIP", "true");
    }
    command.spawn().context("starting gpushare device-plugin")
}

/// Where the device plugin's state directory goes: tmpfs (`/dev/shm`), as
/// `/var/run/gpushare` is on a node; `/tmp` where there is none.
fn tmpfs() -> &'static std::path::Path {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::path::Path::new("/tmp")
    }
}

/// How many times registration is timed (each a fresh process and kubelet); the median is
/// the figure.
const REGISTRATIONS: usize = 7;

/// The device plugin's figures: registration from exec with the preflight on (the median of
/// [`REGISTRATIONS`] starts), the idle footprint, and kubelet's GetPreferredAllocation +
/// Allocate (as kubelet calls them at container start) for each of `dp_pods` pods bound to
/// the node. With `api_delay`, every request to the API server waits that long first (a real
/// API server's latency): Allocate must not wait on it, and the pods' ASSIGNED annotations
/// must land all the same.
async fn device_plugin_figures(
    size: Size,
    api_delay: Option<Duration>,
) -> anyhow::Result<Vec<Figure>> {
    use gpushare_sandbox::kubelet::Kubelet;

    let api = ApiServer::start().await?;
    let node = "dp-node";
    api.create_object(node_named(node))?;
    for i in 0..size.dp_pods {
        let mut pod = bound_pod(i, node, i as u64 % GPUS_PER_NODE, 1);
        pod["metadata"]["annotations"][ANN_ASSIGNED] = json!("false");
        pod["metadata"]["annotations"][ANN_ASSUME_TIME] =
            json!((1_700_000_000_000_000_000u64 + i as u64).to_string());
        pod["status"]["phase"] = json!("Pending");
        api.create_object(pod)?;
    }
    let label = match api_delay {
        Some(d) => format!(" ({} ms API latency)", d.as_millis()),
        None => String::new(),
    };
    if let Some(delay) = api_delay {
        api.inject(Fault::new(None, "", FaultAction::Delay(delay)).times(usize::MAX / 2));
    }
    let mut figures = Vec::new();

    // Registration from exec, preflight on: fresh processes and kubelets, the median.
    if api_delay.is_none() {
        let mut took = Vec::with_capacity(REGISTRATIONS);
        for _ in 0..REGISTRATIONS {
            let dir = tempfile::Builder::new()
                .prefix("gpushare-bench-dp")
                .tempdir()
                .context("temporary folder")?;
            let kubelet = Kubelet::start(dir.path()).await?;
            let started = Instant::now();
            let state = tempfile::Builder::new()
                .prefix("gpushare-bench-dp-state")
                .tempdir_in(tmpfs())
                .context("temporary folder")?;
            let mut child = spawn_device_plugin(&api, &kubelet, node, state.path(), true)?;
            kubelet
                .wait_registered(RESOURCE_GPU_MEM)
                .await
                .context("the device plugin did not register (preflight on)")?;
            took.push(started.elapsed());
            let _ = child.start_kill();
            let _ = child.wait().await;
            kubelet.stop().await;
        }
        let runs: Vec<String> = took
            .iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1000.0))
            .collect();
        took.sort();
        let median = percentile(&took, 0.5);
        figures.push(
            Figure::new(
                "device plugin: registration from exec, preflight on (median)",
                format!(
                    "{:.1} ms (starts: {} ms)",
                    median.as_secs_f64() * 1000.0,
                    runs.join(" / ")
                ),
            )
            .budget("<= 25 ms", median <= Duration::from_millis(25)),
        );
    }

    let dir = tempfile::Builder::new()
        .prefix("gpushare-bench-dp")
        .tempdir()
        .context("temporary folder")?;
    // The plugin's state directory on tmpfs, as its default under /var/run is on a node.
    let state = tempfile::Builder::new()
        .prefix("gpushare-bench-dp-state")
        .tempdir_in(tmpfs())
        .context("temporary folder")?;
    let kubelet = Kubelet::start(dir.path()).await?;
    let mut child = spawn_device_plugin(&api, &kubelet, node, state.path(), false)?;
    let pid = child.id().context("the device plugin exited at once")?;
    let status_path = format!("/proc/{pid}/status");
    kubelet
        .wait_registered(RESOURCE_GPU_MEM)
        .await
        .context("the device plugin did not register")?;
    let idle = rss_of(&status_path);
    // The floor: a call that does none of the plugin's work, over the same connection.
    let mut floor = Vec::with_capacity(size.dp_pods);
    for _ in 0..size.dp_pods {
        let started = Instant::now();
        kubelet
            .device_plugin_options(RESOURCE_GPU_MEM)
            .await
            .context("GetDevicePluginOptions")?;
        floor.push(started.elapsed());
    }
    floor.sort();
    let mut took = Vec::with_capacity(size.dp_pods);
    for i in 0..size.dp_pods {
        let pod = format!("job-{i:06}");
        let started = Instant::now();
        let (_, resp) = kubelet
            .allocate_container(RESOURCE_GPU_MEM, "default", &pod, "main", 1)
            .await
            .with_context(|| format!("Allocate for {pod}"))?;
        took.push(started.elapsed());
        let visible = resp
            .envs
            .get(gpushare::core::wire::ENV_VISIBLE_DEVICES)
            .cloned()
            .unwrap_or_default();
        if visible.is_empty() || visible.starts_with("no-gpu-has") {
            bail!("Allocate for {pod} did not get a GPU: NVIDIA_VISIBLE_DEVICES={visible:?}");
        }
    }
    let last_answered = Instant::now();
    // Every pod's ASSIGNED=true reaches the API (after the answers, with the API's latency).
    let end = last_answered + Duration::from_secs(120);
    let assigned = |api: &ApiServer| {
        api.list_objects("pods", Some("default"))
            .iter()
            .filter(|p| p["metadata"]["annotations"][ANN_ASSIGNED] == "true")
            .count()
    };
    while assigned(&api) < size.dp_pods {
        if Instant::now() > end {
            bail!(
                "only {} of {} pods were marked ASSIGNED within 120 s of the last Allocate",
                assigned(&api),
                size.dp_pods
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let all_assigned = last_answered.elapsed();
    let after = rss_of(&status_path);
    let _ = child.start_kill();
    let _ = child.wait().await;
    kubelet.stop().await;
    took.sort();
    let (p50, p99) = (percentile(&took, 0.50), percentile(&took, 0.99));
    if api_delay.is_none() {
        figures.push(
            Figure::new(
                "device plugin: idle resident memory (own process)",
                format!(
                    "{:.1} MiB ({:.1} MiB after the Allocates)",
                    mib(idle),
                    mib(after)
                ),
            )
            .budget("< 32 MiB", idle > 0 && idle < 32 * 1024 * 1024),
        );
    }
    figures.push(Figure::new(
        format!("device plugin: the floor, an empty call (GetDevicePluginOptions) p50 / p99{label}"),
        format!(
            "{} / {} (kubelet makes two calls per container: twice this is the least the next line can be here)",
            ms(percentile(&floor, 0.50)),
            ms(percentile(&floor, 0.99)),
        ),
    ));
    figures.push(
        Figure::new(
            format!("device plugin: GetPreferredAllocation + Allocate p50 / p99{label}"),
            format!(
                "{} / {} ({} pods on the node)",
                ms(p50),
                ms(p99),
                size.dp_pods
            ),
        )
        .budget(
            "p50 <= 0.3 ms, p99 <= 1 ms",
            p50 <= Duration::from_micros(300) && p99 <= Duration::from_millis(1),
        ),
    );
    figures.push(Figure::new(
        format!("device plugin: every pod's ASSIGNED=true in the API{label}"),
        format!(
            "{:.1} ms after the last Allocate answer ({} pods)",
            all_assigned.as_secs_f64() * 1000.0,
            size.dp_pods
        ),
    ));
    Ok(figures)
}

fn render(figures: &[Figure], size: Size, bench: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## gpushare scale bench ({})\n",
        if bench { "full" } else { "smoke" }
    );
    let _ = writeln!(
        out,
        "{} nodes × {GPUS_PER_NODE} GPUs ({GPU_UNITS} GiB each), {} pods; the extender and the \
         device plugin in processes of their own, the sandbox API server and the load in this \
         one, all on the same {} CPUs; {} build.\n",
        size.nodes,
        size.pods,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if cfg!(debug_assertions) {
            "DEBUG (unoptimised: figures are not representative)"
        } else {
            "release"
        }
    );
    let _ = writeln!(out, "| figure | measured | budget | verdict |");
    let _ = writeln!(out, "| --- | --- | --- | --- |");
    for f in figures {
        let verdict = match f.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            f.name, f.value, f.budget, verdict
        );
    }
    let mut counts = BTreeMap::new();
    for f in figures {
        if let Some(p) = f.pass {
            *counts.entry(p).or_insert(0) += 1;
        }
    }
    let _ = writeln!(
        out,
        "\n{} PASS, {} FAIL",
        counts.get(&true).unwrap_or(&0),
        counts.get(&false).unwrap_or(&0)
    );
    out
}
