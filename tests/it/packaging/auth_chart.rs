//! Authenticated scheduling in the chart (`extender.tls`, `extender.networkPolicy`), rendered
//! by the real Helm v4 engine (helm-python-sdk, `support::clients::helm_chart`): the
//! certificates Helm makes are used for real (an extender started with the rendered Secret's
//! files answers the scheduler's client certificate, under both names the scheduler calls it
//! by, and refuses a caller without one); both scheduler modes carry the matching `tlsConfig`;
//! cert-manager Certificates carry the usages the handshake needs; the NetworkPolicy admits
//! the scheduler and the other replicas. Without the SDK the tests skip loudly (fail under CI).

use std::path::Path;

use base64::Engine as _;
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::json;
use yaml_serde::Value;

use crate::support::assert_cli_accepts;
use crate::support::clients;
use crate::support::helm_chart::{
    all_documents, check_typed, default_values, merged, render_by_path, strings,
};
use crate::support::https_client::{connector, https_via};
use crate::support::objects::{gpu_node, pending_pod};

fn values(overlay: &str) -> Value {
    merged(
        &default_values(),
        &yaml_serde::from_str(overlay).expect("overlay parses"),
    )
}

/// Every rendered object, templates keyed by full path; `None` without Helm.
fn all_documents_full(values: Value) -> Option<Vec<Value>> {
    Some(
        render_by_path(&values)?
            .iter()
            .flat_map(|(name, text)| crate::support::source_tree::yaml_documents(name, text))
            .collect(),
    )
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// A Secret's `data` decoded, written as files into `dir`; returns each file's text.
fn write_secret(secret: &Value, dir: &Path) -> std::collections::BTreeMap<String, String> {
    std::fs::create_dir_all(dir).expect("mkdir");
    let mut out = std::collections::BTreeMap::new();
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        let b64 = secret["data"][key]
            .as_str()
            .unwrap_or_else(|| panic!("{key} in {:?}", secret["metadata"]["name"]));
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64");
        std::fs::write(dir.join(key), &bytes).expect("write");
        out.insert(
            key.to_string(),
            String::from_utf8(bytes).expect("PEM is text"),
        );
    }
    out
}

/// The one extender entry of a KubeSchedulerConfiguration embedded in ConfigMap `name`.
fn extender_entry(docs: &[Value], name: &str) -> Value {
    let cm = find(docs, "ConfigMap", name);
    let cfg: Value = yaml_serde::from_str(
        cm["data"]["scheduler-config.yaml"]
            .as_str()
            .expect("scheduler-config.yaml"),
    )
    .expect("embedded config parses");
    cfg["extenders"][0].clone()
}

