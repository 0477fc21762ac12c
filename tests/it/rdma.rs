//! RDMA HCA discovery and PCIe placement over the recorded trees of `tests/fixtures/rdma/`
//! (each built from real captures, see its PROVENANCE): every tree read with the values its
//! captures state; the PCIe root and switch chain of real device paths; GPU–HCA pairing over
//! the HGX H100 tree (8 GPUs × 12 RDMA devices) and over every `nvidia-smi topo -m` capture
//! of `tests/fixtures/realdata/rdma/topo/`, against the pairing its INDEX states.

use std::collections::BTreeMap;
use std::path::Path;

use gpushare::pcie::{self, PciAddress, PciLocation, Proximity};
use gpushare::rdma::{self, Hca, Inventory, LinkLayer, PortState, Roots};

use crate::support::fixture;

fn tree(name: &str) -> Inventory {
    let roots = Roots::under(&fixture(&format!("rdma/{name}")));
    rdma::discover(&roots).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn hca<'a>(inv: &'a Inventory, name: &str) -> &'a Hca {
    inv.get(name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", names(inv)))
}

fn names(inv: &Inventory) -> Vec<&str> {
    inv.hcas.iter().map(|h| h.name.as_str()).collect()
}

fn addr(s: &str) -> PciAddress {
    s.parse().expect("address")
}

fn addrs(list: &[&str]) -> Vec<PciAddress> {
    list.iter().map(|s| addr(s)).collect()
}

// ------------------------------------------------------------------ discovery, tree by tree

#[test]
fn single_hca_mlx4_reads_as_its_capture_states() {
    let inv = tree("single-hca-mlx4");
    assert_eq!(names(&inv), ["mlx4_0", "scif0"]);
    let h = hca(&inv, "mlx4_0");
    let pci = h.pci.as_ref().expect("PCI place");
    assert_eq!(pci.address, addr("0000:82:00.0"));
    assert_eq!(pci.pcie_root.as_deref(), Some("pci0000:80"));
    assert_eq!(pci.bridges, addrs(&["0000:80:02.2"]));
    assert_eq!(pci.numa_node, Some(1));
    assert_eq!(h.node_guid.as_deref(), Some("0002:c903:00f9:bfa0"));
    assert_eq!(h.firmware.as_deref(), Some("2.11.500"));
    assert_eq!(h.hca_type.as_deref(), Some("MT4099"));
    assert_eq!(h.board_id.as_deref(), Some("DEL0A30000019"));
    assert_eq!(h.ports.len(), 1);
    let p = &h.ports[0];
    assert_eq!(
        (
            p.number,
            &p.state,
            p.phys_state.as_deref(),
            p.link_layer,
            p.rate_mbps
        ),
        (
            1,
            &PortState::Active,
            Some("LinkUp"),
            LinkLayer::InfiniBand,
            Some(56_000)
        )
    );
    let uverbs = h.uverbs.as_ref().expect("uverbs");
    assert_eq!(
        (uverbs.name.as_str(), uverbs.dev.as_deref(), uverbs.present),
        ("uverbs0", Some("231:192"), true)
    );
    assert_eq!(uverbs.host_path(), "/dev/infiniband/uverbs0");
    let umad: Vec<_> = h.umad.iter().map(|u| (u.name.as_str(), u.port)).collect();
    assert_eq!(umad, [("umad0", Some(1))]);
    assert!(inv.rdma_cm);
    // The Xeon Phi SCIF device is not a PCI function: reported, without a place or ports.
    let scif = hca(&inv, "scif0");
    assert_eq!(
        (scif.pci.as_ref(), scif.ports.len(), scif.uverbs.as_ref()),
        (None, 0, None)
    );
}

#[test]
fn qlogic_qib_reads_as_its_capture_states() {
    let inv = tree("qlogic-qib");
    assert_eq!(names(&inv), ["qib0"]);
    let h = hca(&inv, "qib0");
    let pci = h.pci.as_ref().expect("PCI place");
    assert_eq!(pci.address, addr("0000:43:00.0"));
    assert_eq!(pci.pcie_root.as_deref(), Some("pci0000:40"));
    assert_eq!(pci.numa_node, Some(2));
    assert_eq!(h.hca_type.as_deref(), Some("InfiniPath_QLE7340"));
    assert_eq!(h.node_guid.as_deref(), Some("0011:7500:0077:cfc8"));
    assert_eq!(h.firmware, None, "qib has no fw_ver");
    assert_eq!(h.ports[0].rate_mbps, Some(40_000));
    assert!(h.ports[0].active());
    assert_eq!(h.uverbs.as_ref().map(|u| u.name.as_str()), Some("uverbs0"));
}

