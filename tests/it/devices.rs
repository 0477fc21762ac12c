//! Device kinds beside the GPU: the `[devices]` configuration (parsed as TOML, every refusal
//! typed), generic devices discovered over a fake `/dev`, and the hand-over of both kinds
//! checked device by device — each id gets exactly its own nodes, never another device's —
//! over generic declarations and the recorded RDMA trees.

use std::collections::BTreeMap;
use std::path::Path;

use gpushare::devices::generic::{self, GenericConfigError, GenericDeviceConfig};
use gpushare::devices::handover::{self, DeviceNodeSpec, HandOverError};
use gpushare::devices::{DevicesConfig, DevicesConfigError, ResourceNameError};
use gpushare::rdma::{self, Inventory, RdmaConfig, RdmaConfigError, Roots};

use crate::support::fixture;

/// A fake `/dev`: serial ports, fuse, a sound card, a video device, a DRI directory.
fn fake_dev() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for node in [
        "fuse",
        "ttyUSB0",
        "ttyUSB1",
        "ttyACM0",
        "video0",
        "snd/controlC0",
        "snd/pcmC0D0p",
        "snd/pcmC0D0c",
        "snd/timer",
        "dri/card0",
        "accel/accel0",
    ] {
        let p = dir.path().join(node);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, "").expect("node");
    }
    dir
}

fn decl(toml_text: &str) -> GenericDeviceConfig {
    let cfg: DevicesConfig = toml::from_str(toml_text).expect("TOML");
    cfg.validate().expect("valid");
    cfg.generic.into_iter().next().expect("one declaration")
}

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_devices_section_parses_with_its_defaults() {
    let cfg: DevicesConfig = toml::from_str(
        r#"
        sysfs_root = "/host/sys"
        dev_root = "/host/dev"
        [rdma]
        enabled = true
        shares_per_hca = 4
        [[generic]]
        resource = "example.com/fuse"
        shares = 10
        paths = [{ path = "/dev/fuse" }]
        "#,
    )
    .expect("TOML");
    assert_eq!(cfg.validate(), Ok(()));
    assert_eq!(
        cfg.roots(),
        Roots {
            sysfs: "/host/sys".into(),
            dev: "/host/dev".into()
        }
    );
    assert_eq!(cfg.rdma.resource, "gpushare.io/rdma");
    assert_eq!(cfg.rdma.shares_per_hca, 4);
    assert!(cfg.rdma.require_active_port && cfg.rdma.umad);
    let g = &cfg.generic[0];
    assert_eq!((g.shares, g.paths[0].permissions.as_str()), (10, "rw"));
    let defaults = DevicesConfig::default();
    assert_eq!(defaults.roots(), Roots::default());
    assert!(!defaults.rdma.enabled && defaults.generic.is_empty());
}

