//! A fake kubelet for tests and `gpushare demo` — never for production.
//!
//! What it does, as kubelet does:
//! - serves the device-plugin `Registration` service (v1beta1) on
//!   `<root>/device-plugins/kubelet.sock`; on `Register` it checks the API version and the
//!   resource name, then (asynchronously, like kubelet) dials `<dir>/<endpoint>`, calls
//!   `GetDevicePluginOptions`, opens `ListAndWatch` with kubelet's 4 MiB receive limit and keeps
//!   the latest device list with health;
//! - allocates for a container like kubelet at container start ([`Kubelet::allocate_container`]:
//!   free healthy IDs, `GetPreferredAllocation` when offered, `Allocate`, `PreStartContainer`
//!   when required) and records the allocation (IDs are not reused until [`Kubelet::release_pod`]);
//! - serves PodResources v1 (`List`, `Get`, `GetAllocatableResources`) on
//!   `<root>/pod-resources/kubelet.sock` from the recorded allocations (pausable:
//!   [`Kubelet::pause_pod_resources`]);
//! - simulates a kubelet restart ([`Kubelet::restart`]): drops plugin connections, removes
//!   `kubelet.sock` and every other socket in the device-plugin dir, serves a fresh
//!   `kubelet.sock`.
//!
//! The parts: this module holds the kubelet itself (its sockets, state, restart and stop);
//! [`deviceplugin`] the device-plugin side (Registration, the plugin connection, the calls
//! kubelet makes at container start); [`podresources`] the PodResources v1 service.
//!
//! What it does not: checkpoint files, topology/NUMA alignment, CDI, the grace period before
//! devices of a vanished plugin turn unhealthy, or anything about pods beyond the allocation
//! records.

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, bail};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::transport::{Channel, Endpoint, Server, Uri};

use gpushare_core::wire;

pub mod deviceplugin;
pub mod podresources;

pub use deviceplugin::PluginInfo;
use deviceplugin::{PLUGIN_CALL_TIMEOUT, PluginState, serve_registration};
use podresources::serve_pod_resources;

/// How long the `wait_*` methods wait before they give up with an error.
pub const WAIT_DEADLINE: Duration = Duration::from_secs(30);
/// Longest unix socket path the kernel accepts (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// One container's recorded allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Resource name.
    pub resource: String,
    /// Device IDs given to the container.
    pub device_ids: Vec<String>,
}

/// The fake kubelet. Dropping it stops its servers (prefer [`Kubelet::stop`], which also
/// removes its sockets).
#[derive(Debug)]
pub struct Kubelet {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    device_plugin_dir: PathBuf,
    pod_resources_socket: PathBuf,
    state: Mutex<State>,
    /// Bumped on every state change; `wait_*` methods wake on it.
    changed: watch::Sender<u64>,
    registration_server: Mutex<Option<ServerHandle>>,
    pod_resources_server: Mutex<Option<ServerHandle>>,
}

#[derive(Debug, Default)]
struct State {
    plugins: HashMap<String, PluginState>,
    registrations: HashMap<String, usize>,
    allocations: Vec<Allocation>,
    next_generation: u64,
    /// PodResources answers `Unavailable` while set.
    pod_resources_paused: bool,
}

