//! The HTTP side of the sandbox API server: the accept loop (hyper HTTP/1.1), request
//! logging and fault injection, routing of discovery and resource paths, and watch streams
//! (newline-delimited JSON, chunked).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use super::admission::{self, Attributes, Operation};
use super::discovery::{self, ResourceDef};
use super::identity::{self, Identity};
use super::patch::PatchKind;
use super::selector::Selectors;
use super::store::{
    ApiError, EventType, Objects, Origin, Part, PreparedPatch, StoredEvent, count_in, list_in,
    meta_str,
};
use super::table::{self, IncludeObject};
use super::watch_cache::{ListRead, too_large};
use super::{FaultAction, RecordedRequest, Refusal, Shared};
use super::{protobuf_body, rbac, request_info, reviews, serving_tls};

type Body = BoxBody<Bytes, std::io::Error>;

/// Largest request body accepted.
const MAX_BODY: usize = 16 << 20;
/// Interval between watch bookmarks, when asked for.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

/// Resolves once shutdown is signalled (or its sender is gone).
async fn stopped(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Accepts connections until shutdown: plain HTTP, or HTTPS when the first byte is a TLS
/// handshake (see `serving_tls`).
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    tls: Arc<tokio_rustls::rustls::ServerConfig>,
) {
    let mut shutdown = shared.shutdown.clone();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let accepted = tokio::select! {
            _ = stopped(&mut shutdown) => break,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let shared = shared.clone();
        let acceptor = acceptor.clone();
        let mut conn_shutdown = shared.shutdown.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(shared.clone(), req));
            let mut first = [0u8; 1];
            let tls = matches!(stream.peek(&mut first).await, Ok(1) if first[0] == serving_tls::HANDSHAKE);
            let http = hyper::server::conn::http1::Builder::new();
            let serve = async move {
                if tls {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = http.serve_connection(TokioIo::new(stream), service).await;
                    }
                } else {
                    let _ = http.serve_connection(TokioIo::new(stream), service).await;
                }
            };
            tokio::select! {
                _ = serve => {}
                _ = stopped(&mut conn_shutdown) => {}
            }
        });
    }
}

fn full(code: u16, body: Bytes) -> Response<Body> {
    let mut response = Response::new(
        Full::new(body)
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn json_response(code: u16, value: &Value) -> Response<Body> {
    full(code, Bytes::from(value.to_string()))
}

fn error_response(err: &ApiError) -> Response<Body> {
    json_response(err.code, &err.to_status())
}

fn respond(result: Result<(u16, Value), ApiError>) -> Response<Body> {
    match result {
        Ok((code, value)) => json_response(code, &value),
        Err(err) => error_response(&err),
    }
}

/// One request: record, apply faults, route.
async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => return Err(std::io::Error::other(err)),
    };
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or("").to_string();
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let authorization = parts
        .headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let user = shared.authenticate(identity::bearer(authorization));
    shared.record(RecordedRequest {
        method: parts.method.clone(),
        path: path.clone(),
        query: query.clone(),
        content_type: content_type.clone(),
        body: String::from_utf8_lossy(&bytes).into_owned(),
        username: user.as_ref().ok().map(|u| u.username.clone()),
    });
    let refused = |username: Option<String>, err: ApiError| {
        shared.refuse(Refusal {
            method: parts.method.clone(),
            path: path.clone(),
            query: query.clone(),
            username,
            code: err.code,
            message: err.message.clone(),
        });
        Ok(error_response(&err))
    };
    let Ok(user) = user else {
        return refused(None, ApiError::unauthorized());
    };
    let parsed_query = parse_query(&query);
    let attributes = request_info::resolve(&parts.method, &path, &parsed_query);
    let decision = rbac::authorize(&shared.store(), &user, &attributes);
    if !decision.allowed {
        let err = rbac::forbidden(&user, &attributes, &decision.reason);
        return refused(Some(user.username.clone()), err);
    }
    let path_and_query = if query.is_empty() {
        path.clone()
    } else {
        format!("{path}?{query}")
    };
    let fault = shared.take_fault(&parts.method, &path_and_query);
    if let Some(action) = fault.clone() {
        match action {
            FaultAction::Status(code) => return Ok(error_response(&ApiError::from_code(code))),
            FaultAction::Delay(delay) => tokio::time::sleep(delay).await,
            FaultAction::DropConnection => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "injected fault: connection dropped",
                ));
            }
            FaultAction::CutWatch
            | FaultAction::ApplyThenDrop
            | FaultAction::ApplyLate(_)
            | FaultAction::ApplyOnRelease { .. }
            | FaultAction::AnswerLate(_) => {}
            FaultAction::Hold(hold) => hold.pass().await,
        }
    }
    if bytes.len() > MAX_BODY {
        return Ok(error_response(&ApiError::with_code(
            413,
            "RequestEntityTooLarge",
            "the request body is too large",
        )));
    }
    let request = Req {
        method: parts.method,
        path,
        query: parsed_query,
        path_and_query,
        content_type,
        accept: parts
            .headers
            .get(ACCEPT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        body: bytes,
        user,
    };
    let response = match fault {
        Some(FaultAction::ApplyThenDrop) => {
            drop(route(&shared, &request).await);
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "injected fault: applied, answer dropped",
            ));
        }
        Some(FaultAction::ApplyLate(delay)) => {
            // A task of its own, so a client that hangs up cannot cancel the late write.
            let (tx, rx) = tokio::sync::oneshot::channel();
            shared.controls().late_in_flight += 1;
            let late = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let response = route(&late, &request).await;
                late.controls().late_in_flight -= 1;
                let _ = tx.send(response);
            });
            rx.await
                .map_err(|_| std::io::Error::other("the late apply task ended without an answer"))?
        }
        Some(FaultAction::ApplyOnRelease { hold, answer }) => {
            // A task of its own: neither a client that hangs up nor one that dies cancels it.
            let (tx, rx) = tokio::sync::oneshot::channel();
            shared.controls().late_in_flight += 1;
            let late = shared.clone();
            tokio::spawn(async move {
                hold.pass().await;
                let response = route(&late, &request).await;
                late.controls().late_in_flight -= 1;
                let _ = tx.send(response);
            });
            match answer {
                Some(code) => error_response(&ApiError::from_code(code)),
                None => rx.await.map_err(|_| {
                    std::io::Error::other("the held apply task ended without an answer")
                })?,
            }
        }
        Some(FaultAction::AnswerLate(delay)) => {
            let response = route(&shared, &request).await;
            tokio::time::sleep(delay).await;
            response
        }
        _ => route(&shared, &request).await,
    };
    Ok(response)
}

