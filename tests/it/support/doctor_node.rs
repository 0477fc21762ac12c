//! What doctor's tests and the start-up tests share: a node's root file system copied from a
//! fixture (with a live-looking `kubelet.sock`), the labelled GPU node, the configuration of a
//! preflight against the sandbox API server with fake GPUs, and a control-plane report
//! against the sandbox.

use std::path::Path;

use gpushare::config::{Config, GpuBackendKind};
use gpushare::doctor::report::Check;
use gpushare::doctor::{Options, Role, diagnose};
use gpushare_sandbox::apiserver::ApiServer;

use super::fixture;

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