#[test]
fn helm_lint_strict_is_clean_with_authenticated_scheduling() {
    let overlays = [
        "extender: {tls: {enabled: true}, networkPolicy: {enabled: true, schedulerCIDRs: [10.0.0.0/24]}}",
        "extender: {tls: {enabled: true, clientAuth: false, certificates: cert-manager}}",
        "scheduler: {mode: dedicated}\nextender: {tls: {enabled: true, certificates: cert-manager, certManager: {issuerRef: {name: corp-ca, kind: ClusterIssuer}}}, networkPolicy: {enabled: true, extraFrom: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]}}",
    ];
    let lints: Vec<serde_json::Value> = overlays
        .iter()
        .map(|o| serde_json::to_value(values(o)).expect("json"))
        .collect();
    let Some(answer) = clients::helm_chart(&json!({
        "chart": crate::support::source_tree::repo_path("packaging/helm/gpushare"),
        "release": "gpushare",
        "namespace": "kube-system",
        "lints": lints,
    })) else {
        return;
    };
    for (overlay, report) in overlays
        .iter()
        .zip(answer["lints"].as_array().expect("lints"))
    {
        assert_eq!(report["errors"], json!([]), "{overlay}: {report}");
        let findings: Vec<&serde_json::Value> = report["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["severity"].as_u64().unwrap_or(3) >= 2)
            .collect();
        assert!(findings.is_empty(), "{overlay}: {findings:?}");
    }
}

#[test]
fn by_default_nothing_of_it_is_rendered() {
    let Some(docs) = all_documents(default_values()) else {
        return;
    };
    assert!(
        !docs
            .iter()
            .any(|d| d["kind"] == "Secret" || d["kind"] == "NetworkPolicy"),
        "the default render holds TLS or NetworkPolicy objects"
    );
    let e = extender_entry(&docs, "gpushare-scheduler-config");
    assert_eq!(e["enableHTTPS"], false);
    assert!(e.get("tlsConfig").is_none(), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_certificates_authenticate_the_scheduler_to_the_extender() {
    let Some(docs) = all_documents(values("extender: {tls: {enabled: true}}")) else {
        return;
    };
    // The extender's side: the Secret mounted where the flags point, HTTPS probes.
    let deployment = find(&docs, "Deployment", "gpushare-schd-extender");
    check_typed(deployment).expect("a valid Deployment");
    let pod_spec = &deployment["spec"]["template"]["spec"];
    let container = &pod_spec["containers"][0];
    let args = strings(&container["args"]);
    for flag in [
        "--tls-cert=/etc/gpushare/tls/tls.crt",
        "--tls-key=/etc/gpushare/tls/tls.key",
        "--tls-client-ca=/etc/gpushare/tls/ca.crt",
    ] {
        assert!(args.iter().any(|a| a == flag), "{flag} not in {args:?}");
    }
    assert_cli_accepts(&args, "extender with tls");
    let named = |list: &Value, name: &str| {
        list.as_sequence()
            .and_then(|l| l.iter().find(|v| v["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {list:?}"))
    };
    assert_eq!(
        named(&container["volumeMounts"], "tls")["mountPath"],
        "/etc/gpushare/tls"
    );
    assert_eq!(
        named(&pod_spec["volumes"], "tls")["secret"]["secretName"],
        "gpushare-schd-extender-tls"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(container[probe]["httpGet"]["scheme"], "HTTPS", "{probe}");
    }
    // The scheduler's side (kubeadm): https to the NodePort, the client Secret's files.
    let e = extender_entry(&docs, "gpushare-scheduler-config");
    assert_eq!(e["urlPrefix"], "https://127.0.0.1:32766/gpushare-scheduler");
    assert_eq!(e["enableHTTPS"], true);
    let dir = "/etc/kubernetes/gpushare/extender-client";
    assert_eq!(e["tlsConfig"]["caFile"], format!("{dir}/ca.crt"));
    assert_eq!(e["tlsConfig"]["certFile"], format!("{dir}/tls.crt"));
    assert_eq!(e["tlsConfig"]["keyFile"], format!("{dir}/tls.key"));

    // The certificates themselves, used for real.
    let tmp = tempfile::tempdir().expect("tempdir");
    let server = write_secret(
        find(&docs, "Secret", "gpushare-schd-extender-tls"),
        &tmp.path().join("server"),
    );
    let client = write_secret(
        find(&docs, "Secret", "gpushare-scheduler-client-tls"),
        &tmp.path().join("client"),
    );
    let api = ApiServer::start().await.expect("sandbox API server");
    api.create_object(gpu_node("n1", 1, 16)).expect("node");
    api.create_object(pending_pod("p1", "4")).expect("pod");
    let mut config = gpushare::config::Config::default();
    config.doctor.skip = true;
    config.extender.bind_address = [127, 0, 0, 1].into();
    config.extender.port = 0;
    let file = |name: &str| tmp.path().join("server").join(name).display().to_string();
    config.extender.tls_cert = file("tls.crt");
    config.extender.tls_key = file("tls.key");
    config.extender.tls_client_ca = file("ca.crt");
    let ext = gpushare::extender::start(&config, api.admin_client(), Shutdown::never())
        .await
        .expect("the extender takes the chart's certificates");
    ext.wait_ready().await.expect("ready");
    let scheduler = || {
        connector(
            &client["ca.crt"],
            Some((client["tls.crt"].as_str(), client["tls.key"].as_str())),
        )
    };
    let path = "/gpushare-scheduler/inspect";
    for name in ["127.0.0.1", "gpushare-schd-extender.kube-system.svc"] {
        let got = https_via(scheduler(), name, ext.addr, "GET", path, "").await;
        assert_eq!(got.as_ref().map(|r| r.0), Ok(200), "as {name}: {got:?}");
    }
    let anonymous = connector(&server["ca.crt"], None);
    let got = https_via(anonymous, "127.0.0.1", ext.addr, "GET", path, "").await;
    assert_eq!(got.as_ref().map(|r| r.0), Ok(403), "{got:?}");
    ext.stop().await;
    api.shutdown().await;
}

#[test]
fn the_dedicated_scheduler_mounts_and_presents_the_client_certificate() {
    let Some(docs) = all_documents_full(values(
        "scheduler: {mode: dedicated}\nextender: {tls: {enabled: true}}",
    )) else {
        return;
    };
    let e = extender_entry(&docs, "gpushare-scheduler");
    assert_eq!(
        e["urlPrefix"],
        "https://gpushare-schd-extender.kube-system.svc:12345/gpushare-scheduler"
    );
    assert_eq!(e["enableHTTPS"], true);
    let scheduler = find(&docs, "Deployment", "gpushare-scheduler");
    check_typed(scheduler).expect("a valid Deployment");
    let spec = &scheduler["spec"]["template"]["spec"];
    let mount = spec["containers"][0]["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "extender-client-tls")
        .expect("the client certificate is mounted")
        .clone();
    let volume = spec["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "extender-client-tls")
        .expect("its volume")
        .clone();
    assert_eq!(
        volume["secret"]["secretName"],
        "gpushare-scheduler-client-tls"
    );
    let dir = mount["mountPath"].as_str().expect("mountPath");
    for (key, file) in [
        ("caFile", "ca.crt"),
        ("certFile", "tls.crt"),
        ("keyFile", "tls.key"),
    ] {
        assert_eq!(e["tlsConfig"][key], format!("{dir}/{file}"), "{key}");
    }
    // Not inside another mount (a Secret cannot be mounted into a read-only ConfigMap volume).
    for m in spec["containers"][0]["volumeMounts"]
        .as_sequence()
        .expect("mounts")
    {
        let other = m["mountPath"].as_str().unwrap_or_default();
        assert!(
            other == dir || !dir.starts_with(&format!("{other}/")),
            "{dir} lies inside {other}"
        );
    }
}

#[test]
fn cert_manager_certificates_carry_the_usages_the_handshake_needs() {
    let Some(docs) = all_documents(values(
        "extender: {tls: {enabled: true, certificates: cert-manager}}",
    )) else {
        return;
    };
    let server = find(&docs, "Certificate", "gpushare-schd-extender-tls");
    let usages = strings(&server["spec"]["usages"]);
    assert!(
        usages.contains(&"server auth".to_string()) && usages.contains(&"client auth".to_string()),
        "the serving certificate is also the replicas' client certificate: {usages:?}"
    );
    assert!(
        strings(&server["spec"]["dnsNames"])
            .contains(&"gpushare-schd-extender.kube-system.svc".to_string())
    );
    assert_eq!(strings(&server["spec"]["ipAddresses"]), ["127.0.0.1"]);
    let client = find(&docs, "Certificate", "gpushare-scheduler-client-tls");
    assert!(strings(&client["spec"]["usages"]).contains(&"client auth".to_string()));
    // Without an issuerRef the chart's own CA signs both, from a self-signed root.
    assert_eq!(server["spec"]["issuerRef"]["name"], "gpushare-extender-ca");
    let ca = find(&docs, "Certificate", "gpushare-extender-ca");
    assert_eq!(ca["spec"]["isCA"], true);
    find(&docs, "Issuer", "gpushare-extender-ca");
    assert!(
        !docs.iter().any(|d| d["kind"] == "Secret"),
        "no Helm-made Secret"
    );

    let Some(docs) = all_documents(values(
        "extender: {tls: {enabled: true, certificates: cert-manager, certManager: {issuerRef: {name: corp-ca, kind: ClusterIssuer}}}}",
    )) else {
        return;
    };
    let server = find(&docs, "Certificate", "gpushare-schd-extender-tls");
    assert_eq!(server["spec"]["issuerRef"]["name"], "corp-ca");
    assert_eq!(server["spec"]["issuerRef"]["kind"], "ClusterIssuer");
    assert!(
        !docs.iter().any(|d| d["kind"] == "Issuer"),
        "no Issuer of ours"
    );
}

#[test]
fn the_network_policy_admits_the_scheduler_and_the_other_replicas() {
    for (overlay, scheduler_pods) in [
        (
            "extender: {networkPolicy: {enabled: true, schedulerCIDRs: [10.0.0.0/24, 10.0.1.5/32], extraFrom: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]}}",
            false,
        ),
        (
            "scheduler: {mode: dedicated}\nextender: {networkPolicy: {enabled: true}}",
            true,
        ),
    ] {
        let Some(docs) = all_documents_full(values(overlay)) else {
            return;
        };
        let np = find(&docs, "NetworkPolicy", "gpushare-schd-extender");
        let typed: NetworkPolicy = yaml_serde::from_value(np.clone()).expect("a NetworkPolicy");
        let back = serde_json::to_value(&typed).expect("json");
        assert_eq!(back, serde_json::to_value(np).expect("json"), "{overlay}");
        let spec = typed.spec.expect("spec");
        assert_eq!(
            spec.pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .map(|l| l["component"].as_str()),
            Some("gpushare-schd-extender")
        );
        let rules = spec.ingress.expect("ingress");
        assert_eq!(rules.len(), 1);
        let port = &rules[0].ports.as_ref().expect("ports")[0];
        assert_eq!(
            port.port,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(12345))
        );
        let from = rules[0].from.as_ref().expect("from");
        let component = |p: &k8s_openapi::api::networking::v1::NetworkPolicyPeer| {
            p.pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .and_then(|l| l.get("component").cloned())
        };
        assert!(
            from.iter()
                .any(|p| component(p).as_deref() == Some("gpushare-schd-extender")),
            "{overlay}: the replicas must reach each other (forwarding)"
        );
        assert_eq!(
            from.iter()
                .any(|p| component(p).as_deref() == Some("gpushare-scheduler")),
            scheduler_pods,
            "{overlay}"
        );
        if !scheduler_pods {
            let cidrs: Vec<String> = from
                .iter()
                .filter_map(|p| p.ip_block.as_ref().map(|b| b.cidr.clone()))
                .collect();
            assert_eq!(cidrs, ["10.0.0.0/24", "10.0.1.5/32"]);
            assert!(from.iter().any(|p| p.namespace_selector.is_some()));
        }
    }
}
