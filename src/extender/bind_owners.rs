//! The owners of binds still settling: one [`Ticket`] per pod UID ([`BindOwners`]) with the
//! [`Outcome`] its owner has found out so far. The state holds them; the bind (`bind`) writes
//! them. A module of its own below both, so the state does not reach into the bind.
//!
//! Not here: the binds themselves and the tasks that settle them (`bind`).

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

/// What the owner of a bind has found out so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Still trying.
    Running,
    /// Bound to the node (the message for the scheduler).
    Bound(String),
    /// Certainly not bound by us; the reservation is released.
    Failed(String),
    /// The budget ran out with the outcome unknown; the owner keeps settling it.
    Unknown(String),
}

impl Outcome {
    pub(super) fn is_final(&self) -> bool {
        matches!(self, Outcome::Bound(_) | Outcome::Failed(_))
    }
}

/// One live owner, as a retried bind finds it.
#[derive(Clone, Debug)]
pub(super) struct Ticket {
    pub(super) node: String,
    pub(super) token: u64,
    pub(super) outcome: watch::Receiver<Outcome>,
}

/// The owners of reservations still settling, by pod UID.
#[derive(Debug, Default)]
pub struct BindOwners {
    tickets: Mutex<HashMap<String, Ticket>>,
}

impl BindOwners {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ticket>> {
        self.tickets.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn get(&self, uid: &str) -> Option<Ticket> {
        self.lock().get(uid).cloned()
    }

    pub(super) fn remove(&self, uid: &str, token: u64) {
        let mut t = self.lock();
        if t.get(uid).is_some_and(|x| x.token == token) {
            t.remove(uid);
        }
    }

    /// How many reservations are still owned by a running task.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no bind is settling.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
