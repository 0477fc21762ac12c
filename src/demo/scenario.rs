//! The demo scenario: the sandbox cluster, the two roles in-process, and the scheduler and
//! kubelet played step by step. Every outcome is compared with what the core's placement
//! rules predict for the configured GPUs; mismatches are collected, not panicked on.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow};
use bytes::Bytes;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use crate::config::Config;
use crate::core::ledger::{GpuSpec, LedgerPod, NodeLedger, PodState};
use crate::core::memory::{GpuMem, MemoryUnit};
use crate::core::placement::{GpuPolicy, choose_gpu};
use crate::core::wire::{
    ENV_CONTAINER_MEM, ENV_DEVICE_MEM, ENV_GPU_INDEX, ENV_VISIBLE_DEVICES, HEALTHY,
    RESOURCE_GPU_MEM,
};
use crate::gpu::GpuBackend;
use crate::gpu::fake::FakeBackend;
use crate::inspect::report::Report;
use crate::inspect::{Format, render_report};
use crate::outbound;
use crate::shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::kubelet::Kubelet;

const NODE: &str = "gpu-node-1";
const NAMESPACE: &str = "default";

/// How the demo went.
#[derive(Clone, Debug, Default)]
pub struct DemoOutcome {
    /// Expectations checked.
    pub checks: usize,
    /// The ones that did not hold.
    pub failures: Vec<String>,
}

impl DemoOutcome {
    pub(super) fn expect(&mut self, out: &mut dyn Write, what: &str, held: bool, detail: String) {
        self.checks += 1;
        let _ = writeln!(
            out,
            "  {} {what}{}",
            if held { "✔" } else { "✘" },
            if held {
                String::new()
            } else {
                format!(": {detail}")
            }
        );
        if !held {
            self.failures.push(format!("{what}: {detail}"));
        }
    }
}

/// The pods of demo 1, each asking half of GPU 0.
pub(super) const BINPACK_PODS: [&str; 3] = ["binpack-1", "binpack-2", "binpack-3"];

/// The steps both paths print and check alike (the default demo here, `--dra` in
/// [`super::dra`]): the GPUs asked for, the core's prediction of every placement, the demos'
/// headings and the check of each pod's GPU. The path plays its own cluster between the steps.
pub(super) struct Walkthrough {
    /// Each GPU's memory in GiB.
    pub(super) gpu_units: Vec<u64>,
    /// The placements the core's rules predict.
    model: NodeLedger,
    /// The checks so far.
    pub(super) outcome: DemoOutcome,
}

impl Walkthrough {
    /// The fake GPUs of `fake_gpus` (at least two of at least 2 GiB) and the walkthrough over
    /// them.
    pub(super) fn new(fake_gpus: &str) -> anyhow::Result<(Walkthrough, FakeBackend)> {
        let backend = FakeBackend::from_spec(fake_gpus).map_err(|e| anyhow!("--fake-gpus: {e}"))?;
        let gpu_units: Vec<u64> = backend
            .devices()
            .iter()
            .map(|d| MemoryUnit::GIB.units_of_bytes(d.memory_bytes).units())
            .collect();
        anyhow::ensure!(
            gpu_units.len() >= 2 && gpu_units.iter().all(|u| *u >= 2),
            "the demo needs at least two GPUs of at least 2 GiB (got {fake_gpus})"
        );
        let model = NodeLedger::new(
            &gpu_units
                .iter()
                .map(|u| GpuSpec {
                    total: GpuMem::new(*u),
                    healthy: true,
                })
                .collect::<Vec<_>>(),
        );
        let walk = Walkthrough {
            gpu_units,
            model,
            outcome: DemoOutcome::default(),
        };
        Ok((walk, backend))
    }

    /// What each pod of demo 1 asks: half of GPU 0, in GiB.
    pub(super) fn half(&self) -> u64 {
        self.gpu_units[0] / 2
    }

    /// The GiB the model holds in use.
    pub(super) fn used(&self) -> u64 {
        self.model.used().units()
    }

