//! An in-process Kubernetes API server for tests and `gpushare demo` — a test double, never
//! for production.
//!
//! [`ApiServer::start`] serves real HTTP/1.1 on `127.0.0.1:<random port>` (plain HTTP and
//! HTTPS on the one port, see `serving_tls`) from an in-memory store and writes a kubeconfig
//! file for it, so that kube-rs ([`ApiServer::admin_client`]) and the real `kubectl` binaries
//! (`--kubeconfig` [`ApiServer::admin_kubeconfig_path`]) talk to it as to a cluster.
//!
//! # Identities
//! Every request needs a bearer token the server minted (`identity`): without one it is
//! answered `401 Unauthorized`. [`ApiServer::admin_client`] and
//! [`ApiServer::admin_kubeconfig_path`] are the cluster administrator ([`Identity::admin`],
//! group `system:masters`, allowed everything) — a test that bypasses RBAC says so by that
//! name. [`ApiServer::kubeconfig_for`], [`ApiServer::client_for`] and
//! [`ApiServer::service_account_kubeconfig`] mint one for any [`Identity`]: a user, or a
//! ServiceAccount (authenticated while its object exists) optionally with the node-name extra
//! of a pod-bound token ([`Identity::on_node`]).
//!
//! # Supported surface
//! - Discovery: `/version`, `/api`, `/api/v1`, `/apis`, `/apis/<group>[/<version>]`.
//!   Aggregated discovery requests are answered with the plain documents (clients fall back).
//!   `/openapi/v3` lists minimal per-group-version documents that declare server-side
//!   field validation, and `/openapi/v2` (JSON or the protobuf kubectl asks for) declares
//!   the same for kubectl 1.27, so kubectl skips client-side schema validation. No schemas
//!   are served: `kubectl explain` and client-side `kubectl apply` do not work.
//! - Authorization (`rbac`, `request_info`): upstream's RBAC authorizer over the stored
//!   Roles, ClusterRoles, RoleBindings and ClusterRoleBindings (verbs, apiGroups, resources
//!   and subresources with `*/sub`, resourceNames, nonResourceURLs, wildcards), the verb and
//!   name of each request resolved as upstream's RequestInfo does (a `metadata.name` field
//!   selector names a list or watch); `system:masters` is allowed everything; a refusal is
//!   upstream's 403 `Status`. The bootstrap policy is seeded (`cluster-admin`, discovery, the
//!   self reviews, `/version` and health for every authenticated user).
//! - Resources: core/v1 `pods` (namespaced and all-namespaces), `nodes`, `configmaps`,
//!   `events`, `namespaces`; `events.k8s.io/v1` `events` (stored apart from core events, id
//!   `events.events.k8s.io`); `coordination.k8s.io/v1` `leases`;
//!   `authorization.k8s.io/v1` `selfsubjectaccessreviews` and `selfsubjectrulesreviews`,
//!   `authentication.k8s.io/v1` `selfsubjectreviews` (create only, answered for the caller
//!   from the same rules, JSON or the protobuf kubectl sends: `reviews`, `protobuf_body`).
//! - Verbs: get; list with `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (..)`,
//!   `k notin (..)`), `fieldSelector` (any dotted field path with `=`, `==`, `!=`, a missing
//!   field reads as empty), `limit`/`continue` and `resourceVersion`/`resourceVersionMatch`
//!   as upstream reads them (a list at "0" is the watch cache's: one answer, the limit
//!   ignored; see `watch_cache`, which also holds the cache behind on a test's command:
//!   [`ApiServer::hold_watch_cache`]); watch (`watch=true|1`,
//!   `resourceVersion`, `allowWatchBookmarks`, `timeoutSeconds`, `sendInitialEvents`), with
//!   `410 Gone` (an `ERROR` event) for a version older than the retained history; create
//!   (409 AlreadyExists, `generateName`); update (409 Conflict on a stale
//!   `resourceVersion`); delete (immediate, with uid/resourceVersion preconditions) and
//!   delete-collection; patch as JSON merge, strategic merge (merge semantics; `$` directives
//!   dropped), JSON patch (RFC 6902) and server-side apply (merge of the given fields,
//!   creates a missing object, no field ownership); the subresources `pods/status`,
//!   `nodes/status` (only `.status` changes) and `pods/binding` (sets `spec.nodeName`, 409
//!   when bound or on a UID precondition mismatch). `kubectl get` receives server-side
//!   `Table`s for pods and nodes.
//! - Errors are real `Status` objects with the matching HTTP code; malformed input answers
//!   400, unknown paths 404, unsupported methods 405. Bad input never panics.
//! - Admission on every write (create, update, patch, delete, delete-collection,
//!   `pods/binding`, the `status` subresources): stored MutatingWebhookConfigurations, then
//!   the object as it will be stored, then ValidatingAdmissionPolicies with their bindings
//!   (CEL, `admission_policy`, `cel_expr`) and ValidatingWebhookConfigurations, matched as
//!   upstream matches them (rules with subresources and scope, namespace and object
//!   selectors, match conditions; a namespaced write under a namespace selector needs its
//!   Namespace object) and called over HTTPS as kube-apiserver calls them (see `admission`;
//!   webhooks named by Service need [`ApiServer::route_service`]). A write is stored only if
//!   the object it was admitted against is still the stored one (a patch is computed again).
//!   Without any admission configuration stored, writes take the direct path.
//! - Apps/v1 `deployments` and `daemonsets`, batch/v1 `jobs`, core `secrets`, `services` and
//!   `serviceaccounts`, `rbac.authorization.k8s.io/v1` roles, cluster roles and their
//!   bindings, and `admissionregistration.k8s.io/v1` webhook configurations and admission
//!   policies with their bindings are stored like any other object, and so are
//!   `resource.k8s.io/v1` `resourceslices` and `deviceclasses` (cluster-scoped),
//!   `resourceclaimtemplates` and `resourceclaims` (namespaced; claims with the `status`
//!   subresource, written by the sandbox allocator, `crate::dra_allocator`).
//! - `resource.k8s.io/v1` as upstream enforces it, for the Kubernetes version played
//!   ([`ApiServer::set_kubernetes_version`], 1.34 to 1.37, 1.37 until set; `/version`
//!   answers it) and its feature gates ([`ApiServer::set_feature_gate`], each at that
//!   version's upstream default until set): every create, update, patch and status write of
//!   a ResourceSlice, DeviceClass, ResourceClaim or ResourceClaimTemplate first drops the
//!   fields of disabled gates unless the stored object already uses them (upstream's
//!   `dropDisabledFields`: taints without `DRADeviceTaints`, consumable capacity without
//!   `DRAConsumableCapacity`, ...; a new claim's status is reset), then is validated rule by
//!   rule as `pkg/apis/resource/validation` does (`validation_resource`: names, attribute
//!   names and values, 128 devices per slice or 64 once a device has taints, 32 attributes
//!   and capacities per device, request policies with `min + step <= value`, counters,
//!   taints, 32 requests and constraints per claim, selectors that compile, immutable claim
//!   and template specs, allocation results, ...), after mutating admission and before
//!   validating admission, as upstream orders them. A refusal is upstream's 422 `Invalid`
//!   Status with its field paths and messages; a value of the wrong type or an unparsable
//!   quantity is upstream's 400.
//! - `dryRun=All` on every write: validated and admitted (webhooks get `dryRun: true`, and
//!   one with side effects refuses it), answered, nothing stored.
//! - Test controls (they bypass authorization and admission): [`ApiServer::seed_yaml`],
//!   [`ApiServer::get_object`], [`ApiServer::set_pod_phase`], the Kubernetes version and
//!   gates (above, and [`ApiServer::set_consumable_capacity`] for one gate), fault injection
//!   ([`Fault`]: error codes, delays, dropped connections, cut watches, requests held at a
//!   [`Hold`] until released — a paused client; a filter on `fieldManager=<identity>`
//!   singles out one replica's lease writes), a request log naming who sent each request
//!   ([`ApiServer::requests`], [`ApiServer::request_count`]), the requests refused by
//!   authentication or RBAC ([`ApiServer::refusals`]) and the watch cache (off with
//!   [`ApiServer::set_watch_cache`], held behind with [`ApiServer::hold_watch_cache`]). Faults apply after authentication and authorization. Clock
//!   skew is not the server's business: the extender's leader election reads an injectable
//!   clock.
//!
//! # Limits (it is a test double)
//! Authentication by bearer tokens only (no client certificates, no anonymous user, no
//! impersonation, no TokenReview or SubjectAccessReview of other users); no ClusterRole
//! aggregation, Node authorizer or RBAC escalation checks; no admission plugins but the
//! webhooks and ValidatingAdmissionPolicies (no NamespaceLifecycle, NodeRestriction,
//! MutatingAdmissionPolicy; the CEL libraries `cel_expr` lists as missing, no `authorizer`
//! variable, no audit annotations), no controllers (a Deployment never gets pods), no
//! defaulting beyond a pod's `Pending` phase (`resource.k8s.io` defaults such as `count: 1`
//! are assumed by the validation, not written), no validation of object schemas beyond
//! `resource.k8s.io` (whose object metadata, label values, node selectors beyond their term
//! count, CEL cost and 1.37 alpha fields are not checked either; unknown fields are kept,
//! not pruned; objects seeded by test controls keep the status they are given), no garbage
//! collection, graceful
//! deletion or finalizers, no namespace lifecycle (objects may live in any namespace), no
//! field managers, protobuf (except the self reviews' request bodies) or CBOR, no legacy
//! `/api/v1/watch/...` paths. Strategic merge patches merge only well-known lists
//! (containers, conditions, env, volumes, ...) by key and replace the others. One global
//! `resourceVersion` counter for all kinds, as etcd does. kube-rs clients retry
//! 429/503/504 on their own, so a single injected 503 is invisible to them.

