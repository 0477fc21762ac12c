//! `gpushare doctor --dra` over host roots built in the test (directories present, missing,
//! read-only, a file in their place; containerd 2.x, 1.7 with and without `enable_cdi`,
//! cri-dockerd; device-plugin sockets on the same node) and over the sandbox API server
//! (`resource.k8s.io/v1` served or not, the `DRAConsumableCapacity` gate on and off, the
//! DeviceClass absent, present, or selecting another driver), with a golden text report.

use std::path::Path;

use gpushare::config::Config;
use gpushare::doctor::dra::DraArgs;
use gpushare::doctor::report::{Check, Status};
use gpushare::doctor::{Options, Role, diagnose};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, FeatureGate};
use serde_json::Value;

use crate::support::doctor_node::{
    check_of as json_check, fake_node_doctor, report_of as report, status_of,
};
use crate::support::source_tree::assert_generated;
use crate::support::stdout;

const CONTAINERD_2: &str = "version = 3\n";
const CONTAINERD_17: &str = "version = 2\n";
const CONTAINERD_17_CDI_OFF: &str =
    "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  enable_cdi = false\n";

/// A host root with `dirs` and `files` (host paths).
fn root(dirs: &[&str], files: &[(&str, &str)]) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    for d in dirs {
        std::fs::create_dir_all(tmp.path().join(d.trim_start_matches('/'))).expect("mkdir");
    }
    for (f, text) in files {
        let p = tmp.path().join(f.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    }
    tmp
}

/// A DRA node as the chart leaves it: every directory, containerd 2.x.
fn sound_root() -> tempfile::TempDir {
    root(
        &[
            "/var/lib/kubelet/plugins_registry",
            "/var/lib/kubelet/plugins/gpushare.io",
            "/var/lib/kubelet/device-plugins",
            "/var/run/cdi",
            "/var/run/gpushare/gpushare.io",
        ],
        &[
            ("/etc/containerd/config.toml", CONTAINERD_2),
            ("/etc/hostname", "gpu-node-1\n"),
        ],
    )
}

fn node_doctor(root: &Path, extra: &[&str]) -> std::process::Output {
    node_doctor_with_gpus(root, "2x16GiB", extra)
}

fn node_doctor_with_gpus(root: &Path, gpus: &str, extra: &[&str]) -> std::process::Output {
    fake_node_doctor(root, gpus, &[&["--dra"], extra].concat())
}

fn text_of(report: &Value, id: &str) -> String {
    let c = json_check(report, id);
    format!(
        "{}\n{}",
        c["detail"].as_str().unwrap_or(""),
        c["hint"].as_str().unwrap_or("")
    )
}

const NODE_IDS: [&str; 6] = [
    "dra-registry-dir",
    "dra-plugin-dir",
    "dra-cdi-dir",
    "dra-state-dir",
    "dra-cdi-runtime",
    "dra-plugin-conflict",
];

// ---------------------------------------------------------------- node

#[test]
fn a_sound_dra_node_passes_with_a_golden_report() {
    let r = sound_root();
    let out = node_doctor(r.path(), &[]);
    let text = stdout(&out);
    assert_generated(
        "tests/golden/doctor/dra.node.txt",
        &text,
        "GPUSHARE_UPDATE_GOLDEN=1 cargo test --test it doctor_dra::",
    );
    let rep = report(&node_doctor(r.path(), &["-o", "json"]));
    for id in NODE_IDS {
        assert_eq!(status_of(&rep, id), "ok", "{id}: {}", text_of(&rep, id));
    }
    assert!(
        text_of(&rep, "dra-cdi-runtime")
            .contains("containerd /etc/containerd/config.toml (version 3): CDI enabled")
    );
    // The DRA path hands GPUs over through CDI: nvidia need not be the default runtime.
    assert!(!text.contains("] container-runtime "), "{text}");
    // A DRA node is not a device-plugin node: none of the device plugin's checks (its kubelet
    // socket, the ListAndWatch limit, its label) runs; the DRA unit check does.
    for id in [
        "device-plugin-dir",
        "kubelet-socket",
        "memory-unit",
        "node-label",
        "plugin-conflict",
    ] {
        assert!(!text.contains(&format!("] {id} ")), "{id}: {text}");
    }
    assert_eq!(status_of(&rep, "dra-memory-unit"), "ok");
    // Without --dra, no DRA check runs.
    let plain = fake_node_doctor(r.path(), "2x16GiB", &["-o", "json"]);
    assert!(!stdout(&plain).contains("\"dra-"), "{}", stdout(&plain));
    assert_eq!(status_of(&report(&plain), "container-runtime"), "fail");
}

