//! The sandbox API server's admission as a cluster runs it on every write: admission webhooks
//! for any resource and operation with their selectors and match conditions, and
//! ValidatingAdmissionPolicies evaluated in CEL (deny, warn, params, failure policy) — among
//! them the chart's own policies, enforced on the device plugin running under its
//! ServiceAccount's pod-bound token.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use gpushare::webhook::certs::{issue_ca, issue_serving};
use gpushare_sandbox::apiserver::{ApiServer, Identity};

use crate::support::clients::kubectls;
use crate::support::helm_chart::{all_documents, default_values, merged};
use crate::support::wait::wait_until;

/// `code`, `reason` and `message` of a refused call.
fn refusal<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> (u16, String, String) {
    match result {
        Err(kube::Error::Api(s)) => (s.code, s.reason.clone(), s.message.clone()),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn configmap(name: &str, data: Value) -> ConfigMap {
    serde_json::from_value(json!({ "metadata": { "name": name }, "data": data }))
        .expect("a ConfigMap")
}

// ---------------------------------------------------------------- ValidatingAdmissionPolicy

const POLICIES: &str = include_str!("../fixtures/apiserver/policies.yaml");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_deny_and_warn_as_their_bindings_say() {
    let api = ApiServer::start().await.expect("sandbox");
    api.seed_yaml(POLICIES).expect("policies seeded");
    let admin: Api<ConfigMap> = Api::namespaced(api.admin_client(), "ml");
    admin
        .create(
            &PostParams::default(),
            &configmap("ok", json!({ "a": "1" })),
        )
        .await
        .expect("a config map without a forbidden key");
    let (code, reason, message) = refusal(
        admin
            .create(
                &PostParams::default(),
                &configmap("bad", json!({ "a": "1", "secret-token": "x" })),
            )
            .await,
    );
    assert_eq!(
        (code, reason.as_str(), message.as_str()),
        (
            403,
            "Forbidden",
            "configmaps \"bad\" is forbidden: ValidatingAdmissionPolicy 'no-secrets' with binding \
             'deny' denied request: key secret-token is not allowed in ml"
        )
    );
    assert!(api.get_object("configmaps", Some("ml"), "bad").is_none());
    // The binding selects namespaces labelled policy=on only.
    Api::<ConfigMap>::namespaced(api.admin_client(), "other")
        .create(
            &PostParams::default(),
            &configmap("bad", json!({ "secret-token": "x" })),
        )
        .await
        .expect("another namespace is not bound");
    // oldObject and request.userInfo: the data changes only by an administrator.
    let editor: Api<ConfigMap> = Api::namespaced(
        api.client_for(&Identity::service_account("ml", "editor")),
        "ml",
    );
    let change = Patch::Merge(json!({ "data": { "a": "2" } }));
    let (code, reason, message) =
        refusal(editor.patch("ok", &PatchParams::default(), &change).await);
    assert_eq!((code, reason.as_str()), (422, "Invalid"), "{message}");
    assert!(
        message.ends_with("denied request: only an administrator changes the data"),
        "{message}"
    );
    editor
        .patch(
            "ok",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "x": "y" } } })),
        )
        .await
        .expect("the editor may label it");
    admin
        .patch("ok", &PatchParams::default(), &change)
        .await
        .expect("the administrator may change the data");
    // A dry run is refused alike and stores nothing.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let (code, ..) = refusal(
        admin
            .create(&dry, &configmap("dry", json!({ "secret-x": "x" })))
            .await,
    );
    assert_eq!(code, 403);

    // Warn: kubectl prints the warning, the object is stored.
    let (kubectl, _) = kubectls().into_iter().next().expect("a kubectl");
    let manifest = tempfile::NamedTempFile::new().expect("a file");
    std::fs::write(
        manifest.path(),
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: plain, namespace: ml}\ndata: {k: v}\n",
    )
    .expect("written");
    let file = manifest.path().to_str().expect("utf-8");
    let out = crate::support::clients::kubectl_output(
        &kubectl,
        &api.admin_kubeconfig_path(),
        &["create", "-f", file],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "Warning: Validation failed for ValidatingAdmissionPolicy 'labels-recommended' with \
             binding 'warn': set labels"
        ),
        "{stderr}"
    );
    assert!(api.get_object("configmaps", Some("ml"), "plain").is_some());

    // A missing param with parameterNotFoundAction Deny refuses, as a configuration error.
    api.delete_object("configmaps", Some("ml"), "limits")
        .expect("params deleted");
    let (code, _, message) = refusal(
        admin
            .create(&PostParams::default(), &configmap("any", json!({})))
            .await,
    );
    assert_eq!(code, 422, "{message}");
    assert!(
        message.ends_with(
            "denied request: failed to configure binding: no params found for policy binding \
             with `Deny` parameterNotFoundAction"
        ),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expression_that_fails_follows_the_failure_policy() {
    let api = ApiServer::start().await.expect("sandbox");
    let policy = |name: &str, failure: &str, expression: &str| {
        format!(
            "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n\
             metadata: {{name: {name}}}\nspec:\n  failurePolicy: {failure}\n  matchConstraints:\n    \
             resourceRules:\n    - {{apiGroups: [''], apiVersions: ['*'], operations: ['*'], resources: [configmaps]}}\n  \
             validations:\n  - expression: \"{expression}\"\n---\n\
             apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicyBinding\n\
             metadata: {{name: {name}}}\nspec: {{policyName: {name}, validationActions: [Deny]}}\n"
        )
    };
    let cms: Api<ConfigMap> = Api::namespaced(api.admin_client(), "default");
    api.seed_yaml(&policy("lenient", "Ignore", "object.data.missing == 'x'"))
        .expect("seeded");
    cms.create(&PostParams::default(), &configmap("a", json!({})))
        .await
        .expect("Ignore admits despite the error");
    api.seed_yaml(&policy("strict", "Fail", "object.data.missing == 'x'"))
        .expect("seeded");
    let (code, _, message) = refusal(
        cms.create(&PostParams::default(), &configmap("b", json!({})))
            .await,
    );
    assert_eq!(code, 422);
    assert!(
        message.contains(
            "ValidatingAdmissionPolicy 'strict' with binding 'strict' denied request: expression \
             'object.data.missing == 'x'' resulted in error: "
        ),
        "{message}"
    );
    // Deleting: `object` is null, `oldObject` the stored one; a policy on DELETE sees both.
    api.delete_object("validatingadmissionpolicybindings", None, "strict")
        .expect("unbound");
    api.seed_yaml(&policy(
        "keep",
        "Fail",
        "request.operation != 'DELETE' || object == null && oldObject.metadata.name != 'a'",
    ))
    .expect("seeded");
    let (code, _, message) = refusal(cms.delete("a", &DeleteParams::default()).await);
    assert_eq!(code, 422, "{message}");
    assert!(api.get_object("configmaps", Some("default"), "a").is_some());
}

// ---------------------------------------------------------------- admission webhooks

/// An HTTPS admission webhook that records every AdmissionReview request and answers with
/// `decide(request)` (the `response` without `uid`).
struct RecordingWebhook {
    addr: SocketAddr,
    ca_pem: String,
    seen: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RecordingWebhook {
    async fn start(decide: fn(&Value) -> Value) -> RecordingWebhook {
        let now = std::time::SystemTime::now();
        let ca = issue_ca(now, Duration::from_secs(3600)).expect("a CA");
        let serving = issue_serving(
            &ca,
            &["127.0.0.1".to_string()],
            now - Duration::from_secs(60),
            now + Duration::from_secs(3600),
        )
        .expect("a serving certificate");
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(serving.cert.as_bytes())
                .collect::<Result<_, _>>()
                .expect("PEM");
        let key = PrivateKeyDer::from_pem_slice(serving.key.as_bytes()).expect("a key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("a TLS config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let recorded = recorded.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let recorded = recorded.clone();
                        async move {
                            let body = req.into_body().collect().await?.to_bytes();
                            let review: Value =
                                serde_json::from_slice(&body).unwrap_or(Value::Null);
                            let request = review["request"].clone();
                            let mut response = decide(&request);
                            response["uid"] = request["uid"].clone();
                            recorded.lock().expect("the record").push(request);
                            let answer = json!({ "apiVersion": "admission.k8s.io/v1",
                                                 "kind": "AdmissionReview", "response": response });
                            Ok::<_, hyper::Error>(http::Response::new(Full::new(Bytes::from(
                                answer.to_string(),
                            ))))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        RecordingWebhook {
            addr,
            ca_pem: ca.cert,
            seen,
            task,
        }
    }

    /// A webhook entry of a configuration calling `path` on this server.
    fn hook(&self, name: &str, path: &str, extra: Value) -> Value {
        let mut hook = json!({
            "name": name, "sideEffects": "None", "admissionReviewVersions": ["v1"],
            "clientConfig": {
                "url": format!("https://{}{path}", self.addr),
                "caBundle": base64::engine::general_purpose::STANDARD.encode(&self.ca_pem),
            },
        });
        if let (Some(h), Some(e)) = (hook.as_object_mut(), extra.as_object()) {
            h.extend(e.clone());
        }
        hook
    }

    /// `(operation, resource/subresource, namespace/name)` of each request seen, in order.
    fn calls(&self) -> Vec<(String, String, String)> {
        self.seen
            .lock()
            .expect("the record")
            .iter()
            .map(|r| {
                let s = |p: &str| {
                    r.pointer(p)
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                };
                let resource = match s("/subResource").as_str() {
                    "" => s("/resource/resource"),
                    sub => format!("{}/{sub}", s("/resource/resource")),
                };
                (
                    s("/operation"),
                    resource,
                    format!("{}/{}", s("/namespace"), s("/name")),
                )
            })
            .collect()
    }

    fn requests(&self) -> Vec<Value> {
        self.seen.lock().expect("the record").clone()
    }
}

impl Drop for RecordingWebhook {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Refuses config maps named `deny-*` (403 with a message) and `vague-*` (no code, no
/// message); the mutating path adds an annotation.
fn decide(request: &Value) -> Value {
    let name = request["name"].as_str().unwrap_or("");
    if name.starts_with("deny-") {
        return json!({ "allowed": false,
                       "status": { "code": 403, "reason": "Forbidden", "message": "no deny-* here" } });
    }
    if name.starts_with("vague-") {
        return json!({ "allowed": false });
    }
    let mut response = json!({ "allowed": true, "warnings": [format!("seen {name}")] });
    if request["kind"]["kind"] == "ConfigMap" && request["operation"] == "UPDATE" {
        let patch = json!([{ "op": "add", "path": "/metadata/annotations", "value": { "mutated": "yes" } }]);
        response["patchType"] = json!("JSONPatch");
        response["patch"] =
            json!(base64::engine::general_purpose::STANDARD.encode(patch.to_string()));
    }
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_see_every_operation_their_rules_and_selectors_match() {
    let api = ApiServer::start().await.expect("sandbox");
    let hook = RecordingWebhook::start(decide).await;
    api.seed_yaml(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a, labels: {team: a}}\n---\n\
         apiVersion: v1\nkind: Namespace\nmetadata: {name: team-b, labels: {team: b}}\n---\n\
         apiVersion: v1\nkind: Node\nmetadata: {name: n1}\n",
    )
    .expect("namespaces");
    let rules = json!([{ "operations": ["*"], "apiGroups": [""], "apiVersions": ["v1"],
                         "resources": ["configmaps", "nodes/status"] }]);
    api.create_object(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": { "name": "validate" },
        "webhooks": [hook.hook("validate.test", "/validate", json!({
            "rules": rules,
            "namespaceSelector": { "matchLabels": { "team": "a" } },
            "objectSelector": { "matchExpressions": [{ "key": "skip", "operator": "DoesNotExist" }] },
            "matchConditions": [{ "name": "not-probes",
                                  "expression": "object == null || !object.metadata.name.startsWith('probe')" }],
        }))],
    }))
    .expect("validating configuration");
    api.create_object(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": { "name": "mutate" },
        "webhooks": [hook.hook("mutate.test", "/mutate", json!({
            "rules": [{ "operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                        "resources": ["configmaps"], "scope": "Namespaced" }],
        }))],
    }))
    .expect("mutating configuration");

    let team_a: Api<ConfigMap> = Api::namespaced(api.admin_client(), "team-a");
    let params = PostParams::default();
    team_a
        .create(&params, &configmap("c1", json!({ "k": "v" })))
        .await
        .expect("admitted");
    let updated = team_a
        .patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "data": { "k": "w" } })),
        )
        .await
        .expect("admitted");
    assert_eq!(
        updated
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("mutated"))
            .map(String::as_str),
        Some("yes"),
        "the mutating webhook's patch is stored"
    );
    team_a
        .delete("c1", &DeleteParams::default())
        .await
        .expect("admitted");
    // Not called: another namespace's labels, an object labelled skip, a probe.
    Api::<ConfigMap>::namespaced(api.admin_client(), "team-b")
        .create(&params, &configmap("c2", json!({})))
        .await
        .expect("not matched");
    let mut skipped = configmap("c3", json!({}));
    skipped.metadata.labels = Some([("skip".to_string(), "1".to_string())].into());
    team_a.create(&params, &skipped).await.expect("not matched");
    team_a
        .create(&params, &configmap("probe-1", json!({})))
        .await
        .expect("not matched");
    // A namespaced request in a namespace that does not exist: upstream's 404.
    let (code, _, message) = refusal(
        Api::<ConfigMap>::namespaced(api.admin_client(), "ghost")
            .create(&params, &configmap("c4", json!({})))
            .await,
    );
    assert_eq!(
        (code, message.as_str()),
        (404, "namespaces \"ghost\" not found")
    );
    // A cluster-scoped subresource: the namespace selector does not apply.
    Api::<Node>::all(api.admin_client())
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Running" } })),
        )
        .await
        .expect("admitted");
    // Refusals, as upstream words them.
    let (code, reason, message) = refusal(
        team_a
            .create(&params, &configmap("deny-1", json!({})))
            .await,
    );
    assert_eq!(
        (code, reason.as_str(), message.as_str()),
        (
            403,
            "Forbidden",
            "admission webhook \"validate.test\" denied the request: no deny-* here"
        )
    );
    let (code, _, message) = refusal(
        team_a
            .create(&params, &configmap("vague-1", json!({})))
            .await,
    );
    assert_eq!(
        (code, message.as_str()),
        (
            400,
            "admission webhook \"validate.test\" denied the request without explanation"
        )
    );
    let ops = |want: &str| {
        hook.calls()
            .into_iter()
            .filter(|(op, res, _)| op == want && res == "configmaps")
            .count()
    };
    assert_eq!(
        hook.calls(),
        [
            ("CREATE".into(), "configmaps".into(), "team-a/c1".into()),
            ("UPDATE".into(), "configmaps".into(), "team-a/c1".into()),
            ("UPDATE".into(), "configmaps".into(), "team-a/c1".into()),
            ("DELETE".into(), "configmaps".into(), "team-a/c1".into()),
            ("UPDATE".into(), "nodes/status".into(), "/n1".into()),
            ("CREATE".into(), "configmaps".into(), "team-a/deny-1".into()),
            (
                "CREATE".into(),
                "configmaps".into(),
                "team-a/vague-1".into()
            ),
        ],
        "mutating then validating on the update; nothing for team-b, skip, probe or ghost"
    );
    assert_eq!(ops("DELETE"), 1);
    let requests = hook.requests();
    let update = &requests[2];
    assert_eq!(update["oldObject"]["data"]["k"], "v", "{update:#}");
    assert_eq!(update["object"]["data"]["k"], "w");
    assert_eq!(
        update["object"]["metadata"]["annotations"]["mutated"], "yes",
        "the validating webhook sees the mutated object"
    );
    assert_eq!(update["userInfo"]["username"], "sandbox:admin");
    assert_eq!(
        update["kind"],
        json!({ "group": "", "version": "v1", "kind": "ConfigMap" })
    );
    assert_eq!(update["options"]["kind"], "UpdateOptions");
    let delete = &requests[3];
    assert_eq!(delete["object"], Value::Null);
    assert_eq!(delete["oldObject"]["metadata"]["name"], "c1");
    assert_eq!(requests[4]["kind"]["kind"], "Node");

    // A dry run reaches only webhooks without side effects.
    let mut side = hook.hook("side.test", "/side", json!({
        "rules": [{ "operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"] }],
    }));
    side["sideEffects"] = json!("Some");
    api.create_object(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": { "name": "side" }, "webhooks": [side],
    }))
    .expect("configuration");
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let (code, _, message) = refusal(team_a.create(&dry, &configmap("d1", json!({}))).await);
    assert_eq!(
        (code, message.as_str()),
        (
            400,
            "admission webhook \"side.test\" does not support dry run"
        )
    );
    // An unreachable webhook: Fail refuses, Ignore admits.
    let mut down = hook.hook("down.test", "/down", json!({
        "rules": [{ "operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["secrets"] }],
        "failurePolicy": "Fail", "timeoutSeconds": 1,
    }));
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    down["clientConfig"]["url"] = json!(format!("https://{closed}/down"));
    api.create_object(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": { "name": "down" }, "webhooks": [down],
    }))
    .expect("configuration");
    let secret = json!({ "apiVersion": "v1", "kind": "Secret", "metadata": { "name": "s" } });
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(api.admin_client(), "team-a");
    let (code, _, message) = refusal(
        secrets
            .create(
                &params,
                &serde_json::from_value(secret.clone()).expect("a Secret"),
            )
            .await,
    );
    assert_eq!(code, 500, "{message}");
    assert!(
        message.starts_with("Internal error occurred: failed calling webhook \"down.test\""),
        "{message}"
    );
}