mod admission;
mod admission_policy;
mod cel_expr;
mod discovery;
mod feature_gates;
mod field_errors;
mod http_api;
mod identity;
mod patch;
mod protobuf_body;
mod rbac;
mod request_info;
mod resource_strategy;
mod reviews;
mod selector;
mod serving_tls;
mod store;
mod table;
mod validation_resource;
mod watch_cache;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;
use tokio::sync::{oneshot, watch};

pub use feature_gates::{FeatureGate, NEWEST_MINOR, OLDEST_MINOR, UnsupportedVersion};
use identity::Unauthenticated;
pub use identity::{Identity, NODE_NAME_EXTRA};
use store::Store;
pub(crate) use store::new_uid;
use watch_cache::WatchCache;

/// A fault to inject into matching requests, `times` times, then it expires.
#[derive(Clone, Debug)]
pub struct Fault {
    /// The method to match; `None` matches any.
    pub method: Option<http::Method>,
    /// A substring of the request's path and query (`/api/v1/pods?watch=true`).
    pub path_contains: String,
    /// What to do with a matching request.
    pub action: FaultAction,
    /// How many matching requests it applies to.
    pub times: usize,
    /// How many matching requests go through untouched before it applies.
    pub skip: usize,
}

impl Fault {
    /// A fault applying once to requests with `method` (any when `None`) whose path and query
    /// contain `path_contains`.
    pub fn new(
        method: Option<http::Method>,
        path_contains: impl Into<String>,
        action: FaultAction,
    ) -> Fault {
        Fault {
            method,
            path_contains: path_contains.into(),
            action,
            times: 1,
            skip: 0,
        }
    }

