//! The bind verb: choose the pod's GPU on the chosen node, reserve it in the ledger, write the
//! annotations, create the Binding, and say so in an Event.
//!
//! Binds to one node are serialised by that node's `bind_lock` (so the per-GPU check is
//! authoritative); binds to different nodes run concurrently; filters never wait for a bind.
//! The reservation is made BEFORE the API calls, so concurrent filters already see the memory
//! as taken. Transient API errors are retried with backoff inside `extender.bind_timeout_ms`;
//! when the bind fails for good the reservation is rolled back. A Binding answered 409 (for
//! instance because an earlier attempt did land but its answer was lost) is checked against
//! the pod: bound to our node means success. Every write is fenced by the bind's [`Ticket`]
//! (admitted under the leadership term before the request body was read; see `leader`).

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, PostParams};
use tokio::time::Instant;

use super::cache::ReserveError;
use super::filter::pod_request;
use super::leader::{Fenced, Ticket};
use super::state::ExtenderState;
use super::wire::BindingArgs;
use crate::core::PodGpuAnnotations;
use crate::core::wire::EXTENDER_COMPONENT;
use crate::k8s::retry::{RetryError, Transient, retry_until};
use crate::k8s::write::{bind_pod, now_ns, patch_pod_annotations};

/// Event reason of a successful bind.
pub const REASON_BOUND: &str = "GpuShareBound";
/// Event reason of a failed bind.
pub const REASON_FAILED: &str = "GpuShareBindFailed";

/// Why an API call of bind gave up.
#[derive(Debug)]
enum CallError {
    /// The API answered with an error (or the connection failed).
    Kube(kube::Error),
    /// A condition that no retry can fix.
    Permanent(String),
    /// The bind's time budget ran out.
    Timeout,
    /// FENCE (issue 18): the leadership term the bind was admitted under forbids writing.
    Fenced(Fenced),
}

impl CallError {
    fn is_not_found(&self) -> bool {
        matches!(self, CallError::Kube(kube::Error::Api(s)) if s.code == 404)
    }
    fn describe(&self, what: &str) -> String {
        match self {
            CallError::Kube(e) => format!("{what}: {e}"),
            CallError::Permanent(m) => format!("{what}: {m}"),
            CallError::Timeout => format!("{what}: timed out (extender.bind_timeout_ms)"),
            CallError::Fenced(f) => format!("{what}: not written: {f}"),
        }
    }
}

impl Transient for CallError {
    fn is_transient(&self) -> bool {
        matches!(self, CallError::Kube(k) if k.is_transient())
    }
}

/// Runs `op` until it succeeds, fails for good, or the deadline passes (the one retry loop,
/// counting each retry).
async fn with_retry<T, F, Fut>(
    state: &ExtenderState,
    deadline: Instant,
    op: F,
) -> Result<T, CallError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, CallError>>,
{
    retry_until(
        deadline,
        |_| {
            state.metrics().bind_retries.inc();
        },
        op,
    )
    .await
    .map_err(|e| match e {
        RetryError::Failed(e) => e,
        RetryError::DeadlineExceeded => CallError::Timeout,
    })
}

