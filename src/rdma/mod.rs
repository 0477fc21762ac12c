//! RDMA HCAs as the kernel shows them: discovery from `/sys/class/infiniband/*` under a
//! sysfs root and the verbs character devices under a `/dev` root ([`discover`]), the
//! configuration of the RDMA device kind ([`RdmaConfig`]), and the HCAs nearest a GPU
//! ([`preferred_for`]).
//!
//! Each HCA is read for its PCI place ([`crate::pcie`]: PCIe root, bridges, NUMA node), its
//! ports (state, physical state, link layer, rate), node GUID, firmware and type, and its
//! `uverbs` / `umad` character devices (from `class/infiniband_verbs`, `class/infiniband_mad`
//! and the PCI function's own directories), each checked present under the dev root, plus
//! the shared `rdma_cm`. A value sysfs does not hold reads as `None` / `Unknown`: RDMA devices
//! that are not PCI functions (Xeon Phi `scif0`), sub-functions and trees copied without
//! their links are all reported, never refused.
//!
//! It does not open the devices, run verbs, register a device plugin or publish DRA devices:
//! the node agent and the DRA plugin build on what it reports; the hand-over of an HCA to a
//! container is [`crate::devices::handover`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::pcie::{self, PciAddress, PciLocation, Proximity};

/// Where the host's sysfs and `/dev` are read (`--sysfs-root` / `--dev-root`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Roots {
    /// The host's `/sys`.
    pub sysfs: PathBuf,
    /// The host's `/dev`.
    pub dev: PathBuf,
}

impl Default for Roots {
    fn default() -> Roots {
        Roots {
            sysfs: PathBuf::from("/sys"),
            dev: PathBuf::from("/dev"),
        }
    }
}

impl Roots {
    /// `<root>/sys` and `<root>/dev` (a host mounted at `root`, or a recorded tree).
    pub fn under(root: &Path) -> Roots {
        Roots {
            sysfs: root.join("sys"),
            dev: root.join("dev"),
        }
    }
}

/// The host path of `/dev/infiniband/<name>` (what a container is handed, whatever the dev
/// root this process reads).
pub fn dev_path(name: &str) -> String {
    format!("/dev/infiniband/{name}")
}

pub use crate::config::devices::{DEFAULT_RESOURCE, MAX_SHARES, RdmaConfig, RdmaConfigError};

/// The logical state of a port (`ports/N/state`, `4: ACTIVE`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PortState {
    /// 1: DOWN.
    Down,
    /// 2: INIT (link up, no subnet manager has configured it yet).
    Init,
    /// 3: ARMED.
    Armed,
    /// 4: ACTIVE.
    Active,
    /// 5: ACTIVE_DEFER.
    ActiveDefer,
    /// Missing, or a value this reader does not know (kept as read).
    Unknown(String),
}

impl PortState {
    fn parse(s: &str) -> PortState {
        match s.split(':').next().map(str::trim) {
            Some("1") => PortState::Down,
            Some("2") => PortState::Init,
            Some("3") => PortState::Armed,
            Some("4") => PortState::Active,
            Some("5") => PortState::ActiveDefer,
            _ => PortState::Unknown(s.to_string()),
        }
    }
}

/// The link layer of a port (`ports/N/link_layer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE).
    Ethernet,
    /// Missing or unknown.
    Unknown,
}

/// One port of an HCA.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Port {
    /// Port number (from 1).
    pub number: u32,
    /// Logical state.
    pub state: PortState,
    /// Physical state as the kernel names it (`LinkUp`, `Disabled`, `Polling`, …).
    pub phys_state: Option<String>,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Rate in Mb/s (`56 Gb/sec (4X FDR)` reads 56000; `2.5 Gb/sec` 2500).
    pub rate_mbps: Option<u64>,
}

impl Port {
    /// Whether the port can carry traffic now.
    pub fn active(&self) -> bool {
        matches!(self.state, PortState::Active | PortState::ActiveDefer)
    }
}

