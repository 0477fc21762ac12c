//! The resources the sandbox API server knows, and its discovery documents (`/version`,
//! `/api`, `/api/v1`, `/apis`, `/apis/<group>[/<version>]`). Plain (non-aggregated)
//! discovery only.

use std::net::SocketAddr;

use serde_json::{Value, json};

/// One served resource (a plural in one group/version).
#[derive(Debug)]
pub(super) struct ResourceDef {
    /// The key used by the test controls and the store: the plural, or `plural.group` for
    /// a second resource with the same plural.
    pub id: &'static str,
    /// API group (`""` for core).
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
    pub verbs: &'static [&'static str],
    /// Has a `status` subresource (main-resource writes keep `.status`).
    pub status: bool,
    /// Has the `binding` subresource (pods).
    pub binding: bool,
    /// Objects are kept in the store (false for review-style resources).
    pub stored: bool,
}

impl ResourceDef {
    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `PodList` etc.
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// `pods` or `leases.coordination.k8s.io`, as used in error messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// Every served resource.
pub(super) static RESOURCES: &[ResourceDef] = &[
    ResourceDef {
        id: "pods",
        group: "",
        version: "v1",
        plural: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
        short_names: &["po"],
        verbs: ALL_VERBS,
        status: true,
        binding: true,
        stored: true,
    },
    ResourceDef {
        id: "nodes",
        group: "",
        version: "v1",
        plural: "nodes",
        singular: "node",
        kind: "Node",
        namespaced: false,
        short_names: &["no"],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "configmaps",
        group: "",
        version: "v1",
        plural: "configmaps",
        singular: "configmap",
        kind: "ConfigMap",
        namespaced: true,
        short_names: &["cm"],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "events",
        group: "",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        short_names: &["ev"],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "namespaces",
        group: "",
        version: "v1",
        plural: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        namespaced: false,
        short_names: &["ns"],
        verbs: &[
            "create", "delete", "get", "list", "patch", "update", "watch",
        ],
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "leases",
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "events.events.k8s.io",
        group: "events.k8s.io",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        short_names: &["ev"],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "secrets",
        group: "",
        version: "v1",
        plural: "secrets",
        singular: "secret",
        kind: "Secret",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "services",
        group: "",
        version: "v1",
        plural: "services",
        singular: "service",
        kind: "Service",
        namespaced: true,
        short_names: &["svc"],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "deployments",
        group: "apps",
        version: "v1",
        plural: "deployments",
        singular: "deployment",
        kind: "Deployment",
        namespaced: true,
        short_names: &["deploy"],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    // What an Aliyun gpushare installation leaves (doctor's aliyun-leftovers check).
    ResourceDef {
        id: "daemonsets",
        group: "apps",
        version: "v1",
        plural: "daemonsets",
        singular: "daemonset",
        kind: "DaemonSet",
        namespaced: true,
        short_names: &["ds"],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    // What the chart renders besides its workloads (the chart-mode tier creates every object).
    ResourceDef {
        id: "poddisruptionbudgets",
        group: "policy",
        version: "v1",
        plural: "poddisruptionbudgets",
        singular: "poddisruptionbudget",
        kind: "PodDisruptionBudget",
        namespaced: true,
        short_names: &["pdb"],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "priorityclasses",
        group: "scheduling.k8s.io",
        version: "v1",
        plural: "priorityclasses",
        singular: "priorityclass",
        kind: "PriorityClass",
        namespaced: false,
        short_names: &["pc"],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "networkpolicies",
        group: "networking.k8s.io",
        version: "v1",
        plural: "networkpolicies",
        singular: "networkpolicy",
        kind: "NetworkPolicy",
        namespaced: true,
        short_names: &["netpol"],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "jobs",
        group: "batch",
        version: "v1",
        plural: "jobs",
        singular: "job",
        kind: "Job",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "serviceaccounts",
        group: "",
        version: "v1",
        plural: "serviceaccounts",
        singular: "serviceaccount",
        kind: "ServiceAccount",
        namespaced: true,
        short_names: &["sa"],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "clusterroles",
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "clusterroles",
        singular: "clusterrole",
        kind: "ClusterRole",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "clusterrolebindings",
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "clusterrolebindings",
        singular: "clusterrolebinding",
        kind: "ClusterRoleBinding",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "roles",
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "roles",
        singular: "role",
        kind: "Role",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "rolebindings",
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "rolebindings",
        singular: "rolebinding",
        kind: "RoleBinding",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "mutatingwebhookconfigurations",
        group: "admissionregistration.k8s.io",
        version: "v1",
        plural: "mutatingwebhookconfigurations",
        singular: "mutatingwebhookconfiguration",
        kind: "MutatingWebhookConfiguration",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "validatingwebhookconfigurations",
        group: "admissionregistration.k8s.io",
        version: "v1",
        plural: "validatingwebhookconfigurations",
        singular: "validatingwebhookconfiguration",
        kind: "ValidatingWebhookConfiguration",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "validatingadmissionpolicies",
        group: "admissionregistration.k8s.io",
        version: "v1",
        plural: "validatingadmissionpolicies",
        singular: "validatingadmissionpolicy",
        kind: "ValidatingAdmissionPolicy",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "validatingadmissionpolicybindings",
        group: "admissionregistration.k8s.io",
        version: "v1",
        plural: "validatingadmissionpolicybindings",
        singular: "validatingadmissionpolicybinding",
        kind: "ValidatingAdmissionPolicyBinding",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    // Dynamic Resource Allocation (`resource.k8s.io/v1`, GA since 1.34).
    ResourceDef {
        id: "resourceslices",
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceslices",
        singular: "resourceslice",
        kind: "ResourceSlice",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "deviceclasses",
        group: "resource.k8s.io",
        version: "v1",
        plural: "deviceclasses",
        singular: "deviceclass",
        kind: "DeviceClass",
        namespaced: false,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "resourceclaims",
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceclaims",
        singular: "resourceclaim",
        kind: "ResourceClaim",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: true,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "resourceclaimtemplates",
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceclaimtemplates",
        singular: "resourceclaimtemplate",
        kind: "ResourceClaimTemplate",
        namespaced: true,
        short_names: &[],
        verbs: ALL_VERBS,
        status: false,
        binding: false,
        stored: true,
    },
    ResourceDef {
        id: "selfsubjectaccessreviews",
        group: "authorization.k8s.io",
        version: "v1",
        plural: "selfsubjectaccessreviews",
        singular: "selfsubjectaccessreview",
        kind: "SelfSubjectAccessReview",
        namespaced: false,
        short_names: &[],
        verbs: &["create"],
        status: false,
        binding: false,
        stored: false,
    },
    ResourceDef {
        id: "selfsubjectrulesreviews",
        group: "authorization.k8s.io",
        version: "v1",
        plural: "selfsubjectrulesreviews",
        singular: "selfsubjectrulesreview",
        kind: "SelfSubjectRulesReview",
        namespaced: false,
        short_names: &[],
        verbs: &["create"],
        status: false,
        binding: false,
        stored: false,
    },
    ResourceDef {
        id: "selfsubjectreviews",
        group: "authentication.k8s.io",
        version: "v1",
        plural: "selfsubjectreviews",
        singular: "selfsubjectreview",
        kind: "SelfSubjectReview",
        namespaced: false,
        short_names: &[],
        verbs: &["create"],
        status: false,
        binding: false,
        stored: false,
    },
];

/// The groups served under `/apis`.
const GROUPS: &[&str] = &[
    "coordination.k8s.io",
    "authentication.k8s.io",
    "authorization.k8s.io",
    "events.k8s.io",
    "apps",
    "admissionregistration.k8s.io",
    "batch",
    "networking.k8s.io",
    "policy",
    "rbac.authorization.k8s.io",
    "resource.k8s.io",
    "scheduling.k8s.io",
];

/// The resource served at `/<prefix>/<group>/<version>/.../<plural>`.
pub(super) fn by_path(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// The resource with this test-control id (`pods`, `events.events.k8s.io`, ...).
pub(super) fn by_id(id: &str) -> Option<&'static ResourceDef> {
    RESOURCES.iter().find(|r| r.id == id && r.stored)
}

/// The stored resource for an object's `apiVersion` and `kind`.
pub(super) fn by_kind(api_version: &str, kind: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|r| r.stored && r.kind == kind && r.api_version() == api_version)
}

/// `/version`.
pub(super) fn version(minor: u32) -> Value {
    json!({
        "major": "1",
        "minor": minor.to_string(),
        "gitVersion": format!("v1.{minor}.0-gpushare-sandbox"),
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-04-23T00:00:00Z",
        "goVersion": "go1.24.2",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

/// `/api`.
pub(super) fn core_versions(addr: SocketAddr) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": addr.to_string() }],
    })
}

fn group_doc(group: &str) -> Value {
    let gv = json!({ "groupVersion": format!("{group}/v1"), "version": "v1" });
    json!({ "kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": [gv.clone()], "preferredVersion": gv })
}

/// `/apis`.
pub(super) fn group_list() -> Value {
    let groups: Vec<Value> = GROUPS
        .iter()
        .map(|g| {
            let mut doc = group_doc(g);
            if let Some(o) = doc.as_object_mut() {
                o.remove("kind");
                o.remove("apiVersion");
            }
            doc
        })
        .collect();
    json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
}

/// `/apis/<group>`, when served.
pub(super) fn group(group: &str) -> Option<Value> {
    GROUPS.contains(&group).then(|| group_doc(group))
}

/// `/api/v1` or `/apis/<group>/<version>`, when served.
pub(super) fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let mut entry = json!({
            "name": r.plural, "singularName": r.singular, "namespaced": r.namespaced,
            "kind": r.kind, "verbs": r.verbs,
        });
        if !r.short_names.is_empty() && r.group.is_empty() {
            entry["shortNames"] = json!(r.short_names);
        }
        if r.plural == "pods" || r.plural == "nodes" {
            entry["categories"] = json!(["all"]);
        }
        resources.push(entry);
        if r.binding {
            resources.push(
                json!({ "name": format!("{}/binding", r.plural), "singularName": "",
                "namespaced": r.namespaced, "kind": "Binding", "verbs": ["create"] }),
            );
        }
        if r.status {
            resources.push(
                json!({ "name": format!("{}/status", r.plural), "singularName": "",
                "namespaced": r.namespaced, "kind": r.kind, "verbs": ["get", "patch", "update"] }),
            );
        }
    }
    if resources.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
        "resources": resources,
    }))
}