#[test]
fn unknown_keys_and_bad_declarations_are_refused_with_their_kind() {
    assert!(
        toml::from_str::<DevicesConfig>(
            "[[generic]]\nresource = \"a.io/x\"\npaths = []\ncount = 3\n"
        )
        .is_err()
    );
    let bad = |text: &str| -> DevicesConfigError {
        let cfg: DevicesConfig = toml::from_str(text).expect("TOML");
        cfg.validate().expect_err(text)
    };
    let g = |e: DevicesConfigError| match e {
        DevicesConfigError::Generic(g) => g,
        other => panic!("not a generic error: {other}"),
    };
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"fuse\"\npaths = [{ path = \"/dev/fuse\" }]"
        )),
        GenericConfigError::Resource(ResourceNameError::NoDomain(_))
    ));
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"aliyun.com/gpu-mem\"\npaths = [{ path = \"/dev/fuse\" }]"
        )),
        GenericConfigError::Resource(ResourceNameError::Reserved(_))
    ));
    assert!(matches!(
        g(bad("[[generic]]\nresource = \"a.io/x\"\npaths = []")),
        GenericConfigError::NoPaths { .. }
    ));
    for path in ["/etc/shadow", "/dev/../etc/shadow", "dev/fuse", "/dev/"] {
        let text = format!("[[generic]]\nresource = \"a.io/x\"\npaths = [{{ path = \"{path}\" }}]");
        assert!(
            matches!(g(bad(&text)), GenericConfigError::PathNotUnderDev { .. }),
            "{path}"
        );
    }
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/fuse\", permissions = \"rwx\" }]"
        )),
        GenericConfigError::BadPermissions { .. }
    ));
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/tty*\", container_path = \"/dev/tty\" }]"
        )),
        GenericConfigError::BadContainerPath { .. }
    ));
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"a.io/x\"\nshares = 0\npaths = [{ path = \"/dev/fuse\" }]"
        )),
        GenericConfigError::BadShares { shares: 0, .. }
    ));
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/fuse\", optional = true }]"
        )),
        GenericConfigError::OptionalAlone { .. }
    ));
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/fuse\" }]\nenvs = { \"1X\" = \"v\" }"
        )),
        GenericConfigError::BadEnvName { .. }
    ));
    assert!(matches!(
        g(bad(
            "[[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/fuse\" }]\nmounts = [{ host_path = \"lib\", container_path = \"/lib\" }]"
        )),
        GenericConfigError::RelativeMount { .. }
    ));
    let twice = "[[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/fuse\" }]\n\
                 [[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/video0\" }]";
    assert_eq!(
        bad(twice),
        DevicesConfigError::DuplicateResource("a.io/x".into())
    );
    let rdma_clash = "[rdma]\nenabled = true\nresource = \"a.io/x\"\n\
                      [[generic]]\nresource = \"a.io/x\"\npaths = [{ path = \"/dev/fuse\" }]";
    assert_eq!(
        bad(rdma_clash),
        DevicesConfigError::DuplicateResource("a.io/x".into())
    );
    assert_eq!(
        bad("[rdma]\nenabled = true\nshares_per_hca = 0"),
        DevicesConfigError::Rdma(RdmaConfigError::ZeroShares)
    );
    // A disabled RDMA kind is not checked (its defaults stand).
    let off: DevicesConfig = toml::from_str("[rdma]\nshares_per_hca = 0").expect("TOML");
    assert_eq!(off.validate(), Ok(()));
}