/// `response` with a `Warning: 299 - "<text>"` header per warning (admission's).
fn with_warnings(mut response: Response<Body>, warnings: &[String]) -> Response<Body> {
    for w in warnings {
        let text = format!("299 - \"{}\"", w.replace(['"', '\n', '\r'], " "));
        if let Ok(v) = http::HeaderValue::from_str(&text) {
            response.headers_mut().append(http::header::WARNING, v);
        }
    }
    response
}

/// A request, parsed.
struct Req {
    method: Method,
    path: String,
    query: Vec<(String, String)>,
    path_and_query: String,
    content_type: Option<String>,
    accept: Option<String>,
    body: Bytes,
    /// The authenticated identity.
    user: Identity,
}

impl Req {
    fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, name: &str) -> bool {
        matches!(self.param(name), Some("true" | "1"))
    }

    fn json_body(&self) -> Result<Value, ApiError> {
        if self.body.is_empty() {
            return Err(ApiError::bad_request("the request has no body"));
        }
        if self
            .content_type
            .as_deref()
            .is_some_and(|c| c.starts_with(protobuf_body::PROTOBUF))
        {
            return protobuf_body::decode(&self.body)
                .map_err(|why| ApiError::with_code(415, "UnsupportedMediaType", &why));
        }
        match serde_json::from_slice::<Value>(&self.body) {
            Ok(v) => Ok(v),
            Err(json_err) => std::str::from_utf8(&self.body)
                .ok()
                .and_then(|text| yaml_serde::from_str::<Value>(text).ok())
                .filter(Value::is_object)
                .ok_or_else(|| {
                    ApiError::bad_request(format!("error decoding the request body: {json_err}"))
                }),
        }
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(b)) => {
                out.push(b);
                i += 2;
            }
            (b, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// Where a resource path points.
enum Target {
    Collection {
        def: &'static ResourceDef,
        namespace: Option<String>,
    },
    Object {
        def: &'static ResourceDef,
        namespace: Option<String>,
        name: String,
        subresource: Option<String>,
    },
}

fn resource_target(group: &str, version: &str, rest: &[&str]) -> Option<Target> {
    let def = |plural: &str| discovery::by_path(group, version, plural);
    match rest {
        [plural] => Some(Target::Collection {
            def: def(plural)?,
            namespace: None,
        }),
        ["namespaces", ns, plural, tail @ ..] if def(plural).is_some_and(|d| d.namespaced) => {
            let def = def(plural)?;
            match tail {
                [] => Some(Target::Collection {
                    def,
                    namespace: Some(ns.to_string()),
                }),
                [name] => Some(Target::Object {
                    def,
                    namespace: Some(ns.to_string()),
                    name: name.to_string(),
                    subresource: None,
                }),
                [name, sub] => Some(Target::Object {
                    def,
                    namespace: Some(ns.to_string()),
                    name: name.to_string(),
                    subresource: Some(sub.to_string()),
                }),
                _ => None,
            }
        }
        [plural, name, tail @ ..] => {
            let def = def(plural).filter(|d| !d.namespaced)?;
            let subresource = match tail {
                [] => None,
                [sub] => Some(sub.to_string()),
                _ => return None,
            };
            Some(Target::Object {
                def,
                namespace: None,
                name: name.to_string(),
                subresource,
            })
        }
        _ => None,
    }
}

async fn route(shared: &Arc<Shared>, req: &Req) -> Response<Body> {
    let segments: Vec<&str> = req.path.split('/').filter(|s| !s.is_empty()).collect();
    let discovery_doc = match segments.as_slice() {
        ["version"] => Some(discovery::version(shared.store().cluster().minor())),
        ["api"] => Some(discovery::core_versions(shared.addr)),
        ["api", "v1"] => discovery::resource_list("", "v1"),
        ["apis"] => Some(discovery::group_list()),
        ["apis", group] => discovery::group(group),
        ["apis", group, version] => discovery::resource_list(group, version),
        ["openapi", "v3"] => Some(discovery::openapi_v3_root()),
        ["openapi", "v3", rest @ ..] => discovery::openapi_v3_group_version(&rest.join("/")),
        _ => None,
    };
    if segments.as_slice() == ["openapi", "v2"] && req.method == Method::GET {
        if req
            .accept
            .as_deref()
            .is_some_and(|a| a.contains("protobuf"))
        {
            let mut response = full(200, Bytes::from(discovery::openapi_v2_protobuf()));
            response.headers_mut().insert(
                CONTENT_TYPE,
                http::HeaderValue::from_static(
                    "application/com.github.proto-openapi.spec.v2.v1.0+protobuf",
                ),
            );
            return response;
        }
        return json_response(200, &discovery::openapi_v2_json());
    }
    if let Some(doc) = discovery_doc {
        if req.method != Method::GET {
            return error_response(&ApiError::method_not_allowed(&req.method));
        }
        return json_response(200, &doc);
    }
    let target = match segments.as_slice() {
        ["api", "v1", rest @ ..] if !rest.is_empty() => resource_target("", "v1", rest),
        ["apis", group, version, rest @ ..] if !rest.is_empty() => {
            resource_target(group, version, rest)
        }
        _ => None,
    };
    let Some(target) = target else {
        return error_response(&ApiError::path_not_found());
    };
    match target {
        Target::Collection { def, namespace } => {
            collection(shared, req, def, namespace.as_deref()).await
        }
        Target::Object {
            def,
            namespace,
            name,
            subresource,
        } => {
            object(
                shared,
                req,
                def,
                namespace.as_deref(),
                &name,
                subresource.as_deref(),
            )
            .await
        }
    }
}

fn selectors(req: &Req) -> Result<Selectors, ApiError> {
    Selectors::parse(req.param("labelSelector"), req.param("fieldSelector"))
        .map_err(ApiError::bad_request)
}

async fn collection(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
) -> Response<Body> {
    if !def.stored {
        return if req.method == Method::POST {
            respond(review(shared, req, def))
        } else {
            error_response(&ApiError::method_not_allowed(&req.method))
        };
    }
    match req.method {
        Method::GET if req.flag("watch") => match selectors(req) {
            Ok(selectors) => watch(shared, req, def, namespace, selectors),
            Err(err) => error_response(&err),
        },
        Method::GET => list(shared, req, def, namespace),
        Method::POST => match req.json_body() {
            Ok(obj) => create(shared, req, def, namespace, obj).await,
            Err(err) => error_response(&err),
        },
        Method::DELETE => match delete_collection(shared, req, def, namespace).await {
            Ok((code, value, warnings)) => with_warnings(json_response(code, &value), &warnings),
            Err(err) => error_response(&err),
        },
        _ => error_response(&ApiError::method_not_allowed(&req.method)),
    }
}

/// How often a write whose object changed while it was admitted is tried (as upstream's
/// `GuaranteedUpdate` retries a patch).
const WRITE_ATTEMPTS: usize = 5;

impl Req {
    /// `dryRun=All` (the only value upstream accepts) in the query.
    fn dry_run(&self) -> bool {
        self.param("dryRun") == Some("All")
    }
}

fn is_conflict(err: &ApiError) -> bool {
    err.code == 409 && err.reason == "Conflict"
}

/// A create: mutating admission on the object as sent (its namespace the request's), the
/// create's checks and defaults (name generated), validating admission, then stored (or, in a
/// dry run, answered). Without admission configured, the direct path.
async fn create(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
    mut obj: Value,
) -> Response<Body> {
    let dry_run = req.dry_run();
    {
        let mut store = shared.store();
        if !admission::configured(&store) {
            let created = if dry_run {
                store.create_dry_run(def, namespace, obj)
            } else {
                store.create(def, namespace, obj)
            };
            return respond(created.map(|obj| (201, obj)));
        }
    }
    if def.namespaced
        && let Some(ns) = namespace
        && let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut)
        && meta
            .get("namespace")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
    {
        meta.insert("namespace".into(), json!(ns));
    }
    let name = meta_str(&obj, "name").unwrap_or("").to_string();
    let mut attrs = Attributes::new(
        Operation::Create,
        def,
        None,
        namespace,
        &name,
        &req.user,
        dry_run,
    );
    attrs.object = Some(obj);
    let mut warnings = match admission::mutate(shared, &mut attrs).await {
        Ok(w) => w,
        Err(err) => return error_response(&err),
    };
    let prepared = shared.store().admit_create(
        def,
        namespace,
        attrs.object.take().unwrap_or(Value::Null),
        Origin::Request,
    );
    let (key, prepared) = match prepared {
        Ok(p) => p,
        Err(err) => return error_response(&err),
    };
    attrs.name = key.2.clone();
    attrs.object = Some(prepared.clone());
    match admission::validate(shared, &attrs).await {
        Ok(w) => warnings.extend(w),
        Err(err) => return error_response(&err),
    }
    let result = {
        let mut store = shared.store();
        if dry_run {
            Ok(store.dry_run_view(def, prepared))
        } else {
            store.commit_create(def, key, prepared)
        }
    };
    with_warnings(respond(result.map(|obj| (201, obj))), &warnings)
}

