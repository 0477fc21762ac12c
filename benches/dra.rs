//! `cargo bench --bench dra`: the DRA kubelet plugin's figures, in ONE process.
//!
//! With `--bench`: 110 pods with `aliyun.com/gpu-mem` rewritten onto the DRA path
//! (`gpushare::webhook::dra_rewrite`), allocated by the sandbox allocator over a node's slices (8 GPUs ×
//! 16 GiB, `gpushare::dra::slices`), then, as kubelet calls it, `NodePrepareResources` for each
//! pod's claim over the plugin's unix socket (`gpushare::dra::plugin`, with the role's
//! preparer, `gpushare::dra::prepare::CdiPreparer`: one CDI spec per claim), then the same
//! calls again
//! (answered from the checkpoint), then `NodeUnprepareResources`; p50/p99 of each. And the
//! slice update latency after a health change: from the GPU turning unhealthy to the tainted
//! slice stored in the API server (`Pool::update` + `publish::sync_slices`, what the role's
//! publishing loop does). It drives the plugin in-process, not a child process. The plugin's
//! state directory (the checkpoint) and CDI directory are on tmpfs (`/dev/shm` where it
//! exists, else `/tmp`; the report's header names it), as `/var/run` is on a node. Without
//! `--bench` (`cargo test --all-targets`) a 5-pod smoke run.
//!
//! Figures depend on the machine; FAIL lines are reported, not fatal.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gpushare::config::NodeConfig;
use gpushare::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME};
use gpushare::core::{GpuPolicy, MemoryUnit};
use gpushare::dra::plugin::{PluginConfig, Served, start};
use gpushare::dra::prepare::CdiPreparer;
use gpushare::dra::publish::sync_slices;
use gpushare::dra::slices::{Pool, SliceGpu};
use gpushare::kubelet_api::dra::v1;
use gpushare::node::contract::NodeTraits;
use gpushare::node::gpus::ServedGpu;
use gpushare::shutdown::Shutdown;
use gpushare::webhook::dra_rewrite::rewrite;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::DraAllocator;
use gpushare_sandbox::kubelet::dial_unix;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde_json::json;
use tokio::sync::watch;

const GIB: u64 = 1 << 30;
const GPUS: u32 = 8;
/// The p99 budget of `NodePrepareResources` with 110 claims on the node.
const PREPARE_P99_BUDGET: Duration = Duration::from_millis(5);

/// The role's preparer (`gpushare::dra::prepare::CdiPreparer`): one CDI spec per claim, with
/// the device-plugin path's envs, written atomically.
fn preparer(cdi: &std::path::Path) -> CdiPreparer {
    let served: Vec<ServedGpu> = gpus(None)
        .iter()
        .map(|g| ServedGpu {
            index: g.index,
            uuid: g.uuid.clone(),
            units: MemoryUnit::GIB.units_of_bytes(g.memory_bytes),
            minor: Some(g.index),
        })
        .collect();
    CdiPreparer::new(
        NodeConfig::default(),
        NodeTraits::default(),
        served,
        DRA_DRIVER_NAME,
        cdi,
    )
}

fn gpus(unhealthy: Option<u32>) -> Vec<SliceGpu> {
    (0..GPUS)
        .map(|i| SliceGpu {
            index: i,
            uuid: format!("GPU-{i:08x}-0000-0000-0000-000000000000"),
            product_name: "NVIDIA A100-SXM4-80GB".into(),
            memory_bytes: 16 * GIB,
            place: None,
            unhealthy: (unhealthy == Some(i)).then(|| "XID 79".to_string()),
            allocated_bytes: 0,
        })
        .collect()
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

/// Where the state and CDI directories go: tmpfs, as `/var/run` on a node.
fn scratch() -> &'static std::path::Path {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::path::Path::new("/tmp")
    }
}

