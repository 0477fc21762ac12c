//! Authenticated scheduling over real HTTPS (`extender.tls_client_ca`): the scheduling verbs
//! and `/inspect` need a client certificate the CA signed; `/healthz`, `/readyz`, `/version`
//! and `/metrics` stay open; a certificate of another CA is refused in the handshake; the CA
//! file is read again when it changes; a standby forwards to the leader with the replicas'
//! shared serving certificate; `gpushare inspect --from-extender https://…` presents one.
//!
//! Certificates are made here with rcgen. No sleeps as synchronisation: a changed CA is
//! waited for by polling against a deadline.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use gpushare::config::Config;
use gpushare::extender::{ExtenderHandle, StartOptions};
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{Value, json};

use crate::support::doctor_node::doctor_no_cluster;
use crate::support::https_client::{connector, https_via};
use crate::support::objects::{gpu_node, pending_pod};
use crate::support::wait::{DEADLINE, poll, wait_until};

/// A CA: its PEM and what signs with it.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A leaf certificate and key, PEM.
struct Leaf {
    cert: String,
    key: String,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).expect("CA");
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

fn leaf(ca: &Ca, cn: &str, sans: &[&str], usages: &[ExtendedKeyUsagePurpose]) -> Leaf {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("params");
    params.distinguished_name.push(DnType::CommonName, cn);
    params.extended_key_usages = usages.to_vec();
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let cert = params.signed_by(&key, &ca.issuer).expect("leaf");
    Leaf {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// The scheduler's client certificate (EKU clientAuth, as kubeadm's and cert-manager's are).
fn client(ca: &Ca, cn: &str) -> Leaf {
    leaf(ca, cn, &[], &[ExtendedKeyUsagePurpose::ClientAuth])
}

/// The PKI of one test: the serving CA and certificate (server and client auth: replicas
/// present it to each other) and the client CA's file.
struct Pki {
    dir: tempfile::TempDir,
    serving_ca: Ca,
    client_ca: Ca,
}

impl Pki {
    fn new() -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().expect("tempdir"),
            serving_ca: ca("extender-serving-ca"),
            client_ca: ca("scheduler-client-ca"),
        };
        let serving = leaf(
            &pki.serving_ca,
            "gpushare-schd-extender",
            &["127.0.0.1", "localhost"],
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        std::fs::write(pki.path("tls.crt"), &serving.cert).expect("write");
        std::fs::write(pki.path("tls.key"), &serving.key).expect("write");
        std::fs::write(pki.path("serving-ca.crt"), &pki.serving_ca.pem).expect("write");
        std::fs::write(pki.path("client-ca.crt"), &pki.client_ca.pem).expect("write");
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write_leaf(&self, name: &str, l: &Leaf) -> (PathBuf, PathBuf) {
        let (c, k) = (
            self.path(&format!("{name}.crt")),
            self.path(&format!("{name}.key")),
        );
        std::fs::write(&c, &l.cert).expect("write");
        std::fs::write(&k, &l.key).expect("write");
        (c, k)
    }

    fn config(&self, leader_elect: bool) -> Config {
        let mut c = crate::support::extender_cluster::extender_config(leader_elect);
        c.doctor.skip = true;
        c.extender.tls_cert = self.path("tls.crt").display().to_string();
        c.extender.tls_key = self.path("tls.key").display().to_string();
        c.extender.tls_client_ca = self.path("client-ca.crt").display().to_string();
        c
    }

    fn connector(&self, client: Option<&Leaf>) -> tokio_rustls::TlsConnector {
        connector(
            &self.serving_ca.pem,
            client.map(|l| (l.cert.as_str(), l.key.as_str())),
        )
    }
}

/// One HTTPS request on a fresh connection as `client` (none: no certificate): the status and
/// body, or `Err` when the TLS handshake or the connection failed (a refused certificate).
async fn https(
    pki: &Pki,
    addr: SocketAddr,
    client: Option<&Leaf>,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    https_via(pki.connector(client), "127.0.0.1", addr, method, path, body).await
}

fn filter_args(api: &ApiServer, name: &str) -> String {
    let pod = api
        .get_object("pods", Some("default"), name)
        .expect("pod exists");
    json!({"Pod": pod, "NodeNames": ["n1"]}).to_string()
}

fn bind_args(api: &ApiServer, name: &str) -> String {
    let uid = api
        .get_object("pods", Some("default"), name)
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_string))
        .unwrap_or_default();
    json!({"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": "n1"}).to_string()
}

