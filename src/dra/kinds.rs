//! The node agent's device kinds beside the GPU (RDMA HCAs, `[[devices.generic]]` devices) as
//! devices of the driver's ResourceSlice, so one claim can ask for GPU memory and, say, the
//! HCA under the same PCIe root (`matchAttribute: resource.kubernetes.io/pcieRoot`), and what
//! a claim's results on them hand its containers.
//!
//! Each offered HCA and each generic device is one device, named stably (`rdma-mlx5-0`,
//! `<resource name>-<device id>`, lower-cased to a DNS label), with the attributes `type`
//! (`rdma` / `generic`), `resource` (the kind's extended resource, which its DeviceClass
//! selects on), and where sysfs states them the standard `resource.kubernetes.io/pcieRoot`,
//! `pciBusID` and `numaNode`; an HCA also carries `ibdev`, `linkLayer` and `nodeGUID`. A kind
//! shared by several pods (`shares_per_hca`, a declaration's `shares` above 1) publishes
//! `allowMultipleAllocations: true` with a consumable capacity `shares` whose request policy
//! gives each claim one share unless it asks for more; a kind handed out whole publishes an
//! exclusive device.
//!
//! What it does not do: discover devices (the node agent did, [`crate::node::kinds`]), watch
//! their health (an HCA without an ACTIVE port is not offered at all), or write CDI specs
//! (the preparer, from [`hand_over`]).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::core::resource_name::{dns_label as label, unique_dns_label};
use crate::core::wire::{
    DRA_ATTR_RESOURCE, DRA_ATTR_TYPE, DRA_CAPACITY_SHARES, DRA_TYPE_GENERIC, DRA_TYPE_RDMA,
};
use crate::devices::handover::{HandOver, HandOverError};
use crate::node::kinds::{DeviceKinds, KindDevices};
use crate::pcie::{AttributeValue, PciLocation};

/// Device attribute of an HCA: its RDMA device name (`mlx5_0`).
pub const ATTR_IBDEV: &str = "ibdev";
/// Device attribute of an HCA: the link layer of its first active port (`InfiniBand`,
/// `Ethernet`).
pub const ATTR_LINK_LAYER: &str = "linkLayer";
/// Device attribute of an HCA: its node GUID.
pub const ATTR_NODE_GUID: &str = "nodeGUID";

/// One device of a kind beside the GPU, as the slice publishes it and prepare finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindDevice {
    /// The device's name in the slice.
    pub name: String,
    /// The kind's extended resource (`gpushare.io/rdma`).
    pub resource: String,
    /// `rdma` or `generic`.
    pub kind: &'static str,
    /// The device's id in its kind (the HCA's name, the generic device's id): what the
    /// device plugin's ids are made of.
    pub id: String,
    /// How many pods may hold it at once (1: whole).
    pub shares: u32,
    /// The attributes besides `type` and `resource`.
    pub attributes: BTreeMap<String, AttributeValue>,
}

impl KindDevice {
    /// Whether several claims may hold it.
    pub fn shared(&self) -> bool {
        self.shares > 1
    }

    /// The device as the slice publishes it.
    pub fn to_device(&self) -> Device {
        let mut attributes: BTreeMap<String, DeviceAttribute> = self
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), attribute(v)))
            .collect();
        attributes.insert(
            DRA_ATTR_TYPE.to_string(),
            attribute(&AttributeValue::String(self.kind.to_string())),
        );
        attributes.insert(
            DRA_ATTR_RESOURCE.to_string(),
            attribute(&AttributeValue::String(self.resource.clone())),
        );
        let capacity = self.shared().then(|| {
            let q = |v: u32| Quantity(v.to_string());
            BTreeMap::from([(
                DRA_CAPACITY_SHARES.to_string(),
                DeviceCapacity {
                    value: q(self.shares),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(q(1)),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: q(1),
                            max: Some(q(self.shares)),
                            step: Some(q(1)),
                        }),
                        valid_values: None,
                    }),
                },
            )])
        });
        Device {
            name: self.name.clone(),
            allow_multiple_allocations: self.shared().then_some(true),
            attributes: Some(attributes),
            capacity,
            ..Default::default()
        }
    }
}

/// A DRA attribute of `value`.
pub fn attribute(value: &AttributeValue) -> DeviceAttribute {
    match value {
        AttributeValue::String(s) => DeviceAttribute {
            string: Some(s.clone()),
            ..Default::default()
        },
        AttributeValue::Int(i) => DeviceAttribute {
            int: Some(*i),
            ..Default::default()
        },
    }
}