/// The group/version path keys (`api/v1`, `apis/<group>/<version>`) of the OpenAPI v3 root.
fn openapi_keys() -> Vec<(String, &'static str, &'static str)> {
    let mut keys = vec![("api/v1".to_string(), "", "v1")];
    for g in GROUPS {
        keys.push((format!("apis/{g}/v1"), g, "v1"));
    }
    keys
}

/// `/openapi/v3`: the index of per-group-version documents. kubectl reads it to learn that
/// the server validates fields itself (`fieldValidation`), and then skips client-side
/// schema validation (which would need `/openapi/v2`, not served).
pub(super) fn openapi_v3_root() -> Value {
    let paths: serde_json::Map<String, Value> = openapi_keys()
        .into_iter()
        .map(|(key, _, _)| {
            let url = format!("/openapi/v3/{key}?hash=gpushare-sandbox-1");
            (key, json!({ "serverRelativeURL": url }))
        })
        .collect();
    json!({ "paths": paths })
}

/// `/openapi/v3/<api/v1 | apis/group/version>`: a minimal OpenAPI 3 document listing, per
/// resource, the PATCH operation with its group-version-kind and the `fieldValidation`
/// parameter. No schemas.
pub(super) fn openapi_v3_group_version(key: &str) -> Option<Value> {
    let (_, group, version) = openapi_keys().into_iter().find(|(k, _, _)| k == key)?;
    let mut paths = serde_json::Map::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let gvk = json!({ "group": r.group, "version": r.version, "kind": r.kind });
        let params = json!([
            { "name": "dryRun", "in": "query", "schema": { "type": "string" } },
            { "name": "fieldManager", "in": "query", "schema": { "type": "string" } },
            { "name": "fieldValidation", "in": "query", "schema": { "type": "string" } },
        ]);
        let op = |action: &str| {
            json!({ "x-kubernetes-group-version-kind": gvk, "x-kubernetes-action": action,
                    "parameters": params, "responses": { "200": { "description": "OK" } } })
        };
        let prefix = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let collection = if r.namespaced {
            format!("{prefix}/namespaces/{{namespace}}/{}", r.plural)
        } else {
            format!("{prefix}/{}", r.plural)
        };
        if r.stored {
            paths.insert(
                format!("{collection}/{{name}}"),
                json!({ "patch": op("patch"), "put": op("put") }),
            );
        }
        paths.insert(collection, json!({ "post": op("post") }));
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": { "title": "Kubernetes (gpushare sandbox)", "version": "v1.33.0" },
        "paths": paths,
        "components": { "schemas": {} },
    }))
}

