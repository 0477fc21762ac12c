//! `aliyun-leftovers` (control plane; `gpushare doctor`, not the preflight): the objects an
//! Aliyun gpushare installation left in kube-system that `helm install` of this chart cannot
//! take over as they are, and the commands that clear the way, in order.
//!
//! Aliyun's guide creates its objects with `kubectl create -f` (no Helm ownership; the
//! Deployment with `hostNetwork: true` and a `node-role.kubernetes.io/master` node selector),
//! and its Helm installer (chart `gpushare-installer`) adds a `type: runtime` label, a Job and
//! two DaemonSets of its own. Helm refuses objects of another owner, keeps the fields it did not
//! set when it adopts one (so `hostNetwork` and the master selector would survive), and cannot
//! change a Deployment's or DaemonSet's selector. So the workloads are deleted with
//! `--cascade=orphan` (their pods keep serving until the chart's controllers, whose selectors
//! match those pods, replace them one by one), the other objects are labelled and annotated
//! for adoption, and the installer's own objects go with its release. An object carrying
//! `app.kubernetes.io/name: gpushare` is this chart's (Helm or `packaging/manifests/`), and one
//! labelled and annotated for release `gpushare` in kube-system is ready to be adopted: neither
//! is reported. Doctor only reads: it prints the commands, it runs none.

use kube::Api;
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

use super::cluster::{ApiState, CHECK_TIMEOUT};
use super::report::{Check, Status};
use crate::core::wire;

const ID: &str = "aliyun-leftovers";
const TITLE: &str = "no Aliyun gpushare objects in the chart's way";

/// Where Aliyun's manifests and installer put everything.
pub const NAMESPACE: &str = "kube-system";
/// The release `helm install` is told to adopt into (the command of docs/migration.md).
const RELEASE: &str = "gpushare";

/// One object doctor looks for.
#[derive(Clone, Copy, Debug)]
pub struct Wanted {
    /// API group (`""` for core).
    pub group: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// Resource (plural), as kubectl names it.
    pub plural: &'static str,
    /// Namespaced (in [`NAMESPACE`]) or cluster-scoped.
    pub namespaced: bool,
    /// Object name.
    pub name: &'static str,
    /// Only Aliyun's Helm installer makes it (the chart has no such object).
    pub installer_only: bool,
}

const fn wanted(
    group: &'static str,
    kind: &'static str,
    plural: &'static str,
    namespaced: bool,
    name: &'static str,
    installer_only: bool,
) -> Wanted {
    Wanted {
        group,
        kind,
        plural,
        namespaced,
        name,
        installer_only,
    }
}

const RBAC: &str = "rbac.authorization.k8s.io";

/// Aliyun's objects: first those the chart has too (same names), then the installer's own.
pub const WANTED: &[Wanted] = &[
    wanted(
        "apps",
        "Deployment",
        "deployments",
        true,
        wire::EXTENDER_COMPONENT,
        false,
    ),
    wanted(
        "apps",
        "DaemonSet",
        "daemonsets",
        true,
        "gpushare-device-plugin-ds",
        false,
    ),
    wanted(
        "",
        "Service",
        "services",
        true,
        wire::EXTENDER_COMPONENT,
        false,
    ),
    wanted(
        "",
        "ServiceAccount",
        "serviceaccounts",
        true,
        wire::EXTENDER_COMPONENT,
        false,
    ),
    wanted(
        "",
        "ServiceAccount",
        "serviceaccounts",
        true,
        wire::DEVICE_PLUGIN_COMPONENT,
        false,
    ),
    wanted(
        RBAC,
        "ClusterRole",
        "clusterroles",
        false,
        wire::EXTENDER_COMPONENT,
        false,
    ),
    wanted(
        RBAC,
        "ClusterRole",
        "clusterroles",
        false,
        wire::DEVICE_PLUGIN_COMPONENT,
        false,
    ),
    wanted(
        RBAC,
        "ClusterRoleBinding",
        "clusterrolebindings",
        false,
        wire::EXTENDER_COMPONENT,
        false,
    ),
    wanted(
        RBAC,
        "ClusterRoleBinding",
        "clusterrolebindings",
        false,
        wire::DEVICE_PLUGIN_COMPONENT,
        false,
    ),
    wanted("batch", "Job", "jobs", true, "gpushare-installer", true),
    wanted(
        "apps",
        "DaemonSet",
        "daemonsets",
        true,
        "device-plugin-evict-ds",
        true,
    ),
    wanted(
        "apps",
        "DaemonSet",
        "daemonsets",
        true,
        "device-plugin-recover-ds",
        true,
    ),
];

