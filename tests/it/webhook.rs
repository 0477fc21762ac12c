//! `gpushare webhook` over real HTTPS: AdmissionReview round trips (mutate, validate,
//! garbage, other kinds), the `--self-signed` bootstrap against the sandbox API server (two
//! replicas race for one Secret, caBundle patched, renewal at start and while running,
//! conflicts and lost answers), and the sandbox calling the webhook on pod create as
//! kube-apiserver does (a gpu-mem pod that would switch off the CUDA memory limiter refused).

use std::time::{Duration, SystemTime};

use std::sync::Arc;

use base64::Engine as _;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

use gpushare::config::Config;
use gpushare::shutdown::Shutdown;
use gpushare::webhook::bootstrap::{self, KEY_CA_CRT, KEY_TLS_CRT};
use gpushare::webhook::certs::{self, PemPair};
use gpushare::webhook::{self, WebhookHandle};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};

use crate::support::https_client::{connector, https_exchange};

const DNS: &str = "gpushare-webhook.kube-system.svc";

/// POSTs `body` to `path` over TLS, trusting only `ca_pem`, checking the name `DNS`.
async fn post(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Value, String) {
    let answer = https_exchange(connector(ca_pem, None), DNS, addr, method, path, body)
        .await
        .expect("an HTTPS answer from the webhook");
    let json = serde_json::from_str(&answer.body).unwrap_or(Value::String(answer.body));
    let presented = base64::engine::general_purpose::STANDARD.encode(answer.presented);
    (answer.status, json, presented)
}

fn review(kind: &str, object: Value) -> Vec<u8> {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": { "uid": "7f0b", "kind": { "group": "", "version": "v1", "kind": kind },
                     "operation": "CREATE", "namespace": "default", "object": object },
    })
    .to_string()
    .into_bytes()
}

fn gpu_pod(name: &str, limit: &str, request: Option<&str>) -> Value {
    let mut resources = json!({ "limits": { "aliyun.com/gpu-mem": limit } });
    if let Some(r) = request {
        resources["requests"] = json!({ "aliyun.com/gpu-mem": r });
    }
    json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": name },
            "spec": { "containers": [{ "name": "trainer", "image": "cuda", "resources": resources }] } })
}

fn config() -> Config {
    let mut c = Config::default();
    c.webhook.bind_address = [127, 0, 0, 1].into();
    c.webhook.port = 0;
    c
}