/// The standard attributes of a PCI place (`pcieRoot`, `pciBusID`, `numaNode`).
pub fn place_attributes(place: &PciLocation) -> BTreeMap<String, AttributeValue> {
    place
        .dra_attributes()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// Every device of `kinds`, in the kinds' order (RDMA first, then the generic declarations),
/// each kind's devices in discovery order. Names never collide with GPU names (`gpu-…`): a
/// generic resource named `gpu` gets `gpu-x-…`.
pub fn kind_devices(kinds: &DeviceKinds) -> Vec<KindDevice> {
    let mut taken = Vec::new();
    let mut out = Vec::new();
    for kind in &kinds.kinds {
        match &kind.devices {
            KindDevices::Rdma {
                config, offered, ..
            } => {
                for hca in &offered.hcas {
                    let mut attributes = hca.pci.as_ref().map(place_attributes).unwrap_or_default();
                    attributes.insert(
                        ATTR_IBDEV.to_string(),
                        AttributeValue::String(hca.name.clone()),
                    );
                    let layer = hca
                        .ports
                        .iter()
                        .find(|p| p.active())
                        .or(hca.ports.first())
                        .map(|p| p.link_layer);
                    if let Some(layer) = layer.filter(|l| *l != crate::rdma::LinkLayer::Unknown) {
                        attributes.insert(
                            ATTR_LINK_LAYER.to_string(),
                            AttributeValue::String(format!("{layer:?}")),
                        );
                    }
                    if let Some(guid) = &hca.node_guid {
                        attributes.insert(
                            ATTR_NODE_GUID.to_string(),
                            AttributeValue::String(guid.clone()),
                        );
                    }
                    out.push(KindDevice {
                        name: unique_dns_label(&[DRA_TYPE_RDMA, &hca.name], &mut taken),
                        resource: kind.resource.clone(),
                        kind: DRA_TYPE_RDMA,
                        id: hca.name.clone(),
                        shares: config.shares_per_hca.max(1),
                        attributes,
                    });
                }
            }
            KindDevices::Generic { devices, .. } => {
                let short = kind
                    .resource
                    .split_once('/')
                    .map_or(kind.resource.as_str(), |(_, n)| n);
                let prefix = if label(short).starts_with("gpu") {
                    format!("x-{short}")
                } else {
                    short.to_string()
                };
                for d in devices {
                    out.push(KindDevice {
                        name: unique_dns_label(&[&prefix, &d.id], &mut taken),
                        resource: kind.resource.clone(),
                        kind: DRA_TYPE_GENERIC,
                        id: d.id.clone(),
                        shares: d.shares.max(1),
                        attributes: BTreeMap::new(),
                    });
                }
            }
        }
    }
    out
}

/// What a claim holding `devices` (devices of one kind, by id) hands its containers: the
/// kind's hand-over of one share of each ([`crate::node::kinds::DeviceKind::hand_over`]).
/// An id the kind does not offer is refused.
pub fn hand_over(
    kinds: &DeviceKinds,
    resource: &str,
    ids: &[&str],
) -> Result<HandOver, HandOverError> {
    let kind = kinds
        .get(resource)
        .ok_or_else(|| HandOverError::UnknownDevice {
            id: format!("{resource}: {}", ids.join(",")),
        })?;
    let ids: Vec<String> = ids
        .iter()
        .map(|id| crate::core::wire::fake_device_id(id, 0))
        .collect();
    kind.hand_over(&ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels_unique_and_never_a_gpu_name() {
        let mut taken = Vec::new();
        assert_eq!(
            unique_dns_label(&["rdma", "mlx5_0"], &mut taken),
            "rdma-mlx5-0"
        );
        assert_eq!(
            unique_dns_label(&["rdma", "mlx5-0"], &mut taken),
            "rdma-mlx5-0-2"
        );
        let long = "x".repeat(100);
        let name = unique_dns_label(&["fuse", &long], &mut taken);
        assert!(name.len() <= 63, "{name}");
        assert_eq!(label("GPU_a/b"), "gpu-a-b");
    }

    #[test]
    fn a_shared_device_publishes_a_shares_capacity_and_a_whole_one_is_exclusive() {
        let d = KindDevice {
            name: "rdma-mlx5-0".into(),
            resource: "gpushare.io/rdma".into(),
            kind: DRA_TYPE_RDMA,
            id: "mlx5_0".into(),
            shares: 4,
            attributes: BTreeMap::from([(
                "resource.kubernetes.io/pcieRoot".to_string(),
                AttributeValue::String("pci0000:59".into()),
            )]),
        };
        let dev = d.to_device();
        assert_eq!(dev.allow_multiple_allocations, Some(true));
        let cap = &dev.capacity.as_ref().expect("capacity")[DRA_CAPACITY_SHARES];
        assert_eq!(cap.value.0, "4");
        let policy = cap.request_policy.as_ref().expect("policy");
        assert_eq!(policy.default.as_ref().map(|q| q.0.as_str()), Some("1"));
        let attrs = dev.attributes.as_ref().expect("attributes");
        assert_eq!(attrs[DRA_ATTR_TYPE].string.as_deref(), Some("rdma"));
        assert_eq!(
            attrs[DRA_ATTR_RESOURCE].string.as_deref(),
            Some("gpushare.io/rdma")
        );
        assert_eq!(
            attrs["resource.kubernetes.io/pcieRoot"].string.as_deref(),
            Some("pci0000:59")
        );
        let whole = KindDevice { shares: 1, ..d }.to_device();
        assert_eq!(whole.allow_multiple_allocations, None);
        assert_eq!(whole.capacity, None);
    }
}
