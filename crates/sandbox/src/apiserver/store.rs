//! The sandbox API server's in-memory store: objects as JSON by (resource, namespace, name),
//! one global resourceVersion counter, a bounded history of watch events and a broadcast of
//! new ones. Also the `Status` error type and timestamps. No persistence, no conversion.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::discovery::{self, ResourceDef};
use super::feature_gates::{Cluster, FeatureGate};
use super::patch::{self, PatchKind};
use super::resource_strategy::{self, Write};
use super::validation_resource;

/// Watch events kept by default.
const DEFAULT_HISTORY: usize = 10_000;
/// Capacity of the live broadcast; a watcher lagging more is cut (it resumes from its last
/// resourceVersion).
const LIVE_CAPACITY: usize = 16_384;

/// A Kubernetes API error, rendered as a `Status` object.
#[derive(Clone, Debug)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: std::borrow::Cow<'static, str>,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    fn with(code: u16, reason: &'static str, message: String, details: Option<Value>) -> ApiError {
        ApiError::new(code, reason, message, details)
    }

    /// A `Status` with any reason (an admission webhook's own, say) and details.
    pub fn new(
        code: u16,
        reason: impl Into<std::borrow::Cow<'static, str>>,
        message: String,
        details: Option<Value>,
    ) -> ApiError {
        ApiError {
            code,
            reason: reason.into(),
            message,
            details,
        }
    }

    /// A `Status` with an explicit code and reason.
    pub fn with_code(code: u16, reason: &'static str, message: &str) -> ApiError {
        ApiError::with(code, reason, message.to_string(), None)
    }

    /// A `Status` for a bare HTTP code (used by injected faults).
    pub fn from_code(code: u16) -> ApiError {
        let reason = match code {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            405 => "MethodNotAllowed",
            409 => "Conflict",
            410 => "Expired",
            415 => "UnsupportedMediaType",
            422 => "Invalid",
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "Unknown",
        };
        ApiError::with(
            code,
            reason,
            format!("injected fault: {reason} ({code})"),
            None,
        )
    }

    pub fn not_found(def: &ResourceDef, name: &str) -> ApiError {
        ApiError::with(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", def.qualified()),
            Some(details(def, name)),
        )
    }

    pub fn already_exists(def: &ResourceDef, name: &str) -> ApiError {
        ApiError::with(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", def.qualified()),
            Some(details(def, name)),
        )
    }

    pub fn conflict(def: &ResourceDef, name: &str, why: &str) -> ApiError {
        ApiError::with(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                def.qualified()
            ),
            Some(details(def, name)),
        )
    }

    pub fn stale(def: &ResourceDef, name: &str) -> ApiError {
        ApiError::conflict(
            def,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::with(400, "BadRequest", message.into(), None)
    }

    pub fn invalid(def: &ResourceDef, name: &str, message: impl Into<String>) -> ApiError {
        ApiError::with(422, "Invalid", message.into(), Some(details(def, name)))
    }

    pub fn path_not_found() -> ApiError {
        ApiError::with(
            404,
            "NotFound",
            "the server could not find the requested resource".into(),
            None,
        )
    }

    pub fn method_not_allowed(method: &http::Method) -> ApiError {
        ApiError::with(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource: {method}"),
            None,
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> ApiError {
        ApiError::with(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {content_type:?})"
            ),
            None,
        )
    }

    /// Upstream's `NewForbidden`: `<resource>[.group] ["name"] is forbidden: <why>`, or
    /// `forbidden: <why>` without a resource.
    pub fn forbidden(group: &str, resource: &str, name: &str, why: &str) -> ApiError {
        let qualified = if group.is_empty() {
            resource.to_string()
        } else {
            format!("{resource}.{group}")
        };
        let message = match (qualified.is_empty() || resource.is_empty(), name.is_empty()) {
            (true, _) => format!("forbidden: {why}"),
            (false, true) => format!("{qualified} is forbidden: {why}"),
            (false, false) => format!("{qualified} {name:?} is forbidden: {why}"),
        };
        let mut details = json!({});
        for (key, value) in [("name", name), ("group", group), ("kind", resource)] {
            if !value.is_empty() {
                details[key] = json!(value);
            }
        }
        ApiError::with(403, "Forbidden", message, Some(details))
    }

    /// The 401 of a request without valid credentials.
    pub fn unauthorized() -> ApiError {
        ApiError::with(401, "Unauthorized", "Unauthorized".into(), None)
    }

    pub fn gone(message: impl Into<String>) -> ApiError {
        ApiError::with(410, "Expired", message.into(), None)
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}

fn details(def: &ResourceDef, name: &str) -> Value {
    let mut d = json!({ "name": name, "kind": def.plural });
    if !def.group.is_empty() {
        d["group"] = json!(def.group);
    }
    d
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} {})", self.message, self.code, self.reason)
    }
}

