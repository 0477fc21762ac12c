//! How Allocate hands the GPU over (`--device-list-strategy`), over a real unix socket against
//! the sandbox kubelet: envvar, volume-mounts, cdi-annotations, cdi-cri and a combination;
//! `--device-id-strategy`, `--cdi-kind`, `--cdi-annotation-prefix`, `--pass-device-specs`; the
//! ALIYUN_COM_GPU_MEM_* and MPS envs in every strategy; the loud failure when the chosen GPU
//! has no CDI device; the upstream refusal carried into CDI; and the real nvidia-ctk specs
//! (YAML and JSON) in `tests/fixtures/cdi/`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpushare::config::{Config, DeviceListStrategies, DeviceListStrategy, VisibleDevices};
use gpushare::core::wire;
use gpushare::deviceplugin::{self, DevicePluginHandle};
use gpushare::gpu::cdi::Registry;
use gpushare::gpu::fake::{FakeBackend, fake_uuid};
use gpushare::kubelet_api::deviceplugin::ContainerAllocateResponse;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::kubelet::Kubelet;
use serde_json::Value;

use crate::support::fixture;
use crate::support::objects::assumed_pod;

const RESOURCE: &str = wire::RESOURCE_GPU_MEM;
const NODE: &str = "gpu-node-1";

use DeviceListStrategy::{CdiAnnotations, CdiCri, Envvar, VolumeMounts};

struct Node {
    api: ApiServer,
    kubelet: Kubelet,
    plugin: Option<DevicePluginHandle>,
    cdi: PathBuf,
    _dir: tempfile::TempDir,
}

/// A CDI spec as `nvidia-ctk cdi generate` writes it for the fake GPUs `indices` (names by
/// index and by UUID, plus `all`).
fn fake_spec(indices: &[u32]) -> String {
    let mut devices = String::new();
    for i in indices {
        for name in [i.to_string(), fake_uuid(*i)] {
            devices.push_str(&format!(
                "- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia{i}\n  name: \"{name}\"\n"
            ));
        }
    }
    format!(
        "---\ncdiVersion: 0.5.0\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\n  env:\n  - NVIDIA_VISIBLE_DEVICES=void\ndevices:\n{devices}- name: all\nkind: nvidia.com/gpu\n"
    )
}

async fn node(strategies: &[DeviceListStrategy], tweak: impl FnOnce(&mut Config)) -> Node {
    let dir = tempfile::Builder::new()
        .prefix("ho")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).expect("cdi dir");
    std::fs::write(cdi.join("nvidia.yaml"), fake_spec(&[0, 1])).expect("spec");
    let api = ApiServer::start().await.expect("api");
    api.seed_yaml(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    gpushare: \"true\"\n"
    ))
    .expect("node");
    let kubelet = Kubelet::start(dir.path()).await.expect("kubelet");
    let mut config = Config::default();
    let dp = &mut config.device_plugin;
    dp.device_plugin_dir = kubelet.device_plugin_dir();
    dp.pod_resources_socket = kubelet.pod_resources_socket();
    dp.admin_address = String::new();
    let node = &mut config.node;
    node.node_name = NODE.to_string();
    node.device_list_strategy = DeviceListStrategies::new(strategies.iter().copied());
    node.cdi_spec_dirs = vec![PathBuf::from("/nonexistent/etc/cdi"), cdi.clone()];
    config.doctor.skip = true;
    tweak(&mut config);
    let plugin = deviceplugin::start(
        &config,
        api.admin_client(),
        Arc::new(FakeBackend::from_spec("2x16GiB").expect("fake gpus")),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("plugin starts");
    kubelet.wait_registered(RESOURCE).await.expect("registered");
    Node {
        api,
        kubelet,
        plugin: Some(plugin),
        cdi,
        _dir: dir,
    }
}

impl Node {
    fn bound_pod(&self, name: &str, units: u64, idx: u32) {
        self.api
            .create_object(assumed_pod(
                name,
                NODE,
                &[],
                &[("main", units)],
                Some(idx),
                1,
            ))
            .expect("pod created");
    }

    async fn allocate(&self, pod: &str, units: usize) -> anyhow::Result<ContainerAllocateResponse> {
        let (_, resp) = self
            .kubelet
            .allocate_container(RESOURCE, "default", pod, "main", units)
            .await?;
        Ok(resp)
    }

    async fn stop(mut self) {
        if let Some(p) = self.plugin.take() {
            p.stop().await;
        }
        self.kubelet.stop().await;
        self.api.shutdown().await;
    }
}

fn env<'a>(resp: &'a ContainerAllocateResponse, key: &str) -> &'a str {
    resp.envs.get(key).map(String::as_str).unwrap_or("<unset>")
}

