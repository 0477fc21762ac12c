//! One GPU node on the DRA path, in-process over the sandbox: the sandbox API server with the
//! node and the DeviceClass, the `gpushare dra-plugin` role on fake GPUs (its directories in a
//! temp dir of its own), the sandbox DRA kubelet, and the way a gpu-mem pod reaches it (the
//! webhook's rewrite, stored with its claim template).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpushare::config::Config;
use gpushare::core::MemoryUnit;
use gpushare::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME};
use gpushare::dra::role::{self, DraPluginHandle};
use gpushare::gpu::fake::{FakeBackend, FakeHealth};
use gpushare::shutdown::Shutdown;
use gpushare::webhook::dra_rewrite::{DraRewrite, rewrite};
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_kubelet::DraKubelet;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::dra;
pub use super::objects::pod_uid;
use super::socket_dir::short_tempdir;

/// The node's name.
pub const NODE: &str = "node-a";

/// A DRA node: its API server, its directories, the role's configuration and fake GPUs.
pub struct Node {
    /// The sandbox API server.
    pub api: ApiServer,
    /// The node's directories (registry, plugin, state, CDI, GPU locks).
    pub dir: tempfile::TempDir,
    /// The role's configuration.
    pub config: Config,
    /// The fake GPUs.
    pub backend: Arc<FakeBackend>,
    /// Their health events.
    pub health: FakeHealth,
}

impl Node {
    /// Starts the role on its own node agent.
    pub async fn start(&self) -> DraPluginHandle {
        self.try_start().await.expect("the DRA plugin starts")
    }

    /// Starts the role on its own node agent, or why not.
    pub async fn try_start(&self) -> anyhow::Result<DraPluginHandle> {
        let backend: Arc<dyn gpushare::gpu::GpuBackend> = self.backend.clone();
        role::start(
            &self.config,
            self.api.admin_client(),
            backend,
            Shutdown::never(),
        )
        .await
    }

    /// The sandbox DRA kubelet of this node, watching the registry.
    pub fn kubelet(&self) -> DraKubelet {
        DraKubelet::start(&self.config.dra.registry_dir, NODE, self.api.admin_client())
            .expect("the DRA kubelet starts")
    }

    /// The CDI directory the role writes.
    pub fn cdi_dir(&self) -> PathBuf {
        self.config.dra.cdi_dir.clone()
    }

    /// The checkpoint file.
    pub fn checkpoint(&self) -> PathBuf {
        self.config.dra.state_dir.join(role::CHECKPOINT_FILE)
    }

    /// The devices the node's slices publish.
    pub fn slice_devices(&self) -> Vec<Value> {
        dra::slice_devices(&self.api, NODE)
    }
}

/// A DRA node with two 16 GiB fake GPUs, the configuration changed by `tweak`.
pub async fn node(tweak: impl FnOnce(&mut Config)) -> Node {
    node_with("2x16GiB", tweak).await
}

/// A DRA node with the fake GPUs `gpus` (`2x16GiB`), the configuration changed by `tweak`.
pub async fn node_with(gpus: &str, tweak: impl FnOnce(&mut Config)) -> Node {
    let api = ApiServer::start().await.expect("starts");
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n"
    ))
    .expect("the node");
    super::dra::create_gpu_device_class(&api);
    let dir = short_tempdir();
    let config = config_in(dir.path(), tweak);
    let backend = FakeBackend::from_spec(gpus).expect("fake GPUs");
    let health = backend.health();
    Node {
        api,
        dir,
        config,
        backend: Arc::new(backend),
        health,
    }
}

/// The DRA role's configuration for node [`NODE`] with every directory under `dir`.
pub fn config_in(dir: &Path, tweak: impl FnOnce(&mut Config)) -> Config {
    let mut config = Config::default();
    config.node.node_name = NODE.into();
    config.dra.registry_dir = dir.join("registry");
    config.dra.plugin_dir = dir.join("plugin");
    config.dra.state_dir = dir.join("state");
    config.dra.cdi_dir = dir.join("cdi");
    config.dra.admin_address = String::new();
    config.doctor.skip = true;
    tweak(&mut config);
    config
}

/// A sandbox DRA kubelet of node [`NODE`] on `config`'s registry directory, the product's
/// driver registered with it.
pub async fn registered_kubelet(config: &Config, api: &ApiServer) -> DraKubelet {
    let kubelet = DraKubelet::start(&config.dra.registry_dir, NODE, api.admin_client())
        .expect("the DRA kubelet starts");
    kubelet
        .wait_registered(DRA_DRIVER_NAME)
        .await
        .expect("the DRA plugin registers");
    kubelet
}

/// A one-container gpu-mem pod prepared on the DRA path, and the kubelet that prepared it.
pub struct PreparedPod {
    pub kubelet: DraKubelet,
    pub claim_uid: String,
    /// The claim's CDI spec, as JSON.
    pub spec: Value,
    pub pod_uid: String,
}