/// Binds the pod; `Err` carries the message for `{"Error": ...}` (HTTP 500). `ticket` is the
/// bind's admission under the leadership term: its deadline, and the check before each write.
pub async fn bind(
    state: &ExtenderState,
    args: &BindingArgs,
    ticket: &Ticket,
) -> Result<String, String> {
    // FENCE (issue 18): the deadline counts from admission, before the body was read.
    let deadline = ticket.deadline();
    let (ns, name, node) = (&args.pod_namespace, &args.pod_name, &args.node);
    let pods: Api<Pod> = Api::namespaced(state.client().clone(), ns);

    let pod = with_retry(state, deadline, || async {
        pods.get_opt(name).await.map_err(CallError::Kube)
    })
    .await
    .map_err(|e| e.describe(&format!("getting pod {ns}/{name}")))?
    .ok_or_else(|| format!("pod {ns}/{name} not found"))?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if !args.pod_uid.is_empty() && uid != args.pod_uid {
        return Err(format!(
            "The pod {name} in ns {ns}'s uid is {uid}, and it's not equal with expected {}",
            args.pod_uid
        ));
    }
    if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
        && !bound.is_empty()
    {
        return Err(format!("pod {ns}/{name} is already bound to node {bound}"));
    }
    let request = pod_request(&pod).map_err(|e| format!("pod {ns}/{name}: {e}"))?;
    if request.is_zero() {
        return Err(format!(
            "pod {ns}/{name} requests no {}",
            crate::core::wire::RESOURCE_GPU_MEM
        ));
    }
    let slot = state
        .cache()
        .slot(node)
        .ok_or_else(|| format!("the node {node} is not for GPU share"))?;
    let _node_guard = tokio::time::timeout_at(deadline, slot.bind_lock.lock())
        .await
        .map_err(|_| format!("timed out waiting for other binds to node {node}"))?;

    let reservation = state
        .cache()
        .reserve(&uid, ns, name, node, request, state.config().gpu_policy)
        .map_err(|e| match e {
            ReserveError::NoFit(reason) => {
                format!("The node {node} can't place the pod {name} in ns {ns}: {reason}")
            }
            other => other.to_string(),
        })?;
    let gpu = reservation.gpu;
    let result = write_and_bind(
        state,
        &pods,
        args,
        &uid,
        gpu,
        request,
        reservation.device_total,
        deadline,
        ticket,
    )
    .await;
    match result {
        Ok(()) => {
            state.cache().confirm(&uid);
            let msg = format!(
                "assigned GPU {gpu} ({request} {} of {})",
                unit_name(state, node),
                reservation.device_total
            );
            emit_event(state, &pod, REASON_BOUND, &msg, "Normal");
            Ok(msg)
        }
        Err(why) => {
            state.cache().rollback(&uid, node, gpu);
            emit_event(state, &pod, REASON_FAILED, &why, "Warning");
            Err(why)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn write_and_bind(
    state: &ExtenderState,
    pods: &Api<Pod>,
    args: &BindingArgs,
    uid: &str,
    gpu: u32,
    request: crate::core::GpuMem,
    device_total: crate::core::GpuMem,
    deadline: Instant,
    ticket: &Ticket,
) -> Result<(), String> {
    let (ns, name, node) = (&args.pod_namespace, &args.pod_name, &args.node);
    let client = state.client();
    let patch = PodGpuAnnotations::bind_patch(gpu, request, device_total, now_ns());
    with_retry(state, deadline, || async {
        // FENCE (issue 18): still this term, inside the write window, before the deadline.
        ticket.check().map_err(CallError::Fenced)?;
        patch_pod_annotations(client, ns, name, &patch)
            .await
            .map(|_| ())
            .map_err(CallError::Kube)
    })
    .await
    .map_err(|e| {
        if e.is_not_found() {
            format!("pod {ns}/{name} was deleted during bind")
        } else {
            e.describe(&format!("annotating pod {ns}/{name}"))
        }
    })?;
    with_retry(state, deadline, || async {
        // FENCE (issue 18): checked again right before the Binding.
        ticket.check().map_err(CallError::Fenced)?;
        match bind_pod(client, ns, name, uid, node).await {
            Ok(()) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Maybe an earlier attempt landed: look at the pod.
                let pod = pods.get_opt(name).await.map_err(CallError::Kube)?;
                let Some(pod) = pod else {
                    return Err(CallError::Permanent("the pod was deleted".to_string()));
                };
                if pod.metadata.uid.as_deref() != Some(uid) {
                    return Err(CallError::Permanent("the pod was replaced".to_string()));
                }
                match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                    Some(n) if n == node.as_str() => Ok(()),
                    Some(n) if !n.is_empty() => Err(CallError::Permanent(format!(
                        "the pod is already bound to node {n}"
                    ))),
                    _ => Err(CallError::Kube(kube::Error::Api(s))),
                }
            }
            Err(e) => Err(CallError::Kube(e)),
        }
    })
    .await
    .map_err(|e| {
        if e.is_not_found() {
            format!("pod {ns}/{name} was deleted during bind")
        } else {
            e.describe(&format!("binding pod {ns}/{name} to node {node}"))
        }
    })
}

fn unit_name(state: &ExtenderState, node: &str) -> String {
    state
        .cache()
        .node_view(node)
        .and_then(|v| v.unit)
        .map(|u| u.to_string())
        .unwrap_or_else(|| "units".to_string())
}

/// Creates a core/v1 Event on the pod in the background; failures are only logged.
fn emit_event(
    state: &ExtenderState,
    pod: &Pod,
    reason: &'static str,
    message: &str,
    kind: &'static str,
) {
    let ns = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_string());
    let name = pod.metadata.name.clone().unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{name}.{:x}", now_ns())),
            namespace: Some(ns.clone()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Pod".to_string()),
            name: Some(name),
            namespace: Some(ns.clone()),
            uid: pod.metadata.uid.clone(),
            resource_version: pod.metadata.resource_version.clone(),
            ..ObjectReference::default()
        },
        reason: Some(reason.to_string()),
        message: Some(message.to_string()),
        type_: Some(kind.to_string()),
        source: Some(EventSource {
            component: Some(EXTENDER_COMPONENT.to_string()),
            host: None,
        }),
        reporting_component: Some(EXTENDER_COMPONENT.to_string()),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Event::default()
    };
    let events: Api<Event> = Api::namespaced(state.client().clone(), &ns);
    tokio::spawn(async move {
        if let Err(e) = events.create(&PostParams::default(), &event).await {
            tracing::debug!(error = %e, reason, "could not create the pod event");
        }
    });
}
