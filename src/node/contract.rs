//! The container contract: what a container is handed for (GPU, units, strategy), whichever
//! kubelet path serves it. Pure: no I/O, no clock, no kubelet types. The device plugin turns
//! [`ContainerEdits`] into an Allocate answer; a DRA plugin turns it into a CDI spec's
//! `containerEdits`.
//!
//! [`grant`] builds the envvar answer (spec §2.3): `NVIDIA_VISIBLE_DEVICES` (NVML index, or
//! UUID), `ALIYUN_COM_GPU_MEM_IDX`, `_POD` (the pod's total), `_CONTAINER`, `_DEV` (that GPU's
//! units), `CGPU_DISABLE=true` when the node label asks for it; with MPS also
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` (the container sees its one GPU as device 0),
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PIPE_DIRECTORY` with the pipe directory
//! mounted, and the daemon's shared-memory directory at `/dev/shm` when `mps_shm_dir` is set.
//! [`refusal`] builds upstream's failure answer (`no-gpu-has-<N><unit>-to-run`, IDX -1).
//!
//! [`hand_over`] then shapes that answer for the configured `device_list_strategy` (NVIDIA's
//! names; combinable):
//!
//! | strategy | what the container is handed |
//! | --- | --- |
//! | `envvar` (default) | `NVIDIA_VISIBLE_DEVICES=<id>` (the NVIDIA runtime must be the default) |
//! | `volume-mounts` | `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` and a mount `/var/run/nvidia-container-devices/<id>` from `/dev/null` |
//! | `cdi-annotations` | annotation `<prefix>gpushare_gpu-mem: <kind>=<id>` |
//! | `cdi-cri` | CDI device `<kind>=<id>` (kubelet 1.28+) |
//!
//! `<id>` is the index or the UUID (`device_id_strategy`). With only CDI strategies,
//! `NVIDIA_VISIBLE_DEVICES=void`, so an image's `NVIDIA_VISIBLE_DEVICES=all` cannot make a
//! legacy NVIDIA hook expose every GPU; CDI injects the one GPU. `pass_device_specs` adds
//! device nodes `/dev/nvidia<minor>`, `/dev/nvidiactl`, `/dev/nvidia-uvm`,
//! `/dev/nvidia-uvm-tools`. The `ALIYUN_COM_GPU_MEM_*` and MPS envs are kept in every strategy.
//!
//! With a CDI strategy the caller passes the node's CDI specs ([`crate::gpu::cdi`]); a GPU
//! without a matching CDI device is an error with the fix (never a container that silently
//! starts without its GPU). The upstream refusal (`no-gpu-has-<N>-to-run`) is carried into
//! every strategy, as a device name that no runtime resolves, so the container still fails to
//! start.
//!
//! It does not choose the GPU (the role's matching does), read the CDI specs, or record
//! anything on the pod.

use std::collections::HashMap;
use std::path::Path;

use super::gpus::ServedGpu;
use crate::config::{DeviceListStrategy, NodeConfig, VisibleDevices};
use crate::core::GpuMem;
use crate::core::wire::{
    ENV_CGPU_DISABLE, ENV_CONTAINER_MEM, ENV_DEVICE_MEM, ENV_GPU_INDEX,
    ENV_MPS_ACTIVE_THREAD_PERCENTAGE, ENV_MPS_PINNED_MEM_LIMIT, ENV_MPS_PIPE_DIRECTORY,
    ENV_POD_MEM, ENV_VISIBLE_DEVICES,
};
use crate::gpu::cdi::{Registry, qualified_name};

/// Where an MPS client expects the shared memory it shares with the MPS server.
const MPS_CLIENT_SHM: &str = "/dev/shm";

/// A bind mount into the container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MountEdit {
    /// Path inside the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What a container is handed: the parts every kubelet path can express.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    /// Environment variables.
    pub envs: HashMap<String, String>,
    /// Bind mounts.
    pub mounts: Vec<MountEdit>,
    /// Device nodes, the same path on the host and in the container, read-write.
    pub device_nodes: Vec<String>,
    /// Fully qualified CDI device names (`<kind>=<name>`) for the runtime to inject.
    pub cdi_devices: Vec<String>,
    /// Container annotations (the CDI annotation).
    pub annotations: HashMap<String, String>,
}

