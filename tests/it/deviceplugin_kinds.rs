//! The device kinds beside the GPU on the device-plugin path, over real unix sockets against
//! the sandbox kubelet and API server: RDMA HCAs from the recorded HGX H100 tree
//! (`tests/fixtures/rdma/hgx-h100-8gpu-roce`, 8 GPUs with that tree's PCI bus ids) and generic
//! devices declared in configuration over a fake `/dev`: each kind's registration and
//! re-registration, its ListAndWatch, Allocate checked device by device, unknown ids refused,
//! and the HCA GetPreferredAllocation picks for a pod holding GPU k (the one INDEX pairs it
//! with).

use gpushare::config::devices::GenericDeviceConfig;
use gpushare::deviceplugin::kinds::socket_name;
use gpushare::kubelet_api::deviceplugin::ContainerAllocateResponse;
use serde_json::{Value, json};

use crate::support::deviceplugin_cluster::{Cluster, cluster_on, node_yaml, pod_json};
use crate::support::fixture;
use crate::support::hgx::{HGX_NEAREST, dev_path as path, fake_dev, hgx_backend};
use crate::support::socket_dir::short_tempdir;
use crate::support::wait::wait_until;

const RDMA: &str = "gpushare.io/rdma";
const FUSE: &str = "example.com/fuse";
const SERIAL: &str = "example.com/serial";

struct Setup {
    c: Cluster,
    _dev: tempfile::TempDir,
}

async fn setup(rdma_shares: u32) -> Setup {
    let dev = short_tempdir();
    fake_dev(dev.path());
    let dev_root = dev.path().to_path_buf();
    let c = cluster_on(
        hgx_backend(),
        &node_yaml(""),
        |_| {},
        |config| {
            config.devices.sysfs_root = fixture("rdma/hgx-h100-8gpu-roce/sys");
            config.devices.dev_root = dev_root;
            config.devices.rdma.enabled = true;
            config.devices.rdma.shares_per_hca = rdma_shares;
            config.devices.generic = vec![
                GenericDeviceConfig {
                    resource: FUSE.to_string(),
                    paths: vec![path("/dev/fuse")],
                    shares: 3,
                    envs: Default::default(),
                    mounts: Vec::new(),
                },
                GenericDeviceConfig {
                    resource: SERIAL.to_string(),
                    paths: vec![path("/dev/ttyUSB*")],
                    shares: 1,
                    envs: [("SERIAL_BAUD".to_string(), "115200".to_string())].into(),
                    mounts: Vec::new(),
                },
            ];
        },
    )
    .await
    .expect("the sandbox cluster and device plugin start");
    for r in [RDMA, FUSE, SERIAL] {
        c.kubelet.wait_registered(r).await.expect("kind registered");
    }
    Setup { c, _dev: dev }
}

fn ids(c: &Cluster, resource: &str) -> Vec<String> {
    let mut v: Vec<String> = c
        .kubelet
        .devices(resource)
        .into_iter()
        .map(|d| d.id)
        .collect();
    v.sort();
    v
}

fn nodes(resp: &ContainerAllocateResponse) -> Vec<(String, String, String)> {
    resp.devices
        .iter()
        .map(|d| {
            (
                d.host_path.clone(),
                d.container_path.clone(),
                d.permissions.clone(),
            )
        })
        .collect()
}

fn rw(p: &str) -> (String, String, String) {
    (p.to_string(), p.to_string(), "rw".to_string())
}

