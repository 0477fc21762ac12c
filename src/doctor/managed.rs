//! Control-plane checks of managed clusters (`scheduler.mode: dedicated`): the dedicated
//! kube-scheduler (`dedicated-scheduler`: running, and its KubeSchedulerConfiguration calls
//! our extender for gpu-mem), the webhook configurations (`webhook-config`: both present,
//! pointing at the webhook Service, with a caBundle) and the webhook itself
//! (`webhook-endpoint`: reachable, and the certificate it serves verifies against that
//! caBundle for the Service's name).
//!
//! Only reads. Where neither the dedicated scheduler nor the webhook configurations exist
//! (`scheduler.mode: extender`), every check here is skipped.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;

use super::cluster::{ApiState, REQUEST_TIMEOUT};
use super::report::{Check, Status};
use super::scheduler::{get_ci, manages_gpu_mem};
use crate::config::WebhookConfig;
use crate::core::wire;
use crate::outbound::{self, Identity, TlsOptions, Trust};

/// Deadline of the webhook probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Key of the KubeSchedulerConfiguration in the dedicated scheduler's ConfigMap.
pub(crate) const CONFIG_KEY: &str = "scheduler-config.yaml";

const SCHED_ID: &str = "dedicated-scheduler";
const SCHED_TITLE: &str = "dedicated kube-scheduler runs and calls the extender";
const CONFIG_ID: &str = "webhook-config";
const CONFIG_TITLE: &str = "webhook configurations present, with a caBundle";
const ENDPOINT_ID: &str = "webhook-endpoint";
const ENDPOINT_TITLE: &str = "webhook reachable, serving a certificate its caBundle trusts";

/// Checks a dedicated scheduler's KubeSchedulerConfiguration: profile `scheduler_name`, an
/// extender for `aliyun.com/gpu-mem` with our verbs. Returns the extender URL, or what is
/// wrong.
pub fn evaluate_dedicated_config(text: &str, scheduler_name: &str) -> Result<String, Vec<String>> {
    let doc: yaml_serde::Value =
        yaml_serde::from_str(text).map_err(|e| vec![format!("not YAML: {e}")])?;
    let mut wrong = Vec::new();
    let s = |v: Option<&yaml_serde::Value>| v.and_then(|v| v.as_str()).unwrap_or("").to_string();
    if s(doc.get("kind")) != "KubeSchedulerConfiguration" {
        wrong.push(format!(
            "kind {:?} is not KubeSchedulerConfiguration",
            s(doc.get("kind"))
        ));
    }
    if s(doc.get("apiVersion")) != super::scheduler::API_V1 {
        wrong.push(format!(
            "apiVersion {:?}: the chart writes {}",
            s(doc.get("apiVersion")),
            super::scheduler::API_V1
        ));
    }
    let profiles: Vec<String> = doc
        .get("profiles")
        .and_then(|p| p.as_sequence())
        .into_iter()
        .flatten()
        .map(|p| s(p.get("schedulerName")))
        .collect();
    if !profiles.iter().any(|p| p == scheduler_name) {
        wrong.push(format!(
            "no profile named {scheduler_name:?} (profiles: {profiles:?}): the webhook sends gpu-mem pods to {scheduler_name:?}"
        ));
    }
    let extenders = doc
        .get("extenders")
        .and_then(|e| e.as_sequence())
        .cloned()
        .unwrap_or_default();
    let Some(ours) = extenders.iter().find(|e| manages_gpu_mem(e)) else {
        wrong.push(format!("no extender manages {}", wire::RESOURCE_GPU_MEM));
        return Err(wrong);
    };
    let field = |k: &str| get_ci(ours, k);
    let url = s(field("urlPrefix"));
    if !url
        .trim_end_matches('/')
        .ends_with(wire::EXTENDER_URL_PREFIX)
    {
        wrong.push(format!(
            "urlPrefix {url:?} does not end in {}",
            wire::EXTENDER_URL_PREFIX
        ));
    }
    for (key, want) in [("filterVerb", "filter"), ("bindVerb", "bind")] {
        if s(field(key)) != want {
            wrong.push(format!("{key} is {:?}, not {want:?}", s(field(key))));
        }
    }
    if field("nodeCacheCapable").and_then(|v| v.as_bool()) != Some(true) {
        wrong.push("nodeCacheCapable is not true".to_string());
    }
    if wrong.is_empty() {
        Ok(url)
    } else {
        Err(wrong)
    }
}

/// Why an object of the managed mode could not be read (the check warns with it).
#[derive(Debug, thiserror::Error)]
enum LookupError {
    /// The API answered with an error.
    #[error("{0}")]
    Api(kube::Error),
    /// No answer within [`REQUEST_TIMEOUT`].
    #[error("no answer within {timeout:?}", timeout = REQUEST_TIMEOUT)]
    NoAnswer,
}

