//! The kube-scheduler side: `scheduler-config` (the scheduler's configuration has an extender
//! for `aliyun.com/gpu-mem` with the right verbs and flags, in a supported API version) and
//! `extender-reachable` (the extender answers `/version` and `/readyz`).
//!
//! The configuration comes from `--scheduler-config PATH`, else from the `--config=` argument
//! of the kubeadm static pod `/etc/kubernetes/manifests/kube-scheduler.yaml` (read under the
//! host root). Upstream's Policy file (`--policy-config-file`) is reported as removed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::host::HostRoot;
use super::report::{Check, Status};
use crate::core::wire;
use crate::outbound::{self, TlsOptions, Trust};

const CONFIG_ID: &str = "scheduler-config";
const CONFIG_TITLE: &str = "kube-scheduler has the gpushare extender";
const REACH_ID: &str = "extender-reachable";
const REACH_TITLE: &str = "extender answers /version and /readyz";

/// Where kubeadm puts the scheduler's static pod.
pub const SCHEDULER_MANIFEST: &str = "/etc/kubernetes/manifests/kube-scheduler.yaml";
/// The current configuration API.
pub(crate) const API_V1: &str = "kubescheduler.config.k8s.io/v1";
/// Deadline of one HTTP request to the extender.
pub(crate) const HTTP_TIMEOUT: Duration = Duration::from_secs(3);

/// The extenders block that works, shown in fixes.
pub(crate) fn example_config() -> String {
    format!(
        "apiVersion: {API_V1}\n\
         kind: KubeSchedulerConfiguration\n\
         clientConnection:\n  kubeconfig: /etc/kubernetes/scheduler.conf\n\
         extenders:\n\
         - urlPrefix: http://127.0.0.1:32766{}\n  filterVerb: filter\n  bindVerb: bind\n  \
         enableHTTPS: false\n  nodeCacheCapable: true\n  ignorable: false\n  managedResources:\n  \
         - name: {}\n    ignoredByScheduler: false",
        wire::EXTENDER_URL_PREFIX,
        wire::RESOURCE_GPU_MEM
    )
}

/// Kubernetes minor versions that serve a scheduler configuration API: `(first, last)`.
fn api_version_range(api_version: &str) -> Option<(u32, Option<u32>)> {
    match api_version {
        "kubescheduler.config.k8s.io/v1" => Some((25, None)),
        "kubescheduler.config.k8s.io/v1beta3" => Some((23, Some(28))),
        "kubescheduler.config.k8s.io/v1beta2" => Some((22, Some(27))),
        "kubescheduler.config.k8s.io/v1beta1" => Some((19, Some(25))),
        _ => None,
    }
}

/// Where the configuration was found.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Source {
    /// `--scheduler-config`, read as given.
    Explicit(PathBuf),
    /// A host path named by the static pod's flag.
    Host(PathBuf),
}

