//! `gpushare device-plugin` over real unix sockets against the sandbox kubelet and API server,
//! with fake GPUs: registration and re-registration, device lists, the 4 MiB guard, node
//! publishing, Allocate matching (demo A1, reverse order, multi-container, init containers),
//! failures, single-GPU fallback, health and recovery, API errors, NVML missing, and the
//! node agent's one-path-per-GPU rule.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpushare::config::{AllocateFailure, Config};
use gpushare::core::wire;
use gpushare::deviceplugin;
use gpushare::gpu::HealthEvent;
use gpushare::gpu::fake::{FakeBackend, fake_uuid};
use gpushare::kubelet_api::deviceplugin::Device;
use gpushare::node::paths::ServingPath;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};

use crate::support::deviceplugin_cluster::{
    NODE, RESOURCE, cluster, cluster_with, env, node_yaml, uuid_of,
};
use crate::support::socket_dir::short_tempdir;

fn ids_per_gpu(devices: &[Device]) -> BTreeMap<String, usize> {
    let mut per = BTreeMap::new();
    for d in devices {
        *per.entry(uuid_of(&d.id)).or_insert(0) += 1;
    }
    per
}

#[tokio::test]
async fn a_gpu_the_device_plugin_serves_is_refused_to_another_path_until_it_stops() {
    let c = cluster("2x16GiB", |_| {}).await;
    let agent = c.plugin().agent().clone();
    assert_eq!(agent.path_of(0), Some(ServingPath::DevicePlugin));
    assert_eq!(agent.path_of(1), Some(ServingPath::DevicePlugin));
    let err = agent
        .offer(ServingPath::Dra, [1])
        .expect_err("the device plugin offers GPU 1");
    assert_eq!(err.held, ServingPath::DevicePlugin);
    assert_eq!(err.indices, [1]);
    c.stop().await;
    // Stopped, the device plugin gave its GPUs back to the agent.
    assert_eq!(agent.path_of(1), None);
    let offered = agent
        .offer(ServingPath::Dra, [1])
        .expect("free once the device plugin stopped");
    assert_eq!(offered.len(), 1);
    assert_eq!(offered[0].index, 1);
    assert_eq!(agent.path_of(0), None);
}

#[tokio::test]
async fn registers_and_re_registers_after_a_kubelet_restart() {
    let c = cluster("2x16GiB", |_| {}).await;
    let info = c.kubelet.plugin(RESOURCE).expect("registered");
    assert_eq!(info.endpoint, wire::PLUGIN_SOCKET);
    assert_eq!(info.resource_name, RESOURCE);
    assert!(info.options.get_preferred_allocation_available);
    assert_eq!(info.registrations, 1);
    assert!(c.plugin().socket_path().ends_with(wire::PLUGIN_SOCKET));

    c.kubelet.restart().await.expect("kubelet restarts");
    let info = c
        .kubelet
        .wait_registered(RESOURCE)
        .await
        .expect("the plugin registers again");
    assert_eq!(info.registrations, 2);
    assert_eq!(c.kubelet.devices(RESOURCE).len(), 32);
    assert!(c.plugin().socket_path().exists());
    assert_eq!(c.plugin().metrics().registrations.get(), 2);
    // And it still allocates after the restart (single pod, matched).
    c.bound_pod("after-restart", &[("main", 4)], Some(1), 1);
    let (_, resp) = c
        .allocate("after-restart", "main", 4)
        .await
        .expect("allocated");
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "1");
    c.stop().await;
}

