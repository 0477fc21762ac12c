//! AdmissionReview `admission.k8s.io/v1` in and out, and the two decisions of the webhook:
//! [`mutate`] (send gpu-mem pods to our scheduler, as a JSONPatch) and [`validate`] (refuse
//! malformed gpu-mem requests, naming the container and what to write instead).
//!
//! Pure: no I/O. Quantities are read by gpushare-core's request code (through
//! `crate::k8s::pod_gpu_request` and `parse_quantity`), the same code the extender and the
//! device plugin use, so the webhook refuses exactly what they could not serve. It does not
//! judge anything but `aliyun.com/gpu-mem`: every other field is the API server's business.

use std::collections::BTreeMap;

use base64::Engine as _;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

use super::limiter_guard::LimiterGuard;
use crate::core::request::{QuantityError, parse_quantity};
use crate::core::wire::{
    ENV_CGPU_DISABLE, ENV_MPS_ACTIVE_THREAD_PERCENTAGE, ENV_MPS_PINNED_MEM_LIMIT,
    ENV_MPS_PIPE_DIRECTORY, ENV_VISIBLE_DEVICES, POD_ANN_DRA_GPU_MEM, RESOURCE_GPU_MEM,
};

/// The `apiVersion` of every review we accept and answer.
pub(crate) const ADMISSION_API_VERSION: &str = "admission.k8s.io/v1";

/// The scheduler name Kubernetes fills in when a pod names none.
pub(crate) const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// Why a request body is not a usable AdmissionReview (answered with HTTP 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReviewError {
    /// Not JSON at all.
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an `admission.k8s.io/v1` AdmissionReview with a request.
    #[error("not an admission.k8s.io/v1 AdmissionReview: {0}")]
    NotAReview(String),
    /// A Pod review whose object does not decode as a Pod.
    #[error("request.object is not a Pod: {0}")]
    BadPod(String),
}

/// The parts of an AdmissionReview request the webhook reads.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ReviewRequest {
    /// Echoed in the response.
    pub uid: String,
    /// `request.kind.kind` (`Pod`, ...).
    pub kind: String,
    /// `CREATE`, `UPDATE`, ...
    pub operation: String,
    /// `request.namespace`, may be empty.
    pub namespace: String,
    /// `request.object`, may be null (DELETE).
    pub object: Value,
    /// `request.dryRun` (absent: false): nothing may be created for it.
    pub dry_run: bool,
}

/// Parses an AdmissionReview body.
pub(crate) fn parse_review(body: &[u8]) -> Result<ReviewRequest, ReviewError> {
    let review: Value =
        serde_json::from_slice(body).map_err(|e| ReviewError::NotJson(e.to_string()))?;
    let not = |why: &str| ReviewError::NotAReview(why.to_string());
    if review.get("kind").and_then(Value::as_str) != Some("AdmissionReview") {
        return Err(not("kind must be AdmissionReview"));
    }
    let version = review.get("apiVersion").and_then(Value::as_str);
    if version != Some(ADMISSION_API_VERSION) {
        return Err(ReviewError::NotAReview(format!(
            "apiVersion {version:?}; only {ADMISSION_API_VERSION} is served \
             (admissionReviewVersions: [v1])"
        )));
    }
    let request = review
        .get("request")
        .filter(|r| r.is_object())
        .ok_or_else(|| not("no request object"))?;
    let text = |field: &str| {
        request
            .get(field)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let uid = text("uid");
    if uid.is_empty() {
        return Err(not("request.uid is missing"));
    }
    let kind = request
        .pointer("/kind/kind")
        .and_then(Value::as_str)
        .ok_or_else(|| not("request.kind.kind is missing"))?
        .to_string();
    Ok(ReviewRequest {
        uid,
        kind,
        operation: text("operation"),
        namespace: text("namespace"),
        object: request.get("object").cloned().unwrap_or(Value::Null),
        dry_run: request
            .get("dryRun")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    })
}

/// The answer to one review.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Verdict {
    /// Admit the object.
    pub allowed: bool,
    /// Why not (shown to the user by kubectl).
    pub message: Option<String>,
    /// JSONPatch operations, when the object changes.
    pub patch: Vec<Value>,
    /// Warnings shown to the client.
    pub warnings: Vec<String>,
}