    /// Lets the first `n` matching requests through untouched (the fault applies to later
    /// ones): e.g. a kubelet's read of a claim passes and the plugin's read right after it
    /// does not.
    pub fn after(mut self, n: usize) -> Fault {
        self.skip = n;
        self
    }

    /// Applies the fault to `n` matching requests.
    pub fn times(mut self, n: usize) -> Fault {
        self.times = n;
        self
    }

    fn matches(&self, method: &http::Method, path_and_query: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method)
            && path_and_query.contains(&self.path_contains)
    }
}

/// What an injected fault does.
#[derive(Clone, Debug)]
pub enum FaultAction {
    /// Answer a `Status` object with this HTTP code (409 Conflict, 500 InternalError, ...).
    Status(u16),
    /// Wait this long, then serve the request normally.
    Delay(Duration),
    /// Close the connection without an answer (the request is NOT applied).
    DropConnection,
    /// Apply the request, then close the connection without an answer: the write landed but
    /// its answer is lost.
    ApplyThenDrop,
    /// Apply the request at once (a list takes its snapshot now), answer only after this long.
    AnswerLate(Duration),
    /// Apply the request after this long, whatever the client does meanwhile (it may give up
    /// and hang up: the write still lands late), then answer.
    ApplyLate(Duration),
    /// End matching watch streams abruptly: open ones at once, later ones right after their
    /// headers. Requests that are not watches are not affected.
    CutWatch,
    /// Hold the request until the [`Hold`] is released, then serve it normally: a client (or
    /// the network) paused with the request in flight.
    Hold(Hold),
    /// Hold the write at the server until the [`Hold`] is released, then apply it whatever
    /// the client did meanwhile (it may hang up, or be killed: the write still lands). With
    /// `answer: Some(code)` the client gets that error status at once (an API server whose
    /// storage timed out, e.g. a 500 `etcdserver: request timed out`, while the write is
    /// committed later); with `None` it gets the real answer once applied.
    ApplyOnRelease {
        /// The gate the write waits on.
        hold: Hold,
        /// The status answered at once, if any.
        answer: Option<u16>,
    },
}