#[test]
fn one_glob_gives_one_device_per_node() {
    let dev = fake_dev();
    let serial = decl(
        "[[generic]]\nresource = \"example.com/serial\"\npaths = [{ path = \"/dev/ttyUSB*\" }]\n\
         envs = { SERIAL_BAUD = \"115200\" }",
    );
    let found = generic::discover(&serial, dev.path());
    let got: Vec<(&str, Vec<&str>)> = found
        .iter()
        .map(|d| {
            (
                d.id.as_str(),
                d.nodes.iter().map(|n| n.host_path.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("ttyUSB0", vec!["/dev/ttyUSB0"]),
            ("ttyUSB1", vec!["/dev/ttyUSB1"])
        ]
    );
    assert!(
        found
            .iter()
            .all(|d| d.resource == "example.com/serial" && d.shares == 1)
    );
    // Directories are never device nodes.
    let dri =
        decl("[[generic]]\nresource = \"example.com/dri\"\npaths = [{ path = \"/dev/dri\" }]");
    assert!(generic::discover(&dri, dev.path()).is_empty());
    let nothing =
        decl("[[generic]]\nresource = \"example.com/npu\"\npaths = [{ path = \"/dev/davinci*\" }]");
    assert!(generic::discover(&nothing, dev.path()).is_empty());
}

#[test]
fn several_paths_give_one_device_holding_every_node() {
    let dev = fake_dev();
    let sound = decl(
        "[[generic]]\nresource = \"example.com/sound\"\nshares = 3\npaths = [\
         { path = \"/dev/snd/control*\" }, { path = \"/dev/snd/pcm*\" },\
         { path = \"/dev/snd/seq\", optional = true }, { path = \"/dev/snd/timer\", permissions = \"r\" }]",
    );
    let found = generic::discover(&sound, dev.path());
    assert_eq!(found.len(), 1);
    let d = &found[0];
    assert_eq!(d.id, "snd_controlC0");
    let nodes: Vec<(&str, &str)> = d
        .nodes
        .iter()
        .map(|n| (n.host_path.as_str(), n.permissions.as_str()))
        .collect();
    assert_eq!(
        nodes,
        [
            ("/dev/snd/controlC0", "rw"),
            ("/dev/snd/pcmC0D0c", "rw"),
            ("/dev/snd/pcmC0D0p", "rw"),
            ("/dev/snd/timer", "r")
        ]
    );
    assert_eq!(
        d.share_ids(),
        [
            "snd_controlC0-_-0",
            "snd_controlC0-_-1",
            "snd_controlC0-_-2"
        ]
    );
    // A required path that matches nothing: no device at all.
    let incomplete = decl(
        "[[generic]]\nresource = \"example.com/sound\"\npaths = [\
         { path = \"/dev/snd/control*\" }, { path = \"/dev/snd/midi*\" }]",
    );
    assert!(generic::discover(&incomplete, dev.path()).is_empty());
}

#[test]
fn generic_hand_over_gives_each_id_exactly_its_own_device() {
    let dev = fake_dev();
    let serial = decl(
        "[[generic]]\nresource = \"example.com/serial\"\nshares = 2\n\
         paths = [{ path = \"/dev/tty[AU]*[0-9]\" }]\n\
         envs = { SERIAL_BAUD = \"115200\" }\n\
         mounts = [{ host_path = \"/etc/serial.d\", container_path = \"/etc/serial.d\", read_only = true }]",
    );
    let devices = generic::discover(&serial, dev.path());
    assert_eq!(
        devices.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
        ["ttyACM0", "ttyUSB0", "ttyUSB1"]
    );
    for d in &devices {
        for share in d.share_ids() {
            let h = handover::generic(&devices, std::slice::from_ref(&share)).expect("hand-over");
            let want = vec![DeviceNodeSpec {
                container_path: format!("/dev/{}", d.id),
                host_path: format!("/dev/{}", d.id),
                permissions: "rw".into(),
            }];
            assert_eq!(h.devices, want, "{share}");
            assert_eq!(
                h.envs,
                BTreeMap::from([("SERIAL_BAUD".to_string(), "115200".to_string())])
            );
            assert_eq!(h.mounts.len(), 1);
            assert!(h.mounts[0].read_only);
        }
    }
    // Two shares of one device: handed over once. Two devices: both, nothing else.
    let h = handover::generic(&devices, &ids(&["ttyUSB0-_-0", "ttyUSB0-_-1"])).expect("once");
    assert_eq!(h.devices.len(), 1);
    let h = handover::generic(&devices, &ids(&["ttyUSB1-_-1", "ttyACM0-_-0"])).expect("two");
    let paths: Vec<&str> = h.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(paths, ["/dev/ttyACM0", "/dev/ttyUSB1"]);
    assert_eq!(h.mounts.len(), 1, "one mount, not one per device");
    // Never a device the pod was not given.
    for bad in ["ttyUSB9-_-0", "ttyUSB0-_-2", "fuse", ""] {
        assert_eq!(
            handover::generic(&devices, &ids(&[bad])),
            Err(HandOverError::UnknownDevice {
                id: bad.to_string()
            }),
            "{bad}"
        );
    }
    // The answer the device plugin sends.
    let resp = handover::generic(&devices, &ids(&["ttyUSB0-_-0"]))
        .expect("hand-over")
        .to_allocate_response();
    assert_eq!(resp.devices.len(), 1);
    assert_eq!(resp.devices[0].host_path, "/dev/ttyUSB0");
    assert_eq!(resp.devices[0].permissions, "rw");
    assert_eq!(resp.mounts[0].container_path, "/etc/serial.d");
    assert_eq!(
        resp.envs.get("SERIAL_BAUD").map(String::as_str),
        Some("115200")
    );
}

#[test]
fn a_container_path_renames_the_node_in_the_container() {
    let dev = fake_dev();
    let accel = decl(
        "[[generic]]\nresource = \"example.com/npu\"\n\
         paths = [{ path = \"/dev/accel/accel0\", container_path = \"/dev/npu0\", permissions = \"rwm\" }]",
    );
    let devices = generic::discover(&accel, dev.path());
    let h = handover::generic(&devices, &ids(&["accel_accel0-_-0"])).expect("hand-over");
    assert_eq!(
        h.devices,
        [DeviceNodeSpec {
            container_path: "/dev/npu0".into(),
            host_path: "/dev/accel/accel0".into(),
            permissions: "rwm".into()
        }]
    );
}

fn rdma_tree(name: &str) -> Inventory {
    rdma::discover(&Roots::under(&fixture(&format!("rdma/{name}")))).expect("discover")
}

#[test]
fn rdma_hand_over_gives_each_hca_its_own_verbs_node_and_rdma_cm() {
    let inv = rdma_tree("hgx-h100-8gpu-roce");
    let config = RdmaConfig {
        enabled: true,
        shares_per_hca: 4,
        ..RdmaConfig::default()
    };
    for (i, hca) in inv.hcas.iter().enumerate() {
        let share_ids = handover::rdma_share_ids(hca, config.shares_per_hca);
        assert_eq!(share_ids.len(), 4);
        for id in &share_ids {
            let h = handover::rdma(&inv, &config, std::slice::from_ref(id)).expect("hand-over");
            let paths: Vec<&str> = h.devices.iter().map(|d| d.host_path.as_str()).collect();
            assert_eq!(
                paths,
                [
                    "/dev/infiniband/rdma_cm".to_string(),
                    format!("/dev/infiniband/uverbs{i}")
                ],
                "{id}"
            );
            assert!(
                h.devices
                    .iter()
                    .all(|d| d.container_path == d.host_path && d.permissions == "rw")
            );
            assert_eq!(
                h.envs.get(handover::ENV_RDMA_DEVICES),
                Some(&hca.name),
                "{id}"
            );
            assert_eq!(
                h.envs.get(handover::ENV_NCCL_IB_HCA),
                Some(&format!("={}", hca.name))
            );
            assert!(h.mounts.is_empty());
        }
    }
    let two = handover::rdma(
        &inv,
        &config,
        &ids(&["mlx5_10-_-3", "mlx5_0-_-0", "mlx5_10-_-1"]),
    )
    .expect("two HCAs");
    let paths: Vec<&str> = two.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/dev/infiniband/rdma_cm",
            "/dev/infiniband/uverbs0",
            "/dev/infiniband/uverbs10"
        ]
    );
    assert_eq!(two.envs[handover::ENV_RDMA_DEVICES], "mlx5_10,mlx5_0");
    for bad in ["mlx5_12-_-0", "mlx5_0-_-4", "mlx5_bond_0"] {
        assert_eq!(
            handover::rdma(&inv, &config, &ids(&[bad])),
            Err(HandOverError::UnknownDevice {
                id: bad.to_string()
            })
        );
    }
}

