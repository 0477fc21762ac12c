//! The device plugin's ValidatingAdmissionPolicy (`devicePlugin.admissionPolicy`) and the DRA
//! plugin's (`dra.admissionPolicy`: its own node's ResourceSlices only), evaluated over tables
//! of allowed and forbidden requests.
//!
//! The CEL is read from the chart as the real Helm engine renders it (never copied here) and
//! evaluated with the `cel` crate the way the API server does: the resource rules and
//! `matchConditions` decide whether the policy applies, the `variables` are computed in order
//! and exposed as `variables.<name>`, and every validation must be true. The updates are built
//! as the device plugin builds them (`PodGpuAnnotations::allocated_patch`, the node
//! annotation and gpu-count keys of `core::wire`) and applied as JSON merge patches, as the
//! API server applies the plugin's patches. The policy uses only standard CEL (`has`, `in`,
//! `all`, `size`, equality), no Kubernetes CEL library function, so nothing is stubbed.

use std::collections::HashMap;

use cel::{Context, Program, Value as Cel};
use serde_json::{Value as Json, json};

use gpushare::core::PodGpuAnnotations;
use gpushare::core::wire;

use crate::support::helm_chart::{all_documents, default_values, merged};

const NAMESPACE: &str = "kube-system";

/// The policy, compiled.
struct Policy {
    rules: Vec<Json>,
    conditions: Vec<(String, Program)>,
    variables: Vec<(String, Program)>,
    validations: Vec<(String, Program)>,
}

/// What the API server decides.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// The policy does not apply (another user, another operation or resource).
    NotMatched,
    Allowed,
    /// Denied, with the message of the first failed validation.
    Denied(String),
}

fn compile(what: &str, expression: &str) -> Program {
    Program::compile(expression)
        .unwrap_or_else(|e| panic!("{what}: the cel crate cannot parse {expression:?}: {e:?}"))
}

/// The rendered policy; `None` when the Helm engine is missing (skipped; CI fails).
fn rendered_policy(values: &str) -> Option<(Policy, Vec<yaml_serde::Value>)> {
    rendered_named(values, "gpushare-device-plugin")
}

/// The rendered policy `name`, as [`rendered_policy`].
fn rendered_named(values: &str, name: &str) -> Option<(Policy, Vec<yaml_serde::Value>)> {
    let docs = all_documents(merged(
        &default_values(),
        &yaml_serde::from_str(values).expect("overlay parses"),
    ))?;
    let vap = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy" && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("the ValidatingAdmissionPolicy {name} is rendered"));
    let spec: Json = serde_json::to_value(&vap["spec"]).expect("spec as JSON");
    let named = |list: &str, key: &str| -> Vec<(String, Program)> {
        spec[list]
            .as_array()
            .unwrap_or_else(|| panic!("spec.{list}"))
            .iter()
            .map(|item| {
                let name = item[key].as_str().expect("name or message").to_string();
                let expr = item["expression"].as_str().expect("expression");
                (name.clone(), compile(&name, expr))
            })
            .collect()
    };
    let policy = Policy {
        rules: spec["matchConstraints"]["resourceRules"]
            .as_array()
            .expect("resourceRules")
            .clone(),
        conditions: named("matchConditions", "name"),
        variables: named("variables", "name"),
        validations: named("validations", "message"),
    };
    assert_eq!(spec["failurePolicy"], "Fail");
    Some((policy, docs))
}

fn cel(value: &Json) -> Cel {
    cel::to_value(value).expect("JSON converts to CEL")
}

fn rule_matches(rule: &Json, request: &Json) -> bool {
    let has = |key: &str, value: &str| {
        rule[key]
            .as_array()
            .is_some_and(|l| l.iter().any(|v| v == value || v == "*"))
    };
    let resource = request["resource"]["resource"].as_str().unwrap_or_default();
    let full = match request["subResource"].as_str() {
        Some(sub) => format!("{resource}/{sub}"),
        None => resource.to_string(),
    };
    let resource_ok = rule["resources"].as_array().is_some_and(|l| {
        l.iter().filter_map(Json::as_str).any(|r| {
            r == full
                || r == "*"
                || (r.ends_with("/*")
                    && request["subResource"].is_string()
                    && r.trim_end_matches("/*") == resource)
        })
    });
    has(
        "operations",
        request["operation"].as_str().unwrap_or_default(),
    ) && has(
        "apiGroups",
        request["resource"]["group"].as_str().unwrap_or_default(),
    ) && has(
        "apiVersions",
        request["resource"]["version"].as_str().unwrap_or_default(),
    ) && resource_ok
}

