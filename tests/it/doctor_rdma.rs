//! `gpushare doctor --rdma` over the recorded RDMA trees of `tests/fixtures/rdma/`: HCAs
//! found, `ib_uverbs` / `rdma_ucm` loaded (from the tree's `proc/modules`, or a built-in
//! module under `sys/module`), the verbs character devices present, ports ACTIVE — each
//! status and fix hint as the tree's captures imply — and one run of the binary.

use std::path::Path;

use gpushare::doctor::rdma::checks;
use gpushare::doctor::report::{Check, Status};
use gpushare::rdma::Roots;
use serde_json::Value;

use crate::support::doctor_node::{fake_node_doctor, report_of};
use crate::support::{fixture, stdout};

fn doctor(tree: &Path) -> Vec<Check> {
    checks(&Roots::under(tree), &tree.join("proc/modules"))
}

fn by_id<'a>(checks: &'a [Check], id: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no {id} in {checks:?}"))
}

fn statuses(checks: &[Check]) -> Vec<(&str, Status)> {
    checks.iter().map(|c| (c.id, c.status)).collect()
}

#[test]
fn a_healthy_hgx_node_passes_every_rdma_check() {
    let c = doctor(&fixture("rdma/hgx-h100-8gpu-roce"));
    assert_eq!(
        statuses(&c),
        [
            ("rdma-devices", Status::Ok),
            ("rdma-modules", Status::Ok),
            ("rdma-char-devices", Status::Ok),
            ("rdma-ports", Status::Ok)
        ]
    );
    let devices = &by_id(&c, "rdma-devices").detail;
    assert_eq!(devices.lines().count(), 12);
    assert!(
        devices.contains("mlx5_0  0000:1a:00.0  pci0000:15  numa 0  MT4129  fw 28.39.1002  port 1 ACTIVE Ethernet 400 Gb/s  uverbs0"),
        "{devices}"
    );
    assert!(by_id(&c, "rdma-ports").detail.contains("12 port(s) ACTIVE"));
    assert!(c.iter().all(|c| c.hint.is_empty()));
}

#[test]
fn a_port_down_warns_and_names_the_port() {
    let c = doctor(&fixture("rdma/port-down-mlx4-dualport"));
    let ports = by_id(&c, "rdma-ports");
    assert_eq!(ports.status, Status::Warn);
    for want in ["mlx4_0 port 1: DOWN (Disabled)", "1 port(s) ACTIVE"] {
        assert!(ports.detail.contains(want), "{want}: {}", ports.detail);
    }
    assert!(ports.hint.contains("cable"), "{}", ports.hint);
    // This capture has no /dev root: no verbs device can be handed to a pod.
    let chars = by_id(&c, "rdma-char-devices");
    assert_eq!(chars.status, Status::Fail);
    assert!(
        chars.detail.contains("mlx4_0: no uverbs device in sysfs"),
        "{}",
        chars.detail
    );
    assert!(chars.hint.contains("modprobe ib_uverbs"), "{}", chars.hint);
}

#[test]
fn a_single_hca_host_warns_about_its_non_verbs_device_only() {
    let c = doctor(&fixture("rdma/single-hca-mlx4"));
    assert_eq!(by_id(&c, "rdma-devices").status, Status::Ok);
    assert!(
        by_id(&c, "rdma-devices")
            .detail
            .contains("scif0  no PCI place in sysfs")
    );
    let chars = by_id(&c, "rdma-char-devices");
    assert_eq!(chars.status, Status::Warn, "{}", chars.detail);
    assert!(chars.detail.contains("scif0: no uverbs device in sysfs"));
    assert!(chars.detail.contains("mlx4_0: /dev/infiniband/uverbs0"));
    assert!(chars.detail.contains("/dev/infiniband/rdma_cm present"));
    assert_eq!(
        by_id(&c, "rdma-ports").status,
        Status::Warn,
        "scif0 has no port state"
    );
}

#[test]
fn ports_without_state_and_devices_without_verbs_fail() {
    let c = doctor(&fixture("rdma/two-rdma-devices-one-function"));
    assert_eq!(by_id(&c, "rdma-ports").status, Status::Fail);
    assert!(by_id(&c, "rdma-ports").detail.contains("0 port(s) ACTIVE"));
    assert_eq!(by_id(&c, "rdma-char-devices").status, Status::Fail);
    assert!(
        by_id(&c, "rdma-char-devices")
            .detail
            .contains("/dev/infiniband/rdma_cm missing")
    );
}

