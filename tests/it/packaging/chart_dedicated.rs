//! The chart in `scheduler.mode: dedicated` (managed clusters), rendered by the real Helm v4
//! engine (helm-python-sdk from PyPI, through `support::clients::helm_chart`): the dedicated
//! kube-scheduler, its KubeSchedulerConfiguration (read back by doctor's own parser), its
//! RBAC and Lease, and the webhook with both configurations and its least-privilege RBAC.
//!
//! `templates/managed/` uses full Helm syntax (`include`, `with`, `dict`, `regexFind`,
//! `.Capabilities`); these tests need helm-python-sdk (`make clients`, which `.ci/run` runs).

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use gpushare::core::wire;

use crate::support::assert_cli_accepts;
use crate::support::helm_chart::engine;
use crate::support::source_tree::{repo_path, yaml_documents};

const RELEASE: &str = "gpushare";
const NAMESPACE: &str = "kube-system";

/// One request to the real Helm engine (`support::clients::helm_chart`, the one way the tests
/// reach it); every test first checks [`engine`] and returns (skipped) without it.
fn helm(request: Value) -> Value {
    crate::support::clients::helm_chart(&request)
        .unwrap_or_else(|| panic!("the real Helm engine is needed: make clients"))
}

/// Renders the chart with `values` (template paths in full); `Err` carries Helm's error.
fn helm_render(values: Value, namespace: &str) -> Result<BTreeMap<String, String>, String> {
    let answer = helm(json!({
        "chart": repo_path("packaging/helm/gpushare"),
        "release": RELEASE,
        "namespace": namespace,
        "renders": [values],
        "full_paths": true,
    }));
    let render = &answer["renders"][0];
    if let Some(e) = render.get("error") {
        return Err(e.as_str().unwrap_or_default().to_string());
    }
    serde_json::from_value(render["manifests"].clone()).map_err(|e| e.to_string())
}

/// `helm lint --strict` of the chart with `values` against Kubernetes `kube`.
fn helm_lint(values: &Value, kube: &str) -> Value {
    let answer = helm(json!({
        "chart": repo_path("packaging/helm/gpushare"),
        "release": RELEASE,
        "namespace": NAMESPACE,
        "lints": [values],
        "kube_version": kube,
    }));
    answer["lints"][0].clone()
}

