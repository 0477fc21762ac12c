//! `make test-cluster`: the whole path on the real cluster `KUBECONFIG` points at (kind or
//! k3d with the fake GPU backend is enough; `tests/cluster/kind.yaml` makes one whose
//! kube-scheduler calls the extender). `#[ignore]`d, so `make test` and CI never run them;
//! without `KUBECONFIG` they print `SKIPPED` (and `make test-cluster`, which sets
//! `GPUSHARE_TEST_NO_SKIP=1`, fails).
//!
//! What runs: the chart rendered by the real Helm engine (image `$GPUSHARE_CLUSTER_IMAGE`,
//! fake GPUs `2x16GiB`, no preflight) applied with kubectl; one node labelled `gpushare=true`;
//! two pods asking for `aliyun.com/gpu-mem`; then the test waits until the extender has bound
//! them (annotations `ALIYUN_COM_GPU_MEM_*`), the device plugin has allocated them
//! (`ASSIGNED=true`) and they run, and checks `kubectl inspect gpushare`. Everything it made is
//! deleted on every path (a guard), the node label included.
//!
//! Environment: `KUBECONFIG` (required), `GPUSHARE_CLUSTER_IMAGE` (default: the chart's
//! image; load it into kind first: `kind load docker-image ...`), `GPUSHARE_CLUSTER_NODE`
//! (default: the first node without a control-plane role), `GPUSHARE_TEST_KUBECTL`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::clients;

const NAMESPACE: &str = "kube-system";
const TEST_NAMESPACE: &str = "gpushare-cluster-test";
const DEADLINE: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_secs(2);

/// kubectl against the cluster under test.
struct Kubectl {
    bin: PathBuf,
    kubeconfig: String,
    plugin_path: Option<std::ffi::OsString>,
}

impl Kubectl {
    fn run(&self, args: &[&str]) -> Output {
        let mut c = Command::new(&self.bin);
        c.args(args).env("KUBECONFIG", &self.kubeconfig);
        if let Some(path) = &self.plugin_path {
            c.env("PATH", path);
        }
        c.output().expect("kubectl runs")
    }

    /// Runs and asserts success; stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&a)).expect("kubectl prints JSON")
    }
}

/// Deletes what the test made, whatever happens.
struct Cleanup<'a> {
    kubectl: &'a Kubectl,
    manifests: PathBuf,
    node: String,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let k = self.kubectl;
        let _ = k.run(&[
            "delete",
            "namespace",
            TEST_NAMESPACE,
            "--ignore-not-found",
            "--wait=true",
        ]);
        let _ = k.run(&["label", "node", &self.node, "gpushare-"]);
        let manifests = self.manifests.to_string_lossy().into_owned();
        let _ = k.run(&["delete", "-f", &manifests, "--ignore-not-found"]);
    }
}

/// Polls `check` every [`POLL`] until it answers `Some`, or fails after [`DEADLINE`].
fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        std::thread::sleep(POLL);
    }
}

/// The cluster under test, or `None` (with a message) without KUBECONFIG.
fn cluster_kubectl() -> Option<Kubectl> {
    let Some(kubeconfig) = std::env::var("KUBECONFIG").ok().filter(|k| !k.is_empty()) else {
        clients::skip(
            "cluster tests need KUBECONFIG pointing at a disposable cluster \
             (kind create cluster --config tests/cluster/kind.yaml); see tests/it/cluster.rs",
        );
        return None;
    };
    let Some((bin, _)) = clients::kubectls().into_iter().next_back() else {
        return clients::missing("kubectl", "none on PATH (or set GPUSHARE_TEST_KUBECTL)");
    };
    Some(Kubectl {
        bin,
        kubeconfig,
        plugin_path: None,
    })
}

/// The chart, rendered by the Helm engine for this cluster, written as files in `dir`.
fn render_manifests(dir: &Path) -> Option<PathBuf> {
    let mut values = json!({
        "skipDoctor": true,
        "devicePlugin": {"gpuBackend": "fake", "fakeGpus": "2x16GiB"},
        "extender": {"replicas": 1},
    });
    if let Ok(image) = std::env::var("GPUSHARE_CLUSTER_IMAGE") {
        let (repository, tag) = image.rsplit_once(':').unwrap_or((image.as_str(), "latest"));
        values["image"] =
            json!({"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"});
    }
    let answer = clients::helm_chart(&json!({
        "chart": clients::repo_root().join("packaging/helm/gpushare"),
        "release": "gpushare",
        "namespace": NAMESPACE,
        "renders": [values],
    }))?;
    let manifests = answer["renders"][0]["manifests"]
        .as_object()
        .unwrap_or_else(|| panic!("the chart does not render: {answer}"));
    let out = dir.join("manifests");
    std::fs::create_dir_all(&out).expect("manifests dir");
    for (name, text) in manifests {
        std::fs::write(out.join(name), text.as_str().unwrap_or_default()).expect("manifest");
    }
    Some(out)
}

