//! Serving a plugin socket and registering with kubelet, again and again: the GPU resource
//! (`aliyungpushare.sock`, `aliyun.com/gpu-mem`) and each device kind beside it (its own
//! socket and resource, [`super::kinds`]) go through the same loop, one per [`Endpoint`].
//!
//! A serving generation: remove a stale socket (`<dir>/aliyungpushare.sock` for the GPUs), listen on it, serve the
//! gRPC service, wait for the first list of this node's pods (kubelet calls Allocate at once
//! and fails the pod when Allocate fails), Register with `<dir>/kubelet.sock` (retrying every
//! 500 ms until kubelet answers). Then the socket inodes are polled every 250 ms: when kubelet.sock is recreated
//! (kubelet restarted) or our socket vanishes (kubelet removes plugin sockets when it
//! restarts), the generation is stopped — its ListAndWatch streams end — and a new one serves
//! and re-registers, well within a second. On stop the socket is removed.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tonic::transport::{Server, Uri};

use super::service::{Endpoint, EndpointService, plugin_options};
use crate::core::wire::{
    DEVICE_PLUGIN_API_VERSION, KUBELET_SOCKET, PLUGIN_SOCKET, RESOURCE_GPU_MEM,
};
use crate::kubelet_api::deviceplugin::RegisterRequest;
use crate::kubelet_api::deviceplugin::device_plugin_server::DevicePluginServer;
use crate::kubelet_api::deviceplugin::registration_client::RegistrationClient;
use crate::shutdown::{Shutdown, Trigger};

/// How often the socket inodes are checked.
const POLL: Duration = Duration::from_millis(250);
/// Pause between failed registrations.
const REGISTER_RETRY: Duration = Duration::from_millis(500);

fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

struct Generation {
    trigger: Trigger,
    server: JoinHandle<()>,
    socket_inode: Option<u64>,
}

impl Generation {
    fn bind<E: Endpoint>(plugin: &Arc<E>) -> anyhow::Result<Generation> {
        let path = Endpoint::socket_path(plugin.as_ref());
        let dir = &plugin.plugin().config.device_plugin_dir;
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("device plugin directory {}: {e}", dir.display()))?;
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::debug!(path = %path.display(), "removed a stale socket"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot remove the stale socket {}: {e}", path.display()),
        }
        let listener = UnixListener::bind(&path)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", path.display()))?;
        let socket_inode = inode(&path);
        let (trigger, stop) = crate::shutdown::channel();
        let service = DevicePluginServer::new(EndpointService {
            endpoint: plugin.clone(),
            stop: stop.clone(),
        });
        let server = tokio::spawn(async move {
            if let Err(e) = Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    crate::kubelet_api::unix_server::incoming(listener),
                    stop.wait(),
                )
                .await
            {
                tracing::warn!(error = %e, "device plugin gRPC server ended with an error");
            }
        });
        Ok(Generation {
            trigger,
            server,
            socket_inode,
        })
    }

    /// Stops serving; `drain` waits (up to 2 s) for open connections to finish.
    async fn stop<E: Endpoint>(self, plugin: &E, drain: bool) {
        self.trigger.trigger();
        if drain {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.server).await;
        }
        let path = Endpoint::socket_path(plugin);
        if inode(&path).is_some() && inode(&path) == self.socket_inode {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Registers `aliyun.com/gpu-mem` with kubelet over `<dir>/kubelet.sock`.
pub async fn register(device_plugin_dir: &Path) -> anyhow::Result<()> {
    register_resource(device_plugin_dir, PLUGIN_SOCKET, RESOURCE_GPU_MEM).await
}

/// Registers `resource`, served on `<dir>/<endpoint>`, with kubelet over `<dir>/kubelet.sock`.
pub async fn register_resource(
    device_plugin_dir: &Path,
    endpoint: &str,
    resource: &str,
) -> anyhow::Result<()> {
    let path = device_plugin_dir.join(KUBELET_SOCKET);
    let connect_to = path.clone();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = connect_to.clone();
            async move { UnixStream::connect(p).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach kubelet at {}: {e}", path.display()))?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: DEVICE_PLUGIN_API_VERSION.to_string(),
            endpoint: endpoint.to_string(),
            resource_name: resource.to_string(),
            options: Some(plugin_options()),
        })
        .await
        .map_err(|s| anyhow::anyhow!("kubelet refused the registration: {}", s.message()))?;
    Ok(())
}

/// Serves the first generation now (so a socket error fails the start) and supervises the
/// following ones until `stop`.
pub(crate) async fn serve<E: Endpoint>(
    plugin: Arc<E>,
    stop: Shutdown,
) -> anyhow::Result<JoinHandle<()>> {
    let first = Generation::bind(&plugin)?;
    Ok(tokio::spawn(supervise(plugin, stop, first)))
}

async fn supervise<E: Endpoint>(plugin: Arc<E>, stop: Shutdown, first: Generation) {
    let mut generation = first;
    let dir = plugin.plugin().config.device_plugin_dir.clone();
    let kubelet_socket = dir.join(KUBELET_SOCKET);
    let our_socket = Endpoint::socket_path(plugin.as_ref());
    let socket_name = plugin.socket_name();
    let resource = plugin.resource();
    loop {
        // kubelet calls Allocate as soon as we are registered, and turns a failed Allocate
        // into a Failed pod: register only once the pods of this node are known.
        if !plugin.plugin().pods.is_synced() {
            tracing::info!("waiting for the first list of this node's pods before registering");
            tokio::select! {
                _ = stop.clone().wait() => {
                    generation.stop(plugin.as_ref(), true).await;
                    return;
                }
                _ = plugin.plugin().pods.synced() => {}
            }
        }
        // Register (until kubelet answers, our socket goes away, or we stop).
        let mut failures = 0u32;
        let registered_inode = loop {
            if stop.is_triggered() {
                generation.stop(plugin.as_ref(), true).await;
                return;
            }
            if inode(&our_socket) != generation.socket_inode {
                break None;
            }
            let kubelet_inode = inode(&kubelet_socket);
            match register_resource(&dir, &socket_name, &resource).await {
                Ok(()) => {
                    plugin.set_registered(true);
                    tracing::info!(
                        resource = %resource,
                        socket = %our_socket.display(),
                        "registered with kubelet"
                    );
                    break kubelet_inode;
                }
                Err(e) => {
                    if failures.is_multiple_of(20) {
                        tracing::warn!(error = %e, "registration with kubelet failed; retrying");
                    }
                    failures += 1;
                    tokio::select! {
                        _ = stop.clone().wait() => {}
                        _ = tokio::time::sleep(REGISTER_RETRY) => {}
                    }
                }
            }
        };
        // Watch for a kubelet restart.
        if registered_inode.is_some() {
            loop {
                tokio::select! {
                    _ = stop.clone().wait() => {
                        plugin.set_registered(false);
                        generation.stop(plugin.as_ref(), true).await;
                        return;
                    }
                    _ = tokio::time::sleep(POLL) => {}
                }
                if inode(&kubelet_socket) != registered_inode
                    || inode(&our_socket) != generation.socket_inode
                {
                    break;
                }
            }
        }
        tracing::info!(
            "kubelet restarted (or our socket was removed): serving again and re-registering"
        );
        plugin.set_registered(false);
        generation.stop(plugin.as_ref(), false).await;
        generation = loop {
            match Generation::bind(&plugin) {
                Ok(g) => break g,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot serve the plugin socket; retrying");
                    tokio::select! {
                        _ = stop.clone().wait() => return,
                        _ = tokio::time::sleep(REGISTER_RETRY) => {}
                    }
                }
            }
        };
    }
}