/// What the node tells every container about itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeTraits {
    /// The node's label `cgpu.disable.isolation=true`: `CGPU_DISABLE=true` in every answer.
    pub cgpu_disable: bool,
}

fn base_envs(
    node: NodeTraits,
    visible: String,
    index: String,
    pod: GpuMem,
    container: GpuMem,
    dev: GpuMem,
) -> HashMap<String, String> {
    let mut envs = HashMap::from([
        (ENV_VISIBLE_DEVICES.to_string(), visible),
        (ENV_GPU_INDEX.to_string(), index),
        (ENV_POD_MEM.to_string(), pod.to_string()),
        (ENV_CONTAINER_MEM.to_string(), container.to_string()),
        (ENV_DEVICE_MEM.to_string(), dev.to_string()),
    ]);
    if node.cgpu_disable {
        envs.insert(ENV_CGPU_DISABLE.to_string(), "true".to_string());
    }
    envs
}

/// The envvar answer that gives a container `units` of `gpu` (its pod holds `pod_total`);
/// `visible_uuid` names the GPU by UUID in `NVIDIA_VISIBLE_DEVICES`.
pub fn grant(
    config: &NodeConfig,
    node: NodeTraits,
    gpu: &ServedGpu,
    visible_uuid: bool,
    pod_total: GpuMem,
    units: GpuMem,
) -> ContainerEdits {
    let visible = if visible_uuid {
        gpu.uuid.clone()
    } else {
        gpu.index.to_string()
    };
    let mut envs = base_envs(
        node,
        visible,
        gpu.index.to_string(),
        pod_total,
        units,
        gpu.units,
    );
    let mut mounts = Vec::new();
    if config.mps {
        let mib = config.memory_unit.to_mib(units);
        envs.insert(ENV_MPS_PINNED_MEM_LIMIT.to_string(), format!("0={mib}M"));
        if config.mps_active_thread_percentage > 0 {
            envs.insert(
                ENV_MPS_ACTIVE_THREAD_PERCENTAGE.to_string(),
                config.mps_active_thread_percentage.to_string(),
            );
        }
        let dir = config.mps_pipe_dir.display().to_string();
        envs.insert(ENV_MPS_PIPE_DIRECTORY.to_string(), dir.clone());
        mounts.push(MountEdit {
            container_path: dir.clone(),
            host_path: dir,
            read_only: false,
        });
        if !config.mps_shm_dir.as_os_str().is_empty() {
            mounts.push(MountEdit {
                container_path: MPS_CLIENT_SHM.to_string(),
                host_path: config.mps_shm_dir.display().to_string(),
                read_only: false,
            });
        }
    }
    ContainerEdits {
        envs,
        mounts,
        ..ContainerEdits::default()
    }
}

/// The upstream failure answer for a request of `units` that no GPU serves:
/// `NVIDIA_VISIBLE_DEVICES=no-gpu-has-<N><unit>-to-run`, IDX -1, `_DEV` the first GPU's units.
pub fn refusal(
    config: &NodeConfig,
    node: NodeTraits,
    first_gpu_units: GpuMem,
    units: GpuMem,
) -> ContainerEdits {
    let visible = format!(
        "no-gpu-has-{}-to-run",
        config.memory_unit.format_amount(units)
    );
    ContainerEdits {
        envs: base_envs(
            node,
            visible,
            "-1".to_string(),
            units,
            units,
            first_gpu_units,
        ),
        ..ContainerEdits::default()
    }
}

/// Where the NVIDIA runtime looks for the volume-mount device list.
pub(crate) const VOLUME_MOUNT_ROOT: &str = "/var/run/nvidia-container-devices";
/// The host side of each volume-mount entry (only its container path matters).
pub(crate) const VOLUME_MOUNT_HOST_PATH: &str = "/dev/null";
/// `NVIDIA_VISIBLE_DEVICES` when only CDI hands the GPU over (the NVIDIA runtime injects nothing).
pub(crate) const VISIBLE_DEVICES_VOID: &str = "void";
/// The name part of the CDI annotation key (after the prefix).
pub(crate) const CDI_ANNOTATION_NAME: &str = "gpushare_gpu-mem";
/// The control device nodes passed with `--pass-device-specs`.
pub(crate) const CONTROL_DEVICE_NODES: &[&str] =
    &["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// What the container is being handed.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// This GPU.
    Gpu(&'a ServedGpu),
    /// Nothing: the upstream refusal; its `no-gpu-has-…` name is the response's
    /// `NVIDIA_VISIBLE_DEVICES`.
    Refusal,
}

/// Why a GPU could not be handed over.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// The CDI specs do not define the device the runtime would be asked for.
    #[error(transparent)]
    NoCdiDevice(Box<MissingCdiDevice>),
}

