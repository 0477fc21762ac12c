//! Driver enforcement on both paths, in-process over the sandbox with the NVML stub's
//! per-cgroup limits: a pod of 4 GiB on a 16 GiB GPU gets a CDI spec whose hook, run as the
//! runtime would, sets soft = hard = 4 GiB on exactly its container's cgroup and that GPU (the
//! DRA plugin's per-claim spec; the device plugin's CDI answer naming the limit device); the
//! node agent reads every limit back, into `/metrics`, the node annotation that `inspect -o
//! wide` / `-o json` show as used/allocated, and, when a limit is missing, an Event on the pod,
//! a counted violation and (DRA) a health message on the device; a stopped container's limit
//! is cleared before its cgroup goes (the cgroup watch alone does it), and a restarted node
//! agent reconciles the records left while it was down. `enforcement = driver` on a node without support refuses
//! to start with the reason; `auto` there falls back and says which mechanism it chose.

use std::path::Path;

use gpushare::config::enforcement::Enforcement;
use gpushare::config::{Config, DeviceListStrategies, DeviceListStrategy};
use gpushare::dra::role;
use gpushare::gpu::fake::FakeBackend;
use gpushare::node::enforcement::Mechanism;
use gpushare::node::paths::ServingPath;
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::nvml_stub::{self, MemoryAccounting};
use serde_json::{Value, json};

use crate::support::deviceplugin_cluster::{self, NODE as DP_NODE};
use crate::support::dra::dra_node_api;
use crate::support::dra_node::{PreparedPod, prepared_gpu_pod};
use crate::support::enforcement::{
    GIB, Host, gpus, metric, oci_state, pod_events, published_rows, row, run_hook_as_runtime,
};
use crate::support::socket_dir::short_tempdir;
use crate::support::wait::wait_until;
use crate::support::{extender_http, stderr, stdout};

const NODE: &str = "node-a";

fn hook_of(spec: &Value, device: usize) -> Value {
    spec["devices"][device]["containerEdits"]["hooks"][0].clone()
}

fn env_of(spec: &Value, device: usize) -> Vec<String> {
    spec["devices"][device]["containerEdits"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str().map(str::to_string))
        .collect()
}

async fn dra_api() -> ApiServer {
    dra_node_api(NODE).await
}

fn dra_config(host: &Host, dir: &Path) -> Config {
    crate::support::dra_node::config_in(dir, |config| {
        config.dra.admin_address = "127.0.0.1:0".into();
        host.driver_config(config);
    })
}

/// The DRA plugin with driver enforcement over `host`, on a fresh sandbox of node [`NODE`]:
/// the API server, the plugin's directory, its configuration and the running role.
async fn dra_plugin(host: &Host) -> (ApiServer, tempfile::TempDir, Config, role::DraPluginHandle) {
    let api = dra_api().await;
    let dir = short_tempdir();
    let config = dra_config(host, dir.path());
    let plugin = role::start(
        &config,
        api.admin_client(),
        host.backend(),
        Shutdown::never(),
    )
    .await
    .expect("the DRA plugin starts with driver enforcement");
    (api, dir, config, plugin)
}