/// A GPU of fewer than two units cannot be published (the API server refuses `min + step >
/// value`): a warning naming it and a unit that fits every GPU; a failure when no GPU fits.
#[test]
fn a_gpu_too_small_for_the_unit_is_named_with_a_unit_that_fits() {
    let r = sound_root();
    let rep = report(&node_doctor_with_gpus(
        r.path(),
        "16GiB,15GiB",
        &["--memory-unit", "8GiB", "-o", "json"],
    ));
    assert_eq!(status_of(&rep, "dra-memory-unit"), "warn");
    let text = text_of(&rep, "dra-memory-unit");
    assert!(
        text.contains(
            "GPU 1 (GPU-fake-0000-0000-0000-000000000001, 15360 MiB) holds 1 unit(s) of 8GiB"
        ),
        "{text}"
    );
    assert!(!text.contains("GPU 0"), "{text}");
    assert!(text.contains("--memory-unit 4GiB"), "{text}");
    let rep = report(&node_doctor_with_gpus(
        r.path(),
        "16GiB",
        &["--memory-unit", "16GiB", "-o", "json"],
    ));
    assert_eq!(status_of(&rep, "dra-memory-unit"), "fail");
    assert!(text_of(&rep, "dra-memory-unit").contains("--memory-unit 8GiB"));
}