impl std::error::Error for ApiError {}

/// The kind of a watch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as kept in history and broadcast to watches.
#[derive(Debug)]
pub(crate) struct StoredEvent {
    pub rv: u64,
    pub resource: &'static str,
    pub namespace: String,
    pub kind: EventType,
    pub object: Value,
    /// The object before a modification.
    pub old: Option<Value>,
}

/// (resource id, namespace or "", name).
pub(crate) type Key = (&'static str, String, String);

/// What a PATCH would do, before it is done (admission sees it first).
pub(crate) enum PreparedPatch {
    /// `current` becomes `next`.
    Update { current: Value, next: Value },
    /// An apply patch of a missing object creates this one.
    Create(Value),
}

/// The objects, the counter and the event history.
pub(crate) struct Store {
    rv: u64,
    objects: Objects,
    history: VecDeque<Arc<StoredEvent>>,
    history_limit: usize,
    /// The newest resourceVersion dropped from history: a watch from before it is gone.
    compacted_rv: u64,
    live: broadcast::Sender<Arc<StoredEvent>>,
    /// The Kubernetes version played and its feature gates: which `resource.k8s.io` fields a
    /// write keeps and which rules validate it.
    cluster: Cluster,
}

/// Who creates an object.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// An API request: a claim's status is reset, as upstream does.
    Request,
    /// A test control seeding an object as the cluster would hold it (a claim keeps the status
    /// a controller would have written).
    Seed,
}

/// A pod's status subresource etc. keep `.status` apart from main-resource writes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    Main,
    Status,
}

impl Store {
    pub fn new() -> Store {
        let (live, _) = broadcast::channel(LIVE_CAPACITY);
        Store {
            rv: 0,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_limit: DEFAULT_HISTORY,
            compacted_rv: 0,
            live,
            cluster: Cluster::default(),
        }
    }

    /// The Kubernetes version played and its gates.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Plays another Kubernetes version (every gate at that version's default).
    pub fn set_cluster(&mut self, cluster: Cluster) {
        self.cluster = cluster;
    }

    /// Sets one feature gate.
    pub fn set_gate(&mut self, gate: FeatureGate, enabled: bool) {
        self.cluster.set(gate, enabled);
    }

    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Every object, by key.
    pub fn objects(&self) -> &Objects {
        &self.objects
    }

    pub fn set_history_limit(&mut self, n: usize) {
        self.history_limit = n;
        self.trim_history();
    }

    fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted_rv = dropped.rv;
            }
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<StoredEvent>> {
        self.live.subscribe()
    }

    /// Events after `rv`, or `None` when some of them were dropped from history.
    pub fn events_since(&self, rv: u64) -> Option<Vec<Arc<StoredEvent>>> {
        if rv < self.compacted_rv {
            return None;
        }
        Some(self.history.iter().filter(|e| e.rv > rv).cloned().collect())
    }

    fn key(def: &ResourceDef, namespace: Option<&str>, name: &str) -> Key {
        let ns = if def.namespaced {
            namespace.unwrap_or("default")
        } else {
            ""
        };
        (def.id, ns.to_string(), name.to_string())
    }

    /// Stores `obj` under `key` with a new resourceVersion and publishes the event.
    fn commit(&mut self, key: Key, mut obj: Value, kind: EventType, old: Option<Value>) -> Value {
        self.rv += 1;
        set_meta(&mut obj, "resourceVersion", json!(self.rv.to_string()));
        let event = Arc::new(StoredEvent {
            rv: self.rv,
            resource: key.0,
            namespace: key.1.clone(),
            kind,
            object: obj.clone(),
            old,
        });
        if kind == EventType::Deleted {
            self.objects.remove(&key);
        } else {
            self.objects.insert(key, obj.clone());
        }
        self.history.push_back(event.clone());
        self.trim_history();
        let _ = self.live.send(event);
        obj
    }

    /// Creates an object from its own `apiVersion`/`kind` (test controls).
    pub fn create_value(&mut self, obj: Value) -> Result<Value, ApiError> {
        let api_version = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        let def = discovery::by_kind(api_version, kind).ok_or_else(|| {
            ApiError::bad_request(format!(
                "the sandbox API server does not store apiVersion {api_version:?} kind {kind:?}"
            ))
        })?;
        let (key, obj) = self.admit_create(def, None, obj, Origin::Seed)?;
        Ok(self.commit(key, obj, EventType::Added, None))
    }

    /// Creates an object of `def` (namespace from the URL, else the object, else `default`).
    pub fn create(
        &mut self,
        def: &'static ResourceDef,
        url_namespace: Option<&str>,
        obj: Value,
    ) -> Result<Value, ApiError> {
        let (key, obj) = self.admit_create(def, url_namespace, obj, Origin::Request)?;
        Ok(self.commit(key, obj, EventType::Added, None))
    }

    /// A create with `dryRun=All`: validated and answered as it would be stored (fields a
    /// disabled gate drops are dropped), but nothing is stored and no event is sent.
    pub fn create_dry_run(
        &mut self,
        def: &'static ResourceDef,
        url_namespace: Option<&str>,
        obj: Value,
    ) -> Result<Value, ApiError> {
        let (_, obj) = self.admit_create(def, url_namespace, obj, Origin::Request)?;
        Ok(obj)
    }

    /// Stores an object a create prepared ([`Store::admit_create`]); 409 when its name was
    /// taken meanwhile.
    pub fn commit_create(
        &mut self,
        def: &'static ResourceDef,
        key: Key,
        obj: Value,
    ) -> Result<Value, ApiError> {
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(def, &key.2));
        }
        Ok(self.commit(key, obj, EventType::Added, None))
    }

    /// `obj` as a dry-run write answers it. The fields a disabled gate drops were dropped when
    /// the write was prepared ([`Store::admit_create`], [`Store::prepare_update`]), as
    /// upstream's strategy does before validation.
    pub fn dry_run_view(&self, _def: &ResourceDef, obj: Value) -> Value {
        obj
    }

    /// The checks and defaults of a create: the key and the object to store. For
    /// `resource.k8s.io` kinds, upstream's strategy (gated fields dropped) and validation, on
    /// the object mutating admission returned (upstream's order).
    pub fn admit_create(
        &self,
        def: &'static ResourceDef,
        url_namespace: Option<&str>,
        mut obj: Value,
        origin: Origin,
    ) -> Result<(Key, Value), ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request(
                "the request body is not a JSON object",
            ));
        }
        check_kind(def, &obj)?;
        let name = match meta_str(&obj, "name") {
            Some(name) if !name.is_empty() => name.to_string(),
            _ => match meta_str(&obj, "generateName") {
                Some(prefix) if !prefix.is_empty() => format!("{prefix}{}", random_suffix()),
                _ => {
                    return Err(ApiError::invalid(
                        def,
                        "",
                        format!(
                            "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                            def.kind
                        ),
                    ));
                }
            },
        };
        validate_name(def, &name)?;
        let namespace = if def.namespaced {
            let body_ns = meta_str(&obj, "namespace").filter(|ns| !ns.is_empty());
            match (url_namespace, body_ns) {
                (Some(u), Some(b)) if u != b => {
                    return Err(ApiError::bad_request(format!(
                        "the namespace of the provided object ({b}) does not match the namespace sent on the request ({u})"
                    )));
                }
                (Some(u), _) => Some(u.to_string()),
                (None, Some(b)) => Some(b.to_string()),
                (None, None) => Some("default".to_string()),
            }
        } else {
            None
        };
        let key = Store::key(def, namespace.as_deref(), &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(def, &name));
        }
        obj["apiVersion"] = json!(def.api_version());
        obj["kind"] = json!(def.kind);
        set_meta(&mut obj, "name", json!(name));
        match &namespace {
            Some(ns) => set_meta(&mut obj, "namespace", json!(ns)),
            None => remove_meta(&mut obj, "namespace"),
        }
        set_meta(&mut obj, "uid", json!(new_uid()));
        set_meta(&mut obj, "creationTimestamp", json!(now_rfc3339()));
        remove_meta(&mut obj, "resourceVersion");
        if def.id == "pods" {
            set_meta(&mut obj, "generation", json!(1));
            if obj.pointer("/status/phase").is_none() {
                let status = obj
                    .as_object_mut()
                    .map(|o| o.entry("status").or_insert_with(|| json!({})));
                if let Some(Value::Object(status)) = status {
                    status.insert("phase".into(), json!("Pending"));
                }
            }
        }
        let write = Write::Create {
            keep_status: origin == Origin::Seed,
        };
        resource_strategy::prepare(def.id, &mut obj, write, &self.cluster);
        validation_resource::validate(def, &obj, None, Part::Main, &self.cluster)?;
        Ok((key, obj))
    }

    pub fn get(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.objects
            .get(&Store::key(def, namespace, name))
            .cloned()
            .ok_or_else(|| ApiError::not_found(def, name))
    }

    /// Objects of `def` (in `namespace`, or all), ordered by namespace and name, that pass
    /// `keep` and come after `after` (a `(namespace, name)` continue position); at most
    /// `limit` of them (0: all). The second value says whether more matching objects follow.
    ///
    /// Walks only the key range from `after` on and stops after `limit + 1` matches, so a
    /// paged list of N objects costs O(N) in all, not O(N²) (as an API server's watch cache).
    pub fn list(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        after: Option<&(String, String)>,
        limit: usize,
        keep: &dyn Fn(&Value) -> bool,
    ) -> (Vec<(String, String, Value)>, bool) {
        list_in(&self.objects, def, namespace, after, limit, keep)
    }

    /// Every object as it is now, and the resourceVersion it is at: what a watch cache held
    /// back at this moment answers (`super::watch_cache`).
    pub fn snapshot(&self) -> (u64, Objects) {
        (self.rv, self.objects.clone())
    }

    /// What a PUT would store: `(current, next)`, checked as [`Store::update`] checks it.
    pub fn prepare_update(
        &self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        obj: Value,
        part: Part,
    ) -> Result<(Value, Value), ApiError> {
        let (key, current) = self.update_target(def, namespace, name, &obj)?;
        let next = self.next_object(def, &key.2, &current, obj, part)?;
        Ok((current, next))
    }

    /// What a PATCH would do, checked as [`Store::patch`] checks it.
    pub fn prepare_patch(
        &self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        kind: PatchKind,
        body: &[u8],
        part: Part,
    ) -> Result<PreparedPatch, ApiError> {
        let key = Store::key(def, namespace, name);
        let Some(current) = self.objects.get(&key).cloned() else {
            if kind == PatchKind::Apply && part == Part::Main {
                let mut obj = patch::parse_apply_body(body)?;
                if obj.get("metadata").is_none_or(|m| !m.is_object()) {
                    obj["metadata"] = json!({});
                }
                set_meta(&mut obj, "name", json!(name));
                return Ok(PreparedPatch::Create(obj));
            }
            return Err(ApiError::not_found(def, name));
        };
        let patched = patch::apply(kind, &current, body)?;
        let next = self.next_object(def, name, &current, patched, part)?;
        Ok(PreparedPatch::Update { current, next })
    }

    /// The stored object a PUT of `obj` replaces, after the body checks.
    fn update_target(
        &self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        obj: &Value,
    ) -> Result<(Key, Value), ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request(
                "the request body is not a JSON object",
            ));
        }
        check_kind(def, obj)?;
        if let Some(body_name) = meta_str(obj, "name")
            && body_name != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        let key = Store::key(def, namespace, name);
        let current = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(def, name))?;
        Ok((key, current))
    }

    /// Replaces an object (PUT); 409 when the body's resourceVersion is stale.
    pub fn update(
        &mut self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let (key, current) = self.update_target(def, namespace, name, &obj)?;
        self.replace(def, key, current, obj, part)
    }

    /// Applies a patch (or, for apply patches of a missing object, creates it).
    pub fn patch(
        &mut self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        kind: PatchKind,
        body: &[u8],
        part: Part,
    ) -> Result<(Value, bool), ApiError> {
        let key = Store::key(def, namespace, name);
        let Some(current) = self.objects.get(&key).cloned() else {
            if kind == PatchKind::Apply && part == Part::Main {
                let mut obj = patch::parse_apply_body(body)?;
                if obj.get("metadata").is_none_or(|m| !m.is_object()) {
                    obj["metadata"] = json!({});
                }
                set_meta(&mut obj, "name", json!(name));
                return Ok((self.create(def, namespace, obj)?, true));
            }
            return Err(ApiError::not_found(def, name));
        };
        let patched = patch::apply(kind, &current, body)?;
        Ok((self.replace(def, key, current, patched, part)?, false))
    }

    /// Stores `new` in place of `current`, keeping system metadata and (per `part`) the
    /// other half of the object.
    fn replace(
        &mut self,
        def: &'static ResourceDef,
        key: Key,
        current: Value,
        new: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let next = self.next_object(def, &key.2, &current, new, part)?;
        if next == current {
            // A no-op write does not bump the resourceVersion, as in the real server.
            return Ok(current);
        }
        Ok(self.commit(key, next, EventType::Modified, Some(current)))
    }

    /// What replacing `current` with `new` stores: system metadata kept, (per `part`) the
    /// other half of the object kept; 409 when `new` carries a stale resourceVersion.
    fn next_object(
        &self,
        def: &'static ResourceDef,
        name: &str,
        current: &Value,
        new: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        if !new.is_object() {
            return Err(ApiError::bad_request(
                "the patched object is not a JSON object",
            ));
        }
        let current_rv = meta_str(current, "resourceVersion")
            .unwrap_or("")
            .to_string();
        if let Some(rv) = meta_str(&new, "resourceVersion")
            && !rv.is_empty()
            && rv != current_rv
        {
            return Err(ApiError::stale(def, name));
        }
        let mut next = match part {
            Part::Status => {
                let mut next = current.clone();
                next["status"] = new.get("status").cloned().unwrap_or_else(|| json!({}));
                next
            }
            Part::Main => {
                let mut next = new;
                if def.status {
                    match current.get("status") {
                        Some(status) => next["status"] = status.clone(),
                        None => {
                            if let Some(o) = next.as_object_mut() {
                                o.remove("status");
                            }
                        }
                    }
                }
                next
            }
        };
        next["apiVersion"] = json!(def.api_version());
        next["kind"] = json!(def.kind);
        if next.get("metadata").is_none_or(|m| !m.is_object()) {
            next["metadata"] = json!({});
        }
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
        ] {
            match current.pointer(&format!("/metadata/{field}")) {
                Some(v) => set_meta(&mut next, field, v.clone()),
                None => remove_meta(&mut next, field),
            }
        }
        if def.id == "pods" && current.get("spec") != next.get("spec") {
            let generation = current
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            set_meta(&mut next, "generation", json!(generation + 1));
        }
        let write = Write::Update { old: current, part };
        resource_strategy::prepare(def.id, &mut next, write, &self.cluster);
        validation_resource::validate(def, &next, Some(current), part, &self.cluster)?;
        set_meta(&mut next, "resourceVersion", json!(current_rv));
        Ok(next)
    }

    /// The object a DELETE would remove, after its preconditions are checked.
    pub fn prepare_delete(
        &self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        uid: Option<&str>,
        rv: Option<&str>,
    ) -> Result<Value, ApiError> {
        let current = self.get(def, namespace, name)?;
        check_precondition(def, name, &current, Precondition::Uid, uid)?;
        check_precondition(def, name, &current, Precondition::ResourceVersion, rv)?;
        Ok(current)
    }

    /// Deletes an object, checking the optional uid / resourceVersion preconditions.
    pub fn delete(
        &mut self,
        def: &'static ResourceDef,
        namespace: Option<&str>,
        name: &str,
        uid: Option<&str>,
        rv: Option<&str>,
    ) -> Result<Value, ApiError> {
        let key = Store::key(def, namespace, name);
        let current = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(def, name))?;
        check_precondition(def, name, &current, Precondition::Uid, uid)?;
        check_precondition(def, name, &current, Precondition::ResourceVersion, rv)?;
        Ok(self.commit(key, current, EventType::Deleted, None))
    }

    /// Binds pod `name` to `binding.target.name` (pods/binding).
    pub fn bind(&mut self, namespace: &str, name: &str, binding: &Value) -> Result<(), ApiError> {
        let def = discovery::by_id("pods").ok_or_else(ApiError::path_not_found)?;
        let binding_def = ResourceDef {
            plural: "pods/binding",
            ..*def
        };
        if let Some(body_name) = meta_str(binding, "name")
            && !body_name.is_empty()
            && body_name != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the binding ({body_name}) does not match the pod on the URL ({name})"
            )));
        }
        let target = binding
            .pointer("/target/name")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    def,
                    name,
                    format!("Binding \"{name}\" is invalid: target.name: Required value"),
                )
            })?
            .to_string();
        let key = Store::key(def, Some(namespace), name);
        let current = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(def, name))?;
        let uid = meta_str(binding, "uid").filter(|u| !u.is_empty());
        check_precondition(&binding_def, name, &current, Precondition::Uid, uid)?;
        if let Some(node) = current
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            return Err(ApiError::conflict(
                &binding_def,
                name,
                &format!("pod {name} is already assigned to node \"{node}\""),
            ));
        }
        let mut next = current.clone();
        if !next.get("spec").is_some_and(Value::is_object) {
            next["spec"] = json!({});
        }
        next["spec"]["nodeName"] = json!(target);
        if !next.get("status").is_some_and(Value::is_object) {
            next["status"] = json!({});
        }
        let mut conditions: Vec<Value> = next["status"]
            .get("conditions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        conditions.retain(|c| c.get("type").and_then(Value::as_str) != Some("PodScheduled"));
        conditions.push(json!({ "type": "PodScheduled", "status": "True",
            "lastProbeTime": null, "lastTransitionTime": now_rfc3339() }));
        next["status"]["conditions"] = json!(conditions);
        self.commit(key, next, EventType::Modified, Some(current));
        Ok(())
    }

    pub fn set_pod_phase(
        &mut self,
        namespace: &str,
        name: &str,
        phase: &str,
    ) -> Result<(), ApiError> {
        let def = discovery::by_id("pods").ok_or_else(ApiError::path_not_found)?;
        let key = Store::key(def, Some(namespace), name);
        let current = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(def, name))?;
        let mut next = current.clone();
        if !next.get("status").is_some_and(Value::is_object) {
            next["status"] = json!({});
        }
        next["status"]["phase"] = json!(phase);
        self.commit(key, next, EventType::Modified, Some(current));
        Ok(())
    }

    fn def_for_id(id: &str) -> Result<&'static ResourceDef, ApiError> {
        discovery::by_id(id).ok_or_else(|| {
            ApiError::bad_request(format!("the sandbox API server has no resource {id:?}"))
        })
    }

    pub fn get_by_id(&self, id: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let def = Store::def_for_id(id).ok()?;
        self.get(def, namespace, name).ok()
    }

    pub fn list_by_id(&self, id: &str, namespace: Option<&str>) -> Vec<Value> {
        match Store::def_for_id(id) {
            Ok(def) => self
                .list(def, namespace.filter(|_| def.namespaced), None, 0, &|_| {
                    true
                })
                .0
                .into_iter()
                .map(|(_, _, obj)| obj)
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    pub fn delete_by_id(
        &mut self,
        id: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let def = Store::def_for_id(id)?;
        self.delete(def, namespace, name, None, None)
    }
}

/// The objects of a store (or of a watch cache's snapshot of it), by key.
pub(crate) type Objects = BTreeMap<Key, Value>;

/// [`Store::list`] over `objects`.
pub(crate) fn list_in(
    objects: &Objects,
    def: &ResourceDef,
    namespace: Option<&str>,
    after: Option<&(String, String)>,
    limit: usize,
    keep: &dyn Fn(&Value) -> bool,
) -> (Vec<(String, String, Value)>, bool) {
    use std::ops::Bound;
    let start: Key = match (after, namespace) {
        (Some((a_ns, a_name)), _) => (def.id, a_ns.clone(), a_name.clone()),
        (None, Some(ns)) => (def.id, ns.to_string(), String::new()),
        (None, None) => (def.id, String::new(), String::new()),
    };
    let lower = if after.is_some() {
        Bound::Excluded(start)
    } else {
        Bound::Included(start)
    };
    let mut out = Vec::new();
    let mut more = false;
    for ((id, ns, name), obj) in objects.range((lower, Bound::Unbounded)) {
        if *id != def.id || namespace.is_some_and(|want| want < ns.as_str()) {
            break;
        }
        if namespace.is_some_and(|want| want != ns) || !keep(obj) {
            continue;
        }
        if limit > 0 && out.len() == limit {
            more = true;
            break;
        }
        out.push((ns.clone(), name.clone(), obj.clone()));
    }
    (out, more)
}

/// How many objects of `def` (in `namespace`, or all) there are in `objects` after `after`
/// (from the start when `None`): the `remainingItemCount` of an unfiltered page (not cloned,
/// not matched).
pub(crate) fn count_in(
    objects: &Objects,
    def: &ResourceDef,
    namespace: Option<&str>,
    after: Option<&(String, String)>,
) -> usize {
    use std::ops::Bound;
    let lower = match after {
        Some((ns, name)) => Bound::Excluded((def.id, ns.clone(), name.clone())),
        None => Bound::Included((
            def.id,
            namespace.unwrap_or_default().to_string(),
            String::new(),
        )),
    };
    objects
        .range((lower, Bound::Unbounded))
        .take_while(|((id, ns, _), _)| *id == def.id && namespace.is_none_or(|want| want == ns))
        .count()
}

fn check_kind(def: &ResourceDef, obj: &Value) -> Result<(), ApiError> {
    if let Some(kind) = obj.get("kind").and_then(Value::as_str)
        && !kind.is_empty()
        && kind != def.kind
    {
        return Err(ApiError::bad_request(format!(
            "the object kind {kind:?} does not match the resource {} (kind {:?})",
            def.qualified(),
            def.kind
        )));
    }
    Ok(())
}

fn validate_name(def: &ResourceDef, name: &str) -> Result<(), ApiError> {
    if def.group == "rbac.authorization.k8s.io" {
        // Upstream's ValidateRBACName: any valid path segment (`system:discovery`).
        return if name == "." || name == ".." || name.contains(['/', '%']) {
            Err(ApiError::invalid(
                def,
                name,
                format!(
                    "{} \"{name}\" is invalid: metadata.name: Invalid value: \"{name}\": may not be '.' or '..' and may not contain '/' or '%'",
                    def.kind
                ),
            ))
        } else {
            Ok(())
        };
    }
    let ok = name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            def,
            name,
            format!(
                "{} \"{name}\" is invalid: metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                def.kind
            ),
        ))
    }
}