/// A CA and a serving cert for `DNS`, written to files.
fn cert_files(dir: &std::path::Path) -> (PemPair, std::path::PathBuf, std::path::PathBuf) {
    let now = SystemTime::now();
    let ca = certs::issue_ca(now, certs::CA_VALIDITY).expect("CA");
    let names = certs::service_dns_names("gpushare-webhook", "kube-system");
    let leaf =
        certs::issue_serving(&ca, &names, now, now + Duration::from_secs(86_400)).expect("leaf");
    let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&c, &leaf.cert).expect("write cert");
    std::fs::write(&k, &leaf.key).expect("write key");
    (ca, c, k)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_reviews_round_trip_over_https() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = cert_files(dir.path());
    let mut c = config();
    c.webhook.tls_cert = cert.display().to_string();
    c.webhook.tls_key = key.display().to_string();
    c.webhook.max_gpu_mem = 64;
    let hook = webhook::start(&c, None, webhook::DEFAULT_REFRESH, Shutdown::never())
        .await
        .expect("webhook starts");
    let addr = hook.addr;

    let (code, body, _) = post(
        addr,
        &ca.cert,
        "POST",
        "/mutate",
        &review("Pod", gpu_pod("p", "4", None)),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let response = &body["response"];
    assert_eq!(response["uid"], "7f0b");
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("patch"))
        .expect("base64");
    let ops: Value = serde_json::from_slice(&patch).expect("patch JSON");
    assert_eq!(
        ops,
        json!([{ "op": "add", "path": "/spec/schedulerName", "value": "gpushare-scheduler" }])
    );

    let plain = json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "web" },
                        "spec": { "containers": [{ "name": "nginx", "image": "nginx" }] } });
    let (_, body, _) = post(addr, &ca.cert, "POST", "/mutate", &review("Pod", plain)).await;
    assert_eq!(body["response"]["allowed"], true);
    assert!(body["response"].get("patch").is_none(), "{body}");

    let (code, body, _) = post(
        addr,
        &ca.cert,
        "POST",
        "/validate",
        &review("Pod", gpu_pod("p", "2", Some("1"))),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(body["response"]["allowed"], false);
    let message = body["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("\"trainer\"") && message.contains("requests (1) differ from limits (2)"),
        "{message}"
    );
    let (_, body, _) = post(
        addr,
        &ca.cert,
        "POST",
        "/validate",
        &review("Pod", gpu_pod("p", "65", None)),
    )
    .await;
    assert!(
        body["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("at most 64 units"),
        "{body}"
    );
    let (_, body, _) = post(
        addr,
        &ca.cert,
        "POST",
        "/validate",
        &review("Pod", gpu_pod("p", "4", Some("4"))),
    )
    .await;
    assert_eq!(body["response"]["allowed"], true, "{body}");

    let (_, body, _) = post(
        addr,
        &ca.cert,
        "POST",
        "/validate",
        &review("Deployment", json!({})),
    )
    .await;
    assert_eq!(body["response"]["allowed"], true);
    assert!(
        body["response"]["warnings"][0]
            .as_str()
            .unwrap_or_default()
            .contains("Pods only"),
        "{body}"
    );

    for garbage in [
        &b"\xff\xfe{{"[..],
        b"",
        b"[1,2]",
        br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}"#,
    ] {
        let (code, body, _) = post(addr, &ca.cert, "POST", "/mutate", garbage).await;
        assert_eq!(code, 400, "{body}");
        assert!(body["Error"].is_string(), "{body}");
    }
    let (code, _, _) = post(addr, &ca.cert, "GET", "/validate", b"").await;
    assert_eq!(code, 405);
    let (code, body, _) = post(addr, &ca.cert, "GET", "/nope", b"").await;
    assert_eq!(code, 404);
    assert!(body["Error"].is_string());
    let (code, _, _) = post(addr, &ca.cert, "GET", "/readyz", b"").await;
    assert_eq!(code, 200);
    let (_, metrics, _) = post(addr, &ca.cert, "GET", "/metrics", b"").await;
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    assert!(
        metrics
            .contains("gpushare_webhook_reviews_total{endpoint=\"validate\",result=\"denied\"} 2"),
        "{metrics}"
    );
    hook.stop().await;
}

fn webhook_configs(api: &ApiServer) {
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        let path = if kind.starts_with("Mutating") {
            "/mutate"
        } else {
            "/validate"
        };
        api.create_object(json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
            "metadata": { "name": "gpushare-webhook" },
            "webhooks": [{
                "name": format!("{}.gpushare.io", &path[1..]),
                "admissionReviewVersions": ["v1"], "sideEffects": "None", "timeoutSeconds": 5,
                "failurePolicy": "Fail",
                "clientConfig": { "service": { "namespace": "kube-system", "name": "gpushare-webhook", "path": path, "port": 443 } },
                "namespaceSelector": { "matchExpressions": [
                    { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"] },
                    { "key": "gpushare.io/webhook", "operator": "NotIn", "values": ["disabled"] },
                ]},
                "rules": [{ "operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced" }],
            }],
        }))
        .expect("webhook configuration seeded");
    }
}

fn secret_of(api: &ApiServer) -> Secret {
    api.get_as("secrets", Some("kube-system"), "gpushare-webhook-tls")
        .expect("the Secret exists")
}

fn ca_bundles(api: &ApiServer) -> Vec<String> {
    [
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
    ]
    .iter()
    .map(|r| {
        let obj = api.get_object(r, None, "gpushare-webhook").expect("config");
        let b64 = obj["webhooks"][0]["clientConfig"]["caBundle"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap_or_default(),
        )
        .unwrap_or_default()
    })
    .collect()
}

fn text(secret: &Secret, key: &str) -> String {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .unwrap_or_default()
}