#[test]
fn helm_lint_strict_passes_in_both_modes_on_the_oldest_and_newest_kubernetes() {
    if engine().is_none() {
        return;
    }
    for (values, kube) in [
        (json!({}), "v1.27.0"),
        (dedicated(), "v1.27.0"),
        (dedicated(), "v1.33.0"),
    ] {
        let report = helm_lint(&values, kube);
        assert_eq!(
            report["errors"],
            json!([]),
            "{values} on {kube}: {report:#}"
        );
        let serious: Vec<&Value> = report["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["severity"].as_u64().unwrap_or(3) >= 2)
            .collect();
        assert!(serious.is_empty(), "{values} on {kube}: {serious:#?}");
    }
}

/// Every object the managed templates render, as JSON.
fn managed_objects(values: Value) -> Vec<Value> {
    let rendered = helm_render(values, NAMESPACE).unwrap_or_else(|e| panic!("helm: {e}"));
    rendered
        .iter()
        .filter(|(path, _)| path.contains("/templates/managed/"))
        .flat_map(|(path, text)| yaml_documents(path, text))
        .map(|doc| serde_json::to_value(doc).expect("YAML to JSON"))
        .collect()
}

fn dedicated() -> Value {
    json!({ "scheduler": { "mode": "dedicated" } })
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn typed<T: DeserializeOwned + Serialize>(doc: &Value) {
    let t: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{}: {e}", doc["metadata"]["name"]));
    let back = serde_json::to_value(&t).expect("serialize");
    assert_eq!(
        &back, doc,
        "fields lost by the typed round trip of {} {}",
        doc["kind"], doc["metadata"]["name"]
    );
}

#[test]
fn extender_mode_renders_no_managed_object() {
    if engine().is_none() {
        return;
    }
    assert!(managed_objects(json!({})).is_empty());
    let err = helm_render(json!({ "scheduler": { "mode": "sideways" } }), NAMESPACE)
        .expect_err("an unknown mode is refused");
    assert!(
        err.contains("at '/scheduler/mode': value must be one of 'extender', 'dedicated'"),
        "{err}"
    );
}

#[test]
fn dedicated_mode_objects_are_valid_kubernetes_objects() {
    if engine().is_none() {
        return;
    }
    let objects = managed_objects(dedicated());
    let mut kinds = std::collections::BTreeSet::new();
    for o in &objects {
        let kind = o["kind"].as_str().unwrap_or_default().to_string();
        match kind.as_str() {
            "Deployment" => typed::<Deployment>(o),
            "ConfigMap" => typed::<ConfigMap>(o),
            "Service" => typed::<Service>(o),
            "ServiceAccount" => typed::<ServiceAccount>(o),
            "ClusterRole" => typed::<ClusterRole>(o),
            "ClusterRoleBinding" => typed::<ClusterRoleBinding>(o),
            "Role" => typed::<Role>(o),
            "RoleBinding" => typed::<RoleBinding>(o),
            "PriorityClass" => typed::<PriorityClass>(o),
            "PodDisruptionBudget" => typed::<PodDisruptionBudget>(o),
            "MutatingWebhookConfiguration" => typed::<MutatingWebhookConfiguration>(o),
            "ValidatingWebhookConfiguration" => typed::<ValidatingWebhookConfiguration>(o),
            other => panic!("unexpected kind {other}"),
        }
        kinds.insert(kind);
    }
    assert_eq!(kinds.len(), 12, "{kinds:?}");
}

#[test]
fn the_dedicated_scheduler_calls_our_extender() {
    if engine().is_none() {
        return;
    }
    let objects = managed_objects(dedicated());
    let cm = find(&objects, "ConfigMap", "gpushare-scheduler");
    let text = cm["data"]["scheduler-config.yaml"]
        .as_str()
        .expect("config text");
    let ksc: yaml_serde::Value =
        yaml_serde::from_str(text).expect("KubeSchedulerConfiguration YAML");
    let ksc = serde_json::to_value(ksc).expect("json");
    assert_eq!(ksc["apiVersion"], "kubescheduler.config.k8s.io/v1");
    assert_eq!(ksc["kind"], "KubeSchedulerConfiguration");
    assert_eq!(
        ksc["profiles"],
        json!([{ "schedulerName": "gpushare-scheduler" }])
    );
    assert_eq!(
        ksc["leaderElection"],
        json!({ "leaderElect": true, "resourceLock": "leases", "resourceName": "gpushare-scheduler", "resourceNamespace": NAMESPACE })
    );
    let ext = &ksc["extenders"][0];
    assert_eq!(
        ext["urlPrefix"],
        format!(
            "http://gpushare-schd-extender.{NAMESPACE}.svc:12345{}",
            wire::EXTENDER_URL_PREFIX
        )
    );
    assert_eq!(ext["filterVerb"], "filter");
    assert_eq!(ext["prioritizeVerb"], "prioritize");
    assert_eq!(ext["bindVerb"], "bind");
    assert_eq!(ext["nodeCacheCapable"], true);
    assert_eq!(ext["ignorable"], false);
    assert_eq!(
        ext["managedResources"],
        json!([{ "name": wire::RESOURCE_GPU_MEM, "ignoredByScheduler": false }])
    );
    // doctor reads the same file and finds nothing wrong with it.
    let verdict = gpushare::doctor::managed::evaluate_dedicated_config(text, "gpushare-scheduler");
    assert!(verdict.is_ok(), "{verdict:?}");

    let deploy = find(&objects, "Deployment", "gpushare-scheduler");
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "gpushare-scheduler");
    assert_eq!(pod["priorityClassName"], "gpushare-control-plane");
    let c = &pod["containers"][0];
    let image = c["image"].as_str().unwrap_or_default();
    let tag = image
        .strip_prefix("registry.k8s.io/kube-scheduler:")
        .expect("upstream image");
    let version: Vec<&str> = tag.trim_start_matches('v').split('.').collect();
    assert!(
        tag.starts_with('v')
            && version.len() == 3
            && version.iter().all(|p| p.parse::<u32>().is_ok()),
        "{tag}"
    );
    assert!(c["command"].as_array().expect("command").contains(&json!(
        "--config=/etc/gpushare-scheduler/scheduler-config.yaml"
    )));
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(c[probe]["httpGet"]["scheme"], "HTTPS", "{probe}");
        assert_eq!(c[probe]["httpGet"]["port"], "https", "{probe}");
    }
    assert_eq!(c["ports"][0]["containerPort"], 10259);
    let pc = find(&objects, "PriorityClass", "gpushare-control-plane");
    assert_eq!(pc["value"], 1_000_000_000);
    // The tag follows the value when given; the checksum rolls the pods on config changes.
    let pinned = managed_objects(
        json!({ "scheduler": { "mode": "dedicated", "image": { "tag": "v1.31.4" }, "httpTimeout": "20s" } }),
    );
    let deploy2 = find(&pinned, "Deployment", "gpushare-scheduler");
    assert_eq!(
        deploy2["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.k8s.io/kube-scheduler:v1.31.4"
    );
    assert_ne!(
        deploy2["spec"]["template"]["metadata"]["annotations"]["checksum/config"],
        deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    );
}

#[test]
fn the_dedicated_scheduler_has_the_rbac_of_a_scheduler_and_its_own_lease() {
    if engine().is_none() {
        return;
    }
    let objects = managed_objects(dedicated());
    for (binding, role) in [
        ("gpushare-scheduler-kube-scheduler", "system:kube-scheduler"),
        (
            "gpushare-scheduler-volume-scheduler",
            "system:volume-scheduler",
        ),
        ("gpushare-scheduler-auth-delegator", "system:auth-delegator"),
    ] {
        let b = find(&objects, "ClusterRoleBinding", binding);
        assert_eq!(b["roleRef"]["name"], role);
        assert_eq!(b["subjects"][0]["name"], "gpushare-scheduler");
        assert_eq!(b["subjects"][0]["namespace"], NAMESPACE);
    }
    let lease = find(&objects, "Role", "gpushare-scheduler");
    let rules = lease["rules"].as_array().expect("rules");
    assert!(rules.iter().any(|r| {
        r["resources"] == json!(["leases"])
            && r["resourceNames"] == json!(["gpushare-scheduler"])
            && r["verbs"]
                .as_array()
                .is_some_and(|v| v.contains(&json!("update")))
    }));
    let events = find(&objects, "ClusterRole", "gpushare-scheduler-events");
    assert_eq!(events["rules"][0]["resources"], json!(["events"]));
}

#[test]
fn the_webhook_ships_two_replicas_both_configurations_and_least_privilege_rbac() {
    if engine().is_none() {
        return;
    }
    let objects = managed_objects(
        json!({ "scheduler": { "mode": "dedicated" }, "webhook": { "failurePolicy": "Ignore", "timeoutSeconds": 7 } }),
    );
    let deploy = find(&objects, "Deployment", "gpushare-webhook");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<String> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap_or_default().to_string())
        .collect();
    assert!(
        args.contains(&"--self-signed".to_string())
            && args.contains(&"--scheduler-name=gpushare-scheduler".to_string()),
        "{args:?}"
    );
    assert_cli_accepts(&args, "the webhook Deployment");
    assert_eq!(c["readinessProbe"]["httpGet"]["scheme"], "HTTPS");
    let svc = find(&objects, "Service", "gpushare-webhook");
    assert_eq!(svc["spec"]["ports"][0]["port"], 443);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "https");
    find(&objects, "PodDisruptionBudget", "gpushare-webhook");
    for (kind, path) in [
        ("MutatingWebhookConfiguration", "/mutate"),
        ("ValidatingWebhookConfiguration", "/validate"),
    ] {
        let cfg = find(&objects, kind, "gpushare-webhook");
        let hook = &cfg["webhooks"][0];
        assert_eq!(hook["sideEffects"], "NoneOnDryRun");
        assert_eq!(hook["admissionReviewVersions"], json!(["v1"]));
        assert_eq!(hook["timeoutSeconds"], 7);
        assert_eq!(hook["failurePolicy"], "Ignore");
        assert_eq!(
            hook["clientConfig"]["service"],
            json!({ "name": "gpushare-webhook", "namespace": NAMESPACE, "path": path, "port": 443 })
        );
        assert!(
            hook["clientConfig"].get("caBundle").is_none(),
            "the webhook writes the caBundle itself"
        );
        assert_eq!(
            hook["namespaceSelector"]["matchExpressions"],
            json!([
                { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"] },
                { "key": "gpushare.io/webhook", "operator": "NotIn", "values": ["disabled"] },
            ])
        );
        assert_eq!(hook["rules"][0]["resources"], json!(["pods"]));
        assert_eq!(hook["rules"][0]["operations"], json!(["CREATE"]));
    }
    // RBAC: its Secret and its two configurations, nothing else.
    let role = find(&objects, "Role", "gpushare-webhook");
    for rule in role["rules"].as_array().expect("rules") {
        assert_eq!(rule["resources"], json!(["secrets"]));
        if rule["verbs"] != json!(["create"]) {
            assert_eq!(rule["resourceNames"], json!(["gpushare-webhook-tls"]));
        }
    }
    // Cluster-wide: its two configurations and reading namespaces (the gpu-mem-path label);
    // with dra.enabled also the DRA path's claim templates (packaging::dra_chart); nothing
    // else.
    let cr = find(&objects, "ClusterRole", "gpushare-webhook");
    assert_eq!(cr["rules"].as_array().map(Vec::len), Some(2));
    assert_eq!(cr["rules"][0]["resourceNames"], json!(["gpushare-webhook"]));
    assert_eq!(
        cr["rules"][0]["resources"],
        json!([
            "mutatingwebhookconfigurations",
            "validatingwebhookconfigurations"
        ])
    );
    assert_eq!(cr["rules"][1]["resources"], json!(["namespaces"]));
    assert_eq!(cr["rules"][1]["verbs"], json!(["get"]));
}

