//! PCIe topology as sysfs shows it: where a PCI function sits (its PCIe root complex
//! `pci<domain>:<bus>`, the bridges from the root port down to it, its NUMA node) and how near
//! two functions are ([`Proximity`]: same PCIe switch, then same root, then NUMA node, then
//! none), and the nearest of a set of candidates ([`nearest`]).
//!
//! It reads only what sysfs states: the device path a function's `/sys/bus/pci/devices/<addr>`
//! link (or an RDMA device's class link) resolves to, and the function's `numa_node`. It does
//! not enumerate PCI devices, read configuration space, or know what a GPU or an HCA is; the
//! device kinds ask it about the addresses they found.

use std::cmp::Ordering;
use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

/// A PCI function address, `dddd:bb:dd.f` (what sysfs names functions by).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI segment (domain).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0-31).
    pub device: u8,
    /// Function number (0-7).
    pub function: u8,
}

/// Why a PCI address did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a PCI address (dddd:bb:dd.f): {0:?}")]
pub struct BadPciAddress(pub String);

impl FromStr for PciAddress {
    type Err = BadPciAddress;

    /// `0000:19:00.0`, and NVIDIA's 8-digit domain form `00000000:19:00.0`; case-insensitive.
    fn from_str(s: &str) -> Result<PciAddress, BadPciAddress> {
        let bad = || BadPciAddress(s.to_string());
        let (domain, rest) = s.split_once(':').ok_or_else(bad)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
        let (device, function) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |t: &str, max_len: usize| {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                None
            } else {
                u32::from_str_radix(t, 16).ok()
            }
        };
        if domain.len() != 4 && domain.len() != 8 || bus.len() != 2 || device.len() != 2 {
            return Err(bad());
        }
        let domain = hex(domain, 8).ok_or_else(bad)?;
        let bus = hex(bus, 2).ok_or_else(bad)?;
        let device = hex(device, 2).filter(|d| *d < 32).ok_or_else(bad)?;
        let function = hex(function, 1).filter(|f| *f < 8).ok_or_else(bad)?;
        Ok(PciAddress {
            domain,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

impl serde::Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// Where one PCI function sits in the PCIe tree.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PciLocation {
    /// The function.
    pub address: PciAddress,
    /// Its PCIe root complex as sysfs names it (`pci0000:15`), the value of the standard
    /// `resource.kubernetes.io/pcieRoot` attribute; `None` when the device path does not
    /// show it (a function seen only under `/sys/bus/pci/devices`).
    pub pcie_root: Option<String>,
    /// The bridges from the root port down to the function's parent, root port first.
    pub bridges: Vec<PciAddress>,
    /// The function's NUMA node (`numa_node`; `-1` and a missing file read as `None`).
    pub numa_node: Option<u32>,
}

/// DRA's standard attribute of a device's PCIe root complex, valued `pci<domain>:<bus>`
/// ([`PciLocation::pcie_root`]): a claim's `matchAttribute` on it puts a GPU and an HCA
/// under one root.
pub const ATTR_PCIE_ROOT: &str = crate::core::wire::DRA_ATTR_PCIE_ROOT;
/// DRA's standard attribute of a PCI device's address, `dddd:bb:dd.f`.
pub const ATTR_PCI_BUS_ID: &str = crate::core::wire::DRA_ATTR_PCI_BUS_ID;
/// DRA's standard attribute of a device's NUMA node (Kubernetes 1.37), an integer.
pub const ATTR_NUMA_NODE: &str = crate::core::wire::DRA_ATTR_NUMA_NODE;

/// A DRA device attribute's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttributeValue {
    /// `string`.
    String(String),
    /// `int`.
    Int(i64),
}

/// Why a PCI function could not be located.
#[derive(Debug, thiserror::Error)]
pub enum PcieError {
    /// `/sys/bus/pci/devices/<addr>` does not exist under the sysfs root.
    #[error("no PCI function {address} under {}", path.display())]
    NoSuchFunction {
        /// The function looked for.
        address: PciAddress,
        /// The path looked at.
        path: PathBuf,
    },
    /// The bus id is not a PCI address.
    #[error(transparent)]
    BadAddress(#[from] BadPciAddress),
    /// The function's device path names no PCI function.
    #[error("{} does not resolve to a PCI device path", path.display())]
    NotAPciPath {
        /// The path read.
        path: PathBuf,
    },
}

impl PciLocation {
    /// The location a sysfs device path states, e.g.
    /// `devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0[/infiniband/…]`
    /// (absolute or relative, with or without a trailing class directory). The function is
    /// the last PCI address before the first component that is not one (`infiniband`,
    /// `mdev_supported_types`, …); `None` when the path holds no PCI address. The NUMA node
    /// is not in a path: it is `None` here ([`PciLocation::read`] fills it).
    pub fn from_device_path(path: &Path) -> Option<PciLocation> {
        let mut pcie_root = None;
        let mut chain: Vec<PciAddress> = Vec::new();
        for comp in path.components() {
            let Component::Normal(name) = comp else {
                continue;
            };
            let name = name.to_string_lossy();
            if let Ok(addr) = name.parse::<PciAddress>() {
                chain.push(addr);
                continue;
            }
            if !chain.is_empty() {
                break;
            }
            if is_pcie_root_name(&name) {
                pcie_root = Some(name.into_owned());
            }
        }
        let address = chain.pop()?;
        Some(PciLocation {
            address,
            pcie_root,
            bridges: chain,
            numa_node: None,
        })
    }

