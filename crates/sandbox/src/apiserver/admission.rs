//! Admission as kube-apiserver runs it on every write: mutating webhooks, then (after the
//! object is prepared for storage) ValidatingAdmissionPolicies (`admission_policy`) and
//! validating webhooks, from the stored configurations, for any resource and operation.
//!
//! A write is described by its [`Attributes`] (operation `CREATE`, `UPDATE` or `DELETE`;
//! resource, subresource and kind — `pods/binding` is a `CREATE` of a `Binding`; namespace;
//! name; object and old object; the requesting user; dry run). A webhook is called when, as
//! upstream's `ShouldCallHook` decides, its `namespaceSelector` matches the namespace's labels
//! (for a namespaced request: the Namespace object must exist, else 404; for a Namespace, its
//! own labels; never a constraint on cluster-scoped objects), its `objectSelector` matches the
//! object's or the old object's labels, one of its `rules` matches (`operations`,
//! `apiGroups`, `apiVersions`, `resources` with `resource/subresource`, `*`, `resource/*`,
//! `*/subresource`, and `scope`), and then every `matchConditions` CEL expression is true. The
//! admission configurations themselves are exempt, as upstream has them.
//!
//! Calls go over HTTPS (rustls, trusting only the webhook's `caBundle`, checking the server
//! name) to `clientConfig.url`, or for `clientConfig.service` to the address registered with
//! [`super::ApiServer::route_service`] (the sandbox has no cluster network), with the server
//! name `<service>.<namespace>.svc`. The AdmissionReview carries the real request: kind,
//! resource, subresource, name, namespace, operation, the user's `userInfo`, object, old
//! object, dry run and options. `failurePolicy` (default `Fail`) and `timeoutSeconds`
//! (default 10, at most 30) are honoured; a refusal is upstream's status (`admission webhook
//! "<name>" denied the request: <message>`, the webhook's code or 400); warnings come back as
//! `Warning` headers. A dry run is sent with `dryRun: true`, and refused with 400 when a matching
//! webhook's `sideEffects` is neither `None` nor `NoneOnDryRun`.
//!
//! Limits: `reinvocationPolicy` and `matchPolicy: Equivalent` are ignored (every resource has
//! one version here); `matchConditions` have no `authorizer`; mutating webhooks see the object
//! as it will be stored (a status write: the whole object with the new status), and
//! their patches on a DELETE are ignored; no audit annotations.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

use super::Shared;
use super::admission_policy;
use super::cel_expr::{Bindings, Expression};
use super::discovery::ResourceDef;
use super::identity::Identity;
use super::patch::{self, PatchKind};
use super::store::{ApiError, Store, meta_str, new_uid};

/// An admission operation (CONNECT is not served).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operation {
    Create,
    Update,
    Delete,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
            Operation::Delete => "DELETE",
        }
    }

    fn options_kind(self) -> &'static str {
        match self {
            Operation::Create => "CreateOptions",
            Operation::Update => "UpdateOptions",
            Operation::Delete => "DeleteOptions",
        }
    }
}

/// What admission decides on: one write (upstream's `admission.Attributes`).
#[derive(Clone, Debug)]
pub(crate) struct Attributes {
    pub operation: Operation,
    pub def: &'static ResourceDef,
    /// `""`, `status`, `binding`.
    pub subresource: String,
    /// (group, version, kind) of the object: the resource's, or `Binding` for `pods/binding`.
    pub kind: (String, String, String),
    /// `""` for cluster-scoped objects; a Namespace's own name for a Namespace.
    pub namespace: String,
    /// May be empty on a create with `generateName`.
    pub name: String,
    pub object: Option<Value>,
    pub old_object: Option<Value>,
    pub user: Identity,
    pub dry_run: bool,
}