#[test]
fn hgx_h100_tree_reads_twelve_roce_devices_with_their_places() {
    let inv = tree("hgx-h100-8gpu-roce");
    assert_eq!(
        names(&inv),
        [
            "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
            "mlx5_8", "mlx5_9", "mlx5_10", "mlx5_11"
        ]
    );
    // As the ibstat capture states them.
    let cx6 = ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"];
    for h in &inv.hcas {
        let dx = cx6.contains(&h.name.as_str());
        assert_eq!(
            h.hca_type.as_deref(),
            Some(if dx { "MT4125" } else { "MT4129" }),
            "{}",
            h.name
        );
        assert_eq!(
            h.firmware.as_deref(),
            Some(if dx { "22.39.1002" } else { "28.39.1002" }),
            "{}",
            h.name
        );
        let p = &h.ports[0];
        assert_eq!(h.ports.len(), 1, "{}", h.name);
        assert_eq!(p.state, PortState::Active, "{}", h.name);
        assert_eq!(p.link_layer, LinkLayer::Ethernet, "{}", h.name);
        assert_eq!(
            p.rate_mbps,
            Some(if dx { 100_000 } else { 400_000 }),
            "{}",
            h.name
        );
        assert!(h.uverbs.as_ref().is_some_and(|u| u.present), "{}", h.name);
    }
    assert_eq!(
        hca(&inv, "mlx5_0").node_guid.as_deref(),
        Some("a088:c203:00e3:142a")
    );
    assert_eq!(
        hca(&inv, "mlx5_8").node_guid.as_deref(),
        Some("e8eb:d303:0033:08d7")
    );
    // As the lspci capture places them: switch chain, root, NUMA node.
    let m0 = hca(&inv, "mlx5_0").pci.as_ref().expect("place");
    assert_eq!(m0.address, addr("0000:1a:00.0"));
    assert_eq!(m0.pcie_root.as_deref(), Some("pci0000:15"));
    assert_eq!(
        m0.bridges,
        addrs(&["0000:15:01.0", "0000:16:00.0", "0000:17:02.0"])
    );
    assert_eq!(m0.numa_node, Some(0));
    let m8 = hca(&inv, "mlx5_8").pci.as_ref().expect("place");
    assert_eq!(m8.address, addr("0000:9d:00.1"));
    assert_eq!(m8.pcie_root.as_deref(), Some("pci0000:97"));
    assert_eq!(m8.numa_node, Some(1));
    let roots: std::collections::BTreeSet<_> = inv
        .hcas
        .iter()
        .filter_map(|h| h.pci.as_ref()?.pcie_root.clone())
        .collect();
    assert_eq!(roots.len(), 8, "one root complex per switch: {roots:?}");
}

#[test]
fn gpud_ib_ndr_tree_with_bluefield3_reads_without_pci_places() {
    let inv = tree("ib-ndr-8x-bluefield3");
    assert_eq!(
        names(&inv),
        [
            "mlx5_0",
            "mlx5_1",
            "mlx5_4",
            "mlx5_5",
            "mlx5_6",
            "mlx5_7",
            "mlx5_8",
            "mlx5_9",
            "mlx5_bond_0"
        ]
    );
    for h in &inv.hcas {
        assert_eq!(h.pci, None, "{}: the capture has no device links", h.name);
        assert_eq!(h.uverbs, None, "{}", h.name);
        assert!(h.any_port_active(), "{}", h.name);
        if h.name == "mlx5_bond_0" {
            assert_eq!(h.hca_type.as_deref(), Some("MT41692"), "BlueField-3");
            assert_eq!(h.firmware.as_deref(), Some("32.38.3056"));
            assert_eq!(h.board_id.as_deref(), Some("MT_0000000884"));
            assert_eq!(h.ports[0].link_layer, LinkLayer::Ethernet);
            assert_eq!(h.ports[0].rate_mbps, Some(200_000));
        } else {
            assert_eq!(h.hca_type.as_deref(), Some("MT4129"), "{}", h.name);
            assert_eq!(h.firmware.as_deref(), Some("28.41.1000"), "{}", h.name);
            assert_eq!(h.ports[0].link_layer, LinkLayer::InfiniBand, "{}", h.name);
            assert_eq!(h.ports[0].rate_mbps, Some(400_000), "{}", h.name);
        }
    }
    assert!(!inv.rdma_cm, "the capture has no /dev");
}

#[test]
fn a_dual_port_hca_with_port_one_down_reads_both_ports() {
    let inv = tree("port-down-mlx4-dualport");
    let h = hca(&inv, "mlx4_0");
    assert_eq!(h.ports.len(), 2);
    let (p1, p2) = (&h.ports[0], &h.ports[1]);
    assert_eq!(
        (p1.number, &p1.state, p1.phys_state.as_deref()),
        (1, &PortState::Down, Some("Disabled"))
    );
    assert_eq!(
        (p1.link_layer, p1.rate_mbps),
        (LinkLayer::InfiniBand, Some(10_000))
    );
    assert!(!p1.active());
    assert_eq!(
        (p2.number, &p2.state, p2.phys_state.as_deref()),
        (2, &PortState::Active, Some("LinkUp"))
    );
    assert_eq!(
        p2.link_layer,
        LinkLayer::Unknown,
        "the capture is cut before port 2's link layer"
    );
    assert_eq!(p2.rate_mbps, Some(56_000));
    assert!(h.any_port_active());
    assert_eq!(h.best_active_rate_mbps(), 56_000);
    assert_eq!(h.node_guid.as_deref(), Some("f452:1403:007b:e0e0"));
    assert_eq!(h.firmware.as_deref(), Some("2.42.5000"));
}

