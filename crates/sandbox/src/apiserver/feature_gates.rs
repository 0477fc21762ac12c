//! The Kubernetes version the sandbox API server plays and its feature gates: the DRA gates
//! that decide which `resource.k8s.io/v1` fields a write keeps (`resource_strategy`) and which
//! rules validate it (`validation_resource`), with upstream's default per version
//! (`pkg/features/kube_features.go`, 1.34 to 1.37). A test sets the version
//! ([`super::ApiServer::set_kubernetes_version`]), which resets every gate to that version's
//! default, then flips single gates ([`super::ApiServer::set_feature_gate`]) as an operator's
//! `--feature-gates` would.
//!
//! Only the gates that change what the sandbox does are modelled; there is no notion of
//! emulated versions, locked gates or gate dependencies (a gate locked on by upstream can still
//! be turned off here).

use std::collections::BTreeMap;
use std::fmt;

/// The oldest minor version modelled: `resource.k8s.io/v1` is served from 1.34.
pub const OLDEST_MINOR: u32 = 34;
/// The newest minor version modelled, the newest the project ships (k8s-openapi `v1_37`).
pub const NEWEST_MINOR: u32 = 37;

/// A feature gate of kube-apiserver that the sandbox honours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FeatureGate {
    /// `adminAccess` in requests and results.
    DRAAdminAccess,
    /// `allowMultipleAllocations`, `requestPolicy`, capacity requests, `shareID`,
    /// `consumedCapacity`, `distinctAttribute` constraints, `device.allowMultipleAllocations`
    /// in CEL.
    DRAConsumableCapacity,
    /// Binding conditions of devices and results.
    DRADeviceBindingConditions,
    /// `status.devices` of claims.
    DRAResourceClaimDeviceStatus,
    /// Device `taints` in slices and `tolerations` in requests.
    DRADeviceTaints,
    /// `extendedResourceName` of DeviceClasses.
    DRAExtendedResource,
    /// `sharedCounters`, `consumesCounters` and per-device node selection.
    DRAPartitionableDevices,
    /// `firstAvailable` requests.
    DRAPrioritizedList,
    /// List-valued attributes (`bools`, `ints`, `strings`, `versions`).
    DRAListTypeAttributes,
    /// `nodeAllocatableResourceMappings` of devices.
    DRANodeAllocatableResources,
}

impl FeatureGate {
    /// Every modelled gate.
    pub const ALL: [FeatureGate; 10] = [
        FeatureGate::DRAAdminAccess,
        FeatureGate::DRAConsumableCapacity,
        FeatureGate::DRADeviceBindingConditions,
        FeatureGate::DRAResourceClaimDeviceStatus,
        FeatureGate::DRADeviceTaints,
        FeatureGate::DRAExtendedResource,
        FeatureGate::DRAPartitionableDevices,
        FeatureGate::DRAPrioritizedList,
        FeatureGate::DRAListTypeAttributes,
        FeatureGate::DRANodeAllocatableResources,
    ];

    /// The gate's name as `--feature-gates` spells it.
    pub fn name(self) -> &'static str {
        match self {
            FeatureGate::DRAAdminAccess => "DRAAdminAccess",
            FeatureGate::DRAConsumableCapacity => "DRAConsumableCapacity",
            FeatureGate::DRADeviceBindingConditions => "DRADeviceBindingConditions",
            FeatureGate::DRAResourceClaimDeviceStatus => "DRAResourceClaimDeviceStatus",
            FeatureGate::DRADeviceTaints => "DRADeviceTaints",
            FeatureGate::DRAExtendedResource => "DRAExtendedResource",
            FeatureGate::DRAPartitionableDevices => "DRAPartitionableDevices",
            FeatureGate::DRAPrioritizedList => "DRAPrioritizedList",
            FeatureGate::DRAListTypeAttributes => "DRAListTypeAttributes",
            FeatureGate::DRANodeAllocatableResources => "DRANodeAllocatableResources",
        }
    }

    /// The gate of that name.
    pub fn from_name(name: &str) -> Option<FeatureGate> {
        FeatureGate::ALL.into_iter().find(|g| g.name() == name)
    }

    /// Upstream's default at Kubernetes `1.<minor>` (the versioned specs of
    /// `kube_features.go`; a minor outside 1.34–1.37 reads as the nearest one).
    pub fn default_at(self, minor: u32) -> bool {
        let m = minor.clamp(OLDEST_MINOR, NEWEST_MINOR);
        match self {
            // Beta on from 1.34, GA 1.36.
            FeatureGate::DRAAdminAccess | FeatureGate::DRAPrioritizedList => true,
            // Beta on from 1.33.
            FeatureGate::DRAResourceClaimDeviceStatus => true,
            // Alpha in 1.34–1.35 (taints from 1.33), beta on from 1.36.
            FeatureGate::DRAConsumableCapacity
            | FeatureGate::DRADeviceBindingConditions
            | FeatureGate::DRADeviceTaints
            | FeatureGate::DRAExtendedResource
            | FeatureGate::DRAPartitionableDevices => m >= 36,
            // Alpha from 1.36.
            FeatureGate::DRAListTypeAttributes | FeatureGate::DRANodeAllocatableResources => false,
        }
    }
}

impl fmt::Display for FeatureGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Kubernetes minor version the sandbox cannot play.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox API server plays Kubernetes 1.{OLDEST_MINOR} to 1.{NEWEST_MINOR}, not 1.{0}")]
pub struct UnsupportedVersion(pub u32);

/// The version played and the gates as set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cluster {
    minor: u32,
    gates: BTreeMap<FeatureGate, bool>,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::at(NEWEST_MINOR)
    }
}

impl Cluster {
    /// Kubernetes `1.<minor>` with every gate at its default.
    pub fn at(minor: u32) -> Cluster {
        Cluster {
            minor,
            gates: FeatureGate::ALL
                .into_iter()
                .map(|g| (g, g.default_at(minor)))
                .collect(),
        }
    }

    /// `1.<minor>` when supported.
    pub fn checked(minor: u32) -> Result<Cluster, UnsupportedVersion> {
        if (OLDEST_MINOR..=NEWEST_MINOR).contains(&minor) {
            Ok(Cluster::at(minor))
        } else {
            Err(UnsupportedVersion(minor))
        }
    }

    pub fn minor(&self) -> u32 {
        self.minor
    }

    pub fn enabled(&self, gate: FeatureGate) -> bool {
        self.gates
            .get(&gate)
            .copied()
            .unwrap_or_else(|| gate.default_at(self.minor))
    }

    pub fn set(&mut self, gate: FeatureGate, enabled: bool) {
        self.gates.insert(gate, enabled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_upstreams_versioned_specs() {
        use FeatureGate::*;
        for (gate, want) in [
            (DRADeviceTaints, [false, false, true, true]),
            (DRAConsumableCapacity, [false, false, true, true]),
            (DRAPartitionableDevices, [false, false, true, true]),
            (DRAPrioritizedList, [true, true, true, true]),
            (DRAAdminAccess, [true, true, true, true]),
            (DRAListTypeAttributes, [false, false, false, false]),
        ] {
            let got: Vec<bool> = (34..=37).map(|m| Cluster::at(m).enabled(gate)).collect();
            assert_eq!(got, want, "{gate}");
        }
        assert_eq!(
            FeatureGate::from_name("DRADeviceTaints"),
            Some(DRADeviceTaints)
        );
        assert_eq!(FeatureGate::from_name("Nope"), None);
        assert!(Cluster::checked(33).is_err());
        assert_eq!(Cluster::default().minor(), NEWEST_MINOR);
    }
}
