//! The checks that ask the API server: `api-server` (reachable, which version), `rbac`
//! (SelfSubjectAccessReview for every verb the extender and the device plugin use) and
//! `node-label` (this node carries `gpushare=true`). Every request runs under a short
//! deadline so an unreachable or slow API server cannot hang doctor.

use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;

use super::host::HostRoot;
use super::report::{Check, Status};
use crate::config::Config;
use crate::core::wire;
use crate::failure::one_line;
use crate::k8s::{ClientOptions, client, describe};

/// Deadline of one API request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Deadline of a whole API check (connecting included).
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(6);

/// How doctor stands with the API server.
#[derive(Clone)]
pub enum ApiState {
    /// `--no-cluster`: not asked.
    Off,
    /// Could not connect, the server did not answer, or it answered as no API server would.
    Down(String),
    /// Connected; the server's version.
    Up {
        /// The client.
        client: kube::Client,
        /// `v1.33.1`.
        version: String,
        /// Minor version number, when it parses.
        minor: Option<u32>,
    },
}

/// Connects and asks `/version`.
pub async fn connect(config: &Config, no_cluster: bool) -> ApiState {
    if no_cluster {
        return ApiState::Off;
    }
    let attempt = async {
        let opts = ClientOptions {
            kubeconfig: Some(config.cluster.kubeconfig.as_str()),
            context: None,
            timeout: Some(REQUEST_TIMEOUT),
            ..ClientOptions::default()
        };
        let client = client(&opts).await.map_err(|e| one_line(e.as_ref()))?;
        let info = client
            .apiserver_version()
            .await
            .map_err(|e| format!("GET /version: {}", describe(&e)))?;
        let minor = info.minor.trim_end_matches('+').parse().ok();
        Ok::<_, String>(ApiState::Up {
            client,
            version: info.git_version,
            minor,
        })
    };
    match tokio::time::timeout(CHECK_TIMEOUT, attempt).await {
        Ok(Ok(up)) => up,
        Ok(Err(e)) => ApiState::Down(e),
        Err(_) => ApiState::Down(format!("no answer within {} s", CHECK_TIMEOUT.as_secs())),
    }
}

/// The `skip` a check reports when the API is not available.
pub(crate) fn skipped(id: &'static str, title: &'static str, api: &ApiState) -> Option<Check> {
    match api {
        ApiState::Off => Some(Check::new(
            id,
            title,
            Status::Skip,
            "--no-cluster: not asked",
        )),
        ApiState::Down(_) => Some(Check::new(
            id,
            title,
            Status::Skip,
            "no working API server (see api-server)",
        )),
        ApiState::Up { .. } => None,
    }
}

/// The id of the [`api_server`] check.
pub const API_SERVER: &str = "api-server";

/// `api-server`. `preflight`: the check runs before a role starts, where the way out is
/// `--skip-doctor` (`--no-cluster` is a flag of `gpushare doctor` only).
pub(crate) fn api_server(api: &ApiState, config: &Config, preflight: bool) -> Check {
    const ID: &str = API_SERVER;
    const TITLE: &str = "API server reachable";
    let via = if config.cluster.kubeconfig.is_empty() {
        "KUBECONFIG / ~/.kube/config / in-cluster service account".to_string()
    } else {
        format!("kubeconfig {}", config.cluster.kubeconfig)
    };
    match api {
        ApiState::Off => Check::new(ID, TITLE, Status::Skip, "--no-cluster: not asked"),
        ApiState::Down(e) => Check::new(ID, TITLE, Status::Fail, format!("via {via}: {e}")).hint(
            if preflight {
                "pass --kubeconfig (or set KUBECONFIG) to a kubeconfig that `kubectl version` accepts;\n\
                 in a pod, the service account token must be mounted"
            } else {
                "pass --kubeconfig (or set KUBECONFIG) to a kubeconfig that `kubectl version` accepts;\n\
                 in a pod, the service account token must be mounted; --no-cluster checks this host only"
            },
        ),
        ApiState::Up { version, .. } => {
            Check::new(ID, TITLE, Status::Ok, format!("Kubernetes {version} via {via}"))
        }
    }
}

/// Where a permission is needed: the scope its review asks about. A Role grants only in its
/// namespace and a `resourceNames` rule only for that name (for `list` and `watch`, through
/// the `metadata.name` field selector the request carries), so each review asks exactly what
/// the role's requests are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace, or a cluster-scoped resource.
    Cluster,
    /// The namespace of the upstream unhealthy-GPU ConfigMaps (`kube-system`).
    UnhealthyConfigMaps,
    /// The extender's Lease namespace (`extender.lease_namespace`), any name (`create`).
    LeaseNamespace,
    /// The extender's own Lease (`extender.lease_namespace`/`extender.lease_name`).
    Lease,
}