/// What the API answered for one [`Wanted`]: the object as JSON, absent, or why unknown.
pub type Found = (Wanted, Result<Option<Value>, ReadError>);

/// Why one object could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The API server refused (e.g. RBAC): its own message.
    #[error("{0}")]
    Refused(String),
    /// The call failed (connection, decoding).
    #[error("{0}")]
    Failed(kube::Error),
    /// No answer within the check's deadline.
    #[error("no answer in time")]
    TimedOut,
    /// The object could not be turned into JSON.
    #[error("cannot encode the object: {0}")]
    Encode(serde_json::Error),
}

impl From<kube::Error> for ReadError {
    fn from(e: kube::Error) -> ReadError {
        match e {
            kube::Error::Api(status) => ReadError::Refused(status.message.to_string()),
            other => ReadError::Failed(other),
        }
    }
}

/// The labels the chart's selectors use (upstream's); anything else in a selector is a
/// selector the chart cannot take over (immutable).
const OUR_SELECTOR_KEYS: &[&str] = &["app", "component", "name"];

/// The chart's object, or one already labelled and annotated for `helm install` to adopt.
fn is_ours(obj: &Value) -> bool {
    let m = &obj["metadata"];
    m["labels"]["app.kubernetes.io/name"] == "gpushare"
        || (m["annotations"]["meta.helm.sh/release-name"] == RELEASE
            && m["annotations"]["meta.helm.sh/release-namespace"] == NAMESPACE
            && m["labels"]["app.kubernetes.io/managed-by"] == "Helm")
}

fn kubectl_target(w: &Wanted) -> String {
    if w.namespaced {
        format!("-n {NAMESPACE} {}/{}", w.kind.to_ascii_lowercase(), w.name)
    } else {
        format!("{}/{}", w.kind.to_ascii_lowercase(), w.name)
    }
}

/// Why a workload must be recreated rather than adopted.
fn workload_reasons(obj: &Value) -> Vec<String> {
    let mut why = Vec::new();
    let pod = &obj["spec"]["template"]["spec"];
    if pod["hostNetwork"] == true {
        why.push("hostNetwork: true".to_string());
    }
    if let Some(sel) = pod["nodeSelector"].as_object() {
        for k in sel.keys().filter(|k| k.as_str() != wire::LABEL_GPUSHARE) {
            why.push(format!("nodeSelector {k}"));
        }
    }
    if let Some(sel) = obj["spec"]["selector"]["matchLabels"].as_object() {
        for (k, v) in sel
            .iter()
            .filter(|(k, _)| !OUR_SELECTOR_KEYS.contains(&k.as_str()))
        {
            why.push(format!(
                "selector label {k}: {} (a selector cannot change)",
                v.as_str().unwrap_or("?")
            ));
        }
    }
    why
}

/// The check, from what the API answered (pure: tested without a cluster).
pub fn assess(found: &[Found]) -> Check {
    let mut detail = Vec::new();
    let mut unread = Vec::new();
    let mut releases = std::collections::BTreeSet::new();
    let (mut keep, mut orphan, mut adopt, mut delete) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (w, answer) in found {
        let obj = match answer {
            Ok(Some(obj)) if !is_ours(obj) => obj,
            Ok(_) => continue,
            Err(e) => {
                unread.push(format!("{} {}: {e}", w.kind, w.name));
                continue;
            }
        };
        let release = obj["metadata"]["annotations"]["meta.helm.sh/release-name"]
            .as_str()
            .map(str::to_string);
        let owner = match &release {
            Some(r) => format!("Helm release {r}"),
            None => "kubectl create".to_string(),
        };
        if let Some(r) = &release {
            releases.insert(r.clone());
        }
        let target = kubectl_target(w);
        if w.installer_only {
            detail.push(format!(
                "{} {} (Aliyun's installer, {owner})",
                w.kind, w.name
            ));
            if release.is_none() {
                delete.push(format!("kubectl delete {target}"));
            }
            continue;
        }
        if release.is_some() {
            // Kept when the old release is uninstalled; taken over (or replaced) afterwards.
            keep.push(format!(
                "kubectl annotate {target} helm.sh/resource-policy=keep --overwrite"
            ));
        }
        if w.kind == "Deployment" || w.kind == "DaemonSet" {
            let why = workload_reasons(obj);
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(": {}", why.join(", "))
            };
            detail.push(format!("{} {} ({owner}){why}", w.kind, w.name));
            orphan.push(format!("kubectl delete {target} --cascade=orphan"));
        } else {
            detail.push(format!("{} {} ({owner})", w.kind, w.name));
            adopt.push(format!(
                "kubectl annotate {target} meta.helm.sh/release-name={RELEASE} \
                 meta.helm.sh/release-namespace={NAMESPACE} --overwrite && \
                 kubectl label {target} app.kubernetes.io/managed-by=Helm --overwrite"
            ));
        }
    }
    if detail.is_empty() {
        return if unread.is_empty() {
            Check::new(
                ID,
                TITLE,
                Status::Ok,
                "no object of an Aliyun gpushare installation",
            )
        } else {
            Check::new(
                ID,
                TITLE,
                Status::Skip,
                format!("cannot tell:\n{}", unread.join("\n")),
            )
        };
    }
    detail.extend(unread.iter().map(|u| format!("cannot read {u}")));
    let mut steps = Vec::new();
    steps.extend(keep);
    steps.extend(
        releases
            .iter()
            .map(|r| format!("helm uninstall {r} -n {NAMESPACE}   # Aliyun's installer release")),
    );
    steps.extend(delete);
    steps.extend(orphan);
    steps.extend(adopt);
    let numbered: Vec<String> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| format!("{}. {s}", i + 1))
        .collect();
    Check::new(ID, TITLE, Status::Warn, detail.join("\n")).hint(format!(
        "before `helm install {RELEASE}` (docs/migration.md); the running \
         pods keep serving until the chart's replace them:\n{}",
        numbered.join("\n")
    ))
}

