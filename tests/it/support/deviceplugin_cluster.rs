//! A sandbox cluster with the device plugin running on it, as the device-plugin tests drive
//! it: the sandbox API server holding one GPU node, the sandbox kubelet in a short temp dir,
//! fake GPUs with injectable health events, the plugin's state directory in that temp dir;
//! the pods the extender's bind leaves on the node, Allocate through the kubelet (then the
//! wait until the plugin's write of the answer to the pod is done, as the tests read the
//! annotations), and a bounded wait on a condition of the cluster.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpushare::config::Config;
use gpushare::core::wire;
use gpushare::deviceplugin::{self, DevicePluginHandle};
use gpushare::gpu::GpuBackend;
use gpushare::gpu::fake::{FakeBackend, FakeHealth};
use gpushare::kubelet_api::deviceplugin::ContainerAllocateResponse;
use gpushare::node::enforcement::Decision;
use gpushare::node::paths::ServingPath;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::kubelet::Kubelet;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::Value;

use super::objects::assumed_pod;
use super::socket_dir::short_tempdir;
use super::wait::{DEADLINE, wait_until};

pub(crate) const RESOURCE: &str = wire::RESOURCE_GPU_MEM;
pub(crate) const NODE: &str = "gpu-node-1";

/// A sandbox cluster with the device plugin running on it.
pub(crate) struct Cluster {
    pub(crate) api: ApiServer,
    pub(crate) kubelet: Kubelet,
    pub(crate) health: FakeHealth,
    plugin: Option<DevicePluginHandle>,
    /// What the plugin was started with (a restart starts it the same way).
    config: Config,
    backend: Arc<dyn GpuBackend>,
    _dir: tempfile::TempDir,
}

pub(crate) fn node_yaml(labels: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    gpushare: \"true\"\n{labels}status:\n  capacity:\n    cpu: \"8\"\n    aliyun.com/gpu-mem: \"40\"\n"
    )
}

pub(crate) async fn cluster_with(
    gpus: &str,
    node_labels: &str,
    tweak: impl FnOnce(&mut Config),
) -> anyhow::Result<Cluster> {
    cluster_seeded(gpus, &node_yaml(node_labels), |_| {}, tweak).await
}

/// A cluster whose API server holds `node` (YAML) and what `seed` adds before the device
/// plugin starts.
pub(crate) async fn cluster_seeded(
    gpus: &str,
    node: &str,
    seed: impl FnOnce(&ApiServer),
    tweak: impl FnOnce(&mut Config),
) -> anyhow::Result<Cluster> {
    cluster_on(FakeBackend::from_spec(gpus)?, node, seed, tweak).await
}

/// [`cluster_seeded`] over a backend of the caller's (GPUs with PCI bus ids of a recorded
/// sysfs tree, say).
pub(crate) async fn cluster_on(
    backend: FakeBackend,
    node: &str,
    seed: impl FnOnce(&ApiServer),
    tweak: impl FnOnce(&mut Config),
) -> anyhow::Result<Cluster> {
    let health = backend.health();
    cluster_on_backend(Arc::new(backend), health, node, seed, tweak).await
}

/// [`cluster_on`] over any GPU backend (the NVML stub, say); `health` is where the tests inject
/// health events (for a backend of its own, that of an unused fake backend).
pub(crate) async fn cluster_on_backend(
    backend: Arc<dyn GpuBackend>,
    health: FakeHealth,
    node: &str,
    seed: impl FnOnce(&ApiServer),
    tweak: impl FnOnce(&mut Config),
) -> anyhow::Result<Cluster> {
    let dir = short_tempdir();
    let api = ApiServer::start().await?;
    api.seed_yaml(node)?;
    seed(&api);
    let kubelet = Kubelet::start(dir.path()).await?;
    let mut config = Config::default();
    config.node.node_name = NODE.to_string();
    config.device_plugin.device_plugin_dir = kubelet.device_plugin_dir();
    config.device_plugin.pod_resources_socket = kubelet.pod_resources_socket();
    config.device_plugin.admin_address = String::new();
    config.device_plugin.state_dir = dir.path().join("state");
    config.doctor.skip = true;
    tweak(&mut config);
    let plugin = deviceplugin::start(
        &config,
        api.admin_client(),
        backend.clone(),
        gpushare::shutdown::Shutdown::never(),
    )
    .await?;
    kubelet.wait_registered(RESOURCE).await?;
    Ok(Cluster {
        api,
        kubelet,
        health,
        plugin: Some(plugin),
        config,
        backend,
        _dir: dir,
    })
}

pub(crate) async fn cluster(gpus: &str, tweak: impl FnOnce(&mut Config)) -> Cluster {
    cluster_with(gpus, "", tweak)
        .await
        .expect("the sandbox cluster and device plugin start")
}