#[tokio::test]
async fn device_lists_count_every_unit_of_every_gpu() {
    for (gpus, unit, per_gpu) in [
        ("1x16GiB", "GiB", 16usize),
        ("2x16GiB", "MiB", 16 * 1024),
        ("8x16GiB", "256MiB", 64),
        ("1x16160MiB", "GiB", 15),
    ] {
        let c = cluster(gpus, |cfg| {
            cfg.node.memory_unit = unit.parse().expect("unit");
        })
        .await;
        let devices = c.kubelet.devices(RESOURCE);
        let count: usize = gpus
            .split('x')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert_eq!(devices.len(), count * per_gpu, "{gpus} in {unit}");
        let mut expected: Vec<String> = (0..count as u32)
            .flat_map(|i| (0..per_gpu as u64).map(move |n| wire::fake_device_id(&fake_uuid(i), n)))
            .collect();
        let mut ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        expected.sort();
        ids.sort();
        assert_eq!(ids, expected, "{gpus} in {unit}: exact IDs");
        assert!(devices.iter().all(|d| d.health == wire::HEALTHY));
        c.stop().await;
    }
}

#[tokio::test]
async fn heterogeneous_gpus_and_the_node_facts() {
    let c = cluster("16GiB,24GiB", |_| {}).await;
    let per = ids_per_gpu(&c.kubelet.devices(RESOURCE));
    assert_eq!(per.get(&fake_uuid(0)), Some(&16));
    assert_eq!(per.get(&fake_uuid(1)), Some(&24));
    let node = c.node();
    let status = node.status.expect("status");
    let count = |m: Option<
        BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { m.and_then(|m| m.get(wire::RESOURCE_GPU_COUNT).map(|q| q.0.clone())) };
    assert_eq!(count(status.capacity), Some("2".to_string()));
    assert_eq!(count(status.allocatable), Some("2".to_string()));
    let ann = node.metadata.annotations.expect("annotations");
    assert_eq!(ann[wire::NODE_ANN_MEMORY_UNIT], "GiB");
    let published: Vec<gpushare::k8s::project::PublishedGpu> =
        serde_json::from_str(&ann[wire::NODE_ANN_DEVICES]).expect("devices JSON");
    assert_eq!(published.len(), 2);
    assert_eq!((published[0].index, published[0].memory), (0, 16));
    assert_eq!((published[1].index, published[1].memory), (1, 24));
    assert_eq!(published[1].uuid, fake_uuid(1));
    assert!(published.iter().all(|g| g.healthy));
    // The extender's projection reads them as heterogeneous GPUs.
    // The extender's projection reads them as heterogeneous GPUs (kubelet sets the gpu-mem
    // capacity, seeded here as 40).
    let gpus = gpushare::k8s::node_gpus(&c.node(), false);
    assert!(gpus.published);
    let totals: Vec<u64> = gpus.gpus.iter().map(|g| g.total.units()).collect();
    assert_eq!(totals, vec![16, 24]);
    c.stop().await;
}

