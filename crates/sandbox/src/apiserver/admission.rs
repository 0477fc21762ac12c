//! Admission webhooks, as kube-apiserver calls them on pod create: every stored
//! MutatingWebhookConfiguration whose rules match (`pods`, `CREATE`, the namespace selector)
//! is called in name order and its JSONPatch applied; then every matching
//! ValidatingWebhookConfiguration sees the mutated pod and may refuse it.
//!
//! Calls go over HTTPS (rustls, trusting only the webhook's `caBundle`, checking the server
//! name) to `clientConfig.url`, or for `clientConfig.service` to the address registered with
//! [`super::ApiServer::route_service`] (the sandbox has no cluster network), with the server
//! name `<service>.<namespace>.svc`. `failurePolicy` (default `Fail`) and `timeoutSeconds`
//! (default 10) are honoured; warnings come back as `Warning` headers.
//!
//! A dry run (`?dryRun=All`) is sent with `dryRun: true`, and refused with 400 when a matching
//! webhook's `sideEffects` is neither `None` nor `NoneOnDryRun` (as kube-apiserver does).
//!
//! Limits: pods and CREATE only; `objectSelector`, `matchConditions`, `reinvocationPolicy`
//! and `matchPolicy` are ignored; `scope` is not checked.

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
use super::patch::{self, PatchKind};
use super::store::{ApiError, meta_str};

/// The outcome of admission for one pod create.
pub(super) struct Admitted {
    /// The pod to store.
    pub object: Value,
    /// Warnings for the client.
    pub warnings: Vec<String>,
}

/// Runs the webhooks for a pod create in `namespace` (a dry run when `dry_run`); `Err` refuses
/// it.
pub(super) async fn admit_pod_create(
    shared: &Arc<Shared>,
    namespace: &str,
    mut object: Value,
    dry_run: bool,
) -> Result<Admitted, ApiError> {
    let (mutating, validating, ns_labels) = {
        let store = shared.store();
        let ns_labels = store
            .get_by_id("namespaces", None, namespace)
            .and_then(|n| n.pointer("/metadata/labels").cloned())
            .unwrap_or_else(|| json!({}));
        (
            store.list_by_id("mutatingwebhookconfigurations", None),
            store.list_by_id("validatingwebhookconfigurations", None),
            ns_labels,
        )
    };
    let mut ns_labels = ns_labels;
    // As kube-apiserver: every namespace carries its name as a label.
    ns_labels["kubernetes.io/metadata.name"] = json!(namespace);
    let mut warnings = Vec::new();
    for (configs, mutate) in [(mutating, true), (validating, false)] {
        for config in configs {
            for hook in config
                .get("webhooks")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if !matches_pod_create(hook)
                    || !selector_matches(hook.get("namespaceSelector"), &ns_labels)
                {
                    continue;
                }
                let name = hook
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let side_effects = hook.get("sideEffects").and_then(Value::as_str);
                if dry_run && !matches!(side_effects, Some("None" | "NoneOnDryRun")) {
                    return Err(ApiError::with_code(
                        400,
                        "BadRequest",
                        &format!("admission webhook {name:?} does not support dry run"),
                    ));
                }
                let ignore = hook.get("failurePolicy").and_then(Value::as_str) == Some("Ignore");
                let response = match call(shared, hook, namespace, &object, dry_run).await {
                    Ok(r) => r,
                    Err(why) if ignore => {
                        warnings.push(format!("failed calling webhook {name:?} (ignored): {why}"));
                        continue;
                    }
                    Err(why) => {
                        return Err(ApiError::with_code(
                            500,
                            "InternalError",
                            &format!(
                                "Internal error occurred: failed calling webhook {name:?}: {why}"
                            ),
                        ));
                    }
                };
                if let Some(w) = response.get("warnings").and_then(Value::as_array) {
                    warnings.extend(w.iter().filter_map(Value::as_str).map(str::to_string));
                }
                if response.get("allowed").and_then(Value::as_bool) != Some(true) {
                    let message = response
                        .pointer("/status/message")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    let code = response
                        .pointer("/status/code")
                        .and_then(Value::as_u64)
                        .and_then(|c| u16::try_from(c).ok())
                        .filter(|c| (400..600).contains(c))
                        .unwrap_or(403);
                    let reason = match code {
                        400 => "BadRequest",
                        403 => "Forbidden",
                        422 => "Invalid",
                        _ => "InternalError",
                    };
                    return Err(ApiError::with_code(
                        code,
                        reason,
                        &format!("admission webhook {name:?} denied the request: {message}"),
                    ));
                }
                if mutate && let Some(p) = response.get("patch").and_then(Value::as_str) {
                    let raw = base64::engine::general_purpose::STANDARD
                        .decode(p)
                        .map_err(|e| webhook_error(&name, &format!("patch is not base64: {e}")))?;
                    object = patch::apply(PatchKind::Json, &object, &raw).map_err(|e| {
                        webhook_error(&name, &format!("patch does not apply: {}", e.message))
                    })?;
                }
            }
        }
    }
    Ok(Admitted { object, warnings })
}

fn webhook_error(name: &str, why: &str) -> ApiError {
    ApiError::with_code(
        500,
        "InternalError",
        &format!("Internal error occurred: webhook {name:?}: {why}"),
    )
}

fn has(list: Option<&Value>, want: &str) -> bool {
    list.and_then(Value::as_array).is_some_and(|l| {
        l.iter()
            .any(|v| v.as_str().is_some_and(|s| s == want || s == "*"))
    })
}

fn matches_pod_create(hook: &Value) -> bool {
    hook.get("rules")
        .and_then(Value::as_array)
        .is_some_and(|rules| {
            rules.iter().any(|r| {
                has(r.get("operations"), "CREATE")
                    && has(r.get("apiGroups"), "")
                    && has(r.get("resources"), "pods")
            })
        })
}

/// A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against
/// `labels`; absent or empty matches everything.
fn selector_matches(selector: Option<&Value>, labels: &Value) -> bool {
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
                let values: Vec<&str> = e
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|v| v.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
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
async fn call(
    shared: &Shared,
    hook: &Value,
    namespace: &str,
    object: &Value,
    dry_run: bool,
) -> Result<Value, String> {
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
    let uid = format!("sandbox-{}", shared.store().resource_version());
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": { "group": "", "version": "v1", "kind": "Pod" },
            "resource": { "group": "", "version": "v1", "resource": "pods" },
            "requestKind": { "group": "", "version": "v1", "kind": "Pod" },
            "requestResource": { "group": "", "version": "v1", "resource": "pods" },
            "name": meta_str(object, "name").unwrap_or(""),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": { "username": "sandbox" },
            "object": object,
            "oldObject": null,
            "dryRun": dry_run,
            "options": { "apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions" },
        },
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
        let hook = json!({ "rules": [{ "operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"] }] });
        assert!(matches_pod_create(&hook));
        assert!(!matches_pod_create(
            &json!({ "rules": [{ "operations": ["UPDATE"], "apiGroups": [""], "resources": ["pods"] }] })
        ));
    }
}