/// The scheduler configuration's location per the kubeadm manifest: `Ok((path, is_policy))`,
/// `Err(check)` when the manifest says something decisive on its own.
fn from_manifest(host: &HostRoot) -> Result<(PathBuf, bool), Check> {
    let Some(text) = host.read(SCHEDULER_MANIFEST) else {
        return Err(Check::new(
            CONFIG_ID,
            CONFIG_TITLE,
            Status::Skip,
            format!("no {SCHEDULER_MANIFEST} here (not a kubeadm control-plane node?)"),
        )
        .hint("pass --scheduler-config PATH (the file kube-scheduler's --config names)"));
    };
    let pod: yaml_serde::Value = yaml_serde::from_str(&text).map_err(|e| {
        Check::new(
            CONFIG_ID,
            CONFIG_TITLE,
            Status::Fail,
            format!("{SCHEDULER_MANIFEST} is not valid YAML: {e}"),
        )
    })?;
    let mut tokens: Vec<String> = Vec::new();
    let containers = pod
        .get("spec")
        .and_then(|s| s.get("containers"))
        .and_then(|c| c.as_sequence())
        .cloned()
        .unwrap_or_default();
    for c in &containers {
        for key in ["command", "args"] {
            if let Some(seq) = c.get(key).and_then(|v| v.as_sequence()) {
                tokens.extend(seq.iter().filter_map(|t| t.as_str().map(str::to_string)));
            }
        }
    }
    let flag = |name: &str| -> Option<String> {
        let eq = format!("{name}=");
        tokens.iter().enumerate().find_map(|(i, t)| {
            if let Some(v) = t.strip_prefix(&eq) {
                Some(v.to_string())
            } else if t == name {
                tokens.get(i + 1).cloned()
            } else {
                None
            }
        })
    };
    if let Some(p) = flag("--config") {
        return Ok((PathBuf::from(p), false));
    }
    if let Some(p) = flag("--policy-config-file") {
        return Ok((PathBuf::from(p), true));
    }
    if flag("--policy-configmap").is_some() {
        return Err(Check::new(
            CONFIG_ID,
            CONFIG_TITLE,
            Status::Fail,
            format!("{SCHEDULER_MANIFEST} uses --policy-configmap: the Policy API was removed in Kubernetes 1.23"),
        )
        .hint(format!(
            "write a KubeSchedulerConfiguration and pass it with --config:\n{}",
            example_config()
        )));
    }
    Err(Check::new(
        CONFIG_ID,
        CONFIG_TITLE,
        Status::Fail,
        format!("{SCHEDULER_MANIFEST} runs kube-scheduler without --config: no extender is configured"),
    )
    .hint(format!(
        "add --config=/etc/kubernetes/scheduler-policy-config.yaml (mounted with a hostPath) holding:\n{}",
        example_config()
    )))
}

/// The `scheduler-config` check and the extender URL prefix it found.
/// `server_minor` is the API server's minor version, when known.
pub fn scheduler_config(
    host: &HostRoot,
    explicit: Option<&Path>,
    server_minor: Option<u32>,
) -> (Check, Option<String>) {
    let (source, policy_flag) = match explicit {
        Some(p) => (Source::Explicit(p.to_path_buf()), false),
        None => match from_manifest(host) {
            Ok((p, policy)) => (Source::Host(p), policy),
            Err(c) => return (c, None),
        },
    };
    let (shown, text) = match &source {
        Source::Explicit(p) => (p.display().to_string(), std::fs::read_to_string(p).ok()),
        Source::Host(p) => (p.display().to_string(), host.read(p)),
    };
    let Some(text) = text else {
        return (
            Check::new(
                CONFIG_ID,
                CONFIG_TITLE,
                Status::Fail,
                format!("cannot read {shown}"),
            )
            .hint(
                "the file kube-scheduler is told to read must exist (and be mounted into its pod)",
            ),
            None,
        );
    };
    evaluate(&shown, &text, policy_flag, server_minor)
}