/// A copy of `tree` to change (symlinks copied as symlinks).
fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("read_dir").flatten() {
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let meta = std::fs::symlink_metadata(&src).expect("meta");
        if meta.file_type().is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src).expect("link"), &dst)
                .expect("symlink");
        } else if meta.is_dir() {
            std::fs::create_dir_all(&dst).expect("mkdir");
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).expect("copy");
        }
    }
}

#[test]
fn missing_modules_and_nodes_fail_with_their_fix() {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture("rdma/hgx-h100-8gpu-roce"), tmp.path());
    std::fs::write(
        tmp.path().join("proc/modules"),
        "ib_uverbs 163840 2 mlx5_ib, Live 0x0000000000000000\n",
    )
    .expect("modules");
    std::fs::remove_file(tmp.path().join("dev/infiniband/uverbs3")).expect("rm uverbs3");
    std::fs::remove_file(tmp.path().join("dev/infiniband/rdma_cm")).expect("rm rdma_cm");
    let c = doctor(tmp.path());
    let modules = by_id(&c, "rdma-modules");
    assert_eq!(modules.status, Status::Fail);
    assert_eq!(modules.detail, "not loaded: rdma_ucm");
    assert!(
        modules.hint.starts_with("modprobe rdma_ucm"),
        "{}",
        modules.hint
    );
    assert!(modules.hint.contains("/etc/modules-load.d/rdma.conf"));
    let chars = by_id(&c, "rdma-char-devices");
    assert_eq!(chars.status, Status::Warn);
    assert!(
        chars
            .detail
            .contains("mlx5_3: /dev/infiniband/uverbs3 missing"),
        "{}",
        chars.detail
    );
    assert!(chars.detail.contains("/dev/infiniband/rdma_cm missing"));
    // A module built into the kernel shows only under /sys/module.
    std::fs::create_dir_all(tmp.path().join("sys/module/rdma_ucm")).expect("builtin");
    assert_eq!(
        by_id(&doctor(tmp.path()), "rdma-modules").status,
        Status::Ok
    );
    // /proc/modules unreadable and the module not built in: a warning, not a verdict.
    std::fs::remove_dir(tmp.path().join("sys/module/rdma_ucm")).expect("rmdir");
    std::fs::remove_file(tmp.path().join("proc/modules")).expect("rm modules");
    assert_eq!(
        by_id(&doctor(tmp.path()), "rdma-modules").status,
        Status::Warn
    );
}

#[test]
fn no_rdma_class_fails_devices_and_skips_the_rest() {
    let empty = tempfile::tempdir().expect("tempdir");
    let c = doctor(empty.path());
    assert_eq!(
        statuses(&c),
        [
            ("rdma-devices", Status::Fail),
            ("rdma-modules", Status::Warn),
            ("rdma-char-devices", Status::Skip),
            ("rdma-ports", Status::Skip)
        ]
    );
    assert!(by_id(&c, "rdma-devices").hint.contains("--sysfs-root"));
}

#[test]
fn the_binary_runs_the_rdma_checks_with_separate_roots() {
    let tree = fixture("rdma/hgx-h100-8gpu-roce");
    let sys = tree.join("sys");
    let dev = tree.join("dev");
    let (sys, dev) = (sys.to_str().expect("utf-8"), dev.to_str().expect("utf-8"));
    let rdma = ["--rdma", "--sysfs-root", sys, "--dev-root", dev];
    let out = fake_node_doctor(&tree, "1x16GiB", &[&["-o", "json"], &rdma[..]].concat());
    let report: Value = report_of(&out);
    let ids: Vec<&str> = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter_map(|c| c["id"].as_str())
        .filter(|id| id.starts_with("rdma-"))
        .collect();
    assert_eq!(
        ids,
        [
            "rdma-devices",
            "rdma-modules",
            "rdma-char-devices",
            "rdma-ports"
        ]
    );
    for c in report["checks"].as_array().expect("checks") {
        if c["id"].as_str().is_some_and(|id| id.starts_with("rdma-")) {
            assert_eq!(c["status"], "ok", "{c}");
        }
    }
    // Without --rdma, no RDMA check runs.
    let plain = fake_node_doctor(&tree, "1x16GiB", &["-o", "json"]);
    assert!(!stdout(&plain).contains("rdma-"), "{}", stdout(&plain));
}