/// A gate for [`FaultAction::Hold`]: requests wait on it until [`Hold::release`].
#[derive(Clone, Debug)]
pub struct Hold {
    released: Arc<watch::Sender<bool>>,
    held: Arc<std::sync::atomic::AtomicUsize>,
}

impl Default for Hold {
    fn default() -> Self {
        Hold::new()
    }
}

impl Hold {
    /// A closed gate.
    pub fn new() -> Hold {
        let (released, _) = watch::channel(false);
        Hold {
            released: Arc::new(released),
            held: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        }
    }

    /// Lets every held request (and later ones) through.
    pub fn release(&self) {
        self.released.send_replace(true);
    }

    /// How many requests have reached the gate so far (held now or let through since).
    pub fn reached(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Resolves once at least `n` requests have reached the gate.
    pub async fn wait_reached(&self, n: usize) {
        let mut rx = self.released.subscribe();
        while self.reached() < n {
            // Each arrival pings the channel (`send_modify` without a change of value).
            let _ = rx.changed().await;
        }
    }

    pub(crate) async fn pass(&self) {
        self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.released.send_modify(|_| {});
        let mut rx = self.released.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }
}

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// The HTTP method.
    pub method: http::Method,
    /// The path, without the query.
    pub path: String,
    /// The raw query string (empty when none).
    pub query: String,
    /// The `Content-Type` header.
    pub content_type: Option<String>,
    /// The body, as (lossy) UTF-8.
    pub body: String,
    /// Who sent it (the authenticated user name); `None` when it was not authenticated.
    pub username: Option<String>,
}

/// A request refused before it reached the store: 401 (no valid token) or 403 (RBAC).
#[derive(Clone, Debug)]
pub struct Refusal {
    /// The HTTP method.
    pub method: http::Method,
    /// The path, without the query.
    pub path: String,
    /// The raw query string.
    pub query: String,
    /// Who sent it; `None` when it was not authenticated.
    pub username: Option<String>,
    /// 401 or 403.
    pub code: u16,
    /// The `Status` message answered.
    pub message: String,
}

/// An open watch stream, cuttable by a [`FaultAction::CutWatch`].
struct OpenWatch {
    path_and_query: String,
    cut: Option<oneshot::Sender<()>>,
}

/// Test-control state shared by the HTTP side and the handles.
struct Controls {
    faults: Vec<Fault>,
    requests: Vec<RecordedRequest>,
    refusals: Vec<Refusal>,
    /// Bearer token → identity, for every token minted.
    tokens: HashMap<String, Identity>,
    /// Kubeconfig files written so far (a counter for their names).
    kubeconfigs: usize,
    watches: Vec<(u64, OpenWatch)>,
    next_watch_id: u64,
    /// (namespace, service, address) for webhooks named by `clientConfig.service`.
    services: Vec<(String, String, SocketAddr)>,
    late_in_flight: usize,
}

