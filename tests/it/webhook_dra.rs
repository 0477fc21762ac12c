//! The webhook's DRA mode over the sandbox API server (which calls the webhooks on pod create
//! as kube-apiserver does): a gpu-mem pod in a DRA namespace is rewritten into one claim from
//! a template the webhook creates, and the sandbox allocator places that claim on one GPU; the
//! namespace label `gpushare.io/gpu-mem-path` wins over `webhook.gpu_mem_path` both ways; a
//! dry run creates nothing; a pod with claims is left alone; a lost create answer of the
//! template is settled by reading it.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use gpushare::config::{Config, GpuMemPath};
use gpushare::core::wire::{DRA_DRIVER_NAME, DRA_POD_CLAIM};
use gpushare::core::{GpuPolicy, MemoryUnit};
use gpushare::dra::slices::{Pool, SliceGpu};
use gpushare::shutdown::Shutdown;
use gpushare::webhook::{self, WebhookHandle};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};

use crate::support::dra::create_gpu_device_class;

const GIB: u64 = 1 << 30;

/// The sandbox with our two webhook configurations (`sideEffects: NoneOnDryRun`), a webhook
/// serving `default_path`, the DeviceClass, and the namespaces `dra-ns`, `ext-ns` (labelled)
/// and `plain-ns` (no label).
async fn cluster(default_path: GpuMemPath) -> (ApiServer, WebhookHandle) {
    cluster_with(default_path, |_| {}).await
}

async fn cluster_with(
    default_path: GpuMemPath,
    tweak: impl FnOnce(&mut Config),
) -> (ApiServer, WebhookHandle) {
    let api = ApiServer::start().await.expect("sandbox");
    for (kind, path) in [
        ("MutatingWebhookConfiguration", "/mutate"),
        ("ValidatingWebhookConfiguration", "/validate"),
    ] {
        api.create_object(json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
            "metadata": { "name": "gpushare-webhook" },
            "webhooks": [{
                "name": format!("{}.gpushare.io", &path[1..]),
                "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                "timeoutSeconds": 10, "failurePolicy": "Fail",
                "clientConfig": { "service": { "namespace": "kube-system", "name": "gpushare-webhook", "path": path, "port": 443 } },
                "rules": [{ "operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced" }],
            }],
        }))
        .expect("webhook configuration seeded");
    }
    for (ns, label) in [
        ("dra-ns", Some("dra")),
        ("ext-ns", Some("extender")),
        ("plain-ns", None),
    ] {
        let mut object =
            json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": ns } });
        if let Some(l) = label {
            object["metadata"]["labels"] = json!({ "gpushare.io/gpu-mem-path": l });
        }
        api.create_object(object).expect("namespace");
    }
    create_gpu_device_class(&api);
    let mut c = Config::default();
    c.webhook.bind_address = [127, 0, 0, 1].into();
    c.webhook.port = 0;
    c.webhook.self_signed = true;
    c.webhook.gpu_mem_path = default_path;
    c.cluster.kubeconfig = api.admin_kubeconfig_path().display().to_string();
    tweak(&mut c);
    // The client `gpushare webhook` builds for itself.
    let client = webhook::api_client(&c).await.expect("the webhook's client");
    let hook = webhook::start(
        &c,
        Some(client),
        webhook::DEFAULT_REFRESH,
        Shutdown::never(),
    )
    .await
    .expect("webhook starts");
    api.route_service("kube-system", "gpushare-webhook", hook.addr);
    (api, hook)
}

fn two_container_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "containers": [
            { "name": "main", "image": "cuda", "resources": { "limits": { "aliyun.com/gpu-mem": "6" } } },
            { "name": "side", "image": "cuda", "resources": { "limits": { "aliyun.com/gpu-mem": "2" } } },
        ] },
    }))
    .expect("a pod")
}

async fn create(api: &ApiServer, ns: &str, pod: &Pod) -> Pod {
    let pods: Api<Pod> = Api::namespaced(api.admin_client(), ns);
    pods.create(&PostParams::default(), pod)
        .await
        .expect("the pod is admitted")
}

fn claims(pod: &Pod) -> Vec<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.name)
        .collect()
}

fn scheduler(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.scheduler_name.clone())
}

