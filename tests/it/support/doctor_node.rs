//! What doctor's tests and the start-up tests share: a node's root file system copied from a
//! fixture (with a live-looking `kubelet.sock`), the labelled GPU node, the configuration of a
//! preflight against the sandbox API server with fake GPUs, a control-plane report
//! against the sandbox, and the `gpushare doctor` binary run without a cluster with its JSON
//! report read back.

use std::path::Path;
use std::process::Output;

use gpushare::config::{Config, GpuBackendKind};
use gpushare::doctor::report::Check;
use gpushare::doctor::{Options, Role, diagnose};
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::Value;

use super::{fixture, run, stderr, stdout};

/// A labelled GPU node with gpu-mem capacity, as the device plugin leaves it.
pub(crate) const NODE: &str = "
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-1
  labels:
    gpushare: \"true\"
status:
  capacity:
    aliyun.com/gpu-mem: \"30\"
";

/// A copy of fixture root `name` with a live-looking `kubelet.sock`.
pub(crate) fn node_root(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture(&format!("doctor/{name}")), dir.path());
    let plugins = dir.path().join("var/lib/kubelet/device-plugins");
    std::fs::create_dir_all(&plugins).expect("plugin dir");
    // The socket file stays (as a socket) after the listener is dropped.
    drop(
        std::os::unix::net::UnixListener::bind(plugins.join("kubelet.sock"))
            .expect("bind kubelet.sock"),
    );
    dir
}

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("fixture dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            std::fs::create_dir_all(&target).expect("mkdir");
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// The configuration of a node preflight: the sandbox API server, two fake 16 GiB GPUs, and
/// `plugin_dir` as the kubelet's device-plugin directory.
pub(crate) fn preflight_config(api: &ApiServer, plugin_dir: &Path) -> Config {
    let mut c = Config::default();
    c.cluster.kubeconfig = api
        .admin_kubeconfig_path()
        .to_str()
        .expect("utf-8 path")
        .to_string();
    c.gpu.backend = GpuBackendKind::Fake;
    c.gpu.fake_gpus = "2x16GiB".to_string();
    c.node.node_name = "gpu-node-1".to_string();
    c.device_plugin.device_plugin_dir = plugin_dir.to_path_buf();
    c
}

/// The checks of `gpushare doctor --role control-plane` against the sandbox (an empty root,
/// the scheduler configuration not given), with `webhook_url` for the webhook's endpoint.
pub(crate) async fn control_plane_checks(
    api: &ApiServer,
    webhook_url: Option<String>,
) -> Vec<Check> {
    let mut config = Config::default();
    config.cluster.kubeconfig = api.admin_kubeconfig_path().display().to_string();
    let root = tempfile::tempdir().expect("root");
    let opts = Options {
        role: Role::ControlPlane,
        root: root.path().to_path_buf(),
        preflight: false,
        no_cluster: false,
        scheduler_config: None,
        extender_url: None,
        webhook_url,
        dra: None,
    };
    diagnose(&opts, &config).await.checks
}

/// The binary's `gpushare doctor --role ROLE --no-cluster` plus `extra`.
pub(crate) fn doctor_no_cluster(role: &str, extra: &[&str]) -> Output {
    let mut args = vec!["doctor", "--role", role, "--no-cluster"];
    args.extend_from_slice(extra);
    run(&args)
}

/// [`doctor_no_cluster`] for a node whose root file system is `root`, over fake GPUs `gpus`
/// (`2x16GiB`), plus `extra`.
pub(crate) fn fake_node_doctor(root: &Path, gpus: &str, extra: &[&str]) -> Output {
    let root = root.to_str().expect("a UTF-8 root");
    let mut args = vec!["--root", root, "--gpu-backend", "fake", "--fake-gpus", gpus];
    args.extend_from_slice(extra);
    doctor_no_cluster("node", &args)
}

/// The JSON report doctor printed (`-o json`); panics with its stdout and stderr where it
/// printed none.
pub(crate) fn report_of(out: &Output) -> Value {
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| {
        panic!(
            "doctor -o json printed no JSON ({e}): {}\n{}",
            stdout(out),
            stderr(out)
        )
    })
}

/// The check `id` of a JSON report, if it holds one.
pub(crate) fn find_check<'a>(report: &'a Value, id: &str) -> Option<&'a Value> {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["id"] == id))
}

/// The check `id` of a JSON report; panics naming the report where it holds none.
pub(crate) fn check_of<'a>(report: &'a Value, id: &str) -> &'a Value {
    find_check(report, id).unwrap_or_else(|| panic!("no check {id} in {report:#}"))
}

/// The status of check `id` of a JSON report (`?` where it has none).
pub(crate) fn status_of<'a>(report: &'a Value, id: &str) -> &'a str {
    check_of(report, id)["status"].as_str().unwrap_or("?")
}