/// The CDI device a GPU would be handed over as is not in the node's specs.
#[derive(Debug, thiserror::Error)]
#[error(
    "GPU {index} ({uuid}) has no CDI device {name} in {dirs}{seen}; the container would start \
         without its GPU, so Allocate fails. Fix: generate the spec on this node, e.g. \
         `nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml --device-name-strategy={strategy}` \
         (or the GPU Operator with cdi.enabled=true){mount}, or set --device-id-strategy / \
         --cdi-kind to the names the spec has"
)]
pub struct MissingCdiDevice {
    /// GPU index.
    pub index: u32,
    /// GPU UUID.
    pub uuid: String,
    /// The qualified name looked for.
    pub name: String,
    /// The spec directories read.
    pub dirs: String,
    /// What was seen instead (`; it has …`), or empty.
    pub seen: String,
    /// nvidia-ctk's name strategy matching our id strategy.
    pub strategy: &'static str,
    /// A hint about mounting the directories into the plugin's container, or empty.
    pub mount: &'static str,
}

/// The GPU's name in the container's hand-over (`--device-id-strategy`).
pub fn device_id(id: VisibleDevices, gpu: &ServedGpu) -> String {
    match id {
        VisibleDevices::Index => gpu.index.to_string(),
        VisibleDevices::Uuid => gpu.uuid.clone(),
    }
}

/// The CDI annotation key for `prefix`.
pub(crate) fn cdi_annotation_key(prefix: &str) -> String {
    format!("{prefix}{CDI_ANNOTATION_NAME}")
}

/// `/dev/nvidia<minor>` of a GPU (the index when the backend does not know the minor).
pub(crate) fn device_node(gpu: &ServedGpu) -> String {
    format!("/dev/nvidia{}", gpu.minor.unwrap_or(gpu.index))
}

/// Rewrites the envvar answer `base` for the configured strategies. `specs` must be the node's
/// CDI specs when a CDI strategy is on (else it is not looked at).
pub fn hand_over(
    config: &NodeConfig,
    specs: Option<&Registry>,
    target: Target<'_>,
    mut base: ContainerEdits,
) -> Result<ContainerEdits, HandoverError> {
    let strategies = &config.device_list_strategy;
    let id = match target {
        Target::Gpu(gpu) => device_id(config.visible_devices, gpu),
        Target::Refusal => base
            .envs
            .get(ENV_VISIBLE_DEVICES)
            .cloned()
            .unwrap_or_default(),
    };
    if strategies.any_cdi() {
        let name = qualified_name(&config.cdi_kind, &id);
        if let Target::Gpu(gpu) = target {
            check_cdi_device(config, specs, gpu, &id, &name)?;
        }
        if strategies.includes(DeviceListStrategy::CdiAnnotations) {
            base.annotations.insert(
                cdi_annotation_key(&config.cdi_annotation_prefix),
                name.clone(),
            );
        }
        if strategies.includes(DeviceListStrategy::CdiCri) {
            base.cdi_devices.push(name);
        }
    }
    if !strategies.includes(DeviceListStrategy::Envvar) {
        let visible = if strategies.includes(DeviceListStrategy::VolumeMounts) {
            VOLUME_MOUNT_ROOT
        } else {
            VISIBLE_DEVICES_VOID
        };
        base.envs
            .insert(ENV_VISIBLE_DEVICES.to_string(), visible.to_string());
    }
    if strategies.includes(DeviceListStrategy::VolumeMounts) {
        base.mounts.push(MountEdit {
            container_path: Path::new(VOLUME_MOUNT_ROOT).join(&id).display().to_string(),
            host_path: VOLUME_MOUNT_HOST_PATH.to_string(),
            read_only: false,
        });
    }
    if config.pass_device_specs
        && let Target::Gpu(gpu) = target
    {
        let node = device_node(gpu);
        for path in std::iter::once(node.as_str()).chain(CONTROL_DEVICE_NODES.iter().copied()) {
            base.device_nodes.push(path.to_string());
        }
    }
    Ok(base)
}