fn templates(api: &ApiServer, ns: &str) -> Vec<Value> {
    api.list_objects("resourceclaimtemplates", Some(ns))
}

/// Publishes a two-GPU node's slice (16 GiB each).
fn publish(api: &ApiServer) {
    let gpus: Vec<SliceGpu> = (0..2u32)
        .map(|i| SliceGpu {
            index: i,
            uuid: format!("GPU-{i}bbbbbbb-0000-0000-0000-000000000000"),
            product_name: "NVIDIA A10".into(),
            memory_bytes: 16 * GIB,
            place: None,
            unhealthy: None,
            allocated_bytes: 0,
        })
        .collect();
    let slices = Pool::new()
        .update(
            "node-a",
            DRA_DRIVER_NAME,
            Some("550.54.15"),
            MemoryUnit::GIB,
            GpuPolicy::Binpack,
            &gpus,
            &[],
        )
        .expect("slices");
    for s in slices {
        api.create_object(serde_json::to_value(&s).expect("json"))
            .expect("the slice is stored");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_mem_pod_becomes_one_claim_that_the_allocator_places_on_one_gpu() {
    let (api, hook) = cluster(GpuMemPath::Dra).await;
    publish(&api);
    let created = create(&api, "plain-ns", &two_container_pod("train")).await;
    assert_eq!(claims(&created), [DRA_POD_CLAIM]);
    assert_eq!(
        scheduler(&created),
        None,
        "the DRA path keeps kube-scheduler"
    );
    for c in &created.spec.as_ref().expect("spec").containers {
        let res = c.resources.as_ref().expect("resources");
        assert!(res.limits.is_none(), "no gpu-mem left: {res:?}");
        assert_eq!(
            res.claims.as_ref().expect("bound")[0].request.as_deref(),
            Some(c.name.as_str())
        );
    }
    let t = templates(&api, "plain-ns");
    assert_eq!(t.len(), 1, "{t:?}");
    let requests = &t[0]["spec"]["spec"]["devices"]["requests"];
    assert_eq!(
        requests[0]["exactly"]["capacity"]["requests"]["memory"],
        (6 * GIB).to_string()
    );
    assert_eq!(
        requests[1]["exactly"]["capacity"]["requests"]["memory"],
        (2 * GIB).to_string()
    );
    crate::support::dra::allocate_one(&api).await;
    let claim_name = api
        .get_as::<Pod>("pods", Some("plain-ns"), "train")
        .and_then(|p| p.status)
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|s| s[0].resource_claim_name.clone())
        .expect("the pod's claim");
    let claim: ResourceClaim = api
        .get_as("resourceclaims", Some("plain-ns"), &claim_name)
        .expect("the claim");
    let results = claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0].device, results[1].device, "both on one GPU");
    let consumed: Vec<String> = results
        .iter()
        .map(|r| {
            r.consumed_capacity.as_ref().expect("consumed")["memory"]
                .0
                .clone()
        })
        .collect();
    assert_eq!(consumed, ["6Gi", "2Gi"], "each container its own amount");
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespace_label_wins_over_the_cluster_path_both_ways() {
    for (default_path, unlabelled_dra) in [(GpuMemPath::Extender, false), (GpuMemPath::Dra, true)] {
        let (api, hook) = cluster(default_path).await;
        let dra = create(&api, "dra-ns", &two_container_pod("a")).await;
        assert_eq!(claims(&dra), [DRA_POD_CLAIM], "{default_path:?}");
        assert_eq!(scheduler(&dra), None);
        let ext = create(&api, "ext-ns", &two_container_pod("b")).await;
        assert!(claims(&ext).is_empty(), "{default_path:?}");
        assert_eq!(scheduler(&ext).as_deref(), Some("gpushare-scheduler"));
        let plain = create(&api, "plain-ns", &two_container_pod("c")).await;
        assert_eq!(!claims(&plain).is_empty(), unlabelled_dra);
        assert_eq!(scheduler(&plain).is_some(), !unlabelled_dra);
        assert!(templates(&api, "ext-ns").is_empty());
        hook.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_is_rewritten_but_creates_nothing() {
    let (api, hook) = cluster(GpuMemPath::Dra).await;
    let pods: Api<Pod> = Api::namespaced(api.admin_client(), "dra-ns");
    let answered = pods
        .create(
            &PostParams {
                dry_run: true,
                ..PostParams::default()
            },
            &two_container_pod("try"),
        )
        .await
        .expect("the dry run is admitted");
    assert_eq!(
        claims(&answered),
        [DRA_POD_CLAIM],
        "the answer shows the rewrite"
    );
    assert!(templates(&api, "dra-ns").is_empty(), "no template created");
    assert!(api.get_object("pods", Some("dra-ns"), "try").is_none());
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_names_claims_is_left_alone() {
    let (api, hook) = cluster(GpuMemPath::Dra).await;
    let mut pod = two_container_pod("mine");
    if let Some(s) = pod.spec.as_mut() {
        s.resource_claims = Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
            name: "own".into(),
            resource_claim_name: Some("someone-elses".into()),
            resource_claim_template_name: None,
        }]);
    }
    let created = create(&api, "dra-ns", &pod).await;
    assert_eq!(claims(&created), ["own"]);
    let limits = created.spec.as_ref().expect("spec").containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .expect("limits kept");
    assert_eq!(limits["aliyun.com/gpu-mem"].0, "6");
    assert_eq!(scheduler(&created), None);
    assert!(templates(&api, "dra-ns").is_empty());
    hook.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_to_the_template_create_is_settled_by_reading_it() {
    let (api, hook) = cluster(GpuMemPath::Dra).await;
    api.inject(Fault::new(
        Some(http::Method::POST),
        "/resourceclaimtemplates",
        FaultAction::ApplyThenDrop,
    ));
    let created = create(&api, "dra-ns", &two_container_pod("lost")).await;
    assert_eq!(claims(&created), [DRA_POD_CLAIM]);
    assert_eq!(templates(&api, "dra-ns").len(), 1);
    let template_calls: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.path.contains("/resourceclaimtemplates"))
        .map(|r| r.method.to_string())
        .collect();
    assert_eq!(
        template_calls,
        ["POST", "GET"],
        "one create, its lost answer settled by one read"
    );
    // The next pod of the same shape finds the template there (AlreadyExists is fine).
    let again = create(&api, "dra-ns", &two_container_pod("again")).await;
    assert_eq!(claims(&again), [DRA_POD_CLAIM]);
    assert_eq!(templates(&api, "dra-ns").len(), 1);
    hook.stop().await;
}