#[test]
fn two_rdma_devices_on_one_pci_function_both_read_its_address() {
    let inv = tree("two-rdma-devices-one-function");
    assert_eq!(names(&inv), ["mlx5_0", "smi1"]);
    let (a, b) = (hca(&inv, "mlx5_0"), hca(&inv, "smi1"));
    for h in [a, b] {
        let pci = h.pci.as_ref().expect("place");
        assert_eq!(pci.address, addr("0000:0b:00.0"), "{}", h.name);
        assert_eq!(
            pci.pcie_root, None,
            "{}: the capture does not show the tree",
            h.name
        );
    }
    let ports = |h: &Hca| h.ports.iter().map(|p| p.number).collect::<Vec<_>>();
    assert_eq!(ports(a), [1]);
    assert_eq!(ports(b), [1, 2, 3, 4]);
    let umad = |h: &Hca| {
        h.umad
            .iter()
            .map(|u| (u.name.clone(), u.port))
            .collect::<Vec<_>>()
    };
    assert_eq!(umad(a), [("umad0".to_string(), Some(1))]);
    assert_eq!(
        umad(b),
        (1..=4)
            .map(|n| (format!("umad{n}"), Some(n)))
            .collect::<Vec<_>>()
    );
    let (pa, pb) = (a.pci.as_ref().expect("a"), b.pci.as_ref().expect("b"));
    assert_eq!(pa.proximity(pb), Proximity::SameSwitch { bridges: 0 });
}

#[test]
fn oci_deep_switch_chains_give_roots_and_bridges() {
    let inv = tree("oci-18-deep-switches");
    assert_eq!(inv.hcas.len(), 18);
    let place = |n: &str| hca(&inv, n).pci.clone().expect("place");
    let m0 = place("mlx5_0");
    assert_eq!(m0.pcie_root.as_deref(), Some("pci0000:3f"));
    assert_eq!(m0.address, addr("0000:48:00.0"));
    assert_eq!(
        m0.bridges,
        addrs(&[
            "0000:3f:01.1",
            "0000:40:00.0",
            "0000:41:00.0",
            "0000:42:00.0",
            "0000:43:10.0",
            "0000:44:00.0",
            "0000:45:00.0",
            "0000:46:00.0",
            "0000:47:00.0"
        ])
    );
    let m4 = place("mlx5_4");
    assert_eq!(
        m4.bridges,
        addrs(&["0000:2c:03.1"]),
        "directly under a root port"
    );
    let roots: std::collections::BTreeSet<_> = inv
        .hcas
        .iter()
        .filter_map(|h| h.pci.as_ref()?.pcie_root.clone())
        .collect();
    assert_eq!(
        roots.into_iter().collect::<Vec<_>>(),
        [
            "pci0000:00",
            "pci0000:2c",
            "pci0000:3f",
            "pci0000:7e",
            "pci0000:ba"
        ]
    );
    // Dual-function NIC, one switch apart, another root.
    assert_eq!(
        m0.proximity(&place("mlx5_1")),
        Proximity::SameSwitch { bridges: 0 }
    );
    assert_eq!(
        m0.proximity(&place("mlx5_2")),
        Proximity::SameSwitch { bridges: 6 }
    );
    assert!(m0.proximity(&place("mlx5_1")) < m0.proximity(&place("mlx5_2")));
    assert_eq!(
        m0.proximity(&m4),
        Proximity::Distant,
        "no NUMA node in the capture"
    );
    assert!(inv.hcas.iter().all(|h| h.uverbs.is_none()));
}

#[test]
fn device_paths_of_the_other_captures_parse() {
    // mesa-mofed-utils (Talos CX-4) and netdata-9091 (strace -y).
    let talos = PciLocation::from_device_path(Path::new(
        "../../devices/pci0000:00/0000:00:02.0/0000:04:00.0/infiniband/mlx5_0",
    ))
    .expect("talos");
    assert_eq!(talos.address, addr("0000:04:00.0"));
    assert_eq!(talos.pcie_root.as_deref(), Some("pci0000:00"));
    assert_eq!(talos.bridges, addrs(&["0000:00:02.0"]));
    let netdata = PciLocation::from_device_path(Path::new(
        "/sys/devices/pci0000:5d/0000:5d:00.0/0000:5e:00.0/infiniband/mlx5_0/ports/1/counters/port_rcv_data",
    ))
    .expect("netdata");
    assert_eq!(netdata.address, addr("0000:5e:00.0"));
    assert_eq!(netdata.pcie_root.as_deref(), Some("pci0000:5d"));
}

#[test]
fn a_missing_class_directory_is_a_typed_error() {
    let empty = tempfile::tempdir().expect("tempdir");
    let err = rdma::discover(&Roots::under(empty.path())).expect_err("no class dir");
    assert!(matches!(err, rdma::RdmaError::NoRdmaClass { .. }), "{err}");
    assert!(err.to_string().contains("no RDMA device driver"), "{err}");
}

