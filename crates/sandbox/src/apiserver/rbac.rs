//! Authorization as kube-apiserver decides it with `--authorization-mode=RBAC`: upstream's
//! privileged group (`system:masters` is allowed everything), then the RBAC authorizer
//! (`plugin/pkg/auth/authorizer/rbac`) over the stored Roles, ClusterRoles, RoleBindings and
//! ClusterRoleBindings; anything not allowed is denied with upstream's 403 `Status`.
//!
//! As upstream: ClusterRoleBindings are visited first, then (for a namespaced request) the
//! RoleBindings of the request's namespace; a binding applies when one of its subjects is the
//! user (`User`), one of its groups (`Group`) or its ServiceAccount (`ServiceAccount`, the
//! namespace defaulting to the RoleBinding's); a rule allows a resource request when its verbs,
//! apiGroups, resources (`*`, `resource/subresource`, `*/subresource`) and resourceNames (empty:
//! any name; a request without a name matches none) all match, and a non-resource request when
//! its verbs and nonResourceURLs (`*`, exact, or a `prefix*`) match. A binding whose role is
//! missing contributes the error text upstream appends to the denial (`RBAC: clusterrole.rbac.
//! authorization.k8s.io "x" not found`).
//!
//! The bootstrap policy a cluster starts with is seeded by [`bootstrap_objects`]:
//! `cluster-admin` (bound to `system:masters`), `system:discovery`, `system:basic-user` (the
//! self reviews) and `system:public-info-viewer`, bound as upstream binds them.
//!
//! Not here: ClusterRole aggregation (`aggregationRule` is stored, its rules are not filled
//! in), the Node authorizer (`system:node:<name>` users get only what RBAC grants them),
//! escalation checks on writes of roles and bindings.

use serde_json::{Value, json};

use super::identity::{Identity, MASTERS};
use super::request_info::RequestInfo;
use super::store::{ApiError, Store, meta_str};

/// What the authorizers decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    pub allowed: bool,
    /// `RBAC: allowed by ...`, or on a denial the resolution errors (often empty).
    pub reason: String,
}

/// One PolicyRule, as stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Rule {
    pub verbs: Vec<String>,
    pub api_groups: Vec<String>,
    pub resources: Vec<String>,
    pub resource_names: Vec<String>,
    pub non_resource_urls: Vec<String>,
}

