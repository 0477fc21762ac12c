//! `gpushare doctor` as an operator runs it: fixture host roots (Docker, containerd v2/v3,
//! CRI-O, no runtime, old driver, MPS and a second plugin), GPU backends (fake, NVML missing,
//! a fake `nvidia-smi`), the sandbox API server for `api-server` / `rbac` / `node-label`,
//! scheduler configurations, an in-test extender for `extender-reachable`, golden text and
//! JSON outputs, exit codes, and the preflight the server roles run.
//!
//! Fixture roots live in `tests/fixtures/doctor/<name>/`; each test copies one into a temp
//! directory and binds `kubelet.sock` there (sockets cannot be committed). Golden files live
//! in `tests/golden/doctor/`; `GPUSHARE_UPDATE_GOLDEN=1` rewrites them.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Output;

use gpushare::doctor::{Options, Role, diagnose, preflight};
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::Value;

use crate::support::doctor_node::{
    NODE, check_of as check, doctor_no_cluster, fake_node_doctor, node_root, preflight_config,
    report_of as json_of, status_of as status,
};
use crate::support::{fixture, run, stderr, stdout};

// ---------------------------------------------------------------- harness

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// `doctor --role node --root ROOT` with two fake 16 GiB GPUs and no cluster, plus `extra`.
fn node_doctor(root: &Path, extra: &[&str]) -> Output {
    fake_node_doctor(root, "2x16GiB", extra)
}

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/doctor")
        .join(name)
}

fn check_golden(name: &str, actual: &str) {
    let path = golden_path(name);
    if std::env::var("GPUSHARE_UPDATE_GOLDEN").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("golden dir");
        std::fs::write(&path, actual).expect("golden written");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden file {} unreadable ({e}); run with GPUSHARE_UPDATE_GOLDEN=1",
            path.display()
        )
    });
    assert_eq!(actual, expected, "output differs from {}", path.display());
}

// ---------------------------------------------------------------- golden outputs, exit codes