impl Attributes {
    /// A write of `def` (its `subresource`) in `namespace`, object named `name`.
    pub fn new(
        operation: Operation,
        def: &'static ResourceDef,
        subresource: Option<&str>,
        namespace: Option<&str>,
        name: &str,
        user: &Identity,
        dry_run: bool,
    ) -> Attributes {
        let subresource = subresource.unwrap_or("").to_string();
        let kind = if subresource == "binding" {
            (String::new(), "v1".to_string(), "Binding".to_string())
        } else {
            (
                def.group.to_string(),
                def.version.to_string(),
                def.kind.to_string(),
            )
        };
        let namespace = if def.id == "namespaces" {
            name.to_string()
        } else {
            namespace.unwrap_or("").to_string()
        };
        Attributes {
            operation,
            def,
            subresource,
            kind,
            namespace,
            name: name.to_string(),
            object: None,
            old_object: None,
            user: user.clone(),
            dry_run,
        }
    }

    /// Upstream exempts the admission configurations from admission.
    fn exempt(&self) -> bool {
        self.kind.0 == "admissionregistration.k8s.io"
            && matches!(
                self.kind.2.as_str(),
                "ValidatingWebhookConfiguration"
                    | "MutatingWebhookConfiguration"
                    | "ValidatingAdmissionPolicy"
                    | "ValidatingAdmissionPolicyBinding"
            )
    }

    /// Upstream's `AdmissionRequest`; `with_objects` adds `object` and `oldObject` (a webhook's
    /// review), without them it is CEL's `request`.
    pub fn request(&self, uid: &str, with_objects: bool) -> Value {
        let (group, version, kind) = &self.kind;
        let gvk = json!({ "group": group, "version": version, "kind": kind });
        let gvr = json!({ "group": self.def.group, "version": self.def.version,
                          "resource": self.def.plural });
        let mut request = json!({
            "uid": uid,
            "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "operation": self.operation.as_str(),
            "userInfo": self.user.user_info(),
            "dryRun": self.dry_run,
            "options": { "apiVersion": "meta.k8s.io/v1", "kind": self.operation.options_kind() },
        });
        if !self.subresource.is_empty() {
            request["subResource"] = json!(self.subresource);
            request["requestSubResource"] = json!(self.subresource);
        }
        if !self.name.is_empty() {
            request["name"] = json!(self.name);
        }
        if !self.namespace.is_empty() {
            request["namespace"] = json!(self.namespace);
        }
        if with_objects {
            request["object"] = self.object.clone().unwrap_or(Value::Null);
            request["oldObject"] = self.old_object.clone().unwrap_or(Value::Null);
        }
        request
    }

    /// The name in a refusal (upstream's `extractResourceName`): the request's, the object's,
    /// its `generateName`, or `Unknown`.
    pub fn name_for_errors(&self) -> String {
        if !self.name.is_empty() {
            return self.name.clone();
        }
        let object = self.object.as_ref();
        object
            .and_then(|o| meta_str(o, "name").filter(|n| !n.is_empty()))
            .or_else(|| object.and_then(|o| meta_str(o, "generateName")))
            .unwrap_or("Unknown")
            .to_string()
    }
}

/// Whether any admission configuration is stored: without one, admission admits everything
/// unchanged and a write takes the direct path.
pub(crate) fn configured(store: &Store) -> bool {
    [
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
        "validatingadmissionpolicybindings",
    ]
    .iter()
    .any(|id| !store.list_by_id(id, None).is_empty())
}

