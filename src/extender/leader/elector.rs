//! One candidate for one Lease: the read-decide-write rounds of client-go's protocol (a PUT
//! with the `resourceVersion` read, a create for a missing Lease), the task that runs them
//! every retry period and publishes whether this replica leads, the Lease watch that wakes a
//! follower when the Lease changes (through the one watch driver, stopped with the election),
//! the release on shutdown, and this replica's identity.
//!
//! Not here: the rule deciding each round (`rule`), the fence it keeps current (`fence`), the
//! extender's serving gate (`Election`, in the parent module).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::clock::{Clock, SystemClock};
use super::fence::{Fence, KnownLeader};
use super::rule::{ANN_LEADER_ADDRESS, Action, LeaseTiming, Observation, decide};
use crate::shutdown::Shutdown;

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
    timing: LeaseTiming,
    fence: Arc<Fence>,
    address: Option<String>,
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

/// How one acquire/renew round ended.
enum Round {
    /// We hold the lease (renewed or acquired at the instant the round started).
    Holding,
    /// Someone else holds a live lease.
    Following(KnownLeader),
}

impl LeaderElector {
    /// A candidate `identity` for Lease `namespace/name`, on the machine's clock.
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
            timing,
            fence: Fence::elected(identity, Arc::new(SystemClock), timing),
            address: None,
        }
    }

    /// The same candidate reading `clock` (tests: skew, pauses).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.fence = Fence::elected(self.fence.identity().to_string(), clock, self.timing);
        self
    }

    /// The same candidate driving `fence` (its identity and clock are the fence's).
    pub(crate) fn with_fence(mut self, fence: Arc<Fence>) -> Self {
        self.fence = fence;
        self
    }

    /// Publishes `address` (a base URL) in [`ANN_LEADER_ADDRESS`] while leading.
    pub fn advertise(mut self, address: Option<String>) -> Self {
        self.address = address;
        self
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        self.fence.identity()
    }

    /// Writes name the candidate as their field manager (`?fieldManager=<identity>`, cut to
    /// the API's 128 bytes), so an audit log — and a test's fault filter — tells the replicas
    /// apart.
    fn post_params(&self) -> PostParams {
        let mut manager = self.fence.identity().to_string();
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
        let clock = self.fence.clock().clone();
        let me = self.fence.identity().to_string();
        // Start of the last round that renewed (or acquired) the lease, on our clock.
        let mut renewed_at: Option<Instant> = None;
        let mut seen: Option<Observation> = None;
        // Changes of the Lease, as a watch sees them (a hint to look again, never a decision).
        let lease_changed = Arc::new(tokio::sync::Notify::new());
        let lease_watch = tokio::spawn(watch_lease(
            self.api.clone(),
            self.name.clone(),
            lease_changed.clone(),
            shutdown.clone(),
        ));
        let stop = shutdown.clone().wait();
        tokio::pin!(stop);
        loop {
            let started = clock.now();
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
                r = tokio::time::timeout(budget, self.round(&mut seen)) => r,
            };
            match outcome {
                Ok(Ok(Round::Holding)) => {
                    renewed_at = Some(started);
                    if self.fence.renewed(started) {
                        tracing::info!(identity = %me, lease = %self.name, term = self.fence.term_number(), "became leader");
                    }
                    set(true);
                }
                Ok(Ok(Round::Following(leader))) => {
                    if leading {
                        tracing::warn!(identity = %me, ?leader, "lost the lease to another holder");
                    }
                    renewed_at = None;
                    self.fence.lost(leader);
                    set(false);
                }
                Ok(Err(err)) => {
                    tracing::warn!(identity = %me, lease = %self.name, error = %err, "lease round failed");
                }
                Err(_) => {
                    tracing::warn!(identity = %me, lease = %self.name, "lease round timed out");
                }
            }
            // Sleep one retry period, but wake at the renew deadline if that comes first; a
            // follower also wakes just past the moment the lease it follows expires by its
            // clock, and at once when the lease changes (released, taken) — so a free lease is
            // taken within moments, not a retry period later.
            let leading_now = *tx.borrow();
            let deadline = match (leading_now, renewed_at) {
                (true, Some(at)) => Some(at + self.timing.renew_deadline),
                _ => None,
            };
            let mut nap = self.timing.retry_period;
            if let Some(d) = deadline {
                nap = nap.min(d.saturating_duration_since(clock.now()));
            }
            if !leading_now && let Some(o) = &seen {
                let expiry = o.expires_at(self.timing.lease_duration) + Duration::from_millis(1);
                nap = nap.min(expiry.saturating_duration_since(clock.now()));
            }
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(nap) => {}
                _ = lease_changed.notified(), if !leading_now => {}
            }
            if let Some(d) = deadline
                && clock.now() >= d
                && *tx.borrow()
            {
                tracing::warn!(identity = %me, lease = %self.name, "could not renew the lease within the renew deadline; stepping down");
                renewed_at = None;
                self.fence.lost(KnownLeader::Unknown);
                set(false);
            }
        }
        // The watch ends on the same shutdown that ended the loop.
        let _ = lease_watch.await;
        let was_leading = *tx.borrow();
        self.fence.lost(KnownLeader::Unknown);
        set(false);
        if was_leading {
            self.release().await;
        }
    }

    /// One read-decide-write round; a 409 (someone wrote in between) re-reads once.
    async fn round(&self, seen: &mut Option<Observation>) -> Result<Round, kube::Error> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.try_round(seen).await {
                Err(kube::Error::Api(status)) if status.code == 409 && attempts < 2 => continue,
                other => return other,
            }
        }
    }

    /// Sets or clears the leader-address annotation on `meta`.
    fn stamp_address(&self, meta: &mut ObjectMeta) {
        let annotations = meta.annotations.get_or_insert_with(Default::default);
        match &self.address {
            Some(a) => {
                annotations.insert(ANN_LEADER_ADDRESS.to_string(), a.clone());
            }
            None => {
                annotations.remove(ANN_LEADER_ADDRESS);
            }
        }
    }

    async fn try_round(&self, seen: &mut Option<Observation>) -> Result<Round, kube::Error> {
        let current = self.api.get_opt(&self.name).await?;
        let clock = self.fence.clock();
        let action = decide(
            clock.now(),
            current.as_ref(),
            seen,
            self.fence.identity(),
            self.timing.lease_duration,
        );
        let stamp = MicroTime(clock.wall());
        match action {
            Action::Follow { holder, address } => Ok(Round::Following(KnownLeader::Other {
                identity: holder,
                address,
            })),
            Action::Create => {
                let mut lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.fence.identity().to_string()),
                        lease_duration_seconds: Some(self.timing.lease_duration_seconds()),
                        acquire_time: Some(stamp.clone()),
                        renew_time: Some(stamp),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.stamp_address(&mut lease.metadata);
                self.api.create(&self.post_params(), &lease).await?;
                Ok(Round::Holding)
            }
            Action::Acquire | Action::Renew => {
                if action == Action::Acquire && !self.fence.is_leading() {
                    // The holder we followed is gone (released or expired by our clock).
                    self.fence.lost(KnownLeader::Unknown);
                }
                // `current` is Some here; its resourceVersion makes the PUT conditional.
                let mut lease = current.unwrap_or_default();
                self.stamp_address(&mut lease.metadata);
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if action == Action::Acquire {
                    spec.lease_transitions =
                        Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
                    spec.acquire_time = Some(stamp.clone());
                }
                spec.holder_identity = Some(self.fence.identity().to_string());
                spec.lease_duration_seconds = Some(self.timing.lease_duration_seconds());
                spec.renew_time = Some(stamp);
                self.api
                    .replace(&self.name, &self.post_params(), &lease)
                    .await?;
                Ok(Round::Holding)
            }
        }
    }

    /// Clears `holderIdentity` if we still hold the lease (best effort, bounded by the renew
    /// deadline), so that another replica can take over at once.
    async fn release(&self) {
        let me = self.fence.identity().to_string();
        let attempt = async {
            let Some(mut lease) = self.api.get_opt(&self.name).await? else {
                return Ok::<(), kube::Error>(());
            };
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() != Some(me.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(self.fence.clock().wall()));
            if let Some(a) = lease.metadata.annotations.as_mut() {
                a.remove(ANN_LEADER_ADDRESS);
            }
            self.api
                .replace(&self.name, &self.post_params(), &lease)
                .await?;
            Ok(())
        };
        match tokio::time::timeout(self.timing.renew_deadline, attempt).await {
            Ok(Ok(())) => {
                tracing::info!(identity = %me, lease = %self.name, "released the lease")
            }
            Ok(Err(err)) => {
                tracing::warn!(identity = %me, error = %err, "could not release the lease")
            }
            Err(_) => tracing::warn!(identity = %me, "releasing the lease timed out"),
        }
    }
}

/// Pings `changed` on every change of Lease `name` until `shutdown`, on the one watch driver
/// (errors are logged at debug and retried with kube-runtime's default backoff: the watch
/// is a hint to look again, the retry period stays the rule).
async fn watch_lease(
    api: Api<Lease>,
    name: String,
    changed: Arc<tokio::sync::Notify>,
    shutdown: Shutdown,
) {
    use crate::k8s::watch::{ListFrom, WatchConfig};
    // A hint only (the elector reads the Lease itself): the watch cache's view will do.
    let config = WatchConfig::new(ListFrom::Cache).fields(&format!("metadata.name={name}"));
    crate::k8s::watch::drive(
        api,
        config,
        crate::k8s::watch::DefaultBackoff::default(),
        shutdown,
        |e| tracing::debug!(lease = %name, error = %e, "lease watch failed; retrying"),
        |_| changed.notify_one(),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_prefers_the_given_name_and_is_unique_otherwise() {
        assert_eq!(identity(Some("replica-a")), "replica-a");
        let a = identity(None);
        let b = identity(Some(""));
        assert_ne!(a, b);
        assert!(a.contains('_'));
    }
}