/// The object (or its subresource) a PUT or PATCH addresses.
#[derive(Clone, Copy)]
struct Addressed<'a> {
    def: &'static ResourceDef,
    namespace: Option<&'a str>,
    name: &'a str,
    subresource: Option<&'a str>,
    part: Part,
}

/// The body of a PUT or PATCH.
enum Change<'a> {
    Put(Value),
    Patch(PatchKind, &'a [u8]),
}

/// An update (PUT) or patch: the new object computed from the stored one, admitted as an
/// `UPDATE` (mutating, then validating), then stored if the stored object is still the one it
/// was computed from (else, for a patch or an unconditional PUT, computed again). An apply
/// patch of a missing object is a create. Without admission configured, the direct path.
async fn update(
    shared: &Arc<Shared>,
    req: &Req,
    at: Addressed<'_>,
    change: Change<'_>,
) -> Response<Body> {
    let Addressed {
        def,
        namespace,
        name,
        subresource,
        part,
    } = at;
    let dry_run = req.dry_run();
    let retry = match &change {
        Change::Patch(..) => true,
        Change::Put(obj) => meta_str(obj, "resourceVersion").is_none_or(str::is_empty),
    };
    let mut attempt = 0;
    loop {
        attempt += 1;
        let prepared = {
            let mut store = shared.store();
            if !dry_run && !admission::configured(&store) {
                return match &change {
                    Change::Put(obj) => respond(
                        store
                            .update(def, namespace, name, obj.clone(), part)
                            .map(|obj| (200, obj)),
                    ),
                    Change::Patch(kind, body) => respond(
                        store
                            .patch(def, namespace, name, *kind, body, part)
                            .map(|(obj, created)| (if created { 201 } else { 200 }, obj)),
                    ),
                };
            }
            match &change {
                Change::Put(obj) => store
                    .prepare_update(def, namespace, name, obj.clone(), part)
                    .map(|(current, next)| PreparedPatch::Update { current, next }),
                Change::Patch(kind, body) => {
                    store.prepare_patch(def, namespace, name, *kind, body, part)
                }
            }
        };
        let (current, next) = match prepared {
            Ok(PreparedPatch::Update { current, next }) => (current, next),
            Ok(PreparedPatch::Create(obj)) => {
                return create(shared, req, def, namespace, obj).await;
            }
            Err(err) => return error_response(&err),
        };
        let mut attrs = Attributes::new(
            Operation::Update,
            def,
            subresource,
            namespace,
            name,
            &req.user,
            dry_run,
        );
        attrs.old_object = Some(current.clone());
        attrs.object = Some(next);
        let mut warnings = match admission::mutate(shared, &mut attrs).await {
            Ok(w) => w,
            Err(err) => return error_response(&err),
        };
        match admission::validate(shared, &attrs).await {
            Ok(w) => warnings.extend(w),
            Err(err) => return error_response(&err),
        }
        let mut next = attrs.object.take().unwrap_or(Value::Null);
        if dry_run {
            let view = shared.store().dry_run_view(def, next);
            return with_warnings(json_response(200, &view), &warnings);
        }
        if let Some(rv) = current.pointer("/metadata/resourceVersion").cloned()
            && let Some(meta) = next.get_mut("metadata").and_then(Value::as_object_mut)
        {
            meta.insert("resourceVersion".into(), rv);
        }
        let stored = shared.store().update(def, namespace, name, next, part);
        match stored {
            Err(err) if retry && is_conflict(&err) && attempt < WRITE_ATTEMPTS => continue,
            other => return with_warnings(respond(other.map(|obj| (200, obj))), &warnings),
        }
    }
}