async fn start(api: &ApiServer, config: &Config, refresh: Option<Duration>) -> ExtenderHandle {
    let options = StartOptions {
        tls_refresh: refresh,
        ..Default::default()
    };
    let ext =
        gpushare::extender::start_with(config, api.admin_client(), Shutdown::never(), options)
            .await
            .expect("extender starts");
    if !config.extender.leader_elect {
        ext.wait_ready().await.expect("extender ready");
    }
    ext
}

async fn sandbox() -> ApiServer {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.create_object(gpu_node("n1", 2, 16)).expect("node");
    api.create_object(pending_pod("p1", "4")).expect("pod");
    api.create_object(pending_pod("p2", "4")).expect("pod");
    api
}

const PROTECTED: &[(&str, &str)] = &[
    ("POST", "/gpushare-scheduler/filter"),
    ("POST", "/gpushare-scheduler/prioritize"),
    ("POST", "/gpushare-scheduler/bind"),
    ("GET", "/gpushare-scheduler/inspect"),
    ("GET", "/gpushare-scheduler/inspect/n1"),
];
const OPEN: &[&str] = &["/healthz", "/readyz", "/version", "/metrics"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduling_verbs_and_inspect_need_a_certificate_of_the_client_ca() {
    let pki = Pki::new();
    let api = sandbox().await;
    let ext = start(&api, &pki.config(false), None).await;
    let scheduler = client(&pki.client_ca, "kube-scheduler");
    let stranger_ca = ca("somebody-else");
    let stranger = client(&stranger_ca, "kube-scheduler");

    // No certificate: 403 with a JSON error on every protected path; nothing is bound.
    for (method, path) in PROTECTED {
        let body = if path.ends_with("bind") {
            bind_args(&api, "p1")
        } else {
            filter_args(&api, "p1")
        };
        let (status, text) = https(&pki, ext.addr, None, method, path, &body)
            .await
            .expect("an HTTP answer");
        assert_eq!(status, 403, "{method} {path}: {text}");
        let error: Value = serde_json::from_str(&text).expect("JSON error");
        assert!(
            error["Error"]
                .as_str()
                .is_some_and(|e| e.contains("client certificate")),
            "{text}"
        );
    }
    let p1 = api.get_object("pods", Some("default"), "p1").expect("pod");
    assert!(
        p1["spec"]["nodeName"].is_null(),
        "an unauthenticated bind bound {p1}"
    );

    // ... while probes and Prometheus still get through without one.
    for path in OPEN {
        let (status, text) = https(&pki, ext.addr, None, "GET", path, "")
            .await
            .expect("an HTTP answer");
        assert_eq!(status, 200, "{path}: {text}");
    }
    let (_, metrics) = https(&pki, ext.addr, None, "GET", "/metrics", "")
        .await
        .expect("metrics");
    assert!(
        metrics.contains("outcome=\"unauthenticated\""),
        "the refusals are counted: {metrics}"
    );

    // A certificate of another CA does not get past the handshake, whatever the path.
    for path in ["/gpushare-scheduler/filter", "/healthz"] {
        let got = https(
            &pki,
            ext.addr,
            Some(&stranger),
            "POST",
            path,
            &filter_args(&api, "p1"),
        )
        .await;
        assert!(got.is_err(), "{path} answered a stranger: {got:?}");
    }

    // The scheduler's certificate: every verb answers, the bind lands.
    let (status, text) = https(
        &pki,
        ext.addr,
        Some(&scheduler),
        "POST",
        "/gpushare-scheduler/filter",
        &filter_args(&api, "p1"),
    )
    .await
    .expect("filter");
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).expect("filter JSON");
    assert_eq!(answer["NodeNames"], json!(["n1"]), "{text}");
    let (status, text) = https(
        &pki,
        ext.addr,
        Some(&scheduler),
        "POST",
        "/gpushare-scheduler/bind",
        &bind_args(&api, "p1"),
    )
    .await
    .expect("bind");
    assert_eq!(status, 200, "{text}");
    let p1 = api.get_object("pods", Some("default"), "p1").expect("pod");
    assert_eq!(p1["spec"]["nodeName"], json!("n1"), "{p1}");
    let (status, text) = https(
        &pki,
        ext.addr,
        Some(&scheduler),
        "GET",
        "/gpushare-scheduler/inspect",
        "",
    )
    .await
    .expect("inspect");
    assert_eq!(status, 200, "{text}");
    ext.stop().await;
}