impl Verdict {
    pub(crate) fn allow() -> Verdict {
        Verdict {
            allowed: true,
            ..Verdict::default()
        }
    }

    fn warn(message: String) -> Verdict {
        Verdict {
            allowed: true,
            warnings: vec![message],
            ..Verdict::default()
        }
    }

    /// The AdmissionReview response body for request `uid`.
    pub(crate) fn to_review(&self, uid: &str) -> Value {
        let mut response = json!({ "uid": uid, "allowed": self.allowed });
        if let Some(message) = &self.message {
            response["status"] = json!({
                "code": 422, "reason": "Invalid", "message": message,
                "metadata": {}, "status": "Failure",
            });
        }
        if !self.patch.is_empty() {
            let patch = Value::Array(self.patch.clone()).to_string();
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
            response["patchType"] = json!("JSONPatch");
        }
        if !self.warnings.is_empty() {
            response["warnings"] = json!(self.warnings);
        }
        json!({ "apiVersion": ADMISSION_API_VERSION, "kind": "AdmissionReview", "response": response })
    }
}

/// The pod a review asks us to judge: `Ok(None)` when there is nothing to judge (not a
/// CREATE), `Err` for a verdict given at once (not a Pod: allowed, with a warning).
pub(crate) fn pod_of(review: &ReviewRequest) -> Result<Result<Option<Pod>, Verdict>, ReviewError> {
    if review.kind != "Pod" {
        return Ok(Err(Verdict::warn(format!(
            "gpushare webhook reviews Pods only, not {}: the rules of its webhook \
             configuration should name pods alone",
            review.kind
        ))));
    }
    if review.operation != "CREATE" || review.object.is_null() {
        return Ok(Ok(None));
    }
    crate::k8s::decode::from_value(&review.object)
        .map(|pod| Ok(Some(pod)))
        .map_err(|e| ReviewError::BadPod(e.to_string()))
}

/// The `aliyun.com/gpu-mem` entries of one container: (requests, limits).
fn gpu_mem_of(c: &Container) -> (Option<&str>, Option<&str>) {
    fn get(m: Option<&BTreeMap<String, Quantity>>) -> Option<&str> {
        m.and_then(|m| m.get(RESOURCE_GPU_MEM))
            .map(|q| q.0.as_str())
    }
    let r = c.resources.as_ref();
    (
        get(r.and_then(|r| r.requests.as_ref())),
        get(r.and_then(|r| r.limits.as_ref())),
    )
}

/// Every container of the pod, init containers first, with its kind for messages.
fn containers(pod: &Pod) -> Vec<(&'static str, &Container)> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    spec.init_containers
        .iter()
        .flatten()
        .map(|c| ("init container", c))
        .chain(spec.containers.iter().map(|c| ("container", c)))
        .collect()
}

/// Whether any container or init container asks for gpu-mem (in limits or requests, with a
/// value that is not zero; a malformed value asks too, validation refuses it).
pub(crate) fn asks_for_gpu_mem(pod: &Pod) -> bool {
    containers(pod).iter().any(|(_, c)| {
        let (requests, limits) = gpu_mem_of(c);
        [requests, limits]
            .into_iter()
            .flatten()
            .any(|q| parse_quantity(q).map_or(true, |m| !m.is_zero()))
    })
}

/// `POST /mutate` of one request body: [`mutate_review`] of the parsed review, with its uid
/// (the tests' entry; the server parses once in `routes`).
#[cfg(test)]
pub(crate) fn mutate(body: &[u8], scheduler_name: &str) -> Result<(String, Verdict), ReviewError> {
    let review = parse_review(body)?;
    let verdict = mutate_review(&review, scheduler_name)?;
    Ok((review.uid, verdict))
}

/// `POST /mutate`: on Pod CREATE, a gpu-mem pod whose `spec.schedulerName` is empty or
/// `default-scheduler` gets `scheduler_name` ([`mutate_pod`]); everything else is admitted
/// unchanged.
pub(crate) fn mutate_review(
    review: &ReviewRequest,
    scheduler_name: &str,
) -> Result<Verdict, ReviewError> {
    Ok(match pod_of(review)? {
        Err(verdict) => verdict,
        Ok(None) => Verdict::allow(),
        Ok(Some(pod)) => mutate_pod(&pod, scheduler_name),
    })
}