#[test]
fn broken_directories_runtime_and_a_device_plugin_fail_with_their_fixes() {
    let r = root(
        &[
            "/var/lib/kubelet/plugins/gpushare.io",
            "/var/lib/kubelet/device-plugins",
        ],
        &[
            ("/etc/containerd/config.toml", CONTAINERD_17_CDI_OFF),
            ("/var/run/cdi", "not a directory"),
            ("/var/run/gpushare/gpushare.io", "not a directory"),
            ("/var/lib/kubelet/device-plugins/aliyungpushare.sock", ""),
            ("/var/lib/kubelet/device-plugins/nvidia-gpu.sock", ""),
        ],
    );
    let plugin = r.path().join("var/lib/kubelet/plugins/gpushare.io");
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o555))
        .expect("chmod");
    let out = node_doctor(r.path(), &["-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let rep = report(&out);
    for id in NODE_IDS {
        assert_eq!(status_of(&rep, id), "fail", "{id}: {}", text_of(&rep, id));
    }
    let reg = text_of(&rep, "dra-registry-dir");
    assert!(
        reg.contains("/var/lib/kubelet/plugins_registry does not exist"),
        "{reg}"
    );
    assert!(reg.contains("--registry-dir"), "{reg}");
    let plug = text_of(&rep, "dra-plugin-dir");
    assert!(
        plug.contains("/var/lib/kubelet/plugins/gpushare.io is not writable"),
        "{plug}"
    );
    assert!(plug.contains("chmod u+w"), "{plug}");
    assert!(text_of(&rep, "dra-cdi-dir").contains("/var/run/cdi exists but is not a directory"));
    assert!(
        text_of(&rep, "dra-state-dir")
            .contains("/var/run/gpushare/gpushare.io exists but is not a directory")
    );
    let rt = text_of(&rep, "dra-cdi-runtime");
    assert!(rt.contains("CDI DISABLED"), "{rt}");
    assert!(rt.contains("enable_cdi = true"), "{rt}");
    let conflict = text_of(&rep, "dra-plugin-conflict");
    assert!(
        conflict.contains("/var/lib/kubelet/device-plugins/aliyungpushare.sock exists: gpushare's device plugin serves aliyun.com/gpu-mem"),
        "{conflict}"
    );
    assert!(conflict.contains("nvidia-gpu.sock exists"), "{conflict}");
    assert!(
        conflict.contains("gpushare.io/gpu-mem-path=dra"),
        "{conflict}"
    );
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod back");
}

#[test]
fn containerd_1_7_without_enable_cdi_warns_and_missing_plugin_dirs_only_warn() {
    let r = root(
        &["/var/lib/kubelet/plugins_registry"],
        &[("/etc/containerd/config.toml", CONTAINERD_17)],
    );
    let rep = report(&node_doctor(r.path(), &["-o", "json"]));
    assert_eq!(status_of(&rep, "dra-registry-dir"), "ok");
    // Created at start by the chart's hostPath (DirectoryOrCreate).
    assert_eq!(status_of(&rep, "dra-plugin-dir"), "warn");
    assert!(text_of(&rep, "dra-plugin-dir").contains("DirectoryOrCreate"));
    assert_eq!(status_of(&rep, "dra-cdi-dir"), "warn");
    assert_eq!(status_of(&rep, "dra-cdi-runtime"), "warn");
    assert!(text_of(&rep, "dra-cdi-runtime").contains("enable_cdi is not set"));
    assert_eq!(status_of(&rep, "dra-plugin-conflict"), "ok");
}

#[test]
fn the_flags_move_the_directories_and_docker_cannot_serve_dra() {
    let r = root(
        &[
            "/opt/registry",
            "/var/lib/kubelet/plugins/example.com",
            "/opt/cdi",
        ],
        &[
            ("/etc/containerd/config.toml", CONTAINERD_2),
            (
                "/var/lib/kubelet/config.yaml",
                "kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///run/containerd/containerd.sock\n",
            ),
        ],
    );
    let rep = report(&node_doctor(
        r.path(),
        &[
            "-o",
            "json",
            "--driver-name",
            "example.com",
            "--registry-dir",
            "/opt/registry",
            "--cdi-dir",
            "/opt/cdi",
        ],
    ));
    assert_eq!(status_of(&rep, "dra-registry-dir"), "ok");
    assert!(
        text_of(&rep, "dra-plugin-dir")
            .contains("/var/lib/kubelet/plugins/example.com is writable")
    );
    assert_eq!(status_of(&rep, "dra-cdi-dir"), "ok");
    // containerd 2.x reads /etc/cdi and /var/run/cdi, not /opt/cdi.
    assert_eq!(status_of(&rep, "dra-cdi-runtime"), "warn");
    assert!(
        text_of(&rep, "dra-cdi-runtime").contains("the DRA plugin from /opt/cdi"),
        "{}",
        text_of(&rep, "dra-cdi-runtime")
    );
    assert!(text_of(&rep, "dra-cdi-runtime").contains("--cdi-dir"));
    // The kubelet on cri-dockerd: no CDI devices reach containers.
    let docker = sound_root();
    std::fs::create_dir_all(docker.path().join("var/lib/kubelet")).expect("mkdir");
    std::fs::write(
        docker.path().join("var/lib/kubelet/config.yaml"),
        "kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///run/cri-dockerd.sock\n",
    )
    .expect("write");
    let rep = report(&node_doctor(docker.path(), &["-o", "json"]));
    assert_eq!(status_of(&rep, "dra-cdi-runtime"), "fail");
    assert!(text_of(&rep, "dra-cdi-runtime").contains("the DRA path needs CDI"));
}

// ---------------------------------------------------------------- control plane

async fn dra_checks(api: &ApiServer, role: Role, root: &Path) -> Vec<Check> {
    let mut config = Config::default();
    config.cluster.kubeconfig = api.admin_kubeconfig_path().display().to_string();
    config.node.node_name = "gpu-node-1".to_string();
    let opts = Options {
        role,
        root: root.to_path_buf(),
        preflight: false,
        no_cluster: false,
        scheduler_config: None,
        extender_url: None,
        webhook_url: None,
        dra: Some(DraArgs {
            dra: true,
            ..DraArgs::default()
        }),
    };
    diagnose(&opts, &config)
        .await
        .checks
        .into_iter()
        .filter(|c| c.id.starts_with("dra-"))
        .collect()
}

fn by_id<'a>(checks: &'a [Check], id: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no {id} in {checks:?}"))
}