#[test]
fn docker_node_report_golden_text_and_json() {
    let root = node_root("docker-nvidia");
    let out = node_doctor(root.path(), &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let text = stdout(&out);
    assert!(
        !text.contains('\x1b'),
        "no colour when stdout is not a terminal"
    );
    check_golden("docker-nvidia.node.txt", &text);
    let out = node_doctor(root.path(), &["-o", "json"]);
    assert_eq!(out.status.code(), Some(0));
    check_golden("docker-nvidia.node.json", &stdout(&out));
    let report = json_of(&out);
    assert_eq!(report["role"], "node");
    for id in [
        "driver-version",
        "gpu-access",
        "nvml-library",
        "container-runtime",
        "nvidia-toolkit",
        "device-plugin-dir",
        "kubelet-socket",
        "memory-unit",
        "mps-daemon",
        "api-server",
        "node-label",
        "plugin-conflict",
        "rbac",
    ] {
        let c = check(&report, id);
        for field in ["title", "status", "detail", "hint"] {
            assert!(c[field].is_string(), "{id}.{field}: {c}");
        }
    }
    assert_eq!(report["summary"]["fail"], 0);
    assert_eq!(report["summary"]["warn"], 0);
}

#[test]
fn missing_runtime_report_golden_and_exit_1() {
    let root = node_root("missing-runtime");
    let out = node_doctor(root.path(), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    check_golden("missing-runtime.node.txt", &stdout(&out));
    let report = json_of(&node_doctor(root.path(), &["-o", "json"]));
    assert_eq!(status(&report, "container-runtime"), "fail");
    assert_eq!(status(&report, "nvidia-toolkit"), "fail");
    assert!(
        check(&report, "container-runtime")["hint"]
            .as_str()
            .is_some_and(|h| h.contains("nvidia-ctk runtime configure")),
        "{report:#}"
    );
}

#[test]
fn container_runtimes_of_every_kind() {
    let cases = [
        ("docker-nvidia", "ok", "Docker /etc/docker/daemon.json"),
        (
            "containerd-v2-nvidia",
            "ok",
            "containerd /etc/containerd/config.toml (version 2)",
        ),
        (
            "containerd-v2-runc",
            "fail",
            "--runtime=containerd --set-as-default",
        ),
        (
            "containerd-v3-nvidia",
            "ok",
            "/etc/containerd/conf.d/99-nvidia.toml",
        ),
        (
            "containerd-v3-runc",
            "fail",
            "--runtime=containerd --set-as-default",
        ),
        ("crio-nvidia", "ok", "the kubelet uses CRI-O"),
        (
            "missing-runtime",
            "fail",
            "no container runtime configuration found",
        ),
    ];
    for (name, expected, mention) in cases {
        let root = node_root(name);
        let out = node_doctor(root.path(), &["-o", "json"]);
        let report = json_of(&out);
        let c = check(&report, "container-runtime");
        assert_eq!(c["status"], expected, "{name}: {c:#}");
        let said = format!(
            "{}\n{}",
            c["detail"].as_str().unwrap_or(""),
            c["hint"].as_str().unwrap_or("")
        );
        assert!(said.contains(mention), "{name}: {mention:?} not in {said}");
        let code = if expected == "fail" { 1 } else { 0 };
        assert_eq!(out.status.code(), Some(code), "{name}: {report:#}");
    }
}

#[test]
fn an_old_driver_fails() {
    let root = node_root("old-driver");
    let out = node_doctor(root.path(), &["-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let report = json_of(&out);
    let c = check(&report, "driver-version");
    assert_eq!(c["status"], "fail", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .is_some_and(|d| d.contains("340.108") && d.contains("361.93")),
        "{c:#}"
    );
    assert!(
        c["hint"].as_str().is_some_and(|h| h.contains("upgrade")),
        "{c:#}"
    );
}

#[test]
fn another_plugin_warns_strict_turns_warnings_into_exit_1_and_mps_checks_the_daemon() {
    let root = node_root("mps-conflict");
    let out = node_doctor(root.path(), &["-o", "json"]);
    let report = json_of(&out);
    let conflict = check(&report, "plugin-conflict");
    assert_eq!(conflict["status"], "warn", "{conflict:#}");
    let detail = conflict["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("nvidia-gpu.sock") && detail.contains("nvidia-device-plugin"),
        "{detail}"
    );
    assert_eq!(report["summary"]["fail"], 0, "{report:#}");
    assert_eq!(out.status.code(), Some(0));
    let strict = node_doctor(root.path(), &["--strict"]);
    assert_eq!(strict.status.code(), Some(1), "{}", stdout(&strict));
    // Without --mps the daemon is not looked for.
    let report = json_of(&node_doctor(root.path(), &["-o", "json"]));
    assert_eq!(status(&report, "mps-daemon"), "skip");
    // With --mps on a node without the daemon: fail with the command that starts it (a
    // daemon that answers is tested in mps.rs, with a fake nvidia-cuda-mps-control).
    let bare = node_root("docker-nvidia");
    let report = json_of(&node_doctor(bare.path(), &["-o", "json", "--mps"]));
    let c = check(&report, "mps-daemon");
    assert_eq!(c["status"], "fail");
    assert!(
        c["hint"]
            .as_str()
            .is_some_and(|h| h.contains("nvidia-cuda-mps-control -d")),
        "{c:#}"
    );
}

// ---------------------------------------------------------------- GPU backends

#[test]
fn fake_gpus_are_listed_and_the_memory_unit_is_sized() {
    let root = node_root("docker-nvidia");
    let report = json_of(&node_doctor(
        root.path(),
        &["-o", "json", "--memory-unit", "MiB"],
    ));
    let gpu = check(&report, "gpu-access");
    assert_eq!(gpu["status"], "ok");
    let detail = gpu["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("backend fake serves") && detail.contains("2 GPU(s)"),
        "{detail}"
    );
    assert!(
        detail.contains("GPU 0: ") && detail.contains("GPU 1: ") && detail.contains("16384 MiB"),
        "{detail}"
    );
    // 2 × 16 GiB in MiB: 32768 IDs, ~2.2 MB: fits.
    let unit = check(&report, "memory-unit");
    assert_eq!(unit["status"], "ok", "{unit:#}");
    assert!(
        unit["detail"]
            .as_str()
            .is_some_and(|d| d.contains("32768 device IDs")),
        "{unit:#}"
    );
}

#[test]
fn an_old_device_plugin_key_works_and_is_named_with_its_new_name() {
    let root = node_root("docker-nvidia");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("gpushare.toml");
    std::fs::write(&file, "[device_plugin]\nmemory_unit = \"MiB\"\n").expect("config");
    let report = json_of(&node_doctor(
        root.path(),
        &["-o", "json", "--config", path(&file)],
    ));
    // The old key still applies: the unit check sizes MiB.
    let unit = check(&report, "memory-unit");
    assert!(
        unit["detail"]
            .as_str()
            .is_some_and(|d| d.contains("32768 device IDs")),
        "{unit:#}"
    );
    let deprecated = check(&report, "config-deprecated-keys");
    assert_eq!(deprecated["status"], "warn", "{deprecated:#}");
    let detail = deprecated["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("device_plugin.memory_unit")
            && detail.contains("use node.memory_unit")
            && detail.contains("gpushare.toml"),
        "{detail}"
    );
    // Under the new name: no such check.
    std::fs::write(&file, "[node]\nmemory_unit = \"MiB\"\n").expect("config");
    let report = json_of(&node_doctor(
        root.path(),
        &["-o", "json", "--config", path(&file)],
    ));
    assert!(
        report["checks"]
            .as_array()
            .is_some_and(|c| c.iter().all(|c| c["id"] != "config-deprecated-keys")),
        "{report:#}"
    );
}

#[test]
fn nvml_missing_fails_with_a_clear_detail() {
    let root = node_root("docker-nvidia");
    let nvml = [
        "--gpu-backend",
        "nvml",
        "--nvml-library",
        "/nonexistent/libnvidia-ml.so.1",
    ];
    let out = doctor_no_cluster(
        "node",
        &[&["--root", path(root.path()), "-o", "json"], &nvml[..]].concat(),
    );
    assert_eq!(out.status.code(), Some(1));
    let report = json_of(&out);
    let c = check(&report, "gpu-access");
    assert_eq!(c["status"], "fail", "{c:#}");
    let detail = c["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("nvml") && detail.contains("/nonexistent/libnvidia-ml.so.1"),
        "{detail}"
    );
    assert!(
        c["hint"].as_str().is_some_and(|h| h.contains("nvidia-smi")),
        "{c:#}"
    );
    // The library named in the configuration is missing too.
    assert_eq!(status(&report, "nvml-library"), "fail");
    // Without an inventory the driver version still comes from /proc.
    assert_eq!(status(&report, "driver-version"), "ok");
    assert_eq!(status(&report, "memory-unit"), "skip");
}

fn fake_nvidia_smi(dir: &Path, xml: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let program = dir.join("nvidia-smi");
    let mut file = std::fs::File::create(&program).expect("script");
    writeln!(
        file,
        "#!/bin/sh\ncat '{}'",
        fixture(&format!("nvidia-smi/{xml}")).display()
    )
    .expect("write");
    drop(file);
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    program
}

#[test]
fn a_fake_nvidia_smi_serves_and_mib_overflows_list_and_watch() {
    let root = node_root("docker-nvidia");
    let bin = tempfile::tempdir().expect("tempdir");
    let program = fake_nvidia_smi(bin.path(), "550.54.15-h100-80gb-x4.xml");
    let args = |unit: &'static str| {
        vec![
            "doctor".to_string(),
            "--role".into(),
            "node".into(),
            "--no-cluster".into(),
            "--root".into(),
            path(root.path()).into(),
            "--gpu-backend".into(),
            "nvidia-smi".into(),
            "--nvidia-smi".into(),
            path(&program).into(),
            "--memory-unit".into(),
            unit.into(),
            "-o".into(),
            "json".into(),
        ]
    };
    let run_args = |unit| {
        let a = args(unit);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        // Executing a script another test process briefly holds open can fail with
        // "Text file busy"; a second run settles it.
        let out = run(&refs);
        if stdout(&out).contains("Text file busy") {
            run(&refs)
        } else {
            out
        }
    };
    let report = json_of(&run_args("MiB"));
    let gpu = check(&report, "gpu-access");
    assert_eq!(gpu["status"], "ok", "{gpu:#}");
    assert!(
        gpu["detail"]
            .as_str()
            .is_some_and(|d| d.contains("backend nvidia-smi serves") && d.contains("4 GPU(s)")),
        "{gpu:#}"
    );
    let driver = check(&report, "driver-version");
    assert!(
        driver["detail"]
            .as_str()
            .is_some_and(|d| d.contains("from the nvidia-smi backend")),
        "{driver:#}"
    );
    // 4 × 80 GB in MiB is ~20 MB of device IDs: kubelet would refuse it (upstream DP#39).
    let unit = check(&report, "memory-unit");
    assert_eq!(unit["status"], "fail", "{unit:#}");
    assert!(
        unit["hint"]
            .as_str()
            .is_some_and(|h| h.contains("--memory-unit")),
        "{unit:#}"
    );
    let report = json_of(&run_args("GiB"));
    assert_eq!(status(&report, "memory-unit"), "ok");
}

// ---------------------------------------------------------------- scheduler configuration, extender

/// `doctor --role control-plane --no-cluster` plus `extra`.
fn control_plane(extra: &[&str]) -> Value {
    json_of(&doctor_no_cluster(
        "control-plane",
        &[&["-o", "json"], extra].concat(),
    ))
}

#[test]
fn scheduler_configurations() {
    let cases = [
        (
            "v1.yaml",
            "ok",
            "KubeSchedulerConfiguration kubescheduler.config.k8s.io/v1",
        ),
        (
            "v1beta2.yaml",
            "warn",
            "change apiVersion to kubescheduler.config.k8s.io/v1",
        ),
        ("policy.json", "fail", "removed in Kubernetes 1.23"),
        (
            "no-extender.yaml",
            "fail",
            "no extender manages aliyun.com/gpu-mem",
        ),
        ("no-node-cache.yaml", "warn", "nodeCacheCapable: true"),
    ];
    for (file, expected, mention) in cases {
        let cfg = fixture(&format!("doctor/scheduler/{file}"));
        let report = control_plane(&["--scheduler-config", path(&cfg)]);
        let c = check(&report, "scheduler-config");
        assert_eq!(c["status"], expected, "{file}: {c:#}");
        let said = format!(
            "{}\n{}",
            c["detail"].as_str().unwrap_or(""),
            c["hint"].as_str().unwrap_or("")
        );
        assert!(said.contains(mention), "{file}: {mention:?} not in {said}");
    }
    // What the project ships passes.
    let shipped =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("packaging/scheduler/scheduler-config.yaml");
    let report = control_plane(&["--scheduler-config", path(&shipped)]);
    assert_eq!(status(&report, "scheduler-config"), "ok", "{report:#}");
}

#[test]
fn the_scheduler_configuration_is_found_through_the_static_pod() {
    let root = fixture("doctor/control-plane");
    let report = control_plane(&["--root", path(&root)]);
    let c = check(&report, "scheduler-config");
    assert_eq!(c["status"], "ok", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .is_some_and(|d| d.contains("/etc/kubernetes/gpushare/scheduler-config.yaml")),
        "{c:#}"
    );
    let root = fixture("doctor/control-plane-policy");
    let report = control_plane(&["--root", path(&root)]);
    let c = check(&report, "scheduler-config");
    assert_eq!(c["status"], "fail", "{c:#}");
    assert!(
        c["detail"].as_str().is_some_and(|d| d.contains("Policy")),
        "{c:#}"
    );
    // No manifest, no flag: skipped with the way to point at the file.
    let empty = tempfile::tempdir().expect("tempdir");
    let report = control_plane(&["--root", path(empty.path())]);
    assert_eq!(status(&report, "scheduler-config"), "skip");
    assert_eq!(status(&report, "extender-reachable"), "skip");
}

/// A tiny HTTP server on a std thread answering `/version` and `/readyz` (with `ready_code`).
fn tiny_extender(ready_code: u16) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut line = String::new();
            if BufReader::new(&stream).read_line(&mut line).is_err() {
                continue;
            }
            let (code, body) = match line.split_whitespace().nth(1) {
                Some("/version") => (200, "0.1.0-test".to_string()),
                Some("/readyz") if ready_code == 200 => (200, "ok".to_string()),
                Some("/readyz") => (ready_code, "not leader".to_string()),
                _ => (404, "not found".to_string()),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {code} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{addr}/gpushare-scheduler")
}

#[test]
fn the_extender_is_probed_at_its_server_root() {
    let url = tiny_extender(200);
    let report = control_plane(&["--extender-url", &url]);
    let c = check(&report, "extender-reachable");
    assert_eq!(c["status"], "ok", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .is_some_and(|d| d.contains("0.1.0-test")),
        "{c:#}"
    );
    let url = tiny_extender(503);
    let report = control_plane(&["--extender-url", &url]);
    let c = check(&report, "extender-reachable");
    assert_eq!(c["status"], "warn", "{c:#}");
    assert!(
        c["detail"].as_str().is_some_and(|d| d.contains("503")),
        "{c:#}"
    );
    // A closed port fails (connection refused, at once).
    let closed = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let report = control_plane(&[
        "--extender-url",
        &format!("http://{closed}/gpushare-scheduler"),
    ]);
    let c = check(&report, "extender-reachable");
    assert_eq!(c["status"], "fail", "{c:#}");
    assert!(
        c["hint"].as_str().is_some_and(|h| h.contains("32766")),
        "{c:#}"
    );
}

// ---------------------------------------------------------------- the API server

const UNLABELLED_NVIDIA_NODE: &str = "
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-1
status:
  capacity:
    nvidia.com/gpu: \"2\"
";

/// Runs the binary on a blocking thread so the sandbox API server keeps serving.
async fn run_async(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&refs)
    })
    .await
    .expect("doctor ran")
}

