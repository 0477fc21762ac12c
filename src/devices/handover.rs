//! What a container gets with the devices it was given: the device nodes (host path,
//! container path, cgroup permissions), mounts and environment, for RDMA HCAs ([`rdma`]) and
//! generic devices ([`generic`]). Pure: it reads only the inventories handed to it.
//!
//! The input is the device ids the kubelet (or a DRA claim) gave the container — share ids
//! `<device>-_-<n>` as [`crate::devices::generic::GenericDevice::share_ids`] and
//! [`rdma_share_ids`] advertise them. Every node handed over belongs to a device named by one
//! of those ids: an id naming no offered device is refused ([`HandOverError::UnknownDevice`]),
//! never mapped to another, and two shares of one device hand it over once. It does not
//! answer kubelet or write CDI specs itself: [`HandOver::to_allocate_response`] builds the
//! answer the device plugin sends, [`HandOver::to_cdi_container_edits`] the CDI edits a DRA
//! prepare writes.

use std::collections::{BTreeMap, BTreeSet};

use crate::core::wire;
use crate::devices::generic::GenericDevice;
use crate::gpu::cdi::{CdiMount, ContainerEditsSpec, DeviceNodeEdit};
use crate::kubelet_api::deviceplugin as dp;
use crate::rdma::{Hca, Inventory, RdmaConfig};

/// One device node handed to a container.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceNodeSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Cgroup permissions (`rw`, `rwm`).
    pub permissions: String,
}

/// One mount handed to a container.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct MountSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Read-only.
    pub read_only: bool,
}

/// Everything a container gets with its devices of one kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HandOver {
    /// Device nodes, sorted by container path, each once.
    pub devices: Vec<DeviceNodeSpec>,
    /// Mounts, sorted by container path, each once.
    pub mounts: Vec<MountSpec>,
    /// Environment.
    pub envs: BTreeMap<String, String>,
}