const CLASS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: { name: gpu-mem.gpushare.io }
spec:
  selectors: [{ cel: { expression: 'device.driver == "gpushare.io" && device.attributes["gpushare.io"].type == "gpu"' } }]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_checks_read_the_api_and_store_nothing() {
    let api = ApiServer::start().await.expect("sandbox");
    let empty = tempfile::tempdir().expect("root");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    let ids: Vec<&str> = c.iter().map(|c| c.id).collect();
    assert_eq!(
        ids,
        [
            "dra-api",
            "dra-consumable-capacity",
            "dra-device-taints",
            "dra-device-class"
        ]
    );
    let taints = by_id(&c, "dra-device-taints");
    assert_eq!(taints.status, Status::Ok, "{taints:?}");
    assert_eq!(by_id(&c, "dra-api").status, Status::Ok, "{c:?}");
    let cc = by_id(&c, "dra-consumable-capacity");
    assert_eq!(cc.status, Status::Ok, "{cc:?}");
    let class = by_id(&c, "dra-device-class");
    assert_eq!(class.status, Status::Fail, "{class:?}");
    assert!(class.hint.contains("dra.enabled=true"), "{}", class.hint);
    // The dry run stored nothing.
    assert!(api.list_objects("resourceslices", None).is_empty());
    let probe = api
        .requests()
        .into_iter()
        .find(|r| r.path == "/apis/resource.k8s.io/v1/resourceslices")
        .expect("the probe was sent");
    assert!(probe.query.contains("dryRun=All"), "{}", probe.query);
    assert!(
        probe.body.contains("\"allowMultipleAllocations\":true"),
        "{}",
        probe.body
    );

    api.seed_yaml(CLASS).expect("class");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    let class = by_id(&c, "dra-device-class");
    assert_eq!(class.status, Status::Ok, "{class:?}");
    assert!(class.detail.contains("device.driver == \"gpushare.io\""));

    // A class selecting every device of the driver (HCAs and generic devices too).
    api.delete_object("deviceclasses", None, "gpu-mem.gpushare.io")
        .expect("delete");
    api.seed_yaml(&CLASS.replace(" && device.attributes[\"gpushare.io\"].type == \"gpu\"", ""))
        .expect("class");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    let class = by_id(&c, "dra-device-class");
    assert_eq!(class.status, Status::Warn, "{class:?}");
    assert!(class.detail.contains("not only its GPUs"), "{class:?}");
    assert!(
        class
            .hint
            .contains(&gpushare::core::wire::dra_gpu_class_selector("gpushare.io")),
        "{}",
        class.hint
    );

    // A class selecting another driver.
    api.delete_object("deviceclasses", None, "gpu-mem.gpushare.io")
        .expect("delete");
    api.seed_yaml(&CLASS.replace("\"gpushare.io\"", "\"example.com\""))
        .expect("class");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    let class = by_id(&c, "dra-device-class");
    assert_eq!(class.status, Status::Warn, "{class:?}");
    assert!(
        class
            .detail
            .contains("no selector names the driver \"gpushare.io\"")
    );
    api.shutdown().await;
}