#[test]
fn another_namespace_is_skipped_by_its_own_webhook_and_cert_manager_is_supported() {
    if engine().is_none() {
        return;
    }
    let rendered = helm_render(
        json!({ "scheduler": { "mode": "dedicated" },
                "webhook": { "tls": { "existingSecret": "gpushare-webhook-cert", "injectCaFrom": "gpushare/gpushare-webhook" } } }),
        "gpushare",
    )
    .expect("renders");
    let objects: Vec<Value> = rendered
        .iter()
        .filter(|(p, _)| p.contains("/templates/managed/"))
        .flat_map(|(p, t)| yaml_documents(p, t))
        .map(|d| serde_json::to_value(d).expect("json"))
        .collect();
    let cfg = find(&objects, "MutatingWebhookConfiguration", "gpushare-webhook");
    assert_eq!(
        cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "gpushare/gpushare-webhook"
    );
    assert_eq!(
        cfg["webhooks"][0]["namespaceSelector"]["matchExpressions"][0]["values"],
        json!(["kube-system", "gpushare"])
    );
    let deploy = find(&objects, "Deployment", "gpushare-webhook");
    let spec = &deploy["spec"]["template"]["spec"];
    let args = spec["containers"][0]["args"].as_array().expect("args");
    assert!(args.contains(&json!("--tls-cert=/etc/gpushare/webhook-tls/tls.crt")));
    assert!(!args.contains(&json!("--self-signed")));
    assert_eq!(
        spec["volumes"][0]["secret"]["secretName"],
        "gpushare-webhook-cert"
    );
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "Role" && o["metadata"]["name"] == "gpushare-webhook"),
        "no Secret access needed"
    );
}