    /// The location of PCI function `address` under `sysfs` (`/sys`): resolves
    /// `bus/pci/devices/<addr>` and reads the function's `numa_node`.
    pub fn read(sysfs: &Path, address: PciAddress) -> Result<PciLocation, PcieError> {
        let link = sysfs.join("bus/pci/devices").join(address.to_string());
        if std::fs::symlink_metadata(&link).is_err() {
            return Err(PcieError::NoSuchFunction {
                address,
                path: link,
            });
        }
        let resolved = resolve(sysfs, &link);
        let mut loc = PciLocation::from_device_path(&resolved)
            .ok_or(PcieError::NotAPciPath { path: link.clone() })?;
        loc.numa_node = read_numa_node(&link);
        Ok(loc)
    }

    /// The location of the function with bus id `bus_id` as a GPU backend reports it
    /// (`00000000:19:00.0` from NVML or nvidia-smi, or sysfs's `0000:19:00.0`).
    pub fn of_bus_id(sysfs: &Path, bus_id: &str) -> Result<PciLocation, PcieError> {
        PciLocation::read(sysfs, bus_id.trim().parse()?)
    }

    /// The DRA attributes this place gives a device: [`ATTR_PCI_BUS_ID`], and
    /// [`ATTR_PCIE_ROOT`] / [`ATTR_NUMA_NODE`] where known.
    pub fn dra_attributes(&self) -> Vec<(&'static str, AttributeValue)> {
        let mut out = vec![(
            ATTR_PCI_BUS_ID,
            AttributeValue::String(self.address.to_string()),
        )];
        if let Some(root) = &self.pcie_root {
            out.push((ATTR_PCIE_ROOT, AttributeValue::String(root.clone())));
        }
        if let Some(n) = self.numa_node {
            out.push((ATTR_NUMA_NODE, AttributeValue::Int(i64::from(n))));
        }
        out
    }

    /// How near `other` is to this function.
    pub fn proximity(&self, other: &PciLocation) -> Proximity {
        if self.address == other.address {
            return Proximity::SameSwitch { bridges: 0 };
        }
        if self.pcie_root.is_some() && self.pcie_root == other.pcie_root {
            let common = self
                .bridges
                .iter()
                .zip(&other.bridges)
                .take_while(|(a, b)| a == b)
                .count();
            if common > 0 {
                let below = (self.bridges.len() - common) + (other.bridges.len() - common);
                return Proximity::SameSwitch {
                    bridges: u32::try_from(below).unwrap_or(u32::MAX),
                };
            }
            return Proximity::SamePcieRoot;
        }
        match (self.numa_node, other.numa_node) {
            (Some(a), Some(b)) if a == b => Proximity::SameNumaNode,
            _ => Proximity::Distant,
        }
    }
}

/// `pci0000:15`, `pci10000:00`: a root complex directory under `/sys/devices`.
fn is_pcie_root_name(name: &str) -> bool {
    name.strip_prefix("pci").is_some_and(|rest| {
        rest.split_once(':').is_some_and(|(d, b)| {
            !d.is_empty()
                && b.len() == 2
                && d.bytes().chain(b.bytes()).all(|c| c.is_ascii_hexdigit())
        })
    })
}

/// The device path `link` stands for, relative to `sysfs` where possible: the canonical path
/// when it resolves (every link on the way followed), else the link's own target joined
/// lexically (a recorded tree whose targets are missing).
pub(crate) fn resolve(sysfs: &Path, link: &Path) -> PathBuf {
    if let (Ok(full), Ok(root)) = (std::fs::canonicalize(link), std::fs::canonicalize(sysfs)) {
        return full
            .strip_prefix(&root)
            .map(Path::to_path_buf)
            .unwrap_or(full);
    }
    match std::fs::read_link(link) {
        Ok(target) => {
            let base = link.parent().unwrap_or(Path::new(""));
            normalize(&base.join(target))
        }
        Err(_) => link.to_path_buf(),
    }
}

/// `a/b/../c` as `a/c`, without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for comp in path.components() {
        match comp {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// `numa_node` of the function directory `dir` (`-1` or unreadable: `None`).
pub(crate) fn read_numa_node(dir: &Path) -> Option<u32> {
    std::fs::read_to_string(dir.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok())
}

/// How near two PCI functions are, nearest first (the order of `Ord`): behind one PCIe
/// switch (fewer bridges below the shared one first), on one root complex, on one NUMA
/// node, or none of these. `nvidia-smi topo -m` names the same steps PIX/PXB, PHB, NODE and
/// SYS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proximity {
    /// Both below one bridge under the root port (one switch, or one card's functions):
    /// `bridges` counts those between them below the deepest shared one.
    SameSwitch {
        /// Bridges between the two below their deepest shared bridge (0: functions of one
        /// device or one port).
        bridges: u32,
    },
    /// The same PCIe root complex (host bridge), different root ports.
    SamePcieRoot,
    /// Different root complexes on one NUMA node.
    SameNumaNode,
    /// Nothing shared (or not known).
    Distant,
}

impl Proximity {
    /// A short name for reports: `switch`, `pcie-root`, `numa-node`, `none`.
    pub fn name(self) -> &'static str {
        match self {
            Proximity::SameSwitch { .. } => "switch",
            Proximity::SamePcieRoot => "pcie-root",
            Proximity::SameNumaNode => "numa-node",
            Proximity::Distant => "none",
        }
    }
}

/// The candidates nearest to a device: every candidate that shares the best [`Proximity`]
/// found, in the caller's order. `None` when no candidate is nearer than
/// [`Proximity::Distant`] (no pairing: the caller picks by its own rule).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nearest<K> {
    /// How near they are.
    pub proximity: Proximity,
    /// The candidates at that proximity.
    pub keys: Vec<K>,
}