    /// Demo 1's heading.
    pub(super) fn demo1(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "━━ Demo 1: binpack — three pods of {} GiB (half of GPU 0) each ━━",
            self.half()
        )
    }

    /// The GPU the core's rules give demo 1's pod `name` now (recorded in the model).
    pub(super) fn predict(&mut self, name: &str) -> Option<u32> {
        let half = GpuMem::new(self.half());
        let expected = choose_gpu(&self.model, half, GpuPolicy::Binpack).ok();
        if let Some(gpu) = expected {
            self.model.apply_pod(
                name.to_string(),
                LedgerPod {
                    gpu,
                    mem: half,
                    state: PodState::Assigned,
                },
            );
        }
        expected
    }

    /// Checks that pod `name` got the GPU predicted.
    pub(super) fn placed(
        &mut self,
        out: &mut dyn Write,
        name: &str,
        expected: Option<u32>,
        got: Option<u32>,
    ) {
        self.outcome.expect(
            out,
            &format!(
                "{name} runs on GPU {}",
                expected.map_or("-".to_string(), |g| g.to_string())
            ),
            got == expected,
            format!("it got {got:?}"),
        );
    }

    /// Demo 2's heading and its first step: binpack-1 finishes (gone from the model).
    pub(super) fn demo2(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "\n━━ Demo 2: the node has room, but no single GPU does ━━"
        )?;
        writeln!(
            out,
            "▸ binpack-1 finishes; its {} GiB on GPU 0 are free again",
            self.half()
        )?;
        self.model.remove_pod("binpack-1");
        Ok(())
    }

    /// Demo 2's ask: binpack-4 wants all of GPU 0, printed with what the node has free.
    /// Returns the GiB asked and whether one GPU has that room (the layout decides).
    pub(super) fn big_ask(&self, out: &mut dyn Write) -> std::io::Result<(u64, bool)> {
        let big = self.gpu_units[0];
        let free: u64 = self.model.gpus().iter().map(|g| g.free().units()).sum();
        let fits_one_gpu = choose_gpu(&self.model, GpuMem::new(big), GpuPolicy::Binpack).is_ok();
        writeln!(
            out,
            "▸ the node has {free} GiB free in total; binpack-4 asks for {big} GiB"
        )?;
        Ok((big, fits_one_gpu))
    }
}

/// What the played kube-scheduler decided for one pod.
enum Scheduled {
    Bound { score: Option<i64> },
    Pending { message: String },
}

/// Runs both demos against in-process components, writing the walkthrough to `out`.
pub async fn run_scenario(
    fake_gpus: &str,
    out: &mut dyn Write,
    keep_running: bool,
) -> anyhow::Result<DemoOutcome> {
    let (mut walk, backend) = Walkthrough::new(fake_gpus)?;
    let unit = MemoryUnit::GIB;
    let gpu_units = walk.gpu_units.clone();

    writeln!(
        out,
        "gpushare demo — a sandbox cluster with one node and {} fake GPUs ({fake_gpus})\n",
        gpu_units.len()
    )?;
    let (trigger, stop) = shutdown::channel();
    let api = ApiServer::start()
        .await
        .context("starting the sandbox API server")?;
    api.seed_yaml(&node_yaml())?;
    writeln!(
        out,
        "▸ sandbox API server on {} (kubeconfig {})",
        api.url(),
        api.admin_kubeconfig_path().display()
    )?;

    let root = tempfile::Builder::new()
        .prefix("gsd")
        .tempdir_in("/tmp")
        .context("creating the kubelet directory")?;
    let kubelet = Kubelet::start(root.path())
        .await
        .context("starting the fake kubelet")?;
    let mut config = demo_config(&kubelet, unit);
    config.device_plugin.state_dir = root.path().join("state");

    let backend: Arc<dyn GpuBackend> = Arc::new(backend);
    let plugin = crate::deviceplugin::start(&config, api.admin_client(), backend, stop.clone())
        .await
        .context("starting the device plugin")?;
    let info = kubelet.wait_registered(RESOURCE_GPU_MEM).await?;
    let devices = kubelet.devices(RESOURCE_GPU_MEM);
    let healthy = devices.iter().filter(|d| d.health == HEALTHY).count();
    writeln!(
        out,
        "▸ device plugin registered with the kubelet as {} on {}: {} fake devices ({} GiB in GPUs of {:?} GiB)",
        info.resource_name,
        info.endpoint,
        devices.len(),
        healthy,
        gpu_units
    )?;
    // kubelet publishes the plugin's device count as the node's capacity.
    let nodes: Api<Node> = Api::all(api.admin_client());
    let capacity = json!({ "status": {
        "capacity": { RESOURCE_GPU_MEM: healthy.to_string() },
        "allocatable": { RESOURCE_GPU_MEM: healthy.to_string() },
    }});
    nodes
        .patch_status(NODE, &PatchParams::default(), &Patch::Merge(&capacity))
        .await?;

    let extender = crate::extender::start(&config, api.admin_client(), stop.clone()).await?;
    extender.wait_ready().await?;
    let scheduler = PlayedScheduler::new(format!(
        "http://{}{}",
        extender.addr, config.extender.url_prefix
    ));
    scheduler.wait_for_node(gpu_units.len()).await?;
    writeln!(
        out,
        "▸ extender ready on http://{}{} (filter, prioritize, bind)\n",
        extender.addr, config.extender.url_prefix
    )?;

    // The core's rules predict every placement; the demo checks the live system agrees.
    let half = walk.half();
    walk.demo1(out)?;
    for name in BINPACK_PODS {
        let expected = walk.predict(name);
        let got = schedule_and_start(&api, &scheduler, &kubelet, name, half, out).await?;
        walk.placed(out, name, expected, got);
    }
    show_inspect(&api, out, Format::Table).await?;

    let got = run_demo2(&mut walk, &api, &scheduler, &kubelet, out).await?;

    // The plugin keeps the records of the pods still running (binpack-1's may be dropped
    // already: it is gone).
    let allocations = plugin.allocations().await;
    let recorded: std::collections::BTreeSet<&str> =
        allocations.iter().map(|a| a.name.as_str()).collect();
    let mut running = vec!["binpack-2", "binpack-3"];
    if got.is_some() {
        running.push("binpack-4");
    }
    walk.outcome.expect(
        out,
        "the device plugin answered every container start from the extender's choice",
        running.iter().all(|p| recorded.contains(p))
            && recorded
                .iter()
                .all(|p| *p == "binpack-1" || running.contains(p)),
        format!("allocations recorded for {recorded:?}"),
    );

    if keep_running {
        keep_sandbox_up(&api, out).await?;
    }
    trigger.trigger();
    extender.stop().await;
    plugin.stop().await;
    kubelet.stop().await;
    api.shutdown().await;
    Ok(walk.outcome)
}

