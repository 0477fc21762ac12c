//! The webhook's DRA policy, pure (no I/O): a pod that asks `aliyun.com/gpu-mem: N` in its
//! containers becomes a pod with one ResourceClaim, made from a ResourceClaimTemplate.
//!
//! The template holds one request per app container and native sidecar (named after the
//! container) of the DeviceClass `gpu-mem.gpushare.io` with `capacity.requests.memory = N ×
//! unit` in bytes, and, when there are several, a `matchAttribute` constraint on
//! `<driver>/uuid`: every container of the pod lands on one GPU, as on the extender path. Each
//! such container is bound to its own request (`resources.claims[{name, request}]`), so it
//! gets its own share and its own limit; a plain init container shares one (below).
//! The `aliyun.com/gpu-mem` limits and requests are removed (a DRA node does not advertise
//! them) and recorded in the annotation `gpushare.io/dra-gpu-mem`. The template's name is
//! derived from its content (`gpushare-gpu-mem-<hash>`), so pods of the same shape share one.
//!
//! Devices of other kinds the pod asks for in the same containers (`gpushare.io/rdma: 1`, a
//! generic device's resource), when the webhook is told of them ([`KindRequest`]), move into
//! the same claim: one request per container and kind (`<container>-<kind>`, `count` = the
//! limit) of the kind's DeviceClass, the container bound to it too, and for an HCA a
//! `matchAttribute` constraint on `resource.kubernetes.io/pcieRoot` with the container's GPU
//! request, so the HCA is the one under the GPU's PCIe root; the annotation records them under
//! `devices`. A pod asking for such devices without GPU memory is left alone.
//!
//! Init containers count as on the extender path and in kube-scheduler: a native sidecar has a
//! request of its own beside the app containers'; a plain init container runs before them, so
//! it adds nothing to the claim and is bound to a request not in use while it runs (see
//! [`SharePlan`]). Pods that already name claims, and pods without GPU memory, are left alone
//! (`None`). What it does not
//! do: create the template or talk to the API (the webhook does), decide whether a namespace
//! or a cluster uses the DRA path, or translate `aliyun.com/gpu-count`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Pod, PodResourceClaim, ResourceClaim as ContainerClaim,
};
use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceClaim, DeviceConstraint, DeviceRequest, ExactDeviceRequest,
    ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};

use crate::core::request::RequestError;
use crate::core::resource_name::unique_dns_label;
use crate::core::wire::{
    DRA_ATTR_PCIE_ROOT, DRA_ATTR_UUID, DRA_CAPACITY_MEMORY, DRA_POD_CLAIM, POD_ANN_DRA_GPU_MEM,
    RESOURCE_GPU_MEM, dra_kind_class_name,
};
use crate::core::{GpuMem, MemoryUnit};

/// The rewrite of one pod.
#[derive(Clone, Debug, PartialEq)]
pub struct DraRewrite {
    /// The template the pod's claim is made from (the webhook makes sure it exists).
    pub template: ResourceClaimTemplate,
    /// The pod as rewritten.
    pub pod: Pod,
    /// The same change as an RFC 6902 JSON patch of the original pod (what an admission
    /// response carries).
    pub patch: Vec<Value>,
}

/// A device kind the rewrite moves into the pod's claim (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindRequest {
    /// The extended resource pods write in their limits (`gpushare.io/rdma`).
    pub resource: String,
    /// The kind's DeviceClass (`rdma.gpushare.io`).
    pub class: String,
    /// The attribute the kind's device must share with the container's GPU
    /// (`resource.kubernetes.io/pcieRoot` for an HCA); `None`: no constraint.
    pub align: Option<String>,
}

/// The kinds `[devices]` enables, as the rewrite moves them: the HCAs (aligned with the GPU on
/// `resource.kubernetes.io/pcieRoot`), then each generic declaration (no constraint: such a
/// device may have no PCI place), each with the DeviceClass the chart installs for it.
pub fn kind_requests(devices: &crate::config::devices::DevicesConfig) -> Vec<KindRequest> {
    let mut out = Vec::new();
    let mut add = |resource: &str, align: Option<&str>| {
        if let Some(class) = dra_kind_class_name(resource) {
            out.push(KindRequest {
                resource: resource.to_string(),
                class,
                align: align.map(str::to_string),
            });
        }
    };
    if devices.rdma.enabled {
        add(&devices.rdma.resource, Some(DRA_ATTR_PCIE_ROOT));
    }
    for g in &devices.generic {
        add(&g.resource, None);
    }
    out
}