/// The metadata field a DELETE or Binding may carry as a precondition.
#[derive(Clone, Copy)]
enum Precondition {
    Uid,
    ResourceVersion,
}

/// The API server's 409 when `want` is given and differs from the object's metadata field.
fn check_precondition(
    def: &ResourceDef,
    name: &str,
    current: &Value,
    which: Precondition,
    want: Option<&str>,
) -> Result<(), ApiError> {
    let (field, label) = match which {
        Precondition::Uid => ("uid", "UID"),
        Precondition::ResourceVersion => ("resourceVersion", "ResourceVersion"),
    };
    let Some(want) = want else { return Ok(()) };
    let have = meta_str(current, field).unwrap_or("");
    if want == have {
        return Ok(());
    }
    Err(ApiError::conflict(
        def,
        name,
        &format!(
            "Precondition failed: {label} in precondition: {want}, {label} in object meta: {have}"
        ),
    ))
}

/// `metadata.<field>` as a string.
pub(crate) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn set_meta(obj: &mut Value, field: &str, value: Value) {
    if let Some(o) = obj.as_object_mut() {
        let meta = o
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if !meta.is_object() {
            *meta = Value::Object(Map::new());
        }
        if let Some(meta) = meta.as_object_mut() {
            meta.insert(field.to_string(), value);
        }
    }
}

