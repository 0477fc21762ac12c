//! Leader election over a `coordination.k8s.io/v1` Lease, so that several extender replicas
//! can run and exactly one serves the scheduling verbs.
//!
//! The protocol is the one client-go's `leaderelection` package speaks, so `kubectl get lease`
//! reads the same: the holder writes its identity, `acquireTime`, `renewTime` (RFC 3339 with
//! microseconds) and `leaseDurationSeconds`; a lease whose `renewTime + leaseDurationSeconds`
//! lies in the past, or whose holder is empty, is free. Every write is a `PUT` carrying the
//! `resourceVersion` that was read (a create for a missing lease), so two candidates racing
//! for a free lease cannot both win: the loser gets 409 and re-reads.
//!
//! [`decide`] is the pure rule (what to do with a lease read at a given time); the task
//! started by [`LeaderElector::spawn`] applies it every retry period and publishes the
//! outcome on a `watch` channel: `true` while leading. The leader stops leading AT ONCE when
//! it sees another holder, and on its own clock when it has not renewed for `renew_deadline`
//! (which is shorter than the lease duration, so it has stopped before anyone else may take
//! over). On shutdown the leader clears `holderIdentity` so another replica takes over
//! without waiting for the lease to expire.
//!
//! [`Election`] ties it to the extender: only the leader is serving (the others answer 503 on
//! the scheduling verbs and `/readyz`, so the Service routes to the leader), and a replica
//! that becomes leader first re-lists pods, nodes and ConfigMaps (a fresh watch, so its
//! ledger is rebuilt from the annotations as the API server has them NOW, including the
//! previous leader's last binds) and is ready only once that list is applied. Stepping down
//! closes the gate at once. On shutdown the extender drains its HTTP server (in-flight binds
//! finish) and only then resigns, so the next leader never races a bind of the old one.
//!
//! Why a partitioned leader cannot double-allocate with the next one: it stops serving
//! `renew_deadline` after its last successful renewal; the lease expires for the others only
//! `lease_duration` after that renewal's `renewTime`. Binds already running when it stops have
//! `bind_timeout_ms` to finish, so `bind_timeout_ms < lease_duration - renew_deadline` (4 s <
//! 15 s - 10 s by default; a warning is logged otherwise) means the old leader's last write
//! has landed before the new leader lists.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::state::ExtenderState;
use crate::config::ExtenderConfig;
use crate::shutdown::{self, Shutdown, Trigger};

/// The three durations of leader election.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a lease stays valid without renewal (written as `leaseDurationSeconds`,
    /// rounded up to whole seconds).
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it stops leading.
    pub renew_deadline: Duration,
    /// How often a candidate tries to acquire, and the leader to renew.
    pub retry_period: Duration,
}

/// A timing that cannot work (the leader could still lead after others may take over).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "leader election needs retry period ({retry:?}) < renew deadline ({renew:?}) < lease duration ({lease:?})"
)]
pub struct TimingError {
    retry: Duration,
    renew: Duration,
    lease: Duration,
}

impl LeaseTiming {
    /// Checks `retry_period < renew_deadline < lease_duration` (a zero retry period is refused
    /// too): otherwise a partitioned leader could keep serving after another replica has
    /// taken the lease.
    pub fn new(
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Result<Self, TimingError> {
        if retry_period.is_zero()
            || retry_period >= renew_deadline
            || renew_deadline >= lease_duration
        {
            return Err(TimingError {
                retry: retry_period,
                renew: renew_deadline,
                lease: lease_duration,
            });
        }
        Ok(LeaseTiming {
            lease_duration,
            renew_deadline,
            retry_period,
        })
    }

    /// The timing of `[extender]` (`lease_duration_secs`, `renew_deadline_secs`,
    /// `retry_period_secs`).
    pub fn from_config(cfg: &ExtenderConfig) -> Result<Self, TimingError> {
        LeaseTiming::new(
            Duration::from_secs(cfg.lease_duration_secs),
            Duration::from_secs(cfg.renew_deadline_secs),
            Duration::from_secs(cfg.retry_period_secs),
        )
    }

    /// `leaseDurationSeconds` as written into the Lease: whole seconds, rounded up, at least 1.
    pub fn lease_duration_seconds(&self) -> i32 {
        let ms = self.lease_duration.as_millis();
        let secs = ms.div_ceil(1000).max(1);
        i32::try_from(secs).unwrap_or(i32::MAX)
    }
}

/// What a candidate does with the lease it just read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// No lease exists: create it, holding it.
    Create,
    /// The lease is free (no holder) or expired: take it over.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Another candidate holds a live lease.
    Follow {
        /// The holder's identity.
        holder: String,
    },
}