// ------------------------------------------------------------------ GPU–HCA pairing

/// GPU → the PCI addresses of its nearest RDMA functions, as INDEX.md reads the HGX H100
/// lspci capture (same switch upstream port).
const HGX_PAIRS: [(&str, &[&str]); 8] = [
    (
        "0000:19:00.0",
        &["0000:1a:00.0", "0000:1b:00.0", "0000:1b:00.1"],
    ),
    ("0000:3b:00.0", &["0000:3c:00.0"]),
    ("0000:4c:00.0", &["0000:4d:00.0"]),
    ("0000:5d:00.0", &["0000:5e:00.0"]),
    (
        "0000:9b:00.0",
        &["0000:9c:00.0", "0000:9d:00.0", "0000:9d:00.1"],
    ),
    ("0000:bb:00.0", &["0000:bc:00.0"]),
    ("0000:cb:00.0", &["0000:cc:00.0"]),
    ("0000:db:00.0", &["0000:dc:00.0"]),
];

#[test]
fn hgx_h100_every_gpu_pairs_with_the_hcas_behind_its_switch() {
    let root = fixture("rdma/hgx-h100-8gpu-roce");
    let inv = tree("hgx-h100-8gpu-roce");
    let mut first_choice = Vec::new();
    for (gpu, want) in HGX_PAIRS {
        let loc = PciLocation::read(&root.join("sys"), addr(gpu)).expect("GPU place");
        let ranked = rdma::preferred_for(&loc, &inv.hcas);
        assert_eq!(ranked.len(), 12);
        let near = pcie::nearest(ranked.iter().map(|(h, p)| (*h, *p))).expect("a pairing");
        assert!(
            matches!(near.proximity, Proximity::SameSwitch { .. }),
            "{gpu}: {near:?}"
        );
        let mut got: Vec<String> = near
            .keys
            .iter()
            .map(|h| h.pci.as_ref().expect("place").address.to_string())
            .collect();
        got.sort();
        assert_eq!(got, want, "{gpu}");
        // The 400G ConnectX-7 beside it comes first; the 100G ConnectX-6 Dx after it.
        assert_eq!(
            ranked[0].0.pci.as_ref().expect("place").address,
            addr(want[0]),
            "{gpu}"
        );
        first_choice.push(ranked[0].0.name.clone());
        // Every HCA is ranked: same NUMA node before the other socket.
        let kinds: Vec<&str> = ranked.iter().map(|(_, p)| p.name()).collect();
        let numa_from = kinds
            .iter()
            .position(|k| *k == "numa-node")
            .expect("numa-node");
        let none_from = kinds.iter().position(|k| *k == "none").expect("none");
        assert!(numa_from < none_from, "{gpu}: {kinds:?}");
    }
    assert_eq!(
        first_choice,
        [
            "mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"
        ]
    );
}

#[test]
fn a_gpu_address_in_nvidia_form_locates_and_an_unknown_one_is_refused() {
    let sys = fixture("rdma/hgx-h100-8gpu-roce/sys");
    let nvidia: PciAddress = "00000000:DB:00.0".parse().expect("nvidia-smi form");
    let loc = PciLocation::read(&sys, nvidia).expect("place");
    assert_eq!(loc.pcie_root.as_deref(), Some("pci0000:d7"));
    assert_eq!(loc.numa_node, Some(1));
    let err = PciLocation::read(&sys, addr("0000:01:00.0")).expect_err("absent");
    assert!(
        matches!(err, pcie::PcieError::NoSuchFunction { .. }),
        "{err}"
    );
}

/// `nvidia-smi topo -m`: GPU name → [(NIC name, level)], NIC names through the legend.
fn parse_topo(text: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let clean = |l: &str| {
        l.replace("\u{1b}[4m", "")
            .replace("\u{1b}[0m", "")
            .replace("[4m", "")
            .replace("[0m", "")
    };
    let lines: Vec<String> = text.lines().map(clean).collect();
    let header = lines
        .iter()
        .find(|l| l.split_whitespace().next() == Some("GPU0") && l.starts_with([' ', '\t']))
        .expect("header");
    let columns: Vec<&str> = header
        .split_whitespace()
        .take_while(|t| *t != "CPU")
        .collect();
    let legend: BTreeMap<String, String> = lines
        .iter()
        .filter_map(|l| {
            let (k, v) = l.trim().split_once(": ")?;
            k.starts_with("NIC")
                .then(|| (k.to_string(), v.trim().to_string()))
        })
        .collect();
    let mut out = BTreeMap::new();
    for l in &lines {
        let mut tokens = l.split_whitespace();
        let Some(row) = tokens
            .next()
            .filter(|t| t.starts_with("GPU") && !l.starts_with([' ', '\t']))
        else {
            continue;
        };
        let cells: Vec<&str> = tokens.collect();
        let nics = columns
            .iter()
            .zip(&cells)
            .filter(|(c, _)| !c.starts_with("GPU"))
            .map(|(c, v)| {
                let name = legend.get(*c).cloned().unwrap_or_else(|| c.to_string());
                (name, v.to_string())
            })
            .collect();
        out.insert(row.to_string(), nics);
    }
    out
}