fn cluster_args(api: &ApiServer, root: &Path, role: &str) -> Vec<String> {
    cluster_args_as(&api.admin_kubeconfig_path(), root, role)
}

/// Every permission the extender and the device plugin review, each as one rule, except those
/// named in `except` (`"<resource> <verb>"`).
fn role_rules_except(except: &[&str]) -> Vec<Value> {
    let all = [
        ("", "pods", &["get", "list", "watch", "patch"][..]),
        ("", "pods/binding", &["create"]),
        ("", "nodes", &["get", "list", "watch", "patch"]),
        ("", "nodes/status", &["patch"]),
        ("", "configmaps", &["get", "list", "watch"]),
        ("events.k8s.io", "events", &["create", "patch"]),
        (
            "coordination.k8s.io",
            "leases",
            &["get", "create", "update", "list", "watch"],
        ),
        ("resource.k8s.io", "resourceslices", &["list"]),
        ("resource.k8s.io", "resourceclaims", &["list"]),
    ];
    all.iter()
        .flat_map(|(group, resource, verbs)| verbs.iter().map(move |v| (group, resource, v)))
        .filter(|(_, resource, verb)| !except.contains(&format!("{resource} {verb}").as_str()))
        .map(|(group, resource, verb)| {
            serde_json::json!({ "apiGroups": [group], "resources": [resource], "verbs": [verb] })
        })
        .collect()
}