impl Policy {
    fn admit(&self, request: &Json, old: &Json, new: &Json) -> Verdict {
        if !self.rules.iter().any(|r| rule_matches(r, request)) {
            return Verdict::NotMatched;
        }
        let mut ctx = Context::default();
        ctx.add_variable_from_value("request", cel(request));
        ctx.add_variable_from_value("oldObject", cel(old));
        ctx.add_variable_from_value("object", cel(new));
        let truth = |ctx: &Context, what: &str, p: &Program| match p.execute(ctx) {
            Ok(Cel::Bool(b)) => b,
            other => panic!("{what} must evaluate to a bool: {other:?}"),
        };
        for (name, p) in &self.conditions {
            if !truth(&ctx, name, p) {
                return Verdict::NotMatched;
            }
        }
        let mut vars: HashMap<String, Cel> = HashMap::new();
        for (name, p) in &self.variables {
            let v = p
                .execute(&ctx)
                .unwrap_or_else(|e| panic!("variable {name}: {e:?}"));
            vars.insert(name.clone(), v);
            ctx.add_variable_from_value("variables", Cel::from(vars.clone()));
        }
        match self.validations.iter().find(|(m, p)| !truth(&ctx, m, p)) {
            Some((message, _)) => Verdict::Denied(message.clone()),
            None => Verdict::Allowed,
        }
    }
}

/// RFC 7386 JSON merge patch, as the API server applies `Patch::Merge`.
fn merge_patch(target: &Json, patch: &Json) -> Json {
    match patch {
        Json::Object(p) => {
            let mut out = target.as_object().cloned().unwrap_or_default();
            for (k, v) in p {
                if v.is_null() {
                    out.remove(k);
                } else {
                    let merged = merge_patch(out.get(k).unwrap_or(&Json::Null), v);
                    out.insert(k.clone(), merged);
                }
            }
            Json::Object(out)
        }
        other => other.clone(),
    }
}

const PLUGIN: &str = "system:serviceaccount:kube-system:gpushare-device-plugin";

/// An admission request by `user` whose token names `node` (none: no claim).
fn request(user: &str, node: Option<&str>, resource: &str, sub: Option<&str>, name: &str) -> Json {
    let mut user_info = json!({ "username": user, "groups": ["system:serviceaccounts"] });
    if let Some(n) = node {
        user_info["extra"] = json!({
            "authentication.kubernetes.io/node-name": [n],
            "authentication.kubernetes.io/pod-name": ["gpushare-device-plugin-ds-x1"],
        });
    }
    let mut r = json!({
        "operation": "UPDATE",
        "name": name,
        "resource": { "group": "", "version": "v1", "resource": resource },
        "userInfo": user_info,
    });
    if let Some(s) = sub {
        r["subResource"] = json!(s);
    }
    if resource == "pods" {
        r["namespace"] = json!("ml");
    }
    r
}

/// A pod bound to `node` by the extender (its annotations), requesting gpu-mem.
fn pod(node: Option<&str>) -> Json {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "train", "namespace": "ml", "uid": "u-1",
            "labels": { "app": "train" },
            "annotations": {
                wire::ANN_GPU_INDEX: "0", wire::ANN_POD_MEM: "4", wire::ANN_DEVICE_MEM: "16",
                wire::ANN_ASSIGNED: "false", wire::ANN_ASSUME_TIME: "1700000000000000000",
                "team": "vision",
            },
            "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "j-1" }],
        },
        "spec": {
            "containers": [{
                "name": "main", "image": "pytorch:2.4",
                "resources": { "limits": { wire::RESOURCE_GPU_MEM: "4" } },
            }],
        },
        "status": { "phase": "Pending" },
    });
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    p
}