#[tokio::test]
async fn each_kind_registers_its_own_resource_and_lists_one_device_per_share() {
    let Setup { c, _dev } = setup(2).await;
    let info = c.kubelet.plugin(RDMA).expect("registered");
    assert_eq!(info.endpoint, socket_name(RDMA));
    assert_eq!(info.endpoint, "gpushare-gpushare.io_rdma.sock");
    assert!(info.options.get_preferred_allocation_available);
    assert_eq!(
        c.kubelet.plugin(FUSE).expect("fuse").endpoint,
        "gpushare-example.com_fuse.sock"
    );
    // The GPU resource is unchanged beside them.
    assert_eq!(
        c.kubelet
            .plugin(gpushare::core::wire::RESOURCE_GPU_MEM)
            .expect("gpu")
            .endpoint,
        gpushare::core::wire::PLUGIN_SOCKET
    );
    // Twelve ACTIVE HCAs, two shares each.
    let rdma = ids(&c, RDMA);
    assert_eq!(rdma.len(), 24);
    for n in 0..12 {
        for s in 0..2 {
            assert!(rdma.contains(&format!("mlx5_{n}-_-{s}")), "mlx5_{n}-_-{s}");
        }
    }
    assert!(
        c.kubelet
            .devices(RDMA)
            .iter()
            .all(|d| d.health == gpushare::core::wire::HEALTHY)
    );
    assert_eq!(ids(&c, FUSE), ["fuse-_-0", "fuse-_-1", "fuse-_-2"]);
    // One device per matching node; ttyACM0 does not match.
    assert_eq!(ids(&c, SERIAL), ["ttyUSB0-_-0", "ttyUSB1-_-0"]);
    assert_eq!(
        c.plugin().kind_resources(),
        [RDMA.to_string(), FUSE.to_string(), SERIAL.to_string()]
    );

    // A kubelet restart: every kind registers again.
    c.kubelet.restart().await.expect("kubelet restarts");
    for r in [RDMA, FUSE, SERIAL] {
        wait_until("the kind registers again", || {
            c.kubelet.plugin(r).is_some_and(|p| p.registrations == 2)
        })
        .await;
        c.kubelet.wait_registered(r).await.expect("listed again");
    }
    assert_eq!(ids(&c, RDMA).len(), 24);
    c.stop().await;
}

#[tokio::test]
async fn allocate_hands_over_exactly_the_devices_named_and_refuses_unknown_ids() {
    let Setup { c, _dev } = setup(2).await;
    let resp = c
        .kubelet
        .allocate(RDMA, vec!["mlx5_3-_-1".into(), "mlx5_3-_-0".into()])
        .await
        .expect("allocated");
    let one = &resp.container_responses[0];
    // Two shares of one HCA: that HCA once, its uverbs node and the shared rdma_cm; no other
    // HCA's node.
    assert_eq!(
        nodes(one),
        [rw("/dev/infiniband/rdma_cm"), rw("/dev/infiniband/uverbs3")]
    );
    assert_eq!(
        one.envs.get("GPUSHARE_RDMA_DEVICES").map(String::as_str),
        Some("mlx5_3")
    );
    assert_eq!(
        one.envs.get("NCCL_IB_HCA").map(String::as_str),
        Some("=mlx5_3")
    );
    assert!(one.mounts.is_empty());

    let two = c
        .kubelet
        .allocate(RDMA, vec!["mlx5_10-_-0".into(), "mlx5_0-_-1".into()])
        .await
        .expect("allocated");
    let two = &two.container_responses[0];
    assert_eq!(
        nodes(two),
        [
            rw("/dev/infiniband/rdma_cm"),
            rw("/dev/infiniband/uverbs0"),
            rw("/dev/infiniband/uverbs10")
        ]
    );
    assert_eq!(
        two.envs.get("NCCL_IB_HCA").map(String::as_str),
        Some("=mlx5_10,mlx5_0")
    );

    // Ids that name no device of the kind: an HCA that does not exist, a share past the
    // count, another kind's id. Each is an error, never another device.
    for bad in ["mlx5_99-_-0", "mlx5_0-_-2", "fuse-_-0"] {
        let err = c
            .kubelet
            .allocate(RDMA, vec!["mlx5_1-_-0".into(), bad.into()])
            .await
            .expect_err(bad);
        assert!(
            err.to_string().contains("InvalidArgument") || err.to_string().contains("invalid"),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains(bad), "{bad}: {err}");
    }

    let fuse = c
        .kubelet
        .allocate(FUSE, vec!["fuse-_-2".into()])
        .await
        .expect("fuse");
    assert_eq!(nodes(&fuse.container_responses[0]), [rw("/dev/fuse")]);
    let serial = c
        .kubelet
        .allocate(SERIAL, vec!["ttyUSB1-_-0".into()])
        .await
        .expect("serial");
    let serial = &serial.container_responses[0];
    assert_eq!(nodes(serial), [rw("/dev/ttyUSB1")]);
    assert_eq!(
        serial.envs.get("SERIAL_BAUD").map(String::as_str),
        Some("115200")
    );
    assert!(
        c.kubelet
            .allocate(SERIAL, vec!["ttyACM0-_-0".into()])
            .await
            .is_err(),
        "a node the declaration does not match is no device"
    );
    c.stop().await;
}