/// State shared by the server tasks and the handles.
pub(crate) struct Shared {
    store: Mutex<Store>,
    /// The watch cache's state (on or off, held at a version): `watch_cache`.
    cache: Mutex<WatchCache>,
    controls: Mutex<Controls>,
    addr: SocketAddr,
    shutdown: watch::Receiver<bool>,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cache(&self) -> MutexGuard<'_, WatchCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn controls(&self) -> MutexGuard<'_, Controls> {
        self.controls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the first live fault (other than `CutWatch`) matching the request.
    fn take_fault(&self, method: &http::Method, path_and_query: &str) -> Option<FaultAction> {
        let mut controls = self.controls();
        let index = controls.faults.iter().position(|f| {
            !matches!(f.action, FaultAction::CutWatch) && f.matches(method, path_and_query)
        })?;
        let fault = &mut controls.faults[index];
        if fault.skip > 0 {
            fault.skip -= 1;
            return None;
        }
        let action = fault.action.clone();
        fault.times = fault.times.saturating_sub(1);
        if fault.times == 0 {
            controls.faults.remove(index);
        }
        Some(action)
    }

    /// Registers a new watch stream; returns its id, its cut signal, and whether a pending
    /// `CutWatch` fault already applies to it.
    fn open_watch(&self, path_and_query: &str) -> (u64, oneshot::Receiver<()>, bool) {
        let mut controls = self.controls();
        let cut_now = match controls.faults.iter().position(|f| {
            matches!(f.action, FaultAction::CutWatch)
                && f.matches(&http::Method::GET, path_and_query)
        }) {
            Some(index) => {
                let fault = &mut controls.faults[index];
                fault.times = fault.times.saturating_sub(1);
                if fault.times == 0 {
                    controls.faults.remove(index);
                }
                true
            }
            None => false,
        };
        let (tx, rx) = oneshot::channel();
        controls.next_watch_id += 1;
        let id = controls.next_watch_id;
        controls.watches.push((
            id,
            OpenWatch {
                path_and_query: path_and_query.to_string(),
                cut: Some(tx),
            },
        ));
        (id, rx, cut_now)
    }

    fn close_watch(&self, id: u64) {
        self.controls().watches.retain(|(w, _)| *w != id);
    }

    fn record(&self, request: RecordedRequest) {
        self.controls().requests.push(request);
    }

    fn refuse(&self, refusal: Refusal) {
        self.controls().refusals.push(refusal);
    }

    /// The identity a bearer token stands for (see `identity`): a ServiceAccount's only while
    /// its object exists, with that object's uid.
    fn authenticate(&self, token: Option<&str>) -> Result<Identity, Unauthenticated> {
        let token = token.ok_or(Unauthenticated::NoToken)?;
        let mut user = self
            .controls()
            .tokens
            .get(token)
            .cloned()
            .ok_or(Unauthenticated::UnknownToken)?;
        if let Some((ns, name)) = user.service_account_ref() {
            let account = self
                .store()
                .get_by_id("serviceaccounts", Some(ns), name)
                .ok_or_else(|| Unauthenticated::NoServiceAccount(format!("{ns}/{name}")))?;
            user.uid = store::meta_str(&account, "uid").unwrap_or("").to_string();
        }
        Ok(user)
    }
}

/// Owns the server task; dropping the last [`ApiServer`] handle stops it.
struct Inner {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    admin_kubeconfig: PathBuf,
    admin_token: String,
    /// The CA of the server's HTTPS certificate (see `serving_tls`).
    ca_pem: String,
    dir: tempfile::TempDir,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The sandbox API server (see the module docs). Cheap to clone; all clones share one server.
#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Inner>,
}

impl ApiServer {
    /// Starts a server on `127.0.0.1:0` with namespaces `default`, `kube-system`,
    /// `kube-public` and `kube-node-lease`, the bootstrap RBAC policy (`cluster-admin` bound to
    /// `system:masters`, discovery and the self reviews for every authenticated user), and
    /// writes the administrator's kubeconfig ([`ApiServer::admin_kubeconfig_path`]).
    pub async fn start() -> anyhow::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("binding the sandbox API server to 127.0.0.1")?;
        let addr = listener.local_addr()?;
        let (stop, shutdown) = watch::channel(false);
        let admin_token = identity::new_token();
        let tls = serving_tls::issue()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new()),
            cache: Mutex::new(WatchCache::new()),
            controls: Mutex::new(Controls {
                faults: Vec::new(),
                requests: Vec::new(),
                refusals: Vec::new(),
                tokens: HashMap::from([(admin_token.clone(), Identity::admin())]),
                kubeconfigs: 0,
                watches: Vec::new(),
                next_watch_id: 0,
                services: Vec::new(),
                late_in_flight: 0,
            }),
            addr,
            shutdown,
        });
        let namespaces = ["default", "kube-system", "kube-public", "kube-node-lease"].map(|ns| {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": ns },
                "spec": { "finalizers": ["kubernetes"] }, "status": { "phase": "Active" },
            })
        });
        for object in namespaces.into_iter().chain(rbac::bootstrap_objects()) {
            shared
                .store()
                .create_value(object)
                .map_err(anyhow::Error::from)?;
        }
        let dir = tempfile::Builder::new()
            .prefix("gpushare-sandbox-apiserver")
            .tempdir()
            .context("creating the sandbox kubeconfig folder")?;
        let admin_kubeconfig = dir.path().join("kubeconfig");
        let https = format!("https://{addr}");
        std::fs::write(
            &admin_kubeconfig,
            identity::kubeconfig_text(&https, &tls.ca_pem, "sandbox-admin", &admin_token),
        )
        .with_context(|| format!("writing {}", admin_kubeconfig.display()))?;
        let task = tokio::spawn(http_api::serve(listener, shared.clone(), tls.config));
        Ok(ApiServer {
            inner: Arc::new(Inner {
                shared,
                stop,
                task: Mutex::new(Some(task)),
                admin_kubeconfig,
                admin_token,
                ca_pem: tls.ca_pem,
                dir,
            }),
        })
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    /// The base URL, `http://127.0.0.1:PORT` (plain HTTP; the same port serves HTTPS).
    pub fn url(&self) -> String {
        format!("http://{}", self.inner.shared.addr)
    }

    /// The HTTPS URL, `https://127.0.0.1:PORT`, its certificate issued by
    /// [`ApiServer::ca_pem`]: what the kubeconfig files name.
    pub fn https_url(&self) -> String {
        format!("https://{}", self.inner.shared.addr)
    }

    /// The CA certificate (PEM) of the HTTPS certificate.
    pub fn ca_pem(&self) -> String {
        self.inner.ca_pem.clone()
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.shared.addr
    }

    /// The administrator's kubeconfig (context `sandbox`, namespace `default`, the token of
    /// [`Identity::admin`]: `system:masters`, allowed everything; admission still applies),
    /// usable by kube-rs and kubectl. It lives as long as the server. A test or tool that
    /// starts a role under it bypasses RBAC, and says so by this name.
    pub fn admin_kubeconfig_path(&self) -> PathBuf {
        self.inner.admin_kubeconfig.clone()
    }

    /// A kube-rs client for this server as the administrator (see
    /// [`ApiServer::admin_kubeconfig_path`]; plain HTTP, default namespace `default`).
    ///
    /// Must be called inside a tokio runtime, like every kube client constructor.
    pub fn admin_client(&self) -> kube::Client {
        self.client_with_token(&self.inner.admin_token)
    }

    /// The administrator's bearer token.
    pub fn admin_token(&self) -> String {
        self.inner.admin_token.clone()
    }

    /// A bearer token for `identity` (a new one per call). A ServiceAccount's token
    /// authenticates only while the ServiceAccount object exists.
    pub fn token_for(&self, identity: &Identity) -> String {
        let token = identity::new_token();
        self.shared()
            .controls()
            .tokens
            .insert(token.clone(), identity.clone());
        token
    }

    /// A kubeconfig file that authenticates as `identity` (context `sandbox`, namespace
    /// `default`); it lives as long as the server.
    pub fn kubeconfig_for(&self, identity: &Identity) -> anyhow::Result<PathBuf> {
        let token = self.token_for(identity);
        let n = {
            let mut controls = self.shared().controls();
            controls.kubeconfigs += 1;
            controls.kubeconfigs
        };
        let path = self.inner.dir.path().join(format!("kubeconfig-{n}"));
        std::fs::write(
            &path,
            identity::kubeconfig_text(
                &self.https_url(),
                &self.inner.ca_pem,
                &identity.username,
                &token,
            ),
        )
        .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// The kubeconfig of ServiceAccount `namespace/name` as a pod-bound token sees it: with
    /// the node-name extra when `node` is given (what the chart's admission policies read).
    pub fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
        node: Option<&str>,
    ) -> anyhow::Result<PathBuf> {
        let mut identity = Identity::service_account(namespace, name);
        if let Some(node) = node {
            identity = identity.on_node(node);
        }
        self.kubeconfig_for(&identity)
    }

    /// A kube-rs client authenticated as `identity` (plain HTTP, namespace `default`).
    ///
    /// Must be called inside a tokio runtime, like every kube client constructor.
    pub fn client_for(&self, identity: &Identity) -> kube::Client {
        let token = self.token_for(identity);
        self.client_with_token(&token)
    }

    fn client_with_token(&self, token: &str) -> kube::Client {
        let uri: http::Uri = match self.url().parse() {
            Ok(uri) => uri,
            // The URL is built from a SocketAddr, so it always parses.
            Err(_) => http::Uri::from_static("http://127.0.0.1"),
        };
        let mut config = kube::Config::new(uri);
        config.auth_info.token = Some(token.to_string().into());
        match kube::Client::try_from(config) {
            Ok(client) => client,
            Err(err) => panic!("a kube client for a plain-HTTP URL always builds: {err}"),
        }
    }

    /// Plays Kubernetes `1.<minor>` (1.34 to 1.37; 1.37, the newest the project ships, until
    /// set): `/version` answers it, every feature gate goes back to that version's default
    /// (see [`FeatureGate::default_at`]) and `resource.k8s.io` writes are validated with its
    /// limits.
    pub fn set_kubernetes_version(&self, minor: u32) -> Result<(), UnsupportedVersion> {
        let cluster = feature_gates::Cluster::checked(minor)?;
        self.shared().store().set_cluster(cluster);
        Ok(())
    }

    /// The Kubernetes minor version played.
    pub fn kubernetes_minor(&self) -> u32 {
        self.shared().store().cluster().minor()
    }

    /// Turns one feature gate on or off, as `--feature-gates=<gate>=<bool>` on kube-apiserver:
    /// the fields a disabled gate covers are dropped from `resource.k8s.io` writes (unless the
    /// stored object already uses them), as upstream's registry strategies do.
    pub fn set_feature_gate(&self, gate: FeatureGate, enabled: bool) {
        self.shared().store().set_gate(gate, enabled);
    }

    /// Whether a feature gate is on.
    pub fn feature_gate(&self, gate: FeatureGate) -> bool {
        self.shared().store().cluster().enabled(gate)
    }

    /// The `DRAConsumableCapacity` gate ([`ApiServer::set_feature_gate`]): off, writes and
    /// dry-run creates drop the consumable-capacity fields of ResourceSlices, ResourceClaims
    /// and their templates, as a gate-off API server does.
    pub fn set_consumable_capacity(&self, enabled: bool) {
        self.set_feature_gate(FeatureGate::DRAConsumableCapacity, enabled);
    }

    /// Creates every document of a (multi-document) YAML text, of any supported kind.
    /// Fills `uid`, `resourceVersion`, `creationTimestamp` and the `default` namespace.
    pub fn seed_yaml(&self, yaml: &str) -> anyhow::Result<()> {
        for document in yaml_serde::Deserializer::from_str(yaml) {
            let value: Value = serde::Deserialize::deserialize(document)
                .context("parsing a seed YAML document")?;
            if value.is_null() {
                continue;
            }
            self.create_object(value)?;
        }
        Ok(())
    }

    /// Creates one object (its `apiVersion` and `kind` pick the resource); returns it as
    /// stored.
    pub fn create_object(&self, obj: Value) -> anyhow::Result<Value> {
        Ok(self.shared().store().create_value(obj)?)
    }

    /// The stored object, or `None`. `resource` is the plural (`pods`, `nodes`,
    /// `configmaps`, `events`, `namespaces`, `leases`, `events.events.k8s.io`).
    pub fn get_object(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.shared().store().get_by_id(resource, namespace, name)
    }

    /// The stored object decoded as `K` (e.g. `k8s_openapi::api::core::v1::Pod`), or `None`
    /// when missing or not decodable. Decoded from the object's text, as kube's client decodes
    /// (`serde_json::from_str`): a caller's `K` then shares that decoder instead of compiling
    /// one more for `serde_json::Value` (a Pod's is most of a megabyte of the binary).
    pub fn get_as<K: serde::de::DeserializeOwned>(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<K> {
        let object = self.get_object(resource, namespace, name)?;
        serde_json::from_str(&object.to_string()).ok()
    }

    /// All stored objects of `resource`, in one namespace or (`None`) all, ordered by
    /// namespace then name.
    pub fn list_objects(&self, resource: &str, namespace: Option<&str>) -> Vec<Value> {
        self.shared().store().list_by_id(resource, namespace)
    }

    /// Deletes an object (a `DELETED` watch event).
    pub fn delete_object(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> anyhow::Result<()> {
        self.shared()
            .store()
            .delete_by_id(resource, namespace, name)?;
        Ok(())
    }

    /// Sets a pod's `status.phase` (a `MODIFIED` watch event).
    pub fn set_pod_phase(&self, namespace: &str, name: &str, phase: &str) -> anyhow::Result<()> {
        self.shared()
            .store()
            .set_pod_phase(namespace, name, phase)?;
        Ok(())
    }

    /// Keeps only the last `n` watch events (default 10 000); a watch from an older
    /// `resourceVersion` then gets `410 Gone`. Applies at once.
    pub fn set_history_limit(&self, n: usize) {
        self.shared().store().set_history_limit(n);
    }

    /// The current global `resourceVersion`.
    pub fn resource_version(&self) -> u64 {
        self.shared().store().resource_version()
    }

    /// Injects a fault. A `CutWatch` first cuts matching open watch streams.
    pub fn inject(&self, fault: Fault) {
        let mut controls = self.shared().controls();
        let mut fault = fault;
        if matches!(fault.action, FaultAction::CutWatch) {
            for (_, open) in controls.watches.iter_mut() {
                if fault.times == 0 {
                    break;
                }
                if fault.matches(&http::Method::GET, &open.path_and_query)
                    && let Some(cut) = open.cut.take()
                {
                    let _ = cut.send(());
                    fault.times -= 1;
                }
            }
        }
        if fault.times > 0 {
            controls.faults.push(fault);
        }
    }

    /// Sends calls to webhooks whose `clientConfig.service` is `namespace/service` to
    /// `addr` (the sandbox has no cluster network). Replaces an earlier route.
    pub fn route_service(&self, namespace: &str, service: &str, addr: SocketAddr) {
        let mut controls = self.shared().controls();
        controls
            .services
            .retain(|(n, s, _)| !(n == namespace && s == service));
        controls
            .services
            .push((namespace.to_string(), service.to_string(), addr));
    }

    /// How many requests held by [`FaultAction::ApplyLate`] or [`FaultAction::ApplyOnRelease`]
    /// have not been applied yet.
    pub fn late_in_flight(&self) -> usize {
        self.shared().controls().late_in_flight
    }

    /// Removes every pending fault.
    pub fn clear_faults(&self) {
        self.shared().controls().faults.clear();
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared().controls().requests.clone()
    }

    /// How many requests were received so far (cheaper than [`ApiServer::requests`]).
    pub fn request_count(&self) -> usize {
        self.shared().controls().requests.len()
    }

    /// Turns the watch cache on (the default, as kube-apiserver's `--watch-cache`) or off:
    /// off, a list at `resourceVersion=0` is paged by its limit like any list read from etcd
    /// (see the module `watch_cache`).
    pub fn set_watch_cache(&self, enabled: bool) {
        self.shared().cache().set_enabled(enabled);
    }

    /// Holds the watch cache at the current resourceVersion (returned) until
    /// [`ApiServer::release_watch_cache`]: lists at `resourceVersion=0` answer the objects as
    /// they are now, lists not older than a later version answer 504 "Too large resource
    /// version", watches deliver no later event; consistent lists still read the truth. What
    /// a cache lagging behind etcd shows its clients.
    pub fn hold_watch_cache(&self) -> u64 {
        let (rv, objects) = self.shared().store().snapshot();
        self.shared().cache().hold(rv, objects);
        rv
    }

    /// Lets a held watch cache catch up: lists and watches see the newest state again.
    pub fn release_watch_cache(&self) {
        self.shared().cache().release();
    }

    /// Every request refused by authentication (401) or authorization (403) so far, in
    /// order: what a role was not allowed to do.
    pub fn refusals(&self) -> Vec<Refusal> {
        self.shared().controls().refusals.clone()
    }

    /// Stops the server: no new connections, open watches end. Waits for the accept loop.
    pub async fn shutdown(self) {
        let _ = self.inner.stop.send(true);
        let task = self
            .inner
            .task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}
