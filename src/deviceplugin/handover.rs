//! How a container is handed its GPU: turns the envvar answer Allocate built (the
//! `ALIYUN_COM_GPU_MEM_*` envs, `NVIDIA_VISIBLE_DEVICES`, the MPS envs and pipe mount) into the
//! answer of the configured `--device-list-strategy` (NVIDIA's names; combinable):
//!
//! | strategy | what the container response carries |
//! | --- | --- |
//! | `envvar` (default) | `NVIDIA_VISIBLE_DEVICES=<id>` (the NVIDIA runtime must be the default) |
//! | `volume-mounts` | `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` and a mount `/var/run/nvidia-container-devices/<id>` from `/dev/null` |
//! | `cdi-annotations` | annotation `<prefix>gpushare_gpu-mem: <kind>=<id>` |
//! | `cdi-cri` | `cdi_devices: [<kind>=<id>]` (kubelet 1.28+) |
//!
//! `<id>` is the index or the UUID (`--device-id-strategy`). With only CDI strategies,
//! `NVIDIA_VISIBLE_DEVICES=void`, so an image's `NVIDIA_VISIBLE_DEVICES=all` cannot make a
//! legacy NVIDIA hook expose every GPU; CDI injects the one GPU. `--pass-device-specs` adds
//! DeviceSpecs for `/dev/nvidia<minor>`, `/dev/nvidiactl`, `/dev/nvidia-uvm`,
//! `/dev/nvidia-uvm-tools`. The `ALIYUN_COM_GPU_MEM_*` and MPS envs are kept in every strategy.
//!
//! With a CDI strategy the node's CDI specs are read at every Allocate ([`crate::gpu::cdi`]); a
//! GPU without a matching CDI device fails the Allocate with the fix (never a container that
//! silently starts without its GPU). The upstream refusal answer (`no-gpu-has-<N>-to-run`)
//! is carried into every strategy, as a device name that no runtime resolves, so the container
//! still fails to start.
//!
//! It does not choose the GPU (matching does) and does not record anything on the pod.

use std::path::{Path, PathBuf};

use tonic::Status;

use super::Plugin;
use super::devices::ServedGpu;
use crate::config::{DeviceListStrategy, DevicePluginConfig, VisibleDevices};
use crate::core::wire::ENV_VISIBLE_DEVICES;
use crate::gpu::cdi::{Registry, qualified_name};
use crate::kubelet_api::deviceplugin::{CdiDevice, ContainerAllocateResponse, DeviceSpec, Mount};

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
pub(crate) enum HandoverError {
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
pub(crate) struct MissingCdiDevice {
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
pub(crate) fn device_id(id: VisibleDevices, gpu: &ServedGpu) -> String {
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
pub(crate) fn hand_over(
    config: &DevicePluginConfig,
    specs: Option<&Registry>,
    target: Target<'_>,
    mut base: ContainerAllocateResponse,
) -> Result<ContainerAllocateResponse, HandoverError> {
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
            base.cdi_devices.push(CdiDevice { name });
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
        base.mounts.push(Mount {
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
            base.devices.push(DeviceSpec {
                container_path: path.to_string(),
                host_path: path.to_string(),
                permissions: "rw".to_string(),
            });
        }
    }
    Ok(base)
}

fn check_cdi_device(
    config: &DevicePluginConfig,
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

impl Plugin {
    /// The strategy's answer for one container (see the module doc): reads the CDI specs off
    /// the runtime when a CDI strategy is on; a failure is logged, announced as a Warning Event
    /// on the node and returned as FailedPrecondition.
    pub(crate) async fn hand_over(
        &self,
        gpu_index: Option<u32>,
        base: ContainerAllocateResponse,
    ) -> Result<ContainerAllocateResponse, Status> {
        let specs = if self.config.device_list_strategy.any_cdi() && gpu_index.is_some() {
            let dirs: Vec<PathBuf> = self.config.cdi_spec_dirs.clone();
            let read = tokio::task::spawn_blocking(move || Registry::read(Path::new("/"), &dirs));
            Some(read.await.map_err(|e| {
                Status::internal(format!("reading the CDI specs did not finish: {e}"))
            })?)
        } else {
            None
        };
        let target = match gpu_index.and_then(|i| self.gpu_by_index(i)) {
            Some(gpu) => Target::Gpu(gpu),
            None => Target::Refusal,
        };
        hand_over(&self.config, specs.as_ref(), target, base).map_err(|e| {
            let msg = e.to_string();
            tracing::error!("Allocate: {msg}");
            self.metrics.allocation("handover_failed");
            let events = self.events.clone();
            let (node, uid, event_msg) = (self.node.clone(), self.node_uid.clone(), msg.clone());
            tokio::spawn(async move {
                super::node::warn_event(
                    &events,
                    &node,
                    &uid,
                    "Allocate",
                    "GpuShareNoCdiDevice",
                    &event_msg,
                )
                .await;
            });
            Status::failed_precondition(msg)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeviceListStrategies;
    use crate::core::GpuMem;
    use std::collections::HashMap;

    fn gpu() -> ServedGpu {
        ServedGpu {
            index: 1,
            uuid: "GPU-b".to_string(),
            units: GpuMem::new(16),
            minor: Some(3),
        }
    }

    fn base() -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: HashMap::from([
                (ENV_VISIBLE_DEVICES.to_string(), "1".to_string()),
                ("ALIYUN_COM_GPU_MEM_IDX".to_string(), "1".to_string()),
            ]),
            ..Default::default()
        }
    }

    fn config(list: &[DeviceListStrategy]) -> DevicePluginConfig {
        DevicePluginConfig {
            device_list_strategy: DeviceListStrategies::new(list.iter().copied()),
            ..DevicePluginConfig::default()
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
        assert_eq!(out.cdi_devices[0].name, "nvidia.com/gpu=1");
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
        assert_eq!(
            out.cdi_devices[0].name,
            "nvidia.com/gpu=no-gpu-has-4GiB-to-run"
        );
        assert_eq!(
            out.mounts[0].container_path,
            "/var/run/nvidia-container-devices/no-gpu-has-4GiB-to-run"
        );
        assert!(out.devices.is_empty());
    }
}
