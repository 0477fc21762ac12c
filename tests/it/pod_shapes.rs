//! One table of pod shapes (app containers, plain init containers, native sidecars) on one
//! 16 GiB GPU, on both paths: the extender's filter over HTTP (what the extender path places)
//! and the webhook's DRA rewrite allocated by the sandbox allocator (what kube-scheduler's DRA
//! plugin places). Each shape fits on both paths or on neither, and the claim asks exactly the
//! memory the extender path counts: a plain init container counts as max(init, what runs
//! beside it), a sidecar with the app containers.

use gpushare::core::wire::{DRA_DEVICE_CLASS, DRA_DRIVER_NAME, RESOURCE_GPU_MEM};
use gpushare::core::{GpuPolicy, MemoryUnit};
use gpushare::dra::slices::{SliceGpu, build_slices};
use gpushare_sandbox::dra_allocator::{Features, NodeView, Usage, allocate_pod};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use serde_json::{Value, json};

use crate::support::extender_sandbox::{self, Env};
use crate::support::{dra_node, extender_http};

const GIB: u64 = 1 << 30;

/// A container of a shape: name, GiB, kind.
#[derive(Clone, Copy)]
enum C {
    /// An app container.
    App(&'static str, u64),
    /// A plain init container (runs to completion before the app containers).
    Init(&'static str, u64),
    /// A native sidecar (an init container with `restartPolicy: Always`).
    Sidecar(&'static str, u64),
}

/// The shapes: containers in spec order, the memory the extender path counts, whether that
/// fits 16 GiB.
const SHAPES: &[(&str, &[C], u64)] = &[
    ("one app container", &[C::App("main", 10)], 10),
    ("two app containers", &[C::App("a", 6), C::App("b", 8)], 14),
    (
        "init, sidecar, app: the init does not add",
        &[
            C::Init("prep", 10),
            C::Sidecar("log", 2),
            C::App("main", 10),
        ],
        12,
    ),
    (
        "a sidecar before the init runs beside it",
        &[C::Sidecar("log", 4), C::Init("prep", 10), C::App("main", 6)],
        14,
    ),
    (
        "an init larger than every app container",
        &[C::Init("prep", 14), C::App("main", 2)],
        14,
    ),
    (
        "an init as large as the app containers together",
        &[
            C::Init("prep", 12),
            C::App("a", 4),
            C::App("b", 4),
            C::App("c", 4),
        ],
        12,
    ),
    (
        "an init before a sidecar does not run beside it",
        &[C::Init("prep", 13), C::Sidecar("log", 4), C::App("main", 2)],
        13,
    ),
    (
        "two inits, the larger counts",
        &[C::Init("a", 8), C::Init("b", 15), C::App("main", 1)],
        15,
    ),
    (
        "sidecars add to the app containers",
        &[C::Sidecar("s1", 4), C::Sidecar("s2", 4), C::App("main", 9)],
        17,
    ),
    (
        "an init larger than the GPU",
        &[C::Init("prep", 17), C::App("main", 1)],
        17,
    ),
    ("inits only", &[C::Init("a", 3), C::Init("b", 5)], 5),
];

fn pod(name: &str, containers: &[C]) -> Value {
    let c = |n: &str, gib: u64| {
        json!({ "name": n, "image": "x",
            "resources": { "limits": { RESOURCE_GPU_MEM: gib.to_string() } } })
    };
    let mut init = Vec::new();
    let mut app = Vec::new();
    for x in containers {
        match *x {
            C::App(n, g) => app.push(c(n, g)),
            C::Init(n, g) => init.push(c(n, g)),
            C::Sidecar(n, g) => {
                let mut s = c(n, g);
                s["restartPolicy"] = json!("Always");
                init.push(s);
            }
        }
    }
    if app.is_empty() {
        app.push(json!({ "name": "idle", "image": "x" }));
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default", "uid": format!("uid-{name}") },
        "spec": { "initContainers": init, "containers": app },
    })
}

/// Whether the extender's filter passes the node for `pod`.
async fn extender_fits(addr: std::net::SocketAddr, pod: &Value) -> bool {
    let (status, answer) = extender_http::post(
        addr,
        "/gpushare-scheduler/filter",
        &json!({ "Pod": pod, "NodeNames": ["n1"] }),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    answer["NodeNames"]
        .as_array()
        .is_some_and(|n| n.iter().any(|n| n == "n1"))
}

/// The memory the rewritten pod's claim asks (bytes), and whether the sandbox allocator places
/// it on one free 16 GiB GPU.
fn dra_asks_and_fits(pod: &Value) -> (u64, bool) {
    let pod: Pod = serde_json::from_value(pod.clone()).expect("a pod");
    let r = dra_node::rewritten(&pod);
    let spec = r
        .template
        .spec
        .clone()
        .and_then(|s| s.spec)
        .expect("a claim spec");
    let asks: u64 = spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
        .filter_map(|q| q.exactly.as_ref()?.capacity.as_ref()?.requests.as_ref())
        .filter_map(|r| r.get("memory")?.0.parse::<u64>().ok())
        .sum();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": "c", "namespace": "default" },
        "spec": serde_json::to_value(&spec).expect("json"),
    }))
    .expect("a claim");
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": DRA_DEVICE_CLASS },
        "spec": { "selectors": [{ "cel": { "expression":
            gpushare::core::wire::dra_gpu_class_selector(DRA_DRIVER_NAME) } }] },
    }))
    .expect("a class");
    let gpu = SliceGpu {
        index: 0,
        uuid: "GPU-0aaaaaaa-0000-0000-0000-000000000000".into(),
        product_name: "x".into(),
        memory_bytes: 16 * GIB,
        place: None,
        unhealthy: None,
        allocated_bytes: 0,
    };
    let slices = build_slices(
        "n1",
        DRA_DRIVER_NAME,
        None,
        MemoryUnit::GIB,
        GpuPolicy::Binpack,
        &[gpu],
        &[],
        1,
    );
    let mut n = 0;
    let fits = allocate_pod(
        &[claim],
        &[class],
        &slices,
        &[NodeView {
            name: "n1".into(),
            labels: Default::default(),
        }],
        &Usage::default(),
        &Features::default(),
        Some("n1"),
        &mut || {
            n += 1;
            format!("s{n}")
        },
    )
    .is_ok();
    (asks, fits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_table_of_pod_shapes_fits_alike_on_both_paths() {
    let Env { api, ext } = Env::start_with(extender_sandbox::config(), |api| {
        let res = json!({ RESOURCE_GPU_MEM: "16", "aliyun.com/gpu-count": "1" });
        api.create_object(json!({ "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": "n1" }, "status": { "capacity": res, "allocatable": res } }))
            .expect("the node");
    })
    .await;

    let mut wrong = Vec::new();
    for (i, (what, containers, counted)) in SHAPES.iter().enumerate() {
        let p = pod(&format!("p{i}"), containers);
        let extender = extender_fits(ext.addr, &p).await;
        let (asks, dra) = dra_asks_and_fits(&p);
        let want = *counted <= 16;
        if extender != want || dra != want || asks != counted * GIB {
            wrong.push(format!(
                "{what}: counted {counted} GiB (fits: {want}); extender fits: {extender}; \
                 DRA asks {} GiB, fits: {dra}",
                asks as f64 / GIB as f64
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "the paths disagree:\n{}",
        wrong.join("\n")
    );
    ext.stop().await;
    api.shutdown().await;
}