/// A verbs or MAD character device of an HCA.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CharDevice {
    /// Its name (`uverbs0`, `umad1`).
    pub name: String,
    /// The port it serves (`umad`; `None` for `uverbs`).
    pub port: Option<u32>,
    /// `major:minor` as sysfs states it.
    pub dev: Option<String>,
    /// Whether `/dev/infiniband/<name>` exists under the dev root.
    pub present: bool,
}

impl CharDevice {
    /// Its host path, `/dev/infiniband/<name>`.
    pub fn host_path(&self) -> String {
        dev_path(&self.name)
    }
}

/// One RDMA device (`/sys/class/infiniband/<name>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Hca {
    /// Its name (`mlx5_0`, `mlx5_bond_0`, `qib0`).
    pub name: String,
    /// Where its PCI function sits; `None` for a device that is not a PCI function or a tree
    /// without the class link.
    pub pci: Option<PciLocation>,
    /// `node_guid` (`a088:c203:00e3:142a`).
    pub node_guid: Option<String>,
    /// `fw_ver`.
    pub firmware: Option<String>,
    /// `hca_type` (`MT4129`).
    pub hca_type: Option<String>,
    /// `board_id`.
    pub board_id: Option<String>,
    /// Its ports, by number.
    pub ports: Vec<Port>,
    /// Its verbs device.
    pub uverbs: Option<CharDevice>,
    /// Its MAD devices, by port.
    pub umad: Vec<CharDevice>,
}

impl Hca {
    /// Whether any port is ACTIVE.
    pub fn any_port_active(&self) -> bool {
        self.ports.iter().any(Port::active)
    }

    /// The fastest ACTIVE port's rate in Mb/s (0 when none is known).
    pub fn best_active_rate_mbps(&self) -> u64 {
        self.ports
            .iter()
            .filter(|p| p.active())
            .filter_map(|p| p.rate_mbps)
            .max()
            .unwrap_or(0)
    }
}

/// What discovery found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Inventory {
    /// The HCAs, by name (numeric order: `mlx5_2` before `mlx5_10`).
    pub hcas: Vec<Hca>,
    /// Whether `/dev/infiniband/rdma_cm` exists under the dev root.
    pub rdma_cm: bool,
}

impl Inventory {
    /// The HCA named `name`.
    pub fn get(&self, name: &str) -> Option<&Hca> {
        self.hcas.iter().find(|h| h.name == name)
    }
}

/// Why discovery could not run at all (a single device's odd values never fail it).
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// `class/infiniband` is missing: no RDMA driver loaded (or sysfs not mounted there).
    #[error("{} does not exist: no RDMA device driver is loaded (or the sysfs root is wrong)", path.display())]
    NoRdmaClass {
        /// The directory looked for.
        path: PathBuf,
    },
    /// `class/infiniband` could not be listed.
    #[error("cannot list {}: {source}", path.display())]
    List {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Discovers the HCAs under `roots`.
pub fn discover(roots: &Roots) -> Result<Inventory, RdmaError> {
    let class = roots.sysfs.join("class/infiniband");
    if !class.is_dir() {
        return Err(RdmaError::NoRdmaClass { path: class });
    }
    let entries = std::fs::read_dir(&class).map_err(|source| RdmaError::List {
        path: class.clone(),
        source,
    })?;
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort_by_key(|a| natural_key(a));
    let verbs = char_devices(roots, "infiniband_verbs", "uverbs");
    let mad = char_devices(roots, "infiniband_mad", "umad");
    let hcas = names
        .into_iter()
        .map(|name| read_hca(roots, &class, name, &verbs, &mad))
        .collect();
    Ok(Inventory {
        hcas,
        rdma_cm: roots.dev.join("infiniband/rdma_cm").exists(),
    })
}

/// `mlx5_10` sorts after `mlx5_2`: runs of digits compare as numbers.
fn natural_key(s: &str) -> Vec<(u8, u64, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 {
            let (d, r) = rest.split_at(digits);
            out.push((1, d.parse().unwrap_or(u64::MAX), String::new()));
            rest = r;
        } else {
            let text = rest.bytes().take_while(|b| !b.is_ascii_digit()).count();
            let (t, r) = rest.split_at(text);
            out.push((0, 0, t.to_string()));
            rest = r;
        }
    }
    out
}