/// A kubelet registered with the plugin running on `config`, and gpu-mem pod `default/name`
/// of `gib` GiB submitted, allocated by one pass and prepared ([`allocate_prepare_one`]).
pub async fn prepared_gpu_pod(
    config: &Config,
    api: &ApiServer,
    name: &str,
    gib: u64,
) -> PreparedPod {
    let kubelet = registered_kubelet(config, api).await;
    dra::submit_gpu_pod(api, name, gib);
    let (claim_uid, spec) = allocate_prepare_one(api, &kubelet, &config.dra.cdi_dir, name).await;
    let pod_uid = pod_uid(api, name);
    PreparedPod {
        kubelet,
        claim_uid,
        spec,
        pod_uid,
    }
}

/// Waits until kubelet holds the DRA plugin's health report of `device` as `health` (and, where
/// given, with exactly `message`); panics after the kubelet's deadline.
pub async fn wait_device_health(
    kubelet: &DraKubelet,
    device: &str,
    health: &str,
    message: Option<&str>,
) {
    kubelet
        .wait_plugins(&format!("{device} {health}"), |plugins| {
            plugins.iter().flat_map(|p| &p.health).any(|h| {
                h.device == device && h.health == health && message.is_none_or(|m| h.message == m)
            })
        })
        .await
        .unwrap_or_else(|e| panic!("{device} never reached kubelet as {health} {message:?}: {e}"));
}

/// Pod `default/name` (UID `pod_uid`) finishes: one allocator pass releases its claim, and
/// kubelet's unprepare of the pod answers no error.
pub async fn finish_and_unprepare(
    api: &ApiServer,
    kubelet: &DraKubelet,
    name: &str,
    pod_uid: &str,
) {
    api.set_pod_phase("default", name, "Succeeded")
        .expect("the pod's phase");
    dra::release_one(api).await;
    let errors = kubelet.unprepare_pod(pod_uid).await.expect("unprepares");
    assert!(errors.is_empty(), "unprepare of {name}: {errors:?}");
}

/// Rewrites a gpu-mem pod of containers `(name, units)`, stores its template and the pod.
pub fn submit_containers(api: &ApiServer, name: &str, containers: &[(&str, u64)]) {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(c, units)| {
            json!({ "name": c, "image": "x",
                "resources": { "limits": { "aliyun.com/gpu-mem": units.to_string() } } })
        })
        .collect();
    submit_pod(
        api,
        json!({
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "containers": containers },
        }),
    );
}

/// The webhook's DRA rewrite of gpu-mem pod `pod` in namespace `default`, units of GiB, the
/// product's driver and class; panics where it is refused or left alone.
pub fn rewritten(pod: &Pod) -> DraRewrite {
    rewrite(
        pod,
        "default",
        MemoryUnit::GIB,
        DRA_DRIVER_NAME,
        DRA_DEVICE_CLASS,
    )
    .expect("rewrites")
    .expect("rewritten")
}

/// Rewrites pod `pod` (JSON, namespace `default`), stores its template and the pod.
pub fn submit_pod(api: &ApiServer, pod: Value) {
    let pod: Pod = serde_json::from_value(pod).expect("a pod");
    let r = rewritten(&pod);
    let template = r.template.metadata.name.clone().expect("named");
    // Pods of one shape share a template; another submitter may have created it meanwhile.
    if api
        .create_object(serde_json::to_value(&r.template).expect("json"))
        .is_err()
    {
        assert!(
            api.get_object("resourceclaimtemplates", Some("default"), &template)
                .is_some(),
            "the template {template} could not be created"
        );
    }
    let mut value = serde_json::to_value(&r.pod).expect("json");
    value["apiVersion"] = json!("v1");
    value["kind"] = json!("Pod");
    api.create_object(value).expect("the pod");
}

/// Rewrites a `main` + `side` gpu-mem pod, stores its template and the pod.
pub fn submit(api: &ApiServer, name: &str, main: u64, side: u64) {
    submit_containers(api, name, &[("main", main), ("side", side)]);
}

/// The CDI spec file of claim `claim_uid` in `dir`.
pub fn spec_file(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join(format!("gpushare.io_gpu_{claim_uid}.json"))
}

/// One pass of the sandbox allocator binds exactly pod `default/name`, kubelet prepares it on
/// its next sync, and the claim's CDI spec in `cdi_dir` is read back: the prepared claim's
/// UID and its spec as JSON.
pub async fn allocate_prepare_one(
    api: &ApiServer,
    kubelet: &DraKubelet,
    cdi_dir: &Path,
    name: &str,
) -> (String, Value) {
    use gpushare_sandbox::dra_kubelet::ClaimOutcome;
    dra::allocate_one(api).await;
    assert_eq!(
        kubelet.sync().await.expect("sync").prepared,
        [format!("default/{name}")]
    );
    let claims = kubelet.prepared(&pod_uid(api, name)).expect("recorded");
    let ClaimOutcome::Prepared(_) = &claims[0].outcome else {
        panic!("{claims:?}");
    };
    let spec = serde_json::from_slice(
        &std::fs::read(spec_file(cdi_dir, &claims[0].uid)).expect("the claim's spec"),
    )
    .expect("json");
    (claims[0].uid.clone(), spec)
}