async fn get<K>(api: Api<K>, name: &str) -> Result<Option<K>, LookupError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match tokio::time::timeout(REQUEST_TIMEOUT, api.get_opt(name)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(LookupError::Api(e)),
        Err(_) => Err(LookupError::NoAnswer),
    }
}

/// What the cluster holds of the managed mode.
struct Found {
    deployment: Result<Option<Deployment>, LookupError>,
    config_map: Result<Option<ConfigMap>, LookupError>,
    mutating: Result<Option<MutatingWebhookConfiguration>, LookupError>,
    validating: Result<Option<ValidatingWebhookConfiguration>, LookupError>,
}

impl Found {
    fn nothing(&self) -> bool {
        matches!(self.deployment, Ok(None))
            && matches!(self.mutating, Ok(None))
            && matches!(self.validating, Ok(None))
    }
}

/// The three checks, in order: `dedicated-scheduler`, `webhook-config`, `webhook-endpoint`.
/// `webhook_url` overrides `https://<service>.<namespace>.svc:443` (e.g. a port-forward).
pub async fn checks(api: &ApiState, w: &WebhookConfig, webhook_url: Option<&str>) -> Vec<Check> {
    let ApiState::Up { client, .. } = api else {
        let why = "no working API server (see api-server)";
        return vec![
            Check::new(SCHED_ID, SCHED_TITLE, Status::Skip, why),
            Check::new(CONFIG_ID, CONFIG_TITLE, Status::Skip, why),
            Check::new(ENDPOINT_ID, ENDPOINT_TITLE, Status::Skip, why),
        ];
    };
    let ns = &w.namespace;
    let (deployment, config_map, mutating, validating) = tokio::join!(
        get(
            Api::<Deployment>::namespaced(client.clone(), ns),
            &w.scheduler_name
        ),
        get(
            Api::<ConfigMap>::namespaced(client.clone(), ns),
            &w.scheduler_name
        ),
        get(
            Api::<MutatingWebhookConfiguration>::all(client.clone()),
            &w.webhook_config
        ),
        get(
            Api::<ValidatingWebhookConfiguration>::all(client.clone()),
            &w.webhook_config
        ),
    );
    let found = Found {
        deployment,
        config_map,
        mutating,
        validating,
    };
    if found.nothing() {
        let why = format!(
            "no Deployment {ns}/{} and no webhook configuration {}: scheduler.mode is extender",
            w.scheduler_name, w.webhook_config
        );
        return vec![
            Check::new(SCHED_ID, SCHED_TITLE, Status::Skip, why.clone()),
            Check::new(CONFIG_ID, CONFIG_TITLE, Status::Skip, why.clone()),
            Check::new(ENDPOINT_ID, ENDPOINT_TITLE, Status::Skip, why),
        ];
    }
    let (config_check, bundle) = webhook_config(&found, w);
    let endpoint = match bundle {
        Some(ca) => webhook_endpoint(w, &ca, webhook_url).await,
        None => Check::new(
            ENDPOINT_ID,
            ENDPOINT_TITLE,
            Status::Skip,
            "no caBundle to verify against (see webhook-config)",
        ),
    };
    vec![dedicated_scheduler(&found, w), config_check, endpoint]
}

fn dedicated_scheduler(found: &Found, w: &WebhookConfig) -> Check {
    let ns = &w.namespace;
    let name = &w.scheduler_name;
    let describe = format!(
        "kubectl -n {ns} describe deployment/{name}; kubectl -n {ns} logs deployment/{name}"
    );
    let deployment = match &found.deployment {
        Err(e) => {
            return Check::new(
                SCHED_ID,
                SCHED_TITLE,
                Status::Warn,
                format!("cannot read Deployment {ns}/{name}: {e}"),
            )
            .hint("doctor needs get on deployments in that namespace");
        }
        Ok(None) => {
            return Check::new(
                SCHED_ID,
                SCHED_TITLE,
                Status::Fail,
                format!("no Deployment {ns}/{name}, yet the webhook configurations exist: gpu-mem pods are sent to a scheduler that does not run and stay Pending"),
            )
            .hint("helm upgrade gpushare ... --set scheduler.mode=dedicated (or delete the webhook configurations to go back to extender mode)");
        }
        Ok(Some(d)) => d,
    };
    let want = deployment.spec.replicas.unwrap_or(1);
    let ready = deployment
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    let mut problems = Vec::new();
    if ready == 0 {
        problems.push(format!("Deployment {ns}/{name}: 0/{want} replicas ready"));
    }
    let url = match &found.config_map {
        Ok(Some(cm)) => match cm.data.as_ref().and_then(|d| d.get(CONFIG_KEY)) {
            Some(text) => match evaluate_dedicated_config(text, name) {
                Ok(url) => Some(url),
                Err(wrong) => {
                    problems.extend(
                        wrong
                            .into_iter()
                            .map(|p| format!("ConfigMap {ns}/{name}: {p}")),
                    );
                    None
                }
            },
            None => {
                problems.push(format!("ConfigMap {ns}/{name} has no {CONFIG_KEY}"));
                None
            }
        },
        Ok(None) => {
            problems.push(format!(
                "no ConfigMap {ns}/{name} (its KubeSchedulerConfiguration)"
            ));
            None
        }
        Err(e) => {
            problems.push(format!("cannot read ConfigMap {ns}/{name}: {e}"));
            None
        }
    };
    if problems.is_empty() {
        return Check::new(
            SCHED_ID,
            SCHED_TITLE,
            Status::Ok,
            format!(
                "{ready}/{want} replicas ready; profile {name}; extender {}",
                url.unwrap_or_default()
            ),
        );
    }
    Check::new(SCHED_ID, SCHED_TITLE, Status::Fail, problems.join("\n")).hint(format!(
        "{describe}\nthe chart renders a working configuration: helm upgrade with scheduler.mode=dedicated rewrites it"
    ))
}

