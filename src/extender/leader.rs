//! Leader election over a `coordination.k8s.io/v1` Lease, and the fence that keeps a deposed
//! leader's binds from writing.
//!
//! The protocol is the one client-go's `leaderelection` package speaks, so `kubectl get lease`
//! reads the same: the holder writes its identity, `acquireTime`, `renewTime` (RFC 3339 with
//! microseconds) and `leaseDurationSeconds`; every write is a `PUT` carrying the
//! `resourceVersion` that was read (a create for a missing lease), so two candidates racing
//! for a free lease cannot both win: the loser gets 409 and re-reads. The holder also
//! publishes where it serves, in the [`ANN_LEADER_ADDRESS`] annotation, so standbys can
//! forward the scheduling verbs to it (see `forward`).
//!
//! **Expiry is judged on the candidate's own clock** (client-go's rule): a candidate
//! remembers the lease record it last saw and the LOCAL monotonic time at which it saw it
//! change; the lease is expired once it has not changed for `leaseDurationSeconds` of local
//! time. The holder's `renewTime` is never compared with the candidate's wall clock, so
//! clock skew between machines cannot hand the lease to a second replica (a holder whose
//! clock runs 20 s behind keeps its lease). [`decide`] is that rule, pure; the time source is
//! a [`Clock`], which tests replace.
//!
//! **Fencing.** A bind is admitted under a leadership *term* ([`Fence::admit`] returns a
//! [`Ticket`] before the request body is read) and checks its ticket immediately before each
//! API write ([`Ticket::check`]): the term must still be current, the bind's deadline
//! (`bind_timeout_ms` from admission) not passed, and the local time since the leader's last
//! successful renewal below the write window, `lease_duration − margin` where the margin is
//! `lease_duration − renew_deadline`. A leader that was paused (GC, CPU throttling, SIGSTOP)
//! and resumes after another replica took over finds its window closed and writes nothing.
//! The margin is what a write already sent may still take to land, which is why
//! `bind_timeout_ms` must fit inside `lease_duration − renew_deadline` (configuration error
//! otherwise). What no client-side fence can close: a request that the network holds for
//! longer than the margin after it was sent.
//!
//! Why the next leader never races the old one: the old leader stops writing `renew_deadline`
//! after the start of its last successful renewal; any other candidate saw that renewal land
//! no earlier than that start and waits `lease_duration` of its own time after seeing it.
//!
//! The task started by [`LeaderElector::spawn`] applies [`decide`] every retry period,
//! publishes the outcome on a `watch` channel (`true` while leading) and keeps the [`Fence`]
//! current. The leader stops leading AT ONCE when it sees another holder, and when it has not
//! renewed for `renew_deadline`. On shutdown the leader clears `holderIdentity` so another
//! replica takes over without waiting for the lease to expire.
//!
//! [`Election`] ties it to the extender: a replica that becomes leader first re-lists pods,
//! nodes and ConfigMaps (a fresh watch, so its ledger is rebuilt from the annotations as the
//! API server has them NOW, including the previous leader's last binds) and serves the verbs
//! itself only once that list is applied; until then, and while following, the verbs are
//! forwarded to whoever leads. On shutdown the extender drains its HTTP server (in-flight
//! binds finish) and only then resigns.
//!
//! Not here: the forwarding itself (`forward`), the HTTP routes (`routes`).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::state::ExtenderState;
use crate::config::ExtenderConfig;
use crate::shutdown::{self, Shutdown, Trigger};

/// Lease annotation holding the leader's base URL (`http://10.0.0.7:12345`), written by the
/// holder on every renewal; standbys forward the scheduling verbs there.
pub(crate) const ANN_LEADER_ADDRESS: &str = "gpushare.io/leader-address";

/// Where the election and the fence read the time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Local monotonic time: lease expiry, the fence's windows, deadlines.
    fn now(&self) -> Instant;
    /// Wall-clock time: only written into `acquireTime` / `renewTime`, never compared.
    fn wall(&self) -> Timestamp;
}