/// The configuration of the demo's roles: the sandbox node, the fake kubelet's directories,
/// the memory in `unit`, the extender on a free local port.
fn demo_config(kubelet: &Kubelet, unit: MemoryUnit) -> Config {
    let mut config = Config::default();
    config.node.node_name = NODE.to_string();
    config.device_plugin.device_plugin_dir = kubelet.device_plugin_dir();
    config.device_plugin.pod_resources_socket = kubelet.pod_resources_socket();
    config.device_plugin.admin_address = String::new();
    config.node.memory_unit = unit;
    config.extender.bind_address = std::net::IpAddr::from([127, 0, 0, 1]);
    config.extender.port = 0;
    config
}

/// Demo 2: binpack-1 deleted, then a pod asking more than any GPU has free: it runs when
/// one GPU has room, else stays Pending. The GPU it got.
async fn run_demo2(
    walk: &mut Walkthrough,
    api: &ApiServer,
    scheduler: &PlayedScheduler,
    kubelet: &Kubelet,
    out: &mut dyn Write,
) -> anyhow::Result<Option<u32>> {
    walk.demo2(out)?;
    api.delete_object("pods", Some(NAMESPACE), "binpack-1")?;
    kubelet.release_pod(NAMESPACE, "binpack-1");
    scheduler.wait_for_used(walk.used()).await?;
    let (big, fits_one_gpu) = walk.big_ask(out)?;
    let got = schedule_and_start(api, scheduler, kubelet, "binpack-4", big, out).await?;
    let pod: Option<Pod> = api.get_as("pods", Some(NAMESPACE), "binpack-4");
    let phase = pod
        .and_then(|p| p.status)
        .and_then(|s| s.phase)
        .unwrap_or_default();
    if fits_one_gpu {
        walk.outcome.expect(
            out,
            "binpack-4 fits on one GPU with this layout",
            got.is_some(),
            format!("it got {got:?}"),
        );
    } else {
        walk.outcome.expect(
            out,
            "binpack-4 stays Pending: no single GPU has room",
            got.is_none() && phase == "Pending",
            format!("it got {got:?}, phase {phase}"),
        );
    }
    show_inspect(api, out, Format::Wide).await?;
    Ok(got)
}

