//! The bind fence: the leadership term binds are admitted under ([`Fence::admit`] gives a
//! [`Ticket`]), checked before every API write of a bind ([`Ticket::check`]: the term still
//! current, the bind's deadline not passed, the last renewal inside the write window), and
//! who leads as this replica knows it ([`KnownLeader`]).
//!
//! Not here: how terms begin and end (the `elector` drives [`Fence::renewed`] and
//! [`Fence::lost`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::clock::Clock;
use super::rule::LeaseTiming;

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

#[cfg(test)]
mod tests {
    use super::super::clock::AdjustableClock;
    use super::*;

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
}
