//! `gpushare doctor --rdma`: the RDMA stack a pod needs on this node — HCAs in sysfs
//! (`rdma-devices`), the `ib_uverbs` and `rdma_ucm` modules loaded (`rdma-modules`), each
//! HCA's `uverbs` node and the shared `rdma_cm` under `/dev/infiniband` (`rdma-char-devices`),
//! and ports ACTIVE (`rdma-ports`), each with a fix hint.
//!
//! It reads the sysfs and dev roots ([`crate::rdma::discover`]) and `/proc/modules` under
//! `--root` (falling back to `/sys/module/<name>` for built-in modules); it opens no device
//! and loads nothing.

use std::path::Path;

use super::report::{Check, Status};
use crate::rdma::{self, Hca, Inventory, PortState, RdmaError, Roots};

/// Flags of the RDMA checks.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RdmaArgs {
    /// Check the RDMA stack (HCAs, ib_uverbs and rdma_ucm, /dev/infiniband, ports)
    #[arg(long)]
    pub rdma: bool,
    /// Where the host's sysfs and /dev are read.
    #[command(flatten)]
    pub roots: crate::devices::RootArgs,
}

impl RdmaArgs {
    /// The roots the checks read, `root` being `--root`.
    pub fn roots(&self, root: &Path) -> Roots {
        let under = Roots::under(root);
        Roots {
            sysfs: self.roots.sysfs_root.clone().unwrap_or(under.sysfs),
            dev: self.roots.dev_root.clone().unwrap_or(under.dev),
        }
    }
}

/// Kernel modules a pod's RDMA traffic needs: verbs from user space, and the RDMA
/// connection manager's user-space device.
pub const REQUIRED_MODULES: &[&str] = &["ib_uverbs", "rdma_ucm"];

/// The RDMA checks over `roots`, with `/proc/modules` read from `proc_modules`.
pub fn checks(roots: &Roots, proc_modules: &Path) -> Vec<Check> {
    let found = rdma::discover(roots);
    let mut out = vec![devices(&found), modules(roots, proc_modules)];
    match &found {
        Ok(inv) if !inv.hcas.is_empty() => {
            out.push(char_devices(inv));
            out.push(ports(inv));
        }
        _ => {
            for (id, title) in [(CHAR_DEVICES, CHAR_DEVICES_TITLE), (PORTS, PORTS_TITLE)] {
                out.push(Check::new(
                    id,
                    title,
                    Status::Skip,
                    "no RDMA device to check",
                ));
            }
        }
    }
    out
}

const CHAR_DEVICES: &str = "rdma-char-devices";
const CHAR_DEVICES_TITLE: &str = "verbs character devices under /dev/infiniband";
const PORTS: &str = "rdma-ports";
const PORTS_TITLE: &str = "RDMA ports ACTIVE";

fn describe(h: &Hca) -> String {
    let mut parts = vec![h.name.clone()];
    match &h.pci {
        Some(loc) => {
            parts.push(loc.address.to_string());
            if let Some(root) = &loc.pcie_root {
                parts.push(root.clone());
            }
            if let Some(n) = loc.numa_node {
                parts.push(format!("numa {n}"));
            }
        }
        None => parts.push("no PCI place in sysfs".to_string()),
    }
    if let Some(t) = &h.hca_type {
        parts.push(t.clone());
    }
    if let Some(fw) = &h.firmware {
        parts.push(format!("fw {fw}"));
    }
    for p in &h.ports {
        let rate = p
            .rate_mbps
            .map(|r| format!(" {} Gb/s", r as f64 / 1000.0))
            .unwrap_or_default();
        let layer = match p.link_layer {
            rdma::LinkLayer::InfiniBand => "InfiniBand",
            rdma::LinkLayer::Ethernet => "Ethernet",
            rdma::LinkLayer::Unknown => "link layer unknown",
        };
        parts.push(format!(
            "port {} {} {layer}{rate}",
            p.number,
            state_name(&p.state)
        ));
    }
    if let Some(u) = &h.uverbs {
        parts.push(u.name.clone());
    }
    parts.join("  ")
}

fn state_name(s: &PortState) -> String {
    match s {
        PortState::Down => "DOWN".into(),
        PortState::Init => "INIT".into(),
        PortState::Armed => "ARMED".into(),
        PortState::Active => "ACTIVE".into(),
        PortState::ActiveDefer => "ACTIVE_DEFER".into(),
        PortState::Unknown(v) if v.is_empty() => "state unknown".into(),
        PortState::Unknown(v) => v.clone(),
    }
}