fn cdi_names(resp: &ContainerAllocateResponse) -> Vec<&str> {
    resp.cdi_devices.iter().map(|d| d.name.as_str()).collect()
}

/// The ALIYUN_COM_GPU_MEM_* envs of a 4-unit container on GPU 1 of 16 units.
fn assert_gpushare_envs(resp: &ContainerAllocateResponse) {
    assert_eq!(env(resp, wire::ENV_GPU_INDEX), "1");
    assert_eq!(env(resp, wire::ENV_POD_MEM), "4");
    assert_eq!(env(resp, wire::ENV_CONTAINER_MEM), "4");
    assert_eq!(env(resp, wire::ENV_DEVICE_MEM), "16");
}

#[tokio::test]
async fn envvar_is_the_default_and_unchanged() {
    let n = node(&[Envvar], |_| {}).await;
    n.bound_pod("p", 4, 1);
    let resp = n.allocate("p", 4).await.expect("allocated");
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "1");
    assert_gpushare_envs(&resp);
    assert!(resp.mounts.is_empty() && resp.devices.is_empty());
    assert!(resp.annotations.is_empty() && resp.cdi_devices.is_empty());
    assert_eq!(
        Config::default().node.device_list_strategy.to_string(),
        "envvar"
    );
    n.stop().await;
}

#[tokio::test]
async fn volume_mounts_name_the_gpu_in_a_mount_path() {
    let n = node(&[VolumeMounts], |c| {
        c.node.visible_devices = VisibleDevices::Uuid;
    })
    .await;
    n.bound_pod("p", 4, 1);
    let resp = n.allocate("p", 4).await.expect("allocated");
    assert_eq!(
        env(&resp, wire::ENV_VISIBLE_DEVICES),
        "/var/run/nvidia-container-devices"
    );
    assert_gpushare_envs(&resp);
    assert_eq!(resp.mounts.len(), 1);
    assert_eq!(
        resp.mounts[0].container_path,
        format!("/var/run/nvidia-container-devices/{}", fake_uuid(1))
    );
    assert_eq!(resp.mounts[0].host_path, "/dev/null");
    assert!(resp.cdi_devices.is_empty() && resp.annotations.is_empty());
    n.stop().await;
}

#[tokio::test]
async fn cdi_annotations_name_the_device_under_the_prefix() {
    let n = node(&[CdiAnnotations], |c| {
        c.node.cdi_annotation_prefix = "cdi.example.org/".to_string();
    })
    .await;
    n.bound_pod("p", 4, 1);
    let resp = n.allocate("p", 4).await.expect("allocated");
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "void");
    assert_gpushare_envs(&resp);
    assert_eq!(resp.annotations.len(), 1);
    assert_eq!(
        resp.annotations["cdi.example.org/gpushare_gpu-mem"],
        "nvidia.com/gpu=1"
    );
    assert!(resp.cdi_devices.is_empty() && resp.mounts.is_empty());
    n.stop().await;
}

#[tokio::test]
async fn cdi_cri_fills_cdi_devices_by_uuid_with_device_specs() {
    let n = node(&[CdiCri], |c| {
        c.node.visible_devices = VisibleDevices::Uuid;
        c.node.pass_device_specs = true;
    })
    .await;
    n.bound_pod("p", 4, 1);
    let resp = n.allocate("p", 4).await.expect("allocated");
    assert_eq!(
        cdi_names(&resp),
        [format!("nvidia.com/gpu={}", fake_uuid(1))]
    );
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "void");
    assert_gpushare_envs(&resp);
    let devs: Vec<(&str, &str, &str)> = resp
        .devices
        .iter()
        .map(|d| {
            (
                d.container_path.as_str(),
                d.host_path.as_str(),
                d.permissions.as_str(),
            )
        })
        .collect();
    assert_eq!(
        devs,
        [
            ("/dev/nvidia1", "/dev/nvidia1", "rw"),
            ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
            ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
            ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools", "rw"),
        ]
    );
    assert!(resp.annotations.is_empty());
    n.stop().await;
}