#[tokio::test]
async fn dra_a_4gib_pod_is_limited_to_4gib_on_its_own_cgroup_and_the_readback_shows_it() {
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let (api, _dir, config, plugin) = dra_plugin(&host).await;
    assert_eq!(
        plugin.agent().enforcement().mechanism(ServingPath::Dra),
        Mechanism::Driver
    );
    let PreparedPod {
        kubelet,
        spec,
        pod_uid: uid,
        ..
    } = prepared_gpu_pod(&config, &api, "p", 4).await;
    let env = env_of(&spec, 0);
    assert!(
        env.iter().any(|e| e == "NVIDIA_GPU_MEMORY_REQUEST=4096"),
        "{env:?}"
    );
    assert!(
        env.iter().any(|e| e == "NVIDIA_GPU_MEMORY_LIMIT=4096"),
        "{env:?}"
    );
    let index: usize = env
        .iter()
        .find_map(|e| e.strip_prefix("ALIYUN_COM_GPU_MEM_IDX="))
        .expect("the GPU")
        .parse()
        .expect("an index");
    let hook = hook_of(&spec, 0);
    assert_eq!(hook["hookName"], "createRuntime");
    let args: Vec<&str> = hook["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let limit = format!("{}={}", gpus()[index].uuid, 4 * GIB);
    assert!(
        args.windows(2).any(|w| w == ["--limit", limit.as_str()]),
        "{args:?}"
    );

    // The runtime creates the container and runs the hook.
    let main = host.container(&uid, "ctr-main", 4242, ("default", "p", "main"), true);
    let side = host.container(&uid, "ctr-other", 4243, ("default", "p", "other"), true);
    let out = run_hook_as_runtime(&hook, &oci_state(&main));
    assert!(out.status.success(), "{}", stderr(&out));
    let four = (4 * GIB).to_string();
    assert_eq!(
        host.dmem(&main.path, "dmem.max", index).as_deref(),
        Some(four.as_str())
    );
    assert_eq!(
        host.dmem(&main.path, "dmem.min", index).as_deref(),
        Some(four.as_str())
    );
    assert_eq!(
        host.dmem(&side.path, "dmem.max", index),
        None,
        "only that container"
    );
    assert_eq!(
        host.dmem(&main.path, "dmem.max", 1 - index),
        None,
        "only that GPU"
    );
    assert!(host.workload(&main, index, &[GIB]).status.success());

    // The readback: the node annotation, /metrics, inspect.
    wait_until("the readback publishes the container", || {
        row(&published_rows(&api, NODE), "p", "main")
            .is_some_and(|r| r["state"] == "enforced" && r["used"] == GIB)
    })
    .await;
    let admin = plugin.admin_addr().expect("admin");
    let (_, metrics) = extender_http::get(admin, "/metrics").await;
    let labels = ["namespace=\"default\"", "pod=\"p\"", "container=\"main\""];
    assert_eq!(
        metric(
            &metrics,
            "gpushare_container_gpu_memory_limit_bytes",
            &labels
        )
        .as_deref(),
        Some(four.as_str()),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "gpushare_container_gpu_memory_used_bytes",
            &labels
        )
        .as_deref(),
        Some(GIB.to_string().as_str())
    );
    let kc = api.admin_kubeconfig_path().display().to_string();
    crate::support::enforcement::assert_inspect_share(&kc, index, "default/p=1.0/4", GIB, 4 * GIB)
        .await;

    // Someone raises the hard limit behind the driver's back: a mismatch, an Event on the
    // pod, counted, a health message on the device.
    let key = format!(
        "nvidia/{}/vidmem",
        gpus()[index].pci_bus_id.to_ascii_lowercase()
    );
    std::fs::write(main.path.join("dmem.max"), format!("{key} {}\n", 8 * GIB)).expect("raised");
    wait_until("the mismatch is seen", || {
        row(&published_rows(&api, NODE), "p", "main").is_some_and(|r| r["state"] == "mismatch")
    })
    .await;
    wait_until("a Warning Event on the pod", || {
        !pod_events(&api, "p", "GpuShareMemoryLimitMismatch").is_empty()
    })
    .await;
    let (_, metrics) = extender_http::get(admin, "/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            "gpushare_enforcement_violations_total",
            &["state=\"mismatch\""]
        )
        .as_deref(),
        Some("1"),
        "{metrics}"
    );
    kubelet
        .wait_plugins("a health message on the device", |ps| {
            ps.iter().any(|p| {
                p.health.iter().any(|h| {
                    h.health == "HEALTHY"
                        && h.message
                            .contains("GPU memory limit mismatch for default/p container main")
                })
            })
        })
        .await
        .expect("the message reaches kubelet");

    // The container stops: its limit is cleared before the cgroup goes, the record dropped.
    host.stop(&main);
    wait_until("the stopped container's limit is cleared", || {
        host.dmem(&main.path, "dmem.max", index).as_deref() == Some("max")
            && !host.state.join("ctr-main.json").exists()
    })
    .await;
    let pod_dir = main.path.parent().expect("pod");
    assert_eq!(
        host.dmem(pod_dir, "dmem.min", index).as_deref(),
        Some("0"),
        "the ancestors no longer count the soft limit"
    );
    let (_, metrics) = extender_http::get(admin, "/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            "gpushare_enforcement_cleanups_total",
            &["outcome=\"cleared\""]
        )
        .as_deref(),
        Some("1")
    );
    plugin.stop().await;
    api.shutdown().await;
}