/// The extender path's verdict on a pod being created: a gpu-mem pod whose
/// `spec.schedulerName` is empty or `default-scheduler` gets `scheduler_name`; every pod is
/// admitted unchanged when `scheduler_name` is empty (no scheduler to send them to).
pub(crate) fn mutate_pod(pod: &Pod, scheduler_name: &str) -> Verdict {
    if !asks_for_gpu_mem(pod) || scheduler_name.is_empty() {
        return Verdict::allow();
    }
    let current = pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref());
    let op = match current {
        None => "add",
        Some("") | Some(DEFAULT_SCHEDULER) => "replace",
        Some(_) => return Verdict::allow(),
    };
    let mut verdict = Verdict::allow();
    if pod.spec.is_none() {
        verdict
            .patch
            .push(json!({ "op": "add", "path": "/spec", "value": {} }));
    }
    verdict.patch.push(json!({
        "op": op, "path": "/spec/schedulerName", "value": scheduler_name,
    }));
    verdict
}

/// `POST /validate` of one request body with the default limiter directories:
/// [`validate_review`] of the parsed review, with its uid (the tests' entry; the server parses
/// once in `routes`, with the configured directories).
#[cfg(test)]
pub(crate) fn validate(body: &[u8], max_gpu_mem: u64) -> Result<(String, Verdict), ReviewError> {
    let review = parse_review(body)?;
    let verdict = validate_review(&review, max_gpu_mem, &LimiterGuard::default())?;
    Ok((review.uid, verdict))
}

/// `POST /validate`: on Pod CREATE, refuses a malformed gpu-mem request (see [`problems`]),
/// and a gpu-mem pod (or one the DRA rewrite made of it) whose spec would take the CUDA memory
/// limiter's place ([`super::limiter_guard`]) on the node's `guard` directories; everything
/// else is allowed.
pub(crate) fn validate_review(
    review: &ReviewRequest,
    max_gpu_mem: u64,
    guard: &LimiterGuard,
) -> Result<Verdict, ReviewError> {
    let pod = match pod_of(review)? {
        Err(verdict) => return Ok(verdict),
        Ok(None) => return Ok(Verdict::allow()),
        Ok(Some(pod)) => pod,
    };
    let found = problems(&pod, max_gpu_mem);
    let owned = owned_env(&pod);
    let limited = asks_for_gpu_mem(&pod)
        || pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(POD_ANN_DRA_GPU_MEM));
    let escapes = if limited {
        super::limiter_guard::escapes(&pod, guard)
    } else {
        Vec::new()
    };
    if found.is_empty() && owned.is_empty() && escapes.is_empty() {
        return Ok(Verdict::allow());
    }
    let name = pod
        .metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.clone().map(|g| format!("{g}*")))
        .unwrap_or_default();
    let mut parts = Vec::new();
    if !found.is_empty() {
        parts.push(format!(
            "gpushare: pod {name:?} has a malformed {RESOURCE_GPU_MEM} request: {}",
            found.join("; ")
        ));
    }
    if !owned.is_empty() {
        parts.push(format!(
            "gpushare: pod {name:?} sets variables the GPU device plugin owns (they choose the \
             GPU and cap its memory; a pod's own value could widen its GPUs or raise its limit): \
             {}; remove them from env",
            owned.join("; ")
        ));
    }
    if !escapes.is_empty() {
        parts.push(format!(
            "gpushare: pod {name:?} would take the place of the CUDA memory limiter that nodes \
             mount into GPU containers (/etc/ld.so.preload, /usr/local/gpushare) or reach its \
             files on the node: {}; mount elsewhere",
            escapes.join("; ")
        ));
    }
    let message = parts.join("; ");
    Ok(Verdict {
        allowed: false,
        message: Some(message),
        ..Verdict::default()
    })
}