#[tokio::test]
async fn a_combination_answers_every_form_and_keeps_the_mps_envs() {
    let mps = crate::support::mps::FakeMps::new();
    let n = node(&[Envvar, VolumeMounts, CdiAnnotations, CdiCri], |c| {
        mps.configure(c);
        c.node.mps_active_thread_percentage = 50;
        c.node.pass_device_specs = true;
    })
    .await;
    n.bound_pod("p", 4, 1);
    let resp = n.allocate("p", 4).await.expect("allocated");
    // envvar wins the env; volume-mounts still adds its mount.
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "1");
    assert_gpushare_envs(&resp);
    assert_eq!(env(&resp, wire::ENV_MPS_PINNED_MEM_LIMIT), "0=4096M");
    assert_eq!(env(&resp, wire::ENV_MPS_ACTIVE_THREAD_PERCENTAGE), "50");
    let pipe = mps.pipe_dir.display().to_string();
    assert_eq!(env(&resp, wire::ENV_MPS_PIPE_DIRECTORY), pipe);
    let mounts: Vec<&str> = resp
        .mounts
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(
        mounts,
        [pipe.as_str(), "/var/run/nvidia-container-devices/1"]
    );
    assert_eq!(
        resp.annotations["cdi.k8s.io/gpushare_gpu-mem"],
        "nvidia.com/gpu=1"
    );
    assert_eq!(cdi_names(&resp), ["nvidia.com/gpu=1"]);
    assert_eq!(resp.devices.len(), 4);
    n.stop().await;
}

#[tokio::test]
async fn a_gpu_without_a_cdi_device_fails_allocate_with_the_fix() {
    let n = node(&[CdiCri], |c| {
        c.node.cdi_kind = "example.com/gpu".to_string();
    })
    .await;
    n.bound_pod("p", 4, 1);
    let err = n.allocate("p", 4).await.expect_err("no such CDI device");
    let msg = format!("{err:#}");
    assert!(msg.contains("example.com/gpu=1"), "{msg}");
    assert!(msg.contains("no spec of kind example.com/gpu"), "{msg}");
    assert!(msg.contains("nvidia-ctk cdi generate"), "{msg}");
    // The pod is not marked: the GPU was not handed out.
    let pod: Value = n
        .api
        .get_as::<Value>("pods", Some("default"), "p")
        .expect("pod");
    assert!(
        pod["metadata"]["annotations"]
            .get(wire::POD_ANN_ALLOCATED_CONTAINERS)
            .is_none(),
        "{pod}"
    );
    assert_eq!(
        n.plugin
            .as_ref()
            .expect("running")
            .metrics()
            .allocations_with("handover_failed"),
        1
    );
    n.stop().await;
}

#[tokio::test]
async fn a_stale_spec_fails_and_a_regenerated_one_is_read_at_the_next_allocate() {
    let n = node(&[CdiCri], |_| {}).await;
    std::fs::write(n.cdi.join("nvidia.yaml"), fake_spec(&[0])).expect("stale spec");
    n.bound_pod("p", 4, 1);
    let err = n.allocate("p", 4).await.expect_err("GPU 1 not in the spec");
    let msg = format!("{err:#}");
    assert!(msg.contains("nvidia.com/gpu=1"), "{msg}");
    assert!(msg.contains("nvidia.com/gpu devices: 0, "), "{msg}");
    std::fs::write(n.cdi.join("nvidia.yaml"), fake_spec(&[0, 1])).expect("regenerated");
    n.bound_pod("q", 4, 1);
    let resp = n.allocate("q", 4).await.expect("allocated");
    assert_eq!(cdi_names(&resp), ["nvidia.com/gpu=1"]);
    n.stop().await;
}

#[tokio::test]
async fn the_upstream_refusal_is_carried_into_cdi() {
    let n = node(&[CdiCri], |_| {}).await;
    let resp = n.allocate("stray", 3).await.expect("answered");
    assert_eq!(cdi_names(&resp), ["nvidia.com/gpu=no-gpu-has-3GiB-to-run"]);
    assert_eq!(env(&resp, wire::ENV_GPU_INDEX), "-1");
    assert_eq!(env(&resp, wire::ENV_VISIBLE_DEVICES), "void");
    n.stop().await;
}

#[test]
fn the_real_nvidia_ctk_specs_parse_in_both_formats() {
    for file in [
        "nvidia-ctk-1.17.8-one-gpu.yaml",
        "nvidia-ctk-1.17.8-one-gpu.json",
    ] {
        let path = fixture(&format!("cdi/{file}"));
        let text = std::fs::read_to_string(&path).expect("fixture");
        let spec = gpushare::gpu::cdi::parse(Path::new(file), &text).expect(file);
        assert_eq!(spec.version, "0.5.0", "{file}");
        assert_eq!(spec.kind, "nvidia.com/gpu", "{file}");
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            ["0", "GPU-520e01f2-cf30-6396-abef-e8e9a5233b0e", "all"],
            "{file}"
        );
        assert_eq!(
            spec.devices[0].device_nodes,
            ["/dev/nvidia0", "/dev/dri/card1", "/dev/dri/renderD128"]
        );
    }
    let reg = Registry::read(&fixture("cdi"), &[PathBuf::from("/")]);
    assert_eq!(reg.specs.len(), 2, "{:?}", reg.errors);
    assert!(reg.errors.is_empty(), "{:?}", reg.errors);
}