fn check_cdi_device(
    config: &NodeConfig,
    specs: Option<&Registry>,
    gpu: &ServedGpu,
    id: &str,
    name: &str,
) -> Result<(), HandoverError> {
    let empty = Registry::default();
    let specs = specs.unwrap_or(&empty);
    if specs.device(&config.cdi_kind, id).is_some() {
        return Ok(());
    }
    let names = specs.names_of_kind(&config.cdi_kind);
    let mut seen = Vec::new();
    if names.is_empty() {
        let kinds: Vec<&str> = specs.kinds().keys().copied().collect();
        if kinds.is_empty() {
            seen.push("no CDI spec at all".to_string());
        } else {
            seen.push(format!(
                "no spec of kind {}, only {}",
                config.cdi_kind,
                kinds.join(", ")
            ));
        }
    } else {
        let other = match config.visible_devices {
            VisibleDevices::Index => gpu.uuid.clone(),
            VisibleDevices::Uuid => gpu.index.to_string(),
        };
        let mut line = format!("{} devices: {}", config.cdi_kind, names.join(", "));
        if names.contains(&other.as_str()) {
            line.push_str(&format!(
                " (this GPU is there as {other}: the other --device-id-strategy)"
            ));
        }
        seen.push(line);
    }
    seen.extend(specs.errors.iter().map(|e| e.to_string()));
    let mount = if specs.specs.is_empty() {
        " and mount the spec directories into the device plugin's container (the chart does)"
    } else {
        ""
    };
    Err(HandoverError::NoCdiDevice(Box::new(MissingCdiDevice {
        index: gpu.index,
        uuid: gpu.uuid.clone(),
        name: name.to_string(),
        dirs: specs.dirs_text(),
        seen: format!("; found {}", seen.join("; ")),
        strategy: match config.visible_devices {
            VisibleDevices::Index => "index",
            VisibleDevices::Uuid => "uuid",
        },
        mount,
    })))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::DeviceListStrategies;

    fn gpu() -> ServedGpu {
        ServedGpu {
            index: 1,
            uuid: "GPU-b".to_string(),
            units: GpuMem::new(16),
            minor: Some(3),
        }
    }

    fn base() -> ContainerEdits {
        ContainerEdits {
            envs: HashMap::from([
                (ENV_VISIBLE_DEVICES.to_string(), "1".to_string()),
                ("ALIYUN_COM_GPU_MEM_IDX".to_string(), "1".to_string()),
            ]),
            ..Default::default()
        }
    }

    fn config(list: &[DeviceListStrategy]) -> NodeConfig {
        NodeConfig {
            device_list_strategy: DeviceListStrategies::new(list.iter().copied()),
            ..NodeConfig::default()
        }
    }

    fn specs(names: &[&str]) -> Registry {
        Registry {
            dirs: vec![PathBuf::from("/etc/cdi")],
            specs: vec![crate::gpu::cdi::Spec {
                path: PathBuf::from("/etc/cdi/nvidia.yaml"),
                version: "0.5.0".to_string(),
                kind: "nvidia.com/gpu".to_string(),
                devices: names
                    .iter()
                    .map(|n| crate::gpu::cdi::Device {
                        name: n.to_string(),
                        device_nodes: vec![],
                    })
                    .collect(),
            }],
            errors: vec![],
        }
    }

    #[test]
    fn envvar_is_the_answer_unchanged() {
        let out = hand_over(
            &config(&[DeviceListStrategy::Envvar]),
            None,
            Target::Gpu(&gpu()),
            base(),
        )
        .expect("ok");
        assert_eq!(out, base());
    }

    #[test]
    fn cdi_only_voids_the_env_and_names_the_device() {
        let cfg = config(&[DeviceListStrategy::CdiCri]);
        let out = hand_over(
            &cfg,
            Some(&specs(&["1", "all"])),
            Target::Gpu(&gpu()),
            base(),
        )
        .expect("ok");
        assert_eq!(out.envs[ENV_VISIBLE_DEVICES], "void");
        assert_eq!(out.envs["ALIYUN_COM_GPU_MEM_IDX"], "1");
        assert_eq!(out.cdi_devices[0], "nvidia.com/gpu=1");
        assert!(out.annotations.is_empty());
    }

    #[test]
    fn a_missing_device_names_the_other_strategy() {
        let cfg = config(&[DeviceListStrategy::CdiAnnotations]);
        let err = hand_over(&cfg, Some(&specs(&["GPU-b"])), Target::Gpu(&gpu()), base())
            .expect_err("no device 1");
        let msg = err.to_string();
        assert!(msg.contains("nvidia.com/gpu=1"), "{msg}");
        assert!(msg.contains("this GPU is there as GPU-b"), "{msg}");
        assert!(msg.contains("--device-name-strategy=index"), "{msg}");
        let err = hand_over(&cfg, None, Target::Gpu(&gpu()), base()).expect_err("no specs");
        assert!(err.to_string().contains("no CDI spec at all"), "{err}");
    }

    #[test]
    fn the_refusal_is_carried_and_never_checked() {
        let cfg = config(&[DeviceListStrategy::CdiCri, DeviceListStrategy::VolumeMounts]);
        let mut refused = base();
        refused.envs.insert(
            ENV_VISIBLE_DEVICES.to_string(),
            "no-gpu-has-4GiB-to-run".to_string(),
        );
        let out = hand_over(&cfg, None, Target::Refusal, refused).expect("ok");
        assert_eq!(out.cdi_devices[0], "nvidia.com/gpu=no-gpu-has-4GiB-to-run");
        assert_eq!(
            out.mounts[0].container_path,
            "/var/run/nvidia-container-devices/no-gpu-has-4GiB-to-run"
        );
        assert!(out.device_nodes.is_empty());
    }

    #[test]
    fn the_grant_carries_the_mps_limit_and_mounts_and_the_refusal_names_the_amount() {
        let mut cfg = config(&[DeviceListStrategy::Envvar]);
        cfg.mps = true;
        cfg.mps_active_thread_percentage = 30;
        cfg.mps_shm_dir = PathBuf::from("/run/mps-shm");
        let traits = NodeTraits { cgpu_disable: true };
        let out = grant(&cfg, traits, &gpu(), false, GpuMem::new(6), GpuMem::new(4));
        assert_eq!(out.envs[ENV_VISIBLE_DEVICES], "1");
        assert_eq!(out.envs[ENV_POD_MEM], "6");
        assert_eq!(out.envs[ENV_CONTAINER_MEM], "4");
        assert_eq!(out.envs[ENV_DEVICE_MEM], "16");
        assert_eq!(out.envs[ENV_CGPU_DISABLE], "true");
        assert_eq!(out.envs[ENV_MPS_PINNED_MEM_LIMIT], "0=4096M");
        assert_eq!(out.envs[ENV_MPS_ACTIVE_THREAD_PERCENTAGE], "30");
        assert_eq!(out.mounts.len(), 2);
        assert_eq!(out.mounts[1].container_path, "/dev/shm");
        let by_uuid = grant(
            &config(&[DeviceListStrategy::Envvar]),
            NodeTraits::default(),
            &gpu(),
            true,
            GpuMem::new(4),
            GpuMem::new(4),
        );
        assert_eq!(by_uuid.envs[ENV_VISIBLE_DEVICES], "GPU-b");
        assert!(!by_uuid.envs.contains_key(ENV_CGPU_DISABLE));
        assert!(by_uuid.mounts.is_empty());
        let no = refusal(&cfg, NodeTraits::default(), GpuMem::new(16), GpuMem::new(4));
        assert_eq!(no.envs[ENV_VISIBLE_DEVICES], "no-gpu-has-4GiB-to-run");
        assert_eq!(no.envs[ENV_GPU_INDEX], "-1");
        assert_eq!(no.envs[ENV_DEVICE_MEM], "16");
    }
}