#[tokio::test]
async fn device_plugin_a_4gib_pod_gets_the_limit_device_whose_hook_limits_its_container() {
    let host = Host::new(MemoryAccounting::Misc, "615.10.02");
    let cdi = host.nvidia_cdi_spec();
    let dummy = FakeBackend::from_spec("1x1GiB").expect("fake").health();
    let cluster = deviceplugin_cluster::cluster_on_backend(
        host.backend(),
        dummy,
        &deviceplugin_cluster::node_yaml(""),
        |_| {},
        |c| {
            host.driver_config(c);
            c.node.device_list_strategy = DeviceListStrategies::new([DeviceListStrategy::CdiCri]);
            c.node.cdi_spec_dirs = vec![cdi.clone()];
        },
    )
    .await
    .expect("the device plugin starts with driver enforcement");
    assert_eq!(
        cluster
            .plugin()
            .agent()
            .enforcement()
            .mechanism(ServingPath::DevicePlugin),
        Mechanism::Driver
    );
    cluster.bound_pod("p", &[("main", 4)], Some(0), 1);
    let (_, resp) = cluster.allocate("p", "main", 4).await.expect("allocated");
    let name = format!("gpushare.io/memory-limit={}_{}", gpus()[0].uuid, 4 * GIB);
    let names: Vec<&str> = resp.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["nvidia.com/gpu=0", name.as_str()]);
    assert_eq!(resp.envs["NVIDIA_GPU_MEMORY_LIMIT"], "4096");
    assert_eq!(resp.envs["NVIDIA_GPU_MEMORY_REQUEST"], "4096");
    let spec: Value = serde_json::from_slice(
        &std::fs::read(host.root().join("limit-cdi").join(format!(
            "gpushare.io_memory-limit_{}_{}.json",
            gpus()[0].uuid,
            4 * GIB
        )))
        .expect("the limit spec"),
    )
    .expect("json");
    let uid = crate::support::objects::pod_uid(&cluster.api, "p");
    let main = host.container(&uid, "ctr-dp", 5151, ("default", "p", "main"), false);
    let out = run_hook_as_runtime(&hook_of(&spec, 0), &oci_state(&main));
    assert!(out.status.success(), "{}", stderr(&out));
    let limited = host.workload(&main, 0, &[3 * GIB, 2 * GIB]);
    assert!(
        stdout(&limited).starts_with(&format!("memory total={}", 4 * GIB)),
        "{}",
        stdout(&limited)
    );
    assert_eq!(limited.status.code(), Some(2), "past 4 GiB: out of memory");
    wait_until("the readback", || {
        metric(
            &cluster.plugin().render_metrics(),
            "gpushare_container_gpu_memory_limit_bytes",
            &["pod=\"p\"", "container=\"main\""],
        )
        .as_deref()
            == Some((4 * GIB).to_string().as_str())
    })
    .await;

    // A running GPU container the hook never saw (a runtime ignoring CDI): missing, an Event.
    let mut q = deviceplugin_cluster::pod_json("q", &[], &[("main", 2)], Some(1), 2);
    q["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] = json!("true");
    q["status"] = json!({
        "phase": "Running",
        "containerStatuses": [{
            "name": "main", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
            "containerID": "containerd://never-hooked",
            "state": { "running": { "startedAt": "2026-12-01T00:00:00Z" } },
        }],
    });
    cluster.api.create_object(q).expect("pod q");
    wait_until("the unhooked container is reported", || {
        row(&published_rows(&cluster.api, DP_NODE), "q", "main")
            .is_some_and(|r| r["state"] == "missing" && r["index"] == 1)
    })
    .await;
    wait_until("a Warning Event on pod q", || {
        !pod_events(&cluster.api, "q", "GpuShareMemoryLimitMissing").is_empty()
    })
    .await;
    cluster.stop().await;
}

#[tokio::test]
async fn driver_on_a_node_without_support_refuses_to_start_and_auto_falls_back_saying_so() {
    let host = Host::new(MemoryAccounting::Dmem, "550.54.15");
    let cdi = host.nvidia_cdi_spec();
    let tweak = |enforcement: Enforcement, mps: bool| {
        let host = &host;
        let cdi = cdi.clone();
        move |c: &mut Config| {
            host.driver_config(c);
            c.node.enforcement = enforcement;
            c.node.mps = mps;
            c.node.device_list_strategy = DeviceListStrategies::new([DeviceListStrategy::CdiCri]);
            c.node.cdi_spec_dirs = vec![cdi];
        }
    };
    let dummy = || FakeBackend::from_spec("1x1GiB").expect("fake").health();
    let Err(refused) = deviceplugin_cluster::cluster_on_backend(
        host.backend(),
        dummy(),
        &deviceplugin_cluster::node_yaml(""),
        |_| {},
        tweak(Enforcement::Driver, false),
    )
    .await
    else {
        panic!("driver without support refuses to start");
    };
    let msg = format!("{refused:#}");
    assert!(msg.contains("enforcement = driver cannot work"), "{msg}");
    assert!(msg.contains("driver 550.54.15 is older than R615"), "{msg}");
    assert!(msg.contains("fix: upgrade the driver"), "{msg}");

    let cluster = deviceplugin_cluster::cluster_on_backend(
        host.backend(),
        dummy(),
        &deviceplugin_cluster::node_yaml(""),
        |_| {},
        tweak(Enforcement::Auto, false),
    )
    .await
    .expect("auto starts");
    let decision = cluster.enforcement_decision();
    assert_eq!(decision.mechanism, Mechanism::None);
    assert!(decision.why.contains("older than R615"), "{}", decision.why);
    let (_, resp) = {
        cluster.bound_pod("p", &[("main", 4)], Some(0), 1);
        cluster.allocate("p", "main", 4).await.expect("allocated")
    };
    assert!(
        !resp.envs.contains_key("NVIDIA_GPU_MEMORY_LIMIT"),
        "no driver limit"
    );
    assert_eq!(resp.cdi_devices.len(), 1, "no limit device");
    cluster.stop().await;
    let _ = nvml_stub::LIBRARY_NAME;
}