/// The verdict on configuration `text` (file `shown`).
fn evaluate(
    shown: &str,
    text: &str,
    policy_flag: bool,
    server_minor: Option<u32>,
) -> (Check, Option<String>) {
    let docs = match yaml_documents(text) {
        Ok(d) => d,
        Err(e) => {
            return (
                Check::new(
                    CONFIG_ID,
                    CONFIG_TITLE,
                    Status::Fail,
                    format!("{shown} is not valid YAML/JSON: {e}"),
                ),
                None,
            );
        }
    };
    // A bundle (several documents): the scheduler reads one configuration; take the
    // KubeSchedulerConfiguration (or Policy) document when there is one.
    let chosen = docs
        .iter()
        .find(|d| matches!(kind_of(d).as_str(), "KubeSchedulerConfiguration" | "Policy"))
        .or_else(|| docs.first());
    let null = yaml_serde::Value::Null;
    let doc = chosen.unwrap_or(&null);
    let kind = kind_of(doc);
    let kind = kind.as_str();
    let api_version = doc.get("apiVersion").and_then(|k| k.as_str()).unwrap_or("");
    let extenders = doc
        .get("extenders")
        .and_then(|e| e.as_sequence())
        .cloned()
        .unwrap_or_default();
    let ours: Vec<&yaml_serde::Value> = extenders.iter().filter(|e| manages_gpu_mem(e)).collect();
    let url = ours
        .first()
        .and_then(|e| get_ci(e, "urlPrefix"))
        .and_then(|u| u.as_str())
        .map(str::to_string);
    let missing = format!(
        "no extender manages {}: the gpushare extender is not in it",
        wire::RESOURCE_GPU_MEM
    );
    let found = |url: &Option<String>| match url {
        Some(u) => format!("the gpushare extender is in it: {u}"),
        None => missing.clone(),
    };
    if policy_flag || kind == "Policy" {
        return (
            Check::new(
                CONFIG_ID,
                CONFIG_TITLE,
                Status::Fail,
                format!(
                    "{shown} is a scheduler Policy (--policy-config-file): the Policy API was removed in Kubernetes 1.23\n{}",
                    found(&url)
                ),
            )
            .hint(format!(
                "replace it with a KubeSchedulerConfiguration passed with --config (same extender values):\n{}",
                example_config()
            )),
            url,
        );
    }
    if kind != "KubeSchedulerConfiguration" {
        return (not_a_configuration(shown, &docs, kind, &missing), url);
    }
    let mut fails: Vec<String> = Vec::new();
    let mut warns: Vec<String> = Vec::new();
    let mut fixes: Vec<String> = Vec::new();
    check_api_version(
        api_version,
        server_minor,
        &mut fails,
        &mut warns,
        &mut fixes,
    );
    let mut lines = vec![format!("{shown}: {kind} {api_version}")];
    match ours.as_slice() {
        [] => {
            fails.push(missing.clone());
            fixes.push(format!("add the gpushare extender:\n{}", example_config()));
        }
        [first, rest @ ..] => {
            if !rest.is_empty() {
                warns.push(format!(
                    "{} extenders manage {}: only one gpushare extender may bind these pods",
                    rest.len() + 1,
                    wire::RESOURCE_GPU_MEM
                ));
            }
            lines.push(format!(
                "extender {}",
                url.as_deref().unwrap_or("(no urlPrefix)")
            ));
            check_extender_entry(first, url.as_deref(), &mut fails, &mut warns, &mut fixes);
        }
    }
    lines.extend(fails.iter().map(|f| format!("problem: {f}")));
    lines.extend(warns.iter().map(|w| format!("warning: {w}")));
    let status = if !fails.is_empty() {
        Status::Fail
    } else if !warns.is_empty() {
        Status::Warn
    } else {
        Status::Ok
    };
    let mut check = Check::new(CONFIG_ID, CONFIG_TITLE, status, lines.join("\n"));
    if status != Status::Ok {
        fixes.dedup();
        check = check.hint(format!("{}\nthen restart kube-scheduler", fixes.join("\n")));
    }
    (check, url)
}

/// The `kind` of a YAML document (empty when it has none).
fn kind_of(d: &yaml_serde::Value) -> String {
    d.get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string()
}

/// The verdict on a file `shown` whose chosen document (of `docs`) has kind `kind`, not a
/// KubeSchedulerConfiguration; `missing` says the extender is not in it.
fn not_a_configuration(
    shown: &str,
    docs: &[yaml_serde::Value],
    kind: &str,
    missing: &str,
) -> Check {
    let what = if docs.len() > 1 {
        let kinds: Vec<String> = docs
            .iter()
            .map(|d| {
                let k = kind_of(d);
                if k.is_empty() { "?".to_string() } else { k }
            })
            .collect();
        format!(
            "{} YAML documents ({}), none a KubeSchedulerConfiguration",
            docs.len(),
            kinds.join(", ")
        )
    } else if kind.is_empty() {
        "no kind: not a KubeSchedulerConfiguration".to_string()
    } else {
        format!("kind {kind:?} is not KubeSchedulerConfiguration")
    };
    let embedded = embedded_policy(docs);
    let mut lines = vec![format!("{shown}: {what}")];
    if let Some(key) = &embedded {
        lines.push(format!(
                "a ConfigMap carries a scheduler Policy ({key}, for --policy-configmap): the Policy API was removed in Kubernetes 1.23"
            ));
    }
    lines.push(missing.to_string());
    Check::new(CONFIG_ID, CONFIG_TITLE, Status::Fail, lines.join("\n")).hint(example_config())
}