// ---------------------------------------------------------------- the chart's policies

/// The rendered chart's ServiceAccounts, RBAC objects and admission policies with `overlay`;
/// `None` when the Helm engine is missing (skipped).
fn chart_objects(overlay: &str) -> Option<Vec<Value>> {
    let values = merged(
        &default_values(),
        &yaml_serde::from_str(overlay).expect("overlay parses"),
    );
    let docs = all_documents(values)?;
    Some(
        docs.into_iter()
            .map(|d| serde_json::to_value(d).expect("JSON"))
            .filter(|d| {
                matches!(
                    d["kind"].as_str(),
                    Some(
                        "ServiceAccount"
                            | "ClusterRole"
                            | "ClusterRoleBinding"
                            | "Role"
                            | "RoleBinding"
                            | "ValidatingAdmissionPolicy"
                            | "ValidatingAdmissionPolicyBinding"
                    )
                )
            })
            .collect(),
    )
}

const NODE: &str = "gpu-node-1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_under_its_own_token_passes_the_charts_policy_others_do_not() {
    let Some(objects) = chart_objects("devicePlugin: {admissionPolicy: {enabled: true}}") else {
        return;
    };
    let api = ApiServer::start().await.expect("sandbox");
    for object in objects {
        api.create_object(object).expect("a chart object");
    }
    // Nodes as kubelet registers them: with a status.
    for node in [NODE, "gpu-node-2"] {
        api.seed_yaml(&format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: {node}, labels: {{gpushare: 'true'}}}}\n\
             status:\n  capacity: {{cpu: '8'}}\n  allocatable: {{cpu: '8'}}\n  \
             conditions: [{{type: Ready, status: 'True'}}]\n"
        ))
        .expect("a node");
    }
    let plugin = Identity::service_account("kube-system", "gpushare-device-plugin");
    // The real device plugin, with the chart's RBAC, under a pod-bound token naming its node:
    // it publishes its node's devices and gpu-count (PATCH nodes and nodes/status).
    let dir = crate::support::socket_dir::short_tempdir();
    let kubelet = gpushare_sandbox::kubelet::Kubelet::start(dir.path())
        .await
        .expect("kubelet");
    let mut config = gpushare::config::Config::default();
    config.node.node_name = NODE.to_string();
    config.device_plugin.device_plugin_dir = kubelet.device_plugin_dir();
    config.device_plugin.state_dir = dir.path().join("state");
    config.device_plugin.pod_resources_socket = kubelet.pod_resources_socket();
    config.device_plugin.admin_address = String::new();
    config.doctor.skip = true;
    let handle = gpushare::deviceplugin::start(
        &config,
        api.client_for(&plugin.clone().on_node(NODE)),
        Arc::new(gpushare::gpu::fake::FakeBackend::from_spec("2x16GiB").expect("fake GPUs")),
        gpushare::shutdown::Shutdown::never(),
    )
    .await
    .expect("the device plugin starts under its ServiceAccount");
    wait_until("the node's devices published through the policy", || {
        api.get_object("nodes", None, NODE).is_some_and(|n| {
            n.pointer("/metadata/annotations/gpushare.io~1devices")
                .is_some()
                && n.pointer("/status/capacity/aliyun.com~1gpu-count") == Some(&json!("2"))
        })
    })
    .await;
    assert!(
        api.requests()
            .iter()
            .any(|r| r.username.as_deref() == Some(plugin.username.as_str())),
        "the plugin's requests carry its identity"
    );
    assert!(
        api.refusals().is_empty(),
        "the chart's RBAC refused the device plugin: {:#?}",
        api.refusals()
    );

    // The same ServiceAccount writing another node, or without the node claim, is refused.
    let annotate =
        Patch::Merge(json!({ "metadata": { "annotations": { "gpushare.io/devices": "[]" } } }));
    let on_node: Api<Node> = Api::all(api.client_for(&plugin.clone().on_node(NODE)));
    let (code, reason, message) = refusal(
        on_node
            .patch("gpu-node-2", &PatchParams::default(), &annotate)
            .await,
    );
    assert_eq!((code, reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        message,
        "nodes \"gpu-node-2\" is forbidden: ValidatingAdmissionPolicy 'gpushare-device-plugin' \
         with binding 'gpushare-device-plugin' denied request: the device plugin may change only \
         its own Node"
    );
    let labels = Patch::Merge(json!({ "metadata": { "labels": { "evil": "1" } } }));
    let (code, _, message) = refusal(on_node.patch(NODE, &PatchParams::default(), &labels).await);
    assert!(
        code == 403 && message.ends_with("the device plugin may not change labels"),
        "{message}"
    );
    let nameless: Api<Node> = Api::all(api.client_for(&plugin));
    let (code, _, message) = refusal(
        nameless
            .patch(NODE, &PatchParams::default(), &annotate)
            .await,
    );
    assert!(
        code == 403 && message.contains("the device plugin's token names no node"),
        "{message}"
    );
    // The administrator is not the policy's business.
    Api::<Node>::all(api.admin_client())
        .patch(NODE, &PatchParams::default(), &labels)
        .await
        .expect("the administrator labels the node");
    handle.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_plugins_token_writes_only_its_own_nodes_slices() {
    let Some(objects) = chart_objects("dra: {enabled: true, admissionPolicy: {enabled: true}}")
    else {
        return;
    };
    let api = ApiServer::start().await.expect("sandbox");
    for object in objects {
        api.create_object(object).expect("a chart object");
    }
    let plugin = Identity::service_account("kube-system", "gpushare-dra-plugin").on_node("node-a");
    let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> =
        Api::all(api.client_for(&plugin));
    let slice = |name: &str, node: &str, driver: &str| {
        serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "driver": driver, "nodeName": node,
                      "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
                      "devices": [] },
        }))
        .expect("a ResourceSlice")
    };
    let params = PostParams::default();
    slices
        .create(&params, &slice("own", "node-a", "gpushare.io"))
        .await
        .expect("its own node's slice");
    let (code, _, message) = refusal(
        slices
            .create(&params, &slice("other", "node-b", "gpushare.io"))
            .await,
    );
    assert_eq!(code, 403);
    assert!(
        message.ends_with("the DRA plugin may write only the ResourceSlices of its own node"),
        "{message}"
    );
    let (_, _, message) = refusal(
        slices
            .create(&params, &slice("foreign", "node-a", "example.com"))
            .await,
    );
    assert!(
        message.ends_with("the DRA plugin may write only the ResourceSlices of its driver"),
        "{message}"
    );
    // Another node's slice, written by the administrator, cannot be deleted by this plugin.
    Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(api.admin_client())
        .create(&params, &slice("theirs", "node-b", "gpushare.io"))
        .await
        .expect("the administrator writes any slice");
    let (code, _, message) = refusal(slices.delete("theirs", &DeleteParams::default()).await);
    assert!(
        code == 403
            && message.ends_with(
                "the DRA plugin may change or delete only the ResourceSlices of its own node"
            ),
        "{message}"
    );
    slices
        .delete("own", &DeleteParams::default())
        .await
        .expect("its own slice");
}