/// A delete: admitted as a `DELETE` of the stored object, then removed if it is still that
/// object (else admitted again). Without admission configured, the direct path.
async fn delete(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
    name: &str,
) -> Response<Body> {
    let options: Value = if req.body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&req.body) {
            Ok(v) => v,
            Err(e) => {
                return error_response(&ApiError::bad_request(format!(
                    "error decoding DeleteOptions: {e}"
                )));
            }
        }
    };
    let uid = options
        .pointer("/preconditions/uid")
        .and_then(Value::as_str);
    let rv = options
        .pointer("/preconditions/resourceVersion")
        .and_then(Value::as_str);
    let dry_run = req.dry_run()
        || options
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|d| d.iter().any(|v| v == "All"));
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = {
            let mut store = shared.store();
            if !dry_run && !admission::configured(&store) {
                return respond(
                    store
                        .delete(def, namespace, name, uid, rv)
                        .map(|obj| (200, obj)),
                );
            }
            store.prepare_delete(def, namespace, name, uid, rv)
        };
        let current = match current {
            Ok(c) => c,
            Err(err) => return error_response(&err),
        };
        match admit_delete(shared, req, def, namespace, name, &current, dry_run).await {
            Ok(warnings) if dry_run => {
                return with_warnings(json_response(200, &current), &warnings);
            }
            Ok(warnings) => {
                let deleted = shared.store().delete(
                    def,
                    namespace,
                    name,
                    meta_str(&current, "uid"),
                    meta_str(&current, "resourceVersion"),
                );
                match deleted {
                    Err(err) if is_conflict(&err) && attempt < WRITE_ATTEMPTS => continue,
                    other => return with_warnings(respond(other.map(|obj| (200, obj))), &warnings),
                }
            }
            Err(err) => return error_response(&err),
        }
    }
}

/// Admission of the `DELETE` of `current`: the warnings, or the refusal.
async fn admit_delete(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
    name: &str,
    current: &Value,
    dry_run: bool,
) -> Result<Vec<String>, ApiError> {
    let mut attrs = Attributes::new(
        Operation::Delete,
        def,
        None,
        namespace,
        name,
        &req.user,
        dry_run,
    );
    attrs.old_object = Some(current.clone());
    let mut warnings = admission::mutate(shared, &mut attrs).await?;
    warnings.extend(admission::validate(shared, &attrs).await?);
    Ok(warnings)
}