impl Cluster {
    /// What the running device plugin's enforcement decided for the device-plugin path; panics
    /// where it refused.
    pub(crate) fn enforcement_decision(&self) -> Decision {
        self.plugin()
            .agent()
            .enforcement()
            .admit(ServingPath::DevicePlugin)
            .expect("the device plugin's enforcement decides")
    }

    pub(crate) async fn stop(mut self) {
        if let Some(p) = self.plugin.take() {
            let socket = p.socket_path();
            p.stop().await;
            assert!(!socket.exists(), "the plugin socket is removed on stop");
        }
        self.kubelet.stop().await;
        self.api.shutdown().await;
    }

    /// Stops the device plugin and starts it again as it was started, over the same API
    /// server, kubelet and state directory (what a plugin killed and restarted by its
    /// DaemonSet finds); returns once kubelet has its new registration and device list.
    pub(crate) async fn restart_plugin(&mut self) -> anyhow::Result<()> {
        let registrations = |k: &Kubelet| k.plugin(RESOURCE).map_or(0, |p| p.registrations);
        let before = registrations(&self.kubelet);
        if let Some(p) = self.plugin.take() {
            p.stop().await;
        }
        let plugin = deviceplugin::start(
            &self.config,
            self.api.admin_client(),
            self.backend.clone(),
            gpushare::shutdown::Shutdown::never(),
        )
        .await?;
        self.plugin = Some(plugin);
        wait_until("the restarted plugin to register", || {
            registrations(&self.kubelet) > before
        })
        .await;
        self.kubelet.wait_registered(RESOURCE).await?;
        Ok(())
    }

    pub(crate) fn plugin(&self) -> &DevicePluginHandle {
        self.plugin.as_ref().expect("running")
    }

    /// Seeds a pod bound to the node by the extender (annotations as bind writes them).
    pub(crate) fn bound_pod(
        &self,
        name: &str,
        containers: &[(&str, u64)],
        idx: Option<u32>,
        t: u64,
    ) {
        self.pod_with(name, &[], containers, idx, t);
    }

    pub(crate) fn pod_with(
        &self,
        name: &str,
        init: &[(&str, u64)],
        containers: &[(&str, u64)],
        idx: Option<u32>,
        assume_time: u64,
    ) {
        self.api
            .create_object(pod_json(name, init, containers, idx, assume_time))
            .expect("pod created");
    }

    pub(crate) fn annotations(&self, pod: &str) -> BTreeMap<String, String> {
        self.api
            .get_as::<Pod>("pods", Some("default"), pod)
            .and_then(|p| p.metadata.annotations)
            .unwrap_or_default()
    }

    pub(crate) fn node(&self) -> Node {
        self.api
            .get_as::<Node>("nodes", None, NODE)
            .expect("the node exists")
    }

    pub(crate) async fn allocate(
        &self,
        pod: &str,
        container: &str,
        units: usize,
    ) -> anyhow::Result<(Vec<String>, ContainerAllocateResponse)> {
        let answered = self
            .kubelet
            .allocate_container(RESOURCE, "default", pod, container, units)
            .await?;
        // The plugin writes the answer to the pod after it returned it: the tests read the
        // annotations once that write is done.
        tokio::time::timeout(DEADLINE, self.plugin().write_settled("default", pod))
            .await
            .map_err(|_| {
                anyhow::anyhow!("the answer for {pod} was not written to it within {DEADLINE:?}")
            })?;
        Ok(answered)
    }

    /// Waits until `check` holds of the cluster ([`super::wait::wait_until`]).
    pub(crate) async fn wait_for(&self, what: &str, check: impl Fn(&Cluster) -> bool) {
        wait_until(what, || check(self)).await;
    }

    pub(crate) fn warning_events(&self, reason: &str) -> Vec<Value> {
        self.api
            .list_objects("events.events.k8s.io", Some("default"))
            .into_iter()
            .filter(|e| e["reason"] == reason && e["regarding"]["name"] == NODE)
            .collect()
    }
}

/// A pod on the node: [`super::objects::assumed_pod`] on [`NODE`].
pub(crate) fn pod_json(
    name: &str,
    init: &[(&str, u64)],
    containers: &[(&str, u64)],
    idx: Option<u32>,
    assume_time: u64,
) -> Value {
    assumed_pod(name, NODE, init, containers, idx, assume_time)
}

pub(crate) fn env<'a>(resp: &'a ContainerAllocateResponse, key: &str) -> &'a str {
    resp.envs.get(key).map(String::as_str).unwrap_or("<unset>")
}

pub(crate) fn uuid_of(id: &str) -> String {
    wire::parse_fake_device_id(id)
        .map(|(u, _)| u.to_string())
        .unwrap_or_default()
}