/// The configuration's `apiVersion` against the versions kube-scheduler serves and this
/// cluster's (`server_minor`): problems, warnings and fixes.
fn check_api_version(
    api_version: &str,
    server_minor: Option<u32>,
    fails: &mut Vec<String>,
    warns: &mut Vec<String>,
    fixes: &mut Vec<String>,
) {
    let server = server_minor.map(|m| format!("1.{m}"));
    match api_version_range(api_version) {
        None => {
            fails.push(format!(
                "apiVersion {api_version:?} is not served by any current kube-scheduler"
            ));
            fixes.push(format!(
                "change apiVersion to {API_V1}, same extenders block"
            ));
        }
        Some((first, last)) => {
            let served = server_minor.map(|m| m >= first && last.is_none_or(|l| m <= l));
            let span = match last {
                Some(l) => format!("Kubernetes 1.{first} to 1.{l}"),
                None => format!("Kubernetes 1.{first} and newer"),
            };
            match (served, last) {
                (Some(false), _) => {
                    fails.push(format!(
                        "apiVersion {api_version} is served by {span}, not by this cluster ({})",
                        server.as_deref().unwrap_or("?")
                    ));
                    fixes.push(if api_version == API_V1 {
                        "this cluster predates v1: use kubescheduler.config.k8s.io/v1beta3 (1.23-1.24) with the same extenders block".to_string()
                    } else {
                        format!("change apiVersion to {API_V1}, same extenders block")
                    });
                }
                (_, Some(_)) => {
                    warns.push(format!(
                        "apiVersion {api_version} is deprecated ({span} only)"
                    ));
                    fixes.push(format!(
                        "change apiVersion to {API_V1}, same extenders block"
                    ));
                }
                (_, None) => {}
            }
        }
    }
}

