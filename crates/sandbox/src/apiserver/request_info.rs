//! What a request asks for, in authorization terms: upstream's `RequestInfoFactory`
//! (`k8s.io/apiserver/pkg/endpoints/request/requestinfo.go`) for the prefixes `/api`
//! (groupless) and `/apis`.
//!
//! A resource request has a verb (`get`, `list`, `watch`, `create`, `update`, `patch`,
//! `delete`, `deletecollection`; the legacy `/watch/` path prefix too), an API group and
//! version, a namespace, a resource, a subresource and a name. A GET without a name is a
//! `list`, or a `watch` with a `watch` parameter other than `0`/`false`; a DELETE without a
//! name is a `deletecollection`. A list or watch whose `fieldSelector` requires
//! `metadata.name=<name>` is authorized as a request for that name (upstream since 1.11), so
//! RBAC `resourceNames` can grant it. Every other path (`/version`, `/api`, `/apis/<group>`,
//! `/openapi/...`, `/healthz`) is a non-resource request whose verb is the lower-case method.
//!
//! Not here: the `AuthorizeWithSelectors` field and label selector attributes (webhook
//! authorizers only), the `proxy` verb (the sandbox serves no proxy).

use http::Method;

/// The authorization attributes of one request (upstream's `RequestInfo`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RequestInfo {
    /// A resource request (else a non-resource URL).
    pub resource_request: bool,
    /// The URL path.
    pub path: String,
    /// The Kubernetes verb (resource requests) or the lower-case HTTP method.
    pub verb: String,
    /// `""` for core.
    pub api_group: String,
    pub api_version: String,
    /// `""` for cluster-scoped requests.
    pub namespace: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
}

impl RequestInfo {
    /// `resource` or `resource/subresource`.
    pub fn combined_resource(&self) -> String {
        if self.subresource.is_empty() {
            self.resource.clone()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        }
    }
}

/// The request info of `method path?query` (the query already decoded into pairs).
pub(crate) fn resolve(method: &Method, path: &str, query: &[(String, String)]) -> RequestInfo {
    let mut info = RequestInfo {
        resource_request: false,
        path: path.to_string(),
        verb: method.as_str().to_ascii_lowercase(),
        ..RequestInfo::default()
    };
    let mut parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    if path.trim_matches('/').is_empty() || parts.len() < 3 {
        return info;
    }
    let prefix = parts[0];
    if prefix != "api" && prefix != "apis" {
        return info;
    }
    parts.remove(0);
    if prefix == "apis" {
        if parts.len() < 3 {
            return info;
        }
        info.api_group = parts.remove(0).to_string();
    }
    info.resource_request = true;
    info.api_version = parts.remove(0).to_string();
    if parts.first() == Some(&"watch") || parts.first() == Some(&"proxy") {
        if parts.len() < 2 {
            return info;
        }
        info.verb = parts.remove(0).to_string();
    } else {
        info.verb = match *method {
            Method::POST => "create",
            Method::GET | Method::HEAD => "get",
            Method::PUT => "update",
            Method::PATCH => "patch",
            Method::DELETE => "delete",
            _ => "",
        }
        .to_string();
    }
    if parts.first() == Some(&"namespaces")
        && let Some(ns) = parts.get(1)
    {
        info.namespace = ns.to_string();
        if parts.len() > 2 && !matches!(parts[2], "status" | "finalize") {
            parts.drain(..2);
        }
    }
    if parts.len() >= 3 && info.verb != "proxy" {
        info.subresource = parts[2].to_string();
    }
    if parts.len() >= 2 {
        info.name = parts[1].to_string();
    }
    if let Some(resource) = parts.first() {
        info.resource = resource.to_string();
    }
    if info.name.is_empty() && info.verb == "get" {
        let param = |name: &str| query.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        info.verb = match param("watch") {
            Some(v) if v == "0" || v.eq_ignore_ascii_case("false") => "list",
            Some(_) => "watch",
            None => "list",
        }
        .to_string();
        if let Some(name) = param("fieldSelector").and_then(|s| exact_name(s)) {
            info.name = name;
        }
    }
    if info.name.is_empty() && info.verb == "delete" {
        info.verb = "deletecollection".to_string();
    }
    info
}