/// Plays kube-scheduler and then kubelet for one single-container pod; returns the GPU it
/// runs on, or `None` when it stays Pending.
async fn schedule_and_start(
    api: &ApiServer,
    scheduler: &PlayedScheduler,
    kubelet: &Kubelet,
    name: &str,
    units: u64,
    out: &mut dyn Write,
) -> anyhow::Result<Option<u32>> {
    let pod = api.create_object(pod_json(name, units))?;
    writeln!(out, "▸ {name}: created, limits aliyun.com/gpu-mem: {units}")?;
    match scheduler.schedule(api, &pod, units).await? {
        Scheduled::Pending { message } => {
            writeln!(out, "  scheduler: {message}")?;
            writeln!(out, "  {name} stays Pending")?;
            Ok(None)
        }
        Scheduled::Bound { score } => {
            let score = score
                .map(|s| format!(" (prioritize score {s})"))
                .unwrap_or_default();
            let bound: Pod = api
                .get_as("pods", Some(NAMESPACE), name)
                .ok_or_else(|| anyhow!("{name} vanished after bind"))?;
            let ann = bound.metadata.annotations.unwrap_or_default();
            let idx = ann
                .get(crate::core::wire::ANN_GPU_INDEX)
                .cloned()
                .unwrap_or_default();
            writeln!(
                out,
                "  scheduler: filter passed {NODE}{score}; bind chose GPU {idx}"
            )?;
            let (_ids, response) = kubelet
                .allocate_container(RESOURCE_GPU_MEM, NAMESPACE, name, "app", units as usize)
                .await
                .with_context(|| format!("kubelet Allocate for {name}"))?;
            let env = |k: &str| response.envs.get(k).cloned().unwrap_or_default();
            writeln!(
                out,
                "  kubelet: Allocate → {ENV_VISIBLE_DEVICES}={} {ENV_GPU_INDEX}={} {ENV_CONTAINER_MEM}={} {ENV_DEVICE_MEM}={}",
                env(ENV_VISIBLE_DEVICES),
                env(ENV_GPU_INDEX),
                env(ENV_CONTAINER_MEM),
                env(ENV_DEVICE_MEM)
            )?;
            api.set_pod_phase(NAMESPACE, name, "Running")?;
            Ok(env(ENV_GPU_INDEX).parse().ok())
        }
    }
}

async fn show_inspect(api: &ApiServer, out: &mut dyn Write, format: Format) -> anyhow::Result<()> {
    let nodes: Vec<Node> = api
        .list_objects("nodes", None)
        .into_iter()
        .filter_map(|v| crate::k8s::decode::from_value(&v).ok())
        .collect();
    let pods: Vec<Pod> = api
        .list_objects("pods", None)
        .into_iter()
        .filter_map(|v| crate::k8s::decode::from_value(&v).ok())
        .collect();
    let report = Report::from_cluster(&nodes, &pods, None);
    writeln!(
        out,
        "\n$ kubectl inspect gpushare{}",
        if format == Format::Wide {
            " -o wide"
        } else {
            ""
        }
    )?;
    write!(out, "{}", render_report(&report, format, false))?;
    Ok(())
}

async fn keep_sandbox_up(api: &ApiServer, out: &mut dyn Write) -> anyhow::Result<()> {
    let dir = api
        .admin_kubeconfig_path()
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or_default();
    let link = dir.join(crate::buildinfo::KUBECTL_PLUGIN_NAME);
    if let Ok(exe) = std::env::current_exe() {
        let _ = std::fs::remove_file(&link);
        let _ = std::os::unix::fs::symlink(exe, &link);
    }
    // Listen before the instructions go out: a SIGTERM sent as soon as they are read cleans up
    // like Ctrl-C (the caller stops every role and the sandbox directory goes with it).
    let stop = crate::shutdown::listen_for_signal();
    writeln!(out, "\nThe sandbox keeps running. In another shell:\n")?;
    writeln!(
        out,
        "  export KUBECONFIG={}",
        api.admin_kubeconfig_path().display()
    )?;
    writeln!(out, "  export PATH={}:$PATH", dir.display())?;
    writeln!(out, "  kubectl get pods -o wide")?;
    writeln!(out, "  kubectl inspect gpushare -d\n")?;
    writeln!(
        out,
        "Press Ctrl-C (or send SIGTERM) to stop; the sandbox is then removed."
    )?;
    out.flush()?;
    stop.await;
    Ok(())
}

fn node_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    gpushare: \"true\"\n    kubernetes.io/hostname: {NODE}\nstatus:\n  addresses:\n  - type: InternalIP\n    address: 192.168.0.71\n  conditions:\n  - type: Ready\n    status: \"True\"\n"
    )
}