/// `pods/binding`: admitted as the `CREATE` of a `Binding`, then applied.
async fn bind(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
    name: &str,
) -> Response<Body> {
    let binding = match req.json_body() {
        Ok(b) => b,
        Err(err) => return error_response(&err),
    };
    let dry_run = req.dry_run();
    let success = json!({ "kind": "Status", "apiVersion": "v1", "metadata": {},
                          "status": "Success", "code": 201 });
    let configured = admission::configured(&shared.store());
    let (binding, warnings) = if configured || dry_run {
        let mut attrs = Attributes::new(
            Operation::Create,
            def,
            Some("binding"),
            namespace,
            name,
            &req.user,
            dry_run,
        );
        attrs.object = Some(binding);
        let mut warnings = match admission::mutate(shared, &mut attrs).await {
            Ok(w) => w,
            Err(err) => return error_response(&err),
        };
        match admission::validate(shared, &attrs).await {
            Ok(w) => warnings.extend(w),
            Err(err) => return error_response(&err),
        }
        if dry_run {
            return with_warnings(json_response(201, &success), &warnings);
        }
        (attrs.object.take().unwrap_or(Value::Null), warnings)
    } else {
        (binding, Vec::new())
    };
    let bound = shared
        .store()
        .bind(namespace.unwrap_or("default"), name, &binding);
    with_warnings(respond(bound.map(|()| (201, success))), &warnings)
}

/// Where a paged list goes on: after `(ns, name)`, with `returned` objects handed out so far
/// out of `total` (counted once, at the first page), so that each page's `remainingItemCount`
/// is a subtraction, not a count of the rest of the store (which made a whole paged list
/// quadratic: 150,000 pods in 300 pages walked 22 million keys under the store lock). With
/// writes during the list the count is an estimate, as the API documents it.
#[derive(Debug, PartialEq)]
struct ContinueAt {
    ns: String,
    name: String,
    /// (returned so far, total at the first page), absent in a token without them.
    counted: Option<(usize, usize)>,
    /// The resourceVersion of the first page: every page of one list reports it (as the real
    /// API server's snapshot does), so a watch from the list's version replays every change
    /// made while the pages were read (a delete of an object already returned included).
    rv: Option<u64>,
}

fn encode_continue(ns: &str, name: &str, counted: Option<(usize, usize)>, rv: u64) -> String {
    let text = match counted {
        Some((returned, total)) => format!("{rv}|{ns}/{name}/{returned}/{total}"),
        None => format!("{rv}|{ns}/{name}"),
    };
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Option<ContinueAt> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let (rv, text) = match text.split_once('|') {
        Some((rv, rest)) => (Some(rv.parse().ok()?), rest.to_string()),
        None => (None, text),
    };
    let mut parts = text.split('/');
    let ns = parts.next()?.to_string();
    let name = parts.next()?.to_string();
    let counted = match (parts.next(), parts.next(), parts.next()) {
        (None, _, _) => None,
        (Some(r), Some(t), None) => Some((r.parse().ok()?, t.parse().ok()?)),
        _ => return None,
    };
    Some(ContinueAt {
        ns,
        name,
        counted,
        rv,
    })
}

fn list(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
) -> Response<Body> {
    let selectors = match selectors(req) {
        Ok(s) => s,
        Err(err) => return error_response(&err),
    };
    let limit = match req.param("limit").filter(|l| !l.is_empty()) {
        Some(l) => match l.parse::<usize>() {
            Ok(n) => n,
            Err(_) => {
                return error_response(&ApiError::bad_request(format!("invalid limit {l:?}")));
            }
        },
        None => 0,
    };
    let read = match ListRead::of(
        req.param("resourceVersion"),
        req.param("resourceVersionMatch"),
        req.param("continue"),
        limit,
    ) {
        Ok(read) => read,
        Err(err) => return error_response(&err),
    };
    let at = match req.param("continue").filter(|c| !c.is_empty()) {
        Some(token) => match decode_continue(token) {
            Some(at) => Some(at),
            None => {
                return error_response(&ApiError::bad_request(format!(
                    "invalid continue token {token:?}"
                )));
            }
        },
        None => None,
    };
    let (cache_on, held) = {
        let cache = shared.cache();
        (cache.enabled(), cache.held())
    };
    // What answers: the store (etcd, or a cache that has caught up), or the held cache's
    // objects; at which version; paged by the limit or not.
    let store = shared.store();
    let newest = store.resource_version();
    let (snapshot, version, limit) = match (&read, &held) {
        (ListRead::Any, _) if !cache_on => (None, newest, limit),
        (ListRead::Any, Some((rv, objects))) => (Some(objects.clone()), *rv, 0),
        (ListRead::Any, None) => (None, newest, 0),
        (ListRead::NotOlderThan(v), Some((rv, _))) if *v > *rv && cache_on => {
            return error_response(&too_large(*v, *rv));
        }
        (ListRead::NotOlderThan(v), _) if *v > newest => {
            return error_response(&too_large(*v, newest));
        }
        (ListRead::NotOlderThan(_), Some((rv, objects))) if cache_on => {
            (Some(objects.clone()), *rv, limit)
        }
        (ListRead::Exact(v), _) if *v > newest => return error_response(&too_large(*v, newest)),
        (ListRead::Exact(v), _) if *v < newest => {
            return error_response(&ApiError::gone(format!(
                "too old resource version: {v} ({newest})"
            )));
        }
        (ListRead::Continue, Some((rv, objects)))
            if at.as_ref().and_then(|a| a.rv) == Some(*rv) =>
        {
            (Some(objects.clone()), *rv, limit)
        }
        (ListRead::Continue, _) => (
            None,
            at.as_ref().and_then(|a| a.rv).unwrap_or(newest),
            limit,
        ),
        _ => (None, newest, limit),
    };
    let objects: &Objects = match &snapshot {
        Some(held) => held,
        None => store.objects(),
    };
    let after = at.as_ref().map(|a| (a.ns.clone(), a.name.clone()));
    let mut metadata = json!({ "resourceVersion": version.to_string() });
    let (items, more) = list_in(objects, def, namespace, after.as_ref(), limit, &|obj| {
        selectors.matches(obj)
    });
    if more && let Some((ns, name, _)) = items.last() {
        // As the real API server: a count only for unfiltered lists.
        let counted = selectors.is_empty().then(|| {
            // The first page (or a token without counts): count once, from here on.
            let (returned, total) = at
                .as_ref()
                .and_then(|a| a.counted)
                .unwrap_or_else(|| (0, count_in(objects, def, namespace, after.as_ref())));
            (returned + items.len(), total)
        });
        if let Some((returned, total)) = counted {
            metadata["remainingItemCount"] = json!(total.saturating_sub(returned));
        }
        metadata["continue"] = json!(encode_continue(ns, name, counted, version));
    }
    drop(store);
    let objects: Vec<Value> = items.into_iter().map(|(_, _, obj)| obj).collect();
    if table::wants_table(req.accept.as_deref()) {
        let include = IncludeObject::from_query(req.param("includeObject"));
        return json_response(200, &table::table(def, &objects, include, metadata, true));
    }
    json_response(
        200,
        &json!({ "kind": def.list_kind(), "apiVersion": def.api_version(), "metadata": metadata, "items": objects }),
    )
}