/// The `(path, group, version, kind)` of every PATCH operation in the OpenAPI v2 document.
fn patch_operations() -> Vec<(String, &'static str, &'static str, &'static str)> {
    RESOURCES
        .iter()
        .filter(|r| r.stored)
        .map(|r| {
            let prefix = if r.group.is_empty() {
                format!("/api/{}", r.version)
            } else {
                format!("/apis/{}/{}", r.group, r.version)
            };
            let path = if r.namespaced {
                format!("{prefix}/namespaces/{{namespace}}/{}/{{name}}", r.plural)
            } else {
                format!("{prefix}/{}/{{name}}", r.plural)
            };
            (path, r.group, r.version, r.kind)
        })
        .collect()
}

/// `/openapi/v2` as JSON: a Swagger 2.0 document with only the PATCH operations and their
/// `fieldValidation` parameter (what kubectl 1.27's field-validation check reads). No
/// definitions.
pub(super) fn openapi_v2_json() -> Value {
    let mut paths = serde_json::Map::new();
    for (path, group, version, kind) in patch_operations() {
        paths.insert(
            path,
            json!({ "patch": {
                "x-kubernetes-group-version-kind": { "group": group, "version": version, "kind": kind },
                "parameters": [{ "name": "fieldValidation", "in": "query", "type": "string", "uniqueItems": true }],
                "responses": { "200": { "description": "OK" } },
            }}),
        );
    }
    json!({
        "swagger": "2.0",
        "info": { "title": "Kubernetes (gpushare sandbox)", "version": "v1.33.0" },
        "paths": paths,
        "definitions": {},
    })
}