/// Why a pod cannot be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    /// A container's limit of a device kind is not a whole number.
    #[error("container {container}: {resource} {value:?} is not a whole number of devices")]
    KindCount {
        /// The container.
        container: String,
        /// The kind's resource.
        resource: String,
        /// What it says.
        value: String,
    },
    /// A container's `aliyun.com/gpu-mem` limit cannot be read.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The pod could not be handled as JSON (not a pod object).
    #[error("the pod cannot be read as JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Rewrites `pod` (in `namespace`) onto the DRA path of `driver` with DeviceClass `class`;
/// `None` when the pod is left as it is. Devices of other kinds are left in its limits
/// ([`rewrite_with_kinds`] moves them).
pub fn rewrite(
    pod: &Pod,
    namespace: &str,
    unit: MemoryUnit,
    driver: &str,
    class: &str,
) -> Result<Option<DraRewrite>, RewriteError> {
    rewrite_with_kinds(pod, namespace, unit, driver, class, &[])
}

/// [`rewrite`], moving the devices of `kinds` the pod's containers ask for into its claim.
pub fn rewrite_with_kinds(
    pod: &Pod,
    namespace: &str,
    unit: MemoryUnit,
    driver: &str,
    class: &str,
    kinds: &[KindRequest],
) -> Result<Option<DraRewrite>, RewriteError> {
    let has_claims = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .is_some_and(|c| !c.is_empty());
    if has_claims {
        return Ok(None);
    }
    let request = crate::k8s::pod_gpu_request(pod)?;
    if !request.is_gpu_pod() {
        return Ok(None);
    }
    let wanted: BTreeMap<String, GpuMem> = request
        .all_containers()
        .map(|c| (c.name.clone(), c.mem))
        .collect();
    let spec = pod.spec.clone().unwrap_or_default();
    let plan = SharePlan::of(&request);
    let devices = kind_asks(&spec, kinds)?;
    let mut template_spec = claim_spec(&plan.requests, unit, driver, class);
    add_kinds(&mut template_spec, &devices, &plan.binding);
    let name = template_name(&template_spec)?;
    let template = ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "gpushare".to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(ResourceClaimTemplateSpec {
            metadata: None,
            spec: Some(template_spec),
        }),
    };

    let mut out = pod.clone();
    let mut patch = Vec::new();
    let out_spec = out.spec.get_or_insert_with(Default::default);
    out_spec.resource_claims = Some(vec![PodResourceClaim {
        name: DRA_POD_CLAIM.to_string(),
        resource_claim_template_name: Some(name),
        resource_claim_name: None,
    }]);
    patch.push(json!({
        "op": "add", "path": "/spec/resourceClaims",
        "value": serde_json::to_value(&out_spec.resource_claims)?,
    }));
    for (i, c) in out_spec.containers.iter_mut().enumerate() {
        if bind(c, &plan.binding, &devices, kinds) {
            patch.push(json!({
                "op": "add", "path": format!("/spec/containers/{i}/resources"),
                "value": serde_json::to_value(&c.resources)?,
            }));
        }
    }
    for (i, c) in out_spec.init_containers.iter_mut().flatten().enumerate() {
        if bind(c, &plan.binding, &devices, kinds) {
            patch.push(json!({
                "op": "add", "path": format!("/spec/initContainers/{i}/resources"),
                "value": serde_json::to_value(&c.resources)?,
            }));
        }
    }
    let mut record = json!({
        "unit": unit.to_string(),
        "containers": wanted.iter().map(|(n, m)| (n.clone(), m.units())).collect::<BTreeMap<_, _>>(),
    });
    if !devices.is_empty() {
        let mut by_container: BTreeMap<&str, BTreeMap<&str, u64>> = BTreeMap::new();
        for d in &devices {
            by_container
                .entry(d.container.as_str())
                .or_default()
                .insert(d.kind.resource.as_str(), d.count);
        }
        record["devices"] = json!(by_container);
    }
    let record = record.to_string();
    let annotations = out.metadata.annotations.get_or_insert_with(BTreeMap::new);
    if annotations.is_empty() {
        patch.push(json!({ "op": "add", "path": "/metadata/annotations", "value": {} }));
    }
    annotations.insert(POD_ANN_DRA_GPU_MEM.to_string(), record.clone());
    patch.push(json!({
        "op": "add",
        "path": format!("/metadata/annotations/{}", pointer_escape(POD_ANN_DRA_GPU_MEM)),
        "value": record,
    }));
    Ok(Some(DraRewrite {
        template,
        pod: out,
        patch,
    }))
}