async fn delete_collection(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
) -> Result<(u16, Value, Vec<String>), ApiError> {
    let selectors = selectors(req)?;
    let dry_run = req.dry_run();
    let (doomed, configured) = {
        let store = shared.store();
        let (doomed, _) = store.list(def, namespace, None, 0, &|obj| selectors.matches(obj));
        (doomed, admission::configured(&store))
    };
    let mut items = Vec::new();
    let mut warnings = Vec::new();
    for (ns, name, current) in doomed {
        let ns = (!ns.is_empty()).then_some(ns);
        if configured || dry_run {
            warnings.extend(
                admit_delete(shared, req, def, ns.as_deref(), &name, &current, dry_run).await?,
            );
        }
        if dry_run {
            items.push(current);
            continue;
        }
        match shared.store().delete(def, ns.as_deref(), &name, None, None) {
            Ok(deleted) => items.push(deleted),
            // Deleted meanwhile: as upstream, not an error of the collection's delete.
            Err(err) if err.code == 404 => {}
            Err(err) => return Err(err),
        }
    }
    let rv = shared.store().resource_version();
    Ok((
        200,
        json!({ "kind": def.list_kind(), "apiVersion": def.api_version(),
                "metadata": { "resourceVersion": rv.to_string() }, "items": items }),
        warnings,
    ))
}

async fn object(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
    name: &str,
    subresource: Option<&str>,
) -> Response<Body> {
    if !def.stored {
        return error_response(&ApiError::method_not_allowed(&req.method));
    }
    let part = match subresource {
        None => Part::Main,
        Some("status") if def.status => Part::Status,
        Some("binding") if def.binding => {
            return if req.method == Method::POST {
                bind(shared, req, def, namespace, name).await
            } else {
                error_response(&ApiError::method_not_allowed(&req.method))
            };
        }
        Some(_) => return error_response(&ApiError::path_not_found()),
    };
    let at = Addressed {
        def,
        namespace,
        name,
        subresource,
        part,
    };
    match req.method {
        Method::GET => {
            let result = shared.store().get(def, namespace, name);
            match result {
                Ok(obj) if table::wants_table(req.accept.as_deref()) => {
                    let include = IncludeObject::from_query(req.param("includeObject"));
                    let rv = meta_str(&obj, "resourceVersion").unwrap_or("").to_string();
                    json_response(
                        200,
                        &table::table(def, &[obj], include, json!({ "resourceVersion": rv }), true),
                    )
                }
                other => respond(other.map(|obj| (200, obj))),
            }
        }
        Method::PUT => match req.json_body() {
            Ok(obj) => update(shared, req, at, Change::Put(obj)).await,
            Err(err) => error_response(&err),
        },
        Method::PATCH => {
            let content_type = req.content_type.as_deref().unwrap_or("");
            let Some(kind) = PatchKind::from_content_type(content_type) else {
                return error_response(&ApiError::unsupported_media_type(content_type));
            };
            update(shared, req, at, Change::Patch(kind, &req.body)).await
        }
        Method::DELETE if part == Part::Main => delete(shared, req, def, namespace, name).await,
        _ => error_response(&ApiError::method_not_allowed(&req.method)),
    }
}

/// A self review (see `reviews`), answered for the requesting identity.
fn review(shared: &Arc<Shared>, req: &Req, def: &ResourceDef) -> Result<(u16, Value), ApiError> {
    if def.id == "selfsubjectreviews" {
        return Ok(reviews::subject_review(&req.user, &def.api_version()));
    }
    let body = req.json_body()?;
    let store = shared.store();
    match def.id {
        "selfsubjectrulesreviews" => reviews::rules_review(&store, &req.user, body),
        _ => reviews::access_review(&store, &req.user, body),
    }
}