impl HandOver {
    /// The device plugin's answer for one container.
    pub fn to_allocate_response(&self) -> dp::ContainerAllocateResponse {
        dp::ContainerAllocateResponse {
            envs: self
                .envs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            mounts: self
                .mounts
                .iter()
                .map(|m| dp::Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    read_only: m.read_only,
                })
                .collect(),
            devices: self
                .devices
                .iter()
                .map(|d| dp::DeviceSpec {
                    container_path: d.container_path.clone(),
                    host_path: d.host_path.clone(),
                    permissions: d.permissions.clone(),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// The same as the `containerEdits` of a CDI device (`env` as `K=V`, `deviceNodes` with
    /// `path` / `hostPath` / `permissions`, bind `mounts`), what a DRA prepare writes into the
    /// CDI spec it hands the runtime.
    pub fn to_cdi_container_edits(&self) -> ContainerEditsSpec {
        ContainerEditsSpec {
            env: self.envs.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            device_nodes: self
                .devices
                .iter()
                .map(|d| DeviceNodeEdit {
                    path: d.container_path.clone(),
                    host_path: Some(d.host_path.clone()),
                    permissions: Some(d.permissions.clone()),
                })
                .collect(),
            mounts: self
                .mounts
                .iter()
                .map(|m| CdiMount {
                    host_path: m.host_path.clone(),
                    container_path: m.container_path.clone(),
                    options: [
                        if m.read_only { "ro" } else { "rw" },
                        "nosuid",
                        "nodev",
                        "bind",
                    ]
                    .map(str::to_string)
                    .to_vec(),
                })
                .collect(),
            hooks: Vec::new(),
        }
    }

    fn finish(mut self) -> HandOver {
        self.devices.sort();
        self.devices.dedup();
        self.mounts.sort();
        self.mounts.dedup();
        self
    }
}

/// Why devices could not be handed over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandOverError {
    /// An id that names no device offered (or a share number past its shares).
    #[error("device id {id:?} names no device this node offers")]
    UnknownDevice {
        /// The id.
        id: String,
    },
    /// The HCA has no verbs device in sysfs (`ib_uverbs` not loaded for it).
    #[error("HCA {hca} has no uverbs device (is ib_uverbs loaded?)")]
    NoVerbsDevice {
        /// The HCA.
        hca: String,
    },
    /// The HCA's verbs device is missing under the dev root.
    #[error("HCA {hca}: {path} does not exist")]
    NodeMissing {
        /// The HCA.
        hca: String,
        /// The missing node.
        path: String,
    },
}

/// The ids the device plugin advertises for `hca`: `<name>-_-<n>`, `shares` of them.
pub fn rdma_share_ids(hca: &Hca, shares: u32) -> Vec<String> {
    (0..u64::from(shares))
        .map(|n| wire::fake_device_id(&hca.name, n))
        .collect()
}

/// The device each id names, and its share number; ids without a share suffix name the
/// device itself (share 0).
fn device_of(id: &str) -> (&str, u64) {
    wire::parse_fake_device_id(id).unwrap_or((id, 0))
}

/// Env naming the HCAs handed over, comma-separated (`mlx5_0,mlx5_3`).
pub const ENV_RDMA_DEVICES: &str = "GPUSHARE_RDMA_DEVICES";
/// NCCL's HCA selection, set to exactly the HCAs handed over (`=mlx5_0,mlx5_3`), so NCCL
/// never tries an HCA whose sysfs entry the container sees but whose node it lacks.
pub const ENV_NCCL_IB_HCA: &str = "NCCL_IB_HCA";

/// The hand-over of the HCAs `ids` name: each HCA's `uverbs` node, its `umad` nodes when
/// `config.umad`, and `rdma_cm` once when the host has it; [`ENV_RDMA_DEVICES`] and
/// [`ENV_NCCL_IB_HCA`] name them.
pub fn rdma(
    inventory: &Inventory,
    config: &RdmaConfig,
    ids: &[String],
) -> Result<HandOver, HandOverError> {
    let mut names: Vec<&str> = Vec::new();
    let mut seen = BTreeSet::new();
    for id in ids {
        let (name, share) = device_of(id);
        let hca = inventory
            .get(name)
            .filter(|_| share < u64::from(config.shares_per_hca.max(1)))
            .ok_or_else(|| HandOverError::UnknownDevice { id: id.clone() })?;
        if seen.insert(hca.name.as_str()) {
            names.push(hca.name.as_str());
        }
    }
    let mut out = HandOver::default();
    for name in &names {
        let Some(hca) = inventory.get(name) else {
            continue;
        };
        let uverbs = hca
            .uverbs
            .as_ref()
            .ok_or_else(|| HandOverError::NoVerbsDevice {
                hca: hca.name.clone(),
            })?;
        if !uverbs.present {
            return Err(HandOverError::NodeMissing {
                hca: hca.name.clone(),
                path: uverbs.host_path(),
            });
        }
        out.devices.push(node(uverbs.host_path()));
        if config.umad {
            for umad in hca.umad.iter().filter(|u| u.present) {
                out.devices.push(node(umad.host_path()));
            }
        }
    }
    if !names.is_empty() {
        if inventory.rdma_cm {
            out.devices.push(node(crate::rdma::dev_path("rdma_cm")));
        }
        out.envs
            .insert(ENV_RDMA_DEVICES.to_string(), names.join(","));
        out.envs
            .insert(ENV_NCCL_IB_HCA.to_string(), format!("={}", names.join(",")));
    }
    Ok(out.finish())
}

fn node(host_path: String) -> DeviceNodeSpec {
    DeviceNodeSpec {
        container_path: host_path.clone(),
        host_path,
        permissions: "rw".to_string(),
    }
}

/// The hand-over of the generic devices `ids` name, `devices` being those of the one
/// resource the ids were given for: every node of each device, its mounts and its
/// environment.
pub fn generic(devices: &[GenericDevice], ids: &[String]) -> Result<HandOver, HandOverError> {
    let mut out = HandOver::default();
    let mut seen = BTreeSet::new();
    for id in ids {
        let (dev_id, share) = device_of(id);
        let device = devices
            .iter()
            .find(|d| d.id == dev_id && share < u64::from(d.shares))
            .ok_or_else(|| HandOverError::UnknownDevice { id: id.clone() })?;
        if !seen.insert((device.resource.as_str(), device.id.as_str())) {
            continue;
        }
        for n in &device.nodes {
            out.devices.push(DeviceNodeSpec {
                container_path: n.container_path.clone(),
                host_path: n.host_path.clone(),
                permissions: n.permissions.clone(),
            });
        }
        for m in &device.mounts {
            out.mounts.push(MountSpec {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                read_only: m.read_only,
            });
        }
        out.envs
            .extend(device.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    Ok(out.finish())
}