/// The GPU requests of a pod's claim and the request each GPU container is bound to, so that
/// the claim asks what the extender path and kube-scheduler count for the pod
/// ([`crate::core::request::PodGpuRequest::total`]): the app containers and the native
/// sidecars run side by side, so each has a request of its own (its own limit); a plain init
/// container runs alone with the sidecars declared before it, so it adds nothing: it is bound
/// to the largest request not in use while it runs (an app container's, or a sidecar's
/// declared after it). When some init container needs more than any such request, every GPU
/// container of the pod shares one request of the pod's total (each container's limit is
/// then the pod's total, as for a one-container pod).
#[derive(Clone, Debug, PartialEq, Eq)]
struct SharePlan {
    /// The requests (named after the container that owns them), in spec order.
    requests: Vec<(String, GpuMem)>,
    /// Container -> the request it is bound to.
    binding: BTreeMap<String, String>,
}

impl SharePlan {
    fn of(request: &crate::core::request::PodGpuRequest) -> SharePlan {
        let mut requests: Vec<(String, GpuMem)> = Vec::new();
        let mut binding = BTreeMap::new();
        // Own requests: the sidecars (in spec order among the init containers), then the app
        // containers.
        for c in request.init_containers.iter().filter(|c| c.restartable) {
            requests.push((c.name.clone(), c.mem));
            binding.insert(c.name.clone(), c.name.clone());
        }
        for c in &request.containers {
            requests.push((c.name.clone(), c.mem));
            binding.insert(c.name.clone(), c.name.clone());
        }
        let mut fits = true;
        for (i, c) in request.init_containers.iter().enumerate() {
            if c.restartable {
                continue;
            }
            // Free while it runs: the app containers' requests and those of the sidecars
            // declared after it (not started yet).
            let later: Vec<&str> = request.init_containers[i + 1..]
                .iter()
                .filter(|x| x.restartable)
                .map(|x| x.name.as_str())
                .collect();
            let free = requests
                .iter()
                .filter(|(n, _)| {
                    request.containers.iter().any(|a| a.name == *n) || later.contains(&n.as_str())
                })
                .max_by_key(|(_, m)| *m);
            match free {
                Some((n, m)) if *m >= c.mem => {
                    binding.insert(c.name.clone(), n.clone());
                }
                _ => fits = false,
            }
        }
        if fits {
            return SharePlan { requests, binding };
        }
        // One request of the pod's total, shared by every GPU container.
        let first = request
            .all_containers()
            .next()
            .map(|c| c.name.clone())
            .unwrap_or_default();
        SharePlan {
            requests: vec![(first.clone(), request.total())],
            binding: request
                .all_containers()
                .map(|c| (c.name.clone(), first.clone()))
                .collect(),
        }
    }
}

/// One container's ask for devices of one kind.
#[derive(Clone, Debug)]
struct KindAsk<'a> {
    container: String,
    kind: &'a KindRequest,
    count: u64,
    /// The claim's request for it.
    request: String,
}

/// What the containers (init first, in spec order) ask of each kind, with unique request
/// names `<container>-<kind name>` (a DNS label of at most 63 characters).
fn kind_asks<'a>(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    kinds: &'a [KindRequest],
) -> Result<Vec<KindAsk<'a>>, RewriteError> {
    let mut out: Vec<KindAsk<'a>> = Vec::new();
    let mut taken: Vec<String> = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .map(|c| c.name.clone())
        .collect();
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
    {
        for kind in kinds {
            let r = c.resources.as_ref();
            let value = r
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get(&kind.resource))
                .or_else(|| {
                    r.and_then(|r| r.requests.as_ref())
                        .and_then(|l| l.get(&kind.resource))
                });
            let Some(value) = value else { continue };
            let count: u64 = value
                .0
                .trim()
                .parse()
                .map_err(|_| RewriteError::KindCount {
                    container: c.name.clone(),
                    resource: kind.resource.clone(),
                    value: value.0.clone(),
                })?;
            if count == 0 {
                continue;
            }
            let short = kind.resource.rsplit('/').next().unwrap_or(&kind.resource);
            let request = unique_dns_label(&[&c.name, short], &mut taken);
            out.push(KindAsk {
                container: c.name.clone(),
                kind,
                count,
                request,
            });
        }
    }
    Ok(out)
}

