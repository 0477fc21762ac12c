//! The bind verb: choose the pod's GPU on the chosen node, reserve it in the ledger, write the
//! annotations, create the Binding, and say so in an Event.
//!
//! Every reservation has ONE owner: a task spawned for it ([`BindOwners`] lists the live
//! ones), not the HTTP request, so a kube-scheduler that hangs up mid-bind cancels nothing.
//! The request waits for the owner's first outcome within `extender.bind_timeout_ms`. The
//! owner settles the reservation by what the API answers and shows, never by a timeout:
//! - the Binding landed (or a 409 shows the pod bound to our node): confirmed; the ledger
//!   keeps it until the watch shows the pod bound;
//! - the API refused every try for certain (answered errors only, nothing in flight), or shows
//!   the pod deleted, replaced or bound elsewhere: released;
//! - otherwise (a try of the annotation patch or of the Binding timed out, a connection
//!   dropped, an answer was lost) the outcome is UNKNOWN — a patch that may still land carries
//!   the durable reservation, so it is in doubt like a Binding: the reservation stays, and
//!   the owner reads the pod until the API settles it — bound here (confirmed), gone or bound elsewhere (released), still unbound: it finishes
//!   the bind itself (same GPU, same annotations; a 409 is checked against the pod), and
//!   releases only once the pod has stayed unbound for `extender.bind_settle_ms` after the
//!   last unknown try (past which the API server has given up on it too). Only a serving
//!   replica writes; one that stopped leading only reads.
//!
//! A retried bind of a pod whose owner is still at work attaches to that owner's outcome
//! instead of answering "already holds GPU"; a retried bind of a pod already bound to the
//! same node answers success. A bind of a pod whose own reservation an earlier bind left
//! (found on the pod: another process's, or this one's before a restart) to the reserved
//! node takes it over: the same GPU, this bind its owner, an earlier Binding that lands
//! first answered 409 and settled by reading the pod. Reservations are atomic in the ledger, so binds to one node
//! run concurrently without over-committing; filters never wait for a bind. The annotation
//! patch writes a clean slate: our annotations that the bind does not set (left by another
//! pod this one was copied from) are removed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tokio::sync::watch;
use tokio::time::Instant;

pub use super::bind_error::{BindError, CallError};
pub use super::bind_owners::BindOwners;
use super::bind_owners::{Outcome, Ticket};
use super::cache::{Reservation, ReserveError};
use super::filter::pod_request;
use super::leader::{Fenced, Ticket as Admission};
use super::state::ExtenderState;
use super::wire::BindingArgs;
use crate::core::wire::POD_ANN_RESERVATION;
use crate::core::{BindReservation, GpuMem, PodGpuAnnotations};
use crate::k8s::events::{Severity, pod_reference};
use crate::k8s::retry::{RetryError, Transient, retry_until};
use crate::k8s::write::{bind_pod, now_ns, patch_pod_annotation_changes, refused_for_certain};

/// Event reason of a successful bind.
pub(crate) const REASON_BOUND: &str = "GpuShareBound";
/// Event reason of a failed bind.
pub(crate) const REASON_FAILED: &str = "GpuShareBindFailed";

/// Whether a failed call may nevertheless have reached the API server and been applied:
/// everything but an answer that refuses it (a 500 may still be committed).
fn may_have_landed(e: &kube::Error) -> bool {
    !refused_for_certain(e)
}

/// Whether a write retried by [`with_retry`] may have landed: a try whose answer was lost
/// (any error but a refusal for certain), or one that the deadline cut off in flight.
#[derive(Default)]
struct InDoubt {
    lost: AtomicBool,
    in_flight: AtomicBool,
}