fn remove_meta(obj: &mut Value, field: &str) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove(field);
    }
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(crate) fn random_u64() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    mix(nanos ^ mix(n) ^ u64::from(std::process::id()))
}

/// A random (version 4 layout) UUID.
pub(crate) fn new_uid() -> String {
    let a = random_u64();
    let b = random_u64();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | (b >> 48 & 0x3fff),
        b & 0xffff_ffff_ffff
    )
}

/// Five characters for `generateName`, as the real server does.
fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = random_u64();
    (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

/// Now, as `YYYY-MM-DDTHH:MM:SSZ`.
pub(crate) fn now_rfc3339() -> String {
    let secs = unix_now();
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Seconds since the epoch.
pub(crate) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)` into seconds since the epoch.
pub(crate) fn parse_rfc3339(s: &str) -> Option<i64> {
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut rest = s.get(19..)?;
    if let Some(frac) = rest.strip_prefix('.') {
        rest = frac.trim_start_matches(|c: char| c.is_ascii_digit());
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            let oh = rest.get(1..3)?.parse::<i64>().ok()?;
            let om = rest.get(4..6)?.parse::<i64>().ok()?;
            sign * (oh * 3600 + om * 60)
        }
    };
    Some(days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + se - offset)
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip() {
        let now = now_rfc3339();
        let parsed = parse_rfc3339(&now).expect("own timestamps parse");
        assert!((parsed - unix_now()).abs() <= 1);
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("2000-03-01T00:00:00Z"), Some(951_868_800));
        assert_eq!(
            parse_rfc3339("2000-03-01T01:00:00+01:00"),
            Some(951_868_800)
        );
        assert_eq!(parse_rfc3339("garbage"), None);
    }

    fn slice_def() -> &'static ResourceDef {
        discovery::by_kind("resource.k8s.io/v1", "ResourceSlice").expect("served")
    }

    fn slice() -> Value {
        json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": { "name": "s" },
                "spec": { "driver": "gpushare.io", "allNodes": true,
                          "pool": { "name": "p", "generation": 1, "resourceSliceCount": 1 },
                          "devices": [{ "name": "gpu-0", "allowMultipleAllocations": true,
                                        "capacity": { "memory": { "value": "16Gi",
                                            "requestPolicy": { "default": "16Gi" } } } }] } })
    }

    #[test]
    fn a_dry_run_create_stores_nothing_and_a_gate_off_drops_consumable_capacity() {
        let mut store = Store::new();
        let rv = store.resource_version();
        let answer = store
            .create_dry_run(slice_def(), None, slice())
            .expect("dry run");
        assert_eq!(
            answer.pointer("/spec/devices/0/allowMultipleAllocations"),
            Some(&json!(true))
        );
        assert_eq!(store.resource_version(), rv, "nothing stored");
        assert!(store.get(slice_def(), None, "s").is_err());
        store.set_gate(FeatureGate::DRAConsumableCapacity, false);
        let answer = store
            .create_dry_run(slice_def(), None, slice())
            .expect("dry run");
        assert_eq!(
            answer.pointer("/spec/devices/0/allowMultipleAllocations"),
            None
        );
        assert_eq!(
            answer.pointer("/spec/devices/0/capacity/memory"),
            Some(&json!({ "value": "16Gi" }))
        );
        let stored = store.create(slice_def(), None, slice()).expect("create");
        assert_eq!(
            stored.pointer("/spec/devices/0/allowMultipleAllocations"),
            None
        );
    }

    #[test]
    fn uids_are_unique_and_shaped() {
        let a = new_uid();
        let b = new_uid();
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(a.as_bytes()[14], b'4');
    }

    #[test]
    fn history_compaction_reports_gone() {
        let mut store = Store::new();
        store.set_history_limit(2);
        for name in ["a", "b", "c", "d"] {
            store
                .create_value(
                    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}),
                )
                .expect("creates");
        }
        assert!(store.events_since(1).is_none());
        assert_eq!(store.events_since(2).map(|e| e.len()), Some(2));
    }

    #[test]
    fn paged_lists_walk_their_range_and_stop_at_the_limit() {
        let mut store = Store::new();
        for (ns, name) in [
            ("a", "x"),
            ("b", "p1"),
            ("b", "p2"),
            ("b", "p3"),
            ("c", "y"),
        ] {
            store
                .create_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": name, "namespace": ns}}))
                .expect("creates");
        }
        store
            .create_value(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}}))
            .expect("creates");
        let def = Store::def_for_id("configmaps").expect("a resource");
        let names = |items: &[(String, String, Value)]| {
            items
                .iter()
                .map(|(ns, n, _)| format!("{ns}/{n}"))
                .collect::<Vec<_>>()
        };
        let all = |_: &Value| true;

        // All namespaces, two at a time: pages end exactly, no other kind leaks in.
        let (page, more) = store.list(def, None, None, 2, &all);
        assert_eq!(
            (names(&page), more),
            (vec!["a/x".into(), "b/p1".into()], true)
        );
        let after = ("b".to_string(), "p1".to_string());
        assert_eq!(count_in(&store.objects, def, None, Some(&after)), 3);
        assert_eq!(count_in(&store.objects, def, None, None), 5);
        let (page, more) = store.list(def, None, Some(&after), 2, &all);
        assert_eq!(
            (names(&page), more),
            (vec!["b/p2".into(), "b/p3".into()], true)
        );
        let after = ("b".to_string(), "p3".to_string());
        let (page, more) = store.list(def, None, Some(&after), 2, &all);
        assert_eq!((names(&page), more), (vec!["c/y".into()], false));

        // One namespace: bounded on both sides; a limit equal to what is left says no more.
        let (page, more) = store.list(def, Some("b"), None, 3, &all);
        assert_eq!(names(&page).len(), 3);
        assert!(!more);
        let after = ("b".to_string(), "p1".to_string());
        assert_eq!(count_in(&store.objects, def, Some("b"), Some(&after)), 2);
        assert_eq!(count_in(&store.objects, def, Some("b"), None), 3);

        // A filter skips without ending the page early; 0 means everything.
        let only_p2 = |o: &Value| meta_str(o, "name") == Some("p2");
        let (page, more) = store.list(def, None, None, 1, &only_p2);
        assert_eq!((names(&page), more), (vec!["b/p2".into()], false));
        assert_eq!(store.list(def, None, None, 0, &all).0.len(), 5);
    }
}