/// A pod holding GPU `idx` (the extender's bind) whose container also asks one HCA.
fn training_pod(name: &str, idx: u32, t: u64) -> Value {
    let mut pod = pod_json(name, &[], &[("main", 8)], Some(idx), t);
    pod["spec"]["containers"][0]["resources"]["limits"][RDMA] = json!("1");
    pod
}

/// kubelet allocates pod `name`'s GPU memory (8 units to container `main`), and the plugin
/// sees the GPU handed over.
async fn allocate_gpu(c: &Cluster, name: &str) {
    c.kubelet
        .allocate_container(
            gpushare::core::wire::RESOURCE_GPU_MEM,
            "default",
            name,
            "main",
            8,
        )
        .await
        .expect("GPU allocated");
    wait_until("the plugin sees the GPU handed over", || {
        c.plugin()
            .watched_pod("default", name)
            .is_some_and(|a| a.assigned == Some(true))
    })
    .await;
}

#[tokio::test]
async fn a_pod_with_gpu_k_is_preferred_the_hca_behind_gpu_ks_switch() {
    let Setup { c, _dev } = setup(1).await;
    let mut got = Vec::new();
    for (k, want) in HGX_NEAREST.iter().enumerate() {
        let idx = u32::try_from(k).expect("k");
        let name = format!("train-{k}");
        c.api
            .create_object(training_pod(&name, idx, 100 + u64::from(idx)))
            .expect("pod created");
        wait_until("the plugin sees the pod", || {
            c.plugin().watched_pod("default", &name).is_some()
        })
        .await;
        // kubelet asks for the pod's resources in no fixed order: the HCA before the GPU for
        // even k, after it for odd k.
        if k % 2 == 1 {
            allocate_gpu(&c, &name).await;
        }
        let (chosen, resp) = c
            .kubelet
            .allocate_container(RDMA, "default", &name, "main", 1)
            .await
            .expect("HCA allocated");
        assert_eq!(chosen, [format!("{want}-_-0")], "GPU {k}");
        got.push(
            resp.envs
                .get("GPUSHARE_RDMA_DEVICES")
                .cloned()
                .unwrap_or_default(),
        );
        if k % 2 == 0 {
            allocate_gpu(&c, &name).await;
        }
    }
    assert_eq!(got, HGX_NEAREST);

    // Every ConnectX-7 held: a pod with GPU 1 gets the nearest HCA still free (a 100G
    // ConnectX-6 Dx on its NUMA node), not a refusal.
    c.api
        .create_object(training_pod("late", 1, 200))
        .expect("pod created");
    wait_until("the plugin sees the pod", || {
        c.plugin().watched_pod("default", "late").is_some()
    })
    .await;
    let (chosen, _) = c
        .kubelet
        .allocate_container(RDMA, "default", "late", "main", 1)
        .await
        .expect("HCA allocated");
    assert_eq!(chosen, ["mlx5_1-_-0"]);
    c.stop().await;
}

#[tokio::test]
async fn without_rdma_or_generic_devices_only_the_gpu_resource_registers() {
    let c = crate::support::deviceplugin_cluster::cluster("2x16GiB", |_| {}).await;
    assert!(c.plugin().kind_resources().is_empty());
    assert!(c.kubelet.plugin(RDMA).is_none());
    let dir = c.kubelet.device_plugin_dir();
    let socks: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("gpushare-"))
        .collect();
    assert!(socks.is_empty(), "{socks:?}");
    c.stop().await;
}