/// One permission a role needs; allowed when any of `groups` allows it.
#[derive(Clone, Copy, Debug)]
pub struct Permission {
    /// API groups ("" is core); the first is shown.
    pub groups: &'static [&'static str],
    /// Resource, e.g. `pods`.
    pub resource: &'static str,
    /// Subresource, e.g. `binding`, or "".
    pub subresource: &'static str,
    /// Verb.
    pub verb: &'static str,
    /// Only needed with leader election.
    pub leader_only: bool,
    /// Where it is needed.
    pub scope: Scope,
}

const fn perm(
    group: &'static [&'static str],
    resource: &'static str,
    sub: &'static str,
    verb: &'static str,
) -> Permission {
    Permission {
        groups: group,
        resource,
        subresource: sub,
        verb,
        leader_only: false,
        scope: Scope::Cluster,
    }
}

/// A permission of the extender's leader election, in `scope`.
const fn lease(verb: &'static str, scope: Scope) -> Permission {
    Permission {
        leader_only: true,
        scope,
        ..perm(LEASES, "leases", "", verb)
    }
}

const CORE: &[&str] = &[""];
const EVENTS: &[&str] = &["events.k8s.io"];
const LEASES: &[&str] = &["coordination.k8s.io"];
const RESOURCE: &[&str] = &["resource.k8s.io"];

/// What `gpushare extender` does with the API.
pub(crate) const EXTENDER_PERMISSIONS: &[Permission] = &[
    perm(CORE, "pods", "", "get"),
    perm(CORE, "pods", "", "list"),
    perm(CORE, "pods", "", "watch"),
    perm(CORE, "pods", "", "patch"),
    perm(CORE, "pods", "binding", "create"),
    perm(CORE, "nodes", "", "get"),
    perm(CORE, "nodes", "", "list"),
    perm(CORE, "nodes", "", "watch"),
    Permission {
        scope: Scope::UnhealthyConfigMaps,
        ..perm(CORE, "configmaps", "", "get")
    },
    Permission {
        scope: Scope::UnhealthyConfigMaps,
        ..perm(CORE, "configmaps", "", "list")
    },
    Permission {
        scope: Scope::UnhealthyConfigMaps,
        ..perm(CORE, "configmaps", "", "watch")
    },
    perm(EVENTS, "events", "", "create"),
    perm(EVENTS, "events", "", "patch"),
    lease("get", Scope::Lease),
    lease("update", Scope::Lease),
    // The Lease watch: a list and a watch with the field selector metadata.name=<lease>.
    lease("list", Scope::Lease),
    lease("watch", Scope::Lease),
    lease("create", Scope::LeaseNamespace),
];

/// What `gpushare device-plugin` does with the API.
pub(crate) const DEVICE_PLUGIN_PERMISSIONS: &[Permission] = &[
    perm(CORE, "pods", "", "get"),
    perm(CORE, "pods", "", "list"),
    perm(CORE, "pods", "", "watch"),
    perm(CORE, "pods", "", "patch"),
    perm(CORE, "nodes", "", "get"),
    perm(CORE, "nodes", "", "patch"),
    perm(CORE, "nodes", "status", "patch"),
    perm(EVENTS, "events", "", "create"),
    perm(EVENTS, "events", "", "patch"),
    // One path per GPU: a GPU a DRA slice publishes or a claim holds is not offered.
    perm(RESOURCE, "resourceslices", "", "list"),
    perm(RESOURCE, "resourceclaims", "", "list"),
];

/// What `gpushare dra-plugin` does with the API: reads its Node and writes on it only its
/// path's annotation (`gpushare.io/dra-gpus`; with enforcement, the containers' use), lists its
/// node's pods (one path per GPU: a GPU the extender placed a pod on is held back), reads the
/// claims it prepares and follows, keeps its ResourceSlices, and writes the node's Events.
pub(crate) const DRA_PLUGIN_PERMISSIONS: &[Permission] = &[
    perm(CORE, "nodes", "", "get"),
    perm(CORE, "nodes", "", "patch"),
    perm(CORE, "pods", "", "list"),
    perm(RESOURCE, "resourceclaims", "", "get"),
    perm(RESOURCE, "resourceclaims", "", "list"),
    perm(RESOURCE, "resourceclaims", "", "watch"),
    perm(RESOURCE, "resourceslices", "", "list"),
    perm(RESOURCE, "resourceslices", "", "create"),
    perm(RESOURCE, "resourceslices", "", "update"),
    perm(RESOURCE, "resourceslices", "", "delete"),
    perm(EVENTS, "events", "", "create"),
    perm(EVENTS, "events", "", "patch"),
];