#[tokio::test]
async fn the_4mib_guard_refuses_mib_on_8x80gib_and_names_a_unit() {
    let dir = short_tempdir();
    let api = ApiServer::start().await.expect("api");
    api.seed_yaml(&node_yaml("")).expect("node");
    let mut config = Config::default();
    config.node.node_name = NODE.to_string();
    config.device_plugin.device_plugin_dir = dir.path().join("device-plugins");
    config.device_plugin.admin_address = String::new();
    config.node.memory_unit = "MiB".parse().expect("unit");
    let backend = FakeBackend::from_spec("8x80GiB").expect("spec");
    let err = deviceplugin::start(
        &config,
        api.admin_client(),
        Arc::new(backend),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect_err("MiB on 640 GiB cannot fit kubelet's 4 MiB message");
    let text = format!("{err:#}");
    assert!(text.contains("655360 fake devices"), "{text}");
    assert!(
        text.contains("use --memory-unit 16MiB or coarser"),
        "{text}"
    );
    assert!(
        !config
            .device_plugin
            .device_plugin_dir
            .join(wire::PLUGIN_SOCKET)
            .exists()
    );
    api.shutdown().await;
}

#[tokio::test]
async fn demo_a1_binpack_three_pods_through_allocate() {
    // Demo 1: MiB units, 2 GPUs x 16276 MiB, three pods of 8138 bound by the extender.
    let c = cluster("2x16276MiB", |cfg| {
        cfg.node.memory_unit = "MiB".parse().expect("unit");
        cfg.device_plugin.admin_address = "127.0.0.1:0".to_string();
    })
    .await;
    c.bound_pod("binpack-1", &[("binpack", 8138)], Some(0), 100);
    c.bound_pod("binpack-2", &[("binpack", 8138)], Some(0), 200);
    c.bound_pod("binpack-3", &[("binpack", 8138)], Some(1), 300);
    for (pod, gpu) in [("binpack-1", 0u32), ("binpack-2", 0), ("binpack-3", 1)] {
        let (ids, resp) = c.allocate(pod, "binpack", 8138).await.expect("allocated");
        assert_eq!(
            env(&resp, wire::ENV_VISIBLE_DEVICES),
            gpu.to_string(),
            "{pod}"
        );
        assert_eq!(env(&resp, wire::ENV_GPU_INDEX), gpu.to_string());
        assert_eq!(env(&resp, wire::ENV_POD_MEM), "8138");
        assert_eq!(env(&resp, wire::ENV_CONTAINER_MEM), "8138");
        assert_eq!(env(&resp, wire::ENV_DEVICE_MEM), "16276");
        assert!(!resp.envs.contains_key(wire::ENV_CGPU_DISABLE));
        // GetPreferredAllocation steered kubelet to that GPU's device IDs.
        assert!(ids.iter().all(|id| uuid_of(id) == fake_uuid(gpu)), "{pod}");
        let ann = c.annotations(pod);
        assert_eq!(ann[wire::ANN_ASSIGNED], "true", "{pod}");
        assert_eq!(ann[wire::POD_ANN_ALLOCATED_CONTAINERS], "binpack");
        assert_eq!(ann[wire::ANN_GPU_INDEX], gpu.to_string());
    }
    assert_eq!(c.plugin().metrics().allocations_with("matched"), 3);
    // The admin endpoint serves the metrics.
    let addr = c.plugin().admin_addr().expect("admin server");
    let metrics = http_get(addr, "/metrics").await;
    assert!(
        metrics.contains("gpushare_device_plugin_allocations_total{outcome=\"matched\"} 3"),
        "{metrics}"
    );
    assert!(http_get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
    c.stop().await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

#[tokio::test]
async fn equal_pods_allocated_in_reverse_order_leave_no_wrong_gpu_recorded() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("older", &[("main", 4)], Some(0), 1_000);
    c.bound_pod("newer", &[("main", 4)], Some(1), 2_000);
    // kubelet starts the newer pod first: the plugin cannot know (kubelet sends no pod).
    let (_, first) = c.allocate("newer", "main", 4).await.expect("allocated");
    let (_, second) = c.allocate("older", "main", 4).await.expect("allocated");
    let first_gpu: u32 = env(&first, wire::ENV_GPU_INDEX).parse().expect("index");
    let second_gpu: u32 = env(&second, wire::ENV_GPU_INDEX).parse().expect("index");
    assert_ne!(first_gpu, second_gpu);
    // After the PodResources cross-check, every pod's annotation names the GPU its container
    // really got (env) and kubelet recorded (device IDs).
    c.wait_for("annotations to match what kubelet recorded", |c| {
        c.kubelet.allocations().iter().all(|a| {
            let ann = c.annotations(&a.pod);
            let recorded = uuid_of(&a.device_ids[0]);
            ann.get(wire::ANN_GPU_INDEX)
                .and_then(|i| i.parse::<u32>().ok())
                .is_some_and(|i| fake_uuid(i) == recorded)
                && ann.get(wire::ANN_ASSIGNED).map(String::as_str) == Some("true")
        })
    })
    .await;
    assert_eq!(
        c.annotations("newer")[wire::ANN_GPU_INDEX],
        first_gpu.to_string()
    );
    assert_eq!(
        c.annotations("older")[wire::ANN_GPU_INDEX],
        second_gpu.to_string()
    );
    c.wait_for("the swap to be counted", |c| {
        c.plugin().metrics().swaps_corrected.get() >= 1
    })
    .await;
    c.wait_for("a swap Event on the node", |c| {
        !c.warning_events("GpuShareAllocationSwapped").is_empty()
    })
    .await;
    c.stop().await;
}

#[tokio::test]
async fn a_pod_with_an_init_container_and_two_gpu_containers() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.pod_with(
        "multi",
        &[("setup", 2)],
        &[("trainer", 3), ("sidecar", 1)],
        Some(1),
        5,
    );
    let (_, init) = c
        .allocate("multi", "setup", 2)
        .await
        .expect("init allocated");
    assert_eq!(env(&init, wire::ENV_VISIBLE_DEVICES), "1");
    assert_eq!(env(&init, wire::ENV_CONTAINER_MEM), "2");
    assert_eq!(env(&init, wire::ENV_POD_MEM), "4");
    let ann = c.annotations("multi");
    assert_eq!(ann[wire::ANN_ASSIGNED], "false");
    assert_eq!(ann[wire::POD_ANN_ALLOCATED_CONTAINERS], "setup");
    let (_, trainer) = c.allocate("multi", "trainer", 3).await.expect("allocated");
    assert_eq!(env(&trainer, wire::ENV_CONTAINER_MEM), "3");
    assert_eq!(c.annotations("multi")[wire::ANN_ASSIGNED], "false");
    let (_, sidecar) = c.allocate("multi", "sidecar", 1).await.expect("allocated");
    assert_eq!(env(&sidecar, wire::ENV_VISIBLE_DEVICES), "1");
    let ann = c.annotations("multi");
    assert_eq!(ann[wire::ANN_ASSIGNED], "true");
    assert_eq!(
        ann[wire::POD_ANN_ALLOCATED_CONTAINERS],
        "setup,trainer,sidecar"
    );
    c.stop().await;
}

#[tokio::test]
async fn no_candidate_gives_the_upstream_env_and_a_node_event() {
    let c = cluster("2x16GiB", |_| {}).await;
    let (_, resp) = c.allocate("stray", "main", 3).await.expect("answered");
    assert_eq!(
        env(&resp, wire::ENV_VISIBLE_DEVICES),
        "no-gpu-has-3GiB-to-run"
    );
    assert_eq!(env(&resp, wire::ENV_GPU_INDEX), "-1");
    assert_eq!(env(&resp, wire::ENV_CONTAINER_MEM), "3");
    c.wait_for("a Warning Event on the node", |c| {
        !c.warning_events("GpuShareAllocateFailed").is_empty()
    })
    .await;
    assert_eq!(c.plugin().metrics().allocations_with("no_candidate"), 1);
    c.stop().await;
}

#[tokio::test]
async fn no_candidate_with_error_mode_names_the_pods_considered() {
    let c = cluster("2x16GiB", |cfg| {
        cfg.device_plugin.allocate_failure = AllocateFailure::Error;
    })
    .await;
    c.bound_pod("too-big", &[("main", 5)], Some(0), 1);
    c.bound_pod("unbound", &[("main", 3)], None, 1);
    let err = c
        .allocate("someone", "main", 3)
        .await
        .expect_err("a gRPC error");
    let text = format!("{err:#}");
    assert!(
        text.contains("no pod on this node waits for a GPU container of 3GiB"),
        "{text}"
    );
    assert!(
        text.contains("default/too-big: next GPU container \"main\" requests 5, not 3"),
        "{text}"
    );
    assert!(
        text.contains("default/unbound: not bound by the extender"),
        "{text}"
    );
    c.stop().await;
}

#[tokio::test]
async fn a_single_gpu_node_falls_back_to_its_gpu() {
    let c = cluster_with("1x16GiB", "    cgpu.disable.isolation: \"true\"\n", |_| {})
        .await
        .expect("starts");
    let (_, resp) = c
        .allocate("not-via-extender", "main", 2)
        .await
        .expect("answered");
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), fake_uuid(0));
    assert_eq!(env(&resp, wire::ENV_GPU_INDEX), "0");
    assert_eq!(env(&resp, wire::ENV_CGPU_DISABLE), "true");
    assert_eq!(
        c.plugin().metrics().allocations_with("single_gpu_fallback"),
        1
    );
    c.stop().await;
}