/// The name a field selector requires (`metadata.name=<n>` or `==`, among other terms), when
/// it is a valid path segment.
fn exact_name(selector: &str) -> Option<String> {
    selector
        .split(',')
        .find_map(|term| {
            let term = term.trim();
            let (key, value) = term
                .split_once("==")
                .or_else(|| term.split_once('='))
                .filter(|(k, _)| !k.ends_with('!'))?;
            (key.trim() == "metadata.name").then(|| value.trim().to_string())
        })
        .filter(|n| !n.is_empty() && n != "." && n != ".." && !n.contains(['/', '%']))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(method: Method, path_and_query: &str) -> RequestInfo {
        let (path, query) = path_and_query
            .split_once('?')
            .unwrap_or((path_and_query, ""));
        let pairs: Vec<(String, String)> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (k.to_string(), v.to_string())
            })
            .collect();
        resolve(&method, path, &pairs)
    }

    /// (resource request, verb, group, namespace, resource, subresource, name)
    type Short<'a> = (bool, &'a str, &'a str, &'a str, &'a str, &'a str, &'a str);

    fn short(i: &RequestInfo) -> Short<'_> {
        (
            i.resource_request,
            i.verb.as_str(),
            i.api_group.as_str(),
            i.namespace.as_str(),
            i.resource.as_str(),
            i.subresource.as_str(),
            i.name.as_str(),
        )
    }

    #[test]
    fn requests_resolve_as_upstream_resolves_them() {
        use Method as M;
        let table: &[(Method, &str, Short<'_>)] = &[
            (
                M::GET,
                "/api/v1/pods",
                (true, "list", "", "", "pods", "", ""),
            ),
            (
                M::GET,
                "/api/v1/namespaces/ml/pods?watch=true",
                (true, "watch", "", "ml", "pods", "", ""),
            ),
            (
                M::GET,
                "/api/v1/namespaces/ml/pods?watch=false",
                (true, "list", "", "ml", "pods", "", ""),
            ),
            (
                M::GET,
                "/api/v1/namespaces/ml/pods/p",
                (true, "get", "", "ml", "pods", "", "p"),
            ),
            (
                M::POST,
                "/api/v1/namespaces/ml/pods/p/binding",
                (true, "create", "", "ml", "pods", "binding", "p"),
            ),
            (
                M::PATCH,
                "/api/v1/nodes/n1/status",
                (true, "patch", "", "", "nodes", "status", "n1"),
            ),
            (
                M::PUT,
                "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c/status",
                (
                    true,
                    "update",
                    "resource.k8s.io",
                    "ml",
                    "resourceclaims",
                    "status",
                    "c",
                ),
            ),
            (
                M::DELETE,
                "/api/v1/namespaces/ml/pods",
                (true, "deletecollection", "", "ml", "pods", "", ""),
            ),
            (
                M::DELETE,
                "/api/v1/namespaces/ml/pods/p",
                (true, "delete", "", "ml", "pods", "", "p"),
            ),
            (
                M::GET,
                "/api/v1/namespaces/ml",
                (true, "get", "", "ml", "namespaces", "", "ml"),
            ),
            (
                M::PUT,
                "/api/v1/namespaces/ml/finalize",
                (true, "update", "", "ml", "namespaces", "finalize", "ml"),
            ),
            (
                M::GET,
                "/api/v1/namespaces",
                (true, "list", "", "", "namespaces", "", ""),
            ),
            (
                M::GET,
                "/api/v1/watch/namespaces/ml/pods",
                (true, "watch", "", "ml", "pods", "", ""),
            ),
            (
                M::GET,
                "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases?fieldSelector=metadata.name=gpushare&watch=1",
                (
                    true,
                    "watch",
                    "coordination.k8s.io",
                    "kube-system",
                    "leases",
                    "",
                    "gpushare",
                ),
            ),
            (
                M::GET,
                "/api/v1/namespaces/ml/configmaps?fieldSelector=metadata.name!=x",
                (true, "list", "", "ml", "configmaps", "", ""),
            ),
            (
                M::GET,
                "/api/v1/pods?fieldSelector=spec.nodeName=n1,metadata.name==p",
                (true, "list", "", "", "pods", "", "p"),
            ),
            (
                M::POST,
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                (
                    true,
                    "create",
                    "authorization.k8s.io",
                    "",
                    "selfsubjectaccessreviews",
                    "",
                    "",
                ),
            ),
            (
                M::GET,
                "/apis/coordination.k8s.io/v1",
                (false, "get", "", "", "", "", ""),
            ),
            (M::GET, "/api/v1", (false, "get", "", "", "", "", "")),
            (M::GET, "/version", (false, "get", "", "", "", "", "")),
            (
                M::GET,
                "/openapi/v3/apis/apps/v1",
                (false, "get", "", "", "", "", ""),
            ),
            (M::POST, "/healthz", (false, "post", "", "", "", "", "")),
        ];
        for (method, path, want) in table {
            let got = info(method.clone(), path);
            assert_eq!(short(&got), *want, "{method} {path}");
        }
    }
}
