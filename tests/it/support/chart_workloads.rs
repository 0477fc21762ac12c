//! GPU pods taken from their spec to their containers' environment on a chart installed in
//! the sandbox ([`super::chart_install`]), on each path:
//!
//! - the extender path: the pod is created through admission (the webhook of the dedicated
//!   mode routes it to its scheduler); the harness schedules it as kube-scheduler would with
//!   the rendered KubeSchedulerConfiguration (its extender's `urlPrefix`, resolved through
//!   the rendered Service to the extender pod: filter over the nodes whose allocatable has
//!   the pod's `aliyun.com/gpu-mem`, then the extender's bind); the sandbox kubelet of the
//!   node it was bound to then allocates each GPU container (init containers first, native
//!   sidecars among them) and each device of another kind, as kubelet does at pod admission;
//! - the DRA path: the pod is created through admission (the webhook rewrites it into a
//!   claim of the chart's DeviceClass); the sandbox DRA allocator (kube-scheduler's DRA
//!   plugin and the claim controller, upstream's allocator re-expressed) allocates and binds
//!   it; the sandbox DRA kubelet of that node prepares it through the DRA plugin; each
//!   container's environment is read from the CDI specs the plugin wrote for the devices of
//!   its requests.
//!
//! Each step that fails says which rendered object (and template) it goes back to.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use gpushare::core::wire;
use gpushare_sandbox::dra_allocator::DraAllocator;
use gpushare_sandbox::dra_kubelet::ClaimOutcome;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};

use super::chart_install::{ChartCluster, NAMESPACE};
use super::extender_http::post;

/// How long the harness keeps scheduling a pod before it says why it cannot.
const SCHEDULE_WITHIN: Duration = Duration::from_secs(30);

/// One container of a GPU pod: its name, whether it is an init container (`sidecar`: with
/// `restartPolicy: Always`), its `aliyun.com/gpu-mem` and the devices of other kinds it asks.
#[derive(Clone, Debug)]
pub(crate) struct GpuContainer {
    pub name: &'static str,
    pub init: bool,
    pub sidecar: bool,
    pub units: u64,
    pub devices: Vec<(String, u64)>,
}

impl GpuContainer {
    pub(crate) fn app(name: &'static str, units: u64) -> GpuContainer {
        GpuContainer {
            name,
            init: false,
            sidecar: false,
            units,
            devices: Vec::new(),
        }
    }
}

/// A pod of these containers in `namespace`, as a user writes it.
pub(crate) fn gpu_pod(name: &str, namespace: &str, containers: &[GpuContainer]) -> Value {
    let one = |c: &GpuContainer| {
        let mut limits = serde_json::Map::new();
        if c.units > 0 {
            limits.insert(wire::RESOURCE_GPU_MEM.into(), json!(c.units.to_string()));
        }
        for (r, n) in &c.devices {
            limits.insert(r.clone(), json!(n.to_string()));
        }
        let mut out = json!({ "name": c.name, "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
            "resources": { "limits": limits } });
        if c.sidecar {
            out["restartPolicy"] = json!("Always");
        }
        out
    };
    let init: Vec<Value> = containers.iter().filter(|c| c.init).map(one).collect();
    let app: Vec<Value> = containers.iter().filter(|c| !c.init).map(one).collect();
    let mut pod = json!({ "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": namespace },
        "spec": { "containers": app } });
    if !init.is_empty() {
        pod["spec"]["initContainers"] = json!(init);
    }
    pod
}

/// What one container got: its environment, and the device nodes handed to it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Handed {
    pub env: BTreeMap<String, String>,
    pub device_nodes: Vec<String>,
}

/// Creates `pod` as a user does (through admission), as the administrator.
async fn create(c: &ChartCluster, pod: &Value) -> Pod {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or("default");
    let api: Api<Pod> = Api::namespaced(c.api.admin_client(), ns);
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a pod");
    match api.create(&PostParams::default(), &typed).await {
        Ok(pod) => pod,
        Err(e) => panic!(
            "mode {}: the pod {ns}/{} is refused: {e}\n{}",
            c.mode.name,
            typed.metadata.name.unwrap_or_default(),
            c.refusals().join("\n")
        ),
    }
}

/// The text of a rendered object: its template, kind and name.
fn where_from(c: &ChartCluster, kind: &str, name: &str) -> String {
    c.installed
        .objects
        .iter()
        .find(|r| {
            r.object["kind"].as_str() == Some(kind)
                && r.object["metadata"]["name"].as_str() == Some(name)
        })
        .map(|r| format!("{kind} {name} ({})", r.template))
        .unwrap_or_else(|| format!("{kind} {name} (not rendered)"))
}