/// One watch event line, `type` before `object` as the API server writes it (Go encodes the
/// fields of its `WatchEvent` in order; a JSON map here would sort `object` first).
fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = format!("{{\"type\":{},\"object\":{object}}}", Value::from(kind));
    line.push('\n');
    Bytes::from(line)
}

/// What a watch forwards, and how.
struct WatchFilter {
    def: &'static ResourceDef,
    namespace: Option<String>,
    selectors: Selectors,
    table: Option<IncludeObject>,
}

impl WatchFilter {
    /// The line for `event`, as this watch sees it (selector moves become ADDED/DELETED).
    fn line(&self, event: &StoredEvent, first: &mut bool) -> Option<Bytes> {
        if event.resource != self.def.id
            || self
                .namespace
                .as_deref()
                .is_some_and(|ns| ns != event.namespace)
        {
            return None;
        }
        let now = self.selectors.matches(&event.object);
        let before = event
            .old
            .as_ref()
            .is_some_and(|old| self.selectors.matches(old));
        let kind = match (event.kind, before, now) {
            (EventType::Modified, true, true) => EventType::Modified,
            (EventType::Modified, false, true) => EventType::Added,
            (EventType::Modified, true, false) => EventType::Deleted,
            (EventType::Modified, false, false) => return None,
            (kind, _, true) => kind,
            (_, _, false) => return None,
        };
        Some(self.render(kind.as_str(), &event.object, first))
    }

    fn render(&self, kind: &str, object: &Value, first: &mut bool) -> Bytes {
        match self.table {
            Some(include) => {
                let rv = meta_str(object, "resourceVersion")
                    .unwrap_or("")
                    .to_string();
                let t = table::table(
                    self.def,
                    std::slice::from_ref(object),
                    include,
                    json!({ "resourceVersion": rv }),
                    *first,
                );
                *first = false;
                event_line(kind, &t)
            }
            None => event_line(kind, object),
        }
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut metadata = json!({ "resourceVersion": rv.to_string() });
        if initial_end {
            metadata["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
        }
        event_line(
            "BOOKMARK",
            &json!({ "kind": self.def.kind, "apiVersion": self.def.api_version(), "metadata": metadata }),
        )
    }
}

type Chunk = Result<Frame<Bytes>, std::io::Error>;

fn watch(
    shared: &Arc<Shared>,
    req: &Req,
    def: &'static ResourceDef,
    namespace: Option<&str>,
    selectors: Selectors,
) -> Response<Body> {
    let filter = WatchFilter {
        def,
        namespace: namespace.map(str::to_string),
        selectors,
        table: table::wants_table(req.accept.as_deref())
            .then(|| IncludeObject::from_query(req.param("includeObject"))),
    };
    let requested = req.param("resourceVersion").unwrap_or("");
    let requested_rv = match requested {
        "" | "0" => None,
        rv => match rv.parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return error_response(&ApiError::bad_request(format!(
                    "invalid resourceVersion {rv:?}"
                )));
            }
        },
    };
    let send_initial = req.flag("sendInitialEvents");
    let bookmarks = req.flag("allowWatchBookmarks");
    let timeout = req
        .param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map(Duration::from_secs);

    // A held watch cache starts a watch from its objects and holds back later events.
    let (held, held_rx) = {
        let cache = shared.cache();
        (cache.held(), cache.subscribe())
    };
    // Snapshot and subscribe under one lock, so no event falls in between.
    let (initial, live, start_rv, gone) = {
        let store = shared.store();
        let live = store.subscribe();
        let rv = store.resource_version();
        match (requested_rv, send_initial) {
            (Some(from), false) => match store.events_since(from) {
                Some(events) => (Initial::Events(events), live, rv, false),
                None => (Initial::Events(Vec::new()), live, rv, true),
            },
            _ => {
                // Held: the cache's objects, then the changes since, held back in the run.
                let (objects, catch_up, rv) = match &held {
                    Some((held_rv, objects)) => (
                        &**objects,
                        store.events_since(*held_rv).unwrap_or_default(),
                        *held_rv,
                    ),
                    None => (store.objects(), Vec::new(), rv),
                };
                let objects = list_in(objects, def, namespace, None, 0, &|obj| {
                    filter.selectors.matches(obj)
                })
                .0
                .into_iter()
                .map(|(_, _, obj)| obj)
                .collect();
                (Initial::Objects(objects, catch_up), live, rv, false)
            }
        }
    };
    let (watch_id, cut, cut_now) = shared.open_watch(&req.path_and_query);
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    let shared = shared.clone();
    let requested = requested.to_string();
    tokio::spawn(async move {
        run_watch(WatchRun {
            filter,
            initial,
            live,
            start_rv,
            gone,
            requested,
            send_initial,
            bookmarks,
            timeout,
            cut,
            cut_now,
            tx,
            held: held_rx,
            shutdown: shared.shutdown.clone(),
        })
        .await;
        shared.close_watch(watch_id);
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed();
    let mut response = Response::new(body);
    response.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

enum Initial {
    Events(Vec<Arc<StoredEvent>>),
    /// The objects at the start, and the changes made since (a held cache's start is older
    /// than the store's).
    Objects(Vec<Value>, Vec<Arc<StoredEvent>>),
}

struct WatchRun {
    filter: WatchFilter,
    initial: Initial,
    live: broadcast::Receiver<Arc<StoredEvent>>,
    start_rv: u64,
    gone: bool,
    requested: String,
    send_initial: bool,
    bookmarks: bool,
    timeout: Option<Duration>,
    cut: tokio::sync::oneshot::Receiver<()>,
    cut_now: bool,
    tx: mpsc::Sender<Chunk>,
    /// The version the watch cache is held at, if it is: no later event goes out until then.
    held: tokio::sync::watch::Receiver<Option<u64>>,
    shutdown: tokio::sync::watch::Receiver<bool>,
}

/// Waits until the watch cache serves event `rv` (it is not held below it); false when the
/// server stops meanwhile.
async fn served(
    held: &mut tokio::sync::watch::Receiver<Option<u64>>,
    rv: u64,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        r = held.wait_for(|h| h.is_none_or(|at| rv <= at)) => r.is_ok(),
        _ = stopped(shutdown) => false,
    }
}

fn abort() -> Chunk {
    Err(std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "watch cut",
    ))
}

