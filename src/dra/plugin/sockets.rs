//! The plugin's two unix sockets: bound (an old socket file removed first), served with the
//! [`Service`] through the one unix-socket server, and served again when a socket file is
//! removed under the running plugin. It answers no call itself ([`super::services`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tonic::transport::Server;

use super::interface::StartError;
use super::preparation::Core;
use super::services::Service;
use crate::kubelet_api::dra::{health_v1, health_v1alpha1, v1, v1beta1};
use crate::kubelet_api::pluginregistration::registration_server::RegistrationServer;
use crate::shutdown::Shutdown;

pub(super) fn listen(path: &Path) -> Result<UnixListener, StartError> {
    let fail = |source| StartError::Listen {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    UnixListener::bind(path).map_err(fail)
}

/// How often the plugin checks that its sockets are still there.
const SOCKET_CHECK: Duration = Duration::from_millis(500);

/// The two sockets of the plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Socket {
    /// `<plugin_dir>/dra.sock`: the DRA and health services.
    Service,
    /// `<registry_dir>/<driver>-reg.sock`: kubelet's registration.
    Registration,
}

pub(super) fn config_socket(core: &Core, which: Socket) -> (Socket, PathBuf) {
    let path = match which {
        Socket::Service => core.config.service_socket(),
        Socket::Registration => core.config.registration_socket(),
    };
    (which, path)
}

/// The inode of the socket file at `path`, when there is one.
fn socket_inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::symlink_metadata(path).ok()?;
    m.file_type().is_socket().then(|| m.ino())
}

/// Serves `which` on `listener` until `stop`.
fn serve_socket(
    svc: Service,
    which: Socket,
    listener: UnixListener,
    stop: Shutdown,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let incoming = crate::kubelet_api::unix_server::incoming(listener);
        let served =
            match which {
                Socket::Service => Server::builder()
                    .add_service(v1::dra_plugin_server::DraPluginServer::new(svc.clone()))
                    .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
                        svc.clone(),
                    ))
                    .add_service(
                        health_v1::dra_resource_health_server::DraResourceHealthServer::new(
                            svc.clone(),
                        ),
                    )
                    .add_service(
                        health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                            svc,
                        ),
                    )
                    .serve_with_incoming_shutdown(incoming, stop.wait())
                    .await,
                Socket::Registration => {
                    Server::builder()
                        .add_service(RegistrationServer::new(svc))
                        .serve_with_incoming_shutdown(incoming, stop.wait())
                        .await
                }
            };
        if let Err(e) = served {
            tracing::warn!(error = %e, socket = ?which, "DRA plugin gRPC server ended with an error");
        }
    })
}

/// Serves both sockets until `stop`, and serves a socket again when its file is removed
/// under the plugin (a clean-up, a kubelet that wiped its registry): kubelet's plugin watcher
/// finds a new registration socket and registers the plugin again. Until it has, the plugin
/// counts as not registered (its readiness follows). A socket file replaced by another
/// process is left to it (a second plugin on the node; logged).
pub(super) async fn serve_sockets(
    svc: Service,
    listeners: [((Socket, PathBuf), UnixListener); 2],
    stop: Shutdown,
) {
    let mut served: Vec<(Socket, PathBuf, Option<u64>, JoinHandle<()>)> = listeners
        .into_iter()
        .map(|((which, path), listener)| {
            let inode = socket_inode(&path);
            let task = serve_socket(svc.clone(), which, listener, stop.clone());
            (which, path, inode, task)
        })
        .collect();
    let stop_fut = stop.clone().wait();
    tokio::pin!(stop_fut);
    loop {
        tokio::select! {
            _ = &mut stop_fut => break,
            _ = tokio::time::sleep(SOCKET_CHECK) => {}
        }
        for (which, path, inode, task) in served.iter_mut() {
            let now = socket_inode(path);
            if now.is_some() && now == *inode {
                continue;
            }
            if now.is_some() {
                if inode.is_some() {
                    tracing::warn!(socket = %path.display(), "the plugin's socket was replaced by another process: leaving it");
                    *inode = None;
                }
                continue;
            }
            tracing::warn!(socket = %path.display(), "the plugin's socket is gone: serving it again");
            if *which == Socket::Registration {
                // kubelet deregistered the plugin when the socket went away.
                svc.0.registration.send_replace(None);
            }
            match listen(path) {
                Ok(listener) => {
                    task.abort();
                    *inode = socket_inode(path);
                    *task = serve_socket(svc.clone(), *which, listener, stop.clone());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot serve the plugin's socket again (retrying)")
                }
            }
        }
    }
    for (_, _, _, task) in served {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
}