async fn run(pods: usize) -> anyhow::Result<Vec<(String, String, String)>> {
    let server = ApiServer::start().await?;
    let client = server.admin_client();
    server.create_object(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": DRA_DEVICE_CLASS },
        "spec": { "selectors": [{ "cel": { "expression": gpushare::core::wire::dra_gpu_class_selector(DRA_DRIVER_NAME) } }] },
    }))?;
    let mut pool = Pool::new();
    let slices = pool
        .update(
            "node-a",
            DRA_DRIVER_NAME,
            Some("550.54.15"),
            MemoryUnit::GIB,
            GpuPolicy::Binpack,
            &gpus(None),
            &[],
        )
        .context("a first publication")?;
    sync_slices(&client, "node-a", DRA_DRIVER_NAME, &slices).await?;
    for i in 0..pods {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": format!("p{i}"), "namespace": "default" },
            "spec": { "containers": [{ "name": "main", "image": "x",
                "resources": { "limits": { "aliyun.com/gpu-mem": "1" } } }] },
        }))?;
        let r = rewrite(
            &pod,
            "default",
            MemoryUnit::GIB,
            DRA_DRIVER_NAME,
            DRA_DEVICE_CLASS,
        )?
        .context("rewritten")?;
        if i == 0 {
            server.create_object(serde_json::to_value(&r.template)?)?;
        }
        let mut value = serde_json::to_value(&r.pod)?;
        value["apiVersion"] = json!("v1");
        value["kind"] = json!("Pod");
        server.create_object(value)?;
    }
    let pass = DraAllocator::new(client.clone()).reconcile().await?;
    if pass.bound.len() != pods {
        bail!(
            "{} of {pods} pods placed: {:?}",
            pass.bound.len(),
            pass.pending
        );
    }
    let claims: Vec<ResourceClaim> =
        kube::Api::<ResourceClaim>::namespaced(client.clone(), "default")
            .list(&Default::default())
            .await?
            .items;

    let dir = tempfile::Builder::new()
        .prefix("gsb")
        .tempdir_in(scratch())?;
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi)?;
    let config = PluginConfig {
        driver: DRA_DRIVER_NAME.into(),
        node: "node-a".into(),
        registry_dir: dir.path().join("registry"),
        plugin_dir: dir.path().join("plugin"),
        checkpoint: dir.path().join("state/checkpoint.json"),
        unit: MemoryUnit::GIB,
    };
    let served = Served::from_gpus(&gpus(None), MemoryUnit::GIB);
    let (_served_tx, served_rx) = watch::channel(served);
    let _plugin = start(
        config.clone(),
        client.clone(),
        served_rx,
        Arc::new(preparer(&cdi)),
        Shutdown::never(),
    )?;
    let channel = dial_unix(&config.service_socket()).await?;
    let mut kubelet = v1::dra_plugin_client::DraPluginClient::new(channel);
    let wire = |c: &ResourceClaim| v1::Claim {
        namespace: "default".into(),
        uid: c.metadata.uid.clone().unwrap_or_default(),
        name: c.metadata.name.clone().unwrap_or_default(),
    };
    let mut figures = Vec::new();
    for round in ["first", "again (checkpoint)"] {
        let mut times = Vec::new();
        for c in &claims {
            let t = Instant::now();
            let answer = kubelet
                .node_prepare_resources(v1::NodePrepareResourcesRequest {
                    claims: vec![wire(c)],
                })
                .await?
                .into_inner();
            times.push(t.elapsed());
            let uid = c.metadata.uid.clone().unwrap_or_default();
            match answer.claims.get(&uid) {
                Some(r) if r.error.is_empty() => {}
                other => bail!("claim {uid} not prepared: {other:?}"),
            }
        }
        times.sort();
        let p99 = percentile(&times, 0.99);
        figures.push((
            format!(
                "NodePrepareResources, {round}, {} claims on the node: p50 / p99",
                claims.len()
            ),
            format!("{} / {}", ms(percentile(&times, 0.5)), ms(p99)),
            if p99 <= PREPARE_P99_BUDGET {
                "p99 ≤ 5 ms: PASS"
            } else {
                "p99 ≤ 5 ms: FAIL"
            }
            .to_string(),
        ));
    }
    let mut times = Vec::new();
    for c in &claims {
        let t = Instant::now();
        kubelet
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![wire(c)],
            })
            .await?;
        times.push(t.elapsed());
    }
    times.sort();
    figures.push((
        "NodeUnprepareResources: p50 / p99".into(),
        format!(
            "{} / {}",
            ms(percentile(&times, 0.5)),
            ms(percentile(&times, 0.99))
        ),
        String::new(),
    ));

    // Health change -> tainted slice stored.
    let t = Instant::now();
    let slices = pool
        .update(
            "node-a",
            DRA_DRIVER_NAME,
            Some("550.54.15"),
            MemoryUnit::GIB,
            GpuPolicy::Binpack,
            &gpus(Some(3)),
            &[],
        )
        .context("the taint changes the pool")?;
    sync_slices(&client, "node-a", DRA_DRIVER_NAME, &slices).await?;
    let elapsed = t.elapsed();
    let stored: ResourceSlice = server
        .get_as("resourceslices", None, "node-a-gpushare-io-0")
        .context("the slice")?;
    let tainted = stored
        .spec
        .devices
        .iter()
        .flatten()
        .filter(|d| d.taints.is_some())
        .count();
    if tainted != 1 {
        bail!("{tainted} tainted devices stored, expected 1");
    }
    figures.push((
        "slice update after a health change (build + list + replace)".into(),
        ms(elapsed),
        String::new(),
    ));
    Ok(figures)
}

fn main() -> std::process::ExitCode {
    let bench = std::env::args().any(|a| a == "--bench");
    let pods = if bench { 110 } else { 5 };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dra bench: cannot start a tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(pods)) {
        Ok(figures) => {
            println!(
                "## gpushare DRA plugin bench ({}, {} build, {} CPUs, state and CDI dirs in {})\n",
                if bench { "full" } else { "smoke" },
                if cfg!(debug_assertions) {
                    "DEBUG"
                } else {
                    "release"
                },
                std::thread::available_parallelism().map_or(0, |n| n.get()),
                scratch().display()
            );
            println!("| figure | measured | budget |\n| --- | --- | --- |");
            for (name, value, budget) in figures {
                let budget = if bench { budget } else { String::new() };
                println!("| {name} | {value} | {budget} |");
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dra bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
