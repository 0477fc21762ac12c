//! The lease rule, pure: the election's timings and their validation ([`LeaseTiming`]), what
//! a candidate does with the Lease it just read ([`decide`]: expiry by LOCAL time since the
//! record last changed, client-go's rule), and the record it remembers ([`Observation`]).
//!
//! Not here: the reads and writes of the Lease (`elector`), the fence of binds (`fence`).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use tokio::time::Instant;

use crate::config::ExtenderConfig;

/// Lease annotation holding the leader's base URL (`http://10.0.0.7:12345`), written by the
/// holder on every renewal; standbys forward the scheduling verbs there.
pub(crate) const ANN_LEADER_ADDRESS: &str = "gpushare.io/leader-address";

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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::jiff::Timestamp;

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
    fn micro_time_is_written_with_microseconds() {
        let t = MicroTime(ts(0));
        let json = serde_json::to_string(&t).unwrap_or_default();
        assert_eq!(json, "\"2023-11-14T22:13:20.000000Z\"");
    }
}