/// With `[devices.rdma]` in the webhook's configuration, a gpu-mem pod's `gpushare.io/rdma`
/// moves into its claim: a request of the HCA class aligned with the container's GPU on
/// `resource.kubernetes.io/pcieRoot`, and the extended resource leaves the limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hca_in_the_limits_moves_into_the_claim_aligned_with_the_gpu() {
    let (api, _hook) = cluster_with(GpuMemPath::Extender, |c| {
        c.devices.rdma.enabled = true;
    })
    .await;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "trainer" },
        "spec": { "containers": [{ "name": "main", "image": "cuda", "resources": {
            "limits": { "aliyun.com/gpu-mem": "4", "gpushare.io/rdma": "1" } } }] },
    }))
    .expect("a pod");
    let admitted = create(&api, "dra-ns", &pod).await;
    assert_eq!(claims(&admitted), ["gpushare-gpu-mem"]);
    let resources = admitted.spec.as_ref().expect("spec").containers[0]
        .resources
        .clone()
        .expect("resources");
    assert!(resources.limits.is_none(), "{resources:?}");
    let bound: Vec<Option<String>> = resources
        .claims
        .expect("claims")
        .into_iter()
        .map(|c| c.request)
        .collect();
    assert_eq!(bound, [Some("main".into()), Some("main-rdma".into())]);
    let templates = templates(&api, "dra-ns");
    assert_eq!(templates.len(), 1);
    let devices = &templates[0]["spec"]["spec"]["devices"];
    assert_eq!(devices["requests"][1]["name"], "main-rdma");
    assert_eq!(
        devices["requests"][1]["exactly"]["deviceClassName"],
        "rdma.gpushare.io"
    );
    assert_eq!(
        devices["constraints"][0]["matchAttribute"],
        "resource.kubernetes.io/pcieRoot"
    );
    // On the extender path the same pod keeps its limits for the device plugin.
    let kept = create(&api, "ext-ns", &pod).await;
    let limits = kept.spec.as_ref().expect("spec").containers[0]
        .resources
        .clone()
        .and_then(|r| r.limits)
        .expect("limits");
    assert!(limits.contains_key("gpushare.io/rdma"));
}