/// A GPU node as kubelet and the device plugin left it.
fn node(name: &str) -> Json {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": { "gpushare": "true", "kubernetes.io/hostname": name },
            "annotations": { "node.alpha.kubernetes.io/ttl": "0", wire::NODE_ANN_MEMORY_UNIT: "GiB" },
        },
        "spec": { "podCIDR": "10.0.1.0/24" },
        "status": {
            "capacity": { "cpu": "32", "memory": "256Gi", wire::RESOURCE_GPU_MEM: "32", wire::RESOURCE_GPU_COUNT: "2" },
            "allocatable": { "cpu": "31", "memory": "250Gi", wire::RESOURCE_GPU_MEM: "32", wire::RESOURCE_GPU_COUNT: "2" },
            "conditions": [{ "type": "Ready", "status": "True" }],
            "nodeInfo": { "kubeletVersion": "v1.33.1" },
        },
    })
}

/// The device plugin's Allocate patch (the real builder) as a merge patch.
fn allocate_patch() -> Json {
    let ann =
        PodGpuAnnotations::allocated_patch(&["main".to_string()], true, 1_700_000_000_000_000_001);
    json!({ "metadata": { "annotations": ann } })
}

fn gpu_count_patch(count: &str) -> Json {
    json!({ "status": {
        "capacity": { wire::RESOURCE_GPU_COUNT: count },
        "allocatable": { wire::RESOURCE_GPU_COUNT: count },
    }})
}