/// The election rule. `now` is the local wall clock; `default_duration` applies when the lease
/// does not say how long it lasts. A held lease with neither `renewTime` nor `acquireTime` is
/// treated as expired (nobody can prove it is alive).
pub fn decide(
    now: Timestamp,
    lease: Option<&Lease>,
    me: &str,
    default_duration: Duration,
) -> Action {
    let Some(lease) = lease else {
        return Action::Create;
    };
    let spec = lease.spec.as_ref();
    let holder = spec
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or("");
    if holder.is_empty() {
        return Action::Acquire;
    }
    if holder == me {
        return Action::Renew;
    }
    let last = spec.and_then(|s| s.renew_time.as_ref().or(s.acquire_time.as_ref()));
    let Some(last) = last else {
        return Action::Acquire;
    };
    let duration_us = match spec.and_then(|s| s.lease_duration_seconds) {
        Some(secs) if secs > 0 => i64::from(secs).saturating_mul(1_000_000),
        _ => i64::try_from(default_duration.as_micros()).unwrap_or(i64::MAX),
    };
    let expires_us = last.0.as_microsecond().saturating_add(duration_us);
    if expires_us < now.as_microsecond() {
        Action::Acquire
    } else {
        Action::Follow {
            holder: holder.to_string(),
        }
    }
}

/// This replica's identity: `given` when non-empty, else the pod name (`POD_NAME`, then
/// `HOSTNAME`, then the kernel host name) followed by `_` and a random suffix, so a restarted
/// replica never mistakes its predecessor's lease for its own.
pub fn identity(given: Option<&str>) -> String {
    if let Some(id) = given.filter(|s| !s.is_empty()) {
        return id.to_string();
    }
    let base = ["POD_NAME", "HOSTNAME"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .find(|v| !v.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .unwrap_or_else(|| "gpushare-extender".to_string());
    format!("{base}_{:08x}", random_u32())
}

fn random_u32() -> u32 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    // Truncation is the point: any 32 bits of the hash will do.
    h.finish() as u32
}

/// One candidate for one Lease.
#[derive(Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: LeaseTiming,
}

