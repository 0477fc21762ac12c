//! The clock seam of the election and the fence: local monotonic time (lease expiry, the
//! fence's windows, deadlines) and wall-clock time (only written into the Lease), with a
//! clock for tests whose wall clock is skewed and whose monotonic clock jumps.
//!
//! Not here: what the times are compared with (`rule`, `fence`).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skewed_wall_clock_reads_off_by_its_offset() {
        let clock = AdjustableClock::new();
        clock.set_wall_offset(SignedDuration::from_secs(-20));
        let diff = Timestamp::now().as_second() - clock.wall().as_second();
        assert!((19..=21).contains(&diff), "{diff}");
    }
}