fn pod_json(name: &str, units: u64) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": NAMESPACE, "labels": { "app": name } },
        "spec": { "containers": [{
            "name": "app",
            "image": "cheyang/gpu-player:v2",
            "resources": { "limits": { RESOURCE_GPU_MEM: units.to_string() } }
        }]},
        "status": { "phase": "Pending" }
    })
}

/// kube-scheduler, reduced to what the demo needs: the aggregate resource fit it does itself,
/// then the extender's filter, prioritize and bind over HTTP.
struct PlayedScheduler {
    base: String,
    http: outbound::Client,
}

impl PlayedScheduler {
    fn new(base: String) -> Self {
        PlayedScheduler {
            base,
            http: outbound::Client::plain(),
        }
    }

    async fn call(
        &self,
        method: http::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let request = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Bytes::from(body))?;
        let response = self
            .http
            .send(request, Duration::from_secs(10))
            .await
            .context("the extender did not answer")?;
        let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        Ok((response.status.as_u16(), value))
    }

    /// Polls the extender's inspect until `check` holds (deadline 10 s).
    async fn wait_inspect(&self, what: &str, check: impl Fn(&Value) -> bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok((200, v)) = self
                .call(http::Method::GET, &format!("/inspect/{NODE}"), None)
                .await
                && check(&v)
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("the extender never saw {what}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_for_node(&self, gpus: usize) -> anyhow::Result<()> {
        self.wait_inspect("the node's GPUs", |v| {
            node_of(v)
                .and_then(|n| n["devs"].as_array())
                .is_some_and(|d| d.len() == gpus)
        })
        .await
    }

    async fn wait_for_used(&self, used: u64) -> anyhow::Result<()> {
        self.wait_inspect("the released memory", |v| {
            node_of(v).and_then(|n| n["usedGPU"].as_u64()) == Some(used)
        })
        .await
    }

    async fn schedule(
        &self,
        api: &ApiServer,
        pod: &Value,
        units: u64,
    ) -> anyhow::Result<Scheduled> {
        // NodeResourcesFit on the node's aggregate gpu-mem, as kube-scheduler does first.
        let node: Node = api
            .get_as("nodes", None, NODE)
            .ok_or_else(|| anyhow!("node {NODE} vanished"))?;
        let allocatable = crate::k8s::node_gpus(&node, true).capacity.units();
        let requested: u64 = api
            .list_objects("pods", None)
            .into_iter()
            .filter_map(|v| crate::k8s::decode::from_value::<Pod>(&v).ok())
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE))
            .filter(|p| !crate::k8s::pod_is_terminal(p))
            .filter_map(|p| crate::k8s::pod_gpu_request(&p).ok())
            .map(|r| r.total().units())
            .sum();
        if requested + units > allocatable {
            return Ok(Scheduled::Pending {
                message: format!("0/1 nodes are available: 1 Insufficient {RESOURCE_GPU_MEM}."),
            });
        }
        let (status, filter) = self
            .call(
                http::Method::POST,
                "/filter",
                Some(json!({ "Pod": pod, "NodeNames": [NODE] })),
            )
            .await?;
        anyhow::ensure!(status == 200, "filter answered {status}: {filter}");
        let passed = filter["NodeNames"]
            .as_array()
            .is_some_and(|n| n.iter().any(|x| x == NODE));
        if !passed {
            let reason = filter["FailedNodes"][NODE]
                .as_str()
                .or_else(|| filter["FailedAndUnresolvableNodes"][NODE].as_str())
                .unwrap_or("rejected by the extender");
            return Ok(Scheduled::Pending {
                message: format!("0/1 nodes are available: 1 {reason}."),
            });
        }
        let (_, priorities) = self
            .call(
                http::Method::POST,
                "/prioritize",
                Some(json!({ "Pod": pod, "NodeNames": [NODE] })),
            )
            .await?;
        let score = priorities
            .as_array()
            .and_then(|a| a.first())
            .and_then(|h| h["Score"].as_i64());
        let meta = &pod["metadata"];
        let (status, bind) = self
            .call(
                http::Method::POST,
                "/bind",
                Some(json!({
                    "PodName": meta["name"], "PodNamespace": meta["namespace"],
                    "PodUID": meta["uid"], "Node": NODE,
                })),
            )
            .await?;
        anyhow::ensure!(status == 200, "bind answered {status}: {bind}");
        Ok(Scheduled::Bound { score })
    }
}

fn node_of(inspect: &Value) -> Option<&Value> {
    inspect["nodes"]
        .as_array()
        .and_then(|n| n.first())
        .or(Some(inspect))
        .filter(|n| n["name"] == NODE)
}
