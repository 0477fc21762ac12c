//! Leader election over a `coordination.k8s.io/v1` Lease, and the fence that keeps a deposed
//! leader's binds from writing.
//!
//! The protocol is the one client-go's `leaderelection` package speaks, so `kubectl get lease`
//! reads the same: the holder writes its identity, `acquireTime`, `renewTime` (RFC 3339 with
//! microseconds) and `leaseDurationSeconds`; every write is a `PUT` carrying the
//! `resourceVersion` that was read (a create for a missing lease), so two candidates racing
//! for a free lease cannot both win: the loser gets 409 and re-reads. The holder also
//! publishes where it serves, in the `gpushare.io/leader-address` annotation, so standbys can
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
//!
//! Layout: `clock` (the time seam), `rule` (the lease rule, pure), `fence` (the bind fence),
//! `elector` (the Lease rounds and their task); this module wires them to the extender.

mod clock;
mod elector;
mod fence;
mod rule;

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub(crate) use clock::SystemClock;
pub use clock::{AdjustableClock, Clock};
pub use elector::{LeaderElector, Leadership, identity};
pub use fence::{Fence, Fenced, KnownLeader, Ticket};
pub use rule::{Action, LeaseTiming, Observation, TimingError, decide};

use super::state::ExtenderState;
use crate::shutdown::{self, Shutdown, Trigger};

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
}
