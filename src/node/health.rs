//! Per-GPU health from XID events, with recovery: which XIDs matter, which are fatal, and when
//! a GPU with a transient error is healthy again.
//!
//! Pure state machine: the caller passes the time in (`tokio::time::Instant`), so tests drive
//! it without waiting. The node agent's health task feeds it backend events, wakes at
//! [`HealthTracker::next_recovery`] and publishes a [`HealthView`] to every role that serves
//! the GPUs.
//!
//! Rules: application XIDs (13, 31, 43, 45, 68, 109: a program's own fault) are ignored; fatal
//! XIDs (48 double-bit ECC, 79 fallen off the bus, 95 uncontained ECC) keep the GPU down for
//! good (across restarts when the agent keeps a record of them, [`super::fatal_xids`]); any other XID marks the GPU down until `recovery` passes without a new
//! error. A lost GPU stays down until the inventory lists it again. An XID without a UUID
//! (NVML could not name the device) applies to every GPU (as upstream); an XID the kernel
//! attributed to an address that is none of ours ([`HealthEvent::Unattributed`]: NVSwitch /
//! NVLink XIDs at `PCI:0000:00:00`) marks none.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::gpu::HealthEvent;

/// XIDs caused by the application, not the GPU: ignored.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];
/// XIDs after which the GPU does not come back without a reset.
pub const FATAL_XIDS: [u64; 3] = [48, 79, 95];

/// What an XID means for the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidClass {
    /// The application's fault; the GPU is fine.
    Application,
    /// Down, recovers after a quiet period.
    Transient,
    /// Down for good.
    Fatal,
}

/// Classifies an XID.
pub fn classify_xid(xid: u64) -> XidClass {
    if APPLICATION_XIDS.contains(&xid) {
        XidClass::Application
    } else if FATAL_XIDS.contains(&xid) {
        XidClass::Fatal
    } else {
        XidClass::Transient
    }
}

/// Why a GPU is down, as the health view names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    Xid(u64),
    Lost,
}

impl Cause {
    /// A short name that is a valid label value: `xid-79`, `gpu-lost`.
    fn label(self) -> String {
        match self {
            Cause::Xid(xid) => format!("xid-{xid}"),
            Cause::Lost => "gpu-lost".to_string(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Healthy,
    /// Down; recovers at `until` (`None`: never by time).
    Down {
        until: Option<Instant>,
        lost: bool,
        reason: String,
        cause: Cause,
    },
}

/// A GPU whose health changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthChange {
    /// The GPU.
    pub uuid: String,
    /// Its new health.
    pub healthy: bool,
    /// Why (the XID, loss, or recovery).
    pub reason: String,
}

/// The health of every served GPU as the node agent publishes it (a `tokio::sync::watch`):
/// one view for every role of the process: whether each GPU is healthy, and why not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthView {
    /// Healthy or not, by UUID.
    pub healthy: BTreeMap<String, bool>,
    /// Why each GPU that is down is down, by UUID, as a label value: `xid-<n>` (the XID that
    /// took it down; a fatal one is kept over later transient ones) or `gpu-lost`.
    pub reasons: BTreeMap<String, String>,
    /// XIDs at a PCI address that is none of the served GPUs (NVSwitch/NVLink), since start.
    pub unattributed_xids: u64,
}

impl HealthView {
    /// The view of `tracker`.
    pub fn of(tracker: &HealthTracker, unattributed_xids: u64) -> HealthView {
        HealthView {
            healthy: tracker
                .gpus
                .iter()
                .map(|(u, s)| (u.clone(), matches!(s, State::Healthy)))
                .collect(),
            reasons: tracker
                .gpus
                .iter()
                .filter_map(|(u, s)| match s {
                    State::Down { cause, .. } => Some((u.clone(), cause.label())),
                    State::Healthy => None,
                })
                .collect(),
            unattributed_xids,
        }
    }

    /// Whether `uuid` is healthy (unknown GPUs are not).
    pub fn is_healthy(&self, uuid: &str) -> bool {
        self.healthy.get(uuid).copied().unwrap_or(false)
    }

    /// Why `uuid` is down (`xid-79`, `gpu-lost`); `None` when it is healthy or unknown.
    pub fn reason(&self, uuid: &str) -> Option<&str> {
        self.reasons.get(uuid).map(String::as_str)
    }