async fn self_signed(api: &ApiServer, refresh: Duration) -> WebhookHandle {
    let mut c = config();
    c.webhook.self_signed = true;
    webhook::start(&c, Some(api.admin_client()), refresh, Shutdown::never())
        .await
        .expect("webhook starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_racing_agree_on_one_secret_and_write_the_ca_bundle() {
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    // The first create is answered 409 and one read is lost: both rounds must be settled by
    // reading the API, never by assuming.
    api.inject(Fault::new(
        Some(http::Method::POST),
        "/secrets",
        FaultAction::Status(409),
    ));
    api.inject(Fault::new(
        Some(http::Method::GET),
        "/secrets/gpushare-webhook-tls",
        FaultAction::Status(500),
    ));
    let (a, b) = tokio::join!(
        self_signed(&api, webhook::DEFAULT_REFRESH),
        self_signed(&api, webhook::DEFAULT_REFRESH)
    );
    assert_eq!(api.list_objects("secrets", Some("kube-system")).len(), 1);
    let secret = secret_of(&api);
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let ca = text(&secret, KEY_CA_CRT);
    assert_eq!(a.serving.pem(), text(&secret, KEY_TLS_CRT));
    assert_eq!(b.serving.pem(), text(&secret, KEY_TLS_CRT));
    assert_eq!(a.ca_bundle.as_deref(), Some(ca.as_str()));
    assert_eq!(ca_bundles(&api), [ca.clone(), ca.clone()]);
    // Both replicas serve the one certificate, and it verifies against the caBundle.
    let (_, _, from_a) = post(a.addr, &ca, "GET", "/healthz", b"").await;
    let (_, _, from_b) = post(b.addr, &ca, "GET", "/healthz", b"").await;
    assert_eq!(from_a, from_b);
    // A restart keeps what is there.
    let c = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    assert_eq!(text(&secret_of(&api), KEY_TLS_CRT), a.serving.pem());
    for h in [a, b, c] {
        h.stop().await;
    }
}

/// Overwrites the Secret's serving certificate with one of the same CA that expires in a day.
fn expiring_serving(api: &ApiServer) -> String {
    let secret = secret_of(api);
    let ca = PemPair {
        cert: text(&secret, KEY_CA_CRT),
        key: text(&secret, bootstrap::KEY_CA_KEY),
    };
    let now = SystemTime::now();
    let names = certs::service_dns_names("gpushare-webhook", "kube-system");
    let leaf =
        certs::issue_serving(&ca, &names, now, now + Duration::from_secs(86_400)).expect("leaf");
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut obj = api
        .get_object("secrets", Some("kube-system"), "gpushare-webhook-tls")
        .expect("secret");
    obj["data"]["tls.crt"] = json!(b64(&leaf.cert));
    obj["data"]["tls.key"] = json!(b64(&leaf.key));
    api.delete_object("secrets", Some("kube-system"), "gpushare-webhook-tls")
        .expect("delete");
    if let Some(m) = obj["metadata"].as_object_mut() {
        m.remove("resourceVersion");
        m.remove("uid");
    }
    api.create_object(obj).expect("recreate");
    leaf.cert
}

fn days_left(pem: &str) -> u64 {
    let info = certs::first_info("served", pem).expect("readable");
    info.not_after
        .duration_since(SystemTime::now())
        .unwrap_or_default()
        .as_secs()
        / 86_400
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_due_for_renewal_is_renewed_at_start_and_while_running() {
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    let first = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    first.stop().await;
    let ca_before = text(&secret_of(&api), KEY_CA_CRT);
    // At start: a serving cert with one day left is renewed from the same CA.
    let expiring = expiring_serving(&api);
    let hook = self_signed(&api, Duration::from_millis(50)).await;
    let renewed = text(&secret_of(&api), KEY_TLS_CRT);
    assert_ne!(renewed, expiring);
    assert_eq!(hook.serving.pem(), renewed);
    assert!(days_left(&renewed) >= 364, "{}", days_left(&renewed));
    assert_eq!(
        text(&secret_of(&api), KEY_CA_CRT),
        ca_before,
        "the CA is kept"
    );
    // While running: the refresh loop renews again and swaps the served certificate.
    let expiring = expiring_serving(&api);
    let mut served = hook.serving.pem();
    for _ in 0..400 {
        served = hook.serving.pem();
        if served != renewed && served != expiring {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_ne!(served, expiring, "the refresh loop never renewed");
    assert!(days_left(&served) >= 364);
    let (_, _, presented) = post(hook.addr, &ca_before, "GET", "/healthz", b"").await;
    let served_der = certs::pem_certs("served", &served).expect("pem")[0].to_vec();
    assert_eq!(
        presented,
        base64::engine::general_purpose::STANDARD.encode(served_der)
    );
    // A helm upgrade that empties the caBundle is repaired by the same loop.
    let mut cfg = api
        .get_object("validatingwebhookconfigurations", None, "gpushare-webhook")
        .expect("config");
    cfg["webhooks"][0]["clientConfig"]["caBundle"] = json!("");
    api.delete_object("validatingwebhookconfigurations", None, "gpushare-webhook")
        .expect("delete");
    if let Some(m) = cfg["metadata"].as_object_mut() {
        m.remove("resourceVersion");
    }
    api.create_object(cfg).expect("recreate");
    let mut repaired = false;
    for _ in 0..400 {
        if ca_bundles(&api)[1] == ca_before {
            repaired = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(repaired, "the caBundle was not written back");
    hook.stop().await;
}

/// Creates pod `pod` (JSON) through the API server, its admission webhooks included.
async fn create_pod(pods: &Api<Pod>, pod: Value) -> kube::Result<Pod> {
    let pod: Pod = serde_json::from_value(pod).expect("a pod");
    pods.create(&PostParams::default(), &pod).await
}

/// The scheduler a stored pod names, if any.
fn scheduler_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_api_server_calls_the_webhooks_on_pod_create() {
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    let hook = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    api.route_service("kube-system", "gpushare-webhook", hook.addr);
    let pods: Api<Pod> = Api::namespaced(api.admin_client(), "default");
    let created = create_pod(&pods, gpu_pod("train", "4", None))
        .await
        .expect("a well-formed gpu pod is admitted");
    assert_eq!(scheduler_of(&created), Some("gpushare-scheduler"));
    let plain: Pod = serde_json::from_value(json!({ "metadata": { "name": "web" },
        "spec": { "containers": [{ "name": "nginx", "image": "nginx" }] } }))
    .expect("pod");
    let created = pods
        .create(&PostParams::default(), &plain)
        .await
        .expect("plain pod admitted");
    assert_eq!(scheduler_of(&created), None);
    let err = create_pod(&pods, gpu_pod("bad", "1.5", None))
        .await
        .expect_err("a fractional request is refused");
    let kube::Error::Api(status) = err else {
        panic!("not an API error: {err}")
    };
    assert_eq!(status.code, 422);
    assert!(
        status.message.contains("denied the request") && status.message.contains("\"trainer\""),
        "{}",
        status.message
    );
    assert!(api.get_object("pods", Some("default"), "bad").is_none());
    // A namespace that opted out is not touched.
    api.create_object(json!({ "apiVersion": "v1", "kind": "Namespace",
        "metadata": { "name": "legacy", "labels": { "gpushare.io/webhook": "disabled" } } }))
        .expect("ns");
    let legacy: Api<Pod> = Api::namespaced(api.admin_client(), "legacy");
    let created = create_pod(&legacy, gpu_pod("old", "1.5", None))
        .await
        .expect("the webhook skips opted-out namespaces");
    assert_eq!(scheduler_of(&created), None);
    // failurePolicy Fail: with the webhook gone, gpu pods cannot be created.
    hook.stop().await;
    let err = create_pod(&pods, gpu_pod("late", "1", None))
        .await
        .expect_err("failurePolicy: Fail");
    assert!(err.to_string().contains("failed calling webhook"), "{err}");
}

/// A gpu-mem pod whose spec would take the CUDA memory limiter's place (a volume over
/// `/etc/ld.so.preload` or `/usr/local/gpushare`, a hostPath reaching the node's limiter
/// files) is refused through the API server; the same mounts in a pod without GPU memory,
/// and a gpu-mem pod that merely sets variables, are admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_pod_that_would_switch_off_the_limiter_is_refused_on_create() {
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    let hook = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    api.route_service("kube-system", "gpushare-webhook", hook.addr);
    let pods: Api<Pod> = Api::namespaced(api.admin_client(), "default");
    let with = |name: &str, gpu: bool, mount: &str, volume: Value| {
        let mut p = gpu_pod(name, "2", None);
        if !gpu {
            p["spec"]["containers"][0]["resources"] = json!({});
        }
        p["spec"]["containers"][0]["volumeMounts"] =
            json!([{ "name": "v", "mountPath": mount, "subPath": "f" }]);
        p["spec"]["containers"][0]["env"] = json!([
            { "name": "CUDA_DISABLE_CONTROL", "value": "true" },
            { "name": "LD_PRELOAD", "value": "/usr/lib/other.so" },
        ]);
        p["spec"]["volumes"] = json!([volume]);
        serde_json::from_value::<Pod>(p).expect("pod")
    };
    let empty = json!({ "name": "v", "emptyDir": {} });
    for (name, mount, volume, says) in [
        (
            "preload",
            "/etc/ld.so.preload",
            empty.clone(),
            "mounts volume \"v\" at /etc/ld.so.preload",
        ),
        (
            "limits",
            "/usr/local/gpushare/limits",
            empty.clone(),
            "over the limiter's /usr/local/gpushare",
        ),
        (
            "host",
            "/data",
            json!({ "name": "v", "hostPath": { "path": "/var/run" } }),
            "hostPath volume \"v\" (/var/run) reaches the limiter's files",
        ),
    ] {
        let err = pods
            .create(&PostParams::default(), &with(name, true, mount, volume))
            .await
            .expect_err("refused");
        let kube::Error::Api(status) = err else {
            panic!("not an API error: {err}")
        };
        assert_eq!(status.code, 422, "{name}");
        assert!(
            status.message.contains("CUDA memory limiter") && status.message.contains(says),
            "{name}: {}",
            status.message
        );
        assert!(api.get_object("pods", Some("default"), name).is_none());
    }
    pods.create(
        &PostParams::default(),
        &with("plain", false, "/etc/ld.so.preload", empty.clone()),
    )
    .await
    .expect("a pod without GPU memory is not the limiter's business");
    pods.create(&PostParams::default(), &with("vars", true, "/data", empty))
        .await
        .expect("variables cannot switch the limiter off: admitted");
    hook.stop().await;
}

#[test]
fn the_binary_refuses_to_serve_without_tls() {
    let out = crate::support::run(&["webhook", "--port", "0"]);
    // Missing configuration: exit 78.
    assert_eq!(
        out.status.code(),
        Some(78),
        "{}",
        crate::support::stderr(&out)
    );
    assert!(
        crate::support::stderr(&out).contains("--tls-cert and --tls-key"),
        "{}",
        crate::support::stderr(&out)
    );
}

/// kubectl (a client someone else wrote) creating pods through the sandbox and its webhooks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_sees_the_pod_routed_and_the_refusal_explained() {
    const KUBECTLS: [&str; 2] = [
        "/usr/lib/google-cloud-sdk/bin/kubectl.1.27",
        "/usr/lib/google-cloud-sdk/bin/kubectl.1.33",
    ];
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    let hook = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    api.route_service("kube-system", "gpushare-webhook", hook.addr);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ran = 0;
    for (i, kubectl) in KUBECTLS.iter().enumerate() {
        if !std::path::Path::new(kubectl).exists() {
            eprintln!("skipping {kubectl}: not installed");
            continue;
        }
        ran += 1;
        let good = dir.path().join(format!("good{i}.yaml"));
        let bad = dir.path().join(format!("bad{i}.yaml"));
        std::fs::write(
            &good,
            yaml_serde::to_string(&gpu_pod(&format!("good{i}"), "2", None)).expect("yaml"),
        )
        .expect("write");
        std::fs::write(
            &bad,
            yaml_serde::to_string(&gpu_pod(&format!("bad{i}"), "-1", None)).expect("yaml"),
        )
        .expect("write");
        let kubeconfig = api.admin_kubeconfig_path();
        let kubectl = kubectl.to_string();
        // kubectl keeps its discovery cache under $HOME/.kube: a HOME of the test's own.
        let home = dir.path().to_path_buf();
        let run = move |args: Vec<String>| {
            std::process::Command::new(&kubectl)
                .env_clear()
                .env("HOME", &home)
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(args)
                .output()
                .expect("kubectl runs")
        };
        let (created, refused, scheduler) = tokio::task::spawn_blocking(move || {
            let created = run(vec![
                "create".into(),
                "-f".into(),
                good.display().to_string(),
            ]);
            let refused = run(vec![
                "create".into(),
                "-f".into(),
                bad.display().to_string(),
            ]);
            let scheduler = run(vec![
                "get".into(),
                "pod".into(),
                format!("good{i}"),
                "-o".into(),
                "jsonpath={.spec.schedulerName}".into(),
            ]);
            (created, refused, scheduler)
        })
        .await
        .expect("kubectl thread");
        assert!(
            created.status.success(),
            "{}",
            crate::support::stderr(&created)
        );
        assert_eq!(crate::support::stdout(&scheduler), "gpushare-scheduler");
        assert!(!refused.status.success());
        let err = crate::support::stderr(&refused);
        assert!(
            err.contains("admission webhook \"validate.gpushare.io\" denied the request")
                && err.contains("container \"trainer\"")
                && err.contains("negative"),
            "{err}"
        );
    }
    if ran == 0 {
        crate::support::clients::missing::<()>(
            "kubectl",
            &format!("neither of {KUBECTLS:?} (the Google Cloud SDK's kubectl 1.27 and 1.33)"),
        );
    }
    hook.stop().await;
}

/// Whether the webhook at `addr` presents a certificate that `ca_pem` verifies (as the API
/// server checks it against the caBundle).
async fn verifies(addr: std::net::SocketAddr, ca_pem: &str) -> bool {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()).flatten() {
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return false;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let Ok(builder) =
        rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()
    else {
        return false;
    };
    let config = builder.with_root_certificates(roots).with_no_client_auth();
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let Ok(name) = ServerName::try_from(DNS) else {
        return false;
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .is_ok()
}

/// The Secret is deleted under two replicas: the one that re-creates it must not drop the CA
/// the other still serves with (its next look at the Secret is a whole refresh period away):
/// every caBundle verifies both replicas throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_secret_re_created_under_two_replicas_keeps_every_served_ca_trusted() {
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    let slow = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    let fast = self_signed(&api, Duration::from_millis(50)).await;
    let before = text(&secret_of(&api), KEY_CA_CRT);
    for bundle in ca_bundles(&api) {
        assert!(verifies(slow.addr, &bundle).await && verifies(fast.addr, &bundle).await);
    }
    let rv = secret_of(&api).metadata.resource_version;
    api.delete_object("secrets", Some("kube-system"), "gpushare-webhook-tls")
        .expect("Secret deleted");
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let again = api.get_as::<Secret>("secrets", Some("kube-system"), "gpushare-webhook-tls");
        if again.is_some_and(|s| s.metadata.resource_version != rv) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the Secret was never re-created"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the fast replica finish its round (the caBundles follow the Secret).
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    let after = text(&secret_of(&api), KEY_CA_CRT);
    loop {
        let bundles = ca_bundles(&api);
        let follows = bundles.iter().all(|b| {
            certs::pem_certs("ca", &after)
                .map(|want| {
                    want.iter()
                        .all(|c| certs::pem_certs("bundle", b).is_ok_and(|have| have.contains(c)))
                })
                .unwrap_or(false)
        });
        if follows {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the caBundles never followed the Secret"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for bundle in ca_bundles(&api) {
        assert!(
            verifies(fast.addr, &bundle).await,
            "the re-creating replica is not trusted"
        );
        assert!(
            verifies(slow.addr, &bundle).await,
            "the caBundle dropped the CA the other replica serves with (before: {}, after: {})",
            before.len(),
            after.len()
        );
    }
    slow.stop().await;
    fast.stop().await;
}

/// A replica that starts while the Secret is missing issues a new CA; the caBundle it writes
/// keeps the CA the running replica still serves with (a union, with a retention), so the
/// running replica stays trusted until it picks the new Secret up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_replica_re_creating_the_secret_keeps_the_running_replicas_ca() {
    let api = ApiServer::start().await.expect("sandbox");
    webhook_configs(&api);
    let running = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    let old = text(&secret_of(&api), KEY_CA_CRT);
    api.delete_object("secrets", Some("kube-system"), "gpushare-webhook-tls")
        .expect("Secret deleted");
    let fresh = self_signed(&api, webhook::DEFAULT_REFRESH).await;
    let new = text(&secret_of(&api), KEY_CA_CRT);
    assert_ne!(old, new, "the fresh replica issued a CA of its own");
    for bundle in ca_bundles(&api) {
        assert!(verifies(fresh.addr, &bundle).await, "the new CA is trusted");
        assert!(
            verifies(running.addr, &bundle).await,
            "the running replica's CA was dropped from the caBundle"
        );
        assert!(
            bundle.starts_with(new.trim_end()),
            "the Secret's CA comes first"
        );
    }
    running.stop().await;
    fresh.stop().await;
}