#[test]
fn rdma_hand_over_adds_umad_nodes_when_asked_and_refuses_an_hca_without_verbs() {
    let inv = rdma_tree("single-hca-mlx4");
    let with = handover::rdma(&inv, &RdmaConfig::default(), &ids(&["mlx4_0-_-0"])).expect("umad");
    let paths: Vec<&str> = with.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/dev/infiniband/rdma_cm",
            "/dev/infiniband/umad0",
            "/dev/infiniband/uverbs0"
        ]
    );
    let no_umad = RdmaConfig {
        umad: false,
        ..RdmaConfig::default()
    };
    let without = handover::rdma(&inv, &no_umad, &ids(&["mlx4_0-_-0"])).expect("no umad");
    assert_eq!(without.devices.len(), 2);
    assert_eq!(
        handover::rdma(&inv, &RdmaConfig::default(), &ids(&["scif0-_-0"])),
        Err(HandOverError::NoVerbsDevice {
            hca: "scif0".into()
        })
    );
    let bf3 = rdma_tree("ib-ndr-8x-bluefield3");
    assert_eq!(
        handover::rdma(&bf3, &RdmaConfig::default(), &ids(&["mlx5_bond_0-_-0"])),
        Err(HandOverError::NoVerbsDevice {
            hca: "mlx5_bond_0".into()
        })
    );
    // The node gone from /dev since discovery: refused, not handed over half.
    let mut gone = inv.clone();
    if let Some(u) = gone.hcas[0].uverbs.as_mut() {
        u.present = false;
    }
    assert_eq!(
        handover::rdma(&gone, &RdmaConfig::default(), &ids(&["mlx4_0-_-0"])),
        Err(HandOverError::NodeMissing {
            hca: "mlx4_0".into(),
            path: "/dev/infiniband/uverbs0".into()
        })
    );
    // Nothing asked, nothing handed over (no rdma_cm, no env).
    let none = handover::rdma(&inv, &RdmaConfig::default(), &[]).expect("empty");
    assert!(none.devices.is_empty() && none.envs.is_empty());
    assert!(Path::new(&fixture("rdma/single-hca-mlx4/dev/infiniband/rdma_cm")).exists());
}