// MPS mode (envs, mounts, the daemon it runs) is tested in mps.rs.

fn healthy_per_gpu(devices: &[Device], uuid: &str) -> Option<bool> {
    let mine: Vec<&Device> = devices.iter().filter(|d| uuid_of(&d.id) == uuid).collect();
    if mine.is_empty() {
        return None;
    }
    Some(mine.iter().all(|d| d.health == wire::HEALTHY))
}

#[tokio::test]
async fn health_fatal_stays_down_application_ignored_transient_recovers() {
    let c = cluster("2x16GiB", |cfg| {
        cfg.node.health_recovery_secs = 1;
    })
    .await;
    c.wait_for("the health watcher", |c| c.health.subscribers() > 0)
        .await;
    let (gpu0, gpu1) = (fake_uuid(0), fake_uuid(1));
    // XID 31 (application) on GPU 0, then XID 79 (fatal) on GPU 1: events are handled in
    // order, so once GPU 1 is down the first one has been seen and ignored.
    c.health.inject(HealthEvent::Xid {
        uuid: Some(gpu0.clone()),
        xid: 31,
    });
    c.health.inject(HealthEvent::Xid {
        uuid: Some(gpu1.clone()),
        xid: 79,
    });
    let devices = c
        .kubelet
        .wait_devices(RESOURCE, |d| healthy_per_gpu(d, &gpu1) == Some(false))
        .await
        .expect("GPU 1 unhealthy");
    assert_eq!(healthy_per_gpu(&devices, &gpu0), Some(true));
    c.wait_for("the node annotation to say GPU 1 is down", |c| {
        c.node()
            .metadata
            .annotations
            .and_then(|a| a.get(wire::NODE_ANN_DEVICES).cloned())
            .is_some_and(|v| v.contains("\"healthy\":false"))
    })
    .await;
    c.wait_for("a GpuUnhealthy Event", |c| {
        !c.warning_events("GpuUnhealthy").is_empty()
    })
    .await;
    // XID 62 (transient) on GPU 0: down, then healthy again after the quiet period.
    c.health.inject(HealthEvent::Xid {
        uuid: Some(gpu0.clone()),
        xid: 62,
    });
    c.kubelet
        .wait_devices(RESOURCE, |d| healthy_per_gpu(d, &gpu0) == Some(false))
        .await
        .expect("GPU 0 unhealthy");
    let devices = c
        .kubelet
        .wait_devices(RESOURCE, |d| healthy_per_gpu(d, &gpu0) == Some(true))
        .await
        .expect("GPU 0 recovers");
    // The fatal one did not recover in the meantime.
    assert_eq!(healthy_per_gpu(&devices, &gpu1), Some(false));
    assert_eq!(c.plugin().node_metrics().unhealthy_gpus.get(), 1);
    c.stop().await;
}

