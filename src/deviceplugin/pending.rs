//! The state of the background writer of Allocate's answers ([`Writeback`]): the journal, the
//! newest unwritten answers of each pod, the pods whose write runs, and a count the tests and
//! the handle wait on. The writing itself (which needs the plugin) is in
//! [`super::writeback`]; this module names no plugin, so the plugin's state can hold it.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tokio::sync::watch;

use super::journal::{Journal, JournalError, PendingWrite};

/// Why [`Writeback::submit`] did not take an answer.
#[derive(Debug, thiserror::Error)]
pub enum NotAccepted {
    /// No journal directory could be used at start.
    #[error("no usable device-plugin state directory: {0}")]
    NoJournal(String),
    /// The journal refused the record.
    #[error(transparent)]
    Journal(#[from] JournalError),
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) next_generation: u64,
    /// The newest unwritten record of each pod, by UID.
    pub(super) pending: HashMap<String, PendingWrite>,
    /// Pods whose write task runs.
    pub(super) running: HashSet<String>,
}

/// The background writer of Allocate's answers.
#[derive(Debug)]
pub(crate) struct Writeback {
    pub(super) journal: Result<Journal, JournalError>,
    state: Mutex<State>,
    /// How many pods have writes not landed yet.
    pending_tx: watch::Sender<usize>,
}

impl Writeback {
    /// A writer over the journal in `dir`; without a usable directory it accepts nothing (the
    /// reason is kept for the log).
    pub fn open(dir: &std::path::Path) -> Writeback {
        let journal = Journal::open(dir);
        if let Err(e) = &journal {
            tracing::warn!(
                error = %e,
                "no device-plugin state directory: Allocate writes each answer to the API before it returns it (set device_plugin.state_dir to a writable directory on tmpfs)"
            );
        }
        Writeback {
            journal,
            state: Mutex::default(),
            pending_tx: watch::channel(0).0,
        }
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn publish_pending(&self, state: &State) {
        self.pending_tx.send_replace(state.pending.len());
    }

    /// How many pods have answers not written to the API yet.
    pub fn pending(&self) -> usize {
        *self.pending_tx.borrow()
    }

    /// Resolves once every answer so far is written (or its pod gone).
    pub async fn settled(&self) {
        let mut rx = self.pending_tx.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Resolves once every answer so far for pod `namespace/name` is written (or it is gone).
    pub async fn settled_pod(&self, namespace: &str, name: &str) {
        let mut rx = self.pending_tx.subscribe();
        loop {
            let waiting = self
                .state()
                .pending
                .values()
                .any(|w| w.namespace == namespace && w.name == name);
            if !waiting || rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// The write of `uid` at `generation` is done (landed, or its pod gone): its journal
    /// record goes unless a newer answer replaced it; returns whether the pod is done.
    pub(super) fn finish(&self, uid: &str, generation: u64) -> bool {
        let mut state = self.state();
        if let Ok(journal) = &self.journal
            && let Err(e) = journal.clear(uid, generation)
        {
            tracing::warn!(error = %e, "could not clear a device-plugin journal record; its write is repeated at the next start");
        }
        let done = state
            .pending
            .get(uid)
            .is_none_or(|w| w.generation == generation);
        if done {
            state.pending.remove(uid);
            state.running.remove(uid);
            self.publish_pending(&state);
        }
        done
    }
}