/// A running election: the leading flag, and the task (which releases the lease on shutdown).
#[derive(Debug)]
pub struct Leadership {
    leading: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

impl Leadership {
    /// A receiver of the leading flag (`true` while this replica leads).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    /// Waits for the election task to end (after shutdown, once the lease is released).
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// Starts leader election with the `[extender]` settings (`lease_name`, `lease_namespace` and
/// the durations). `identity` as in [`identity`].
pub fn spawn(
    client: kube::Client,
    cfg: &ExtenderConfig,
    identity_given: Option<&str>,
    shutdown: Shutdown,
) -> Result<Leadership, TimingError> {
    let timing = LeaseTiming::from_config(cfg)?;
    let elector = LeaderElector::new(
        client,
        &cfg.lease_namespace,
        &cfg.lease_name,
        identity(identity_given),
        timing,
    );
    Ok(elector.spawn(shutdown))
}

/// How one acquire/renew round ended.
enum Round {
    /// We hold the lease (renewed or acquired at the instant the round started).
    Holding,
    /// Someone else holds a live lease.
    Following(String),
}

impl LeaderElector {
    /// A candidate `identity` for Lease `namespace/name`.
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: String,
        timing: LeaseTiming,
    ) -> Self {
        LeaderElector {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity,
            timing,
        }
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Writes name the candidate as their field manager (`?fieldManager=<identity>`, cut to
    /// the API's 128 bytes), so an audit log — and a test's fault filter — tells the replicas
    /// apart.
    fn post_params(&self) -> PostParams {
        let mut manager = self.identity.clone();
        while manager.len() > 128 {
            manager.pop();
        }
        PostParams {
            dry_run: false,
            field_manager: Some(manager),
        }
    }

    /// Runs the election until `shutdown`; the flag starts `false`.
    pub fn spawn(self, shutdown: Shutdown) -> Leadership {
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(self.run(tx, shutdown));
        Leadership { leading: rx, task }
    }

    async fn run(self, tx: watch::Sender<bool>, shutdown: Shutdown) {
        let set = |leading: bool| {
            tx.send_if_modified(|v| {
                let changed = *v != leading;
                *v = leading;
                changed
            });
        };
        // Start of the last round that renewed (or acquired) the lease.
        let mut renewed_at: Option<Instant> = None;
        let stop = shutdown.clone().wait();
        tokio::pin!(stop);
        loop {
            let started = Instant::now();
            let leading = *tx.borrow();
            // A renewal may not outlive the renew deadline: a hung request must not keep a
            // partitioned leader serving.
            let budget = match (leading, renewed_at) {
                (true, Some(at)) => {
                    (at + self.timing.renew_deadline).saturating_duration_since(started)
                }
                _ => self.timing.renew_deadline,
            };
            let outcome = tokio::select! {
                _ = &mut stop => break,
                r = tokio::time::timeout(budget, self.round()) => r,
            };
            match outcome {
                Ok(Ok(Round::Holding)) => {
                    renewed_at = Some(started);
                    if !leading {
                        tracing::info!(identity = %self.identity, lease = %self.name, "became leader");
                    }
                    set(true);
                }
                Ok(Ok(Round::Following(holder))) => {
                    if leading {
                        tracing::warn!(identity = %self.identity, %holder, "lost the lease to another holder");
                    }
                    renewed_at = None;
                    set(false);
                }
                Ok(Err(err)) => {
                    tracing::warn!(identity = %self.identity, lease = %self.name, error = %err, "lease round failed");
                }
                Err(_) => {
                    tracing::warn!(identity = %self.identity, lease = %self.name, "lease round timed out");
                }
            }
            // Sleep one retry period, but wake at the renew deadline if that comes first.
            let mut wake = Instant::now() + self.timing.retry_period;
            let deadline = match (*tx.borrow(), renewed_at) {
                (true, Some(at)) => Some(at + self.timing.renew_deadline),
                _ => None,
            };
            if let Some(d) = deadline {
                wake = wake.min(d);
            }
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep_until(wake) => {}
            }
            if let Some(d) = deadline
                && Instant::now() >= d
                && *tx.borrow()
            {
                tracing::warn!(identity = %self.identity, lease = %self.name, "could not renew the lease within the renew deadline; stepping down");
                renewed_at = None;
                set(false);
            }
        }
        let was_leading = *tx.borrow();
        set(false);
        if was_leading {
            self.release().await;
        }
    }

    /// One read-decide-write round; a 409 (someone wrote in between) re-reads once.
    async fn round(&self) -> Result<Round, kube::Error> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.try_round().await {
                Err(kube::Error::Api(status)) if status.code == 409 && attempts < 2 => continue,
                other => return other,
            }
        }
    }

    async fn try_round(&self) -> Result<Round, kube::Error> {
        let current = self.api.get_opt(&self.name).await?;
        let now = Timestamp::now();
        let action = decide(
            now,
            current.as_ref(),
            &self.identity,
            self.timing.lease_duration,
        );
        let stamp = MicroTime(now);
        match action {
            Action::Follow { holder } => Ok(Round::Following(holder)),
            Action::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(self.timing.lease_duration_seconds()),
                        acquire_time: Some(stamp.clone()),
                        renew_time: Some(stamp),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.api.create(&self.post_params(), &lease).await?;
                Ok(Round::Holding)
            }
            Action::Acquire | Action::Renew => {
                // `current` is Some here; its resourceVersion makes the PUT conditional.
                let mut lease = current.unwrap_or_default();
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if action == Action::Acquire {
                    spec.lease_transitions =
                        Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
                    spec.acquire_time = Some(stamp.clone());
                }
                spec.holder_identity = Some(self.identity.clone());
                spec.lease_duration_seconds = Some(self.timing.lease_duration_seconds());
                spec.renew_time = Some(stamp);
                self.api
                    .replace(&self.name, &self.post_params(), &lease)
                    .await?;
                Ok(Round::Holding)
            }
        }
    }

    /// Clears `holderIdentity` if we still hold the lease (best effort, bounded by one retry
    /// period), so that another replica can take over at once.
    async fn release(&self) {
        let attempt = async {
            let Some(mut lease) = self.api.get_opt(&self.name).await? else {
                return Ok::<(), kube::Error>(());
            };
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(Timestamp::now()));
            self.api
                .replace(&self.name, &self.post_params(), &lease)
                .await?;
            Ok(())
        };
        match tokio::time::timeout(self.timing.renew_deadline, attempt).await {
            Ok(Ok(())) => {
                tracing::info!(identity = %self.identity, lease = %self.name, "released the lease")
            }
            Ok(Err(err)) => {
                tracing::warn!(identity = %self.identity, error = %err, "could not release the lease")
            }
            Err(_) => tracing::warn!(identity = %self.identity, "releasing the lease timed out"),
        }
    }
}