/// A character device sysfs lists, before it is tied to its HCA.
#[derive(Clone, Debug)]
struct ListedCharDevice {
    ibdev: String,
    device: CharDevice,
}

/// The `prefix*` entries of `class/<class>` (their `ibdev`, `port`, `dev` files).
fn char_devices(roots: &Roots, class: &str, prefix: &str) -> Vec<ListedCharDevice> {
    list_char_dir(roots, &roots.sysfs.join("class").join(class), prefix)
}

fn list_char_dir(roots: &Roots, dir: &Path, prefix: &str) -> Vec<ListedCharDevice> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with(prefix) {
            continue;
        }
        let path = dir.join(&name);
        let Some(ibdev) = read_value(&path.join("ibdev")) else {
            continue;
        };
        let present = roots.dev.join("infiniband").join(&name).exists();
        out.push(ListedCharDevice {
            ibdev,
            device: CharDevice {
                port: read_value(&path.join("port")).and_then(|p| p.parse().ok()),
                dev: read_value(&path.join("dev")),
                name,
                present,
            },
        });
    }
    out
}

/// One sysfs value, trimmed; `None` when missing, unreadable or empty.
fn read_value(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn read_hca(
    roots: &Roots,
    class: &Path,
    name: String,
    verbs: &[ListedCharDevice],
    mad: &[ListedCharDevice],
) -> Hca {
    let dir = class.join(&name);
    let resolved = pcie::resolve(&roots.sysfs, &dir);
    let pci = PciLocation::from_device_path(&resolved).map(|mut loc| {
        loc.numa_node = read_numa_node_of(&roots.sysfs, &resolved, loc.address);
        loc
    });
    // The PCI function's own verbs / MAD directories (trees without the class links).
    let function_dir = dir.join("device");
    let local_verbs = list_char_dir(roots, &function_dir.join("infiniband_verbs"), "uverbs");
    let local_mad = list_char_dir(roots, &function_dir.join("infiniband_mad"), "umad");
    let mine = |all: &[ListedCharDevice], local: &[ListedCharDevice]| {
        let mut found: BTreeMap<String, CharDevice> = BTreeMap::new();
        for c in all.iter().chain(local) {
            if c.ibdev == name {
                found
                    .entry(c.device.name.clone())
                    .or_insert(c.device.clone());
            }
        }
        let mut v: Vec<CharDevice> = found.into_values().collect();
        v.sort_by_key(|a| natural_key(&a.name));
        v
    };
    let mut umad = mine(mad, &local_mad);
    umad.sort_by_key(|c| c.port);
    Hca {
        uverbs: mine(verbs, &local_verbs).into_iter().next(),
        umad,
        ports: read_ports(&dir.join("ports")),
        node_guid: read_value(&dir.join("node_guid")),
        firmware: read_value(&dir.join("fw_ver")),
        hca_type: read_value(&dir.join("hca_type")),
        board_id: read_value(&dir.join("board_id")),
        pci,
        name,
    }
}

/// `numa_node` of the function at `address` on `resolved` (the HCA's device path): the
/// function directory is the path up to that address.
fn read_numa_node_of(sysfs: &Path, resolved: &Path, address: PciAddress) -> Option<u32> {
    let wanted = address.to_string();
    let mut dir = PathBuf::new();
    for comp in resolved.components() {
        dir.push(comp);
        if comp.as_os_str() == wanted.as_str() {
            let full = if dir.is_absolute() {
                dir.clone()
            } else {
                sysfs.join(&dir)
            };
            return pcie::read_numa_node(&full);
        }
    }
    None
}

fn read_ports(dir: &Path) -> Vec<Port> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut ports: Vec<Port> = entries
        .flatten()
        .filter_map(|e| {
            let number: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let p = e.path();
            Some(Port {
                number,
                state: read_value(&p.join("state"))
                    .map(|s| PortState::parse(&s))
                    .unwrap_or(PortState::Unknown(String::new())),
                phys_state: read_value(&p.join("phys_state")).map(|s| match s.split_once(':') {
                    Some((_, name)) => name.trim().to_string(),
                    None => s,
                }),
                link_layer: match read_value(&p.join("link_layer")).as_deref() {
                    Some("InfiniBand") => LinkLayer::InfiniBand,
                    Some("Ethernet") => LinkLayer::Ethernet,
                    _ => LinkLayer::Unknown,
                },
                rate_mbps: read_value(&p.join("rate")).and_then(|r| parse_rate_mbps(&r)),
            })
        })
        .collect();
    ports.sort_by_key(|p| p.number);
    ports
}