/// Protobuf wire encoding, just enough for the gnostic `openapi.v2.Document` below.
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn bytes(mut self, field: u32, data: &[u8]) -> Proto {
        self.varint(u64::from(field) << 3 | 2);
        self.varint(data.len() as u64);
        self.0.extend_from_slice(data);
        self
    }

    fn string(self, field: u32, s: &str) -> Proto {
        self.bytes(field, s.as_bytes())
    }

    fn message(self, field: u32, inner: Proto) -> Proto {
        self.bytes(field, &inner.0)
    }
}

/// `/openapi/v2` as protobuf (`application/com.github.proto-openapi.spec.v2.v1.0+protobuf`),
/// the form kubectl asks for: gnostic `openapi.v2.Document` with the same content as
/// [`openapi_v2_json`].
pub(super) fn openapi_v2_protobuf() -> Vec<u8> {
    let mut paths = Proto(Vec::new());
    for (path, group, version, kind) in patch_operations() {
        // QueryParameterSubSchema { in = 2, name = 4, type = 6 }
        let query = Proto(Vec::new())
            .string(2, "query")
            .string(4, "fieldValidation")
            .string(6, "string");
        // ParametersItem { parameter = 1 { non_body_parameter = 2 { query = 3 } } }
        let parameter = Proto(Vec::new()).message(
            1,
            Proto(Vec::new()).message(2, Proto(Vec::new()).message(3, query)),
        );
        // NamedAny { name = 1, value = 2 { yaml = 2 } }
        let yaml = format!("group: \"{group}\"\nkind: {kind}\nversion: {version}\n");
        let gvk = Proto(Vec::new())
            .string(1, "x-kubernetes-group-version-kind")
            .message(2, Proto(Vec::new()).string(2, &yaml));
        // Operation { parameters = 8, vendor_extension = 13 }
        let operation = Proto(Vec::new()).message(8, parameter).message(13, gvk);
        // NamedPathItem { name = 1, value = 2 { patch = 8 } }
        let item = Proto(Vec::new())
            .string(1, &path)
            .message(2, Proto(Vec::new()).message(8, operation));
        // Paths { path = 2 }
        paths = paths.message(2, item);
    }
    // Document { swagger = 1, info = 2 { title = 1, version = 2 }, paths = 8 }
    Proto(Vec::new())
        .string(1, "2.0")
        .message(
            2,
            Proto(Vec::new())
                .string(1, "Kubernetes (gpushare sandbox)")
                .string(2, "v1.33.0"),
        )
        .message(8, paths)
        .0
}