impl InDoubt {
    /// Runs one try of the write, noting whether it may have landed.
    async fn track<T>(
        &self,
        write: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, kube::Error> {
        self.in_flight.store(true, Ordering::Relaxed);
        let r = write.await;
        self.in_flight.store(false, Ordering::Relaxed);
        if matches!(&r, Err(e) if may_have_landed(e)) {
            self.lost.store(true, Ordering::Relaxed);
        }
        r
    }

    fn is_set(&self) -> bool {
        self.lost.load(Ordering::Relaxed) || self.in_flight.load(Ordering::Relaxed)
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

/// What one round of writes achieved.
#[derive(Debug)]
enum Attempt {
    /// The Binding landed (or the pod is bound to our node).
    Bound,
    /// Nothing of this round can land. `definitive`: the pod's state rules out any earlier
    /// round landing too (deleted, replaced, bound elsewhere).
    Refused { why: String, definitive: bool },
    /// A write of this round (the Binding, or the patch carrying the reservation) may or may
    /// not have landed.
    Unknown(String),
}

/// Everything the owner needs.
struct Job {
    state: Arc<ExtenderState>,
    /// The leadership term the bind was admitted under: no write outside it.
    admission: Admission,
    pods: Api<Pod>,
    pod: Pod,
    namespace: String,
    name: String,
    uid: String,
    node: String,
    request: GpuMem,
    reservation: Reservation,
    /// The `gpushare.io/reservation` value every round writes (one per reservation).
    reserved: String,
}

impl Job {
    fn bound_message(&self) -> String {
        format!(
            "assigned GPU {} ({} {} of {})",
            self.reservation.gpu,
            self.request,
            unit_name(&self.state, &self.node),
            self.reservation.device_total
        )
    }
}

/// Binds the pod; `Err` carries the message for `{"Error": ...}` (HTTP 500). `admission` is
/// the bind's admission under the leadership term (issue 18): its deadline counts from then,
/// and every write of this bind and of its owner is checked against it first.
pub async fn bind(
    state: &Arc<ExtenderState>,
    args: &BindingArgs,
    admission: &Admission,
) -> Result<String, BindError> {
    let deadline = admission.deadline();
    let (ns, name, node) = (&args.pod_namespace, &args.pod_name, &args.node);
    let pods: Api<Pod> = Api::namespaced(state.client().clone(), ns);
    let (pod, uid) = read_pod(state, &pods, args, deadline).await?;
    if let Some(ticket) = state.binds().get(&uid) {
        return attach(ticket, ns, name, node, deadline).await;
    }
    if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
        && !bound.is_empty()
    {
        // A retry of a bind that did land: the same answer again.
        if bound == node.as_str()
            && let Some(p) = state.cache().pod_placement(&uid)
            && p.node == *node
        {
            return Ok(format!(
                "pod {ns}/{name} is bound to node {node} on GPU {}",
                p.gpu
            ));
        }
        return Err(BindError::AlreadyBound {
            namespace: ns.clone(),
            name: name.clone(),
            node: bound.to_string(),
        });
    }
    let request = pod_request(&pod).map_err(|source| BindError::PodRequest {
        namespace: ns.clone(),
        name: name.clone(),
        source,
    })?;
    if request.is_zero() {
        return Err(BindError::NoRequest {
            namespace: ns.clone(),
            name: name.clone(),
        });
    }
    if state.cache().slot(node).is_none() {
        return Err(BindError::NotForGpuShare(node.clone()));
    }
    drop_unbacked_found(state, &uid, ns, name, node);
    let reservation =
        match state
            .cache()
            .reserve(&uid, ns, name, node, request, state.config().gpu_policy)
        {
            Ok(r) => r,
            Err(e @ ReserveError::AlreadyPlaced { .. }) => {
                // Another bind of the same pod won the race to reserve: attach to it.
                return match state.binds().get(&uid) {
                    Some(ticket) => attach(ticket, ns, name, node, deadline).await,
                    None => Err(BindError::Reserve(e)),
                };
            }
            Err(ReserveError::NoFit(reason)) => {
                return Err(BindError::NoFit {
                    namespace: ns.clone(),
                    name: name.clone(),
                    node: node.clone(),
                    reason,
                });
            }
            Err(other) => return Err(BindError::Reserve(other)),
        };
    let (tx, rx) = watch::channel(Outcome::Running);
    state.binds().lock().insert(
        uid.clone(),
        Ticket {
            node: node.clone(),
            token: reservation.token,
            outcome: rx.clone(),
        },
    );
    let job = Job {
        admission: admission.clone(),
        state: state.clone(),
        pods,
        pod,
        namespace: ns.clone(),
        name: name.clone(),
        uid,
        node: node.clone(),
        request,
        reservation,
        reserved: BindReservation {
            node: node.clone(),
            gpu: reservation.gpu,
            since: now_ns(),
        }
        .encode(),
    };
    tokio::spawn(own(job, deadline, tx));
    wait_for(rx, deadline, |o| *o != Outcome::Running)
        .await
        .unwrap_or_else(|| {
            Err(BindError::TimedOut {
                namespace: ns.clone(),
                name: name.clone(),
                node: node.clone(),
            })
        })
}

/// Drops the pod's own reservation found on it for `node` when its GPU cannot hold it beside
/// what is counted there: no Binding backs it (its annotation patch landed after its bind gave
/// up; see `reservations`), so this bind reserves afresh instead of taking it over.
fn drop_unbacked_found(state: &ExtenderState, uid: &str, ns: &str, name: &str, node: &str) {
    if state.cache().drop_found_over_capacity(uid, node).is_none() {
        return;
    }
    state.metrics().count_settled("released");
    tracing::info!(
        pod = %format!("{ns}/{name}"), node = %node,
        "the reservation found on the pod does not fit its GPU beside what is counted there \
         (its annotation patch landed after its bind settled it as released: no Binding backs it): \
         reserving afresh"
    );
}

/// The pod `args` names, read from the API (retried until `deadline`), with its uid; refused
/// when the scheduler sent another uid.
async fn read_pod(
    state: &ExtenderState,
    pods: &Api<Pod>,
    args: &BindingArgs,
    deadline: Instant,
) -> Result<(Pod, String), BindError> {
    let (ns, name) = (&args.pod_namespace, &args.pod_name);
    let pod = with_retry(state, deadline, || async {
        pods.get_opt(name).await.map_err(CallError::Kube)
    })
    .await
    .map_err(|source| BindError::GetPod {
        namespace: ns.clone(),
        name: name.clone(),
        source,
    })?
    .ok_or_else(|| BindError::PodNotFound {
        namespace: ns.clone(),
        name: name.clone(),
    })?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if !args.pod_uid.is_empty() && uid != args.pod_uid {
        return Err(BindError::UidMismatch {
            namespace: ns.clone(),
            name: name.clone(),
            uid,
            expected: args.pod_uid.clone(),
        });
    }
    Ok((pod, uid))
}

/// Waits until `done` holds for the owner's outcome, or the deadline; maps it to an answer.
async fn wait_for(
    mut rx: watch::Receiver<Outcome>,
    deadline: Instant,
    done: impl Fn(&Outcome) -> bool,
) -> Option<Result<String, BindError>> {
    let waited = tokio::time::timeout_at(deadline, async {
        rx.wait_for(|o| done(o)).await.map(|o| o.clone()).ok()
    })
    .await;
    let outcome = match waited {
        Ok(Some(o)) => o,
        // The owner is gone: its last word stands.
        Ok(None) => rx.borrow().clone(),
        Err(_) => return None,
    };
    match outcome {
        Outcome::Bound(msg) => Some(Ok(msg)),
        Outcome::Failed(why) => Some(Err(BindError::Refused(why))),
        Outcome::Unknown(why) => Some(Err(BindError::Unknown(why))),
        Outcome::Running => None,
    }
}

/// A retried bind of a pod whose owner still works: the owner's outcome answers it.
async fn attach(
    ticket: Ticket,
    ns: &str,
    name: &str,
    node: &str,
    deadline: Instant,
) -> Result<String, BindError> {
    let answer = wait_for(ticket.outcome, deadline, Outcome::is_final).await;
    match answer {
        Some(Ok(msg)) if ticket.node == node => Ok(msg),
        Some(Ok(_)) => Err(BindError::AlreadyBound {
            namespace: ns.to_string(),
            name: name.to_string(),
            node: ticket.node,
        }),
        Some(Err(why)) => Err(why),
        None => Err(BindError::EarlierUnknown {
            namespace: ns.to_string(),
            name: name.to_string(),
            node: ticket.node,
        }),
    }
}

/// The owner of one reservation: first round within the request's budget, then — if the
/// outcome is unknown — settles it by reading the API (see the module documentation).
async fn own(job: Job, deadline: Instant, tx: watch::Sender<Outcome>) {
    let state = job.state.clone();
    let stop = state.shutdown().clone();
    tokio::select! {
        _ = stop.wait() => {}
        _ = settle(&job, deadline, &tx) => {}
    }
    state.binds().remove(&job.uid, job.reservation.token);
}

async fn settle(job: &Job, deadline: Instant, tx: &watch::Sender<Outcome>) {
    let state = &job.state;
    let cache = state.cache();
    let token = job.reservation.token;
    let first = match attempt(job, deadline).await {
        Attempt::Bound => {
            cache.confirm(&job.uid, token);
            let msg = job.bound_message();
            emit_event(state, &job.pod, REASON_BOUND, &msg, Severity::Normal);
            tx.send_replace(Outcome::Bound(msg));
            None
        }
        Attempt::Refused { why, .. } if job.reservation.taken_over.is_some() => {
            // Our tries were refused, but the earlier bind whose reservation this one took
            // over may still land: unknown, settled by reading the pod as any unknown outcome,
            // its window counted from when this process began counting the reservation.
            state.metrics().bind_unknown.inc();
            tx.send_replace(Outcome::Unknown(why));
            job.reservation.taken_over
        }
        Attempt::Refused { why, .. } => {
            forget_reservation(job);
            cache.release(&job.uid, token);
            emit_event(state, &job.pod, REASON_FAILED, &why, Severity::Warning);
            tx.send_replace(Outcome::Failed(why));
            return;
        }
        Attempt::Unknown(why) => {
            state.metrics().bind_unknown.inc();
            tracing::warn!(
                pod = %format!("{}/{}", job.namespace, job.name), node = %job.node,
                "bind outcome unknown ({why}); keeping the reservation and settling it by reading the API"
            );
            tx.send_replace(Outcome::Unknown(why));
            Some(Instant::now())
        }
    };
    let last_unknown = Mutex::new(first);
    let settle_window = Duration::from_millis(state.config().bind_settle_ms);
    let call_budget = Duration::from_millis(state.config().bind_timeout_ms.max(1));
    // Polls until the reservation ends: the watch shows the pod (observed, deleted), or the
    // API read here settles it. Each poll is one step of the one retry loop.
    let step = || async {
        if !cache.holds(&job.uid, token) {
            return Ok(());
        }
        let read = tokio::time::timeout(call_budget, job.pods.get_opt(&job.name)).await;
        let Ok(Ok(pod)) = read else {
            return Err(Pending);
        };
        let pod = pod.filter(|p| p.metadata.uid.as_deref() == Some(job.uid.as_str()));
        let bound_to = pod
            .as_ref()
            .and_then(|p| p.spec.as_ref())
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty());
        let finished = pod.as_ref().is_some_and(crate::k8s::pod_is_terminal);
        match (pod.is_some(), bound_to) {
            (true, Some(n)) if n == job.node && !finished => {
                // Bound here: confirmed; the watch turns it into an observed pod.
                if !tx.borrow().is_final() {
                    finish_bound(job, tx);
                }
                cache.confirm(&job.uid, token);
                Err(Pending)
            }
            (true, None) if !finished => {
                let since = *last_unknown.lock().unwrap_or_else(|p| p.into_inner());
                if since.is_none_or(|t| t.elapsed() >= settle_window) {
                    release(
                        job,
                        tx,
                        "the pod stayed unbound after a bind of unknown outcome",
                        false,
                    );
                    return Ok(());
                }
                if !state.is_serving() {
                    return Err(Pending);
                }
                match attempt(job, Instant::now() + call_budget).await {
                    Attempt::Bound => {
                        cache.confirm(&job.uid, token);
                        finish_bound(job, tx);
                    }
                    Attempt::Refused {
                        why,
                        definitive: true,
                    } => {
                        release(job, tx, &why, false);
                        return Ok(());
                    }
                    Attempt::Refused { .. } => {}
                    Attempt::Unknown(_) => {
                        *last_unknown.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(Instant::now());
                    }
                }
                Err(Pending)
            }
            (true, Some(_)) if !finished => {
                release(job, tx, "the pod is bound to another node", false);
                Ok(())
            }
            _ => {
                release(job, tx, "the pod is gone or finished", true);
                Ok(())
            }
        }
    };
    // The owner lives as long as its reservation; a far deadline only bounds a stuck API.
    let far = Instant::now() + Duration::from_secs(24 * 3600);
    let _ = retry_until(far, |_| {}, step).await;
}

/// "Not settled yet": always worth another poll.
#[derive(Debug)]
struct Pending;

impl Transient for Pending {
    fn is_transient(&self) -> bool {
        true
    }
}

fn finish_bound(job: &Job, tx: &watch::Sender<Outcome>) {
    let msg = job.bound_message();
    job.state.metrics().count_settled("bound");
    emit_event(&job.state, &job.pod, REASON_BOUND, &msg, Severity::Normal);
    tx.send_replace(Outcome::Bound(msg));
}

/// Releases the reservation; `gone`: the API showed the pod deleted or finished.
fn release(job: &Job, tx: &watch::Sender<Outcome>, why: &str, gone: bool) {
    let cache = job.state.cache();
    let token = job.reservation.token;
    let released = if gone {
        cache.release_gone(&job.uid, token)
    } else {
        forget_reservation(job);
        cache.release(&job.uid, token)
    };
    if released {
        job.state.metrics().count_settled("released");
        tracing::info!(
            pod = %format!("{}/{}", job.namespace, job.name), node = %job.node,
            "reservation released: {why}"
        );
    }
    if !tx.borrow().is_final() {
        let why = format!(
            "binding pod {}/{} to node {}: {why}",
            job.namespace, job.name, job.node
        );
        emit_event(&job.state, &job.pod, REASON_FAILED, &why, Severity::Warning);
        tx.send_replace(Outcome::Failed(why));
    }
}

/// The reservation is settled as not landing: the watch must not count its annotation again,
/// and a serving replica removes it from the pod (in the background).
fn forget_reservation(job: &Job) {
    if !job.state.cache().holds(&job.uid, job.reservation.token) {
        return;
    }
    job.state.cache().mark_released(&job.uid, &job.reserved);
    if job.state.is_serving() {
        let (state, reserved) = (job.state.clone(), job.reserved.clone());
        let (ns, name, uid) = (job.namespace.clone(), job.name.clone(), job.uid.clone());
        tokio::spawn(async move {
            super::reservations::clear(&state, &ns, &name, &uid, &reserved).await;
        });
    }
}

/// One round: the clean-slate annotation patch, then the Binding, retried within `deadline`.
/// FENCE (issue 18): why this bind may not write now, if it may not: the leadership term it
/// was admitted under has ended, or the last renewal is older than the write window. Time
/// is bounded separately: each round by its own deadline (the request's, from admission, for
/// the first; the owner's budget for settle rounds).
fn fenced(job: &Job) -> Option<Fenced> {
    job.admission.check_term().err()
}

async fn attempt(job: &Job, deadline: Instant) -> Attempt {
    let state = &job.state;
    if let Some(f) = fenced(job) {
        // Nothing is sent, so nothing of this round can land.
        return Attempt::Refused {
            why: format!("not written: {f}"),
            definitive: false,
        };
    }
    if let Err(failed) = annotate(job, deadline).await {
        return failed;
    }
    let (ns, name, node, uid) = (&job.namespace, &job.name, &job.node, &job.uid);
    let client = state.client();
    // FENCE (issue 18): checked again right before the Binding.
    if let Some(f) = fenced(job) {
        return Attempt::Refused {
            why: format!("annotated, but the Binding was not sent: {f}"),
            definitive: false,
        };
    }
    let in_doubt = InDoubt::default();
    let bound = with_retry(state, deadline, || async {
        match in_doubt.track(bind_pod(client, ns, name, uid, node)).await {
            Ok(()) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Maybe an earlier try landed: look at the pod.
                let pod = job.pods.get_opt(name).await.map_err(CallError::Kube)?;
                let Some(pod) = pod else {
                    return Err(CallError::Definitive("the pod was deleted".to_string()));
                };
                if pod.metadata.uid.as_deref() != Some(uid.as_str()) {
                    return Err(CallError::Definitive("the pod was replaced".to_string()));
                }
                match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                    Some(n) if n == node.as_str() => Ok(()),
                    Some(n) if !n.is_empty() => Err(CallError::Definitive(format!(
                        "the pod is already bound to node {n}"
                    ))),
                    _ => Err(CallError::Kube(kube::Error::Api(s))),
                }
            }
            Err(e) => Err(CallError::Kube(e)),
        }
    })
    .await;
    // A lost answer of an earlier try leaves the round in doubt even if the last was refused.
    let what = format!("binding pod {ns}/{name} to node {node}");
    match bound {
        Ok(()) => Attempt::Bound,
        Err(e @ CallError::Definitive(_)) => Attempt::Refused {
            why: e.describe(&what),
            definitive: true,
        },
        Err(e) if e.is_not_found() => Attempt::Refused {
            why: format!("pod {ns}/{name} was deleted during bind"),
            definitive: true,
        },
        Err(e @ CallError::Timeout) => Attempt::Unknown(e.describe(&what)),
        Err(e) if in_doubt.is_set() => Attempt::Unknown(e.describe(&what)),
        Err(e) => Attempt::Refused {
            why: e.describe(&what),
            definitive: false,
        },
    }
}