#[tokio::test]
async fn a_stopped_containers_limit_is_cleared_while_its_cgroup_still_exists() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let mut config = Config::default();
    host.driver_config(&mut config);
    let backend = host.backend();
    let inventory = backend.inventory().expect("the stub's GPUs");
    let enforcer = Arc::new(gpushare::node::enforcement::Enforcer::prepare(
        &config.node,
        &backend,
        &inventory,
    ));
    assert!(enforcer.support().ok(), "{:?}", enforcer.support());
    let limits = enforcer.limits().expect("NVML's limits").clone();
    let c = host.container("u1", "c1", 101, ("default", "p", "main"), true);
    let hook = crate::support::enforcement::hook(&[(&gpus()[0].uuid, 4 * GIB)], &host.hook_flags());
    assert!(run_hook_as_runtime(&hook, &oci_state(&c)).status.success());
    let pod_dir = c.path.parent().expect("pod").to_path_buf();
    assert_eq!(
        host.dmem(&pod_dir, "dmem.min", 0),
        Some((4 * GIB).to_string())
    );
    // Only the watch runs (no readback cycle): the container stops, its cgroup stays.
    let stop = Arc::new(AtomicBool::new(false));
    let watch = {
        let (enforcer, stop) = (enforcer.clone(), stop.clone());
        std::thread::spawn(move || {
            gpushare::node::enforcement::readback::watch_stops(enforcer, limits, stop)
        })
    };
    host.stop(&c);
    wait_until("the limit cleared while the cgroup exists", || {
        host.dmem(&c.path, "dmem.max", 0).as_deref() == Some("max")
            && !host.state.join("c1.json").exists()
    })
    .await;
    assert!(c.path.is_dir(), "the runtime has not removed it");
    assert_eq!(
        host.dmem(&pod_dir, "dmem.min", 0).as_deref(),
        Some("0"),
        "the ancestors no longer count its soft limit"
    );
    assert_eq!(enforcer.status().cycles(), 0, "no readback cycle did it");
    stop.store(true, Ordering::Relaxed);
    watch.join().expect("the watch ends");
}

#[tokio::test]
async fn a_restarted_node_agent_reconciles_what_happened_while_it_was_down() {
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let hook = crate::support::enforcement::hook(&[(&gpus()[0].uuid, 2 * GIB)], &host.hook_flags());
    // While no node agent ran: one container stopped (its cgroup still there), one went
    // entirely, one still runs.
    let stopped = host.container("u1", "stopped", 301, ("default", "a", "main"), true);
    let gone = host.container("u2", "gone", 302, ("default", "b", "main"), true);
    let running = host.container("u3", "running", 303, ("default", "c", "main"), true);
    for c in [&stopped, &gone, &running] {
        assert!(run_hook_as_runtime(&hook, &oci_state(c)).status.success());
    }
    host.stop(&stopped);
    for f in ["dmem.max", "dmem.min", "dmem.current", "cgroup.events"] {
        std::fs::remove_file(gone.path.join(f)).expect("gone");
    }
    std::fs::remove_dir(&gone.path).expect("the runtime removed it");

    let (api, _dir, _config, plugin) = dra_plugin(&host).await;
    wait_until("the first cycle reconciled the records", || {
        !host.state.join("stopped.json").exists() && !host.state.join("gone.json").exists()
    })
    .await;
    assert_eq!(
        host.dmem(&stopped.path, "dmem.max", 0).as_deref(),
        Some("max"),
        "cleared"
    );
    assert!(
        host.state.join("running.json").exists(),
        "the running one is kept"
    );
    wait_until("the running one read back", || {
        row(&published_rows(&api, NODE), "c", "main").is_some_and(|r| r["state"] == "enforced")
    })
    .await;
    let (_, metrics) = extender_http::get(plugin.admin_addr().expect("admin"), "/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            "gpushare_enforcement_cleanups_total",
            &["outcome=\"missed\""]
        )
        .as_deref(),
        Some("1"),
        "{metrics}"
    );
    plugin.stop().await;
    api.shutdown().await;
}