/// Bumps a file's modification time well past its last one (filesystems with a coarse clock
/// would otherwise show no change for a rewrite within the same tick).
fn touch_later(path: &Path) {
    let file = std::fs::File::options()
        .write(true)
        .open(path)
        .expect("open");
    file.set_modified(SystemTime::now() + Duration::from_secs(5))
        .expect("set mtime");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_client_ca_is_used_without_a_restart() {
    let pki = Pki::new();
    let api = sandbox().await;
    let ext = start(&api, &pki.config(false), Some(Duration::from_millis(50))).await;
    let old = client(&pki.client_ca, "old-scheduler");
    let next_ca = ca("rotated-client-ca");
    let new = client(&next_ca, "new-scheduler");
    let path = "/gpushare-scheduler/inspect";
    assert_eq!(
        https(&pki, ext.addr, Some(&old), "GET", path, "")
            .await
            .map(|r| r.0),
        Ok(200)
    );
    assert!(
        https(&pki, ext.addr, Some(&new), "GET", path, "")
            .await
            .is_err(),
        "the next CA's certificate is not trusted yet"
    );

    // A half-written file is not taken: the old CA stays in force.
    let ca_file = pki.path("client-ca.crt");
    std::fs::write(&ca_file, "-----BEGIN CERTIFICATE-----\ngarbage").expect("write");
    touch_later(&ca_file);
    std::fs::write(&ca_file, &next_ca.pem).expect("write");
    touch_later(&ca_file);
    poll("the rotated CA to be used", DEADLINE, || async {
        match https(&pki, ext.addr, Some(&new), "GET", path, "").await {
            Ok((200, _)) => Ok(()),
            got => Err(got),
        }
    })
    .await;
    assert!(
        https(&pki, ext.addr, Some(&old), "GET", path, "")
            .await
            .is_err(),
        "the replaced CA's certificate is still accepted"
    );
    ext.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_forwards_to_a_leader_that_checks_client_certificates() {
    let pki = Pki::new();
    let api = sandbox().await;
    let config = pki.config(true);
    let a = start(&api, &config, None).await;
    let b = start(&api, &config, None).await;
    // The leader serves once its ledger is synced; the standby then answers /readyz 200
    // only by asking the leader over TLS, with the shared certificate.
    wait_until("a synced leader", || {
        a.state().is_ready() || b.state().is_ready()
    })
    .await;
    let standby = if a.state().is_serving() { &b } else { &a };
    let scheduler = client(&pki.client_ca, "kube-scheduler");
    poll("the standby to become ready", DEADLINE, || async {
        match https(&pki, standby.addr, None, "GET", "/readyz", "").await {
            Ok((200, _)) => Ok(()),
            got => Err(got),
        }
    })
    .await;

    // The scheduler's certificate on the standby: forwarded, answered by the leader.
    let (status, text) = https(
        &pki,
        standby.addr,
        Some(&scheduler),
        "POST",
        "/gpushare-scheduler/bind",
        &bind_args(&api, "p2"),
    )
    .await
    .expect("bind via the standby");
    assert_eq!(status, 200, "{text}");
    let p2 = api.get_object("pods", Some("default"), "p2").expect("pod");
    assert_eq!(p2["spec"]["nodeName"], json!("n1"), "{p2}");

    // Without one the standby refuses itself: nothing reaches the leader.
    let (status, text) = https(
        &pki,
        standby.addr,
        None,
        "POST",
        "/gpushare-scheduler/filter",
        &filter_args(&api, "p1"),
    )
    .await
    .expect("an HTTP answer");
    assert_eq!(status, 403, "{text}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_from_an_https_extender_presents_its_client_certificate() {
    let pki = Pki::new();
    let api = sandbox().await;
    let ext = start(&api, &pki.config(false), None).await;
    let (cert, key) = pki.write_leaf("inspector", &client(&pki.client_ca, "inspector"));
    let url = format!("https://127.0.0.1:{}", ext.addr.port());
    let ca = pki.path("serving-ca.crt");
    let bin = crate::support::bin();
    let args = |with_cert: bool| {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.args(["inspect", "-o", "json", "--from-extender", &url])
            .arg("--extender-ca")
            .arg(&ca);
        if with_cert {
            cmd.arg("--extender-cert")
                .arg(&cert)
                .arg("--extender-key")
                .arg(&key);
        }
        cmd
    };
    let out = args(true).output().await.expect("inspect runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(report["source"], json!("extender"), "{stdout}");
    assert_eq!(report["nodes"][0]["name"], json!("n1"), "{stdout}");

    let out = args(false).output().await.expect("inspect runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("403") && stderr.contains("--extender-cert"),
        "{stderr}"
    );
    ext.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_probes_an_https_extender_and_says_its_certificate_is_not_checked() {
    let pki = Pki::new();
    let api = sandbox().await;
    let ext = start(&api, &pki.config(false), None).await;
    let url = format!("https://127.0.0.1:{}/gpushare-scheduler", ext.addr.port());
    let args = ["-o", "json", "--extender-url", url.as_str()];
    // The binary runs while the extender serves on the other worker.
    let out = tokio::task::block_in_place(|| doctor_no_cluster("control-plane", &args));
    let report: Value = serde_json::from_slice(&out.stdout).expect("doctor's JSON report");
    let check = report["checks"]
        .as_array()
        .and_then(|checks| {
            checks
                .iter()
                .find(|c| c["id"] == json!("extender-reachable"))
        })
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(check["status"], json!("ok"), "{check:#}");
    let detail = check["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("ready") && detail.contains("certificate is not checked"),
        "{check:#}"
    );
    ext.stop().await;
}

/// Rotates the client CA file to `next` and waits until a certificate of `next` is accepted.
async fn rotate_client_ca(pki: &Pki, addr: SocketAddr, next: &Ca) {
    let ca_file = pki.path("client-ca.crt");
    std::fs::write(&ca_file, &next.pem).expect("write");
    touch_later(&ca_file);
    let probe = client(next, "probe");
    let path = "/gpushare-scheduler/inspect";
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        let got = https(pki, addr, Some(&probe), "GET", path, "").await;
        if got.as_ref().map(|r| r.0) == Ok(200) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the rotated CA was never used: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client of a replaced CA that resumes its TLS session (one connector: rustls keeps the
/// session tickets it was given) gets nothing after the rotation: no resumed session outlives
/// the CA that verified its certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_does_not_outlive_a_replaced_client_ca() {
    let pki = Pki::new();
    let api = sandbox().await;
    let ext = start(&api, &pki.config(false), Some(Duration::from_millis(50))).await;
    let old = client(&pki.client_ca, "old-scheduler");
    let resuming = pki.connector(Some(&old));
    let path = "/gpushare-scheduler/inspect";
    for _ in 0..2 {
        let got = https_via(resuming.clone(), "127.0.0.1", ext.addr, "GET", path, "").await;
        assert_eq!(got.map(|r| r.0), Ok(200));
    }
    rotate_client_ca(&pki, ext.addr, &ca("rotated-client-ca")).await;
    for verb in ["GET", "POST"] {
        let (target, body) = if verb == "GET" {
            (path, String::new())
        } else {
            ("/gpushare-scheduler/filter", filter_args(&api, "p1"))
        };
        let got = https_via(resuming.clone(), "127.0.0.1", ext.addr, verb, target, &body).await;
        assert!(
            !matches!(got, Ok((200, _))),
            "{verb} {target}: a session of the replaced CA was resumed: {got:?}"
        );
    }
    ext.stop().await;
}

/// Reads one HTTP/1.1 response (headers and a `Content-Length` body) from `conn`: its status.
async fn read_response<S: tokio::io::AsyncRead + Unpin>(conn: &mut S) -> Option<u16> {
    use tokio::io::AsyncReadExt as _;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let status = head.get(9..12)?.parse().ok()?;
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    conn.read_exact(&mut body).await.ok()?;
    Some(status)
}

/// A connection kept alive across the rotation gets nothing more on the old CA's certificate:
/// the check holds for every request after the rotation, not only for new handshakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_does_not_outlive_a_replaced_client_ca() {
    use tokio::io::AsyncWriteExt as _;
    let pki = Pki::new();
    let api = sandbox().await;
    let ext = start(&api, &pki.config(false), Some(Duration::from_millis(50))).await;
    let old = client(&pki.client_ca, "old-scheduler");
    let tcp = tokio::net::TcpStream::connect(ext.addr)
        .await
        .expect("connect");
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let mut conn = pki
        .connector(Some(&old))
        .connect(name, tcp)
        .await
        .expect("handshake");
    let request = b"GET /gpushare-scheduler/inspect HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    conn.write_all(request).await.expect("write");
    assert_eq!(read_response(&mut conn).await, Some(200));
    rotate_client_ca(&pki, ext.addr, &ca("rotated-client-ca")).await;
    conn.write_all(request).await.expect("write");
    let after = read_response(&mut conn).await;
    assert!(
        after.is_none_or(|s| s == 403),
        "a request on a connection of the replaced CA was served: {after:?}"
    );
    ext.stop().await;
}