/// `56 Gb/sec (4X FDR)` as 56000, `2.5 Gb/sec (1X SDR)` as 2500.
fn parse_rate_mbps(rate: &str) -> Option<u64> {
    let number = rate.split_whitespace().next()?;
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let whole: u64 = whole.parse().ok()?;
    let tenths: u64 = match frac {
        "" => 0,
        f => f.get(..1)?.parse().ok()?,
    };
    whole.checked_mul(1000)?.checked_add(tenths * 100)
}

/// Why an HCA discovery found is not offered to pods.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(rename_all = "kebab-case", tag = "reason")]
pub enum NotOffered {
    /// No `uverbs` device in sysfs: verbs cannot reach it (`ib_uverbs` not loaded for it, or
    /// not an RDMA device user space can use).
    #[error("no uverbs device (is ib_uverbs loaded?)")]
    NoVerbsDevice,
    /// Its `uverbs` node is missing under the dev root.
    #[error("{path} does not exist")]
    VerbsNodeMissing {
        /// The missing node.
        path: String,
    },
    /// No port is ACTIVE (with `require_active_port`).
    #[error("no port is ACTIVE")]
    NoActivePort,
}

/// The HCAs the RDMA kind offers under `config`, and those it leaves out with the reason.
pub fn offer<'a>(
    inventory: &'a Inventory,
    config: &RdmaConfig,
) -> (Vec<&'a Hca>, Vec<(&'a Hca, NotOffered)>) {
    let mut offered = Vec::new();
    let mut left_out = Vec::new();
    for h in &inventory.hcas {
        let reason = match &h.uverbs {
            None => Some(NotOffered::NoVerbsDevice),
            Some(u) if !u.present => Some(NotOffered::VerbsNodeMissing {
                path: u.host_path(),
            }),
            Some(_) if config.require_active_port && !h.any_port_active() => {
                Some(NotOffered::NoActivePort)
            }
            Some(_) => None,
        };
        match reason {
            Some(r) => left_out.push((h, r)),
            None => offered.push(h),
        }
    }
    (offered, left_out)
}

/// The HCAs for a pod whose GPU sits at `gpu`, best first: nearest by [`Proximity`], then
/// an ACTIVE port before none, then the faster port, then the name. HCAs without a PCI
/// place come last (as [`Proximity::Distant`]). The caller filters out what is not free.
pub fn preferred_for<'a>(
    gpu: &PciLocation,
    hcas: impl IntoIterator<Item = &'a Hca>,
) -> Vec<(&'a Hca, Proximity)> {
    let mut ranked: Vec<(&Hca, Proximity)> = hcas
        .into_iter()
        .map(|h| {
            let p = h
                .pci
                .as_ref()
                .map(|loc| gpu.proximity(loc))
                .unwrap_or(Proximity::Distant);
            (h, p)
        })
        .collect();
    ranked.sort_by(|(a, pa), (b, pb)| {
        pa.cmp(pb)
            .then(b.any_port_active().cmp(&a.any_port_active()))
            .then(b.best_active_rate_mbps().cmp(&a.best_active_rate_mbps()))
            .then(natural_key(&a.name).cmp(&natural_key(&b.name)))
    });
    ranked
}

