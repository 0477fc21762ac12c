//! What the device plugin's reconciler has reported already (each mismatch and split once),
//! kept in the shared [`Plugin`](super::Plugin) between passes. A module of its own so that
//! the shared state does not reach into the reconciler that uses it.
//!
//! Not here: the reconciler (`reconcile`).

use std::collections::HashSet;

/// (namespace, pod, container) kubelet recorded for a device ID.
pub(crate) type Holder = (String, String, String);

/// What the reconciler has reported already (each mismatch and split once).
#[derive(Debug, Default)]
pub(crate) struct Reported {
    pub(super) holders: HashSet<Holder>,
    pub(super) splits: HashSet<String>,
}