fn strings(value: Option<&Value>) -> Vec<&str> {
    value
        .and_then(Value::as_array)
        .map(|l| l.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Upstream's `rules.Matcher`: one `RuleWithOperations` against the request.
pub(crate) fn rule_matches(rule: &Value, attrs: &Attributes) -> bool {
    let any = |key: &str, want: &str| {
        strings(rule.get(key))
            .iter()
            .any(|v| *v == "*" || *v == want)
    };
    let is_namespace = attrs.def.id == "namespaces";
    let scope = match rule.get("scope").and_then(Value::as_str) {
        None | Some("*") => true,
        Some("Namespaced") => !is_namespace && !attrs.namespace.is_empty(),
        Some("Cluster") => is_namespace || attrs.namespace.is_empty(),
        Some(_) => false,
    };
    let resource = strings(rule.get("resources")).iter().any(|r| {
        let (res, sub) = r.split_once('/').unwrap_or((r, ""));
        (res == "*" || res == attrs.def.plural) && (sub == "*" || sub == attrs.subresource)
    });
    scope
        && any("operations", attrs.operation.as_str())
        && any("apiGroups", attrs.def.group)
        && any("apiVersions", attrs.def.version)
        && resource
}

/// A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against
/// `labels`; absent or empty matches everything.
pub(crate) fn selector_matches(selector: Option<&Value>, labels: &Value) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    let label = |k: &str| labels.get(k).and_then(Value::as_str);
    let match_labels = selector
        .get("matchLabels")
        .and_then(Value::as_object)
        .is_none_or(|m| m.iter().all(|(k, v)| label(k) == v.as_str()));
    let expressions = selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .is_none_or(|list| {
            list.iter().all(|e| {
                let key = e.get("key").and_then(Value::as_str).unwrap_or("");
                let values = strings(e.get("values"));
                match e.get("operator").and_then(Value::as_str) {
                    Some("In") => label(key).is_some_and(|v| values.contains(&v)),
                    Some("NotIn") => label(key).is_none_or(|v| !values.contains(&v)),
                    Some("Exists") => label(key).is_some(),
                    Some("DoesNotExist") => label(key).is_none(),
                    _ => false,
                }
            })
        });
    match_labels && expressions
}

fn is_empty_selector(selector: Option<&Value>) -> bool {
    selector.is_none_or(|s| {
        s.get("matchLabels")
            .and_then(Value::as_object)
            .is_none_or(|m| m.is_empty())
            && s.get("matchExpressions")
                .and_then(Value::as_array)
                .is_none_or(|l| l.is_empty())
    })
}

fn labels_of(object: Option<&Value>) -> Value {
    object
        .and_then(|o| o.pointer("/metadata/labels"))
        .cloned()
        .unwrap_or_else(|| json!({}))
}

/// Upstream's `MatchNamespaceSelector`: `Err` (404) when the namespace of a namespaced request
/// does not exist and the selector is not empty.
pub(crate) fn namespace_selector_matches(
    store: &Store,
    selector: Option<&Value>,
    attrs: &Attributes,
) -> Result<bool, ApiError> {
    let is_namespace = attrs.def.id == "namespaces";
    if (attrs.namespace.is_empty() && !is_namespace) || is_empty_selector(selector) {
        return Ok(true);
    }
    let mut labels = if is_namespace {
        let own = if attrs.operation == Operation::Delete {
            attrs.old_object.as_ref()
        } else {
            attrs.object.as_ref()
        };
        labels_of(own)
    } else {
        let namespace = namespace_object(store, &attrs.namespace)?;
        labels_of(Some(&namespace))
    };
    // As kube-apiserver: every namespace carries its name as a label.
    labels["kubernetes.io/metadata.name"] = json!(attrs.namespace);
    Ok(selector_matches(selector, &labels))
}

/// The Namespace object, or upstream's 404.
pub(crate) fn namespace_object(store: &Store, name: &str) -> Result<Value, ApiError> {
    store.get_by_id("namespaces", None, name).ok_or_else(|| {
        ApiError::new(
            404,
            "NotFound",
            format!("namespaces {name:?} not found"),
            Some(json!({ "name": name, "kind": "namespaces" })),
        )
    })
}

/// Upstream's `MatchObjectSelector`: the object's or the old object's labels.
pub(crate) fn object_selector_matches(selector: Option<&Value>, attrs: &Attributes) -> bool {
    if is_empty_selector(selector) {
        return true;
    }
    [attrs.object.as_ref(), attrs.old_object.as_ref()]
        .into_iter()
        .flatten()
        .any(|o| selector_matches(selector, &labels_of(Some(o))))
}

/// Upstream's `ShouldCallHook`: selectors, then rules; a selector's error only when the rules
/// match.
fn should_call(store: &Store, hook: &Value, attrs: &Attributes) -> Result<bool, ApiError> {
    let ns = namespace_selector_matches(store, hook.get("namespaceSelector"), attrs);
    if matches!(ns, Ok(false)) || !object_selector_matches(hook.get("objectSelector"), attrs) {
        return Ok(false);
    }
    let rules = hook
        .get("rules")
        .and_then(Value::as_array)
        .is_some_and(|rules| rules.iter().any(|r| rule_matches(r, attrs)));
    if !rules {
        return Ok(false);
    }
    ns
}

/// The CEL bindings of a webhook's `matchConditions` and of a policy: `object`, `oldObject`,
/// `request`.
pub(crate) fn request_bindings(attrs: &Attributes) -> Bindings {
    let mut bindings = Bindings::default();
    bindings.set_json("object", attrs.object.as_ref().unwrap_or(&Value::Null));
    bindings.set_json(
        "oldObject",
        attrs.old_object.as_ref().unwrap_or(&Value::Null),
    );
    bindings.set_json("request", &attrs.request(&new_uid(), false));
    bindings
}

/// Upstream's match conditions: `Ok(false)` when one is false (whatever the others do),
/// `Err` when none is false and one failed to evaluate.
pub(crate) fn match_conditions(
    conditions: Option<&Value>,
    bindings: &Bindings,
) -> Result<bool, String> {
    let mut errors = Vec::new();
    for condition in conditions.and_then(Value::as_array).into_iter().flatten() {
        let source = condition
            .get("expression")
            .and_then(Value::as_str)
            .unwrap_or("");
        match Expression::compile(source).truth(bindings) {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(true)
    } else {
        Err(errors.join(", "))
    }
}

/// Every webhook of the stored configurations of `id`, in name order.
fn webhooks(store: &Store, id: &str) -> Vec<Value> {
    store
        .list_by_id(id, None)
        .into_iter()
        .flat_map(|config| {
            config
                .get("webhooks")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

fn webhook_error(name: &str, why: &str) -> ApiError {
    ApiError::new(
        500,
        "InternalError",
        format!("Internal error occurred: failed calling webhook {name:?}: {why}"),
        None,
    )
}

/// Upstream's `ToStatusErr`: the webhook's status, its code at least 400.
fn denial(name: &str, status: Option<&Value>) -> ApiError {
    let field = |k: &str| {
        status
            .and_then(|s| s.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let code = status
        .and_then(|s| s.get("code"))
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok())
        .filter(|c| *c >= 400)
        .unwrap_or(400);
    let denied_by = format!("admission webhook {name:?} denied the request");
    let (message, reason) = (field("message"), field("reason"));
    let message = match (message.is_empty(), reason.is_empty()) {
        (false, _) => format!("{denied_by}: {message}"),
        (true, false) => format!("{denied_by}: {reason}"),
        (true, true) => format!("{denied_by} without explanation"),
    };
    ApiError::new(
        code,
        reason,
        message,
        status.and_then(|s| s.get("details")).cloned(),
    )
}

/// Runs the webhooks of `id` (mutating or validating) on `attrs`; mutating ones may patch the
/// object. Returns the warnings.
async fn run_webhooks(
    shared: &Arc<Shared>,
    id: &str,
    attrs: &mut Attributes,
) -> Result<Vec<String>, ApiError> {
    let mutate = id == "mutatingwebhookconfigurations";
    let hooks = webhooks(&shared.store(), id);
    let mut warnings = Vec::new();
    for hook in hooks {
        let name = hook
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if !should_call(&shared.store(), &hook, attrs)? {
            continue;
        }
        let ignore = hook.get("failurePolicy").and_then(Value::as_str) == Some("Ignore");
        match match_conditions(hook.get("matchConditions"), &request_bindings(attrs)) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) if ignore => continue,
            Err(why) => {
                return Err(webhook_error(
                    &name,
                    &format!("failed to evaluate match condition: {why}"),
                ));
            }
        }
        let side_effects = hook.get("sideEffects").and_then(Value::as_str);
        if attrs.dry_run && !matches!(side_effects, Some("None" | "NoneOnDryRun")) {
            return Err(ApiError::bad_request(format!(
                "admission webhook {name:?} does not support dry run"
            )));
        }
        let response = match call(shared, &hook, attrs).await {
            Ok(r) => r,
            Err(why) if ignore => {
                warnings.push(format!("failed calling webhook {name:?} (ignored): {why}"));
                continue;
            }
            Err(why) => return Err(webhook_error(&name, &why)),
        };
        if let Some(w) = response.get("warnings").and_then(Value::as_array) {
            warnings.extend(w.iter().filter_map(Value::as_str).map(str::to_string));
        }
        if response.get("allowed").and_then(Value::as_bool) != Some(true) {
            return Err(denial(&name, response.get("status")));
        }
        if mutate
            && let Some(p) = response.get("patch").and_then(Value::as_str)
            && let Some(object) = attrs.object.as_ref()
        {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(p)
                .map_err(|e| {
                    ApiError::new(
                        500,
                        "InternalError",
                        format!(
                            "Internal error occurred: webhook {name:?}: patch is not base64: {e}"
                        ),
                        None,
                    )
                })?;
            let patched = patch::apply(PatchKind::Json, object, &raw).map_err(|e| {
                ApiError::new(
                    500,
                    "InternalError",
                    format!(
                        "Internal error occurred: webhook {name:?}: patch does not apply: {}",
                        e.message
                    ),
                    None,
                )
            })?;
            attrs.object = Some(patched);
        }
    }
    Ok(warnings)
}

/// Mutating admission: the mutating webhooks, in name order, each seeing the previous one's
/// patch. Returns the warnings; `attrs.object` is the mutated object.
pub(crate) async fn mutate(
    shared: &Arc<Shared>,
    attrs: &mut Attributes,
) -> Result<Vec<String>, ApiError> {
    if attrs.exempt() {
        return Ok(Vec::new());
    }
    run_webhooks(shared, "mutatingwebhookconfigurations", attrs).await
}

/// Validating admission: the ValidatingAdmissionPolicies, then the validating webhooks.
/// Returns the warnings.
pub(crate) async fn validate(
    shared: &Arc<Shared>,
    attrs: &Attributes,
) -> Result<Vec<String>, ApiError> {
    if attrs.exempt() {
        return Ok(Vec::new());
    }
    let mut warnings = admission_policy::validate(&shared.store(), attrs)?;
    let mut attrs = attrs.clone();
    warnings.extend(run_webhooks(shared, "validatingwebhookconfigurations", &mut attrs).await?);
    Ok(warnings)
}

/// Where to call and which name the certificate must carry.
fn target(shared: &Shared, hook: &Value) -> Result<(SocketAddr, String, String), String> {
    let client = hook.get("clientConfig").ok_or("no clientConfig")?;
    if let Some(url) = client.get("url").and_then(Value::as_str) {
        let uri: http::Uri = url.parse().map_err(|e| format!("bad url {url:?}: {e}"))?;
        if uri.scheme_str() != Some("https") {
            return Err(format!("url {url:?} is not https"));
        }
        let host = uri.host().ok_or("url without host")?.to_string();
        let port = uri.port_u16().unwrap_or(443);
        let addr = format!("{host}:{port}")
            .parse::<SocketAddr>()
            .or_else(|_| {
                if host == "localhost" {
                    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
                } else {
                    Err(format!(
                        "the sandbox resolves only IPs and localhost, not {host:?}"
                    ))
                }
            })?;
        return Ok((addr, host, uri.path().to_string()));
    }
    let service = client
        .get("service")
        .ok_or("clientConfig has neither url nor service")?;
    let ns = service
        .get("namespace")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let name = service.get("name").and_then(Value::as_str).unwrap_or("");
    let path = service
        .get("path")
        .and_then(Value::as_str)
        .unwrap_or("/")
        .to_string();
    let addr = shared
        .controls()
        .services
        .iter()
        .find(|(n, s, _)| n == ns && s == name)
        .map(|(_, _, a)| *a)
        .ok_or_else(|| format!("service {ns}/{name} has no endpoint (ApiServer::route_service)"))?;
    Ok((addr, format!("{name}.{ns}.svc"), path))
}

/// Calls one webhook; returns its `response` object.
async fn call(shared: &Shared, hook: &Value, attrs: &Attributes) -> Result<Value, String> {
    let (addr, server_name, path) = target(shared, hook)?;
    let ca = hook
        .pointer("/clientConfig/caBundle")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or("clientConfig.caBundle is empty")?;
    let ca = base64::engine::general_purpose::STANDARD
        .decode(ca)
        .map_err(|e| format!("caBundle is not base64: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&ca) {
        let cert = cert.map_err(|e| format!("caBundle is not PEM: {e}"))?;
        roots.add(cert).map_err(|e| format!("caBundle: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let timeout = Duration::from_secs(
        hook.get("timeoutSeconds")
            .and_then(Value::as_u64)
            .unwrap_or(10)
            .clamp(1, 30),
    );
    let uid = new_uid();
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": attrs.request(&uid, true),
    });
    let exchange = async {
        let server_name = ServerName::try_from(server_name.clone())
            .map_err(|e| format!("server name {server_name:?}: {e}"))?;
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let tls = connector
            .connect(server_name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = http::Request::post(format!("{path}?timeout={}s", timeout.as_secs()))
            .header(http::header::HOST, addr.to_string())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(review.to_string())))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ));
        }
        let answer: Value =
            serde_json::from_slice(&body).map_err(|e| format!("answer is not JSON: {e}"))?;
        let response = answer
            .get("response")
            .cloned()
            .ok_or("answer has no response")?;
        if response.get("uid").and_then(Value::as_str) != Some(uid.as_str()) {
            return Err("answer's response.uid does not match the request".to_string());
        }
        Ok(response)
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {timeout:?} (timeoutSeconds)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apiserver::discovery;

    fn attrs(op: Operation, id: &str, sub: Option<&str>, ns: Option<&str>) -> Attributes {
        let def = discovery::by_id(id).expect("a resource");
        Attributes::new(op, def, sub, ns, "x", &Identity::admin(), false)
    }

    #[test]
    fn namespace_selectors_match_like_label_selectors() {
        let labels =
            json!({ "kubernetes.io/metadata.name": "team", "gpushare.io/webhook": "disabled" });
        let skip = json!({ "matchExpressions": [
            { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"] },
            { "key": "gpushare.io/webhook", "operator": "NotIn", "values": ["disabled"] },
        ]});
        assert!(!selector_matches(Some(&skip), &labels));
        assert!(selector_matches(
            Some(&skip),
            &json!({ "kubernetes.io/metadata.name": "team" })
        ));
        assert!(!selector_matches(
            Some(&skip),
            &json!({ "kubernetes.io/metadata.name": "kube-system" })
        ));
        assert!(selector_matches(None, &labels));
    }

    #[test]
    fn rules_match_as_upstreams_rule_matcher() {
        use Operation::*;
        let pod_create = attrs(Create, "pods", None, Some("ml"));
        let binding = attrs(Create, "pods", Some("binding"), Some("ml"));
        let node_status = attrs(Update, "nodes", Some("status"), None);
        let ns_update = attrs(Update, "namespaces", None, None);
        let slice_delete = attrs(Delete, "resourceslices", None, None);
        let rule = |ops: &[&str], groups: &[&str], resources: &[&str], scope: Option<&str>| {
            let mut r = json!({ "operations": ops, "apiGroups": groups, "apiVersions": ["*"],
                                "resources": resources });
            if let Some(s) = scope {
                r["scope"] = json!(s);
            }
            r
        };
        let table: &[(Value, &Attributes, bool)] = &[
            (rule(&["CREATE"], &[""], &["pods"], None), &pod_create, true),
            (
                rule(&["UPDATE"], &[""], &["pods"], None),
                &pod_create,
                false,
            ),
            (rule(&["*"], &["*"], &["*"], None), &pod_create, true),
            // `pods` and `*` do not match a subresource; `pods/*`, `*/binding` and `*/*` do
            (rule(&["CREATE"], &[""], &["pods"], None), &binding, false),
            (rule(&["CREATE"], &[""], &["*"], None), &binding, false),
            (
                rule(&["CREATE"], &[""], &["pods/binding"], None),
                &binding,
                true,
            ),
            (rule(&["CREATE"], &[""], &["pods/*"], None), &binding, true),
            (
                rule(&["CREATE"], &[""], &["*/binding"], None),
                &binding,
                true,
            ),
            (
                rule(&["CREATE"], &[""], &["pods/*"], None),
                &pod_create,
                true,
            ),
            (
                rule(&["UPDATE"], &[""], &["nodes"], None),
                &node_status,
                false,
            ),
            (
                rule(&["UPDATE"], &[""], &["nodes/status"], None),
                &node_status,
                true,
            ),
            (
                rule(&["*"], &["*"], &["*/*"], Some("Cluster")),
                &node_status,
                true,
            ),
            (
                rule(&["*"], &["*"], &["*/*"], Some("Namespaced")),
                &node_status,
                false,
            ),
            (
                rule(&["*"], &["*"], &["*"], Some("Namespaced")),
                &pod_create,
                true,
            ),
            // a Namespace is cluster-scoped, though its namespace is its own name
            (
                rule(&["*"], &["*"], &["*"], Some("Namespaced")),
                &ns_update,
                false,
            ),
            (
                rule(&["*"], &["*"], &["*"], Some("Cluster")),
                &ns_update,
                true,
            ),
            (
                rule(&["DELETE"], &["resource.k8s.io"], &["resourceslices"], None),
                &slice_delete,
                true,
            ),
            (
                rule(&["DELETE"], &[""], &["resourceslices"], None),
                &slice_delete,
                false,
            ),
        ];
        for (r, a, want) in table {
            assert_eq!(
                rule_matches(r, a),
                *want,
                "{r} on {:?} {}/{}",
                a.operation,
                a.def.plural,
                a.subresource
            );
        }
        assert_eq!(binding.kind.2, "Binding");
        assert_eq!(
            ns_update.namespace, "x",
            "a namespace's namespace is its name"
        );
    }

    #[test]
    fn selectors_need_the_namespace_and_read_old_and_new_labels() {
        let mut store = Store::new();
        let mut a = attrs(Operation::Update, "pods", None, Some("ml"));
        let selector = json!({ "matchLabels": { "team": "a" } });
        let missing = namespace_selector_matches(&store, Some(&selector), &a).expect_err("404");
        assert_eq!(
            (missing.code, missing.message.as_str()),
            (404, "namespaces \"ml\" not found")
        );
        assert!(namespace_selector_matches(&store, Some(&json!({})), &a).expect("empty"));
        store
            .create_value(json!({ "apiVersion": "v1", "kind": "Namespace",
                                  "metadata": { "name": "ml", "labels": { "team": "a" } } }))
            .expect("namespace");
        assert!(namespace_selector_matches(&store, Some(&selector), &a).expect("labels"));
        let name = json!({ "matchLabels": { "kubernetes.io/metadata.name": "ml" } });
        assert!(namespace_selector_matches(&store, Some(&name), &a).expect("name label"));
        a.old_object = Some(json!({ "metadata": { "labels": { "app": "old" } } }));
        a.object = Some(json!({ "metadata": { "labels": { "app": "new" } } }));
        for app in ["old", "new"] {
            let s = json!({ "matchLabels": { "app": app } });
            assert!(object_selector_matches(Some(&s), &a), "{app}");
        }
        assert!(!object_selector_matches(
            Some(&json!({ "matchLabels": { "app": "x" } })),
            &a
        ));
    }
}
