//! Every chart mode installed as rendered and run ([`crate::support::chart_install`]): the
//! chart rendered by the real Helm engine, every object checked against each Kubernetes
//! version's schema (1.34 on) and created in the sandbox API server (authentication, RBAC,
//! admission and `resource.k8s.io` validation as a cluster does them), each role started as
//! the binary with exactly its container's arguments and environment under its
//! ServiceAccount's token, and GPU pods taken from their spec to their containers'
//! environment on every path the mode offers ([`crate::support::chart_workloads`]): one
//! container; init, native sidecar and app containers; an HCA and a generic device where the
//! mode has them. A role that exits, a request a role is refused, a pod not routed or not
//! rewritten, a claim that cannot be allocated fails with the object it goes back to.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{Value, json};

use crate::support::chart_install::{ChartCluster, Mode, SimNodeSpec};
use crate::support::chart_workloads::{
    GpuContainer, Handed, gpu_pod, on_dra_path, on_extender_path,
};
use crate::support::container_mapping::{Mounts, map_value};
use crate::support::helm_chart::merged;

const EXT_NODE: &str = "gpu-node-ext";
const DRA_NODE: &str = "gpu-node-dra";
const EXT_NS: &str = "train-ext";
const DRA_NS: &str = "train-dra";

/// The values every mode starts from: an image of the user's registry, fake GPUs (the build
/// machine has none), both admission policies rendered (the sandbox enforces them).
fn base_values() -> Value {
    json!({
        "image": { "repository": "registry.example.com/gpushare", "tag": "0.0.0-test" },
        "devicePlugin": {
            "gpuBackend": "fake",
            "fakeGpus": "2x16GiB",
            "admissionPolicy": { "enabled": true },
        },
        "dra": { "admissionPolicy": { "enabled": true } },
    })
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A mode over the base values: `overlay` merged in; a device-plugin node, and with
/// `dra.enabled` a DRA node and a namespace on each path.
fn mode(name: &str, overlay: Value) -> Mode {
    let base = yaml_serde::to_value(base_values()).expect("yaml");
    let values = merged(&base, &yaml_serde::to_value(&overlay).expect("yaml"));
    let values: Value = serde_json::to_value(values).expect("json");
    let dra = values["dra"]["enabled"] == true;
    let mut nodes = vec![SimNodeSpec {
        name: EXT_NODE.into(),
        labels: labels(&[("gpushare", "true")]),
    }];
    let mut namespaces = vec![(
        EXT_NS.to_string(),
        if dra {
            labels(&[("gpushare.io/gpu-mem-path", "extender")])
        } else {
            BTreeMap::new()
        },
    )];
    if dra {
        nodes.push(SimNodeSpec {
            name: DRA_NODE.into(),
            labels: labels(&[("gpushare", "true"), ("gpushare.io/gpu-mem-path", "dra")]),
        });
        namespaces.push((
            DRA_NS.to_string(),
            labels(&[("gpushare.io/gpu-mem-path", "dra")]),
        ));
    }
    Mode {
        name: name.to_string(),
        values,
        nodes,
        namespaces,
        sysfs: None,
        dev: None,
    }
}

/// One GPU container, and init + native sidecar + two app containers, all asking GPU memory,
/// with what each container is handed: its own units, except a plain init container on the DRA
/// path (`dra`), which adds nothing to the claim and is bound to the largest request free while
/// it runs (here `main`'s: docs/dra.md).
fn pods(ns: &str, unit_scale: u64, dra: bool) -> Vec<(Value, Vec<(&'static str, u64)>)> {
    let u = |n: u64| n * unit_scale;
    let single = [GpuContainer::app("main", u(2))];
    let mut init = GpuContainer::app("init", u(1));
    init.init = true;
    let mut sidecar = GpuContainer::app("sidecar", u(1));
    sidecar.init = true;
    sidecar.sidecar = true;
    let several = [
        init,
        sidecar,
        GpuContainer::app("main", u(3)),
        GpuContainer::app("helper", u(1)),
    ];
    let expect = |cs: &[GpuContainer]| {
        cs.iter()
            .map(|c| match c.name {
                "init" if dra => (c.name, u(3)),
                _ => (c.name, c.units),
            })
            .collect::<Vec<_>>()
    };
    vec![
        (gpu_pod("one", ns, &single), expect(&single)),
        (gpu_pod("several", ns, &several), expect(&several)),
    ]
}

/// Every GPU container got its GPU and its memory (in units), and the containers of one pod
/// share one GPU.
fn assert_gpu_handed(mode: &str, pod: &str, got: &BTreeMap<String, Handed>, want: &[(&str, u64)]) {
    let mut gpus = Vec::new();
    for (container, units) in want {
        let h = got
            .get(*container)
            .unwrap_or_else(|| panic!("{mode}: {pod} {container} was handed nothing: {got:?}"));
        let env = |k: &str| h.env.get(k).cloned().unwrap_or_else(|| "<unset>".into());
        assert!(
            !env("NVIDIA_VISIBLE_DEVICES").contains("no-gpu-has"),
            "{mode}: {pod} {container}: {:?}",
            h.env
        );
        assert_ne!(
            env("NVIDIA_VISIBLE_DEVICES"),
            "<unset>",
            "{mode}: {pod} {container}: {:?}",
            h.env
        );
        assert_eq!(
            env("ALIYUN_COM_GPU_MEM_CONTAINER"),
            units.to_string(),
            "{mode}: {pod} {container}: {:?}",
            h.env
        );
        gpus.push(env("ALIYUN_COM_GPU_MEM_IDX"));
    }
    gpus.dedup();
    assert_eq!(
        gpus.len(),
        1,
        "{mode}: the containers of {pod} share one GPU: {gpus:?}"
    );
}

async fn run_extender_pods(c: &ChartCluster, scale: u64) {
    for (pod, want) in pods(EXT_NS, scale, false) {
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let got = on_extender_path(c, &pod).await;
        assert_gpu_handed(
            &c.mode.name,
            &format!("{EXT_NS}/{name} (extender path)"),
            &got,
            &want,
        );
    }
}

async fn run_dra_pods(c: &ChartCluster, scale: u64) {
    for (pod, want) in pods(DRA_NS, scale, true) {
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let got = on_dra_path(c, &pod).await;
        assert_gpu_handed(
            &c.mode.name,
            &format!("{DRA_NS}/{name} (DRA path)"),
            &got,
            &want,
        );
    }
}

#[test]
fn the_mapping_table_maps_paths_by_the_longest_mount_and_container_ports() {
    let m = Mounts::new(
        vec![
            (PathBuf::from("/var/lib/kubelet"), PathBuf::from("/h/k")),
            (
                PathBuf::from("/var/lib/kubelet/plugins/x"),
                PathBuf::from("/h/p"),
            ),
        ],
        PathBuf::from("/r"),
    );
    let ports = BTreeMap::from([(9102, 40000)]);
    for (value, mapped) in [
        (
            "--plugin-dir=/var/lib/kubelet/plugins/x",
            "--plugin-dir=/h/p",
        ),
        ("/var/lib/kubelet/a.sock", "/h/k/a.sock"),
        ("--config=/etc/x.toml", "--config=/r/etc/x.toml"),
        (
            "--cdi-spec-dirs=/etc/cdi,/var/lib/kubelet/cdi",
            "--cdi-spec-dirs=/r/etc/cdi,/h/k/cdi",
        ),
        (
            "--admin-address=0.0.0.0:9102",
            "--admin-address=0.0.0.0:40000",
        ),
        ("--port=9102", "--port=40000"),
        ("--port=9103", "--port=9103"),
        ("--memory-unit=GiB", "--memory-unit=GiB"),
        ("--scheduler-name=", "--scheduler-name="),
        ("dra-plugin", "dra-plugin"),
    ] {
        assert_eq!(map_value(value, &m, &ports), mapped, "{value}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extender_mode() {
    let Some(c) = ChartCluster::install(mode("extender", json!({}))).await else {
        return;
    };
    run_extender_pods(&c, 1).await;
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dedicated_mode() {
    let Some(c) = ChartCluster::install(mode(
        "dedicated",
        json!({ "scheduler": { "mode": "dedicated" } }),
    ))
    .await
    else {
        return;
    };
    run_extender_pods(&c, 1).await;
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extender_mode_with_dra() {
    let Some(c) = ChartCluster::install(mode(
        "extender + DRA",
        json!({ "dra": { "enabled": true } }),
    ))
    .await
    else {
        return;
    };
    run_extender_pods(&c, 1).await;
    run_dra_pods(&c, 1).await;
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dedicated_mode_with_dra() {
    let Some(c) = ChartCluster::install(mode(
        "dedicated + DRA",
        json!({ "scheduler": { "mode": "dedicated" }, "dra": { "enabled": true } }),
    ))
    .await
    else {
        return;
    };
    run_extender_pods(&c, 1).await;
    run_dra_pods(&c, 1).await;
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dra_with_another_driver_name() {
    let Some(c) = ChartCluster::install(mode(
        "DRA with driver example.com",
        json!({ "dra": { "enabled": true, "driverName": "gpu.example.com" } }),
    ))
    .await
    else {
        return;
    };
    run_dra_pods(&c, 1).await;
    let slices = c.api.list_objects("resourceslices", None);
    assert!(
        !slices.is_empty()
            && slices
                .iter()
                .all(|s| s["spec"]["driver"] == "gpu.example.com"),
        "{slices:?}"
    );
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mib_units_on_both_paths() {
    let Some(c) = ChartCluster::install(mode(
        "memoryUnit=MiB",
        json!({ "dra": { "enabled": true }, "devicePlugin": { "memoryUnit": "MiB" } }),
    ))
    .await
    else {
        return;
    };
    run_extender_pods(&c, 1024).await;
    run_dra_pods(&c, 1024).await;
    c.finish().await;
}

/// A pod asking GPU memory, an HCA and a generic device in one container.
fn hca_pod(ns: &str) -> Value {
    let mut c = GpuContainer::app("main", 4);
    c.devices = vec![
        ("gpushare.io/rdma".into(), 1),
        ("example.com/fuse".into(), 1),
    ];
    gpu_pod("with-hca", ns, &[c])
}

fn assert_devices_handed(mode: &str, pod: &str, got: &BTreeMap<String, Handed>) {
    assert_gpu_handed(mode, pod, got, &[("main", 4)]);
    let nodes = &got["main"].device_nodes;
    assert!(
        nodes
            .iter()
            .any(|n| n.starts_with("/dev/infiniband/uverbs")),
        "{mode}: {pod} gets its HCA: {nodes:?}"
    );
    assert!(
        nodes.iter().any(|n| n == "/dev/fuse"),
        "{mode}: {pod} gets /dev/fuse: {nodes:?}"
    );
}

/// RDMA HCAs and a generic device beside the GPUs, on both paths: the recorded HGX H100 tree
/// as every node's sysfs and `/dev/infiniband`, the fake GPUs at its GPUs' PCI addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rdma_and_generic_devices_on_both_paths() {
    let mut m = mode(
        "RDMA and generic devices",
        json!({
            "dra": { "enabled": true },
            "devicePlugin": { "fakeGpus": "80GiB@00000000:19:00.0,80GiB@00000000:3B:00.0" },
            "config": { "devices": {
                "rdma": { "enabled": true },
                "generic": [ { "resource": "example.com/fuse", "paths": [ { "path": "/dev/fuse" } ] } ],
            } },
        }),
    );
    m.sysfs = Some(crate::support::fixture("rdma/hgx-h100-8gpu-roce/sys"));
    m.dev = Some(crate::support::hgx::fake_dev);
    let Some(c) = ChartCluster::install(m).await else {
        return;
    };
    run_extender_pods(&c, 1).await;
    let got = on_extender_path(&c, &hca_pod(EXT_NS)).await;
    assert_devices_handed(&c.mode.name, "the HCA pod (extender path)", &got);
    run_dra_pods(&c, 1).await;
    let got = on_dra_path(&c, &hca_pod(DRA_NS)).await;
    assert_devices_handed(&c.mode.name, "the HCA pod (DRA path)", &got);
    c.finish().await;
}

/// The webhook with a certificate of the user's own (`webhook.tls.existingSecret`, what
/// cert-manager makes; the harness plays cert-manager), on both paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn webhook_with_an_existing_secret() {
    let Some(c) = ChartCluster::install(mode(
        "webhook.tls.existingSecret",
        json!({
            "scheduler": { "mode": "dedicated" },
            "dra": { "enabled": true },
            "webhook": { "tls": {
                "existingSecret": "gpushare-webhook-cert",
                "injectCaFrom": "kube-system/gpushare-webhook",
            } },
        }),
    ))
    .await
    else {
        return;
    };
    run_extender_pods(&c, 1).await;
    run_dra_pods(&c, 1).await;
    assert!(
        c.api
            .get_object("secrets", Some("kube-system"), "gpushare-webhook-tls")
            .is_none(),
        "no self-signed Secret with a certificate of the user's own"
    );
    c.finish().await;
}

/// `skipDoctor`: no role runs its preflight, and everything still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skip_doctor() {
    let Some(c) = ChartCluster::install(mode(
        "skipDoctor",
        json!({ "skipDoctor": true, "dra": { "enabled": true } }),
    ))
    .await
    else {
        return;
    };
    for p in &c.pods {
        let log = p.process.log();
        assert!(
            !log.contains("gpushare doctor (role:"),
            "{} ran its preflight: {log}",
            p.workload
        );
    }
    let roles: Vec<&str> = c.pods.iter().map(|p| p.role.as_str()).collect();
    for role in ["extender", "device-plugin", "dra-plugin", "webhook"] {
        assert!(roles.contains(&role), "{role} runs: {roles:?}");
    }
    run_extender_pods(&c, 1).await;
    run_dra_pods(&c, 1).await;
    c.finish().await;
}