/// The machine's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn wall(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock for tests: the wall clock off by a settable amount (skew between machines), and
/// the monotonic clock moved forward by hand (how a process pause looks from inside).
#[derive(Debug, Default)]
pub struct AdjustableClock {
    wall_offset_ms: AtomicI64,
    ahead_ms: AtomicU64,
}

impl AdjustableClock {
    /// A clock that reads like the machine's until adjusted.
    pub fn new() -> Arc<AdjustableClock> {
        Arc::new(AdjustableClock::default())
    }

    /// Sets the wall-clock skew: negative runs behind, positive ahead.
    pub fn set_wall_offset(&self, offset: SignedDuration) {
        let ms = i64::try_from(offset.as_millis()).unwrap_or(i64::MAX);
        self.wall_offset_ms.store(ms, Ordering::SeqCst);
    }

    /// Moves the monotonic clock forward by `by` (time that passed while "paused").
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.ahead_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for AdjustableClock {
    fn now(&self) -> Instant {
        Instant::now() + Duration::from_millis(self.ahead_ms.load(Ordering::SeqCst))
    }
    fn wall(&self) -> Timestamp {
        let offset = SignedDuration::from_millis(self.wall_offset_ms.load(Ordering::SeqCst));
        let now = Timestamp::now();
        now.checked_add(offset).unwrap_or(now)
    }
}

/// The three durations of leader election.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a lease stays valid without renewal (written as `leaseDurationSeconds`,
    /// rounded up to whole seconds).
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it stops leading; also the fence's
    /// write window after each renewal.
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
    pub(crate) fn lease_duration_seconds(&self) -> i32 {
        let ms = self.lease_duration.as_millis();
        let secs = ms.div_ceil(1000).max(1);
        i32::try_from(secs).unwrap_or(i32::MAX)
    }

    /// The fence's margin: what a write sent at the end of the write window may take to
    /// land before another replica may take over (`lease_duration − renew_deadline`).
    pub(crate) fn margin(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_deadline)
    }

    /// How long after the start of its last successful renewal a leader may still begin a
    /// write: `lease_duration − margin`.
    pub(crate) fn write_window(&self) -> Duration {
        self.lease_duration.saturating_sub(self.margin())
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
        /// Where the holder serves ([`ANN_LEADER_ADDRESS`]), when it says.
        address: Option<String>,
    },
}

/// The parts of a Lease whose change proves its holder alive (client-go's
/// `LeaderElectionRecord`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    holder: String,
    duration: Option<i32>,
    acquire_us: Option<i64>,
    renew_us: Option<i64>,
    transitions: Option<i32>,
}

impl Record {
    fn of(spec: Option<&LeaseSpec>) -> Record {
        Record {
            holder: spec
                .and_then(|s| s.holder_identity.clone())
                .unwrap_or_default(),
            duration: spec.and_then(|s| s.lease_duration_seconds),
            acquire_us: spec.and_then(|s| s.acquire_time.as_ref().map(|t| t.0.as_microsecond())),
            renew_us: spec.and_then(|s| s.renew_time.as_ref().map(|t| t.0.as_microsecond())),
            transitions: spec.and_then(|s| s.lease_transitions),
        }
    }
}

/// What a candidate last saw of a lease held by another, and the LOCAL time it saw it change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    record: Record,
    at: Instant,
}

impl Observation {
    /// The local instant after which the lease counts as expired unless it changes.
    pub(crate) fn expires_at(&self, default_duration: Duration) -> Instant {
        let duration = match self.record.duration {
            Some(secs) if secs > 0 => Duration::from_secs(u64::from(secs.unsigned_abs())),
            _ => default_duration,
        };
        self.at + duration
    }
}

