//! `doctor --role control-plane` on managed clusters: the dedicated scheduler and the webhook
//! checks over fixtures in the sandbox API server, with a real `gpushare webhook` serving.

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use gpushare::config::Config;
use gpushare::doctor::report::{Check, Status};
use gpushare::shutdown::Shutdown;
use gpushare::webhook;
use gpushare_sandbox::apiserver::ApiServer;

use crate::support::doctor_node::control_plane_checks;
use crate::support::fixture;

fn seed(api: &ApiServer, name: &str) {
    let text =
        std::fs::read_to_string(fixture(&format!("doctor/managed/{name}"))).expect("fixture");
    api.seed_yaml(&text).expect("seeded");
}

async fn managed_checks(api: &ApiServer, webhook_url: Option<String>) -> Vec<Check> {
    control_plane_checks(api, webhook_url)
        .await
        .into_iter()
        .filter(|c| ["dedicated-scheduler", "webhook-config", "webhook-endpoint"].contains(&c.id))
        .collect()
}

fn by_id<'a>(checks: &'a [Check], id: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no check {id}: {checks:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extender_mode_skips_the_managed_checks() {
    let api = ApiServer::start().await.expect("sandbox");
    let checks = managed_checks(&api, None).await;
    assert_eq!(checks.len(), 3);
    assert!(
        checks.iter().all(|c| c.status == Status::Skip),
        "{checks:#?}"
    );
    assert!(checks[0].detail.contains("scheduler.mode is extender"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_dedicated_scheduler_is_named_with_a_fix() {
    let api = ApiServer::start().await.expect("sandbox");
    seed(&api, "broken-scheduler.yaml");
    seed(&api, "webhook-configurations.yaml");
    let checks = managed_checks(&api, None).await;
    let sched = by_id(&checks, "dedicated-scheduler");
    assert_eq!(sched.status, Status::Fail, "{sched:#?}");
    for needle in [
        "0/2 replicas ready",
        "no profile named \"gpushare-scheduler\"",
        "no extender manages aliyun.com/gpu-mem",
    ] {
        assert!(sched.detail.contains(needle), "{needle}: {}", sched.detail);
    }
    assert!(
        sched
            .hint
            .contains("kubectl -n kube-system logs deployment/gpushare-scheduler"),
        "{}",
        sched.hint
    );
    // No caBundle yet: the configuration check says so, the endpoint check has nothing to verify.
    let cfg = by_id(&checks, "webhook-config");
    assert_eq!(cfg.status, Status::Fail);
    assert!(cfg.detail.contains("empty caBundle"), "{}", cfg.detail);
    assert_eq!(by_id(&checks, "webhook-endpoint").status, Status::Skip);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sound_managed_install_passes_and_a_stale_ca_bundle_fails() {
    let api = ApiServer::start().await.expect("sandbox");
    seed(&api, "dedicated-scheduler.yaml");
    seed(&api, "webhook-configurations.yaml");
    let mut config = Config::default();
    config.webhook.bind_address = [127, 0, 0, 1].into();
    config.webhook.port = 0;
    config.webhook.self_signed = true;
    let hook = webhook::start(
        &config,
        Some(api.admin_client()),
        webhook::DEFAULT_REFRESH,
        Shutdown::never(),
    )
    .await
    .expect("webhook starts");
    let url = format!("https://127.0.0.1:{}", hook.addr.port());
    let checks = managed_checks(&api, Some(url.clone())).await;
    for c in &checks {
        assert_eq!(c.status, Status::Ok, "{c:#?}");
    }
    assert!(
        by_id(&checks, "dedicated-scheduler")
            .detail
            .contains("2/2 replicas ready")
    );

    // Someone pastes another CA into both configurations: the API server could not call the
    // webhook any more, and doctor says so.
    let now = std::time::SystemTime::now();
    let other = gpushare::webhook::certs::issue_ca(now, Duration::from_secs(86_400)).expect("CA");
    let b64 = base64::engine::general_purpose::STANDARD.encode(&other.cert);
    for resource in [
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
    ] {
        let mut obj: Value = api
            .get_object(resource, None, "gpushare-webhook")
            .expect("config");
        obj["webhooks"][0]["clientConfig"]["caBundle"] = json!(b64);
        api.delete_object(resource, None, "gpushare-webhook")
            .expect("delete");
        if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("resourceVersion");
        }
        api.create_object(obj).expect("recreate");
    }
    let checks = managed_checks(&api, Some(url)).await;
    let endpoint = by_id(&checks, "webhook-endpoint");
    assert_eq!(endpoint.status, Status::Fail, "{endpoint:#?}");
    assert!(
        endpoint
            .detail
            .contains("does not verify against the caBundle"),
        "{}",
        endpoint.detail
    );
    assert!(
        endpoint
            .hint
            .contains("rollout restart deployment/gpushare-webhook"),
        "{}",
        endpoint.hint
    );
    // Unreachable (outside the cluster): a warning that says how to port-forward.
    hook.stop().await;
    let checks = managed_checks(&api, None).await;
    let endpoint = by_id(&checks, "webhook-endpoint");
    assert_eq!(endpoint.status, Status::Warn, "{endpoint:#?}");
    assert!(endpoint.hint.contains("port-forward"), "{}", endpoint.hint);
}