fn level(l: &str) -> Proximity {
    match l {
        "PIX" => Proximity::SameSwitch { bridges: 1 },
        "PXB" => Proximity::SameSwitch { bridges: 2 },
        "PHB" => Proximity::SamePcieRoot,
        "NODE" => Proximity::SameNumaNode,
        "SYS" => Proximity::Distant,
        other => panic!("unknown topo level {other:?}"),
    }
}

/// The GPU → nearest NIC pairing INDEX.md states for each topo capture (proximity name,
/// then per GPU its NICs); `None` for a GPU whose row the capture lacks.
fn topo_expectations() -> Vec<(&'static str, &'static str, Vec<Vec<&'static str>>)> {
    let each = |n: usize, f: &dyn Fn(usize) -> Vec<&'static str>| (0..n).map(f).collect();
    let mlx = |i: usize| -> &'static str {
        [
            "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
            "mlx5_8", "mlx5_9", "mlx5_10", "mlx5_11", "mlx5_12", "mlx5_13", "mlx5_14", "mlx5_15",
            "mlx5_16", "mlx5_17",
        ][i]
    };
    let nic = |i: usize| -> &'static str {
        [
            "NIC0", "NIC1", "NIC2", "NIC3", "NIC4", "NIC5", "NIC6", "NIC7", "NIC8",
        ][i]
    };
    vec![
        (
            "issue-sglang-30401-h100x8-8nic-pix-1to1",
            "switch",
            each(8, &|i| vec![mlx(i)]),
        ),
        (
            "issue-sglang-28424-h800x8-9nic-noncontiguous-names-bond",
            "switch",
            [0, 3, 4, 5, 6, 7, 8, 9]
                .iter()
                .map(|&i| vec![mlx(i)])
                .collect(),
        ),
        (
            "issue-sglang-26039-b300x8-9nic-pxb-mlx5_10-17-bond-ansi-residue",
            "switch",
            each(8, &|i| vec![mlx(10 + i)]),
        ),
        (
            "issue-mooncake-2039-h100x8-12nic-ib-ndr-plus-cx6dx-eth",
            "switch",
            vec![
                vec![mlx(0), mlx(1), mlx(2)],
                vec![mlx(3)],
                vec![mlx(4)],
                vec![mlx(5)],
                vec![mlx(6), mlx(7), mlx(8)],
                vec![mlx(9)],
                vec![mlx(10)],
                vec![mlx(11)],
            ],
        ),
        (
            "issue-sglang-24413-h100pcie-1gpu-1nic-phb-kvm",
            "pcie-root",
            vec![vec![mlx(0)]],
        ),
        (
            "awesome-mlsys-h800x4-visible-17nic-container",
            "switch",
            vec![
                vec![mlx(4), mlx(13)],
                vec![mlx(6), mlx(14)],
                vec![mlx(7), mlx(15)],
                vec![mlx(8), mlx(16)],
            ],
        ),
        (
            "gpu-compress-decompress-dgxa100-8gpu-10nic-pxb",
            "switch",
            each(8, &|i| vec![mlx(i / 2 * 2), mlx(i / 2 * 2 + 1)]),
        ),
        (
            "ucx-py-dgx1-8xv100-4nic-old-format",
            "switch",
            each(8, &|i| vec![mlx(i / 2)]),
        ),
        (
            "sysuest-4xv100sxm2-4nic-2nic-per-gpu",
            "switch",
            each(4, &|i| vec![mlx(i / 2 * 2), mlx(i / 2 * 2 + 1)]),
        ),
        (
            "sysuest-xinghe1-2xa100pcie-1nic",
            "numa-node",
            each(2, &|_| vec![mlx(0)]),
        ),
        (
            "stelline-asus-esc8000a-e12-4xrtx6000ada-2xcx7-dualport",
            "numa-node",
            each(4, &|i| vec![mlx(i / 2 * 2), mlx(i / 2 * 2 + 1)]),
        ),
        (
            "stelline-puget-wrx90-2gpu-1xcx7-dualport",
            "numa-node",
            each(2, &|_| vec![mlx(0), mlx(1)]),
        ),
        (
            "issue-nccl-933-8gpu-9nic-interleaved-PARTIAL",
            "switch",
            [2, 4, 6, 8, 1, 3, 5]
                .iter()
                .map(|&i| vec![nic(i)])
                .collect(),
        ),
        (
            "issue-nccl-1453-8gpu-nv18-9nic-reversed-order-PARTIAL",
            "switch",
            each(8, &|i| vec![nic(8 - i)]),
        ),
    ]
}