/// Leader election wired to an extender: the serving gate and the ledger rebuild.
#[derive(Debug)]
pub struct Election {
    leadership: Leadership,
    resign: Trigger,
    gate: JoinHandle<()>,
}

impl Election {
    /// Starts competing for the `[extender]` Lease. Takes over `watches` (the running
    /// [`super::sync`] tasks): they keep the ledger warm while following and are restarted
    /// (a fresh list) whenever this replica becomes leader. `shutdown` closes the gate and
    /// stops the watches; the lease itself is released by [`Election::resign`].
    pub fn start(
        state: Arc<ExtenderState>,
        watches: Vec<JoinHandle<()>>,
        shutdown: Shutdown,
    ) -> Result<Election, TimingError> {
        let cfg = state.config();
        let timing = LeaseTiming::from_config(cfg)?;
        let margin = timing.lease_duration - timing.renew_deadline;
        if Duration::from_millis(cfg.bind_timeout_ms) >= margin {
            tracing::warn!(
                bind_timeout_ms = cfg.bind_timeout_ms,
                margin_ms = margin.as_millis(),
                "extender.bind_timeout_ms should be shorter than lease_duration_secs - renew_deadline_secs, \
                 or a bind of a deposed leader may still land after the next leader has listed"
            );
        }
        let (resign, resign_handle) = shutdown::channel();
        let me = identity(None);
        tracing::info!(identity = %me, lease = %format!("{}/{}", cfg.lease_namespace, cfg.lease_name), "leader election on");
        let leadership = LeaderElector::new(
            state.client().clone(),
            &cfg.lease_namespace,
            &cfg.lease_name,
            me,
            timing,
        )
        .spawn(resign_handle);
        state.set_serving(false);
        let gate = tokio::spawn(gate(state, leadership.subscribe(), watches, shutdown));
        Ok(Election {
            leadership,
            resign,
            gate,
        })
    }

    /// A receiver of the leading flag.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leadership.subscribe()
    }

    /// Stops competing and releases the lease if held. Call after the HTTP server has
    /// drained, so no bind of this replica is still running.
    pub async fn resign(self) {
        self.resign.trigger();
        self.leadership.join().await;
        let _ = self.gate.await;
    }
}