/// The round's clean-slate annotation patch with the durable reservation, retried within
/// `deadline`; `Err` is the round's answer when it failed.
async fn annotate(job: &Job, deadline: Instant) -> Result<(), Attempt> {
    let state = &job.state;
    let (ns, name, node, uid) = (&job.namespace, &job.name, &job.node, &job.uid);
    let client = state.client();
    let r = job.reservation;
    let mut patch = PodGpuAnnotations::bind_patch(r.gpu, job.request, r.device_total, now_ns());
    // Durable: any successor reads what the pod is promised (see `reservations`).
    patch.insert(POD_ANN_RESERVATION.to_string(), job.reserved.clone());
    // Fenced by the pod's resourceVersion: a slow patch of an earlier round (or of an
    // earlier owner) can never land over this one, nor this one over a later write.
    let seen = Mutex::new((
        job.pod.metadata.annotations.clone(),
        job.pod.metadata.resource_version.clone(),
    ));
    // A try that may still land carries the durable reservation: the round is then in doubt
    // even if a later try was refused.
    let in_doubt = InDoubt::default();
    let patched = with_retry(state, deadline, || async {
        let (annotations, rv) = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let changes = clean_slate(annotations.as_ref(), patch.clone());
        let write = patch_pod_annotation_changes(client, ns, name, &changes, rv.as_deref());
        match in_doubt.track(write).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // The pod changed since it was read: read it again.
                let pod = job.pods.get_opt(name).await.map_err(CallError::Kube)?;
                let Some(pod) = pod.filter(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
                else {
                    return Err(CallError::Definitive(
                        "the pod was deleted or replaced".into(),
                    ));
                };
                match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                    // Bound here already: by an earlier round of ours, after its own patch.
                    Some(n) if n == node.as_str() => return Ok(()),
                    Some(n) if !n.is_empty() => {
                        return Err(CallError::Definitive(format!(
                            "the pod is already bound to node {n}"
                        )));
                    }
                    _ => {}
                }
                *seen.lock().unwrap_or_else(|p| p.into_inner()) =
                    (pod.metadata.annotations, pod.metadata.resource_version);
                Err(CallError::Kube(kube::Error::Api(s)))
            }
            Err(e) => Err(CallError::Kube(e)),
        }
    })
    .await;
    patched.map_err(|e| patch_failed(&e, in_doubt.is_set(), ns, name))
}