/// The gpushare extender's entry `e` (with its `urlPrefix`, `url`): verbs, node cache,
/// managed resource, `ignorable` and TLS: problems, warnings and fixes.
fn check_extender_entry(
    e: &yaml_serde::Value,
    url: Option<&str>,
    fails: &mut Vec<String>,
    warns: &mut Vec<String>,
    fixes: &mut Vec<String>,
) {
    let s = |k: &str| {
        get_ci(e, k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let b = |k: &str| get_ci(e, k).and_then(|v| v.as_bool());
    if url.is_none() {
        fails.push("the extender has no urlPrefix".to_string());
    }
    if s("filterVerb").is_empty() {
        fails.push("filterVerb is not set: the extender never filters".to_string());
        fixes.push("set filterVerb: filter".to_string());
    }
    if s("bindVerb").is_empty() {
        fails.push("bindVerb is not set: pods are bound without a GPU index".to_string());
        fixes.push("set bindVerb: bind".to_string());
    }
    if b("nodeCacheCapable") != Some(true) {
        warns.push(
            "nodeCacheCapable is not true: every filter call carries whole Node objects"
                .to_string(),
        );
        fixes.push("set nodeCacheCapable: true".to_string());
    }
    let ignored = get_ci(e, "managedResources")
        .and_then(|m| m.as_sequence())
        .into_iter()
        .flatten()
        .filter(|r| get_ci(r, "name").and_then(|n| n.as_str()) == Some(wire::RESOURCE_GPU_MEM))
        .any(|r| get_ci(r, "ignoredByScheduler").and_then(|v| v.as_bool()) == Some(true));
    if ignored {
        warns.push(format!(
            "ignoredByScheduler: true: kube-scheduler stops checking node-level {}",
            wire::RESOURCE_GPU_MEM
        ));
        fixes.push("set ignoredByScheduler: false".to_string());
    }
    if b("ignorable") == Some(true) {
        warns.push(
            "ignorable: true: while the extender is down GPU pods are bound without a GPU"
                .to_string(),
        );
        fixes.push("set ignorable: false".to_string());
    }
    tls_config(e, url, fails, warns, fixes);
}

/// The YAML (or JSON) documents of `text`; empty documents are dropped.
/// The extender entry's `tlsConfig` against its URL: a client certificate for an extender that
/// checks them (`--tls-client-ca`), a CA for the extender's serving certificate.
fn tls_config(
    e: &yaml_serde::Value,
    url: Option<&str>,
    fails: &mut Vec<String>,
    warns: &mut Vec<String>,
    fixes: &mut Vec<String>,
) {
    let tls = get_ci(e, "tlsConfig");
    let has = |k: &str| {
        tls.and_then(|t| get_ci(t, k))
            .and_then(|v| v.as_str())
            .is_some_and(|v| !v.is_empty())
    };
    let https = url.is_some_and(|u| u.starts_with("https://"));
    let cert = has("certFile") || has("certData");
    let key = has("keyFile") || has("keyData");
    if !https {
        if tls.is_some() {
            warns.push("tlsConfig is set but urlPrefix is http://: it is not used".to_string());
            fixes.push("use https:// in urlPrefix (the extender with --tls-cert)".to_string());
        }
        return;
    }
    if cert != key {
        fails.push(
            "tlsConfig has a client certificate without its key (or a key without its certificate)"
                .to_string(),
        );
        fixes.push("give both certFile and keyFile (or certData and keyData)".to_string());
    } else if !cert {
        warns.push(
            "the extender is called over HTTPS without a client certificate: an extender started \
             with --tls-client-ca answers filter and bind 403"
                .to_string(),
        );
        fixes.push(
            "add tlsConfig certFile / keyFile: a client certificate the extender's CA signed \
             (docs/extender.md, \"Authenticated scheduling\")"
                .to_string(),
        );
    }
    let insecure = tls
        .and_then(|t| get_ci(t, "insecure"))
        .and_then(|v| v.as_bool())
        == Some(true);
    if !has("caFile") && !has("caData") {
        warns.push(if insecure {
            "tlsConfig insecure: true: the extender's serving certificate is not verified"
                .to_string()
        } else {
            "tlsConfig has no caFile: kube-scheduler does not verify the extender's serving \
             certificate (enableHTTPS without a CA is insecure)"
                .to_string()
        });
        fixes.push("set tlsConfig caFile to the CA of the extender's certificate".to_string());
    }
}

fn yaml_documents(text: &str) -> Result<Vec<yaml_serde::Value>, yaml_serde::Error> {
    use serde::Deserialize;
    let mut docs = Vec::new();
    for de in yaml_serde::Deserializer::from_str(text) {
        let v = yaml_serde::Value::deserialize(de)?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// `ConfigMap/<name> data.<key>` of a ConfigMap whose data holds a scheduler Policy.
fn embedded_policy(docs: &[yaml_serde::Value]) -> Option<String> {
    docs.iter()
        .filter(|d| d.get("kind").and_then(|k| k.as_str()) == Some("ConfigMap"))
        .find_map(|d| {
            let name = d
                .get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(|n| n.as_str())
                .unwrap_or("?");
            d.get("data")?.as_mapping()?.iter().find_map(|(k, v)| {
                let policy = yaml_documents(v.as_str()?)
                    .ok()?
                    .into_iter()
                    .any(|p| p.get("kind").and_then(|k| k.as_str()) == Some("Policy"));
                policy.then(|| format!("ConfigMap/{name} data.{}", k.as_str().unwrap_or("?")))
            })
        })
}

/// A key looked up case-insensitively (the Policy file spells `enableHttps`, v1 `enableHTTPS`).
pub(crate) fn get_ci<'a>(v: &'a yaml_serde::Value, key: &str) -> Option<&'a yaml_serde::Value> {
    v.as_mapping()?
        .iter()
        .find(|(k, _)| k.as_str().is_some_and(|k| k.eq_ignore_ascii_case(key)))
        .map(|(_, v)| v)
}

pub(crate) fn manages_gpu_mem(extender: &yaml_serde::Value) -> bool {
    get_ci(extender, "managedResources")
        .and_then(|m| m.as_sequence())
        .into_iter()
        .flatten()
        .any(|r| get_ci(r, "name").and_then(|n| n.as_str()) == Some(wire::RESOURCE_GPU_MEM))
}

/// `http://host:port/prefix` → `("http", "host:port")`; the scheme's port when none is given.
fn split_url(url: &str) -> Option<(&str, String)> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?']).next()?;
    if authority.is_empty() {
        return None;
    }
    let has_port = match authority.rsplit_once(']') {
        Some((_, after)) => after.starts_with(':'),
        None => authority.contains(':'),
    };
    if has_port {
        return Some((scheme, authority.to_string()));
    }
    let port = if scheme == "https" { 443 } else { 80 };
    Some((scheme, format!("{authority}:{port}")))
}

/// One GET of `scheme://authority{path}` with a deadline: status and body (cut to 200
/// bytes). Over https the certificate is not checked (like `curl -k`): this check is about
/// the answers; the scheduler's `tlsConfig` is what authenticates the extender.
async fn get(
    client: &outbound::Client,
    scheme: &str,
    authority: &str,
    path: &str,
) -> Result<(u16, String), outbound::Error> {
    let answer = client
        .get(&format!("{scheme}://{authority}{path}"), HTTP_TIMEOUT)
        .await?;
    Ok((answer.status.as_u16(), answer.body_excerpt(200)))
}

/// `extender-reachable`: `url` is `--extender-url` or the scheduler configuration's urlPrefix.
pub(crate) async fn extender_reachable(url: Option<&str>, from_flag: bool) -> Check {
    let Some(url) = url else {
        return Check::new(
            REACH_ID,
            REACH_TITLE,
            Status::Skip,
            "no extender URL (no --extender-url, none in the scheduler configuration)",
        )
        .hint(format!(
            "pass --extender-url http://HOST:PORT{}",
            wire::EXTENDER_URL_PREFIX
        ));
    };
    let source = if from_flag {
        "--extender-url"
    } else {
        "the scheduler configuration"
    };
    let Some((scheme, authority)) = split_url(url) else {
        return Check::new(
            REACH_ID,
            REACH_TITLE,
            Status::Fail,
            format!("{url} (from {source}) is not a URL"),
        )
        .hint(format!(
            "write it as http://HOST:PORT{}",
            wire::EXTENDER_URL_PREFIX
        ));
    };
    let unreachable_hint = "is the extender running (kubectl -n kube-system get pods -l app=gpushare-schd-extender)?\n\
                            is its Service gpushare-schd-extender (NodePort 32766) reachable from the scheduler's host?\n\
                            127.0.0.1 NodePorts depend on kube-proxy's settings: use the node's IP or the ClusterIP";
    let client = match scheme {
        "http" => outbound::Client::plain(),
        "https" => match outbound::Client::new(TlsOptions::trusting(Trust::InsecureSkipVerify)) {
            Ok(c) => c,
            Err(e) => {
                return Check::new(REACH_ID, REACH_TITLE, Status::Fail, format!("{url}: {e}"));
            }
        },
        _ => {
            return Check::new(
                REACH_ID,
                REACH_TITLE,
                Status::Fail,
                format!("{url}: scheme {scheme:?} is neither http nor https"),
            );
        }
    };
    let head = if scheme == "https" {
        format!("{url} (from {source}; its certificate is not checked here)")
    } else {
        format!("{url} (from {source})")
    };
    let authority = authority.as_str();
    let version = match get(&client, scheme, authority, "/version").await {
        Ok((200, body)) => body,
        Ok((code, body)) => {
            return Check::new(
                REACH_ID,
                REACH_TITLE,
                Status::Fail,
                format!("{head}: GET {scheme}://{authority}/version answered {code}: {body}"),
            )
            .hint(
                "something else listens there: point urlPrefix at the gpushare extender's Service",
            );
        }
        Err(e) => {
            return Check::new(REACH_ID, REACH_TITLE, Status::Fail, format!("{head}: {e}"))
                .hint(unreachable_hint);
        }
    };
    match get(&client, scheme, authority, "/readyz").await {
        Ok((200, _)) => Check::new(
            REACH_ID,
            REACH_TITLE,
            Status::Ok,
            format!("{head}: version {version}; ready"),
        ),
        Ok((code, body)) => Check::new(
            REACH_ID,
            REACH_TITLE,
            Status::Warn,
            format!("{head}: version {version}; /readyz answered {code}: {body}"),
        )
        .hint("the extender is ready once its ledger is rebuilt (and, with leader election, it leads): see its logs"),
        Err(e) => Check::new(REACH_ID, REACH_TITLE, Status::Warn, format!("{head}: version {version}; /readyz: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> String {
        example_config()
    }

    #[test]
    fn the_example_is_ok() {
        let (c, url) = evaluate("cfg", &good(), false, Some(33));
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert_eq!(
            url.as_deref(),
            Some("http://127.0.0.1:32766/gpushare-scheduler")
        );
    }

    #[test]
    fn api_versions_against_the_server() {
        let v1beta2 = good().replace(API_V1, "kubescheduler.config.k8s.io/v1beta2");
        let (c, _) = evaluate("cfg", &v1beta2, false, Some(33));
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(
            c.hint
                .contains("change apiVersion to kubescheduler.config.k8s.io/v1"),
            "{c:?}"
        );
        let (c, _) = evaluate("cfg", &v1beta2, false, Some(24));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        let (c, _) = evaluate("cfg", &v1beta2, false, None);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        let (c, _) = evaluate("cfg", &good(), false, Some(24));
        assert_eq!(c.status, Status::Fail, "{c:?}");
    }

    #[test]
    fn upstream_policy_json_is_removed() {
        let policy = r#"{"kind":"Policy","apiVersion":"v1","extenders":[{"urlPrefix":"http://127.0.0.1:32766/gpushare-scheduler","filterVerb":"filter","bindVerb":"bind","enableHttps":false,"nodeCacheCapable":true,"managedResources":[{"name":"aliyun.com/gpu-mem","ignoredByScheduler":false}],"ignorable":false}]}"#;
        let (c, url) = evaluate("p.json", policy, false, None);
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("removed in Kubernetes 1.23"), "{c:?}");
        assert!(url.is_some());
    }

    #[test]
    fn another_projects_policy_says_the_gpushare_extender_is_missing() {
        let policy = r#"{"kind":"Policy","apiVersion":"v1","extenders":[{"urlPrefix":"http://127.0.0.1:8888/","filterVerb":"filter"}]}"#;
        let (c, url) = evaluate("p.json", policy, false, None);
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("removed in Kubernetes 1.23"), "{c:?}");
        assert!(
            c.detail.contains("the gpushare extender is not in it"),
            "{c:?}"
        );
        assert_eq!(url, None);
    }

    #[test]
    fn multi_document_yaml_is_read_document_by_document() {
        // A kubectl bundle: the configuration is one of its documents.
        let bundle = format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: s\n---\n{}\n",
            good()
        );
        let (c, url) = evaluate("bundle.yaml", &bundle, false, Some(33));
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(url.is_some());
        // A bundle without one: not a configuration, never "not valid YAML".
        let no_config = "kind: ServiceAccount\n---\nkind: ConfigMap\nmetadata:\n  name: p\ndata:\n  policy.cfg: '{\"kind\":\"Policy\",\"apiVersion\":\"v1\"}'\n";
        let (c, _) = evaluate("bundle.yaml", no_config, false, None);
        assert_eq!(c.status, Status::Fail);
        assert!(!c.detail.contains("not valid YAML"), "{c:?}");
        assert!(
            c.detail
                .contains("2 YAML documents (ServiceAccount, ConfigMap)"),
            "{c:?}"
        );
        assert!(c.detail.contains("ConfigMap/p data.policy.cfg"), "{c:?}");
        assert!(
            c.detail.contains("the gpushare extender is not in it"),
            "{c:?}"
        );
    }

    #[test]
    fn extender_block_problems() {
        let (c, _) = evaluate(
            "cfg",
            &good().replace("aliyun.com/gpu-mem", "example.com/x"),
            false,
            None,
        );
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.detail.contains("no extender manages aliyun.com/gpu-mem"),
            "{c:?}"
        );
        let (c, _) = evaluate(
            "cfg",
            &good().replace("nodeCacheCapable: true", "nodeCacheCapable: false"),
            false,
            None,
        );
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.hint.contains("nodeCacheCapable: true"));
        let (c, _) = evaluate(
            "cfg",
            &good().replace("  bindVerb: bind\n", ""),
            false,
            None,
        );
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("bindVerb"));
        let (c, _) = evaluate(
            "cfg",
            &good().replace("ignoredByScheduler: false", "ignoredByScheduler: true"),
            false,
            None,
        );
        assert_eq!(c.status, Status::Warn, "{c:?}");
        let (c, _) = evaluate("cfg", "kind: [", false, None);
        assert_eq!(c.status, Status::Fail);
    }

    #[test]
    fn the_extender_tls_config_matches_its_url() {
        let https = good().replace("http://127.0.0.1", "https://127.0.0.1");
        let (c, _) = evaluate("cfg", &https, false, None);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("without a client certificate"), "{c:?}");
        assert!(c.detail.contains("no caFile"), "{c:?}");
        let full = format!(
            "{https}\n  tlsConfig:\n    caFile: /ca.crt\n    certFile: /tls.crt\n    keyFile: /tls.key\n"
        );
        let (c, _) = evaluate("cfg", &full, false, None);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        let (c, _) = evaluate(
            "cfg",
            &full.replace("    keyFile: /tls.key\n", ""),
            false,
            None,
        );
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("without its key"), "{c:?}");
        let plain = format!("{}\n  tlsConfig:\n    caFile: /ca.crt\n", good());
        let (c, _) = evaluate("cfg", &plain, false, None);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("not used"), "{c:?}");
    }

    #[test]
    fn the_manifest_names_the_file_under_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path());
        let (c, _) = scheduler_config(&host, None, None);
        assert_eq!(c.status, Status::Skip);
        std::fs::create_dir_all(dir.path().join("etc/kubernetes/manifests")).unwrap();
        std::fs::write(
            dir.path().join("etc/kubernetes/manifests/kube-scheduler.yaml"),
            "apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - command:\n    - kube-scheduler\n    - --config=/etc/kubernetes/sched.yaml\n",
        )
        .unwrap();
        let (c, _) = scheduler_config(&host, None, None);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(
            c.detail.contains("cannot read /etc/kubernetes/sched.yaml"),
            "{c:?}"
        );
        std::fs::write(dir.path().join("etc/kubernetes/sched.yaml"), good()).unwrap();
        let (c, url) = scheduler_config(&host, None, Some(30));
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(url.is_some());
    }

    #[test]
    fn urls_split_into_scheme_and_authority() {
        assert_eq!(
            split_url("http://127.0.0.1:32766/gpushare-scheduler"),
            Some(("http", "127.0.0.1:32766".to_string()))
        );
        assert_eq!(
            split_url("https://extender.kube-system"),
            Some(("https", "extender.kube-system:443".to_string()))
        );
        assert_eq!(
            split_url("http://[::1]/x"),
            Some(("http", "[::1]:80".to_string()))
        );
        assert_eq!(split_url("127.0.0.1"), None);
    }

    #[tokio::test]
    async fn a_closed_port_fails_quickly() {
        // Bind then drop: the port is closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/gpushare-scheduler");
        let c = extender_reachable(Some(&url), true).await;
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert_eq!(extender_reachable(None, false).await.status, Status::Skip);
    }
}