/// The rendered KubeSchedulerConfiguration of the mode's scheduler: the dedicated one, or the
/// one kube-scheduler is wired to in extender mode.
fn scheduler_configuration(c: &ChartCluster) -> (Value, String) {
    let dedicated = c.mode.values["scheduler"]["mode"] == "dedicated";
    let name = if dedicated {
        c.mode.values["scheduler"]["name"]
            .as_str()
            .unwrap_or("gpushare-scheduler")
            .to_string()
    } else {
        "gpushare-scheduler-config".to_string()
    };
    let cm = c
        .installed
        .find("ConfigMap", &name)
        .unwrap_or_else(|| panic!("mode {}: no ConfigMap {name} rendered", c.mode.name));
    let text = cm["data"]["scheduler-config.yaml"]
        .as_str()
        .expect("scheduler-config.yaml");
    (
        yaml_serde::from_str(text).expect("a KubeSchedulerConfiguration"),
        where_from(c, "ConfigMap", &name),
    )
}

/// The extender pod's address that `url` (the configuration's `urlPrefix`) reaches through
/// the rendered Service (by name and port, or by nodePort on the loopback).
fn resolve_extender(c: &ChartCluster, url: &str, source: &str) -> (SocketAddr, String) {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (host, port) = authority
        .rsplit_once(':')
        .expect("a port in the extender URL");
    let port: i32 = port.parse().expect("a numeric port");
    let services = c.installed.of_kind("Service");
    let service = services
        .iter()
        .find(|s| {
            let name = s["metadata"]["name"].as_str().unwrap_or_default();
            let by_name = host == format!("{name}.{NAMESPACE}.svc")
                || host == format!("{name}.{NAMESPACE}.svc.cluster.local");
            s["spec"]["ports"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|p| {
                    (by_name && p["port"].as_i64() == Some(port.into()))
                        || (host == "127.0.0.1" && p["nodePort"].as_i64() == Some(port.into()))
                })
        })
        .unwrap_or_else(|| {
            panic!(
                "mode {}: {url} of {source} reaches no rendered Service",
                c.mode.name
            )
        });
    let sp = service["spec"]["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|p| {
            p["port"].as_i64() == Some(port.into()) || p["nodePort"].as_i64() == Some(port.into())
        })
        .expect("the Service port");
    let extender = c
        .pods
        .iter()
        .find(|p| p.role == "extender")
        .unwrap_or_else(|| panic!("mode {}: no extender pod runs", c.mode.name));
    let target = match &sp["targetPort"] {
        v if v.as_i64().is_some() => u16::try_from(v.as_i64().unwrap_or_default()).expect("a port"),
        v => *extender
            .port_names
            .get(v.as_str().unwrap_or_default())
            .unwrap_or_else(|| {
                panic!(
                    "mode {}: targetPort {v:?} names no port of the extender",
                    c.mode.name
                )
            }),
    };
    assert!(
        extender.ports.contains_key(&target),
        "mode {}: the Service's targetPort {target} is no container port of {}",
        c.mode.name,
        extender.workload
    );
    (extender.addr(target), format!("/{path}"))
}