/// The environment variables the device plugin sets for a gpu-mem container: the GPUs it sees,
/// the MPS limits and pipes, the memory envs cGPU reads. A gpu-mem pod may not set them.
fn is_owned_env(name: &str) -> bool {
    [
        ENV_VISIBLE_DEVICES,
        ENV_MPS_PINNED_MEM_LIMIT,
        ENV_MPS_ACTIVE_THREAD_PERCENTAGE,
        ENV_MPS_PIPE_DIRECTORY,
        ENV_CGPU_DISABLE,
    ]
    .contains(&name)
        || name.starts_with("ALIYUN_COM_GPU_MEM_")
}

/// For a pod asking for gpu-mem: each container that sets an owned variable itself, as
/// "container X sets NAME" (every container of the pod: they share the node's runtime).
pub(crate) fn owned_env(pod: &Pod) -> Vec<String> {
    if !asks_for_gpu_mem(pod) {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (what, c) in containers(pod) {
        for e in c.env.iter().flatten().filter(|e| is_owned_env(&e.name)) {
            out.push(format!("{what} {:?} sets {}", c.name, e.name));
        }
    }
    out
}

/// Each thing wrong with the pod's gpu-mem request, as "container X: what; write Y".
pub(crate) fn problems(pod: &Pod, max_gpu_mem: u64) -> Vec<String> {
    let mut out = Vec::new();
    for (what, c) in containers(pod) {
        let name = &c.name;
        let (requests, limits) = gpu_mem_of(c);
        let limit = match limits.map(|l| (l, parse_quantity(l))) {
            None => None,
            Some((text, Ok(mem))) => Some((text, mem)),
            Some((text, Err(e))) => {
                out.push(format!("{what} {name:?}: {}", quantity_fix(text, &e)));
                continue;
            }
        };
        match (requests, limit) {
            (Some(req), None) => {
                let suggestion = match parse_quantity(req) {
                    Ok(m) => format!("\"{}\"", m.units()),
                    Err(_) => "a whole number such as \"1\"".to_string(),
                };
                out.push(format!(
                    "{what} {name:?}: {RESOURCE_GPU_MEM} is in resources.requests but not in \
                     resources.limits; extended resources are asked for in limits: write \
                     limits: {{{RESOURCE_GPU_MEM}: {suggestion}}} (requests may then be left out)"
                ));
                continue;
            }
            (Some(req), Some((text, mem))) => match parse_quantity(req) {
                Ok(r) if r == mem => {}
                Ok(r) => out.push(format!(
                    "{what} {name:?}: {RESOURCE_GPU_MEM} requests ({}) differ from limits ({}); \
                     GPU memory cannot be overcommitted: write the same number in both, or only \
                     limits: {{{RESOURCE_GPU_MEM}: \"{}\"}}",
                    r.units(),
                    mem.units(),
                    mem.units()
                )),
                Err(e) => out.push(format!(
                    "{what} {name:?}: requests: {}; or leave requests out, limits ({text}) is enough",
                    quantity_fix(req, &e)
                )),
            },
            _ => {}
        }
        if let Some((_, mem)) = limit
            && mem.units() > max_gpu_mem
        {
            out.push(format!(
                "{what} {name:?}: {RESOURCE_GPU_MEM} {} is more than any GPU can offer \
                 (at most {max_gpu_mem} units, webhook.max_gpu_mem); ask for at most the \
                 memory of one GPU, counted in the device plugin's --memory-unit (GiB unless \
                 changed)",
                mem.units()
            ));
        }
    }
    // The request code itself (max of init containers, sum of app containers): the pod must
    // fit one GPU as a whole.
    if out.is_empty()
        && let Ok(request) = crate::k8s::pod_gpu_request(pod)
        && request.total().units() > max_gpu_mem
    {
        let names: Vec<&str> = request.containers.iter().map(|c| c.name.as_str()).collect();
        out.push(format!(
            "containers {names:?} together ask for {} units of {RESOURCE_GPU_MEM}, more than \
             any GPU can offer (at most {max_gpu_mem} units, webhook.max_gpu_mem); all GPU \
             containers of a pod share one GPU: lower their limits so that they sum to at most \
             {max_gpu_mem}",
            request.total().units()
        ));
    }
    out
}

/// What is wrong with one quantity and what to write instead.
fn quantity_fix(text: &str, e: &QuantityError) -> String {
    match e {
        QuantityError::Fractional(_) => {
            let whole = text.trim().split('.').next().unwrap_or("1");
            let whole = if whole.is_empty() || whole == "0" {
                "1"
            } else {
                whole
            };
            format!(
                "{RESOURCE_GPU_MEM} {text:?} is not a whole number of units; write a whole \
                 number such as \"{whole}\" (one unit is a GiB unless the device plugin runs \
                 with --memory-unit; use a finer unit for smaller slices)"
            )
        }
        QuantityError::Negative(_) => format!(
            "{RESOURCE_GPU_MEM} {text:?} is negative; write a positive whole number of units \
             such as \"1\""
        ),
        QuantityError::TooLarge(_) | QuantityError::Overflow(_) => format!(
            "{RESOURCE_GPU_MEM} {text:?} is absurdly large; write the number of units as a \
             plain whole number such as \"8\" (suffixes like G or Gi multiply the count, they \
             are not memory sizes)"
        ),
        QuantityError::Malformed(_) => format!(
            "{RESOURCE_GPU_MEM} {text:?} is not a quantity; write a plain whole number of \
             units such as \"4\""
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(kind: &str, op: &str, object: Value) -> Vec<u8> {
        json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": { "uid": "u-1", "kind": { "group": "", "version": "v1", "kind": kind },
                         "operation": op, "namespace": "default", "object": object },
        })
        .to_string()
        .into_bytes()
    }

    fn pod(containers: Value) -> Value {
        json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "p" },
                "spec": { "containers": containers } })
    }

    fn gpu(limits: Value, requests: Value) -> Value {
        json!([{ "name": "main", "image": "x",
                  "resources": { "limits": limits, "requests": requests } }])
    }

    #[test]
    fn dry_run_is_read_with_the_review() {
        let with = |dry: Value| {
            let mut v: Value = serde_json::from_slice(&review("Pod", "CREATE", Value::Null))
                .expect("the review is JSON");
            v["request"]["dryRun"] = dry;
            parse_review(v.to_string().as_bytes()).expect("a review")
        };
        assert!(with(json!(true)).dry_run);
        assert!(!with(json!(false)).dry_run);
        assert!(!with(Value::Null).dry_run);
        let plain = parse_review(&review("Pod", "CREATE", Value::Null)).expect("a review");
        assert!(!plain.dry_run);
    }

    #[test]
    fn mutate_adds_the_scheduler_name_only_for_gpu_pods() {
        let body = review(
            "Pod",
            "CREATE",
            pod(gpu(json!({"aliyun.com/gpu-mem": "2"}), json!({}))),
        );
        let (uid, v) = mutate(&body, "gpushare-scheduler").unwrap();
        assert_eq!(uid, "u-1");
        assert_eq!(
            v.patch,
            [json!({"op": "add", "path": "/spec/schedulerName", "value": "gpushare-scheduler"})]
        );
        let plain = review("Pod", "CREATE", pod(json!([{ "name": "c", "image": "x" }])));
        assert!(mutate(&plain, "s").unwrap().1.patch.is_empty());
        let mut named = pod(gpu(json!({"aliyun.com/gpu-mem": "2"}), json!({})));
        named["spec"]["schedulerName"] = json!("default-scheduler");
        let v = mutate(&review("Pod", "CREATE", named.clone()), "s")
            .unwrap()
            .1;
        assert_eq!(v.patch[0]["op"], "replace");
        named["spec"]["schedulerName"] = json!("volcano");
        assert!(
            mutate(&review("Pod", "CREATE", named), "s")
                .unwrap()
                .1
                .patch
                .is_empty()
        );
    }

    #[test]
    fn a_gpu_pod_mounting_over_the_limiter_is_refused_and_a_plain_pod_is_not() {
        let over = |limits: serde_json::Value, annotations: serde_json::Value| {
            json!({ "metadata": { "name": "p", "annotations": annotations }, "spec": {
                "containers": [{ "name": "main", "image": "x",
                    "resources": { "limits": limits },
                    "env": [{ "name": "CUDA_DISABLE_CONTROL", "value": "true" },
                            { "name": "LD_PRELOAD", "value": "" }],
                    "volumeMounts": [{ "name": "v", "mountPath": "/etc/ld.so.preload", "subPath": "empty" }] }],
                "volumes": [{ "name": "v", "configMap": { "name": "c" } }] } })
        };
        let (_, v) = validate(
            &review(
                "Pod",
                "CREATE",
                over(json!({"aliyun.com/gpu-mem": "2"}), json!({})),
            ),
            100,
        )
        .unwrap();
        assert!(!v.allowed);
        let msg = v.message.unwrap_or_default();
        assert!(msg.contains("CUDA memory limiter"), "{msg}");
        assert!(
            msg.contains("container \"main\" mounts volume \"v\" at /etc/ld.so.preload"),
            "{msg}"
        );
        assert!(
            !msg.contains("CUDA_DISABLE_CONTROL"),
            "variables are not judged: {msg}"
        );
        // The DRA rewrite removed the gpu-mem limits and left its annotation.
        let rewritten = over(json!({}), json!({ "gpushare.io/dra-gpu-mem": "{}" }));
        assert!(
            !validate(&review("Pod", "CREATE", rewritten), 100)
                .unwrap()
                .1
                .allowed
        );
        // Not a GPU pod: not the limiter's business.
        assert!(
            validate(&review("Pod", "CREATE", over(json!({}), json!({}))), 100)
                .unwrap()
                .1
                .allowed
        );
    }

    #[test]
    fn an_init_container_asking_for_gpu_mem_routes_the_pod() {
        let obj = json!({ "metadata": { "name": "p" }, "spec": {
            "initContainers": [{ "name": "warmup", "image": "x",
                                 "resources": { "limits": { "aliyun.com/gpu-mem": "1" } } }],
            "containers": [{ "name": "main", "image": "x" }] } });
        let (_, v) = mutate(&review("Pod", "CREATE", obj), "gpushare-scheduler").unwrap();
        assert_eq!(v.patch.len(), 1);
        let zero = pod(gpu(json!({"aliyun.com/gpu-mem": "0"}), json!({})));
        let (_, v) = mutate(&review("Pod", "CREATE", zero), "s").unwrap();
        assert!(v.patch.is_empty(), "a zero request asks for nothing");
        let bad_init = json!({ "metadata": { "name": "p" }, "spec": {
            "initContainers": [{ "name": "warmup", "image": "x",
                                 "resources": { "limits": { "aliyun.com/gpu-mem": "0.5" } } }],
            "containers": [{ "name": "main", "image": "x" }] } });
        let (_, v) = validate(&review("Pod", "CREATE", bad_init), 100).unwrap();
        assert!(
            v.message
                .unwrap_or_default()
                .contains("init container \"warmup\"")
        );
    }

    #[test]
    fn validate_names_the_container_and_the_fix() {
        let check = |limits: Value, requests: Value, needle: &str| {
            let body = review("Pod", "CREATE", pod(gpu(limits, requests)));
            let (_, v) = validate(&body, 100).unwrap();
            assert!(!v.allowed, "{needle}");
            let m = v.message.unwrap_or_default();
            assert!(m.contains("\"main\"") && m.contains(needle), "{m}");
        };
        check(
            json!({}),
            json!({"aliyun.com/gpu-mem": "2"}),
            "not in resources.limits",
        );
        check(
            json!({"aliyun.com/gpu-mem": "4"}),
            json!({"aliyun.com/gpu-mem": "2"}),
            "differ",
        );
        check(
            json!({"aliyun.com/gpu-mem": "1.5"}),
            json!({}),
            "whole number such as \"1\"",
        );
        check(json!({"aliyun.com/gpu-mem": "-1"}), json!({}), "negative");
        check(
            json!({"aliyun.com/gpu-mem": "101"}),
            json!({}),
            "more than any GPU",
        );
        check(
            json!({"aliyun.com/gpu-mem": "2Ti"}),
            json!({}),
            "absurdly large",
        );
        let ok = review(
            "Pod",
            "CREATE",
            pod(gpu(
                json!({"aliyun.com/gpu-mem": "4"}),
                json!({"aliyun.com/gpu-mem": "4"}),
            )),
        );
        assert!(validate(&ok, 100).unwrap().1.allowed);
    }

    #[test]
    fn a_gpu_mem_pod_that_sets_the_device_plugins_variables_is_refused() {
        for var in [
            "NVIDIA_VISIBLE_DEVICES",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "ALIYUN_COM_GPU_MEM_CONTAINER",
        ] {
            let sidecar = json!({ "metadata": { "name": "p" }, "spec": { "containers": [
                { "name": "main", "image": "x",
                  "resources": { "limits": { "aliyun.com/gpu-mem": "4" } } },
                { "name": "side", "image": "x", "env": [{ "name": var, "value": "all" }] },
            ] } });
            let (_, v) = validate(&review("Pod", "CREATE", sidecar), 100).unwrap();
            assert!(!v.allowed, "{var}");
            let m = v.message.unwrap_or_default();
            assert!(m.contains(&format!("container \"side\" sets {var}")), "{m}");
        }
        // A pod without gpu-mem is none of the webhook's business.
        let other = json!({ "metadata": { "name": "p" }, "spec": { "containers": [
            { "name": "main", "image": "x",
              "env": [{ "name": "NVIDIA_VISIBLE_DEVICES", "value": "all" }] },
        ] } });
        assert!(
            validate(&review("Pod", "CREATE", other), 100)
                .unwrap()
                .1
                .allowed
        );
    }

    #[test]
    fn a_pod_too_big_for_one_gpu_is_refused_as_a_whole() {
        let two = json!([
            { "name": "a", "image": "x", "resources": { "limits": {"aliyun.com/gpu-mem": "60"} } },
            { "name": "b", "image": "x", "resources": { "limits": {"aliyun.com/gpu-mem": "60"} } },
        ]);
        let (_, v) = validate(&review("Pod", "CREATE", pod(two)), 100).unwrap();
        assert!(!v.allowed);
        assert!(v.message.unwrap_or_default().contains("120 units"));
    }

    #[test]
    fn garbage_and_other_kinds() {
        assert!(matches!(mutate(b"{", "s"), Err(ReviewError::NotJson(_))));
        assert!(matches!(
            mutate(b"{\"kind\":\"Pod\"}", "s"),
            Err(ReviewError::NotAReview(_))
        ));
        let old = br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x","kind":{"kind":"Pod"}}}"#;
        assert!(matches!(validate(old, 1), Err(ReviewError::NotAReview(_))));
        let bad_pod = review("Pod", "CREATE", json!({"spec": {"containers": "nope"}}));
        assert!(matches!(validate(&bad_pod, 1), Err(ReviewError::BadPod(_))));
        let (_, v) = validate(&review("ConfigMap", "CREATE", json!({})), 1).unwrap();
        assert!(v.allowed && !v.warnings.is_empty());
        let (_, v) = mutate(&review("Pod", "DELETE", Value::Null), "s").unwrap();
        assert!(v.allowed && v.patch.is_empty());
    }

    #[test]
    fn the_response_carries_a_base64_json_patch() {
        let v = Verdict {
            allowed: true,
            patch: vec![json!({"op": "add", "path": "/a", "value": 1})],
            ..Verdict::default()
        };
        let out = v.to_review("u");
        assert_eq!(out["response"]["patchType"], "JSONPatch");
        let raw = base64::engine::general_purpose::STANDARD
            .decode(out["response"]["patch"].as_str().unwrap_or_default())
            .unwrap();
        let ops: Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(ops[0]["path"], "/a");
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bodies_and_quantities_never_panic(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
            limit in ".{0,12}",
            request in ".{0,12}",
        ) {
            let _ = mutate(&body, "s");
            let _ = validate(&body, 100);
            let obj = pod(gpu(json!({"aliyun.com/gpu-mem": limit}), json!({"aliyun.com/gpu-mem": request})));
            let body = review("Pod", "CREATE", obj);
            let (_, v) = validate(&body, 100).expect("a pod with any strings is a Pod");
            proptest::prop_assert!(v.allowed || v.message.is_some_and(|m| m.contains("\"main\"")));
            proptest::prop_assert!(mutate(&body, "s").is_ok());
        }
    }
}