#[test]
fn a_refused_devices_section_exits_78_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("gpushare.toml");
    for (text, says) in [
        (
            "[devices.rdma]\nenabled = true\nshares_per_hca = 0\n",
            "shares_per_hca",
        ),
        (
            "[[devices.generic]]\nresource = \"example.com/fuse\"\npaths = [{ path = \"/etc/shadow\" }]\n",
            "under /dev",
        ),
        (
            "[devices.rdma]\nenabled = true\nresource = \"example.com/x\"\n\
             [[devices.generic]]\nresource = \"example.com/x\"\npaths = [{ path = \"/dev/fuse\" }]\n",
            "declared twice",
        ),
    ] {
        std::fs::write(&file, text).expect("write");
        let config = file.to_str().expect("utf-8");
        let out = crate::support::run(&["--config", config, "doctor"]);
        let err = crate::support::stderr(&out);
        assert_eq!(out.status.code(), Some(78), "{text}: {err}");
        assert!(
            err.contains("devices") && err.contains(says),
            "{text}: {err}"
        );
    }
    // Typed: the loader names the section's own error.
    std::fs::write(
        &file,
        "[devices.rdma]\nenabled = true\nshares_per_hca = 0\n",
    )
    .expect("write");
    let err = gpushare::config::load(Some(&file), gpushare::config::FlagOverrides::new())
        .expect_err("refused");
    assert!(
        matches!(
            err,
            gpushare::config::Error::Devices(gpushare::config::devices::DevicesConfigError::Rdma(
                gpushare::config::devices::RdmaConfigError::ZeroShares
            ))
        ),
        "{err}"
    );
}

/// kubelet written by others: Python grpcio (`tests/clients/kubelet_grpcio.py`) registers the
/// RDMA kind, lists it and allocates one HCA, checked device by device.
#[tokio::test]
async fn grpcio_kubelet_registers_lists_and_allocates_an_hca() {
    let Some(python) = crate::support::clients::grpcio_python() else {
        return;
    };
    let dir = short_tempdir();
    let dev = short_tempdir();
    fake_dev(dev.path());
    let api = gpushare_sandbox::apiserver::ApiServer::start()
        .await
        .expect("sandbox API server");
    api.seed_yaml(&node_yaml("")).expect("node seeded");
    let mut config = gpushare::config::Config::default();
    config.node.node_name = crate::support::deviceplugin_cluster::NODE.to_string();
    config.device_plugin.device_plugin_dir = dir.path().to_path_buf();
    config.device_plugin.state_dir = dir.path().join("state");
    config.device_plugin.pod_resources_socket = dir.path().join("no-pod-resources.sock");
    config.device_plugin.admin_address = String::new();
    config.doctor.skip = true;
    config.devices.sysfs_root = fixture("rdma/hgx-h100-8gpu-roce/sys");
    config.devices.dev_root = dev.path().to_path_buf();
    config.devices.rdma.enabled = true;
    let plugin = gpushare::deviceplugin::start(
        &config,
        api.admin_client(),
        std::sync::Arc::new(hgx_backend()),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("the device plugin starts");
    let args = ["--resource", RDMA, "--ids", "mlx5_3-_-0"];
    let (code, report, stderr) =
        crate::support::clients::device_plugin_kubelet_grpcio(&python, dir.path(), &args).await;
    plugin.stop().await;
    api.shutdown().await;
    assert_eq!(code, Some(0), "{report}\n{stderr}");
    assert_eq!(report["register"]["resource_name"], RDMA);
    assert_eq!(
        report["register"]["endpoint"],
        "gpushare-gpushare.io_rdma.sock"
    );
    assert_eq!(
        report["register"]["get_preferred_allocation_available"],
        true
    );
    assert_eq!(report["devices"], 12, "{report}");
    assert_eq!(report["healthy"], 12, "{report}");
    assert_eq!(
        report["allocate_devices"],
        json!([[
            ["/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"],
            ["/dev/infiniband/uverbs3", "/dev/infiniband/uverbs3", "rw"]
        ]]),
        "{report}"
    );
    assert_eq!(report["allocate"][0]["NCCL_IB_HCA"], "=mlx5_3", "{report}");
}