/// The share ids to prefer for a container asking `size` shares of the RDMA resource
/// (GetPreferredAllocation): `must_include` first, then the free shares (`available`) of the
/// HCAs [`preferred_for`] ranks best for the pod's GPU at `gpu`, one share per HCA before a
/// second share of any; without a GPU place (a pod without a gpushare GPU, a GPU sysfs does
/// not show), HCAs by ACTIVE port, rate and name.
///
/// When no HCA near the GPU has a free share, the nearest HCA that has one is preferred (same
/// NUMA node, then any): the preference is advice to kubelet, so it never refuses; the
/// `Proximity` of each pick is returned for the caller to log or expose. Ids that name no
/// HCA of `inventory` are never returned unless the kubelet listed them in `must_include`.
pub fn preferred_allocation(
    inventory: &Inventory,
    gpu: Option<&PciLocation>,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<(String, Proximity)> {
    let ranked: Vec<(&Hca, Proximity)> = match gpu {
        Some(loc) => preferred_for(loc, &inventory.hcas),
        None => {
            let mut v: Vec<(&Hca, Proximity)> = inventory
                .hcas
                .iter()
                .map(|h| (h, Proximity::Distant))
                .collect();
            v.sort_by(|(a, _), (b, _)| {
                b.any_port_active()
                    .cmp(&a.any_port_active())
                    .then(b.best_active_rate_mbps().cmp(&a.best_active_rate_mbps()))
                    .then(natural_key(&a.name).cmp(&natural_key(&b.name)))
            });
            v
        }
    };
    let rank_of = |id: &str| {
        let name = crate::core::wire::parse_fake_device_id(id).map_or(id, |(n, _)| n);
        ranked
            .iter()
            .position(|(h, _)| h.name == name)
            .map(|i| (i, ranked[i].1))
    };
    let mut out: Vec<(String, Proximity)> = Vec::new();
    let mut used_hcas = std::collections::BTreeSet::new();
    for id in must_include {
        let (rank, p) = rank_of(id).unwrap_or((usize::MAX, Proximity::Distant));
        used_hcas.insert(rank);
        out.push((id.clone(), p));
    }
    let mut free: Vec<(usize, Proximity, &String)> = available
        .iter()
        .filter(|id| !must_include.contains(id))
        .filter_map(|id| rank_of(id).map(|(r, p)| (r, p, id)))
        .collect();
    free.sort_by(|a, b| a.0.cmp(&b.0).then(natural_key(a.2).cmp(&natural_key(b.2))));
    // First pass: one share per HCA not used yet; second pass: any.
    let mut taken = std::collections::BTreeSet::new();
    for pass in 0..2 {
        for (i, (rank, p, id)) in free.iter().enumerate() {
            if out.len() >= size {
                return out;
            }
            if taken.contains(&i) || (pass == 0 && used_hcas.contains(rank)) {
                continue;
            }
            taken.insert(i);
            used_hcas.insert(*rank);
            out.push(((*id).clone(), *p));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_states_and_names_parse() {
        assert_eq!(parse_rate_mbps("56 Gb/sec (4X FDR)"), Some(56_000));
        assert_eq!(parse_rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(parse_rate_mbps("fast"), None);
        assert_eq!(parse_rate_mbps("99999999999999999999 Gb/sec"), None);
        assert_eq!(parse_rate_mbps("18446744073709552 Gb/sec"), None);
        assert_eq!(PortState::parse("4: ACTIVE"), PortState::Active);
        assert_eq!(PortState::parse("1: DOWN"), PortState::Down);
        assert_eq!(
            PortState::parse("9: NEW"),
            PortState::Unknown("9: NEW".into())
        );
        let mut v = vec!["mlx5_10", "mlx5_2", "mlx5_bond_0", "mlx5_1"];
        v.sort_by_key(|a| natural_key(a));
        assert_eq!(v, ["mlx5_1", "mlx5_2", "mlx5_10", "mlx5_bond_0"]);
    }

    #[test]
    fn config_is_checked() {
        assert_eq!(RdmaConfig::default().validate(), Ok(()));
        let zero = RdmaConfig {
            shares_per_hca: 0,
            ..RdmaConfig::default()
        };
        assert_eq!(zero.validate(), Err(RdmaConfigError::ZeroShares));
        let bad = RdmaConfig {
            resource: "rdma".into(),
            ..RdmaConfig::default()
        };
        assert!(matches!(bad.validate(), Err(RdmaConfigError::Resource(_))));
    }
}