/// Adds a request per kind ask to `spec`, with the alignment constraint to the container's
/// GPU request.
fn add_kinds(spec: &mut ResourceClaimSpec, asks: &[KindAsk<'_>], gpus: &BTreeMap<String, String>) {
    let Some(devices) = spec.devices.as_mut() else {
        return;
    };
    for a in asks {
        devices
            .requests
            .get_or_insert_with(Vec::new)
            .push(DeviceRequest {
                name: a.request.clone(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: a.kind.class.clone(),
                    count: (a.count > 1).then(|| i64::try_from(a.count).unwrap_or(i64::MAX)),
                    ..Default::default()
                }),
                first_available: None,
            });
        if let Some(attribute) = &a.kind.align
            && let Some(gpu_request) = gpus.get(&a.container)
        {
            devices
                .constraints
                .get_or_insert_with(Vec::new)
                .push(DeviceConstraint {
                    requests: Some(vec![gpu_request.clone(), a.request.clone()]),
                    match_attribute: Some(attribute.clone()),
                    distinct_attribute: None,
                });
        }
    }
}

/// Binds `c` to its GPU request when it asks GPU memory ([`SharePlan`]), and to its kinds'
/// requests; drops the extended resources moved into the claim from every container (a zero
/// limit too: a DRA node does not advertise them). Whether it changed.
fn bind(
    c: &mut Container,
    binding: &BTreeMap<String, String>,
    asks: &[KindAsk<'_>],
    kinds: &[KindRequest],
) -> bool {
    let mut changed = false;
    if let Some(resources) = c.resources.as_mut() {
        for list in [&mut resources.limits, &mut resources.requests] {
            if let Some(map) = list.as_mut() {
                changed |= map.remove(RESOURCE_GPU_MEM).is_some();
                for k in kinds {
                    changed |= map.remove(&k.resource).is_some();
                }
                if map.is_empty() {
                    *list = None;
                }
            }
        }
    }
    let mut requests: Vec<String> = Vec::new();
    if let Some(request) = binding.get(&c.name) {
        requests.push(request.clone());
    }
    requests.extend(
        asks.iter()
            .filter(|a| a.container == c.name)
            .map(|a| a.request.clone()),
    );
    for request in requests {
        c.resources
            .get_or_insert_with(Default::default)
            .claims
            .get_or_insert_with(Vec::new)
            .push(ContainerClaim {
                name: DRA_POD_CLAIM.to_string(),
                request: Some(request),
            });
        changed = true;
    }
    changed
}

fn claim_spec(
    gpu_requests: &[(String, GpuMem)],
    unit: MemoryUnit,
    driver: &str,
    class: &str,
) -> ResourceClaimSpec {
    let order: Vec<String> = gpu_requests.iter().map(|(n, _)| n.clone()).collect();
    let requests = gpu_requests
        .iter()
        .map(|(name, mem)| {
            let bytes = unit.to_bytes(*mem);
            DeviceRequest {
                name: name.clone(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: class.to_string(),
                    capacity: Some(CapacityRequirements {
                        requests: Some(BTreeMap::from([(
                            DRA_CAPACITY_MEMORY.to_string(),
                            Quantity(bytes.to_string()),
                        )])),
                    }),
                    ..Default::default()
                }),
                first_available: None,
            }
        })
        .collect();
    let constraints = (order.len() > 1).then(|| {
        vec![DeviceConstraint {
            requests: Some(order.clone()),
            match_attribute: Some(format!("{driver}/{DRA_ATTR_UUID}")),
            distinct_attribute: None,
        }]
    });
    ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(requests),
            constraints,
            config: None,
        }),
    }
}

/// `gpushare-gpu-mem-<16 hex digits>`: FNV-1a of the spec's JSON (serde_json writes maps in
/// key order, so equal specs hash equally).
fn template_name(spec: &ResourceClaimSpec) -> Result<String, serde_json::Error> {
    let bytes = serde_json::to_vec(spec)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    Ok(format!("gpushare-gpu-mem-{h:016x}"))
}