/// Takes `pod` along the extender path (see the module docs); what each container got.
pub(crate) async fn on_extender_path(c: &ChartCluster, pod: &Value) -> BTreeMap<String, Handed> {
    let created = create(c, pod).await;
    let ns = created.metadata.namespace.clone().unwrap_or_default();
    let name = created.metadata.name.clone().unwrap_or_default();
    let spec = created.spec.clone().expect("a pod spec");
    let dedicated = c.mode.values["scheduler"]["mode"] == "dedicated";
    let want_scheduler = if dedicated {
        c.mode.values["scheduler"]["name"]
            .as_str()
            .unwrap_or("gpushare-scheduler")
            .to_string()
    } else {
        "default-scheduler".to_string()
    };
    let got_scheduler = spec
        .scheduler_name
        .clone()
        .unwrap_or_else(|| "default-scheduler".into());
    assert_eq!(
        got_scheduler,
        want_scheduler,
        "mode {}: pod {ns}/{name} is not routed to the scheduler that calls the extender (the webhook: {})",
        c.mode.name,
        where_from(c, "MutatingWebhookConfiguration", "gpushare-webhook")
    );
    assert!(
        spec.resource_claims.is_none(),
        "mode {}: pod {ns}/{name} of the extender path was rewritten into claims",
        c.mode.name
    );
    let (config, source) = scheduler_configuration(c);
    let extender = &config["extenders"][0];
    let url = extender["urlPrefix"].as_str().expect("urlPrefix");
    let (addr, prefix) = resolve_extender(c, url, &source);
    let verb = |v: &str| {
        format!(
            "{}/{}",
            prefix.trim_end_matches('/'),
            extender[v].as_str().unwrap_or(v)
        )
    };
    let total: u64 = spec
        .containers
        .iter()
        .filter_map(|ctr| {
            ctr.resources
                .as_ref()?
                .limits
                .as_ref()?
                .get(wire::RESOURCE_GPU_MEM)
        })
        .filter_map(|q| q.0.parse::<u64>().ok())
        .sum();
    let candidates: Vec<String> = c
        .api
        .list_objects("nodes", None)
        .into_iter()
        .filter(|n| {
            n["status"]["allocatable"][wire::RESOURCE_GPU_MEM]
                .as_str()
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|have| have >= total)
        })
        .filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    assert!(
        !candidates.is_empty(),
        "mode {}: no node has {total} allocatable {}: the device plugin serves none ({})",
        c.mode.name,
        wire::RESOURCE_GPU_MEM,
        where_from(c, "DaemonSet", "gpushare-device-plugin-ds")
    );
    let pod_json = serde_json::to_value(&created).expect("json");
    let end = tokio::time::Instant::now() + SCHEDULE_WITHIN;
    let node = loop {
        let (code, answer) = post(
            addr,
            &verb("filterVerb"),
            &json!({ "Pod": pod_json, "NodeNames": candidates }),
        )
        .await;
        let fits: Vec<String> = answer["NodeNames"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        if code == 200 && !fits.is_empty() {
            break fits[0].clone();
        }
        assert!(
            tokio::time::Instant::now() < end,
            "mode {}: the extender's filter keeps pod {ns}/{name} off every node ({code}): {answer}",
            c.mode.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (code, answer) = post(
        addr,
        &verb("bindVerb"),
        &json!({ "PodName": name, "PodNamespace": ns,
                 "PodUID": created.metadata.uid.clone().unwrap_or_default(), "Node": node }),
    )
    .await;
    assert!(
        code == 200 && answer["Error"].as_str().unwrap_or_default().is_empty(),
        "mode {}: the extender's bind of {ns}/{name} to {node} failed ({code}): {answer}",
        c.mode.name
    );
    let bound = c
        .api
        .get_as::<Pod>("pods", Some(&ns), &name)
        .and_then(|p| p.spec)
        .and_then(|s| s.node_name);
    assert_eq!(
        bound.as_deref(),
        Some(node.as_str()),
        "mode {}: {ns}/{name} bound",
        c.mode.name
    );
    let kubelet = &c.node(&node).kubelet;
    let mut out = BTreeMap::new();
    let ordered = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter());
    for ctr in ordered {
        let limits = ctr
            .resources
            .as_ref()
            .and_then(|r| r.limits.clone())
            .unwrap_or_default();
        let mut handed = Handed::default();
        let mut resources: Vec<(&String, u64)> = limits
            .iter()
            .filter(|(r, _)| r.as_str() != "cpu" && r.as_str() != "memory")
            .filter_map(|(r, q)| q.0.parse::<u64>().ok().map(|n| (r, n)))
            .filter(|(_, n)| *n > 0)
            .collect();
        // The GPU first: the HCA nearest to it is preferred.
        resources.sort_by_key(|(r, _)| r.as_str() != wire::RESOURCE_GPU_MEM);
        for (resource, count) in resources {
            let (_, resp) = kubelet
                .allocate_container(resource, &ns, &name, &ctr.name, usize::try_from(count).expect("a count"))
                .await
                .unwrap_or_else(|e| {
                    panic!("mode {}: kubelet cannot allocate {count} {resource} to {ns}/{name} {}: {e:#}", c.mode.name, ctr.name)
                });
            handed.env.extend(resp.envs.clone());
            handed
                .device_nodes
                .extend(resp.devices.iter().map(|d| d.container_path.clone()));
        }
        if !handed.env.is_empty() || !handed.device_nodes.is_empty() {
            out.insert(ctr.name.clone(), handed);
        }
    }
    out
}

/// Takes `pod` along the DRA path (see the module docs); what each container got.
pub(crate) async fn on_dra_path(c: &ChartCluster, pod: &Value) -> BTreeMap<String, Handed> {
    let created = create(c, pod).await;
    let ns = created.metadata.namespace.clone().unwrap_or_default();
    let name = created.metadata.name.clone().unwrap_or_default();
    let spec = created.spec.clone().expect("a pod spec");
    assert!(
        spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty()),
        "mode {}: pod {ns}/{name} of the DRA path was not rewritten into a claim: the webhook \
         ({}, {}) did not see it or left it; namespace labels {:?}",
        c.mode.name,
        where_from(c, "MutatingWebhookConfiguration", "gpushare-webhook"),
        where_from(c, "Deployment", "gpushare-webhook"),
        c.api
            .get_object("namespaces", None, &ns)
            .map(|n| n["metadata"]["labels"].clone())
    );
    let allocator = DraAllocator::new(c.api.admin_client());
    let end = tokio::time::Instant::now() + SCHEDULE_WITHIN;
    let node = loop {
        let pass = allocator.reconcile().await.expect("an allocator pass");
        let key = format!("{ns}/{name}");
        if let Some((_, node)) = pass.bound.iter().find(|(p, _)| *p == key) {
            break node.clone();
        }
        let bound = c
            .api
            .get_as::<Pod>("pods", Some(&ns), &name)
            .and_then(|p| p.spec)
            .and_then(|s| s.node_name);
        if let Some(node) = bound {
            break node;
        }
        if tokio::time::Instant::now() >= end {
            let classes: Vec<String> = c
                .installed
                .objects
                .iter()
                .filter(|r| r.object["kind"] == "DeviceClass")
                .map(|r| {
                    format!(
                        "{} ({}): {:?}",
                        r.object["metadata"]["name"].as_str().unwrap_or_default(),
                        r.template,
                        r.object["spec"]["selectors"]
                    )
                })
                .collect();
            panic!(
                "mode {}: pod {key} rewritten into an unschedulable claim: {:?}\nthe claim templates: {:?}\nthe DeviceClasses: {classes:#?}\nthe slices: {:?}",
                c.mode.name,
                pass.pending.iter().find(|(p, _)| *p == key),
                c.api
                    .list_objects("resourceclaimtemplates", Some(&ns))
                    .iter()
                    .map(|t| t["spec"].clone())
                    .collect::<Vec<_>>(),
                c.api
                    .list_objects("resourceslices", None)
                    .iter()
                    .map(|s| s["spec"].clone())
                    .collect::<Vec<_>>(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let sim = c.node(&node);
    let prepared = sim
        .dra_kubelet
        .prepare_pod(&ns, &name)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "mode {}: kubelet cannot prepare {ns}/{name}: {e:#}",
                c.mode.name
            )
        });
    let cdi_dir = sim.host.join("var/run/cdi");
    let specs = read_cdi(&cdi_dir);
    let mut by_request: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for claim in &prepared {
        match &claim.outcome {
            ClaimOutcome::Prepared(devices) => {
                for d in devices {
                    for r in &d.request_names {
                        by_request
                            .entry(r.clone())
                            .or_default()
                            .extend(d.cdi_device_ids.clone());
                    }
                }
            }
            other => panic!(
                "mode {}: the DRA plugin did not prepare claim {} of {ns}/{name}: {other:?}",
                c.mode.name, claim.name
            ),
        }
    }
    let mut out = BTreeMap::new();
    for ctr in spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
    {
        let claims = ctr
            .resources
            .as_ref()
            .and_then(|r| r.claims.clone())
            .unwrap_or_default();
        let mut handed = Handed::default();
        for cl in claims {
            let request = cl.request.clone().unwrap_or_default();
            for id in by_request.get(&request).into_iter().flatten() {
                let edits = specs.get(id).unwrap_or_else(|| {
                    panic!(
                        "mode {}: CDI device {id} of {ns}/{name} {} is in no spec of {}",
                        c.mode.name,
                        ctr.name,
                        cdi_dir.display()
                    )
                });
                for e in edits["env"].as_array().into_iter().flatten() {
                    if let Some((k, v)) = e.as_str().and_then(|e| e.split_once('=')) {
                        handed.env.insert(k.to_string(), v.to_string());
                    }
                }
                for n in edits["deviceNodes"].as_array().into_iter().flatten() {
                    if let Some(p) = n["path"].as_str() {
                        handed.device_nodes.push(p.to_string());
                    }
                }
            }
        }
        if !handed.env.is_empty() || !handed.device_nodes.is_empty() {
            out.insert(ctr.name.clone(), handed);
        }
    }
    out
}

/// The container edits of every CDI device in the specs of `dir`, by fully qualified name
/// (`<kind>=<device>`).
fn read_cdi(dir: &std::path::Path) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let Ok(spec) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let kind = spec["kind"].as_str().unwrap_or_default().to_string();
        for d in spec["devices"].as_array().into_iter().flatten() {
            let name = d["name"].as_str().unwrap_or_default();
            out.insert(format!("{kind}={name}"), d["containerEdits"].clone());
        }
    }
    out
}