#[test]
fn the_policy_allows_only_the_device_plugins_own_writes() {
    let Some((policy, _)) = rendered_policy("devicePlugin: {admissionPolicy: {enabled: true}}")
    else {
        return;
    };
    let plugin_pod = |node: Option<&str>| request(PLUGIN, node, "pods", None, "train");
    let plugin_node = |node: Option<&str>, sub: Option<&str>, name: &str| {
        request(PLUGIN, node, "nodes", sub, name)
    };
    let own = Some("gpu-a");
    let denied = |m: &str| Verdict::Denied(m.to_string());
    let msg = |fragment: &str| -> String {
        policy
            .validations
            .iter()
            .map(|(m, _)| m)
            .find(|m| m.contains(fragment))
            .unwrap_or_else(|| panic!("no validation message contains {fragment:?}"))
            .clone()
    };
    let on_a = pod(Some("gpu-a"));
    let node_a = node("gpu-a");
    let reconcile = json!({ "metadata": { "annotations": {
        wire::ANN_GPU_INDEX: "1", wire::ANN_DEVICE_MEM: "24",
        wire::POD_ANN_ALLOCATED_CONTAINERS: "", wire::ANN_ASSIGNED: "false",
    }}});
    let device_annotations = json!({ "metadata": { "annotations": {
        wire::NODE_ANN_DEVICES: r#"[{"index":0,"uuid":"GPU-a","memory":16,"healthy":true}]"#,
        wire::NODE_ANN_MEMORY_UNIT: "GiB",
        wire::NODE_ANN_EXCLUDED_GPUS: "[]",
    }}});

    // (what, request, old object, merge patch, verdict)
    let cases: Vec<(&str, Json, Json, Json, Verdict)> = vec![
        // --- what the device plugin does
        (
            "Allocate marks its own node's pod assigned",
            plugin_pod(own),
            on_a.clone(),
            allocate_patch(),
            Verdict::Allowed,
        ),
        (
            "reconcile corrects IDX/DEV/assigned on its own node's pod",
            plugin_pod(own),
            on_a.clone(),
            reconcile.clone(),
            Verdict::Allowed,
        ),
        (
            "removing one of our annotations",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "annotations": { wire::ANN_ASSUME_TIME: null } } }),
            Verdict::Allowed,
        ),
        (
            "gpu-count on its own Node's status",
            plugin_node(own, Some("status"), "gpu-a"),
            node_a.clone(),
            gpu_count_patch("3"),
            Verdict::Allowed,
        ),
        (
            "gpu-count added where there was none",
            plugin_node(own, Some("status"), "gpu-a"),
            merge_patch(
                &node_a,
                &json!({ "status": { "capacity": { wire::RESOURCE_GPU_COUNT: null }, "allocatable": { wire::RESOURCE_GPU_COUNT: null } } }),
            ),
            gpu_count_patch("2"),
            Verdict::Allowed,
        ),
        (
            "device annotations on its own Node",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            device_annotations.clone(),
            Verdict::Allowed,
        ),
        (
            "the enforcement readback on its own Node",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            json!({ "metadata": { "annotations": {
                wire::NODE_ANN_CONTAINER_GPU_MEMORY: r#"[{"namespace":"d","pod":"p","container":"c","gpu":"GPU-a","index":0,"expected":4294967296,"state":"missing"}]"#,
            }}}),
            Verdict::Allowed,
        ),
        (
            "the GPUs it offers and holds back, on its own Node, and their removal",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            json!({ "metadata": { "annotations": {
                wire::NODE_ANN_DEVICE_PLUGIN_GPUS: r#"{"offered":[0],"heldBack":{"1":"…"}}"#,
            }}}),
            Verdict::Allowed,
        ),
        // --- another node's objects
        (
            "a pod bound to another node",
            plugin_pod(own),
            pod(Some("gpu-b")),
            allocate_patch(),
            denied(&msg("pods bound to its own node")),
        ),
        (
            "a pod not bound yet",
            plugin_pod(own),
            pod(None),
            allocate_patch(),
            denied(&msg("pods bound to its own node")),
        ),
        (
            "another Node's gpu-count",
            plugin_node(own, Some("status"), "gpu-b"),
            node("gpu-b"),
            gpu_count_patch("8"),
            denied(&msg("only its own Node")),
        ),
        (
            "another Node's annotations",
            plugin_node(own, None, "gpu-b"),
            node("gpu-b"),
            device_annotations.clone(),
            denied(&msg("only its own Node")),
        ),
        (
            "a token without a node claim",
            plugin_pod(None),
            on_a.clone(),
            allocate_patch(),
            denied(&msg("names no node")),
        ),
        // --- fields that are not ours, on its own objects
        (
            "the pod's image",
            plugin_pod(own),
            on_a.clone(),
            json!({ "spec": { "containers": [{ "name": "main", "image": "evil:latest" }] } }),
            denied(&msg("spec")),
        ),
        (
            "moving the pod to another node",
            plugin_pod(own),
            on_a.clone(),
            json!({ "spec": { "nodeName": "gpu-b" } }),
            denied(&msg("pods bound to its own node")),
        ),
        (
            "a pod label",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "labels": { "app": "other" } } }),
            denied(&msg("labels")),
        ),
        (
            "a foreign pod annotation added",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "annotations": { "sidecar.istio.io/inject": "false" } } }),
            denied(&msg("annotations")),
        ),
        (
            "a foreign pod annotation removed",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "annotations": { "team": null } } }),
            denied(&msg("annotations")),
        ),
        (
            "the extender's ALIYUN_COM_GPU_MEM_POD",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "annotations": { wire::ANN_POD_MEM: "64" } } }),
            denied(&msg("annotations")),
        ),
        (
            "the pod's owner",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "ownerReferences": null } }),
            denied(&msg("ownerReferences")),
        ),
        (
            "a finalizer on the pod",
            plugin_pod(own),
            on_a.clone(),
            json!({ "metadata": { "finalizers": ["example.com/hold"] } }),
            denied(&msg("finalizers")),
        ),
        (
            "its Node's aliyun.com/gpu-mem capacity",
            plugin_node(own, Some("status"), "gpu-a"),
            node_a.clone(),
            json!({ "status": { "capacity": { wire::RESOURCE_GPU_MEM: "320" } } }),
            denied(&msg("capacity and allocatable")),
        ),
        (
            "its Node's cpu allocatable removed",
            plugin_node(own, Some("status"), "gpu-a"),
            node_a.clone(),
            json!({ "status": { "allocatable": { "cpu": null } } }),
            denied(&msg("capacity and allocatable")),
        ),
        (
            "its Node's Ready condition",
            plugin_node(own, Some("status"), "gpu-a"),
            node_a.clone(),
            json!({ "status": { "conditions": [{ "type": "Ready", "status": "False" }] } }),
            denied(&msg("status field")),
        ),
        (
            "a label on its Node",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            json!({ "metadata": { "labels": { "node-role.kubernetes.io/control-plane": "" } } }),
            denied(&msg("labels")),
        ),
        (
            "the gpushare label of its Node",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            json!({ "metadata": { "labels": { wire::LABEL_GPUSHARE: null } } }),
            denied(&msg("labels")),
        ),
        (
            "a taint on its Node",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            json!({ "spec": { "taints": [{ "key": "x", "effect": "NoSchedule" }] } }),
            denied(&msg("spec")),
        ),
        (
            "a foreign annotation on its Node",
            plugin_node(own, None, "gpu-a"),
            node_a.clone(),
            json!({ "metadata": { "annotations": { "node.alpha.kubernetes.io/ttl": "30" } } }),
            denied(&msg("annotations")),
        ),
        // --- everybody else is not affected
        (
            "kubelet updating its Node's conditions",
            request("system:node:gpu-a", None, "nodes", Some("status"), "gpu-a"),
            node_a.clone(),
            json!({ "status": { "conditions": [{ "type": "Ready", "status": "False" }] } }),
            Verdict::NotMatched,
        ),
        (
            "the extender annotating a pod anywhere",
            request(
                "system:serviceaccount:kube-system:gpushare-schd-extender",
                None,
                "pods",
                None,
                "train",
            ),
            pod(Some("gpu-b")),
            json!({ "metadata": { "annotations": { wire::ANN_POD_MEM: "8" } } }),
            Verdict::NotMatched,
        ),
        (
            "an admin changing the image",
            request("kubernetes-admin", None, "pods", None, "train"),
            on_a.clone(),
            json!({ "spec": { "containers": [{ "name": "main", "image": "pytorch:2.5" }] } }),
            Verdict::NotMatched,
        ),
        (
            "a same-named ServiceAccount in another namespace",
            request(
                "system:serviceaccount:default:gpushare-device-plugin",
                own,
                "pods",
                None,
                "train",
            ),
            pod(Some("gpu-b")),
            allocate_patch(),
            Verdict::NotMatched,
        ),
    ];
    let mut failures = Vec::new();
    for (what, req, old, patch, expected) in &cases {
        let new = merge_patch(old, patch);
        assert_ne!(&new, old, "{what}: the patch must change something");
        let got = policy.admit(req, old, &new);
        if &got != expected {
            failures.push(format!("{what}: expected {expected:?}, got {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // A create or delete is not an UPDATE: not this policy's business (RBAC grants neither).
    let mut create = plugin_pod(own);
    create["operation"] = json!("CREATE");
    assert_eq!(
        policy.admit(&create, &Json::Null, &on_a),
        Verdict::NotMatched
    );
}

#[test]
fn the_policy_names_the_release_namespace_and_its_binding_denies() {
    let Some((policy, docs)) = rendered_policy("devicePlugin: {admissionPolicy: {enabled: true}}")
    else {
        return;
    };
    let binding = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
        .expect("a binding");
    assert_eq!(binding["spec"]["policyName"], "gpushare-device-plugin");
    assert_eq!(binding["spec"]["validationActions"][0], "Deny");
    // The ServiceAccount is the one the DaemonSet runs as, in the release namespace.
    let ds = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("the DaemonSet");
    let sa = ds["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .expect("serviceAccountName");
    assert_eq!(
        format!("system:serviceaccount:{NAMESPACE}:{sa}"),
        PLUGIN,
        "the table's user is the DaemonSet's"
    );
    let mut req = request(PLUGIN, Some("gpu-a"), "pods", None, "train");
    let on_b = pod(Some("gpu-b"));
    let new = merge_patch(&on_b, &allocate_patch());
    assert!(matches!(
        policy.admit(&req, &on_b, &new),
        Verdict::Denied(_)
    ));
    req["userInfo"]["username"] = json!("system:serviceaccount:gpu:gpushare-device-plugin");
    assert_eq!(policy.admit(&req, &on_b, &new), Verdict::NotMatched);
}

#[test]
fn the_policy_renders_where_the_cluster_serves_it_and_can_be_turned_off() {
    let has_policy = |values: &str| -> Option<bool> {
        let docs = all_documents(merged(
            &default_values(),
            &yaml_serde::from_str(values).expect("overlay parses"),
        ))?;
        Some(
            docs.iter()
                .any(|d| d["kind"] == "ValidatingAdmissionPolicy"),
        )
    };
    // `auto` (the default) follows .Capabilities: the engine's offline default API set (as
    // `helm template` has it) does not list the kind, so the default render has no policy.
    let Some(default) = has_policy("{}") else {
        return;
    };
    assert!(
        !default,
        "auto without the API in .Capabilities renders no policy"
    );
    assert_eq!(
        has_policy("devicePlugin: {admissionPolicy: {enabled: true}}"),
        Some(true)
    );
    assert_eq!(
        has_policy("devicePlugin: {admissionPolicy: {enabled: false}}"),
        Some(false)
    );
}

// ---------------------------------------------------------------- the DRA plugin's policy

const DRA_PLUGIN: &str = "system:serviceaccount:kube-system:gpushare-dra-plugin";

/// A write of a ResourceSlice by `user`, whose token names `node`.
fn slice_request(user: &str, node: Option<&str>, operation: &str) -> Json {
    let mut r = request(user, node, "resourceslices", None, "node-a-gpushare.io-x");
    r["operation"] = json!(operation);
    r["resource"] =
        json!({ "group": "resource.k8s.io", "version": "v1", "resource": "resourceslices" });
    r
}

fn slice(node: &str, driver: &str) -> Json {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": "node-a-gpushare.io-x" },
        "spec": { "driver": driver, "nodeName": node,
                  "pool": { "name": node, "generation": 2, "resourceSliceCount": 1 },
                  "devices": [{ "name": "gpu-0", "allowMultipleAllocations": true }] },
    })
}

#[test]
fn the_dra_policy_keeps_each_plugin_to_its_own_nodes_slices() {
    let Some((policy, _)) = rendered_named(
        "{ dra: { enabled: true, admissionPolicy: { enabled: true } } }",
        "gpushare-dra-plugin",
    ) else {
        return;
    };
    let mine = slice("node-a", "gpushare.io");
    let other = slice("node-b", "gpushare.io");
    let foreign = slice("node-a", "example.com");
    let null = Json::Null;
    let own = "the DRA plugin may write only the ResourceSlices of its own node";
    let own_old = "the DRA plugin may change or delete only the ResourceSlices of its own node";
    let cases: Vec<(&str, Json, &Json, &Json, Verdict)> = vec![
        ("create own", slice_request(DRA_PLUGIN, Some("node-a"), "CREATE"), &null, &mine, Verdict::Allowed),
        ("update own", slice_request(DRA_PLUGIN, Some("node-a"), "UPDATE"), &mine, &mine, Verdict::Allowed),
        ("delete own", slice_request(DRA_PLUGIN, Some("node-a"), "DELETE"), &mine, &null, Verdict::Allowed),
        ("create another node's", slice_request(DRA_PLUGIN, Some("node-a"), "CREATE"), &null, &other, Verdict::Denied(own.into())),
        ("move another node's to own", slice_request(DRA_PLUGIN, Some("node-a"), "UPDATE"), &other, &mine, Verdict::Denied(own_old.into())),
        ("move own to another node", slice_request(DRA_PLUGIN, Some("node-a"), "UPDATE"), &mine, &other, Verdict::Denied(own.into())),
        ("delete another node's", slice_request(DRA_PLUGIN, Some("node-a"), "DELETE"), &other, &null, Verdict::Denied(own_old.into())),
        ("another driver", slice_request(DRA_PLUGIN, Some("node-a"), "CREATE"), &null, &foreign,
            Verdict::Denied("the DRA plugin may write only the ResourceSlices of its driver".into())),
        ("a token without a node", slice_request(DRA_PLUGIN, None, "CREATE"), &null, &mine,
            Verdict::Denied("the DRA plugin's token names no node (claim authentication.kubernetes.io/node-name): use a pod-bound token (Kubernetes 1.30+)".into())),
        ("another user", slice_request("system:serviceaccount:kube-system:other", None, "DELETE"), &other, &null, Verdict::NotMatched),
        ("the device plugin's pods are not its business",
            request(DRA_PLUGIN, Some("node-a"), "pods", None, "p"), &null, &null, Verdict::NotMatched),
    ];
    for (what, req, old, new, want) in cases {
        assert_eq!(policy.admit(&req, old, new), want, "{what}");
    }
}

/// The DRA plugin's writes on Nodes: its own Node, and there only the DRA path's annotations
/// (`gpushare.io/dra-gpus`; with enforcement `gpushare.io/container-gpu-memory`), never a
/// label, a spec, another annotation, an owner or finalizer.
#[test]
fn the_dra_policy_keeps_each_plugin_to_its_own_nodes_annotations_of_the_dra_path() {
    let Some((policy, _)) = rendered_named(
        "{ dra: { enabled: true, admissionPolicy: { enabled: true } } }",
        "gpushare-dra-plugin-node",
    ) else {
        return;
    };
    let mine = node("node-a");
    let theirs = node("node-b");
    let patched = |n: &Json, patch: Json| merge_patch(n, &patch);
    let gate = json!({ "metadata": { "annotations": { wire::NODE_ANN_DRA_GPUS: "{\"offered\":[0,1],\"heldBack\":{}}" } } });
    let use_ =
        json!({ "metadata": { "annotations": { "gpushare.io/container-gpu-memory": "{}" } } });
    let gone = json!({ "metadata": { "annotations": { wire::NODE_ANN_DRA_GPUS: null } } });
    let devices = json!({ "metadata": { "annotations": { "gpushare.io/devices": "[]" } } });
    let label = json!({ "metadata": { "labels": { "gpushare": null } } });
    let taint = json!({ "spec": { "taints": [{ "key": "x", "effect": "NoSchedule" }] } });
    let finalizer = json!({ "metadata": { "finalizers": ["x"] } });
    let node_req =
        |user: &str, token: Option<&str>, name: &str| request(user, token, "nodes", None, name);
    let with_gate = patched(&mine, gate.clone());
    let cases: Vec<(&str, Json, Json, Json, Verdict)> = vec![
        ("its path's annotation", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), mine.clone(), with_gate.clone(), Verdict::Allowed),
        ("the containers' use", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), mine.clone(), patched(&mine, use_), Verdict::Allowed),
        ("the annotation removed at stop", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), with_gate.clone(), patched(&with_gate, gone), Verdict::Allowed),
        ("another node", node_req(DRA_PLUGIN, Some("node-a"), "node-b"), theirs.clone(), patched(&theirs, gate.clone()),
            Verdict::Denied("the DRA plugin may change only its own Node".into())),
        ("the device plugin's annotation", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), mine.clone(), patched(&mine, devices),
            Verdict::Denied("the DRA plugin may change only the annotations of the DRA path".into())),
        ("a label", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), mine.clone(), patched(&mine, label),
            Verdict::Denied("the DRA plugin may not change labels".into())),
        ("a taint", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), mine.clone(), patched(&mine, taint),
            Verdict::Denied("the DRA plugin may not change a spec".into())),
        ("a finalizer", node_req(DRA_PLUGIN, Some("node-a"), "node-a"), mine.clone(), patched(&mine, finalizer),
            Verdict::Denied("the DRA plugin may not change metadata.finalizers".into())),
        ("a token without a node", node_req(DRA_PLUGIN, None, "node-a"), mine.clone(), with_gate.clone(),
            Verdict::Denied("the DRA plugin's token names no node (claim authentication.kubernetes.io/node-name): use a pod-bound token (Kubernetes 1.30+)".into())),
        ("another user", node_req("system:serviceaccount:kube-system:other", None, "node-b"), theirs.clone(), patched(&theirs, json!({ "metadata": { "labels": { "x": "y" } } })), Verdict::NotMatched),
    ];
    for (what, req, old, new, want) in cases {
        assert_eq!(policy.admit(&req, &old, &new), want, "{what}");
    }
}
