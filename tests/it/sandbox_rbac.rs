//! The sandbox API server refuses what a cluster refuses: bearer-token authentication (401) and
//! RBAC authorization (403 with upstream's `Status`), decided from the stored Roles,
//! ClusterRoles and bindings, as kube-rs and the real `kubectl` 1.27–1.33 see it
//! (`kubectl auth can-i`, `auth can-i --list`, `auth whoami`, a refused `kubectl get`).

use std::path::Path;

use gpushare_sandbox::apiserver::{ApiServer, Identity, NODE_NAME_EXTRA};
use http::Method;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authorization::v1::{SelfSubjectRulesReview, SelfSubjectRulesReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use crate::support::clients::kubectls;
use crate::support::extender_http::http_as;

/// The RBAC of the table below:
/// - `ml/reader`: ClusterRole `pod-reader` (get, list, watch pods) bound in `ml` only;
/// - `kube-system/elector`: the extender chart's Lease Role (create; get and update of the
///   Lease `gpushare` by name, no watch) and `watcher`'s named watch of `other`;
/// - `kube-system/binder`: ClusterRole with `pods/binding` create and `*/status` patch;
/// - group `gpu-admins`: nodes get; user `alice`: configmaps in `ml` through a Role;
/// - a ClusterRoleBinding of every ServiceAccount to a ClusterRole that does not exist.
const RBAC: &str = include_str!("../fixtures/apiserver/rbac.yaml");

async fn cluster() -> ApiServer {
    let server = ApiServer::start().await.expect("sandbox API server");
    server.seed_yaml(RBAC).expect("RBAC seeded");
    server
}

/// One raw request as `client`: the HTTP status and the body (a `Status` on errors).
async fn send(
    client: &kube::Client,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let content_type = if method == "PATCH" {
        "application/merge-patch+json"
    } else {
        "application/json"
    };
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("Content-Type", content_type)
        .body(body.map(|b| b.to_string().into_bytes()).unwrap_or_default())
        .expect("a request");
    match client.request_text(request).await {
        // A watch answers lines of events (none here): the text as a string then.
        Ok(text) => (
            200,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ),
        Err(kube::Error::Api(status)) => (
            status.code,
            serde_json::to_value(&*status).expect("a Status as JSON"),
        ),
        Err(other) => panic!("{method} {path}: expected an answer, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_allowed_exactly_as_the_stored_rbac_allows_them() {
    let server = cluster().await;
    let reader = server.client_for(&Identity::service_account("ml", "reader"));
    let elector = server.client_for(&Identity::service_account("kube-system", "elector"));
    let binder = server.client_for(&Identity::service_account("kube-system", "binder"));
    let admins = server.client_for(&Identity::user("bob", &["gpu-admins"]));
    let alice = server.client_for(&Identity::user("alice", &[]));
    let admin = server.admin_client();
    let binding = json!({ "apiVersion": "v1", "kind": "Binding", "metadata": { "name": "p" },
                          "target": { "kind": "Node", "name": "n1" } });
    let lease = json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": { "name": "gpushare" } });
    let leases = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases";
    let named_watch = |name: &str| {
        format!("{leases}?fieldSelector=metadata.name%3D{name}&watch=1&timeoutSeconds=1")
    };
    let cm = json!({ "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "name": "c" } });
    // (who, client, method, path, body, expected status)
    type Case<'a> = (
        &'a str,
        &'a kube::Client,
        &'a str,
        String,
        Option<Value>,
        u16,
    );
    let table: Vec<Case<'_>> = vec![
        (
            "reader",
            &reader,
            "GET",
            "/api/v1/namespaces/ml/pods/p".into(),
            None,
            200,
        ),
        (
            "reader",
            &reader,
            "GET",
            "/api/v1/namespaces/ml/pods".into(),
            None,
            200,
        ),
        (
            "reader lists another namespace",
            &reader,
            "GET",
            "/api/v1/namespaces/default/pods".into(),
            None,
            403,
        ),
        (
            "reader lists all namespaces",
            &reader,
            "GET",
            "/api/v1/pods".into(),
            None,
            403,
        ),
        (
            "reader patches",
            &reader,
            "PATCH",
            "/api/v1/namespaces/ml/pods/p".into(),
            Some(json!({})),
            403,
        ),
        (
            "reader binds",
            &reader,
            "POST",
            "/api/v1/namespaces/ml/pods/p/binding".into(),
            Some(binding.clone()),
            403,
        ),
        (
            "reader reads a node",
            &reader,
            "GET",
            "/api/v1/nodes/n1".into(),
            None,
            403,
        ),
        (
            "reader discovers",
            &reader,
            "GET",
            "/apis/coordination.k8s.io/v1".into(),
            None,
            200,
        ),
        (
            "reader reads /version",
            &reader,
            "GET",
            "/version".into(),
            None,
            200,
        ),
        (
            "elector creates its lease",
            &elector,
            "POST",
            leases.into(),
            Some(lease),
            200,
        ),
        (
            "elector gets it by name",
            &elector,
            "GET",
            format!("{leases}/gpushare"),
            None,
            200,
        ),
        (
            "elector gets another",
            &elector,
            "GET",
            format!("{leases}/other"),
            None,
            403,
        ),
        (
            "elector lists leases",
            &elector,
            "GET",
            leases.into(),
            None,
            403,
        ),
        // The chart's Role has get/update by name, not watch: a named watch is refused...
        (
            "elector watches its lease",
            &elector,
            "GET",
            named_watch("gpushare"),
            None,
            403,
        ),
        // ...and allowed where `watch` is granted by name.
        (
            "elector watches `other`",
            &elector,
            "GET",
            named_watch("other"),
            None,
            200,
        ),
        (
            "binder binds",
            &binder,
            "POST",
            "/api/v1/namespaces/ml/pods/p/binding".into(),
            Some(binding.clone()),
            200,
        ),
        (
            "binder patches a node's status",
            &binder,
            "PATCH",
            "/api/v1/nodes/n1/status".into(),
            Some(json!({})),
            200,
        ),
        (
            "binder patches the node",
            &binder,
            "PATCH",
            "/api/v1/nodes/n1".into(),
            Some(json!({})),
            403,
        ),
        (
            "a group member reads the node",
            &admins,
            "GET",
            "/api/v1/nodes/n1".into(),
            None,
            200,
        ),
        (
            "a group member lists nodes",
            &admins,
            "GET",
            "/api/v1/nodes".into(),
            None,
            403,
        ),
        (
            "alice creates a config map",
            &alice,
            "POST",
            "/api/v1/namespaces/ml/configmaps".into(),
            Some(cm.clone()),
            200,
        ),
        (
            "alice deletes it",
            &alice,
            "DELETE",
            "/api/v1/namespaces/ml/configmaps/c".into(),
            None,
            200,
        ),
        (
            "alice in kube-system",
            &alice,
            "POST",
            "/api/v1/namespaces/kube-system/configmaps".into(),
            Some(cm),
            403,
        ),
        (
            "the admin reads a secret",
            &admin,
            "GET",
            "/api/v1/namespaces/ml/secrets/none".into(),
            None,
            404,
        ),
    ];
    for (who, client, method, path, body, want) in table {
        let (code, answer) = send(client, method, &path, body).await;
        assert_eq!(code, want, "{who}: {method} {path}: {answer:#}");
        if code == 403 {
            assert_eq!(answer["reason"], "Forbidden", "{who}: {answer:#}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_upstreams_forbidden_status() {
    let server = cluster().await;
    // The body on the wire, then as kube-rs reads it.
    let token = server.token_for(&Identity::service_account("ml", "reader"));
    let url = format!("{}/api/v1/namespaces/default/pods/p", server.url());
    let (code, body) = http_as(Method::GET, &url, None, Some(&token))
        .await
        .expect("an answer");
    let status: Value = serde_json::from_slice(&body).expect("a JSON Status");
    assert_eq!(code, 403);
    assert_eq!(
        status,
        json!({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": 403, "reason": "Forbidden",
            "message": "pods \"p\" is forbidden: User \"system:serviceaccount:ml:reader\" cannot get \
                        resource \"pods\" in API group \"\" in the namespace \"default\": RBAC: \
                        clusterrole.rbac.authorization.k8s.io \"gone\" not found",
            "details": { "name": "p", "kind": "pods" },
        })
    );
    let reader = server.client_for(&Identity::service_account("ml", "reader"));
    match Api::<Pod>::namespaced(reader, "default").get("p").await {
        Err(kube::Error::Api(s)) => assert_eq!(
            (s.code, s.reason.as_str(), s.message.as_str()),
            (
                403,
                "Forbidden",
                status["message"].as_str().unwrap_or_default()
            )
        ),
        other => panic!("a 403, not {other:?}"),
    }
    let binder = server.client_for(&Identity::service_account("kube-system", "binder"));
    let (_, status) = send(
        &binder,
        "GET",
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases",
        None,
    )
    .await;
    assert_eq!(
        status["message"],
        "leases.coordination.k8s.io is forbidden: User \"system:serviceaccount:kube-system:binder\" \
         cannot list resource \"leases\" in API group \"coordination.k8s.io\" in the namespace \
         \"kube-system\": RBAC: clusterrole.rbac.authorization.k8s.io \"gone\" not found"
    );
    assert_eq!(
        status["details"],
        json!({ "group": "coordination.k8s.io", "kind": "leases" })
    );
    // A user outside every binding gets no resolution error appended.
    let nobody = server.client_for(&Identity::user("nobody", &[]));
    let (_, status) = send(&nobody, "PATCH", "/api/v1/nodes/n1/status", Some(json!({}))).await;
    assert_eq!(
        status["message"],
        "nodes \"n1\" is forbidden: User \"nobody\" cannot patch resource \"nodes/status\" in API \
         group \"\" at the cluster scope"
    );
    // Every refusal is kept, with who was refused.
    let refusals = server.refusals();
    assert_eq!(refusals.len(), 4, "{refusals:#?}");
    let last = &refusals[3];
    assert_eq!(
        (last.code, last.username.as_deref(), last.path.as_str()),
        (403, Some("nobody"), "/api/v1/nodes/n1/status")
    );
    assert_eq!(last.message, status["message"]);
    // Every request is logged with who sent it.
    assert!(
        server.requests().iter().any(|r| r.path == "/api/v1/nodes/n1/status"
            && r.username.as_deref() == Some("nobody")),
        "the request log names the user"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_token_are_unauthorized() {
    let server = cluster().await;
    let unauthorized = json!({
        "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
        "code": 401, "reason": "Unauthorized", "message": "Unauthorized",
    });
    for token in [None, Some("not-a-sandbox-token")] {
        for path in ["/api/v1/namespaces/ml/pods", "/version", "/api"] {
            let url = format!("{}{path}", server.url());
            let (code, body) = http_as(Method::GET, &url, None, token)
                .await
                .expect("an answer");
            let status: Value = serde_json::from_slice(&body).expect("a JSON Status");
            assert_eq!(
                (code, &status),
                (401, &unauthorized),
                "{path} with {token:?}"
            );
        }
    }
    // kube-rs without credentials sees the same Status.
    let anonymous = kube::Client::try_from(kube::Config::new(server.url().parse().expect("a URL")))
        .expect("a client");
    match Api::<Pod>::namespaced(anonymous, "ml")
        .list(&Default::default())
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (401, "Unauthorized")),
        other => panic!("a 401, not {other:?}"),
    }
    // A ServiceAccount token stops authenticating when its account is deleted.
    let reader = server.client_for(&Identity::service_account("ml", "reader"));
    assert_eq!(
        send(&reader, "GET", "/api/v1/namespaces/ml/pods", None)
            .await
            .0,
        200
    );
    server
        .delete_object("serviceaccounts", Some("ml"), "reader")
        .expect("account deleted");
    assert_eq!(
        send(&reader, "GET", "/api/v1/namespaces/ml/pods", None)
            .await
            .0,
        401
    );
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.path == "/api/v1/namespaces/ml/pods" && r.username.is_none()),
        "unauthenticated requests are logged without a user"
    );
    assert!(
        server
            .refusals()
            .iter()
            .all(|r| r.code == 401 && r.username.is_none() && r.message == "Unauthorized"),
        "{:#?}",
        server.refusals()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_reviews_answer_for_the_caller() {
    let server = cluster().await;
    let identity = Identity::service_account("kube-system", "binder").on_node("n1");
    let binder = server.client_for(&identity);
    let whoami = Api::<SelfSubjectReview>::all(binder.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .expect("a SelfSubjectReview");
    let user = whoami
        .status
        .and_then(|s| s.user_info)
        .expect("status.userInfo");
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:kube-system:binder")
    );
    let account = server
        .get_object("serviceaccounts", Some("kube-system"), "binder")
        .expect("the account");
    assert_eq!(
        user.uid.as_deref(),
        account["metadata"]["uid"].as_str(),
        "the account's uid"
    );
    assert_eq!(
        user.extra.expect("extra")[NODE_NAME_EXTRA],
        vec!["n1".to_string()]
    );
    let rules = Api::<SelfSubjectRulesReview>::all(binder)
        .create(
            &PostParams::default(),
            &SelfSubjectRulesReview {
                spec: SelfSubjectRulesReviewSpec {
                    namespace: Some("ml".into()),
                },
                ..SelfSubjectRulesReview::default()
            },
        )
        .await
        .expect("a SelfSubjectRulesReview")
        .status
        .expect("a status");
    let granted: Vec<(Vec<String>, Vec<String>)> = rules
        .resource_rules
        .iter()
        .map(|r| (r.verbs.clone(), r.resources.clone().unwrap_or_default()))
        .collect();
    assert!(
        granted.contains(&(vec!["create".into()], vec!["pods/binding".into()])),
        "{granted:?}"
    );
    assert!(
        rules.non_resource_rules.iter().any(|r| r
            .non_resource_urls
            .as_deref()
            .unwrap_or_default()
            .contains(&"/version".to_string())),
        "discovery is granted to every authenticated user"
    );
    assert_eq!(
        rules.evaluation_error.as_deref(),
        Some("clusterrole.rbac.authorization.k8s.io \"gone\" not found")
    );
}

/// Runs `kubectl` with `kubeconfig`: (exit code, stdout, stderr).
async fn kubectl(binary: &Path, kubeconfig: &Path, args: &[&str]) -> (i32, String, String) {
    let out = crate::support::clients::kubectl_output(binary, kubeconfig, args).await;
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `(binary, minor)` of every kubectl found; fails loudly when none is (every machine of this
/// project has 1.27–1.33).
fn every_kubectl() -> Vec<(std::path::PathBuf, u32)> {
    let found: Vec<_> = kubectls()
        .into_iter()
        .filter_map(|(path, version)| {
            let minor = version
                .strip_prefix("v1.")?
                .split('.')
                .next()?
                .parse()
                .ok()?;
            Some((path, minor))
        })
        .collect();
    assert!(
        !found.is_empty(),
        "no kubectl found: the real-kubectl tests need kubectl 1.27–1.33 (Google Cloud SDK)"
    );
    found
}

const BIND_IN_ML: &[&str] = &[
    "auth",
    "can-i",
    "create",
    "pods",
    "--subresource=binding",
    "-n",
    "ml",
];
const LEASE: &str = "leases.coordination.k8s.io/gpushare";
const UPDATE_LEASE: &[&str] = &["auth", "can-i", "update", LEASE, "-n", "kube-system"];
const WATCH_LEASE: &[&str] = &["auth", "can-i", "watch", LEASE, "-n", "kube-system"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_auth_can_i_asks_the_same_rules() {
    let server = cluster().await;
    let reader = server
        .service_account_kubeconfig("ml", "reader", None)
        .expect("a kubeconfig");
    let elector = server
        .service_account_kubeconfig("kube-system", "elector", None)
        .expect("a kubeconfig");
    for (binary, minor) in every_kubectl() {
        let k = |kc: &'static str, args: &'static [&'static str]| {
            let binary = binary.clone();
            let kubeconfig = if kc == "reader" {
                reader.clone()
            } else {
                elector.clone()
            };
            async move { kubectl(&binary, &kubeconfig, args).await }
        };
        let (code, out, err) = k("reader", &["auth", "can-i", "list", "pods", "-n", "ml"]).await;
        assert_eq!((code, out.trim()), (0, "yes"), "1.{minor}: {err}");
        // kubectl prints the authorizer's reason after the answer.
        let (code, out, _) = k(
            "reader",
            &["auth", "can-i", "list", "pods", "-n", "default"],
        )
        .await;
        assert_eq!(
            (code, out.trim()),
            (
                1,
                "no - RBAC: clusterrole.rbac.authorization.k8s.io \"gone\" not found"
            ),
            "1.{minor}"
        );
        // Each question, and whether kubectl answers yes (exit 0) or no (exit 1).
        for (who, args, allowed) in [
            ("reader", BIND_IN_ML, false),
            ("elector", UPDATE_LEASE, true),
            ("elector", WATCH_LEASE, false),
        ] {
            let (code, out, err) = k(who, args).await;
            if allowed {
                assert_eq!(
                    (code, out.trim()),
                    (0, "yes"),
                    "1.{minor} {who} {args:?}: {err}"
                );
            } else {
                assert!(
                    code == 1 && out.starts_with("no"),
                    "1.{minor} {who} {args:?}: {out}"
                );
            }
        }
        // The refusal as kubectl prints it.
        let (code, _, err) = k("reader", &["get", "nodes"]).await;
        assert_eq!(code, 1, "1.{minor}");
        assert!(
            err.contains(
                "Error from server (Forbidden): nodes is forbidden: User \
                 \"system:serviceaccount:ml:reader\" cannot list resource \"nodes\" in API group \
                 \"\" at the cluster scope"
            ),
            "1.{minor}: {err}"
        );
        let (code, out, err) = k("reader", &["auth", "can-i", "--list", "-n", "ml"]).await;
        assert_eq!(code, 0, "1.{minor}: {err}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("pods ") && l.contains("[get list watch]")),
            "1.{minor}: {out}"
        );
        if minor >= 28 {
            let (code, out, err) = k("reader", &["auth", "whoami", "-o", "json"]).await;
            assert_eq!(code, 0, "1.{minor}: {err}");
            let review: Value = serde_json::from_str(&out).expect("whoami prints JSON");
            assert_eq!(
                review["status"]["userInfo"]["username"], "system:serviceaccount:ml:reader",
                "1.{minor}"
            );
        }
    }
    // A kubeconfig with a token the server never issued.
    let bad = tempfile::NamedTempFile::new().expect("a file");
    let text = std::fs::read_to_string(&reader).expect("the kubeconfig");
    let token_line = text
        .lines()
        .find(|l| l.trim_start().starts_with("token:"))
        .expect("a token line");
    std::fs::write(
        bad.path(),
        text.replace(token_line, "    token: \"forged\""),
    )
    .expect("written");
    let (binary, minor) = every_kubectl().remove(0);
    let (code, _, err) = kubectl(&binary, bad.path(), &["get", "pods", "-n", "ml"]).await;
    assert_eq!(code, 1, "1.{minor}");
    assert!(
        err.contains("You must be logged in to the server"),
        "1.{minor}: {err}"
    );
}