/// Follows the leading flag: opens the serving gate after a fresh list, closes it at once.
async fn gate(
    state: Arc<ExtenderState>,
    mut leading: watch::Receiver<bool>,
    mut watches: Vec<JoinHandle<()>>,
    shutdown: Shutdown,
) {
    let stop = shutdown.clone().wait();
    tokio::pin!(stop);
    loop {
        let changed = tokio::select! {
            _ = &mut stop => break,
            r = leading.changed() => r,
        };
        if changed.is_err() {
            break;
        }
        if *leading.borrow_and_update() {
            // Rebuild from what the API server holds now: restart the watches, whose first
            // list replaces the ledger; `sync` marks it synced when the lists are applied.
            state.set_synced(false);
            for w in watches.drain(..) {
                w.abort();
            }
            watches = super::sync::spawn(state.clone(), shutdown.clone());
            state.set_serving(true);
            tracing::info!(
                "leading: serving once the fresh list of pods, nodes and ConfigMaps is applied"
            );
        } else {
            state.set_serving(false);
            tracing::info!("not leading: the scheduling verbs answer 503");
        }
    }
    state.set_serving(false);
    for w in watches {
        w.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    fn lease(holder: Option<&str>, renewed: Option<i64>, duration: Option<i32>) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                renew_time: renewed.map(|s| MicroTime(ts(s))),
                lease_duration_seconds: duration,
                ..LeaseSpec::default()
            }),
        }
    }

    const D: Duration = Duration::from_secs(15);

    #[test]
    fn missing_lease_is_created() {
        assert_eq!(decide(ts(0), None, "me", D), Action::Create);
    }

    #[test]
    fn free_lease_is_acquired() {
        assert_eq!(
            decide(ts(0), Some(&lease(None, Some(0), Some(15))), "me", D),
            Action::Acquire
        );
        assert_eq!(
            decide(ts(0), Some(&lease(Some(""), Some(0), Some(15))), "me", D),
            Action::Acquire
        );
        let no_spec = Lease::default();
        assert_eq!(decide(ts(0), Some(&no_spec), "me", D), Action::Acquire);
    }

    #[test]
    fn own_lease_is_renewed() {
        assert_eq!(
            decide(
                ts(100),
                Some(&lease(Some("me"), Some(0), Some(15))),
                "me",
                D
            ),
            Action::Renew
        );
    }

    #[test]
    fn live_foreign_lease_is_followed_until_it_expires() {
        let l = lease(Some("other"), Some(0), Some(15));
        let follow = Action::Follow {
            holder: "other".into(),
        };
        assert_eq!(decide(ts(10), Some(&l), "me", D), follow);
        // Exactly at expiry it is still live; one second later it is not.
        assert_eq!(decide(ts(15), Some(&l), "me", D), follow);
        assert_eq!(decide(ts(16), Some(&l), "me", D), Action::Acquire);
    }

    #[test]
    fn acquire_time_stands_in_for_renew_time_and_default_duration_applies() {
        let mut l = lease(Some("other"), None, None);
        if let Some(spec) = l.spec.as_mut() {
            spec.acquire_time = Some(MicroTime(ts(0)));
        }
        assert!(matches!(
            decide(ts(14), Some(&l), "me", D),
            Action::Follow { .. }
        ));
        assert_eq!(decide(ts(16), Some(&l), "me", D), Action::Acquire);
        // Nothing proves the holder alive: take it.
        let l = lease(Some("other"), None, Some(15));
        assert_eq!(decide(ts(0), Some(&l), "me", D), Action::Acquire);
        // A nonsensical duration falls back to the default.
        let l = lease(Some("other"), Some(0), Some(-5));
        assert!(matches!(
            decide(ts(10), Some(&l), "me", D),
            Action::Follow { .. }
        ));
    }

    #[test]
    fn timing_is_validated() {
        let s = Duration::from_secs;
        assert!(LeaseTiming::new(s(15), s(10), s(2)).is_ok());
        assert!(LeaseTiming::new(s(10), s(10), s(2)).is_err());
        assert!(LeaseTiming::new(s(15), s(10), s(10)).is_err());
        assert!(LeaseTiming::new(s(15), s(10), s(0)).is_err());
        assert!(LeaseTiming::from_config(&ExtenderConfig::default()).is_ok());
        let t = LeaseTiming::new(
            Duration::from_millis(1500),
            Duration::from_secs(1),
            Duration::from_millis(200),
        );
        assert_eq!(t.map(|t| t.lease_duration_seconds()), Ok(2));
    }

    #[test]
    fn identity_prefers_the_given_name_and_is_unique_otherwise() {
        assert_eq!(identity(Some("replica-a")), "replica-a");
        let a = identity(None);
        let b = identity(Some(""));
        assert_ne!(a, b);
        assert!(a.contains('_'));
    }

    #[test]
    fn micro_time_is_written_with_microseconds() {
        let t = MicroTime(ts(0));
        let json = serde_json::to_string(&t).unwrap_or_default();
        assert_eq!(json, "\"2023-11-14T22:13:20.000000Z\"");
    }
}
