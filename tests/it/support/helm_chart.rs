//! The Helm chart as the packaging tests render it: the chart's default values and `--set`-like
//! merges, one request to the real Helm engine (helm-python-sdk, see [`super::clients`]),
//! every rendered object, the typed check of an object against its k8s-openapi type, and the
//! scheduler-configuration block that the chart and the kubeadm script must both carry.

use std::collections::BTreeMap;

use gpushare::core::wire;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use yaml_serde::Value;

use super::clients;
use super::source_tree::{read, repo_path, yaml_documents};

/// The chart's directory in the source tree.
pub(crate) const CHART: &str = "packaging/helm/gpushare";
/// The release name the chart is rendered under (as the plain manifests are).
pub(crate) const RELEASE: &str = "gpushare";
/// The namespace the chart is rendered into.
pub(crate) const NAMESPACE: &str = "kube-system";

/// Whether the real Helm engine is here: `None` after [`clients::skip`]'s `SKIPPED` line when
/// helm-python-sdk is missing (under CI that fails the test). Tests that reach the engine
/// through a helper of their own call this first and return on `None`.
pub(crate) fn engine() -> Option<()> {
    clients::python_with(&["helm_python"]).map(|_| ())
}

/// The chart's own `values.yaml`.
pub(crate) fn default_values() -> Value {
    yaml_serde::from_str(&read(&format!("{CHART}/values.yaml"))).expect("values.yaml parses")
}

/// `base` with `overlay` merged in (maps deeply, everything else replaced), like `--set`.
pub(crate) fn merged(base: &Value, overlay: &Value) -> Value {
    match (base, overlay) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            let mut out = b.clone();
            for (k, v) in o {
                let merged_v = match b.get(k) {
                    Some(bv) => merged(bv, v),
                    None => v.clone(),
                };
                out.insert(k.clone(), merged_v);
            }
            Value::Mapping(out)
        }
        (_, o) => o.clone(),
    }
}

/// One request to the Helm engine: renders of `renders` and `helm lint --strict` with `lints`.
/// `None` when helm-python-sdk is missing (skipped; under CI the test fails).
pub(crate) fn helm(renders: &[&Value], lints: &[&Value]) -> Option<serde_json::Value> {
    clients::helm_chart(&serde_json::json!({
        "chart": repo_path(CHART),
        "release": RELEASE,
        "namespace": NAMESPACE,
        "renders": renders,
        "lints": lints,
    }))
}

/// Renders each of `values` (user values, merged by Helm itself), with NOTES.txt where
/// `notes`: each render's answer (`manifests`, `notes`) or Helm's error message; `None`
/// without the engine (skipped).
pub(crate) fn user_renders(
    values: &[serde_json::Value],
    notes: bool,
) -> Option<Vec<Result<serde_json::Value, String>>> {
    let answer = clients::helm_chart(&serde_json::json!({
        "chart": repo_path(CHART),
        "release": RELEASE,
        "namespace": NAMESPACE,
        "renders": values,
        "notes": notes,
    }))?;
    Some(
        answer["renders"]
            .as_array()
            .expect("renders")
            .iter()
            .map(|r| match r.get("error") {
                Some(e) => Err(e.as_str().unwrap_or_default().to_string()),
                None => Ok(r.clone()),
            })
            .collect(),
    )
}

/// Every object the chart renders with the chart's defaults and `overlay` (YAML) merged in;
/// `None` without the engine (skipped).
pub(crate) fn documents_with(overlay: &str) -> Option<Vec<Value>> {
    all_documents(merged(
        &default_values(),
        &yaml_serde::from_str(overlay).expect("overlay parses"),
    ))
}

/// The object of `kind` named `name` among `docs`.
pub(crate) fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

/// The pod spec of DaemonSet `name` rendered with `overlay`; `None` without the engine.
pub(crate) fn daemonset_pod_spec(overlay: &str, name: &str) -> Option<Value> {
    let docs = documents_with(overlay)?;
    find(&docs, "DaemonSet", name).map(|d| d["spec"]["template"]["spec"].clone())
}

/// `(mountPath, hostPath, readOnly)` of each hostPath volume of pod spec `spec` mounted into
/// `container`.
pub(crate) fn host_mounts(spec: &Value, container: &Value) -> Vec<(String, String, bool)> {
    let volumes = spec["volumes"].as_sequence().cloned().unwrap_or_default();
    container["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let v = volumes.iter().find(|v| v["name"] == m["name"])?;
            Some((
                m["mountPath"].as_str()?.to_string(),
                v["hostPath"]["path"].as_str()?.to_string(),
                m["readOnly"].as_bool().unwrap_or(false),
            ))
        })
        .collect()
}

/// The value of environment variable `name` of `container`, where it has one.
pub(crate) fn env_value(container: &Value, name: &str) -> Option<String> {
    container["env"]
        .as_sequence()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(str::to_string))
}