/// The round's answer when the annotation patch of pod `ns/name` failed with `e`. No Binding
/// was sent, but a patch whose answer was lost or that was cut off in flight (`in_doubt`) may
/// still land with the reservation on it: unknown, the reservation kept and settled by
/// reading the pod like a Binding of unknown outcome. Only a patch refused for certain frees
/// the GPU at once.
fn patch_failed(e: &CallError, in_doubt: bool, ns: &str, name: &str) -> Attempt {
    let what = format!("annotating pod {ns}/{name}");
    if let CallError::Definitive(_) = e {
        Attempt::Refused {
            why: e.describe(&what),
            definitive: true,
        }
    } else if e.is_not_found() {
        Attempt::Refused {
            why: format!("pod {ns}/{name} was deleted during bind"),
            definitive: true,
        }
    } else if in_doubt {
        Attempt::Unknown(format!("{} (the patch may still land)", e.describe(&what)))
    } else {
        Attempt::Refused {
            why: e.describe(&what),
            definitive: false,
        }
    }
}

/// The bind's annotation changes: `patch`, and a removal of every annotation of ours the pod
/// carries that the bind does not set (a pod created from another pod's YAML).
pub(crate) fn clean_slate(
    existing: Option<&BTreeMap<String, String>>,
    patch: BTreeMap<String, String>,
) -> BTreeMap<String, Option<String>> {
    let mut changes: BTreeMap<String, Option<String>> =
        patch.into_iter().map(|(k, v)| (k, Some(v))).collect();
    for key in existing.into_iter().flat_map(|a| a.keys()) {
        if crate::core::wire::is_our_pod_annotation(key) && !changes.contains_key(key) {
            changes.insert(key.clone(), None);
        }
    }
    changes
}

fn unit_name(state: &ExtenderState, node: &str) -> String {
    state
        .cache()
        .node_view(node)
        .and_then(|v| v.unit)
        .map(|u| u.to_string())
        .unwrap_or_else(|| "units".to_string())
}

/// Raises an Event on the pod (in the background: a slow Event API never holds a bind).
fn emit_event(
    state: &ExtenderState,
    pod: &Pod,
    reason: &'static str,
    message: &str,
    severity: Severity,
) {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let regarding = pod_reference(ns, name, pod.metadata.uid.as_deref());
    let events = state.events().clone();
    let message = message.to_string();
    tokio::spawn(async move {
        events
            .publish(&regarding, severity, "Bind", reason, &message)
            .await;
    });
}