#[test]
fn the_hand_over_as_cdi_container_edits() {
    let inv = rdma_tree("single-hca-mlx4");
    let h = handover::rdma(&inv, &RdmaConfig::default(), &ids(&["mlx4_0-_-0"])).expect("hand-over");
    let edits = serde_json::to_value(h.to_cdi_container_edits()).expect("json");
    assert_eq!(
        edits,
        serde_json::json!({
            "env": ["GPUSHARE_RDMA_DEVICES=mlx4_0", "NCCL_IB_HCA==mlx4_0"],
            "deviceNodes": [
                {"path": "/dev/infiniband/rdma_cm", "hostPath": "/dev/infiniband/rdma_cm", "permissions": "rw"},
                {"path": "/dev/infiniband/umad0", "hostPath": "/dev/infiniband/umad0", "permissions": "rw"},
                {"path": "/dev/infiniband/uverbs0", "hostPath": "/dev/infiniband/uverbs0", "permissions": "rw"}
            ]
        })
    );
    let dev = fake_dev();
    let npu = decl(
        "[[generic]]\nresource = \"example.com/npu\"\npaths = [{ path = \"/dev/accel/accel0\" }]\n\
         mounts = [{ host_path = \"/opt/npu\", container_path = \"/opt/npu\", read_only = true }]",
    );
    let devices = generic::discover(&npu, dev.path());
    let edits = serde_json::to_value(
        handover::generic(&devices, &ids(&["accel_accel0-_-0"]))
            .expect("hand-over")
            .to_cdi_container_edits(),
    )
    .expect("json");
    assert_eq!(
        edits["mounts"],
        serde_json::json!([{"hostPath": "/opt/npu", "containerPath": "/opt/npu", "options": ["ro", "nosuid", "nodev", "bind"]}])
    );
    assert!(
        edits.get("env").is_none(),
        "no env key when there is none: {edits}"
    );
    assert_eq!(
        serde_json::to_value(handover::HandOver::default().to_cdi_container_edits()).expect("json"),
        serde_json::json!({})
    );
}