#[test]
fn every_topo_capture_pairs_each_gpu_as_its_index_states() {
    let dir = fixture("realdata/rdma/topo");
    let expectations = topo_expectations();
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("topo dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".topo.txt"))
        .collect();
    files.sort();
    assert_eq!(
        files.len(),
        expectations.len(),
        "a capture without an expectation: {files:?}"
    );
    for (stem, kind, want) in expectations {
        let path = dir.join(format!("{stem}.topo.txt"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{stem}: {e}"));
        let matrix = parse_topo(&text);
        assert_eq!(
            matrix.len(),
            want.len(),
            "{stem}: GPU rows {:?}",
            matrix.keys()
        );
        for (i, want_nics) in want.iter().enumerate() {
            let gpu = format!("GPU{i}");
            let row = matrix
                .get(&gpu)
                .unwrap_or_else(|| panic!("{stem}: no {gpu}"));
            let near = pcie::nearest(row.iter().map(|(n, l)| (n.as_str(), level(l))))
                .unwrap_or_else(|| panic!("{stem} {gpu}: no pairing"));
            assert_eq!(near.proximity.name(), kind, "{stem} {gpu}");
            let mut got = near.keys.clone();
            got.sort_by_key(|n| (n.len(), n.to_string()));
            let mut want_sorted = want_nics.clone();
            want_sorted.sort_by_key(|n| (n.len(), n.to_string()));
            assert_eq!(got, want_sorted, "{stem} {gpu}");
        }
    }
}

// ------------------------------------------------------------------ preferred allocation

fn share_ids(inv: &Inventory, shares: u32) -> Vec<String> {
    inv.hcas
        .iter()
        .flat_map(|h| gpushare::devices::handover::rdma_share_ids(h, shares))
        .collect()
}

fn picks(v: &[(String, Proximity)]) -> Vec<(&str, &str)> {
    v.iter().map(|(id, p)| (id.as_str(), p.name())).collect()
}

#[test]
fn the_preferred_hca_is_the_one_behind_the_gpus_switch_then_the_nearest_free_one() {
    let sys = fixture("rdma/hgx-h100-8gpu-roce/sys");
    let inv = tree("hgx-h100-8gpu-roce");
    let gpu = PciLocation::read(&sys, addr("0000:3b:00.0")).expect("GPU 1");
    let all = share_ids(&inv, 2);
    let pick = |available: &[String], must: &[String], size| {
        rdma::preferred_allocation(&inv, Some(&gpu), available, must, size)
    };
    assert_eq!(picks(&pick(&all, &[], 1)), [("mlx5_3-_-0", "switch")]);
    // mlx5_3 fully held: the best free HCA on the GPU's NUMA node (400G before 100G).
    let busy: Vec<String> = all
        .iter()
        .filter(|id| !id.starts_with("mlx5_3-"))
        .cloned()
        .collect();
    assert_eq!(picks(&pick(&busy, &[], 1)), [("mlx5_0-_-0", "numa-node")]);
    // Only the other socket's HCAs free: still an answer (advice never refuses).
    let far: Vec<String> = all
        .iter()
        .filter(|id| {
            ["mlx5_6-", "mlx5_9-", "mlx5_10-", "mlx5_11-"]
                .iter()
                .any(|p| id.starts_with(p))
        })
        .cloned()
        .collect();
    assert_eq!(picks(&pick(&far, &[], 1)), [("mlx5_6-_-0", "none")]);
    // Two shares: one per HCA first; must_include kept first.
    let gpu0 = PciLocation::read(&sys, addr("0000:19:00.0")).expect("GPU 0");
    let two = rdma::preferred_allocation(&inv, Some(&gpu0), &all, &[], 2);
    assert_eq!(
        picks(&two),
        [("mlx5_0-_-0", "switch"), ("mlx5_1-_-0", "switch")]
    );
    let must = vec!["mlx5_9-_-1".to_string()];
    let with_must = rdma::preferred_allocation(&inv, Some(&gpu0), &all, &must, 2);
    assert_eq!(
        picks(&with_must),
        [("mlx5_9-_-1", "none"), ("mlx5_0-_-0", "switch")]
    );
    // One HCA left with two free shares: both, from the same HCA.
    let one_hca: Vec<String> = all
        .iter()
        .filter(|id| id.starts_with("mlx5_4-"))
        .cloned()
        .collect();
    assert_eq!(
        picks(&rdma::preferred_allocation(
            &inv,
            Some(&gpu0),
            &one_hca,
            &[],
            2
        )),
        [("mlx5_4-_-0", "numa-node"), ("mlx5_4-_-1", "numa-node")]
    );
    // No GPU place: the fastest ACTIVE HCA by name; ids naming no HCA are never offered.
    let mut odd = vec!["mlx5_99-_-0".to_string()];
    odd.extend(all.iter().filter(|id| id.starts_with("mlx5_1-")).cloned());
    odd.extend(all.iter().filter(|id| id.starts_with("mlx5_11-")).cloned());
    assert_eq!(
        picks(&rdma::preferred_allocation(&inv, None, &odd, &[], 1)),
        [("mlx5_11-_-0", "none")]
    );
}

// ------------------------------------------------------------------ the trees' provenance

/// Every entry under `dir`, relative: `path -> target` for links, `path:content` for files,
/// `path/` for directories.
fn listing(dir: &Path, rel: &Path, out: &mut Vec<String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir.join(rel))
        .expect("read_dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    entries.sort();
    for name in entries {
        let r = rel.join(&name);
        let full = dir.join(&r);
        let meta = std::fs::symlink_metadata(&full).expect("meta");
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&full).expect("link");
            out.push(format!("{} -> {}", r.display(), target.display()));
        } else if meta.is_dir() {
            out.push(format!("{}/", r.display()));
            listing(dir, &r, out);
        } else {
            let text = std::fs::read_to_string(&full).expect("text");
            out.push(format!("{}:{text}", r.display()));
        }
    }
}

#[test]
fn the_recorded_trees_are_what_build_py_makes_of_the_captures() {
    let Some(python) = crate::support::clients::python_with(&["re", "shutil"]) else {
        return;
    };
    let out = tempfile::tempdir().expect("tempdir");
    let run = std::process::Command::new(python)
        .arg(fixture("rdma/build.py"))
        .arg(out.path())
        .output()
        .expect("build.py runs");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let committed = fixture("rdma");
    let mut trees: Vec<String> = std::fs::read_dir(out.path())
        .expect("out")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    trees.sort();
    assert_eq!(trees.len(), 7, "{trees:?}");
    for t in &trees {
        let (mut built, mut have) = (Vec::new(), Vec::new());
        listing(&out.path().join(t), Path::new(""), &mut built);
        listing(&committed.join(t), Path::new(""), &mut have);
        assert_eq!(built, have, "{t}: rerun tests/fixtures/rdma/build.py");
        let provenance =
            std::fs::read_to_string(committed.join(t).join("PROVENANCE")).expect("PROVENANCE");
        assert!(provenance.contains("tests/fixtures/realdata/rdma/"), "{t}");
    }
}

#[test]
fn every_gpu_bus_id_of_the_nvidia_smi_captures_parses_as_a_pci_address() {
    use gpushare::gpu::nvidia_smi::parse_xml;
    let dir = fixture("realdata/nvidia-smi-xml");
    let mut seen = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    for path in entries {
        if path.extension().is_none_or(|x| x != "xml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        let Ok(inv) = parse_xml(&text) else {
            continue; // the corpus' NEGATIVE files
        };
        for gpu in inv.devices.iter().filter(|g| !g.pci_bus_id.is_empty()) {
            let a: PciAddress = gpu
                .pci_bus_id
                .parse()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            // NVIDIA's 8-digit domain reads as sysfs's 4-digit name, case folded.
            let sysfs_form = a.to_string();
            let want = gpu.pci_bus_id.to_lowercase();
            let want = want
                .strip_prefix("0000")
                .filter(|w| w.len() == 12)
                .unwrap_or(&want);
            assert_eq!(sysfs_form, want, "{}", path.display());
            seen += 1;
        }
    }
    assert!(seen > 50, "only {seen} GPUs");
    // The HGX tree's GPUs, located from NVIDIA's form.
    let sys = fixture("rdma/hgx-h100-8gpu-roce/sys");
    let loc = PciLocation::of_bus_id(&sys, "00000000:9B:00.0").expect("GPU 4");
    assert_eq!(loc.bridges.last(), Some(&addr("0000:99:01.0")));
    assert!(matches!(
        PciLocation::of_bus_id(&sys, "GPU-1234"),
        Err(pcie::PcieError::BadAddress(_))
    ));
}

#[test]
fn the_path_and_listing_captures_read_right() {
    let capture = |name: &str| {
        std::fs::read_to_string(fixture(&format!("realdata/rdma/sysfs/{name}"))).expect("capture")
    };
    // A BlueField-2 sub-function: the RDMA device lives under an mdev of PCI function 03:00.0.
    let bf2 = capture("issue-lshca-25-bluefield2-mdev-sf-ports-ll.txt");
    let path = bf2
        .split_whitespace()
        .find(|t| t.contains("/infiniband/mlx5_2/"))
        .expect("the ll path");
    let cwd = bf2
        .split_once(":/")
        .and_then(|(_, rest)| rest.split_once('#'))
        .map(|(dir, _)| format!("/{dir}"))
        .expect("the prompt's directory");
    let full = Path::new(&cwd).join(path);
    let loc = PciLocation::from_device_path(&full).expect("SF place");
    assert_eq!(loc.address, addr("0000:03:00.0"));
    assert_eq!((loc.pcie_root, loc.bridges), (None, vec![]));
    // Talos CX-4, netdata's strace -y: the function and its root.
    let talos = capture("mesa-mofed-utils-talos-cx4-single-mlx5_0-ls-class-infiniband.txt");
    let target = talos.split(" -> ").nth(1).expect("link").trim();
    let loc = PciLocation::from_device_path(Path::new(target)).expect("talos");
    assert_eq!(
        (loc.address, loc.pcie_root.as_deref()),
        (addr("0000:04:00.0"), Some("pci0000:00"))
    );
    let netdata = capture("issue-netdata-9091-strace-resolved-class-infiniband-paths.txt");
    for line in netdata.lines() {
        let resolved = line
            .split('<')
            .nth(1)
            .and_then(|r| r.split('>').next())
            .expect("resolved path");
        let loc = PciLocation::from_device_path(Path::new(resolved)).expect("netdata");
        assert_eq!(loc.address, addr("0000:5e:00.0"));
        assert_eq!(loc.bridges, addrs(&["0000:5d:00.0"]));
    }
    // gpud #200: `ls` lists mlx5_10 before mlx5_2; discovery orders by number.
    let listing = capture("issue-gpud-200-ls-sys-class-infiniband-two-h100-hosts.txt");
    let line = listing
        .lines()
        .find(|l| l.contains("mlx5_11"))
        .expect("12 devices");
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in line.split_whitespace() {
        std::fs::create_dir_all(tmp.path().join("sys/class/infiniband").join(name)).expect("mkdir");
    }
    let inv = rdma::discover(&Roots::under(tmp.path())).expect("discover");
    let got = names(&inv);
    let want: Vec<String> = (0..12).map(|i| format!("mlx5_{i}")).collect();
    assert_eq!(got, want.iter().map(String::as_str).collect::<Vec<_>>());
}

#[test]
fn only_hcas_with_a_verbs_node_and_an_active_port_are_offered() {
    let config = rdma::RdmaConfig::default();
    let offered_names = |inv: &Inventory, cfg: &rdma::RdmaConfig| {
        let (offered, left) = rdma::offer(inv, cfg);
        let o: Vec<String> = offered.iter().map(|h| h.name.clone()).collect();
        let l: Vec<(String, rdma::NotOffered)> =
            left.into_iter().map(|(h, r)| (h.name.clone(), r)).collect();
        (o, l)
    };
    let hgx = tree("hgx-h100-8gpu-roce");
    let (o, l) = offered_names(&hgx, &config);
    assert_eq!((o.len(), l.len()), (12, 0));
    let single = tree("single-hca-mlx4");
    let (o, l) = offered_names(&single, &config);
    assert_eq!(o, ["mlx4_0"]);
    assert_eq!(l, [("scif0".to_string(), rdma::NotOffered::NoVerbsDevice)]);
    // The node gone, a port down: each left out with its reason.
    let mut changed = hgx.clone();
    if let Some(u) = changed.hcas[3].uverbs.as_mut() {
        u.present = false;
    }
    for p in &mut changed.hcas[5].ports {
        p.state = PortState::Down;
    }
    let (o, l) = offered_names(&changed, &config);
    assert_eq!(o.len(), 10);
    assert_eq!(
        l,
        [
            (
                "mlx5_3".to_string(),
                rdma::NotOffered::VerbsNodeMissing {
                    path: "/dev/infiniband/uverbs3".into()
                }
            ),
            ("mlx5_5".to_string(), rdma::NotOffered::NoActivePort)
        ]
    );
    let lenient = rdma::RdmaConfig {
        require_active_port: false,
        ..rdma::RdmaConfig::default()
    };
    assert_eq!(offered_names(&changed, &lenient).0.len(), 11);
}

#[test]
fn a_gpu_and_its_hca_carry_the_same_standard_pcie_root_attribute() {
    use gpushare::pcie::{ATTR_NUMA_NODE, ATTR_PCI_BUS_ID, ATTR_PCIE_ROOT, AttributeValue};
    let sys = fixture("rdma/hgx-h100-8gpu-roce/sys");
    let inv = tree("hgx-h100-8gpu-roce");
    let gpu = PciLocation::read(&sys, addr("0000:5d:00.0")).expect("GPU 3");
    let hca = hca(&inv, "mlx5_5").pci.as_ref().expect("place");
    let root = |attrs: Vec<(&str, AttributeValue)>| {
        attrs
            .into_iter()
            .find(|(k, _)| *k == ATTR_PCIE_ROOT)
            .map(|(_, v)| v)
    };
    assert_eq!(
        root(gpu.dra_attributes()),
        Some(AttributeValue::String("pci0000:59".into()))
    );
    assert_eq!(root(gpu.dra_attributes()), root(hca.dra_attributes()));
    assert_eq!(
        hca.dra_attributes(),
        [
            (
                ATTR_PCI_BUS_ID,
                AttributeValue::String("0000:5e:00.0".into())
            ),
            (ATTR_PCIE_ROOT, AttributeValue::String("pci0000:59".into())),
            (ATTR_NUMA_NODE, AttributeValue::Int(0)),
        ]
    );
    assert_ne!(
        root(gpu.dra_attributes()),
        root(hca_place(&inv, "mlx5_4").dra_attributes())
    );
    // No root in the path (the two-devices capture): no pcieRoot attribute, never a guess.
    let two = tree("two-rdma-devices-one-function");
    assert_eq!(root(hca_place(&two, "smi1").dra_attributes()), None);
}

fn hca_place(inv: &Inventory, name: &str) -> PciLocation {
    hca(inv, name).pci.clone().expect("place")
}
