//! The device kinds the node agent holds beside its GPUs: the RDMA HCAs it offers (discovered
//! from sysfs, [`crate::rdma`]) and each generic declaration's devices (found under the dev
//! root, [`crate::devices::generic`]), each kind one extended resource, with the PCI place of
//! every served GPU so a kind can prefer the device nearest a pod's GPU.
//!
//! It reads sysfs and `/dev` once, at [`discover`]; it does not register, answer kubelet or
//! match pods (the device plugin does), and never hands over a device a kind does not offer:
//! an id naming an HCA left out (no verbs node, no ACTIVE port) is unknown here.

use std::collections::BTreeMap;

use crate::config::devices::DevicesConfig;
use crate::devices::generic::{self, GenericDevice, GenericDeviceConfig};
use crate::devices::handover::{self, HandOver, HandOverError};
use crate::gpu::GpuDevice;
use crate::pcie::{PciLocation, Proximity};
use crate::rdma::{self, Inventory, RdmaConfig};

/// The devices of one kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KindDevices {
    /// RDMA HCAs: only those offered are in `offered`.
    Rdma {
        /// `[devices.rdma]`.
        config: RdmaConfig,
        /// The HCAs offered (`rdma::offer`), with the host's `rdma_cm`.
        offered: Inventory,
        /// The HCAs left out, with the reason.
        left_out: Vec<(String, String)>,
    },
    /// One `[[devices.generic]]` declaration's devices.
    Generic {
        /// The declaration.
        config: GenericDeviceConfig,
        /// The devices found under the dev root.
        devices: Vec<GenericDevice>,
    },
}

/// One device kind: one extended resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceKind {
    /// The extended resource (`gpushare.io/rdma`, `example.com/fuse`).
    pub resource: String,
    /// Its devices.
    pub devices: KindDevices,
}

impl DeviceKind {
    /// `rdma` or `generic`.
    pub fn kind_name(&self) -> &'static str {
        match self.devices {
            KindDevices::Rdma { .. } => "rdma",
            KindDevices::Generic { .. } => "generic",
        }
    }

    /// The share ids ListAndWatch advertises: `<device>-_-<n>`, one per share of each device.
    pub fn share_ids(&self) -> Vec<String> {
        match &self.devices {
            KindDevices::Rdma {
                config, offered, ..
            } => offered
                .hcas
                .iter()
                .flat_map(|h| handover::rdma_share_ids(h, config.shares_per_hca))
                .collect(),
            KindDevices::Generic { devices, .. } => {
                devices.iter().flat_map(GenericDevice::share_ids).collect()
            }
        }
    }

    /// What a container given `ids` of this kind gets; an id naming no device of the kind
    /// (or a share past its count) is refused.
    pub fn hand_over(&self, ids: &[String]) -> Result<HandOver, HandOverError> {
        match &self.devices {
            KindDevices::Rdma {
                config, offered, ..
            } => handover::rdma(offered, config, ids),
            KindDevices::Generic { devices, .. } => handover::generic(devices, ids),
        }
    }

    /// The ids to prefer for a container asking `size` of this kind: for RDMA, the HCAs
    /// nearest the pod's GPU at `gpu` first ([`rdma::preferred_allocation`]); for a generic
    /// kind, `must_include` then the available ids in order, one share per device first.
    pub fn preferred(
        &self,
        gpu: Option<&PciLocation>,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Vec<(String, Proximity)> {
        match &self.devices {
            KindDevices::Rdma { offered, .. } => {
                rdma::preferred_allocation(offered, gpu, available, must_include, size)
            }
            KindDevices::Generic { devices, .. } => {
                let mut out: Vec<(String, Proximity)> = must_include
                    .iter()
                    .map(|id| (id.clone(), Proximity::Distant))
                    .collect();
                let device_of = |id: &str| {
                    crate::core::wire::parse_fake_device_id(id)
                        .map_or(id.to_string(), |(d, _)| d.to_string())
                };
                let mut used: Vec<String> = must_include.iter().map(|i| device_of(i)).collect();
                let free: Vec<&String> = available
                    .iter()
                    .filter(|id| !must_include.contains(id))
                    .filter(|id| devices.iter().any(|d| d.id == device_of(id)))
                    .collect();
                let mut taken = vec![false; free.len()];
                for pass in 0..2 {
                    for (i, id) in free.iter().enumerate() {
                        if out.len() >= size {
                            return out;
                        }
                        let dev = device_of(id);
                        if taken[i] || (pass == 0 && used.contains(&dev)) {
                            continue;
                        }
                        taken[i] = true;
                        used.push(dev);
                        out.push(((*id).clone(), Proximity::Distant));
                    }
                }
                out
            }
        }
    }
}

/// Every kind the node offers, and the PCI place of each served GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceKinds {
    /// The kinds, RDMA first, then the generic declarations in configuration order.
    pub kinds: Vec<DeviceKind>,
    /// The PCI place of each GPU (by index) sysfs shows.
    pub gpu_places: BTreeMap<u32, PciLocation>,
}

impl DeviceKinds {
    /// The kind serving `resource`.
    pub fn get(&self, resource: &str) -> Option<&DeviceKind> {
        self.kinds.iter().find(|k| k.resource == resource)
    }
}

/// Reads the kinds `config` enables under its roots, and the places of `gpus`. A host
/// without `/sys/class/infiniband` (RDMA enabled on a node without HCAs) offers no HCA, with a
/// warning; nothing is read when no kind is configured.
pub fn discover(config: &DevicesConfig, gpus: &[GpuDevice]) -> DeviceKinds {
    let mut out = DeviceKinds::default();
    if config.rdma.enabled {
        let inventory = match rdma::discover(&config.roots()) {
            Ok(inv) => inv,
            Err(e) => {
                tracing::warn!(error = %e, resource = %config.rdma.resource, "no RDMA device offered");
                Inventory::default()
            }
        };
        let (offered, left_out) = rdma::offer(&inventory, &config.rdma);
        for (h, why) in &left_out {
            tracing::warn!(hca = %h.name, reason = %why, "RDMA device not offered");
        }
        out.kinds.push(DeviceKind {
            resource: config.rdma.resource.clone(),
            devices: KindDevices::Rdma {
                config: config.rdma.clone(),
                offered: Inventory {
                    hcas: offered.into_iter().cloned().collect(),
                    rdma_cm: inventory.rdma_cm,
                },
                left_out: left_out
                    .into_iter()
                    .map(|(h, why)| (h.name.clone(), why.to_string()))
                    .collect(),
            },
        });
    }
    for decl in &config.generic {
        let devices = generic::discover(decl, &config.dev_root);
        if devices.is_empty() {
            tracing::warn!(resource = %decl.resource, "no device matches the declaration's paths");
        }
        out.kinds.push(DeviceKind {
            resource: decl.resource.clone(),
            devices: KindDevices::Generic {
                config: decl.clone(),
                devices,
            },
        });
    }
    if out.kinds.iter().any(|k| k.kind_name() == "rdma") {
        for g in gpus {
            match PciLocation::of_bus_id(&config.sysfs_root, &g.pci_bus_id) {
                Ok(loc) => {
                    out.gpu_places.insert(g.index, loc);
                }
                Err(e) => {
                    tracing::warn!(gpu = g.index, error = %e, "GPU's PCI place unknown: its pods get any HCA")
                }
            }
        }
    }
    out
}