/// Reads every [`WANTED`] object and assesses them.
pub async fn aliyun_leftovers(api: &ApiState) -> Check {
    let ApiState::Up { client, .. } = api else {
        return Check::new(ID, TITLE, Status::Skip, "no API");
    };
    let mut found = Vec::with_capacity(WANTED.len());
    for w in WANTED {
        let gvk = GroupVersionKind::gvk(w.group, "v1", w.kind);
        let resource = ApiResource::from_gvk_with_plural(&gvk, w.plural);
        let objects: Api<DynamicObject> = if w.namespaced {
            Api::namespaced_with(client.clone(), NAMESPACE, &resource)
        } else {
            Api::all_with(client.clone(), &resource)
        };
        let answer = match tokio::time::timeout(CHECK_TIMEOUT, objects.get_opt(w.name)).await {
            Ok(Ok(o)) => o
                .map(|o| serde_json::to_value(o).map_err(ReadError::Encode))
                .transpose(),
            Ok(Err(e)) => Err(ReadError::from(e)),
            Err(_) => Err(ReadError::TimedOut),
        };
        found.push((*w, answer));
    }
    assess(&found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with(objects: &[(&str, &str, Value)]) -> Vec<Found> {
        WANTED
            .iter()
            .map(|w| {
                let obj = objects
                    .iter()
                    .find(|(k, n, _)| *k == w.kind && *n == w.name)
                    .map(|(_, _, o)| o.clone());
                (*w, Ok(obj))
            })
            .collect()
    }

    fn meta(extra: Value) -> Value {
        let mut o = json!({ "metadata": { "labels": { "app": "gpushare" } } });
        if let (Some(m), Some(e)) = (o["metadata"].as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                m.insert(k.clone(), v.clone());
            }
        }
        o
    }

    /// Aliyun's guide: `kubectl create -f` of its manifests.
    fn guide() -> Vec<(&'static str, &'static str, Value)> {
        let mut deploy = meta(json!({}));
        deploy["spec"] = json!({
            "selector": { "matchLabels": { "app": "gpushare", "component": "gpushare-schd-extender" } },
            "template": { "spec": { "hostNetwork": true, "nodeSelector": { "node-role.kubernetes.io/master": "" } } },
        });
        let mut ds = meta(json!({}));
        ds["spec"] = json!({
            "selector": { "matchLabels": { "app": "gpushare", "component": "gpushare-device-plugin", "name": "gpushare-device-plugin-ds" } },
            "template": { "spec": { "hostNetwork": true, "nodeSelector": { "gpushare": "true" } } },
        });
        vec![
            ("Deployment", "gpushare-schd-extender", deploy),
            ("DaemonSet", "gpushare-device-plugin-ds", ds),
            ("Service", "gpushare-schd-extender", meta(json!({}))),
            ("ServiceAccount", "gpushare-device-plugin", meta(json!({}))),
            ("ClusterRole", "gpushare-device-plugin", meta(json!({}))),
        ]
    }

    #[test]
    fn nothing_there_or_only_ours_is_ok() {
        assert_eq!(assess(&with(&[])).status, Status::Ok);
        let ours = json!({ "metadata": { "labels": { "app.kubernetes.io/name": "gpushare" } },
                           "spec": { "template": { "spec": { "hostNetwork": true } } } });
        let check = assess(&with(&[("Deployment", "gpushare-schd-extender", ours)]));
        assert_eq!(check.status, Status::Ok, "{check:?}");
    }

    #[test]
    fn the_guides_objects_are_orphaned_or_adopted_in_that_order() {
        let check = assess(&with(&guide()));
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("Deployment gpushare-schd-extender (kubectl create): hostNetwork: true, nodeSelector node-role.kubernetes.io/master"), "{}", check.detail);
        assert!(
            check.detail.contains(
                "DaemonSet gpushare-device-plugin-ds (kubectl create): hostNetwork: true"
            ),
            "{}",
            check.detail
        );
        let hint = check.hint.as_str();
        let orphan = hint
            .find(
                "kubectl delete -n kube-system deployment/gpushare-schd-extender --cascade=orphan",
            )
            .expect("orphan the Deployment");
        assert!(
            hint.contains(
                "kubectl delete -n kube-system daemonset/gpushare-device-plugin-ds --cascade=orphan"
            ),
            "{hint}"
        );
        let adopt = hint
            .find("kubectl annotate -n kube-system service/gpushare-schd-extender meta.helm.sh/release-name=gpushare meta.helm.sh/release-namespace=kube-system --overwrite")
            .expect("adopt the Service");
        assert!(orphan < adopt, "{hint}");
        assert!(hint.contains("kubectl label clusterrole/gpushare-device-plugin app.kubernetes.io/managed-by=Helm --overwrite"), "{hint}");
        assert!(!hint.contains("helm uninstall"), "{hint}");
    }

    #[test]
    fn the_installers_release_is_kept_from_then_uninstalled() {
        let mut objects = guide();
        for (_, _, o) in objects.iter_mut() {
            o["metadata"]["annotations"] =
                json!({ "meta.helm.sh/release-name": "gpushare-installer" });
            o["metadata"]["labels"]["type"] = json!("runtime");
        }
        objects[1].2["spec"]["selector"]["matchLabels"]["type"] = json!("runtime");
        objects.push((
            "Job",
            "gpushare-installer",
            meta(json!({ "annotations": { "meta.helm.sh/release-name": "gpushare-installer" } })),
        ));
        objects.push((
            "DaemonSet",
            "device-plugin-evict-ds",
            meta(json!({ "annotations": { "meta.helm.sh/release-name": "gpushare-installer" } })),
        ));
        let check = assess(&with(&objects));
        assert_eq!(check.status, Status::Warn);
        assert!(
            check
                .detail
                .contains("selector label type: runtime (a selector cannot change)"),
            "{}",
            check.detail
        );
        assert!(
            check.detail.contains(
                "Job gpushare-installer (Aliyun's installer, Helm release gpushare-installer)"
            ),
            "{}",
            check.detail
        );
        let hint = check.hint.as_str();
        let keep = hint
            .find("kubectl annotate -n kube-system daemonset/gpushare-device-plugin-ds helm.sh/resource-policy=keep")
            .expect("keep");
        let uninstall = hint
            .find("helm uninstall gpushare-installer -n kube-system")
            .expect("uninstall");
        let orphan = hint.find("--cascade=orphan").expect("orphan");
        assert!(keep < uninstall && uninstall < orphan, "{hint}");
        // The installer's own objects go with its release, not by hand.
        assert!(!hint.contains("delete -n kube-system job/"), "{hint}");
    }

    #[test]
    fn unreadable_objects_are_named_and_never_called_ok() {
        let mut found = with(&[]);
        found[0].1 = Err(ReadError::Refused(
            "deployments.apps is forbidden".to_string(),
        ));
        let check = assess(&found);
        assert_eq!(check.status, Status::Skip);
        assert!(
            check
                .detail
                .contains("Deployment gpushare-schd-extender: deployments.apps is forbidden"),
            "{}",
            check.detail
        );
        let mut found = with(&guide());
        found[2].1 = Err(ReadError::Refused("forbidden".to_string()));
        let check = assess(&found);
        assert_eq!(check.status, Status::Warn);
        assert!(
            check
                .detail
                .contains("cannot read Service gpushare-schd-extender: forbidden"),
            "{}",
            check.detail
        );
        // A Job left by hand (no release) is deleted by name.
        let job = vec![("Job", "gpushare-installer", meta(json!({})))];
        let check = assess(&with(&job));
        assert!(
            check
                .hint
                .as_str()
                .contains("kubectl delete -n kube-system job/gpushare-installer")
        );
    }
}
