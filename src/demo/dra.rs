//! `gpushare demo --dra`: demo 1 (binpack) and demo 2 (room on the node, on no single GPU) on
//! the DRA path. The sandbox API server serves `resource.k8s.io/v1`; `gpushare dra-plugin`
//! runs in-process on fake GPUs and publishes the node's slice; each `aliyun.com/gpu-mem` pod
//! is rewritten into a claim (the webhook's rewrite), the sandbox allocator plays
//! kube-scheduler's DRA allocation (first fit over the slice order) and the sandbox DRA kubelet
//! prepares the pods through the plugin. Every GPU is compared with what the core's placement
//! rules predict; mismatches are collected, not panicked on.
//!
//! It does not play the extender path (the default demo does) or the webhook's admission (the
//! rewrite is called directly).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::DemoOutcome;
use super::scenario::{BINPACK_PODS, Walkthrough};
use crate::config::Config;
use crate::core::memory::MemoryUnit;
use crate::core::placement::GpuPolicy;
use crate::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME};
use crate::gpu::GpuBackend;
use crate::shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::DraAllocator;
use gpushare_sandbox::dra_kubelet::{ClaimOutcome, DraKubelet};

const NODE: &str = "gpu-node-1";
const NAMESPACE: &str = "default";

/// Creates the rewritten pod `name` asking `units` GiB (its template first).
fn submit(api: &ApiServer, name: &str, units: u64) -> anyhow::Result<()> {
    let pod: Pod = crate::k8s::decode::from_value(&json!({
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": { "containers": [{ "name": "main", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
            "resources": { "limits": { "aliyun.com/gpu-mem": units.to_string() } } }] },
    }))?;
    let r = crate::webhook::dra_rewrite::rewrite(
        &pod,
        NAMESPACE,
        MemoryUnit::GIB,
        DRA_DRIVER_NAME,
        DRA_DEVICE_CLASS,
    )?
    .ok_or_else(|| anyhow!("{name} was not rewritten"))?;
    let template = r.template.metadata.name.clone().unwrap_or_default();
    if api
        .get_object("resourceclaimtemplates", Some(NAMESPACE), &template)
        .is_none()
    {
        api.create_object(serde_json::to_value(&r.template)?)?;
    }
    let mut value = serde_json::to_value(&r.pod)?;
    value["apiVersion"] = json!("v1");
    value["kind"] = json!("Pod");
    api.create_object(value)?;
    Ok(())
}

/// The GPU index the plugin prepared for pod `name`, if it was.
fn prepared_gpu(
    api: &ApiServer,
    kubelet: &DraKubelet,
    served: &crate::dra::plugin::Served,
    name: &str,
) -> Option<u32> {
    let pod: Pod = api.get_as("pods", Some(NAMESPACE), name)?;
    let claims = kubelet.prepared(pod.metadata.uid.as_deref()?)?;
    match &claims.first()?.outcome {
        ClaimOutcome::Prepared(devices) => {
            let device = &devices.first()?.device;
            served.devices.get(device).map(|d| d.index)
        }
        _ => None,
    }
}

/// Runs demo 1 and demo 2 on the DRA path, writing the walkthrough to `out`.
pub async fn run_dra_scenario(fake_gpus: &str, out: &mut dyn Write) -> anyhow::Result<DemoOutcome> {
    let (mut walk, backend) = Walkthrough::new(fake_gpus)?;
    let unit = MemoryUnit::GIB;
    writeln!(
        out,
        "gpushare demo --dra — a sandbox cluster with one node and {} fake GPUs ({fake_gpus}), served through DRA\n",
        walk.gpu_units.len()
    )?;
    let (trigger, stop) = shutdown::channel();
    let api = ApiServer::start()
        .await
        .context("starting the sandbox API server")?;
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n"
    ))?;
    api.create_object(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": DRA_DEVICE_CLASS },
        "spec": { "selectors": [{ "cel": { "expression": crate::core::wire::dra_gpu_class_selector(DRA_DRIVER_NAME) } }] },
    }))?;
    let root = tempfile::Builder::new()
        .prefix("gsdra")
        .tempdir_in("/tmp")
        .context("creating the kubelet directory")?;
    let mut config = Config::default();
    config.node.node_name = NODE.to_string();
    config.node.memory_unit = unit;
    config.dra.registry_dir = root.path().join("registry");
    config.dra.plugin_dir = root.path().join("plugin");
    config.dra.state_dir = root.path().join("state");
    config.dra.cdi_dir = root.path().join("cdi");
    config.dra.admin_address = String::new();
    config.dra.gpu_policy = GpuPolicy::Binpack;
    let backend: Arc<dyn GpuBackend> = Arc::new(backend);
    let plugin = crate::dra::role::start(&config, api.admin_client(), backend, stop.clone())
        .await
        .context("starting the DRA plugin")?;
    let kubelet = DraKubelet::start(&config.dra.registry_dir, NODE, api.admin_client())?;
    let info = kubelet.wait_registered(DRA_DRIVER_NAME).await?;
    let mut generation = plugin.published_generation();
    tokio::time::timeout(Duration::from_secs(30), generation.wait_for(|g| *g >= 1))
        .await
        .context("the ResourceSlice was not published")??;
    let served = plugin.served().borrow().clone();
    writeln!(
        out,
        "▸ DRA plugin {} registered with the DRA kubelet ({}); its ResourceSlice lists {} GPUs, memory in GiB, binpack order",
        info.driver,
        info.endpoint.display(),
        served.devices.len()
    )?;
    let allocator = DraAllocator::new(api.admin_client());

    let half = walk.half();
    writeln!(out)?;
    walk.demo1(out)?;
    for name in BINPACK_PODS {
        let expected = walk.predict(name);
        submit(&api, name, half)?;
        allocator.reconcile().await?;
        kubelet.sync().await?;
        let got = prepared_gpu(&api, &kubelet, &served, name);
        writeln!(
            out,
            "▸ {name}: claim allocated and prepared on GPU {}",
            got.map_or("-".to_string(), |g| g.to_string())
        )?;
        walk.placed(out, name, expected, got);
    }

    walk.demo2(out)?;
    api.set_pod_phase(NAMESPACE, "binpack-1", "Succeeded")?;
    allocator.reconcile().await?;
    kubelet.sync().await?;
    let (big, fits_one_gpu) = walk.big_ask(out)?;
    submit(&api, "binpack-4", big)?;
    let pass = allocator.reconcile().await?;
    kubelet.sync().await?;
    let bound = pass.bound.iter().any(|(p, _)| p.ends_with("/binpack-4"));
    if fits_one_gpu {
        walk.outcome.expect(
            out,
            "binpack-4 fits on one GPU with this layout",
            bound,
            format!("{pass:?}"),
        );
    } else {
        walk.outcome.expect(
            out,
            "binpack-4 stays Pending: no GPU has the capacity its claim asks",
            !bound && pass.pending.iter().any(|(p, _)| p.ends_with("/binpack-4")),
            format!("{pass:?}"),
        );
    }
    trigger.trigger();
    plugin.stop().await;
    Ok(walk.outcome)
}