/// The kubeconfig of ServiceAccount `kube-system/doctor`, granted `rules` by a ClusterRole:
/// doctor run as an identity that RBAC restricts.
fn restricted_kubeconfig(api: &ApiServer, rules: Vec<Value>) -> PathBuf {
    for object in [
        serde_json::json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                            "metadata": { "name": "doctor", "namespace": "kube-system" } }),
        serde_json::json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                            "metadata": { "name": "doctor" }, "rules": rules }),
        serde_json::json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                            "metadata": { "name": "doctor" },
                            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "doctor" },
                            "subjects": [{ "kind": "ServiceAccount", "name": "doctor", "namespace": "kube-system" }] }),
    ] {
        api.create_object(object).expect("RBAC object created");
    }
    api.service_account_kubeconfig("kube-system", "doctor", None)
        .expect("a kubeconfig")
}

fn cluster_args_as(kubeconfig: &Path, root: &Path, role: &str) -> Vec<String> {
    let mut args: Vec<String> = [
        "--kubeconfig",
        path(kubeconfig),
        "doctor",
        "--role",
        role,
        "--root",
        path(root),
        "-o",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--gpu-backend", "fake", "--fake-gpus", "2x16GiB"].map(String::from));
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_checks_against_the_sandbox_cluster() {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(NODE).expect("seed node");
    let root = node_root("docker-nvidia");
    // The node name comes from the host's /etc/hostname (gpu-node-1).
    let out = run_async(cluster_args(&api, root.path(), "all")).await;
    let report = json_of(&out);
    assert_eq!(status(&report, "api-server"), "ok", "{report:#}");
    assert!(
        check(&report, "api-server")["detail"]
            .as_str()
            .is_some_and(|d| d.contains("Kubernetes v1.")),
        "{report:#}"
    );
    assert_eq!(status(&report, "rbac"), "ok", "{report:#}");
    let label = check(&report, "node-label");
    assert_eq!(label["status"], "ok", "{label:#}");
    assert!(
        label["detail"]
            .as_str()
            .is_some_and(|d| d.contains("aliyun.com/gpu-mem: 30")),
        "{label:#}"
    );
    assert_eq!(status(&report, "plugin-conflict"), "ok", "{report:#}");

    // One verb RBAC does not grant shows up by name and fails the run.
    let kubeconfig = restricted_kubeconfig(&api, role_rules_except(&["pods/binding create"]));
    let out = run_async(cluster_args_as(&kubeconfig, root.path(), "control-plane")).await;
    assert_eq!(out.status.code(), Some(1));
    let report = json_of(&out);
    let rbac = check(&report, "rbac");
    assert_eq!(rbac["status"], "fail", "{rbac:#}");
    let detail = rbac["detail"].as_str().unwrap_or("");
    assert!(detail.contains("denied: pods/binding create"), "{detail}");
    assert!(detail.contains("extender: 17 of 18 allowed"), "{detail}");
    // The device plugin does not create bindings: the node role's review passes.
    let report = json_of(&run_async(cluster_args_as(&kubeconfig, root.path(), "node")).await);
    assert_eq!(status(&report, "rbac"), "ok", "{report:#}");
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlabelled_node_with_nvidia_gpus_warns() {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(UNLABELLED_NVIDIA_NODE).expect("seed node");
    let root = node_root("docker-nvidia");
    let mut args = cluster_args(&api, root.path(), "node");
    args.extend(["--node-name".to_string(), "gpu-node-1".to_string()]);
    let report = json_of(&run_async(args).await);
    let label = check(&report, "node-label");
    assert_eq!(label["status"], "warn", "{label:#}");
    assert!(
        label["hint"]
            .as_str()
            .is_some_and(|h| h.contains("kubectl label node gpu-node-1 gpushare=true")),
        "{label:#}"
    );
    let conflict = check(&report, "plugin-conflict");
    assert_eq!(conflict["status"], "warn", "{conflict:#}");
    assert!(
        conflict["detail"]
            .as_str()
            .is_some_and(|d| d.contains("nvidia.com/gpu: 2")),
        "{conflict:#}"
    );
    // A node name the cluster does not know fails.
    let mut args = cluster_args(&api, root.path(), "node");
    args.extend(["--node-name".to_string(), "no-such-node".to_string()]);
    let report = json_of(&run_async(args).await);
    assert_eq!(status(&report, "node-label"), "fail", "{report:#}");
    api.shutdown().await;
}

#[test]
fn an_unreachable_api_server_fails_fast_and_skips_what_depends_on_it() {
    let kubeconfig = tempfile::NamedTempFile::new().expect("tempfile");
    let closed = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    std::fs::write(
        kubeconfig.path(),
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{closed}\n\
             contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user: {{}}\n"
        ),
    )
    .expect("kubeconfig");
    let out = run(&[
        "--kubeconfig",
        path(kubeconfig.path()),
        "doctor",
        "--role",
        "control-plane",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let report = json_of(&out);
    let api = check(&report, "api-server");
    assert_eq!(api["status"], "fail", "{api:#}");
    assert!(
        api["hint"]
            .as_str()
            .is_some_and(|h| h.contains("--kubeconfig")),
        "{api:#}"
    );
    assert_eq!(status(&report, "rbac"), "skip");
}

// ---------------------------------------------------------------- preflight

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_passes_a_sound_setup_and_refuses_a_broken_one() {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(NODE).expect("seed node");
    let root = node_root("docker-nvidia");
    let plugins = root.path().join("var/lib/kubelet/device-plugins");
    let config = preflight_config(&api, &plugins);
    preflight(Role::Node, &config)
        .await
        .expect("node preflight passes");
    preflight(Role::ControlPlane, &config)
        .await
        .expect("control-plane preflight passes");

    // A verb only the extender needs, not granted, stops the extender, not the device plugin.
    let mut config = config;
    config.cluster.kubeconfig = path(&restricted_kubeconfig(
        &api,
        role_rules_except(&["configmaps watch"]),
    ))
    .to_string();
    let err = preflight(Role::ControlPlane, &config)
        .await
        .expect_err("rbac fails");
    let text = format!("{err:#}");
    assert!(
        text.contains("rbac") && text.contains("--skip-doctor"),
        "{text}"
    );
    preflight(Role::Node, &config)
        .await
        .expect("node preflight still passes");

    // Fake GPUs that cannot be parsed: the device plugin must not start.
    let mut broken = preflight_config(&api, &plugins);
    broken.gpu.fake_gpus = "lots".to_string();
    let err = preflight(Role::Node, &broken)
        .await
        .expect_err("gpu-access fails");
    assert!(format!("{err:#}").contains("gpu-access"), "{err:#}");

    // No kubelet directory: fail.
    let mut broken = preflight_config(&api, &plugins);
    broken.device_plugin.device_plugin_dir = root.path().join("no-such-dir");
    let err = preflight(Role::Node, &broken)
        .await
        .expect_err("device-plugin-dir fails");
    assert!(format!("{err:#}").contains("device-plugin-dir"), "{err:#}");

    // No API server: the preflight's hint names what a server role accepts, not doctor's
    // own --no-cluster.
    let mut broken = preflight_config(&api, &plugins);
    broken.cluster.kubeconfig = root.path().join("no-such-kubeconfig").display().to_string();
    let report = diagnose(&Options::preflight(Role::ControlPlane), &broken).await;
    let check = report
        .checks
        .iter()
        .find(|c| c.id == "api-server")
        .expect("an api-server check");
    assert!(
        check.hint.contains("--kubeconfig") && !check.hint.contains("--no-cluster"),
        "{}",
        check.hint
    );
    api.shutdown().await;
}