/// The election rule. `now` is local monotonic time; `seen` is this candidate's memory of
/// the lease (updated here: a changed record restarts the count); `default_duration`
/// applies when the lease does not say how long it lasts. A foreign lease is expired once its
/// record has not changed for its duration of LOCAL time — its `renewTime` is not compared
/// with our clock, so skew between machines does not matter. A lease first seen now counts
/// from now: a new candidate waits a whole duration before taking over a held lease.
pub fn decide(
    now: Instant,
    lease: Option<&Lease>,
    seen: &mut Option<Observation>,
    me: &str,
    default_duration: Duration,
) -> Action {
    let Some(lease) = lease else {
        *seen = None;
        return Action::Create;
    };
    let spec = lease.spec.as_ref();
    let record = Record::of(spec);
    if record.holder.is_empty() {
        *seen = None;
        return Action::Acquire;
    }
    if record.holder == me {
        *seen = None;
        return Action::Renew;
    }
    let duration = match record.duration {
        Some(secs) if secs > 0 => Duration::from_secs(u64::from(secs.unsigned_abs())),
        _ => default_duration,
    };
    let since = match seen {
        Some(o) if o.record == record => now.saturating_duration_since(o.at),
        _ => {
            *seen = Some(Observation {
                record: record.clone(),
                at: now,
            });
            Duration::ZERO
        }
    };
    if since > duration {
        Action::Acquire
    } else {
        Action::Follow {
            holder: record.holder,
            address: lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANN_LEADER_ADDRESS))
                .filter(|a| !a.is_empty())
                .cloned(),
        }
    }
}

/// Who leads, as this replica knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KnownLeader {
    /// No live holder is known (no lease, expired, or not read yet).
    Unknown,
    /// This replica.
    Me,
    /// Another replica.
    Other {
        /// Its identity.
        identity: String,
        /// Its base URL, when it publishes one.
        address: Option<String>,
    },
}

/// Why a bind may not write (see the module docs on fencing).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Fenced {
    /// This replica does not lead.
    #[error("this extender replica is not the leader")]
    NotLeader,
    /// The term the bind was admitted under is over (leadership was lost, maybe regained).
    #[error("the leadership term {admitted} under which the bind was admitted has ended")]
    TermEnded {
        /// The term at admission.
        admitted: u64,
    },
    /// The last successful renewal is too long ago: another replica may be taking over.
    #[error(
        "the lease was last renewed {since:?} ago, past the write window of {window:?} \
         (lease_duration - margin); another replica may be taking over"
    )]
    Stale {
        /// Local time since the start of the last successful renewal.
        since: Duration,
        /// The write window.
        window: Duration,
    },
    /// The bind's own deadline, counted from admission, has passed.
    #[error("the bind did not finish within extender.bind_timeout_ms of its admission")]
    DeadlineExceeded,
}

#[derive(Debug, Default)]
struct Term {
    number: u64,
    leading: bool,
    renewed_at: Option<Instant>,
}

/// The leadership state binds are fenced by, and who leads. Shared by the election (which
/// updates it) and the request handlers (which admit and check [`Ticket`]s).
#[derive(Debug)]
pub struct Fence {
    identity: String,
    clock: Arc<dyn Clock>,
    /// `None`: no leader election, every bind is admitted.
    window: Option<Duration>,
    term: Mutex<Term>,
    leader: watch::Sender<KnownLeader>,
}

impl Fence {
    /// A fence for a single replica (no election): admits everything, checks only deadlines.
    pub(crate) fn unelected(identity: String, clock: Arc<dyn Clock>) -> Arc<Fence> {
        let (leader, _) = watch::channel(KnownLeader::Me);
        Arc::new(Fence {
            identity,
            clock,
            window: None,
            term: Mutex::new(Term::default()),
            leader,
        })
    }

    /// A fence driven by leader election with `timing`; closed until the first renewal.
    pub(crate) fn elected(
        identity: String,
        clock: Arc<dyn Clock>,
        timing: LeaseTiming,
    ) -> Arc<Fence> {
        let (leader, _) = watch::channel(KnownLeader::Unknown);
        Arc::new(Fence {
            identity,
            clock,
            window: Some(timing.write_window()),
            term: Mutex::new(Term::default()),
            leader,
        })
    }

    fn term(&self) -> std::sync::MutexGuard<'_, Term> {
        self.term.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This replica's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The clock everything here reads.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Whether binds are fenced by an election at all.
    pub(crate) fn is_elected(&self) -> bool {
        self.window.is_some()
    }

    /// Whether this replica leads now (always, without an election).
    pub(crate) fn is_leading(&self) -> bool {
        self.window.is_none() || self.term().leading
    }