/// The unit and the driver the webhook is given (`--memory-unit`, `--driver-name`: the chart's
/// `devicePlugin.memoryUnit` and `dra.driverName`) are the ones its claims are written in: a
/// container asking 4096 units of MiB asks 4 GiB, and the pod's requests are kept on one GPU
/// by `<driver>/uuid`, the attribute that driver's slices publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_is_written_in_the_unit_and_driver_the_webhook_is_given() {
    let (api, hook) = cluster_with(GpuMemPath::Dra, |c| {
        c.node.memory_unit = MemoryUnit::MIB;
        c.dra.driver_name = "example.com".into();
    })
    .await;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "mib" },
        "spec": { "containers": [
            { "name": "main", "image": "cuda", "resources": { "limits": { "aliyun.com/gpu-mem": "4096" } } },
            { "name": "side", "image": "cuda", "resources": { "limits": { "aliyun.com/gpu-mem": "1024" } } },
        ] },
    }))
    .expect("a pod");
    create(&api, "plain-ns", &pod).await;
    let t = templates(&api, "plain-ns");
    assert_eq!(t.len(), 1, "{t:?}");
    let devices = &t[0]["spec"]["spec"]["devices"];
    assert_eq!(
        devices["requests"][0]["exactly"]["capacity"]["requests"]["memory"],
        (4 * GIB).to_string(),
        "4096 MiB units are 4 GiB"
    );
    assert_eq!(
        devices["requests"][1]["exactly"]["capacity"]["requests"]["memory"],
        GIB.to_string()
    );
    assert_eq!(
        devices["constraints"][0]["matchAttribute"], "example.com/uuid",
        "the attribute the driver's slices publish"
    );
    hook.stop().await;
}

/// With no scheduler to send pods to (`--scheduler-name ""`: scheduler.mode=extender, where the
/// default kube-scheduler calls the extender), the webhook rewrites the DRA path's pods and
/// leaves every other pod's scheduler as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_scheduler_to_route_to_only_the_dra_path_changes_pods() {
    let (api, hook) = cluster_with(GpuMemPath::Extender, |c| {
        c.webhook.scheduler_name = String::new();
    })
    .await;
    let dra = create(&api, "dra-ns", &two_container_pod("a")).await;
    assert_eq!(claims(&dra), [DRA_POD_CLAIM]);
    let ext = create(&api, "ext-ns", &two_container_pod("b")).await;
    assert!(claims(&ext).is_empty());
    assert_eq!(scheduler(&ext), None, "kept for the default kube-scheduler");
    let plain = create(&api, "plain-ns", &two_container_pod("c")).await;
    assert_eq!(scheduler(&plain), None);
    assert!(claims(&plain).is_empty());
    hook.stop().await;
}

/// A 503 / 429 / 504 storm on the namespace read: the webhook (with the client `gpushare
/// webhook` builds) reads the namespace a bounded number of times per admission and answers,
/// instead of multiplying its own retries by the client's quiet ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_503_429_504_on_the_namespace_read_is_bounded() {
    for code in [503u16, 429, 504] {
        let (api, hook) = cluster(GpuMemPath::Extender).await;
        api.inject(
            Fault::new(
                Some(http::Method::GET),
                "/api/v1/namespaces/dra-ns",
                FaultAction::Status(code),
            )
            .times(1000),
        );
        let pods: Api<Pod> = Api::namespaced(api.admin_client(), "dra-ns");
        let refused = pods
            .create(&PostParams::default(), &two_container_pod("p"))
            .await
            .expect_err("the path of the namespace is unknown: refused");
        assert!(
            refused.to_string().contains("cannot read namespace dra-ns"),
            "{code}: {refused}"
        );
        let reads = api
            .requests()
            .into_iter()
            .filter(|r| r.method == http::Method::GET && r.path.contains("/namespaces/dra-ns"))
            .count();
        assert!(
            (1..=3).contains(&reads),
            "{code}: {reads} namespace reads for one admission"
        );
        hook.stop().await;
    }
}