fn pick_node(k: &Kubectl) -> String {
    if let Ok(node) = std::env::var("GPUSHARE_CLUSTER_NODE") {
        return node;
    }
    let nodes = k.json(&["get", "nodes"]);
    let items = nodes["items"].as_array().cloned().unwrap_or_default();
    let is_control_plane = |n: &Value| {
        n["metadata"]["labels"]
            .as_object()
            .is_some_and(|l| l.contains_key("node-role.kubernetes.io/control-plane"))
    };
    items
        .iter()
        .find(|n| !is_control_plane(n))
        .or(items.first())
        .and_then(|n| n["metadata"]["name"].as_str())
        .expect("the cluster has a node")
        .to_string()
}

fn gpu_pod(name: &str, units: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9",
                "resources": {"limits": {"aliyun.com/gpu-mem": units.to_string()}}}]}})
}

#[test]
#[ignore = "needs a cluster: make test-cluster"]
fn cluster_gpu_mem_pods_are_bound_allocated_and_inspected() {
    let Some(mut k) = cluster_kubectl() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    // `kubectl inspect gpushare` finds the plugin on PATH.
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).expect("plugin dir");
    std::os::unix::fs::symlink(
        crate::support::bin(),
        plugins.join("kubectl-inspect-gpushare"),
    )
    .expect("plugin link");
    let mut path = vec![plugins];
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    k.plugin_path = Some(std::env::join_paths(path).expect("PATH"));
    let k = k;
    let Some(manifests) = render_manifests(dir.path()) else {
        return;
    };
    let node = pick_node(&k);
    let _cleanup = Cleanup {
        kubectl: &k,
        manifests: manifests.clone(),
        node: node.clone(),
    };
    let manifests_arg = manifests.to_string_lossy().into_owned();
    k.ok(&["apply", "-f", &manifests_arg]);
    k.ok(&["label", "node", &node, "gpushare=true", "--overwrite"]);
    k.ok(&[
        "-n",
        NAMESPACE,
        "rollout",
        "status",
        "deployment/gpushare-schd-extender",
        "--timeout=300s",
    ]);

    // The device plugin registers: the node advertises 2 x 16 GiB and the GPU count.
    wait_for("the node to advertise aliyun.com/gpu-mem", || {
        let n = k.json(&["get", "node", &node]);
        (n["status"]["allocatable"]["aliyun.com/gpu-mem"] == "32"
            && n["status"]["capacity"]["aliyun.com/gpu-count"] == "2")
            .then_some(())
    });

    k.ok(&["create", "namespace", TEST_NAMESPACE]);
    for (name, units) in [("trainer-a", 6u32), ("trainer-b", 12)] {
        let file = dir.path().join(format!("{name}.json"));
        std::fs::write(&file, gpu_pod(name, units).to_string()).expect("pod file");
        k.ok(&["create", "-f", &file.to_string_lossy()]);
    }

    // The extender binds each pod to one GPU, the device plugin allocates it, it runs.
    let mut gpus = Vec::new();
    for name in ["trainer-a", "trainer-b"] {
        let pod = wait_for(&format!("{name} to run with its GPU assigned"), || {
            let p = k.json(&["-n", TEST_NAMESPACE, "get", "pod", name]);
            let ann = &p["metadata"]["annotations"];
            (p["status"]["phase"] == "Running" && ann["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true")
                .then_some(p)
        });
        assert_eq!(pod["spec"]["nodeName"], node.as_str(), "{pod}");
        let ann = &pod["metadata"]["annotations"];
        assert_eq!(ann["ALIYUN_COM_GPU_MEM_DEV"], "16", "{pod}");
        assert!(ann["ALIYUN_COM_GPU_MEM_ASSUME_TIME"].is_string(), "{pod}");
        gpus.push(
            ann["ALIYUN_COM_GPU_MEM_IDX"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        );
    }
    // Binpack: 6 + 12 units do not fit one 16 GiB GPU, so they sit on both.
    gpus.sort();
    assert_eq!(gpus, ["0", "1"]);

    // kubectl inspect gpushare, the plugin found on PATH.
    let table = k.ok(&["inspect", "gpushare"]);
    assert!(table.contains(&node), "{table}");
    let report: Value =
        serde_json::from_str(&k.ok(&["inspect", "gpushare", "-o", "json"])).expect("JSON");
    let ours = report["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["name"] == node.as_str()))
        .unwrap_or_else(|| panic!("{node} missing from {report}"));
    assert_eq!(ours["total"], 32, "{ours}");
    assert_eq!(ours["used"], 18, "{ours}");
}