    /// The current term number (0 before the first win; counts wins).
    pub(crate) fn term_number(&self) -> u64 {
        self.term().number
    }

    /// Who leads.
    pub fn leader(&self) -> KnownLeader {
        self.leader.borrow().clone()
    }

    /// Admits a bind: the term now and a deadline `timeout` from now (the body read comes
    /// after this, inside the same deadline).
    pub(crate) fn admit(self: &Arc<Self>, timeout: Duration) -> Result<Ticket, Fenced> {
        let now = self.clock.now();
        let term = if self.window.is_some() {
            let t = self.term();
            if !t.leading {
                return Err(Fenced::NotLeader);
            }
            Some(t.number)
        } else {
            None
        };
        let ticket = Ticket {
            fence: self.clone(),
            term,
            deadline: now + timeout,
        };
        ticket.check()?;
        Ok(ticket)
    }

    /// A successful renewal (or acquisition) whose round started at `started` (our clock).
    /// Returns true when this begins a new term.
    pub fn renewed(&self, started: Instant) -> bool {
        let new_term = {
            let mut t = self.term();
            let new_term = !t.leading;
            if new_term {
                t.number += 1;
                t.leading = true;
            }
            t.renewed_at = Some(started);
            new_term
        };
        self.leader.send_if_modified(|l| {
            let changed = *l != KnownLeader::Me;
            *l = KnownLeader::Me;
            changed
        });
        new_term
    }

    /// Leadership is lost (or never held); `leader` is who leads instead, as far as known.
    pub fn lost(&self, leader: KnownLeader) {
        {
            let mut t = self.term();
            t.leading = false;
            t.renewed_at = None;
        }
        self.leader.send_if_modified(|l| {
            let changed = *l != leader;
            *l = leader;
            changed
        });
    }
}

/// A bind's admission under one term: check it before every write.
#[derive(Debug, Clone)]
pub struct Ticket {
    fence: Arc<Fence>,
    term: Option<u64>,
    deadline: Instant,
}

impl Ticket {
    /// Ok while the bind may write: deadline not passed and, under an election, still the
    /// same term and inside the write window after the last successful renewal.
    pub fn check(&self) -> Result<(), Fenced> {
        if self.fence.clock.now() >= self.deadline {
            return Err(Fenced::DeadlineExceeded);
        }
        self.check_term()
    }

    /// Ok while, under an election, this is still the term the bind was admitted under and
    /// inside the write window after the last successful renewal (the deadline aside: the
    /// owner of a reservation settling it past the request's deadline is held by this).
    pub(crate) fn check_term(&self) -> Result<(), Fenced> {
        let now = self.fence.clock.now();
        let (Some(admitted), Some(window)) = (self.term, self.fence.window) else {
            return Ok(());
        };
        let t = self.fence.term();
        if !t.leading || t.number != admitted {
            return Err(Fenced::TermEnded { admitted });
        }
        let since = t
            .renewed_at
            .map_or(Duration::MAX, |at| now.saturating_duration_since(at));
        if since >= window {
            return Err(Fenced::Stale { since, window });
        }
        Ok(())
    }

    /// The bind's deadline on tokio's clock (for timeouts and the retry loop).
    pub fn deadline(&self) -> Instant {
        let left = self
            .deadline
            .saturating_duration_since(self.fence.clock.now());
        Instant::now() + left
    }