    /// How many GPUs are down.
    pub fn unhealthy_count(&self) -> usize {
        self.healthy.values().filter(|h| !**h).count()
    }
}

/// Health of every served GPU.
#[derive(Clone, Debug)]
pub struct HealthTracker {
    recovery: Duration,
    gpus: BTreeMap<String, State>,
}

impl HealthTracker {
    /// All of `uuids` healthy; transient errors recover after `recovery`.
    pub fn new(uuids: impl IntoIterator<Item = String>, recovery: Duration) -> Self {
        HealthTracker {
            recovery,
            gpus: uuids.into_iter().map(|u| (u, State::Healthy)).collect(),
        }
    }

    /// Whether `uuid` is healthy (unknown GPUs are not).
    pub fn is_healthy(&self, uuid: &str) -> bool {
        matches!(self.gpus.get(uuid), Some(State::Healthy))
    }

    /// The UUIDs that are down.
    pub fn unhealthy(&self) -> Vec<String> {
        self.gpus
            .iter()
            .filter(|(_, s)| !matches!(s, State::Healthy))
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Applies a backend event at `now`; returns the GPUs whose health changed.
    pub fn apply(&mut self, event: &HealthEvent, now: Instant) -> Vec<HealthChange> {
        let (targets, until, lost, cause) = match event {
            HealthEvent::Xid { uuid, xid } => {
                let until = match classify_xid(*xid) {
                    XidClass::Application => return Vec::new(),
                    XidClass::Fatal => None,
                    XidClass::Transient => Some(now + self.recovery),
                };
                let targets: Vec<String> = match uuid {
                    Some(u) if self.gpus.contains_key(u) => vec![u.clone()],
                    Some(_) => return Vec::new(),
                    None => self.gpus.keys().cloned().collect(),
                };
                (targets, until, false, Cause::Xid(*xid))
            }
            HealthEvent::Unattributed { .. } => return Vec::new(),
            HealthEvent::Lost { uuid } => {
                if !self.gpus.contains_key(uuid) {
                    return Vec::new();
                }
                (
                    vec![uuid.clone()],
                    Some(now + self.recovery),
                    true,
                    Cause::Lost,
                )
            }
        };
        let reason = match cause {
            Cause::Xid(xid) => format!("XID {xid}"),
            Cause::Lost => "GPU lost".to_string(),
        };
        let mut changes = Vec::new();
        for uuid in targets {
            let Some(state) = self.gpus.get_mut(&uuid) else {
                continue;
            };
            let was_healthy = matches!(state, State::Healthy);
            let new_lost = lost || matches!(state, State::Down { lost: true, .. });
            // A fatal error stays fatal, and stays the reason; a new transient error pushes
            // the recovery out.
            let (new_until, new_reason, new_cause) = match state {
                State::Down {
                    until: None,
                    reason,
                    cause,
                    ..
                } if until.is_some() => (None, reason.clone(), *cause),
                _ => (until, reason.clone(), cause),
            };
            *state = State::Down {
                until: new_until,
                lost: new_lost,
                reason: new_reason,
                cause: new_cause,
            };
            if was_healthy {
                changes.push(HealthChange {
                    uuid,
                    healthy: false,
                    reason: reason.clone(),
                });
            }
        }
        changes
    }

    /// Recovers the GPUs whose quiet period ended by `now`. A lost GPU recovers only when
    /// `present(uuid)` says the inventory lists it again (else it waits another period).
    pub fn recover(&mut self, now: Instant, present: impl Fn(&str) -> bool) -> Vec<HealthChange> {
        let mut changes = Vec::new();
        for (uuid, state) in self.gpus.iter_mut() {
            let State::Down {
                until: Some(until),
                lost,
                reason,
                ..
            } = state
            else {
                continue;
            };
            if *until > now {
                continue;
            }
            if *lost && !present(uuid) {
                *until = now + self.recovery;
                continue;
            }
            let reason = format!("no new errors for {:?} after {reason}", self.recovery);
            *state = State::Healthy;
            changes.push(HealthChange {
                uuid: uuid.clone(),
                healthy: true,
                reason,
            });
        }
        changes
    }

    /// The GPUs down for good, with the fatal Xid that took each down.
    pub fn fatal_xids(&self) -> BTreeMap<String, u64> {
        self.gpus
            .iter()
            .filter_map(|(u, s)| match s {
                State::Down {
                    until: None,
                    cause: Cause::Xid(xid),
                    ..
                } => Some((u.clone(), *xid)),
                _ => None,
            })
            .collect()
    }

    /// When the next GPU may recover.
    pub fn next_recovery(&self) -> Option<Instant> {
        self.gpus
            .values()
            .filter_map(|s| match s {
                State::Down { until, .. } => *until,
                State::Healthy => None,
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> HealthTracker {
        HealthTracker::new(
            ["GPU-a".to_string(), "GPU-b".to_string()],
            Duration::from_secs(300),
        )
    }

    fn xid(uuid: Option<&str>, xid: u64) -> HealthEvent {
        HealthEvent::Xid {
            uuid: uuid.map(str::to_string),
            xid,
        }
    }

    #[test]
    fn application_xids_are_ignored() {
        let mut t = tracker();
        let now = Instant::now();
        for x in APPLICATION_XIDS {
            assert!(t.apply(&xid(Some("GPU-a"), x), now).is_empty());
        }
        assert!(t.is_healthy("GPU-a"));
    }

    #[test]
    fn transient_xids_recover_after_a_quiet_period() {
        let mut t = tracker();
        let now = Instant::now();
        let changes = t.apply(&xid(Some("GPU-a"), 62), now);
        assert_eq!(changes.len(), 1);
        assert!(!changes[0].healthy);
        assert!(!t.is_healthy("GPU-a") && t.is_healthy("GPU-b"));
        // A second error later pushes the recovery out.
        t.apply(&xid(Some("GPU-a"), 62), now + Duration::from_secs(200));
        assert!(
            t.recover(now + Duration::from_secs(300), |_| true)
                .is_empty()
        );
        assert_eq!(t.next_recovery(), Some(now + Duration::from_secs(500)));
        let back = t.recover(now + Duration::from_secs(500), |_| true);
        assert_eq!(back.len(), 1);
        assert!(back[0].healthy);
        assert!(t.is_healthy("GPU-a"));
        assert_eq!(t.next_recovery(), None);
    }

    #[test]
    fn fatal_xids_stay_down() {
        let mut t = tracker();
        let now = Instant::now();
        t.apply(&xid(Some("GPU-b"), 79), now);
        // A later transient error does not make it recoverable.
        t.apply(&xid(Some("GPU-b"), 62), now);
        assert_eq!(t.next_recovery(), None);
        assert!(
            t.recover(now + Duration::from_secs(100_000), |_| true)
                .is_empty()
        );
        assert_eq!(t.unhealthy(), vec!["GPU-b".to_string()]);
        // The view names the fatal XID, not the later transient one.
        let view = HealthView::of(&t, 0);
        assert_eq!(view.reason("GPU-b"), Some("xid-79"));
        assert_eq!(view.reason("GPU-a"), None);
    }

    #[test]
    fn xid_without_uuid_hits_every_gpu_and_unknown_uuids_nothing() {
        let mut t = tracker();
        let now = Instant::now();
        assert!(t.apply(&xid(Some("GPU-zzz"), 79), now).is_empty());
        assert_eq!(t.apply(&xid(None, 62), now).len(), 2);
    }

    #[test]
    fn unattributed_xids_mark_no_gpu() {
        let mut t = tracker();
        let now = Instant::now();
        let nvlink = HealthEvent::Unattributed {
            pci: "0000:00:00".to_string(),
            xid: 149,
        };
        assert!(t.apply(&nvlink, now).is_empty());
        assert!(t.unhealthy().is_empty());
    }

    #[test]
    fn lost_gpus_wait_for_the_inventory() {
        let mut t = tracker();
        let now = Instant::now();
        t.apply(
            &HealthEvent::Lost {
                uuid: "GPU-a".to_string(),
            },
            now,
        );
        assert_eq!(HealthView::of(&t, 0).reason("GPU-a"), Some("gpu-lost"));
        let later = now + Duration::from_secs(300);
        assert!(t.recover(later, |_| false).is_empty());
        assert!(!t.is_healthy("GPU-a"));
        let back = t.recover(later + Duration::from_secs(300), |u| u == "GPU-a");
        assert_eq!(back.len(), 1);
    }
}