/// The namespace and name a review of `p` asks about.
fn scope_of(p: &Permission, config: &Config) -> (Option<String>, Option<String>) {
    let lease = &config.extender;
    match p.scope {
        Scope::Cluster => (None, None),
        Scope::UnhealthyConfigMaps => (Some(wire::UNHEALTHY_CONFIGMAP_NAMESPACE.to_string()), None),
        Scope::LeaseNamespace => (Some(lease.lease_namespace.clone()), None),
        Scope::Lease => (
            Some(lease.lease_namespace.clone()),
            Some(lease.lease_name.clone()),
        ),
    }
}

impl Permission {
    fn label(&self) -> String {
        let res = if self.subresource.is_empty() {
            self.resource.to_string()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        };
        match self.groups.first() {
            Some(g) if !g.is_empty() => format!("{res}.{g} {}", self.verb),
            _ => format!("{res} {}", self.verb),
        }
    }
}

async fn allowed_in(
    client: &kube::Client,
    p: &Permission,
    group: &str,
    config: &Config,
) -> Result<bool, ApiError> {
    let (namespace, name) = scope_of(p, config);
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some(group.to_string()),
                resource: Some(p.resource.to_string()),
                subresource: (!p.subresource.is_empty()).then(|| p.subresource.to_string()),
                verb: Some(p.verb.to_string()),
                namespace,
                name,
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let answer = api
        .create(&PostParams::default(), &review)
        .await
        .map_err(ApiError::Kube)?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

async fn allowed(client: &kube::Client, p: &Permission, config: &Config) -> Result<bool, ApiError> {
    let mut last_err = None;
    for group in p.groups {
        match allowed_in(client, p, group, config).await {
            Ok(true) => return Ok(true),
            Ok(false) => {}
            Err(e) => last_err = Some(e),
        }
    }
    match last_err {
        Some(e) => Err(e),
        None => Ok(false),
    }
}

/// `rbac`: each `(who, permissions)` set reviewed with SelfSubjectAccessReview, each in its
/// scope ([`Scope`], from `config`); the leader-election ones count only with
/// `extender.leader_elect`.
pub async fn rbac(api: &ApiState, sets: &[(&str, &[Permission])], config: &Config) -> Check {
    let leader_elect = config.extender.leader_elect;
    const ID: &str = "rbac";
    const TITLE: &str = "RBAC permissions of this identity";
    if let Some(c) = skipped(ID, TITLE, api) {
        return c;
    }
    let ApiState::Up { client, .. } = api else {
        return Check::new(ID, TITLE, Status::Skip, "no API");
    };
    let mut lines = Vec::new();
    let mut failed = false;
    let mut unknown = false;
    for (who, perms) in sets {
        let reviews = futures::future::join_all(perms.iter().map(|p| async move {
            let r = tokio::time::timeout(CHECK_TIMEOUT, allowed(client, p, config)).await;
            (p, r.unwrap_or(Err(ApiError::TimedOut)))
        }))
        .await;
        let mut denied = Vec::new();
        let mut optional = Vec::new();
        let mut errors = Vec::new();
        for (p, r) in reviews {
            match r {
                Ok(true) => {}
                Ok(false) if p.leader_only && !leader_elect => optional.push(p.label()),
                Ok(false) => denied.push(p.label()),
                Err(e) => errors.push(format!("{}: {e}", p.label())),
            }
        }
        let granted = perms.len() - denied.len() - optional.len() - errors.len();
        lines.push(format!("{who}: {granted} of {} allowed", perms.len()));
        if !denied.is_empty() {
            failed = true;
            lines.push(format!("  denied: {}", denied.join(", ")));
        }
        if !optional.is_empty() {
            lines.push(format!(
                "  denied, needed only with leader election: {}",
                optional.join(", ")
            ));
        }
        if let Some(first) = errors.first() {
            unknown = true;
            lines.push(format!(
                "  could not review {} permission(s): {first}",
                errors.len()
            ));
        }
    }
    let detail = lines.join("\n");
    let hint = "grant them to the identity the role runs as: apply the ClusterRole and ClusterRoleBinding\n\
                of the gpushare manifests (gpushare-schd-extender, gpushare-device-plugin); verify with\n\
                kubectl auth can-i <verb> <resource> --as=system:serviceaccount:kube-system:<name>";
    if failed {
        Check::new(ID, TITLE, Status::Fail, detail).hint(hint)
    } else if unknown {
        Check::new(ID, TITLE, Status::Warn, detail).hint(
            "the API server did not answer SelfSubjectAccessReview; check with kubectl auth can-i",
        )
    } else {
        Check::new(ID, TITLE, Status::Ok, detail)
    }
}

/// This node's name: `node.node_name` (`--node-name`, `NODE_NAME`), else the host's
/// `/etc/hostname`. The second value says where it came from.
pub fn node_name(config: &Config, host: &HostRoot) -> Option<(String, &'static str)> {
    if !config.node.node_name.is_empty() {
        return Some((config.node.node_name.clone(), "--node-name / NODE_NAME"));
    }
    host.read("/etc/hostname")
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .map(|h| (h, "/etc/hostname"))
}

/// The Node object, when the API is up and the name known: `Ok(None)` when it does not exist.
pub(crate) async fn get_node(api: &ApiState, name: &str) -> Result<Option<Node>, ApiError> {
    let ApiState::Up { client, .. } = api else {
        return Err(ApiError::NotAsked);
    };
    let nodes: Api<Node> = Api::all(client.clone());
    match tokio::time::timeout(CHECK_TIMEOUT, nodes.get_opt(name)).await {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(ApiError::Kube(e)),
        Err(_) => Err(ApiError::TimedOut),
    }
}

/// Why a check's API call has no answer.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The API is down or the call was not made (no node name, `--no-cluster`).
    #[error("not asked")]
    NotAsked,
    /// The API call failed (said in words: [`describe`]).
    #[error("{}", describe(.0))]
    Kube(kube::Error),
    /// No answer within the check's deadline.
    #[error("no answer in time")]
    TimedOut,
}