#[tokio::test]
async fn api_errors_during_the_assigned_patch_are_retried_then_fail_the_allocate() {
    // Without a usable state directory the answer cannot be made durable on the node first:
    // Allocate writes to the pod before it answers.
    let c = cluster("2x16GiB", |c| {
        c.device_plugin.state_dir = "/dev/null/no-state-dir".into();
    })
    .await;
    c.bound_pod("flaky", &[("main", 2)], Some(0), 1);
    c.bound_pod("broken", &[("main", 3)], Some(1), 1);
    // Two 500s: retried, the allocation succeeds and is recorded.
    c.api.inject(
        Fault::new(
            Some(http::Method::PATCH),
            "/pods/flaky",
            FaultAction::Status(500),
        )
        .times(2),
    );
    let (_, resp) = c.allocate("flaky", "main", 2).await.expect("retried");
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "0");
    assert_eq!(c.annotations("flaky")[wire::ANN_ASSIGNED], "true");
    // Persistent 500s: the Allocate fails instead of handing out an unrecorded GPU; a 500 may
    // still be committed, so the outcome is unknown and the claim is kept.
    c.api.inject(
        Fault::new(
            Some(http::Method::PATCH),
            "/pods/broken",
            FaultAction::Status(500),
        )
        .times(100),
    );
    let err = c.allocate("broken", "main", 3).await.expect_err("fails");
    assert!(
        format!("{err:#}").contains("recording it on the pod failed"),
        "{err:#}"
    );
    assert_eq!(c.annotations("broken")[wire::ANN_ASSIGNED], "false");
    assert_eq!(c.plugin().metrics().allocations_with("patch_unknown"), 1);
    // Only an answer that refuses the write (4xx) is a failure that drops the claim.
    c.api.clear_faults();
    c.bound_pod("invalid", &[("main", 1)], Some(1), 1);
    c.api.inject(
        Fault::new(
            Some(http::Method::PATCH),
            "/pods/invalid",
            FaultAction::Status(422),
        )
        .times(100),
    );
    let err = c.allocate("invalid", "main", 1).await.expect_err("fails");
    assert!(
        format!("{err:#}").contains("recording it on the pod failed"),
        "{err:#}"
    );
    assert_eq!(c.plugin().metrics().allocations_with("patch_failed"), 1);
    c.api.clear_faults();
    c.stop().await;
}