/// Every template's rendered text, by file name (sorted), as the Helm engine renders it with
/// `values` as the user's values; `None` when the engine is missing (skipped).
pub(crate) fn render_chart(values: Value) -> Option<BTreeMap<String, String>> {
    let answer = helm(&[&values], &[])?;
    let render = &answer["renders"][0];
    if let Some(e) = render.get("error") {
        panic!("Helm cannot render the chart: {e:?}");
    }
    let out: BTreeMap<String, String> =
        serde_json::from_value(render["manifests"].clone()).expect("manifests by file");
    assert!(!out.is_empty(), "no templates rendered");
    Some(out)
}

/// Parses `doc` as `T` and serializes it back: equal only if every field is one `T` knows,
/// with the right type (k8s-openapi's deserializers alone ignore unknown fields).
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<(), String> {
    let typed: T = yaml_serde::from_value(doc.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let original = serde_json::to_value(doc).map_err(|e| e.to_string())?;
    if back == original {
        Ok(())
    } else {
        Err(format!(
            "fields lost or changed by the typed round trip:\n--- as written\n{}\n--- as {}\n{}",
            serde_json::to_string_pretty(&original).unwrap_or_default(),
            std::any::type_name::<T>(),
            serde_json::to_string_pretty(&back).unwrap_or_default()
        ))
    }
}

/// Checks `doc` against the k8s-openapi type its `kind` names; returns the kind.
pub(crate) fn check_typed(doc: &Value) -> Result<String, String> {
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .ok_or("document without kind")?
        .to_string();
    match kind.as_str() {
        "Deployment" => round_trip::<Deployment>(doc),
        "DaemonSet" => round_trip::<DaemonSet>(doc),
        "Service" => round_trip::<Service>(doc),
        "ServiceAccount" => round_trip::<ServiceAccount>(doc),
        "ClusterRole" => round_trip::<ClusterRole>(doc),
        "ClusterRoleBinding" => round_trip::<ClusterRoleBinding>(doc),
        "Role" => round_trip::<Role>(doc),
        "RoleBinding" => round_trip::<RoleBinding>(doc),
        "ConfigMap" => round_trip::<ConfigMap>(doc),
        "PodDisruptionBudget" => {
            round_trip::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(doc)
        }
        "ValidatingAdmissionPolicy" => round_trip::<
            k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy,
        >(doc),
        "ValidatingAdmissionPolicyBinding" => round_trip::<
            k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding,
        >(doc),
        // Prometheus Operator's CRD: not in k8s-openapi; its shape is checked in
        // chart_production.rs.
        "ServiceMonitor" if doc["apiVersion"] == "monitoring.coreos.com/v1" => Ok(()),
        other => Err(format!("unexpected kind {other}")),
    }?;
    Ok(kind)
}

/// Every rendered object; `None` when the Helm engine is missing (skipped).
pub(crate) fn all_documents(values: Value) -> Option<Vec<Value>> {
    Some(
        render_chart(values)?
            .iter()
            .flat_map(|(name, text)| yaml_documents(name, text))
            .collect(),
    )
}

/// The extender block every copy of the scheduler configuration must carry.
pub(crate) fn assert_scheduler_config(cfg: &Value, url: &str) {
    assert_eq!(cfg["apiVersion"], "kubescheduler.config.k8s.io/v1");
    assert_eq!(cfg["kind"], "KubeSchedulerConfiguration");
    assert_eq!(
        cfg["clientConnection"]["kubeconfig"],
        "/etc/kubernetes/scheduler.conf"
    );
    let extenders = cfg["extenders"].as_sequence().expect("extenders");
    assert_eq!(extenders.len(), 1);
    let e = &extenders[0];
    assert_eq!(e["urlPrefix"], url);
    assert_eq!(e["filterVerb"], "filter");
    assert_eq!(e["prioritizeVerb"], "prioritize");
    assert_eq!(e["bindVerb"], "bind");
    assert_eq!(e["weight"], 1);
    assert_eq!(e["enableHTTPS"], false);
    assert_eq!(e["nodeCacheCapable"], true);
    assert_eq!(e["httpTimeout"], "10s");
    assert_eq!(e["ignorable"], false);
    let managed = e["managedResources"]
        .as_sequence()
        .expect("managedResources");
    assert_eq!(managed.len(), 1);
    assert_eq!(managed[0]["name"], wire::RESOURCE_GPU_MEM);
    assert_eq!(managed[0]["ignoredByScheduler"], false);
}

/// The default extender URL: the Service's NodePort on the loopback.
pub(crate) fn default_extender_url() -> String {
    format!("http://127.0.0.1:32766{}", wire::EXTENDER_URL_PREFIX)
}

/// Every option on (scheduler.mode is one or the other: the dedicated mode renders the
/// extender's objects too; the webhook keeps --self-signed, whose RBAC is the wider one).
pub(crate) const EVERY_OPTION_ON: &str = r#"
image: {digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}
imagePullSecrets: [{name: regcred}]
podAnnotations: {example.com/team: gpu}
config: {extender: {bind_timeout_ms: 3000}, http: {max_connections: 1024}}
serviceMonitor: {enabled: true, labels: {release: prometheus}}
scheduler:
  mode: dedicated
  image: {digest: "sha256:89abcdef0123456789abcdef0123456789abcdef0123456789abcdef01234567"}
extender:
  hostNetwork: true
  extraArgs: [--url-prefix=/gpushare-scheduler]
  extraEnv: [{name: GPUSHARE_HTTP__MAX_CONNECTIONS, value: "512"}]
devicePlugin:
  kmsg: {enabled: true}
  mps: true
  hostNetwork: true
  runtimeClassName: nvidia
  deviceListStrategy: [envvar, cdi-cri]
  passDeviceSpecs: true
  admissionPolicy: {enabled: true}
dra: {enabled: true, admissionPolicy: {enabled: true}}
"#;

/// The chart rendered with `values`, every template keyed by its full path
/// (`templates/managed/…` has file names of its own that [`render_chart`]'s by-name map would
/// fold together); `None` without Helm.
pub(crate) fn render_by_path(values: &Value) -> Option<BTreeMap<String, String>> {
    let answer = super::clients::helm_chart(&serde_json::json!({
        "chart": super::source_tree::repo_path("packaging/helm/gpushare"),
        "release": "gpushare",
        "namespace": "kube-system",
        "renders": [values],
        "full_paths": true,
    }))?;
    let render = &answer["renders"][0];
    assert!(
        render.get("error").is_none(),
        "Helm cannot render: {render}"
    );
    Some(serde_json::from_value(render["manifests"].clone()).expect("manifests"))
}

/// The strings of a YAML sequence (others and non-strings left out).
pub(crate) fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// Asserts that one `helm lint --strict` report (of `what`) has no error and no finding of
/// severity 2 (warning) or 3; severity 1 is INFO ("icon is recommended").
pub(crate) fn assert_lint_clean(report: &serde_json::Value, what: &str) {
    assert_eq!(report["errors"], serde_json::json!([]), "{what}: {report}");
    let findings: Vec<&serde_json::Value> = report["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["severity"].as_u64().unwrap_or(3) >= 2)
        .collect();
    assert!(
        findings.is_empty(),
        "helm lint --strict with {what}: {findings:?}"
    );
}

/// One object of a render: the template file it came from (`templates/managed/…`) and the
/// object.
#[derive(Clone, Debug)]
pub(crate) struct Rendered {
    /// The template's path in the chart (`gpushare/templates/dra-plugin.yaml`).
    pub template: String,
    /// The object.
    pub object: Value,
}

/// What `helm install` would create and print: every object with its template, and
/// NOTES.txt.
#[derive(Clone, Debug)]
pub(crate) struct Installed {
    /// Every rendered object, in template order.
    pub objects: Vec<Rendered>,
    /// NOTES.txt as rendered.
    pub notes: String,
}

impl Installed {
    /// The object of `kind` named `name`, if rendered.
    pub(crate) fn find(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects
            .iter()
            .map(|r| &r.object)
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    /// The objects of `kind`.
    pub(crate) fn of_kind(&self, kind: &str) -> Vec<&Value> {
        self.objects
            .iter()
            .map(|r| &r.object)
            .filter(|o| o["kind"] == kind)
            .collect()
    }
}

/// The chart rendered as `helm install` does with the user values `values` (merged over the
/// chart's by Helm itself, so `null` deletes a default), in `namespace`: the objects and the
/// notes, or Helm's error (a template's `fail`, the schema's refusal). `None` without the
/// engine (skipped; CI fails).
pub(crate) fn install(
    values: &serde_json::Value,
    namespace: &str,
) -> Option<Result<Installed, String>> {
    let answer = clients::helm_chart(&serde_json::json!({
        "chart": repo_path(CHART),
        "release": RELEASE,
        "namespace": namespace,
        "renders": [values],
        "full_paths": true,
        "notes": true,
    }))?;
    let render = &answer["renders"][0];
    if let Some(e) = render.get("error") {
        return Some(Err(e.as_str().unwrap_or_default().to_string()));
    }
    let manifests: BTreeMap<String, String> =
        serde_json::from_value(render["manifests"].clone()).expect("manifests by path");
    let objects = manifests
        .iter()
        .flat_map(|(path, text)| {
            yaml_documents(path, text)
                .into_iter()
                .map(|object| Rendered {
                    template: path.clone(),
                    object,
                })
        })
        .collect();
    Some(Ok(Installed {
        objects,
        notes: render["notes"].as_str().unwrap_or_default().to_string(),
    }))
}