/// On Kubernetes 1.34 and 1.35 `DRADeviceTaints` is off by default: the API server drops the
/// taints of the slices, and an unhealthy GPU keeps receiving claims. The same dry-run slice
/// tells, and the check names the gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_off_api_server_warns_that_unhealthy_gpus_keep_receiving_claims() {
    let api = ApiServer::start().await.expect("sandbox");
    api.set_feature_gate(FeatureGate::DRADeviceTaints, false);
    let empty = tempfile::tempdir().expect("root");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    assert_eq!(by_id(&c, "dra-consumable-capacity").status, Status::Ok);
    let t = by_id(&c, "dra-device-taints");
    assert_eq!(t.status, Status::Warn, "{t:?}");
    assert!(t.detail.contains("dropped the taints"), "{}", t.detail);
    assert!(t.hint.contains("DRADeviceTaints=true"), "{}", t.hint);
    assert!(
        api.list_objects("resourceslices", None).is_empty(),
        "a dry run stores nothing"
    );
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_off_api_server_fails_consumable_capacity() {
    let api = ApiServer::start().await.expect("sandbox");
    api.set_consumable_capacity(false);
    let empty = tempfile::tempdir().expect("root");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    assert_eq!(by_id(&c, "dra-api").status, Status::Ok);
    let cc = by_id(&c, "dra-consumable-capacity");
    assert_eq!(cc.status, Status::Fail, "{cc:?}");
    assert!(
        cc.detail.contains("dropped allowMultipleAllocations"),
        "{}",
        cc.detail
    );
    assert!(
        cc.hint.contains("DRAConsumableCapacity=true"),
        "{}",
        cc.hint
    );
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_resource_k8s_io_v1_the_rest_is_skipped() {
    let api = ApiServer::start().await.expect("sandbox");
    api.inject(
        Fault::new(
            Some(http::Method::GET),
            "/apis/resource.k8s.io/v1",
            FaultAction::Status(404),
        )
        .times(10),
    );
    let empty = tempfile::tempdir().expect("root");
    let c = dra_checks(&api, Role::ControlPlane, empty.path()).await;
    let served = by_id(&c, "dra-api");
    assert_eq!(served.status, Status::Fail, "{served:?}");
    assert!(served.detail.contains("does not serve resource.k8s.io/v1"));
    assert!(served.hint.contains("1.34"));
    for id in ["dra-consumable-capacity", "dra-device-class"] {
        assert_eq!(by_id(&c, id).status, Status::Skip, "{id}");
    }
    api.shutdown().await;
}

const GPU_MEM_NODE: &str = "
apiVersion: v1
kind: Node
metadata: { name: gpu-node-1 }
status:
  capacity: { aliyun.com/gpu-mem: \"30\" }
  allocatable: { aliyun.com/gpu-mem: \"30\" }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_the_device_plugin_serves_conflicts() {
    let api = ApiServer::start().await.expect("sandbox");
    api.seed_yaml(GPU_MEM_NODE).expect("node");
    let r = sound_root();
    let c = dra_checks(&api, Role::Node, r.path()).await;
    let conflict = by_id(&c, "dra-plugin-conflict");
    assert_eq!(conflict.status, Status::Fail, "{conflict:?}");
    assert!(
        conflict
            .detail
            .contains("the node advertises aliyun.com/gpu-mem: 30"),
        "{}",
        conflict.detail
    );
    // Node role: no control-plane DRA check.
    assert!(c.iter().all(|c| c.id != "dra-api"));
    api.shutdown().await;
}

/// `gpushare dra-plugin` runs `dra-plugin-conflict` in its preflight: with NVIDIA's device
/// plugin socket in kubelet's device-plugin directory it refuses to start, naming the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_plugin_preflight_runs_dra_plugin_conflict() {
    let api = ApiServer::start().await.expect("sandbox");
    api.seed_yaml("apiVersion: v1\nkind: Node\nmetadata: { name: gpu-node-1 }\n")
        .expect("node");
    let dir = crate::support::socket_dir::short_tempdir();
    let dp_dir = dir.path().join("device-plugins");
    std::fs::create_dir_all(&dp_dir).expect("mkdir");
    let _nvidia = std::os::unix::net::UnixListener::bind(dp_dir.join("nvidia-gpu.sock"))
        .expect("NVIDIA's plugin socket");
    let _kubelet = std::os::unix::net::UnixListener::bind(dp_dir.join("kubelet.sock"))
        .expect("kubelet's socket");
    let path = |p: &str| dir.path().join(p).display().to_string();
    let kubeconfig = api.admin_kubeconfig_path().display().to_string();
    let mut child = std::process::Command::new(crate::support::bin())
        .args([
            "--kubeconfig",
            &kubeconfig,
            "dra-plugin",
            "--node-name",
            "gpu-node-1",
            "--gpu-backend",
            "fake",
            "--fake-gpus",
            "1x16GiB",
            "--registry-dir",
            &path("registry"),
            "--plugin-dir",
            &path("plugin"),
            "--state-dir",
            &path("state"),
            "--cdi-dir",
            &path("cdi"),
            "--admin-address",
            "",
        ])
        .env("GPUSHARE_DEVICE_PLUGIN__DEVICE_PLUGIN_DIR", &dp_dir)
        .env("GPUSHARE_CLUSTER__API_WAIT_SECS", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    if status.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("output");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(1),
        "the DRA plugin started beside NVIDIA's device plugin: {err}"
    );
    assert!(err.contains("dra-plugin-conflict"), "{err}");
    assert!(err.contains("nvidia-gpu.sock"), "{err}");
    api.shutdown().await;
}

/// The GPU locks the node roles hold are named by both conflict checks: a GPU the device
/// plugin holds fails `dra-plugin-conflict`, one the DRA plugin holds warns in
/// `plugin-conflict`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_locks_held_by_the_other_path_are_named_by_the_conflict_checks() {
    use gpushare::node::gpu_locks::GpuLocks;
    use gpushare::node::paths::ServingPath;
    let r = sound_root();
    let locks = GpuLocks::new(&r.path().join("var/run/gpushare/gpus"), "gpu-node-1");
    let dp = locks
        .try_take("GPU-aaaa", ServingPath::DevicePlugin)
        .expect("taken");
    let rep = report(&node_doctor(r.path(), &["-o", "json"]));
    assert_eq!(status_of(&rep, "dra-plugin-conflict"), "fail");
    let conflict = text_of(&rep, "dra-plugin-conflict");
    assert!(
        conflict.contains("GPU GPU-aaaa is served by the device plugin"),
        "{conflict}"
    );
    drop(dp);
    let rep = report(&node_doctor(r.path(), &["-o", "json"]));
    assert_eq!(status_of(&rep, "dra-plugin-conflict"), "ok");

    let _dra = locks.try_take("GPU-bbbb", ServingPath::Dra).expect("taken");
    let out = fake_node_doctor(r.path(), "1x16GiB", &["-o", "json"]);
    let rep = report(&out);
    assert_eq!(status_of(&rep, "plugin-conflict"), "warn");
    assert!(
        text_of(&rep, "plugin-conflict")
            .contains("GPU GPU-bbbb is served by the DRA kubelet plugin"),
        "{}",
        text_of(&rep, "plugin-conflict")
    );
}
