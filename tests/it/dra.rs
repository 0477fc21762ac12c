//! The DRA path's pieces together over the sandbox: slices built by `gpushare::dra::slices`,
//! a pod rewritten by `gpushare::webhook::dra_rewrite`, allocated by the sandbox allocator (first fit,
//! consumable capacity, as upstream) and read back by `gpushare::dra::claims` — the same
//! `aliyun.com/gpu-mem` numbers per container, on one GPU, in the order the GPU policy chose.

use std::collections::BTreeMap;

use gpushare::core::wire::DRA_DRIVER_NAME;
use gpushare::core::{GpuMem, GpuPolicy, MemoryUnit};
use gpushare::dra::claims::{ClaimShare, NodeDevice, read_claim};
use gpushare::dra::slices::{Pool, SliceGpu, device_name};
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::DraAllocator;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::support::dra::create_gpu_device_class;
use crate::support::dra_node::submit;

const GIB: u64 = 1 << 30;

fn gpus(allocated: [u64; 2]) -> Vec<SliceGpu> {
    (0..2u32)
        .map(|i| SliceGpu {
            index: i,
            uuid: format!("GPU-{i}aaaaaaa-0000-0000-0000-000000000000"),
            product_name: "NVIDIA A10".into(),
            memory_bytes: 16 * GIB + (300 << 20),
            place: None,
            unhealthy: None,
            allocated_bytes: allocated[i as usize],
        })
        .collect()
}

fn devices() -> BTreeMap<String, NodeDevice> {
    gpus([0, 0])
        .iter()
        .map(|g| {
            (
                device_name(g),
                NodeDevice {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    memory_bytes: 16 * GIB,
                },
            )
        })
        .collect()
}

/// Publishes the pool (replacing the slices) through the sandbox's store when the devices
/// changed; whether they did.
fn publish(server: &ApiServer, pool: &mut Pool, policy: GpuPolicy, allocated: [u64; 2]) -> bool {
    let Some(slices) = pool.update(
        "node-a",
        DRA_DRIVER_NAME,
        Some("550.54.15"),
        MemoryUnit::GIB,
        policy,
        &gpus(allocated),
        &[],
    ) else {
        return false;
    };
    for s in slices {
        let name = s.metadata.name.clone().expect("a name");
        let _ = server.delete_object("resourceslices", None, &name);
        server
            .create_object(serde_json::to_value(&s).expect("json"))
            .expect("the API server stores the slice");
    }
    true
}

/// The shares of the pod's claim, read as the plugin will read them.
fn shares(server: &ApiServer, pod: &str) -> Vec<ClaimShare> {
    let p: Pod = server
        .get_as("pods", Some("default"), pod)
        .expect("the pod");
    let claim_name = p
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|s| s[0].resource_claim_name.clone())
        .expect("the pod's claim");
    let claim: ResourceClaim = server
        .get_as("resourceclaims", Some("default"), &claim_name)
        .expect("the claim");
    read_claim(
        &claim,
        DRA_DRIVER_NAME,
        "node-a",
        &devices(),
        &BTreeMap::new(),
        MemoryUnit::GIB,
    )
    .expect("the claim reads")
    .gpus
}

async fn cluster() -> ApiServer {
    let server = ApiServer::start().await.expect("starts");
    create_gpu_device_class(&server);
    server
}

#[tokio::test]
async fn a_rewritten_pod_gets_its_gpu_mem_per_container_on_one_gpu() {
    let server = cluster().await;
    let mut pool = Pool::new();
    assert!(publish(&server, &mut pool, GpuPolicy::Binpack, [0, 0]));
    submit(&server, "p1", 6, 2);
    crate::support::dra::allocate_one(&server).await;
    let s = shares(&server, "p1");
    let got: Vec<(&str, GpuMem, &str)> = s
        .iter()
        .map(|s| (s.request.as_str(), s.units, s.uuid.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("main", GpuMem::new(6), s[0].uuid.as_str()),
            ("side", GpuMem::new(2), s[0].uuid.as_str())
        ],
        "both containers on one GPU, each with its own amount"
    );
    assert!(s.iter().all(|x| x.share_id.is_some()));
    assert_ne!(s[0].share_id, s[1].share_id);
}

/// First fit over the slice order: binpack (fullest first) puts the second pod beside the
/// first, spread (emptiest first) on the other GPU.
#[tokio::test]
async fn the_gpu_policy_orders_the_slice_and_first_fit_follows_it() {
    for (policy, same_gpu) in [(GpuPolicy::Binpack, true), (GpuPolicy::Spread, false)] {
        let server = cluster().await;
        let allocator = DraAllocator::new(server.admin_client());
        let mut pool = Pool::new();
        assert!(publish(&server, &mut pool, policy, [0, 0]));
        submit(&server, "p1", 3, 1);
        allocator.reconcile().await.expect("a pass");
        let first = shares(&server, "p1");
        let used = first[0].index as usize;
        let mut allocated = [0; 2];
        allocated[used] = 4 * GIB;
        // Binpack keeps the used GPU first (nothing to publish); spread moves it last.
        assert_eq!(publish(&server, &mut pool, policy, allocated), !same_gpu);
        assert_eq!(pool.generation(), if same_gpu { 1 } else { 2 });
        submit(&server, "p2", 3, 1);
        allocator.reconcile().await.expect("a pass");
        let second = shares(&server, "p2");
        assert_eq!(second[0].uuid == first[0].uuid, same_gpu, "{policy}");
    }
}