#[test]
fn missing_nvml_exits_1_with_a_clear_error_instead_of_hanging() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = rt.block_on(ApiServer::start()).expect("api");
    api.seed_yaml(&node_yaml("")).expect("node");
    let kubeconfig = api.admin_kubeconfig_path();
    let dir = short_tempdir();
    let plugin_dir = dir.path().display().to_string();
    for backend in ["nvml", "auto"] {
        let mut child = std::process::Command::new(crate::support::bin())
            .args([
                "device-plugin",
                "--node-name",
                NODE,
                "--gpu-backend",
                backend,
                "--nvml-library",
                "/nonexistent/libnvidia-ml.so.1",
                "--skip-doctor",
                "--device-plugin-dir",
                &plugin_dir,
                "--admin-address",
                "",
                "--kubeconfig",
                &kubeconfig.display().to_string(),
            ])
            .env_clear()
            .env("PATH", "/nonexistent")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("the device plugin hangs without NVML ({backend})");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        use std::io::Read;
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        assert_eq!(status.code(), Some(1), "{backend}: {stderr}");
        assert!(
            stderr.contains("cannot reach the GPUs"),
            "{backend}: {stderr}"
        );
        assert!(
            stderr.contains("nvml") || stderr.contains("NVML"),
            "{backend}: {stderr}"
        );
    }
    rt.block_on(api.shutdown());
}

#[test]
fn a_missing_node_name_exits_78_and_upstream_flags_are_accepted() {
    let out = crate::support::run(&[
        "device-plugin",
        "--logtostderr",
        "--v=5",
        "--alsologtostderr",
        "--query-kubelet",
        "--kubelet-address",
        "0.0.0.0",
        "--timeout=10",
        "--memory-unit=GiB",
        "--gpu-backend",
        "fake",
        "--fake-gpus",
        "1x16GiB",
    ]);
    // The flags are accepted; the missing node name is missing configuration.
    assert_eq!(
        out.status.code(),
        Some(78),
        "{}",
        crate::support::stderr(&out)
    );
    assert!(crate::support::stderr(&out).contains("node name is required"));
}