/// Capacity of `resource` on `node`, as text.
pub fn capacity(node: &Node, resource: &str) -> Option<String> {
    node.status
        .as_ref()?
        .capacity
        .as_ref()?
        .get(resource)
        .map(|q| q.0.clone())
}

/// `status.allocatable[resource]` of `node`, as written.
pub fn allocatable(node: &Node, resource: &str) -> Option<String> {
    node.status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get(resource)
        .map(|q| q.0.clone())
}

/// `node-label`: the node exists and carries `gpushare=true`.
pub(crate) fn node_label(
    api: &ApiState,
    name: Option<&(String, &'static str)>,
    node: &Result<Option<Node>, ApiError>,
) -> Check {
    const ID: &str = "node-label";
    const TITLE: &str = "node is labelled gpushare=true";
    if let Some(c) = skipped(ID, TITLE, api) {
        return c;
    }
    let Some((name, source)) = name else {
        return Check::new(ID, TITLE, Status::Skip, "this node's name is unknown")
            .hint("pass --node-name NAME (or set NODE_NAME)");
    };
    let node = match node {
        Ok(Some(n)) => n,
        Ok(None) => {
            return Check::new(
                ID,
                TITLE,
                Status::Fail,
                format!("node {name} (from {source}) does not exist"),
            )
            .hint(
                "pass the node's name as Kubernetes knows it: --node-name NAME (kubectl get nodes)",
            );
        }
        Err(e) => {
            return Check::new(
                ID,
                TITLE,
                Status::Warn,
                format!("cannot read node {name}: {e}"),
            )
            .hint("the identity needs nodes get");
        }
    };
    let label = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(wire::LABEL_GPUSHARE))
        .cloned();
    let gpu_mem = capacity(node, wire::RESOURCE_GPU_MEM).unwrap_or_else(|| "none".to_string());
    let detail_tail = format!("capacity {}: {gpu_mem}", wire::RESOURCE_GPU_MEM);
    let fix = format!(
        "kubectl label node {name} {}=true --overwrite",
        wire::LABEL_GPUSHARE
    );
    match label.as_deref() {
        Some("true") => Check::new(
            ID,
            TITLE,
            Status::Ok,
            format!("node {name}: {}=true; {detail_tail}", wire::LABEL_GPUSHARE),
        ),
        Some(other) => Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!(
                "node {name}: {}={other}: the device plugin DaemonSet (nodeSelector {}=true) does not run here; {detail_tail}",
                wire::LABEL_GPUSHARE,
                wire::LABEL_GPUSHARE
            ),
        )
        .hint(fix),
        None => Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!(
                "node {name} has no {} label: the device plugin DaemonSet (nodeSelector {}=true) does not run here; {detail_tail}",
                wire::LABEL_GPUSHARE,
                wire::LABEL_GPUSHARE
            ),
        )
        .hint(fix),
    }
}