/// One webhook of a configuration, as the checks see it.
struct HookView {
    name: String,
    ca_bundle: Option<Vec<u8>>,
    /// (namespace, name) of the Service it calls.
    service: Option<(String, String)>,
}

fn view(name: String, client: WebhookClientConfig) -> HookView {
    HookView {
        name,
        ca_bundle: client.ca_bundle.map(|b| b.0),
        service: client.service.map(|s| (s.namespace, s.name)),
    }
}

/// The webhooks of one configuration; `Ok(None)` when it does not exist.
type Hooks<'a> = Result<Option<Vec<HookView>>, &'a LookupError>;

/// The check, and the CA bundle (PEM) the API server trusts for the webhook.
fn webhook_config(found: &Found, w: &WebhookConfig) -> (Check, Option<String>) {
    let mut problems = Vec::new();
    let mut bundles: Vec<Vec<u8>> = Vec::new();
    let mut names = Vec::new();
    let mutating: Hooks = found.mutating.as_ref().map(|o| {
        o.clone().map(|c| {
            c.webhooks
                .unwrap_or_default()
                .into_iter()
                .map(|h| view(h.name, h.client_config))
                .collect()
        })
    });
    let validating: Hooks = found.validating.as_ref().map(|o| {
        o.clone().map(|c| {
            c.webhooks
                .unwrap_or_default()
                .into_iter()
                .map(|h| view(h.name, h.client_config))
                .collect()
        })
    });
    for (kind, got) in [
        ("MutatingWebhookConfiguration", mutating),
        ("ValidatingWebhookConfiguration", validating),
    ] {
        let hooks = match got {
            Err(e) => {
                problems.push(format!("cannot read {kind} {}: {e}", w.webhook_config));
                continue;
            }
            Ok(None) => {
                problems.push(format!("no {kind} {}", w.webhook_config));
                continue;
            }
            Ok(Some(hooks)) => hooks,
        };
        if hooks.is_empty() {
            problems.push(format!("{kind} {} has no webhooks", w.webhook_config));
        }
        for hook in hooks {
            let name = &hook.name;
            names.push(name.clone());
            match &hook.service {
                Some((ns, svc)) if ns == &w.namespace && svc == &w.service_name => {}
                Some((ns, svc)) => problems.push(format!(
                    "{kind} webhook {name} calls Service {ns}/{svc}, not {}/{}",
                    w.namespace, w.service_name
                )),
                None => problems.push(format!("{kind} webhook {name} calls no Service")),
            }
            match hook.ca_bundle {
                Some(ca) if !ca.is_empty() => bundles.push(ca),
                _ => problems.push(format!("{kind} webhook {name} has an empty caBundle")),
            }
        }
    }
    bundles.dedup();
    if bundles.len() > 1 {
        problems.push("the webhooks carry different caBundles".to_string());
    }
    let bundle = bundles
        .first()
        .and_then(|b| String::from_utf8(b.clone()).ok());
    if problems.is_empty() {
        return (
            Check::new(
                CONFIG_ID,
                CONFIG_TITLE,
                Status::Ok,
                format!(
                    "webhooks {} call {}/{}",
                    names.join(", "),
                    w.namespace,
                    w.service_name
                ),
            ),
            bundle,
        );
    }
    (
        Check::new(CONFIG_ID, CONFIG_TITLE, Status::Fail, problems.join("\n")).hint(format!(
            "with --self-signed the webhook writes the caBundle within a minute of starting: \
             kubectl -n {} logs deployment/gpushare-webhook; a missing configuration comes back \
             with helm upgrade ... --set scheduler.mode=dedicated",
            w.namespace
        )),
        bundle,
    )
}

