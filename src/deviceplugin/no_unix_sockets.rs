//! Stand-ins for [`registration`](super) and [`reconcile`](super) where the platform has no
//! unix sockets (Windows): kubelet's device-plugin and PodResources APIs are unix sockets, so
//! there the device plugin cannot serve. The dispatcher refuses the role before it gets here
//! (`buildinfo::ensure_server_platform`); these only keep the build whole for the kubectl
//! plugin (inspect, doctor). They do not emulate anything.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::task::JoinHandle;

use super::Plugin;
use crate::shutdown::Shutdown;

/// Always an error: no unix socket to serve the device-plugin API on.
pub(crate) async fn serve(_plugin: Arc<Plugin>, _stop: Shutdown) -> anyhow::Result<JoinHandle<()>> {
    anyhow::bail!(
        "the device plugin needs unix sockets (kubelet's device-plugin API); this platform has none"
    )
}

/// Nothing to reconcile without the PodResources socket.
pub(crate) async fn run(_plugin: Arc<Plugin>, _stop: Shutdown) {}

/// Always an error: no PodResources socket to ask.
pub(crate) async fn list_assignments(
    _socket: &std::path::Path,
) -> anyhow::Result<HashMap<String, (String, String, String)>> {
    anyhow::bail!("kubelet's PodResources API is a unix socket; this platform has none")
}

/// Always an error, as [`list_assignments`].
pub(crate) async fn reconcile_once(_plugin: &Arc<Plugin>) -> anyhow::Result<usize> {
    anyhow::bail!("kubelet's PodResources API is a unix socket; this platform has none")
}

/// Nothing to write: the device plugin never answers an Allocate here.
pub(crate) fn annotations_after(
    _plugin: &Plugin,
    _uid: &str,
    _added: std::collections::BTreeSet<String>,
) -> Option<std::collections::BTreeMap<String, String>> {
    None
}