#[derive(Debug)]
struct ServerHandle {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ServerHandle {
    async fn shutdown(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

impl Kubelet {
    /// Serves Registration on `<root>/device-plugins/kubelet.sock` and PodResources v1 on
    /// `<root>/pod-resources/kubelet.sock` (directories created as needed).
    pub async fn start(root: &Path) -> anyhow::Result<Kubelet> {
        let device_plugin_dir = root.join("device-plugins");
        let pod_resources_dir = root.join("pod-resources");
        for dir in [&device_plugin_dir, &pod_resources_dir] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let pod_resources_socket = pod_resources_dir.join(wire::KUBELET_SOCKET);
        let (changed, _) = watch::channel(0);
        let inner = Arc::new(Inner {
            device_plugin_dir,
            pod_resources_socket,
            state: Mutex::new(State::default()),
            changed,
            registration_server: Mutex::new(None),
            pod_resources_server: Mutex::new(None),
        });
        let registration = serve_registration(&inner)?;
        *lock(&inner.registration_server) = Some(registration);
        let pod_resources = serve_pod_resources(&inner)?;
        *lock(&inner.pod_resources_server) = Some(pod_resources);
        Ok(Kubelet { inner })
    }

    /// `<root>/device-plugins`.
    pub fn device_plugin_dir(&self) -> PathBuf {
        self.inner.device_plugin_dir.clone()
    }

    /// `<root>/device-plugins/kubelet.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.inner.device_plugin_dir.join(wire::KUBELET_SOCKET)
    }

    /// `<root>/pod-resources/kubelet.sock`.
    pub fn pod_resources_socket(&self) -> PathBuf {
        self.inner.pod_resources_socket.clone()
    }

    /// Forgets the allocations of a pod (it terminated); its IDs become free again.
    pub fn release_pod(&self, namespace: &str, pod: &str) {
        self.inner
            .state()
            .allocations
            .retain(|a| !(a.namespace == namespace && a.pod == pod));
        self.inner.bump();
    }

    /// Every recorded allocation, in the order they were made.
    pub fn allocations(&self) -> Vec<Allocation> {
        self.inner.state().allocations.clone()
    }

    /// Simulates a kubelet restart: drops plugin connections, removes `kubelet.sock` and every
    /// other socket in the device-plugin dir (as kubelet does), then serves a fresh
    /// `kubelet.sock`. Plugins must notice and register again. Allocations are kept (kubelet
    /// keeps them in its checkpoint).
    pub async fn restart(&self) -> anyhow::Result<()> {
        let old = lock(&self.inner.registration_server).take();
        if let Some(server) = old {
            server.shutdown().await;
        }
        self.inner.drop_plugins();
        let entries = std::fs::read_dir(&self.inner.device_plugin_dir)
            .with_context(|| format!("reading {}", self.inner.device_plugin_dir.display()))?;
        for entry in entries.flatten() {
            let is_socket = entry.file_type().map(|t| t.is_socket()).unwrap_or(false);
            if is_socket {
                std::fs::remove_file(entry.path())
                    .with_context(|| format!("removing {}", entry.path().display()))?;
            }
        }
        let server = serve_registration(&self.inner)?;
        *lock(&self.inner.registration_server) = Some(server);
        self.inner.bump();
        Ok(())
    }

    /// Stops both servers and every plugin connection, and removes the kubelet's sockets.
    pub async fn stop(self) {
        let registration = lock(&self.inner.registration_server).take();
        let pod_resources = lock(&self.inner.pod_resources_server).take();
        for server in [registration, pod_resources].into_iter().flatten() {
            server.shutdown().await;
        }
        self.inner.drop_plugins();
        let _ = std::fs::remove_file(self.registration_socket());
        let _ = std::fs::remove_file(&self.inner.pod_resources_socket);
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        for server in [
            &self.inner.registration_server,
            &self.inner.pod_resources_server,
        ] {
            if let Some(server) = lock(server).take() {
                let _ = server.stop.send(());
                server.task.abort();
            }
        }
        self.inner.drop_plugins();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The fake kubelet's state stays consistent across a panicking test thread.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    fn drop_plugins(&self) {
        let plugins: Vec<PluginState> = self.state().plugins.drain().map(|(_, p)| p).collect();
        for plugin in plugins {
            plugin.task.abort();
        }
        self.bump();
    }

    /// Applies `f` to the plugin of `resource` if it is still registration `generation`.
    fn update(&self, resource: &str, generation: u64, f: impl FnOnce(&mut PluginState)) {
        {
            let mut state = self.state();
            match state.plugins.get_mut(resource) {
                Some(plugin) if plugin.generation == generation => f(plugin),
                _ => return,
            }
        }
        self.bump();
    }
}

fn check_socket_path(path: &Path) -> anyhow::Result<()> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        bail!(
            "unix socket path {} is {len} bytes, over the {MAX_SOCKET_PATH}-byte limit; use a \
             shorter directory",
            path.display()
        );
    }
    Ok(())
}

fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    check_socket_path(path)?;
    if path.exists() {
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("listening on {}", path.display()))
}

/// Serves `routes` on `listener` until the handle is stopped.
fn serve(listener: UnixListener, routes: Routes, what: &'static str) -> ServerHandle {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let result = Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(
                gpushare_kubelet_api::unix_server::incoming(listener),
                async {
                    let _ = stopped.await;
                },
            )
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "fake kubelet {what} server failed");
        }
    });
    ServerHandle { stop, task }
}

/// A gRPC channel over the unix socket at `path`.
pub async fn dial_unix(path: &Path) -> anyhow::Result<Channel> {
    check_socket_path(path)?;
    let path = path.to_path_buf();
    // The URI is required by tonic but unused: the connector always dials `path`.
    let channel = Endpoint::try_from("http://[::1]:1")?
        .connect_timeout(PLUGIN_CALL_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await?;
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_socket_paths_are_refused() {
        let long = PathBuf::from(format!("/tmp/{}/kubelet.sock", "x".repeat(120)));
        let err = check_socket_path(&long).expect_err("too long").to_string();
        assert!(err.contains("over the 107-byte limit"), "{err}");
        assert!(check_socket_path(Path::new("/tmp/k/kubelet.sock")).is_ok());
    }
}