fn strings(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|l| {
            l.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

impl Rule {
    fn from_json(rule: &Value) -> Rule {
        Rule {
            verbs: strings(rule.get("verbs")),
            api_groups: strings(rule.get("apiGroups")),
            resources: strings(rule.get("resources")),
            resource_names: strings(rule.get("resourceNames")),
            non_resource_urls: strings(rule.get("nonResourceURLs")),
        }
    }

    /// Upstream's `RuleAllows`.
    pub fn allows(&self, request: &RequestInfo) -> bool {
        let verb = self.verbs.iter().any(|v| v == "*" || *v == request.verb);
        if !request.resource_request {
            return verb
                && self.non_resource_urls.iter().any(|u| {
                    u == "*"
                        || *u == request.path
                        || (u.ends_with('*') && request.path.starts_with(u.trim_end_matches('*')))
                });
        }
        let combined = request.combined_resource();
        let sub = &request.subresource;
        verb && self
            .api_groups
            .iter()
            .any(|g| g == "*" || *g == request.api_group)
            && self.resources.iter().any(|r| {
                r == "*"
                    || *r == combined
                    || (!sub.is_empty()
                        && r.len() == sub.len() + 2
                        && r.starts_with("*/")
                        && r.ends_with(sub.as_str()))
            })
            && (self.resource_names.is_empty() || self.resource_names.contains(&request.name))
    }

    fn to_json(&self) -> (Option<Value>, Option<Value>) {
        let resource = (!self.resources.is_empty()).then(|| {
            let mut r = json!({ "verbs": self.verbs, "apiGroups": self.api_groups,
                                "resources": self.resources });
            if !self.resource_names.is_empty() {
                r["resourceNames"] = json!(self.resource_names);
            }
            r
        });
        let non_resource = (!self.non_resource_urls.is_empty())
            .then(|| json!({ "verbs": self.verbs, "nonResourceURLs": self.non_resource_urls }));
        (resource, non_resource)
    }
}

/// Where an allowing rule came from (upstream's describer).
fn describe(binding_kind: &str, binding: &Value, subject: &Value) -> String {
    let name = meta_str(binding, "name").unwrap_or("");
    let namespace = meta_str(binding, "namespace").unwrap_or("");
    let binding_name = if binding_kind == "RoleBinding" {
        format!("{name}/{namespace}")
    } else {
        name.to_string()
    };
    let str_of = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let role_ref = binding.get("roleRef").cloned().unwrap_or(Value::Null);
    let subject_kind = str_of(subject, "kind");
    let subject_name = str_of(subject, "name");
    let described = if subject_kind == "ServiceAccount" {
        let ns = match str_of(subject, "namespace") {
            ns if ns.is_empty() => namespace.to_string(),
            ns => ns,
        };
        format!("{subject_kind} {:?}", format!("{subject_name}/{ns}"))
    } else {
        format!("{subject_kind} {subject_name:?}")
    };
    format!(
        "{binding_kind} {binding_name:?} of {} {:?} to {described}",
        str_of(&role_ref, "kind"),
        str_of(&role_ref, "name"),
    )
}

/// Upstream's `appliesToUser` for one subject; `namespace` is the RoleBinding's ("" for a
/// ClusterRoleBinding).
fn applies(user: &Identity, subject: &Value, namespace: &str) -> bool {
    let field = |k: &str| subject.get(k).and_then(Value::as_str).unwrap_or("");
    match field("kind") {
        "User" => user.username == field("name"),
        "Group" => user.in_group(field("name")),
        "ServiceAccount" => {
            let ns = match field("namespace") {
                "" => namespace,
                ns => ns,
            };
            !ns.is_empty()
                && user.username == format!("system:serviceaccount:{ns}:{}", field("name"))
        }
        _ => false,
    }
}

/// The rules of a binding's role, or upstream's lister error.
fn role_rules(
    store: &Store,
    role_ref: Option<&Value>,
    namespace: &str,
) -> Result<Vec<Rule>, String> {
    let field = |k: &str| {
        role_ref
            .and_then(|r| r.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
    };
    let name = field("name");
    let role = match field("kind") {
        "Role" => store
            .get_by_id("roles", Some(namespace).filter(|n| !n.is_empty()), name)
            .filter(|_| !namespace.is_empty())
            .ok_or_else(|| format!("role.rbac.authorization.k8s.io {name:?} not found"))?,
        "ClusterRole" => store
            .get_by_id("clusterroles", None, name)
            .ok_or_else(|| format!("clusterrole.rbac.authorization.k8s.io {name:?} not found"))?,
        other => return Err(format!("unsupported role reference kind: {other:?}")),
    };
    Ok(role
        .get("rules")
        .and_then(Value::as_array)
        .map(|rules| rules.iter().map(Rule::from_json).collect())
        .unwrap_or_default())
}

/// Upstream's `VisitRulesFor`: calls `visit(source, rule)` for each rule that applies to `user`
/// in `namespace` until it returns `false`; returns the resolution errors met on the way.
fn visit_rules(
    store: &Store,
    user: &Identity,
    namespace: &str,
    visit: &mut dyn FnMut(&dyn Fn() -> String, &Rule) -> bool,
) -> Vec<String> {
    let mut errors = Vec::new();
    let mut scopes = vec![(
        "ClusterRoleBinding",
        store.list_by_id("clusterrolebindings", None),
        "",
    )];
    if !namespace.is_empty() {
        scopes.push((
            "RoleBinding",
            store.list_by_id("rolebindings", Some(namespace)),
            namespace,
        ));
    }
    for (kind, bindings, binding_ns) in scopes {
        for binding in &bindings {
            let subjects = binding
                .get("subjects")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let Some(subject) = subjects.iter().find(|s| applies(user, s, binding_ns)) else {
                continue;
            };
            match role_rules(store, binding.get("roleRef"), binding_ns) {
                Err(e) => errors.push(e),
                Ok(rules) => {
                    let source = || describe(kind, binding, subject);
                    for rule in &rules {
                        if !visit(&source, rule) {
                            return errors;
                        }
                    }
                }
            }
        }
    }
    errors
}

/// Whether `user` may do what `request` asks.
pub(crate) fn authorize(store: &Store, user: &Identity, request: &RequestInfo) -> Decision {
    if user.in_group(MASTERS) {
        return Decision {
            allowed: true,
            reason: String::new(),
        };
    }
    let mut allowed_by = None;
    let errors = visit_rules(store, user, &request.namespace, &mut |source, rule| {
        if rule.allows(request) {
            allowed_by = Some(format!("RBAC: allowed by {}", source()));
            return false;
        }
        true
    });
    match allowed_by {
        Some(reason) => Decision {
            allowed: true,
            reason,
        },
        None => Decision {
            allowed: false,
            reason: if errors.is_empty() {
                String::new()
            } else if errors.len() == 1 {
                format!("RBAC: {}", errors[0])
            } else {
                format!("RBAC: [{}]", errors.join(", "))
            },
        },
    }
}

/// Every rule that applies to `user` in `namespace` (a SelfSubjectRulesReview's answer):
/// `(resourceRules, nonResourceRules, evaluationError)`.
pub(crate) fn rules_for(
    store: &Store,
    user: &Identity,
    namespace: &str,
) -> (Vec<Value>, Vec<Value>, Vec<String>) {
    let mut resource_rules = Vec::new();
    let mut non_resource_rules = Vec::new();
    if user.in_group(MASTERS) {
        resource_rules.push(json!({ "verbs": ["*"], "apiGroups": ["*"], "resources": ["*"] }));
        non_resource_rules.push(json!({ "verbs": ["*"], "nonResourceURLs": ["*"] }));
    }
    let errors = visit_rules(store, user, namespace, &mut |_, rule| {
        let (resource, non_resource) = rule.to_json();
        resource_rules.extend(resource);
        non_resource_rules.extend(non_resource);
        true
    });
    (resource_rules, non_resource_rules, errors)
}

/// Upstream's 403 for a request the authorizers did not allow (`responsewriters.Forbidden`).
pub(crate) fn forbidden(user: &Identity, request: &RequestInfo, reason: &str) -> ApiError {
    let mut message = if !request.resource_request {
        format!(
            "User {:?} cannot {} path {:?}",
            user.username, request.verb, request.path
        )
    } else if !request.namespace.is_empty() {
        format!(
            "User {:?} cannot {} resource {:?} in API group {:?} in the namespace {:?}",
            user.username,
            request.verb,
            request.combined_resource(),
            request.api_group,
            request.namespace
        )
    } else {
        format!(
            "User {:?} cannot {} resource {:?} in API group {:?} at the cluster scope",
            user.username,
            request.verb,
            request.combined_resource(),
            request.api_group,
        )
    };
    if !reason.is_empty() {
        message = format!("{message}: {reason}");
    }
    ApiError::forbidden(
        &request.api_group,
        if request.resource_request {
            &request.resource
        } else {
            ""
        },
        &request.name,
        &message,
    )
}

/// The bootstrap ClusterRoles and ClusterRoleBindings every cluster starts with (the subset
/// that matters to clients: administrators, discovery, self reviews, version and health).
pub(crate) fn bootstrap_objects() -> Vec<Value> {
    let meta = |name: &str| {
        json!({ "name": name, "labels": { "kubernetes.io/bootstrapping": "rbac-defaults" },
                "annotations": { "rbac.authorization.kubernetes.io/autoupdate": "true" } })
    };
    let role = |name: &str, rules: Value| {
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": meta(name), "rules": rules })
    };
    let binding = |name: &str, groups: &[&str]| {
        let subjects: Vec<Value> = groups
            .iter()
            .map(|g| json!({ "apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": g }))
            .collect();
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": meta(name),
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name },
                "subjects": subjects })
    };
    let health = ["/healthz", "/livez", "/readyz", "/version", "/version/"];
    let mut discovery: Vec<&str> = vec![
        "/api",
        "/api/*",
        "/apis",
        "/apis/*",
        "/openapi",
        "/openapi/*",
    ];
    discovery.extend(health);
    vec![
        role(
            "cluster-admin",
            json!([
                { "apiGroups": ["*"], "resources": ["*"], "verbs": ["*"] },
                { "nonResourceURLs": ["*"], "verbs": ["*"] },
            ]),
        ),
        role(
            "system:discovery",
            json!([{ "nonResourceURLs": discovery, "verbs": ["get"] }]),
        ),
        role(
            "system:public-info-viewer",
            json!([{ "nonResourceURLs": health, "verbs": ["get"] }]),
        ),
        role(
            "system:basic-user",
            json!([
                { "apiGroups": ["authorization.k8s.io"],
                  "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                  "verbs": ["create"] },
                { "apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"],
                  "verbs": ["create"] },
            ]),
        ),
        binding("cluster-admin", &[MASTERS]),
        binding("system:discovery", &["system:authenticated"]),
        binding(
            "system:public-info-viewer",
            &["system:authenticated", "system:unauthenticated"],
        ),
        binding("system:basic-user", &["system:authenticated"]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apiserver::request_info::resolve;

    fn request(method: http::Method, path: &str, query: &[(&str, &str)]) -> RequestInfo {
        let q: Vec<(String, String)> = query
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        resolve(&method, path, &q)
    }

    fn rule(v: Value) -> Rule {
        Rule::from_json(&v)
    }

    #[test]
    fn rules_match_as_upstream_helpers_match() {
        use http::Method as M;
        let get_pod = request(M::GET, "/api/v1/namespaces/ml/pods/p", &[]);
        let list_pods = request(M::GET, "/api/v1/namespaces/ml/pods", &[]);
        let bind = request(M::POST, "/api/v1/namespaces/ml/pods/p/binding", &[]);
        let node_status = request(M::PATCH, "/api/v1/nodes/n/status", &[]);
        let lease_watch = request(
            M::GET,
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases",
            &[("watch", "1"), ("fieldSelector", "metadata.name=l")],
        );
        let version = request(M::GET, "/version", &[]);
        let apis = request(M::GET, "/apis/apps/v1", &[]);
        let table: &[(Value, &RequestInfo, bool)] = &[
            (
                json!({ "verbs": ["get"], "apiGroups": [""], "resources": ["pods"] }),
                &get_pod,
                true,
            ),
            (
                json!({ "verbs": ["*"], "apiGroups": ["*"], "resources": ["*"] }),
                &get_pod,
                true,
            ),
            (
                json!({ "verbs": ["get"], "apiGroups": ["apps"], "resources": ["pods"] }),
                &get_pod,
                false,
            ),
            (
                json!({ "verbs": ["list"], "apiGroups": [""], "resources": ["pods"] }),
                &get_pod,
                false,
            ),
            (
                json!({ "verbs": ["get"], "apiGroups": [""], "resources": ["pods"], "resourceNames": ["p"] }),
                &get_pod,
                true,
            ),
            (
                json!({ "verbs": ["get"], "apiGroups": [""], "resources": ["pods"], "resourceNames": ["q"] }),
                &get_pod,
                false,
            ),
            // resourceNames never match a request without a name
            (
                json!({ "verbs": ["list"], "apiGroups": [""], "resources": ["pods"], "resourceNames": ["p"] }),
                &list_pods,
                false,
            ),
            // a resource does not grant its subresources, nor `*` a subresource of another
            (
                json!({ "verbs": ["create"], "apiGroups": [""], "resources": ["pods"] }),
                &bind,
                false,
            ),
            (
                json!({ "verbs": ["create"], "apiGroups": [""], "resources": ["pods/binding"] }),
                &bind,
                true,
            ),
            (
                json!({ "verbs": ["create"], "apiGroups": [""], "resources": ["*/binding"] }),
                &bind,
                true,
            ),
            (
                json!({ "verbs": ["create"], "apiGroups": [""], "resources": ["*/status"] }),
                &bind,
                false,
            ),
            (
                json!({ "verbs": ["create"], "apiGroups": [""], "resources": ["*"] }),
                &bind,
                true,
            ),
            (
                json!({ "verbs": ["patch"], "apiGroups": [""], "resources": ["nodes"] }),
                &node_status,
                false,
            ),
            (
                json!({ "verbs": ["patch"], "apiGroups": [""], "resources": ["nodes/status"] }),
                &node_status,
                true,
            ),
            // a named watch is authorized by name
            (
                json!({ "verbs": ["get", "update"], "apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["l"] }),
                &lease_watch,
                false,
            ),
            (
                json!({ "verbs": ["watch"], "apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["l"] }),
                &lease_watch,
                true,
            ),
            (
                json!({ "verbs": ["get"], "nonResourceURLs": ["/version"] }),
                &version,
                true,
            ),
            (
                json!({ "verbs": ["get"], "nonResourceURLs": ["/apis/*"] }),
                &apis,
                true,
            ),
            (
                json!({ "verbs": ["get"], "nonResourceURLs": ["/api/*"] }),
                &apis,
                false,
            ),
            (
                json!({ "verbs": ["get"], "apiGroups": ["*"], "resources": ["*"] }),
                &version,
                false,
            ),
            (
                json!({ "verbs": ["*"], "nonResourceURLs": ["*"] }),
                &apis,
                true,
            ),
        ];
        for (r, req, want) in table {
            assert_eq!(rule(r.clone()).allows(req), *want, "{r} on {req:?}");
        }
    }

    #[test]
    fn bindings_grant_by_user_group_and_service_account() {
        let mut store = Store::new();
        for obj in bootstrap_objects() {
            store.create_value(obj).expect("bootstrap object");
        }
        for doc in [
            json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                    "metadata": { "name": "pod-reader" },
                    "rules": [{ "verbs": ["get", "list"], "apiGroups": [""], "resources": ["pods"] }] }),
            json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": { "name": "read", "namespace": "ml" },
                    "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "pod-reader" },
                    "subjects": [{ "kind": "ServiceAccount", "name": "reader" }] }),
            json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                    "metadata": { "name": "dangling" },
                    "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "gone" },
                    "subjects": [{ "kind": "Group", "name": "system:serviceaccounts" }] }),
        ] {
            store.create_value(doc).expect("rbac object");
        }
        let reader = Identity::service_account("ml", "reader");
        let other_ns = Identity::service_account("other", "reader");
        let get = request(http::Method::GET, "/api/v1/namespaces/ml/pods/p", &[]);
        let decision = authorize(&store, &reader, &get);
        assert!(decision.allowed, "{decision:?}");
        assert_eq!(
            decision.reason,
            "RBAC: allowed by RoleBinding \"read/ml\" of ClusterRole \"pod-reader\" to ServiceAccount \"reader/ml\""
        );
        let denied = authorize(&store, &other_ns, &get);
        assert!(!denied.allowed);
        assert_eq!(
            denied.reason,
            "RBAC: clusterrole.rbac.authorization.k8s.io \"gone\" not found"
        );
        let err = forbidden(&other_ns, &get, &denied.reason);
        assert_eq!(err.code, 403);
        assert_eq!(
            err.message,
            "pods \"p\" is forbidden: User \"system:serviceaccount:other:reader\" cannot get resource \"pods\" \
             in API group \"\" in the namespace \"ml\": RBAC: clusterrole.rbac.authorization.k8s.io \"gone\" not found"
        );
        let nodes = request(http::Method::GET, "/api/v1/nodes", &[]);
        let err = forbidden(&reader, &nodes, "");
        assert_eq!(
            err.message,
            "nodes is forbidden: User \"system:serviceaccount:ml:reader\" cannot list resource \"nodes\" \
             in API group \"\" at the cluster scope"
        );
        // Discovery and the self reviews are every authenticated user's.
        assert!(
            authorize(
                &store,
                &reader,
                &request(http::Method::GET, "/apis/apps/v1", &[])
            )
            .allowed
        );
        let ssar = request(
            http::Method::POST,
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            &[],
        );
        assert!(authorize(&store, &reader, &ssar).allowed);
        let healthz = request(http::Method::POST, "/healthz", &[]);
        assert_eq!(
            forbidden(&reader, &healthz, "").message,
            "forbidden: User \"system:serviceaccount:ml:reader\" cannot post path \"/healthz\""
        );
        assert!(authorize(&store, &Identity::admin(), &nodes).allowed);
        let (resource, non_resource, errors) = rules_for(&store, &reader, "ml");
        assert!(resource.contains(
            &json!({ "verbs": ["get", "list"], "apiGroups": [""], "resources": ["pods"] })
        ));
        assert!(!non_resource.is_empty());
        assert_eq!(errors.len(), 1);
    }
}