/// Connects to the webhook, verifying its certificate against `ca_pem` for the Service name,
/// and asks `/readyz`.
async fn webhook_endpoint(w: &WebhookConfig, ca_pem: &str, url: Option<&str>) -> Check {
    let dns = format!("{}.{}.svc", w.service_name, w.namespace);
    let url = url.map_or_else(|| format!("https://{dns}:443"), str::to_string);
    match probe(&url, &dns, ca_pem).await {
        Ok(200) => Check::new(
            ENDPOINT_ID,
            ENDPOINT_TITLE,
            Status::Ok,
            format!("{url}: /readyz 200, certificate for {dns} verified against the caBundle"),
        ),
        Ok(status) => Check::new(
            ENDPOINT_ID,
            ENDPOINT_TITLE,
            Status::Fail,
            format!("{url}: /readyz answered {status}"),
        )
        .hint(format!("kubectl -n {} logs deployment/gpushare-webhook", w.namespace)),
        Err(Probe::Untrusted(e)) => Check::new(
            ENDPOINT_ID,
            ENDPOINT_TITLE,
            Status::Fail,
            format!("{url}: the served certificate does not verify against the caBundle for {dns}: {e}"),
        )
        .hint(format!(
            "the API server will refuse to call it; with --self-signed the webhook rewrites the caBundle \
             from its Secret every minute: kubectl -n {ns} rollout restart deployment/gpushare-webhook; \
             if the Secret itself is broken, kubectl -n {ns} delete secret {} and restart",
            w.tls_secret,
            ns = w.namespace
        )),
        Err(Probe::Unreachable(e)) => Check::new(
            ENDPOINT_ID,
            ENDPOINT_TITLE,
            Status::Warn,
            format!("{url}: {e}"),
        )
        .hint(format!(
            "outside the cluster the Service name does not resolve: kubectl -n {} port-forward \
             service/{} 9443:443, then gpushare doctor --webhook-url https://127.0.0.1:9443",
            w.namespace, w.service_name
        )),
    }
}

enum Probe {
    Unreachable(String),
    Untrusted(String),
}

async fn probe(url: &str, dns: &str, ca_pem: &str) -> Result<u16, Probe> {
    let Some(authority) = url
        .strip_prefix("https://")
        .and_then(|rest| rest.split('/').next())
        .filter(|a| !a.is_empty())
    else {
        return Err(Probe::Unreachable(
            "the webhook URL must start with https://".into(),
        ));
    };
    let client = outbound::Client::new(TlsOptions {
        trust: Trust::CaPem(ca_pem.to_string()),
        identity: Identity::None,
        server_name: Some(dns.to_string()),
    })
    .map_err(|e| match e {
        outbound::SetupError::ServerName { .. } => Probe::Unreachable(e.to_string()),
        _ => Probe::Untrusted(format!("caBundle: {e}")),
    })?;
    let readyz = format!("https://{authority}/readyz");
    let request = http::Request::get(readyz.as_str())
        .header(http::header::HOST, dns)
        .body(bytes::Bytes::new())
        .map_err(|e| Probe::Unreachable(format!("{readyz}: {e}")))?;
    match client.send(request, PROBE_TIMEOUT).await {
        Ok(answer) => Ok(answer.status.as_u16()),
        Err(e) if e.is_tls() => Err(Probe::Untrusted(e.to_string())),
        Err(e) => Err(Probe::Unreachable(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_without_our_profile_or_extender_is_named() {
        let good = "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
                    profiles: [{schedulerName: gpushare-scheduler}]\n\
                    extenders: [{urlPrefix: 'http://x:12345/gpushare-scheduler', filterVerb: filter, bindVerb: bind,\n\
                    nodeCacheCapable: true, managedResources: [{name: aliyun.com/gpu-mem}]}]\n";
        assert_eq!(
            evaluate_dedicated_config(good, "gpushare-scheduler"),
            Ok("http://x:12345/gpushare-scheduler".to_string())
        );
        let wrong = evaluate_dedicated_config(good, "other").unwrap_err();
        assert!(wrong[0].contains("no profile named \"other\""), "{wrong:?}");
        let no_ext = "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nprofiles: [{schedulerName: s}]\n";
        let wrong = evaluate_dedicated_config(no_ext, "s").unwrap_err();
        assert!(
            wrong.iter().any(|w| w.contains("no extender manages")),
            "{wrong:?}"
        );
        assert!(evaluate_dedicated_config(": :", "s").is_err());
    }
}