    /// The term admitted under (`None` without an election).
    pub fn term(&self) -> Option<u64> {
        self.term
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

/// This replica's base URL for the others: `given` (`HOST[:PORT]`, the port defaulting to
/// `port`), else `pod_ip` with `port`, else `bind` with `port` when it is a specific address;
/// `None` when nothing says where this replica can be reached.
pub(crate) fn advertise_url(
    given: &str,
    pod_ip: Option<&str>,
    bind: std::net::IpAddr,
    port: u16,
    tls: bool,
) -> Option<String> {
    let (host, port) = if !given.is_empty() {
        let (host, p) = crate::config::split_host_port(given).ok()?;
        (host, p.unwrap_or(port))
    } else if let Some(ip) = pod_ip.map(str::trim).filter(|ip| !ip.is_empty()) {
        (ip.to_string(), port)
    } else if !bind.is_unspecified() {
        (bind.to_string(), port)
    } else {
        return None;
    };
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    let scheme = if tls { "https" } else { "http" };
    Some(format!("{scheme}://{host}:{port}"))
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
        self.fence = Fence::elected(self.fence.identity.clone(), clock, self.timing);
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
        &self.fence.identity
    }

    /// Writes name the candidate as their field manager (`?fieldManager=<identity>`, cut to
    /// the API's 128 bytes), so an audit log — and a test's fault filter — tells the replicas
    /// apart.
    fn post_params(&self) -> PostParams {
        let mut manager = self.fence.identity.clone();
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
        let clock = self.fence.clock.clone();
        let me = self.fence.identity.clone();
        // Start of the last round that renewed (or acquired) the lease, on our clock.
        let mut renewed_at: Option<Instant> = None;
        let mut seen: Option<Observation> = None;
        // Changes of the Lease, as a watch sees them (a hint to look again, never a decision).
        let lease_changed = Arc::new(tokio::sync::Notify::new());
        let lease_watch = tokio::spawn(watch_lease(
            self.api.clone(),
            self.name.clone(),
            lease_changed.clone(),
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
        lease_watch.abort();
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
        let clock = &self.fence.clock;
        let action = decide(
            clock.now(),
            current.as_ref(),
            seen,
            &self.fence.identity,
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
                        holder_identity: Some(self.fence.identity.clone()),
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
                spec.holder_identity = Some(self.fence.identity.clone());
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
        let me = self.fence.identity.clone();
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
            spec.renew_time = Some(MicroTime(self.fence.clock.wall()));
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

/// Pings `changed` on every change of Lease `name` (a watch; errors are retried with backoff).
async fn watch_lease(api: Api<Lease>, name: String, changed: Arc<tokio::sync::Notify>) {
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    use kube::runtime::watcher;
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher::watcher(api, config).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        if event.is_ok() {
            changed.notify_one();
        }
    }
}

/// Leader election wired to an extender: the serving gate and the ledger rebuild.
#[derive(Debug)]
pub(crate) struct Election {
    leadership: Leadership,
    resign: Trigger,
    gate: JoinHandle<()>,
}

impl Election {
    /// Starts competing for the `[extender]` Lease, driving the state's [`Fence`] and
    /// publishing `address` (this replica's base URL) while leading. Takes over `watches`
    /// (the running [`super::sync`] tasks): they keep the ledger warm while following and
    /// are restarted (a fresh list) whenever this replica becomes leader. `shutdown` closes
    /// the gate and stops the watches; the lease itself is released by [`Election::resign`].
    pub fn start(
        state: Arc<ExtenderState>,
        watches: Vec<JoinHandle<()>>,
        address: Option<String>,
        shutdown: Shutdown,
    ) -> Result<Election, TimingError> {
        let cfg = state.config();
        let timing = LeaseTiming::from_config(cfg)?;
        let (resign, resign_handle) = shutdown::channel();
        let fence = state.fence().clone();
        tracing::info!(identity = %fence.identity(), lease = %format!("{}/{}", cfg.lease_namespace, cfg.lease_name), address = ?address, "leader election on");
        let leadership = LeaderElector::new(
            state.client().clone(),
            &cfg.lease_namespace,
            &cfg.lease_name,
            fence.identity().to_string(),
            timing,
        )
        .with_fence(fence)
        .advertise(address)
        .spawn(resign_handle);
        state.set_serving(false);
        let gate = tokio::spawn(gate(state, leadership.subscribe(), watches, shutdown));
        Ok(Election {
            leadership,
            resign,
            gate,
        })
    }

    /// Stops competing and releases the lease if held. Call after the HTTP server has
    /// drained, so no bind of this replica is still running.
    pub(crate) async fn resign(self) {
        self.resign.trigger();
        self.leadership.join().await;
        let _ = self.gate.await;
    }
}

/// Follows the leading flag: serves locally after a fresh list, stops at once.
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
            // Reservations found on pods count a full settle window from this term's start.
            state.cache().restart_found_clocks();
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
            tracing::info!("not leading: the scheduling verbs go to the leader");
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

    fn follow(holder: &str) -> Action {
        Action::Follow {
            holder: holder.into(),
            address: None,
        }
    }

    #[test]
    fn missing_lease_is_created() {
        let t0 = Instant::now();
        assert_eq!(decide(t0, None, &mut None, "me", D), Action::Create);
    }

    #[test]
    fn free_lease_is_acquired() {
        let t0 = Instant::now();
        let mut seen = None;
        let free = lease(None, Some(0), Some(15));
        assert_eq!(decide(t0, Some(&free), &mut seen, "me", D), Action::Acquire);
        let empty = lease(Some(""), Some(0), Some(15));
        assert_eq!(
            decide(t0, Some(&empty), &mut seen, "me", D),
            Action::Acquire
        );
        let no_spec = Lease::default();
        assert_eq!(
            decide(t0, Some(&no_spec), &mut seen, "me", D),
            Action::Acquire
        );
    }

    #[test]
    fn own_lease_is_renewed_whatever_its_times_say() {
        let t0 = Instant::now();
        let old = lease(Some("me"), Some(-100_000), Some(15));
        assert_eq!(decide(t0, Some(&old), &mut None, "me", D), Action::Renew);
    }

    #[test]
    fn a_foreign_lease_expires_by_local_time_since_its_record_last_changed() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut seen = None;
        let l = lease(Some("other"), Some(0), Some(15));
        // First sight counts from now, however old its renewTime looks.
        assert_eq!(decide(t0, Some(&l), &mut seen, "me", D), follow("other"));
        assert_eq!(
            decide(t0 + s(15), Some(&l), &mut seen, "me", D),
            follow("other")
        );
        assert_eq!(
            decide(t0 + s(16), Some(&l), &mut seen, "me", D),
            Action::Acquire
        );
        // A renewal (any change of the record) restarts the count.
        let mut seen = None;
        assert_eq!(decide(t0, Some(&l), &mut seen, "me", D), follow("other"));
        let renewed = lease(Some("other"), Some(2), Some(15));
        assert_eq!(
            decide(t0 + s(10), Some(&renewed), &mut seen, "me", D),
            follow("other")
        );
        assert_eq!(
            decide(t0 + s(24), Some(&renewed), &mut seen, "me", D),
            follow("other")
        );
        assert_eq!(
            decide(t0 + s(26), Some(&renewed), &mut seen, "me", D),
            Action::Acquire
        );
    }

    #[test]
    fn renew_times_far_in_the_past_or_future_do_not_matter() {
        // A holder whose clock runs 20 s behind (or a candidate 20 s ahead) writes renewTimes
        // that look expired to a wall-clock comparison; it renews every 2 s, so it keeps it.
        let t0 = Instant::now();
        let mut seen = None;
        for round in 0..20i64 {
            let l = lease(Some("slow-clock"), Some(round * 2 - 20), Some(15));
            let now = t0 + Duration::from_secs(u64::try_from(round * 2).unwrap_or(0));
            assert_eq!(
                decide(now, Some(&l), &mut seen, "me", D),
                follow("slow-clock"),
                "round {round}"
            );
        }
    }

    #[test]
    fn the_default_duration_applies_when_the_lease_has_none_and_the_address_is_read() {
        let t0 = Instant::now();
        let mut seen = None;
        let mut l = lease(Some("other"), None, Some(-5));
        l.metadata.annotations = Some(
            [(
                ANN_LEADER_ADDRESS.to_string(),
                "http://10.0.0.7:12345".to_string(),
            )]
            .into(),
        );
        assert_eq!(
            decide(t0, Some(&l), &mut seen, "me", D),
            Action::Follow {
                holder: "other".into(),
                address: Some("http://10.0.0.7:12345".into())
            }
        );
        assert!(matches!(
            decide(t0 + Duration::from_secs(14), Some(&l), &mut seen, "me", D),
            Action::Follow { .. }
        ));
        assert_eq!(
            decide(t0 + Duration::from_secs(16), Some(&l), &mut seen, "me", D),
            Action::Acquire
        );
    }

    fn elected(clock: Arc<AdjustableClock>) -> Arc<Fence> {
        let timing = LeaseTiming::new(
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Fence::elected("me".into(), clock, timing)
    }

    #[tokio::test]
    async fn the_fence_admits_only_a_leader_and_closes_when_the_term_ends() {
        let clock = AdjustableClock::new();
        let fence = elected(clock.clone());
        let t = Duration::from_secs(4);
        assert_eq!(fence.admit(t).err(), Some(Fenced::NotLeader));
        assert!(
            fence.renewed(clock.now()),
            "the first renewal starts term 1"
        );
        let ticket = fence.admit(t).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ticket.term(), Some(1));
        assert_eq!(ticket.check(), Ok(()));
        assert!(!fence.renewed(clock.now()), "a renewal continues the term");
        assert_eq!(ticket.check(), Ok(()));
        // Lost and regained: a new term; the old ticket stays fenced.
        fence.lost(KnownLeader::Unknown);
        assert_eq!(ticket.check(), Err(Fenced::TermEnded { admitted: 1 }));
        assert!(fence.renewed(clock.now()));
        assert_eq!(ticket.check(), Err(Fenced::TermEnded { admitted: 1 }));
        assert_eq!(fence.admit(t).map(|t| t.term()), Ok(Some(2)));
    }

    #[tokio::test]
    async fn a_paused_leader_finds_its_write_window_closed() {
        let clock = AdjustableClock::new();
        let fence = elected(clock.clone());
        fence.renewed(clock.now());
        let ticket = fence
            .admit(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
        // 9 s without a renewal: still inside the window (lease 15 − margin 5 = 10 s).
        clock.advance(Duration::from_secs(9));
        assert_eq!(ticket.check(), Ok(()));
        // The process was stopped for a while: the window is closed although the election
        // task has not run yet to notice.
        clock.advance(Duration::from_secs(20));
        assert!(matches!(ticket.check(), Err(Fenced::Stale { .. })));
        assert!(fence.is_leading(), "the election has not run yet");
    }

    #[tokio::test]
    async fn the_deadline_counts_from_admission() {
        let clock = AdjustableClock::new();
        let fence = Fence::unelected("solo".into(), clock.clone());
        let ticket = fence
            .admit(Duration::from_secs(4))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ticket.term(), None);
        clock.advance(Duration::from_secs(3));
        assert_eq!(ticket.check(), Ok(()));
        clock.advance(Duration::from_secs(2));
        assert_eq!(ticket.check(), Err(Fenced::DeadlineExceeded));
        assert!(fence.is_leading());
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
        let t = LeaseTiming::new(s(15), s(10), s(2)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((t.margin(), t.write_window()), (s(5), s(10)));
    }

    #[test]
    fn the_advertised_url_comes_from_the_flag_then_pod_ip_then_a_specific_bind_address() {
        let any: std::net::IpAddr = [0, 0, 0, 0].into();
        let lo: std::net::IpAddr = [127, 0, 0, 1].into();
        let url = |g: &str, ip: Option<&str>, b, tls| advertise_url(g, ip, b, 12345, tls);
        assert_eq!(
            url("10.0.0.9:8443", Some("10.1.1.1"), any, true).as_deref(),
            Some("https://10.0.0.9:8443")
        );
        assert_eq!(
            url("cp-2", None, any, false).as_deref(),
            Some("http://cp-2:12345")
        );
        assert_eq!(
            url("", Some("fd00::5"), any, false).as_deref(),
            Some("http://[fd00::5]:12345")
        );
        assert_eq!(
            url("", None, lo, false).as_deref(),
            Some("http://127.0.0.1:12345")
        );
        assert_eq!(url("", Some(" "), any, false), None);
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

    #[test]
    fn a_skewed_wall_clock_reads_off_by_its_offset() {
        let clock = AdjustableClock::new();
        clock.set_wall_offset(SignedDuration::from_secs(-20));
        let diff = Timestamp::now().as_second() - clock.wall().as_second();
        assert!((19..=21).contains(&diff), "{diff}");
    }
}