/// `rdma-devices`: the HCAs sysfs shows.
fn devices(found: &Result<Inventory, RdmaError>) -> Check {
    const ID: &str = "rdma-devices";
    const TITLE: &str = "RDMA devices in sysfs";
    match found {
        Err(e) => Check::new(ID, TITLE, Status::Fail, e.to_string()).hint(
            "load the HCA's driver (mlx5_core and mlx5_ib for ConnectX, or the vendor's), or point\n\
             --sysfs-root at the host's /sys when doctor runs in a container",
        ),
        Ok(inv) if inv.hcas.is_empty() => Check::new(
            ID,
            TITLE,
            Status::Fail,
            "class/infiniband is empty: no RDMA device",
        )
        .hint("load the HCA's RDMA driver (e.g. modprobe mlx5_ib) and check `ibv_devices`"),
        Ok(inv) => Check::new(
            ID,
            TITLE,
            Status::Ok,
            inv.hcas.iter().map(describe).collect::<Vec<_>>().join("\n"),
        ),
    }
}

/// The module names `/proc/modules` lists.
fn loaded_modules(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}

/// `rdma-modules`: `ib_uverbs` and `rdma_ucm` loaded (or built in).
fn modules(roots: &Roots, proc_modules: &Path) -> Check {
    const ID: &str = "rdma-modules";
    const TITLE: &str = "ib_uverbs and rdma_ucm loaded";
    let text = std::fs::read_to_string(proc_modules).ok();
    let loaded = text.as_deref().map(loaded_modules).unwrap_or_default();
    let missing: Vec<&str> = REQUIRED_MODULES
        .iter()
        .copied()
        .filter(|m| !loaded.contains(m) && !roots.sysfs.join("module").join(m).is_dir())
        .collect();
    if missing.is_empty() {
        return Check::new(
            ID,
            TITLE,
            Status::Ok,
            REQUIRED_MODULES.join(", ") + " loaded",
        );
    }
    let status = if text.is_none() {
        Status::Warn
    } else {
        Status::Fail
    };
    let mut detail = format!("not loaded: {}", missing.join(", "));
    if text.is_none() {
        detail.push_str(" (/proc/modules could not be read)");
    }
    Check::new(ID, TITLE, status, detail).hint(format!(
        "modprobe {m}; to load them at boot: printf '%s\\n' {m} > /etc/modules-load.d/rdma.conf",
        m = missing.join(" ")
    ))
}

/// `rdma-char-devices`: each HCA's `uverbs` node, and `rdma_cm`.
fn char_devices(inv: &Inventory) -> Check {
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for h in &inv.hcas {
        match &h.uverbs {
            None => bad.push(format!("{}: no uverbs device in sysfs", h.name)),
            Some(u) if !u.present => bad.push(format!("{}: {} missing", h.name, u.host_path())),
            Some(u) => ok.push(format!("{}: {}", h.name, u.host_path())),
        }
    }
    let mut lines = bad.clone();
    lines.extend(ok.iter().cloned());
    if inv.rdma_cm {
        lines.push("/dev/infiniband/rdma_cm present".to_string());
    } else {
        lines.push("/dev/infiniband/rdma_cm missing".to_string());
    }
    let status = if ok.is_empty() {
        Status::Fail
    } else if !bad.is_empty() || !inv.rdma_cm {
        Status::Warn
    } else {
        Status::Ok
    };
    let check = Check::new(CHAR_DEVICES, CHAR_DEVICES_TITLE, status, lines.join("\n"));
    if status == Status::Ok {
        return check;
    }
    check.hint(
        "modprobe ib_uverbs (uverbsN) and rdma_ucm (rdma_cm); in a container, mount the host's\n\
         /dev/infiniband (and pass --dev-root); an HCA without a uverbs device is not usable for verbs",
    )
}

/// `rdma-ports`: ports ACTIVE.
fn ports(inv: &Inventory) -> Check {
    let mut down = Vec::new();
    let mut active = 0;
    for h in &inv.hcas {
        if h.ports.is_empty() {
            down.push(format!("{}: no port state in sysfs", h.name));
        }
        for p in &h.ports {
            if p.active() {
                active += 1;
            } else {
                let phys = p
                    .phys_state
                    .as_deref()
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default();
                down.push(format!(
                    "{} port {}: {}{phys}",
                    h.name,
                    p.number,
                    state_name(&p.state)
                ));
            }
        }
    }
    let status = if active == 0 {
        Status::Fail
    } else if down.is_empty() {
        Status::Ok
    } else {
        Status::Warn
    };
    let mut lines = down;
    lines.push(format!("{active} port(s) ACTIVE"));
    let check = Check::new(PORTS, PORTS_TITLE, status, lines.join("\n"));
    if status == Status::Ok {
        return check;
    }
    check.hint(
        "DOWN / Disabled: check the cable and the switch port (ibstat); INIT on InfiniBand: no subnet\n\
         manager has configured the port (run opensm or check the fabric's); Ethernet (RoCE): bring the\n\
         netdev up (ip link set <dev> up)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_modules_names_are_the_first_field() {
        let text = "rdma_ucm 28672 0 - Live 0x0\nib_uverbs 163840 2 rdma_ucm, Live 0x0\n";
        assert_eq!(loaded_modules(text), ["rdma_ucm", "ib_uverbs"]);
    }
}
