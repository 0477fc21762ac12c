//! `gpushare demo --managed`: the managed-cluster install (EKS, GKE, AKS, ACK) in the sandbox.
//! The sandbox API server holds both webhook configurations as the chart writes them;
//! `gpushare webhook --self-signed` (in-process) creates its CA and Secret and writes the
//! caBundle; then pods are created through the API as `kubectl apply` would, and the sandbox
//! calls the webhook as kube-apiserver does: a gpu-mem pod gets `schedulerName:
//! gpushare-scheduler`, a plain pod is untouched, a malformed request is refused with the fix.
//! `doctor`'s managed checks close the tour.
//!
//! The scheduler itself is not played here (the default demo plays it): only what a managed
//! cluster adds.

use std::io::Write;

use anyhow::Context;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::DemoOutcome;
use crate::config::Config;
use crate::doctor::report::Status;
use crate::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;

const NAMESPACE: &str = "kube-system";
const SERVICE: &str = "gpushare-webhook";

fn webhook_configuration(kind: &str, name: &str, path: &str) -> Value {
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
        "metadata": { "name": SERVICE },
        "webhooks": [{
            "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
            "timeoutSeconds": 5, "failurePolicy": "Fail",
            "clientConfig": { "service": { "namespace": NAMESPACE, "name": SERVICE, "path": path, "port": 443 } },
            "namespaceSelector": { "matchExpressions": [
                { "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE] },
                { "key": "gpushare.io/webhook", "operator": "NotIn", "values": ["disabled"] },
            ]},
            "rules": [{ "operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                        "resources": ["pods"], "scope": "Namespaced" }],
        }],
    })
}

fn pod(name: &str, resources: Value) -> anyhow::Result<Pod> {
    Ok(crate::k8s::decode::from_value(&json!({
        "metadata": { "name": name },
        "spec": { "containers": [{ "name": "main", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
                                   "resources": resources }] },
    }))?)
}

/// Runs the managed tour, writing it to `out`.
pub async fn run_managed_scenario(out: &mut dyn Write) -> anyhow::Result<DemoOutcome> {
    let mut outcome = DemoOutcome::default();
    writeln!(
        out,
        "gpushare demo --managed — a control plane you cannot edit: a dedicated scheduler and gpushare webhook\n"
    )?;
    let api = ApiServer::start()
        .await
        .context("starting the sandbox API server")?;
    for (kind, name, path) in [
        (
            "MutatingWebhookConfiguration",
            "mutate.gpushare.io",
            "/mutate",
        ),
        (
            "ValidatingWebhookConfiguration",
            "validate.gpushare.io",
            "/validate",
        ),
    ] {
        api.create_object(webhook_configuration(kind, name, path))?;
    }
    writeln!(
        out,
        "▸ sandbox API server on {} with the chart's Mutating- and ValidatingWebhookConfiguration {SERVICE} (no caBundle yet)",
        api.url()
    )?;

    let mut config = Config::default();
    config.webhook.bind_address = std::net::IpAddr::from([127, 0, 0, 1]);
    config.webhook.port = 0;
    config.webhook.self_signed = true;
    config.webhook.namespace = NAMESPACE.to_string();
    config.cluster.kubeconfig = api.admin_kubeconfig_path().display().to_string();
    let hook = crate::webhook::start(
        &config,
        Some(api.admin_client()),
        crate::webhook::DEFAULT_REFRESH,
        Shutdown::never(),
    )
    .await
    .context("starting gpushare webhook")?;
    api.route_service(NAMESPACE, SERVICE, hook.addr);
    writeln!(
        out,
        "▸ gpushare webhook --self-signed on https://{} (Service {NAMESPACE}/{SERVICE})",
        hook.addr
    )?;
    expect_tls_written(&api, &config, &mut outcome, out);

    let pods: Api<Pod> = Api::namespaced(api.admin_client(), "default");
    expect_pods_routed(&pods, &config, &mut outcome, out).await?;
    expect_sloppy_refused(&pods, &mut outcome, out).await?;

    writeln!(
        out,
        "\n▸ gpushare doctor --role control-plane, webhook checks (dedicated-scheduler needs a \
         running kube-scheduler, which the sandbox does not have)"
    )?;
    let checks = crate::doctor::managed::checks(
        &crate::doctor::cluster::connect(&config, false).await,
        &config.webhook,
        Some(&format!("https://127.0.0.1:{}", hook.addr.port())),
    )
    .await;
    for c in checks.iter().filter(|c| c.id != "dedicated-scheduler") {
        writeln!(
            out,
            "  {:<20} {:?}: {}",
            c.id,
            c.status,
            c.detail.lines().next().unwrap_or("")
        )?;
    }
    let endpoint_ok = checks
        .iter()
        .any(|c| c.id == "webhook-endpoint" && c.status == Status::Ok);
    outcome.expect(
        out,
        "doctor verifies the served certificate against the caBundle",
        endpoint_ok,
        format!("{checks:?}"),
    );
    hook.stop().await;
    api.shutdown().await;
    Ok(outcome)
}

/// The `--self-signed` bootstrap's results in the API: the Secret with the CA and the
/// serving certificate, the caBundle of both webhook configurations.
fn expect_tls_written(
    api: &ApiServer,
    config: &Config,
    outcome: &mut DemoOutcome,
    out: &mut dyn Write,
) {
    let secret = api.get_object("secrets", Some(NAMESPACE), &config.webhook.tls_secret);
    outcome.expect(
        out,
        &format!(
            "Secret {NAMESPACE}/{} holds the CA and the serving certificate",
            config.webhook.tls_secret
        ),
        secret.as_ref().is_some_and(|s| {
            ["ca.crt", "ca.key", "tls.crt", "tls.key"]
                .iter()
                .all(|k| s["data"][k].is_string())
        }),
        "the Secret is missing or incomplete".to_string(),
    );
    let bundles: Vec<bool> = [
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
    ]
    .iter()
    .map(|r| {
        api.get_object(r, None, SERVICE).is_some_and(|c| {
            c["webhooks"][0]["clientConfig"]["caBundle"]
                .as_str()
                .is_some_and(|b| !b.is_empty())
        })
    })
    .collect();
    outcome.expect(
        out,
        "the caBundle of both configurations is written",
        bundles.iter().all(|b| *b),
        format!("written: {bundles:?}"),
    );
}

/// A gpu-mem pod goes to the dedicated scheduler; a pod without GPU is left alone.
async fn expect_pods_routed(
    pods: &Api<Pod>,
    config: &Config,
    outcome: &mut DemoOutcome,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "\n▸ kubectl apply: pod trainer, limits aliyun.com/gpu-mem: 4"
    )?;
    let created = pods
        .create(
            &PostParams::default(),
            &pod(
                "trainer",
                json!({ "limits": { "aliyun.com/gpu-mem": "4" } }),
            )?,
        )
        .await;
    let scheduler = created
        .as_ref()
        .ok()
        .and_then(|p| p.spec.as_ref())
        .and_then(|s| s.scheduler_name.clone())
        .unwrap_or_default();
    writeln!(out, "  stored with spec.schedulerName: {scheduler}")?;
    outcome.expect(
        out,
        "the webhook sent the gpu-mem pod to gpushare-scheduler",
        scheduler == config.webhook.scheduler_name,
        format!(
            "schedulerName {scheduler:?}, create result {:?}",
            created.err()
        ),
    );

    writeln!(out, "\n▸ kubectl apply: pod web, no GPU")?;
    let created = pods
        .create(&PostParams::default(), &pod("web", json!({}))?)
        .await;
    let untouched = created.as_ref().is_ok_and(|p| {
        p.spec
            .as_ref()
            .and_then(|s| s.scheduler_name.as_ref())
            .is_none()
    });
    writeln!(out, "  stored unchanged (the default scheduler places it)")?;
    outcome.expect(
        out,
        "a pod without gpu-mem is left alone",
        untouched,
        format!("{created:?}"),
    );
    Ok(())
}

/// A pod whose gpu-mem request differs from its limit is refused, naming the container and
/// the fix.
async fn expect_sloppy_refused(
    pods: &Api<Pod>,
    outcome: &mut DemoOutcome,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "\n▸ kubectl apply: pod sloppy, requests aliyun.com/gpu-mem: 2, limits aliyun.com/gpu-mem: 4"
    )?;
    let refused = pods
        .create(
            &PostParams::default(),
            &pod(
                "sloppy",
                json!({ "limits": { "aliyun.com/gpu-mem": "4" }, "requests": { "aliyun.com/gpu-mem": "2" } }),
            )?,
        )
        .await;
    let message = match &refused {
        Err(kube::Error::Api(status)) => status.message.clone(),
        other => format!("not refused: {other:?}"),
    };
    writeln!(out, "  Error from server: {message}")?;
    outcome.expect(
        out,
        "the malformed request is refused, naming the container and the fix",
        refused.is_err() && message.contains("\"main\"") && message.contains("limits"),
        message.clone(),
    );
    Ok(())
}