/// The nearest of `candidates` (key, proximity to the device in question).
pub fn nearest<K>(candidates: impl IntoIterator<Item = (K, Proximity)>) -> Option<Nearest<K>> {
    let mut best: Option<Nearest<K>> = None;
    for (key, p) in candidates {
        if p == Proximity::Distant {
            continue;
        }
        match best.as_mut().map(|b| p.cmp(&b.proximity)) {
            None | Some(Ordering::Less) => {
                best = Some(Nearest {
                    proximity: p,
                    keys: vec![key],
                })
            }
            Some(Ordering::Equal) => {
                if let Some(b) = best.as_mut() {
                    b.keys.push(key);
                }
            }
            Some(Ordering::Greater) => {}
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> PciAddress {
        s.parse().expect("address")
    }

    #[test]
    fn addresses_parse_in_both_domain_widths_and_print_in_sysfs_form() {
        assert_eq!(addr("0000:19:00.0").to_string(), "0000:19:00.0");
        assert_eq!(addr("00000000:1A:00.1").to_string(), "0000:1a:00.1");
        for bad in [
            "",
            "19:00.0",
            "0000:19:00",
            "0000:19:20.0",
            "0000:19:00.8",
            "000:19:00.0",
            "0000:1g:00.0",
            "pci0000:15",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn a_device_path_gives_root_bridges_and_function() {
        let p = Path::new("devices/pci0000:80/0000:80:02.2/0000:82:00.0/infiniband/mlx4_0");
        let loc = PciLocation::from_device_path(p).expect("location");
        assert_eq!(loc.address, addr("0000:82:00.0"));
        assert_eq!(loc.pcie_root.as_deref(), Some("pci0000:80"));
        assert_eq!(loc.bridges, vec![addr("0000:80:02.2")]);
        assert!(
            PciLocation::from_device_path(Path::new("devices/scif_dma_0/infiniband/scif0"))
                .is_none()
        );
    }

    #[test]
    fn proximity_orders_switch_root_numa_none() {
        let at = |p: &str, numa| {
            let mut l = PciLocation::from_device_path(Path::new(p)).expect("loc");
            l.numa_node = numa;
            l
        };
        let gpu = at(
            "devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0",
            Some(0),
        );
        let nic = at(
            "devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:02.0/0000:1a:00.0",
            Some(0),
        );
        let other_port = at("devices/pci0000:15/0000:15:02.0/0000:20:00.0", Some(0));
        let other_root = at("devices/pci0000:37/0000:37:01.0/0000:3c:00.0", Some(0));
        let other_numa = at("devices/pci0000:97/0000:97:01.0/0000:9c:00.0", Some(1));
        assert_eq!(gpu.proximity(&nic), Proximity::SameSwitch { bridges: 2 });
        assert_eq!(gpu.proximity(&other_port), Proximity::SamePcieRoot);
        assert_eq!(gpu.proximity(&other_root), Proximity::SameNumaNode);
        assert_eq!(gpu.proximity(&other_numa), Proximity::Distant);
        assert!(Proximity::SameSwitch { bridges: 9 } < Proximity::SamePcieRoot);
        let n = nearest([
            ("far", Proximity::Distant),
            ("a", Proximity::SameNumaNode),
            ("b", Proximity::SameNumaNode),
        ]);
        assert_eq!(n.map(|n| n.keys), Some(vec!["a", "b"]));
        assert_eq!(nearest([("far", Proximity::Distant)]), None);
    }

    proptest::proptest! {
        #[test]
        fn addresses_round_trip_and_paths_never_panic(
            domain in 0u32..=0xffff, bus: u8, device in 0u8..32, function in 0u8..8,
            junk in "[a-z0-9:./]{0,40}",
        ) {
            let a = PciAddress { domain, bus, device, function };
            proptest::prop_assert_eq!(a.to_string().parse::<PciAddress>(), Ok(a));
            let _ = PciLocation::from_device_path(Path::new(&junk));
            let _ = junk.parse::<PciAddress>();
        }
    }
}