/// RFC 6901 escaping of one path segment.
fn pointer_escape(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).expect("a pod")
    }

    fn gpu_pod(containers: &[(&str, Option<&str>)]) -> Pod {
        let containers: Vec<Value> = containers
            .iter()
            .map(|(n, mem)| {
                let mut c = json!({ "name": n, "image": "x",
                    "resources": { "limits": { "cpu": "1" } } });
                if let Some(m) = mem {
                    c["resources"]["limits"][RESOURCE_GPU_MEM] = json!(m);
                }
                c
            })
            .collect();
        pod(
            json!({ "metadata": { "name": "p", "namespace": "ns" }, "spec": { "containers": containers } }),
        )
    }

    fn rw(p: &Pod) -> Option<DraRewrite> {
        rewrite(
            p,
            "ns",
            MemoryUnit::GIB,
            "gpushare.io",
            "gpu-mem.gpushare.io",
        )
        .expect("rewrites")
    }

    /// Applies the `add` operations of a patch (all the rewrite emits).
    fn apply(mut doc: Value, patch: &[Value]) -> Value {
        for op in patch {
            assert_eq!(op["op"], "add");
            let path = op["path"].as_str().expect("path");
            let mut parts: Vec<String> = path
                .split('/')
                .skip(1)
                .map(|p| p.replace("~1", "/").replace("~0", "~"))
                .collect();
            let last = parts.pop().expect("a segment");
            let mut at = &mut doc;
            for p in parts {
                at = match at {
                    Value::Array(a) => &mut a[p.parse::<usize>().expect("index")],
                    other => other.get_mut(&p).expect("the parent exists"),
                };
            }
            at.as_object_mut()
                .expect("an object")
                .insert(last, op["value"].clone());
        }
        doc
    }

    #[test]
    fn kinds_move_into_the_claim_and_an_hca_is_aligned_with_its_containers_gpu() {
        let mut config = crate::config::devices::DevicesConfig::default();
        config.rdma.enabled = true;
        config.generic = vec![crate::config::devices::GenericDeviceConfig {
            resource: "example.com/fuse".into(),
            paths: Vec::new(),
            shares: 1,
            envs: BTreeMap::new(),
            mounts: Vec::new(),
        }];
        let kinds = kind_requests(&config);
        assert_eq!(
            kinds.iter().map(|k| k.class.as_str()).collect::<Vec<_>>(),
            ["rdma.gpushare.io", "fuse.example.com"]
        );
        let original = pod(json!({
            "metadata": { "name": "p", "namespace": "ns" },
            "spec": { "containers": [
                { "name": "trainer", "image": "x", "resources": {
                    "limits": { "aliyun.com/gpu-mem": "4", "gpushare.io/rdma": "2", "cpu": "1" },
                    "requests": { "gpushare.io/rdma": "2" } } },
                { "name": "fuse", "image": "x", "resources": {
                    "limits": { "example.com/fuse": "1" } } },
            ] },
        }));
        let r = rewrite_with_kinds(
            &original,
            "ns",
            MemoryUnit::GIB,
            "gpushare.io",
            "gpu-mem.gpushare.io",
            &kinds,
        )
        .expect("rewrites")
        .expect("rewritten");
        let devices = r
            .template
            .spec
            .clone()
            .and_then(|t| t.spec)
            .and_then(|s| s.devices)
            .expect("devices");
        let requests = devices.requests.expect("requests");
        let names: Vec<&str> = requests.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["trainer", "trainer-rdma", "fuse-fuse"]);
        let nic = requests[1].exactly.as_ref().expect("exactly");
        assert_eq!(nic.device_class_name, "rdma.gpushare.io");
        assert_eq!(nic.count, Some(2));
        assert_eq!(requests[2].exactly.as_ref().expect("exactly").count, None);
        let constraints = devices.constraints.expect("constraints");
        assert_eq!(
            constraints.len(),
            1,
            "only the HCA is aligned: {constraints:?}"
        );
        assert_eq!(
            constraints[0].requests.as_deref(),
            Some(&["trainer".to_string(), "trainer-rdma".to_string()][..])
        );
        assert_eq!(
            constraints[0].match_attribute.as_deref(),
            Some("resource.kubernetes.io/pcieRoot")
        );
        // The pod: the kinds' resources gone, each container bound to its requests, the
        // annotation records them; the patch gives the same pod.
        let spec = r.pod.spec.clone().expect("spec");
        let trainer = spec.containers[0].resources.clone().expect("resources");
        let limits = trainer.limits.expect("cpu stays");
        assert!(!limits.contains_key("gpushare.io/rdma") && limits.contains_key("cpu"));
        assert!(trainer.requests.is_none(), "an emptied list goes");
        let bound: Vec<Option<String>> = trainer
            .claims
            .expect("claims")
            .into_iter()
            .map(|c| c.request)
            .collect();
        assert_eq!(bound, [Some("trainer".into()), Some("trainer-rdma".into())]);
        let fuse = spec.containers[1].resources.clone().expect("resources");
        assert!(fuse.limits.is_none());
        assert_eq!(
            fuse.claims.expect("claims")[0].request.as_deref(),
            Some("fuse-fuse")
        );
        let record: Value = serde_json::from_str(
            &r.pod.metadata.annotations.clone().expect("annotations")[POD_ANN_DRA_GPU_MEM],
        )
        .expect("json");
        assert_eq!(record["devices"]["trainer"]["gpushare.io/rdma"], 2);
        assert_eq!(record["devices"]["fuse"]["example.com/fuse"], 1);
        let patched = apply(serde_json::to_value(&original).expect("json"), &r.patch);
        assert_eq!(patched, serde_json::to_value(&r.pod).expect("json"));
        // A count that is not a whole number is refused by name.
        let bad = pod(json!({
            "metadata": { "name": "p", "namespace": "ns" },
            "spec": { "containers": [{ "name": "c", "image": "x", "resources": {
                "limits": { "aliyun.com/gpu-mem": "1", "gpushare.io/rdma": "half" } } }] },
        }));
        let err = rewrite_with_kinds(
            &bad,
            "ns",
            MemoryUnit::GIB,
            "gpushare.io",
            "gpu-mem.gpushare.io",
            &kinds,
        )
        .expect_err("refused");
        assert!(
            err.to_string().contains("gpushare.io/rdma \"half\""),
            "{err}"
        );
        // Without GPU memory the pod is left alone.
        let nic_only = pod(json!({
            "metadata": { "name": "p", "namespace": "ns" },
            "spec": { "containers": [{ "name": "c", "image": "x", "resources": {
                "limits": { "gpushare.io/rdma": "1" } } }] },
        }));
        assert!(
            rewrite_with_kinds(
                &nic_only,
                "ns",
                MemoryUnit::GIB,
                "gpushare.io",
                "gpu-mem.gpushare.io",
                &kinds
            )
            .expect("reads")
            .is_none()
        );
    }

    #[test]
    fn each_gpu_container_gets_its_own_request_all_on_one_gpu() {
        let p = gpu_pod(&[("main", Some("6")), ("log", None), ("side", Some("2"))]);
        let r = rw(&p).expect("rewritten");
        let spec = r
            .template
            .spec
            .as_ref()
            .and_then(|s| s.spec.clone())
            .expect("spec");
        let devices = spec.devices.expect("devices");
        let requests = devices.requests.expect("requests");
        let got: Vec<(String, String)> = requests
            .iter()
            .map(|q| {
                let e = q.exactly.as_ref().expect("exactly");
                assert_eq!(e.device_class_name, "gpu-mem.gpushare.io");
                let mem = e
                    .capacity
                    .as_ref()
                    .and_then(|c| c.requests.as_ref())
                    .expect("c")["memory"]
                    .0
                    .clone();
                (q.name.clone(), mem)
            })
            .collect();
        assert_eq!(
            got,
            [
                ("main".into(), (6u64 << 30).to_string()),
                ("side".into(), (2u64 << 30).to_string())
            ]
        );
        let c = &devices.constraints.expect("constraints")[0];
        assert_eq!(c.match_attribute.as_deref(), Some("gpushare.io/uuid"));
        let containers = &r.pod.spec.as_ref().expect("spec").containers;
        let claims = |i: usize| {
            containers[i]
                .resources
                .as_ref()
                .and_then(|r| r.claims.clone())
        };
        assert_eq!(
            claims(0).expect("bound")[0],
            ContainerClaim {
                name: DRA_POD_CLAIM.into(),
                request: Some("main".into())
            }
        );
        assert_eq!(
            claims(1),
            None,
            "a container without GPU memory is untouched"
        );
        let limits = containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.clone())
            .expect("l");
        assert!(!limits.contains_key(RESOURCE_GPU_MEM));
        assert_eq!(limits["cpu"].0, "1");
        let ann = &r.pod.metadata.annotations.as_ref().expect("ann")[POD_ANN_DRA_GPU_MEM];
        assert_eq!(ann, r#"{"containers":{"main":6,"side":2},"unit":"GiB"}"#);
        // The patch, applied to the original, gives the rewritten pod.
        let patched = apply(serde_json::to_value(&p).expect("json"), &r.patch);
        assert_eq!(patched, serde_json::to_value(&r.pod).expect("json"));
    }

    #[test]
    fn pods_with_claims_or_without_gpu_memory_are_left_alone() {
        assert!(rw(&gpu_pod(&[("a", None)])).is_none());
        assert!(rw(&gpu_pod(&[("a", Some("0"))])).is_none());
        let mut with_claims = gpu_pod(&[("a", Some("2"))]);
        if let Some(s) = with_claims.spec.as_mut() {
            s.resource_claims = Some(vec![PodResourceClaim {
                name: "mine".into(),
                resource_claim_name: Some("c".into()),
                resource_claim_template_name: None,
            }]);
        }
        assert!(rw(&with_claims).is_none());
        let bad = gpu_pod(&[("a", Some("1.5"))]);
        assert!(matches!(
            rewrite(&bad, "ns", MemoryUnit::GIB, "gpushare.io", "c"),
            Err(RewriteError::Request(_))
        ));
    }

    #[test]
    fn one_container_has_no_constraint_and_same_shapes_share_a_template() {
        let a = rw(&gpu_pod(&[("main", Some("4"))])).expect("rewritten");
        let spec = a
            .template
            .spec
            .as_ref()
            .and_then(|s| s.spec.clone())
            .expect("spec");
        assert!(spec.devices.expect("d").constraints.is_none());
        let b = rw(&gpu_pod(&[("main", Some("4"))])).expect("rewritten");
        assert_eq!(a.template.metadata.name, b.template.metadata.name);
        let c = rw(&gpu_pod(&[("main", Some("5"))])).expect("rewritten");
        assert_ne!(a.template.metadata.name, c.template.metadata.name);
        let name = a.template.metadata.name.expect("name");
        assert!(
            name.len() <= 63 && name.starts_with("gpushare-gpu-mem-"),
            "{name}"
        );
    }

    #[test]
    fn sidecars_are_rewritten_and_the_template_is_a_valid_api_object() {
        let p = pod(json!({
            "metadata": { "name": "p", "annotations": { "keep": "me" } },
            "spec": {
                "initContainers": [{ "name": "warm", "image": "x", "restartPolicy": "Always",
                    "resources": { "limits": { RESOURCE_GPU_MEM: "1" }, "requests": { RESOURCE_GPU_MEM: "1" } } }],
                "containers": [{ "name": "main", "image": "x",
                    "resources": { "limits": { RESOURCE_GPU_MEM: "3" } } }],
            },
        }));
        let r = rewrite(
            &p,
            "ns",
            MemoryUnit::from_mib(512).expect("u"),
            "gpushare.io",
            "k",
        )
        .expect("rewrites")
        .expect("rewritten");
        let init = &r
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.clone())
            .expect("i")[0];
        let res = init.resources.as_ref().expect("res");
        assert!(res.limits.is_none() && res.requests.is_none(), "{res:?}");
        assert_eq!(
            res.claims.as_ref().expect("claims")[0].request.as_deref(),
            Some("warm")
        );
        let json = serde_json::to_value(&r.template).expect("json");
        assert_eq!(json["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(json["kind"], "ResourceClaimTemplate");
        assert_eq!(json["metadata"]["namespace"], "ns");
        let requests = &json["spec"]["spec"]["devices"]["requests"];
        assert_eq!(requests[0]["name"], "warm");
        assert_eq!(
            requests[0]["exactly"]["capacity"]["requests"]["memory"],
            (512u64 << 20).to_string()
        );
        assert_eq!(
            requests[1]["exactly"]["capacity"]["requests"]["memory"],
            (1536u64 << 20).to_string()
        );
        let back: ResourceClaimTemplate = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, r.template);
        let patched = apply(serde_json::to_value(&p).expect("json"), &r.patch);
        assert_eq!(patched, serde_json::to_value(&r.pod).expect("json"));
    }

    /// A plain init container adds nothing: it is bound to the largest request free while it
    /// runs (an app container's); when none is large enough, every GPU container shares one
    /// request of the pod's total.
    #[test]
    fn a_plain_init_container_shares_a_request_and_adds_nothing() {
        let shaped = |init: &str, app: &[(&str, &str)]| {
            let apps: Vec<Value> = app
                .iter()
                .map(|(n, m)| {
                    json!({ "name": n, "image": "x",
                    "resources": { "limits": { RESOURCE_GPU_MEM: m } } })
                })
                .collect();
            let p = pod(json!({
                "metadata": { "name": "p" },
                "spec": {
                    "initContainers": [
                        { "name": "prep", "image": "x", "resources": { "limits": { RESOURCE_GPU_MEM: init } } },
                        { "name": "log", "image": "x", "restartPolicy": "Always",
                          "resources": { "limits": { RESOURCE_GPU_MEM: "2" } } },
                    ],
                    "containers": apps,
                },
            }));
            let r = rw(&p).expect("rewritten");
            let requests: Vec<(String, String)> = r
                .template
                .spec
                .and_then(|s| s.spec)
                .and_then(|s| s.devices)
                .and_then(|d| d.requests)
                .expect("requests")
                .into_iter()
                .map(|q| {
                    let mem = q
                        .exactly
                        .and_then(|e| e.capacity)
                        .and_then(|c| c.requests)
                        .expect("mem")["memory"]
                        .0
                        .clone();
                    (q.name, mem)
                })
                .collect();
            let spec = r.pod.spec.expect("spec");
            let bound: BTreeMap<String, String> = spec
                .init_containers
                .into_iter()
                .flatten()
                .chain(spec.containers)
                .filter_map(|c| {
                    let request = c.resources?.claims?.first()?.request.clone()?;
                    Some((c.name, request))
                })
                .collect();
            (requests, bound)
        };
        let g = |n: u64| (n << 30).to_string();
        let (requests, bound) = shaped("10", &[("main", "10")]);
        assert_eq!(requests, [("log".into(), g(2)), ("main".into(), g(10))]);
        assert_eq!(bound["prep"], "main");
        assert_eq!(bound["log"], "log");
        let (requests, bound) = shaped("12", &[("a", "4"), ("b", "4")]);
        assert_eq!(
            requests,
            [("prep".into(), g(12))],
            "one request of the pod's total"
        );
        assert!(bound.values().all(|r| r == "prep"), "{bound:?}");
    }

    proptest! {
        /// Whatever the containers: every GPU container is bound to exactly its own request
        /// asking N × unit, no `aliyun.com/gpu-mem` is left, other containers are untouched,
        /// and the patch reproduces the rewritten pod.
        #[test]
        fn every_gpu_container_is_bound_to_its_own_request(
            mems in proptest::collection::vec(proptest::option::of(0u64..64), 1..6),
            unit_mib in prop_oneof![Just(1u32), Just(256), Just(1024)],
        ) {
            let names: Vec<String> = (0..mems.len()).map(|i| format!("c{i}")).collect();
            let texts: Vec<Option<String>> = mems.iter().map(|m| m.map(|v| v.to_string())).collect();
            let spec: Vec<(&str, Option<&str>)> = names
                .iter()
                .zip(&texts)
                .map(|(n, t)| (n.as_str(), t.as_deref()))
                .collect();
            let p = gpu_pod(&spec);
            let unit = MemoryUnit::from_mib(unit_mib).expect("unit");
            let r = rewrite(&p, "ns", unit, "gpushare.io", "k").expect("rewrites");
            let gpu: Vec<(usize, u64)> = mems
                .iter()
                .enumerate()
                .filter_map(|(i, m)| m.filter(|v| *v > 0).map(|v| (i, v)))
                .collect();
            let Some(r) = r else {
                prop_assert!(gpu.is_empty());
                return Ok(());
            };
            let requests = r.template.spec.as_ref().and_then(|s| s.spec.clone())
                .and_then(|s| s.devices).and_then(|d| d.requests).expect("requests");
            prop_assert_eq!(requests.len(), gpu.len());
            let containers = &r.pod.spec.as_ref().expect("spec").containers;
            for (i, c) in containers.iter().enumerate() {
                let res = c.resources.as_ref();
                let has_mem = res.and_then(|r| r.limits.as_ref()).is_some_and(|l| l.contains_key(RESOURCE_GPU_MEM));
                prop_assert!(!has_mem);
                let claims = res.and_then(|r| r.claims.clone()).unwrap_or_default();
                match gpu.iter().find(|(j, _)| *j == i) {
                    Some((_, v)) => {
                        prop_assert_eq!(claims.len(), 1);
                        prop_assert_eq!(claims[0].request.as_deref(), Some(c.name.as_str()));
                        let q = requests.iter().find(|q| q.name == c.name).expect("its request");
                        let mem = &q.exactly.as_ref().and_then(|e| e.capacity.clone())
                            .and_then(|c| c.requests).expect("mem")["memory"];
                        prop_assert_eq!(mem.0.clone(), (v * (u64::from(unit_mib) << 20)).to_string());
                    }
                    None => prop_assert!(claims.is_empty()),
                }
            }
            let patched = apply(serde_json::to_value(&p).expect("json"), &r.patch);
            prop_assert_eq!(patched, serde_json::to_value(&r.pod).expect("json"));
        }
    }
}