async fn run_watch(mut run: WatchRun) {
    let tx = run.tx.clone();
    let send = |bytes: Bytes| {
        let tx = tx.clone();
        async move { tx.send(Ok(Frame::data(bytes))).await.is_ok() }
    };
    if run.gone {
        let status = ApiError::gone(format!(
            "too old resource version: {} ({})",
            run.requested, run.start_rv
        ))
        .to_status();
        let _ = send(event_line("ERROR", &status)).await;
        return;
    }
    let mut first = true;
    let mut seen_rv = run.start_rv;
    match std::mem::replace(&mut run.initial, Initial::Events(Vec::new())) {
        Initial::Events(events) => {
            for event in events {
                if !served(&mut run.held, event.rv, &mut run.shutdown).await {
                    return;
                }
                if let Some(line) = run.filter.line(&event, &mut first)
                    && !send(line).await
                {
                    return;
                }
            }
        }
        Initial::Objects(objects, catch_up) => {
            for object in objects {
                if !send(run.filter.render("ADDED", &object, &mut first)).await {
                    return;
                }
            }
            if run.send_initial && !send(run.filter.bookmark(run.start_rv, true)).await {
                return;
            }
            for event in catch_up {
                if !served(&mut run.held, event.rv, &mut run.shutdown).await {
                    return;
                }
                seen_rv = seen_rv.max(event.rv);
                if let Some(line) = run.filter.line(&event, &mut first)
                    && !send(line).await
                {
                    return;
                }
            }
        }
    }
    if run.cut_now {
        let _ = tx.send(abort()).await;
        return;
    }
    let deadline = run.timeout.map(|t| tokio::time::Instant::now() + t);
    let mut ticker = tokio::time::interval(BOOKMARK_INTERVAL);
    ticker.tick().await;
    loop {
        tokio::select! {
            biased;
            _ = &mut run.cut => {
                let _ = tx.send(abort()).await;
                return;
            }
            _ = stopped(&mut run.shutdown) => return,
            _ = tx.closed() => return,
            _ = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => return,
            _ = ticker.tick(), if run.bookmarks => {
                if !send(run.filter.bookmark(seen_rv, false)).await {
                    return;
                }
            }
            event = run.live.recv() => match event {
                Ok(event) => {
                    if event.rv <= seen_rv {
                        continue;
                    }
                    if !served(&mut run.held, event.rv, &mut run.shutdown).await {
                        return;
                    }
                    seen_rv = event.rv;
                    if let Some(line) = run.filter.line(&event, &mut first)
                        && !send(line).await
                    {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = tx.send(abort()).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continue_tokens_round_trip() {
        let at = |counted| ContinueAt {
            ns: "ns".into(),
            name: "pod-1".into(),
            counted,
            rv: Some(7),
        };
        let token = encode_continue("ns", "pod-1", None, 7);
        assert_eq!(decode_continue(&token), Some(at(None)));
        let token = encode_continue("ns", "pod-1", Some((500, 150_000)), 7);
        assert_eq!(decode_continue(&token), Some(at(Some((500, 150_000)))));
        assert_eq!(decode_continue("zz"), None);
        assert_eq!(decode_continue("abc"), None);
        let four_parts = encode_continue("ns", "pod-1", None, 7) + "2f78";
        assert_eq!(
            decode_continue(&four_parts),
            None,
            "ns/pod-1/x: a count without a total"
        );
    }

    #[test]
    fn queries_decode() {
        let q = parse_query("labelSelector=app%3Dx%2Ctier+in+%28a%29&watch=1&flag&bad=%zz%4");
        assert_eq!(q[0], ("labelSelector".into(), "app=x,tier in (a)".into()));
        assert_eq!(q[1], ("watch".into(), "1".into()));
        assert_eq!(q[2], ("flag".into(), String::new()));
        assert_eq!(q[3], ("bad".into(), "%zz%4".into()));
    }

    #[test]
    fn resource_paths() {
        assert!(matches!(
            resource_target("", "v1", &["namespaces", "ns", "pods", "p", "binding"]),
            Some(Target::Object { subresource: Some(ref s), .. }) if s == "binding"
        ));
        assert!(matches!(
            resource_target("", "v1", &["namespaces", "ns"]),
            Some(Target::Object { def, .. }) if def.id == "namespaces"
        ));
        assert!(matches!(
            resource_target("", "v1", &["pods"]),
            Some(Target::Collection {
                namespace: None,
                ..
            })
        ));
        assert!(resource_target("", "v1", &["pods", "p"]).is_none());
        assert!(resource_target("", "v1", &["widgets"]).is_none());
        assert!(
            resource_target("", "v1", &["namespaces", "ns", "pods", "p", "status", "x"]).is_none()
        );
    }
}
