//! The tonic `DevicePlugin` service, one for every socket the device plugin serves: the GPU
//! resource ([`Plugin`](super::Plugin)) and each device kind beside it
//! ([`KindPlugin`](super::kinds)) are [`Endpoint`]s, and one [`EndpointService`] per serving
//! generation (a kubelet restart starts a new one) answers for it: ListAndWatch streams the
//! endpoint's device list and ends when its generation stops, so kubelet sees the plugin go
//! away and come back; Allocate and GetPreferredAllocation are the endpoint's own.
//!
//! It does not serve a socket or register with kubelet ([`super::registration`] does).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

use super::Plugin;
use crate::core::wire::{PLUGIN_SOCKET, RESOURCE_GPU_MEM};
use crate::kubelet_api::deviceplugin::device_plugin_server::DevicePlugin;
use crate::kubelet_api::deviceplugin::{
    AllocateRequest, AllocateResponse, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use crate::shutdown::Shutdown;

/// The options we register with and report: GetPreferredAllocation available, no PreStart.
pub(crate) fn plugin_options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// One socket served and registered: the GPU plugin, or one device kind.
pub(crate) trait Endpoint: Send + Sync + 'static {
    /// The GPU plugin (device-plugin dir, the pod store).
    fn plugin(&self) -> &Plugin;
    /// The socket's file name inside the device-plugin dir.
    fn socket_name(&self) -> String;
    /// The extended resource registered.
    fn resource(&self) -> String;
    /// Registered with kubelet (`true`) or not any more.
    fn set_registered(&self, registered: bool);
    /// The device list ListAndWatch streams.
    fn devices(&self) -> &watch::Sender<Arc<ListAndWatchResponse>>;
    /// Answers one Allocate call.
    fn allocate(
        self: &Arc<Self>,
        request: AllocateRequest,
    ) -> impl Future<Output = Result<AllocateResponse, Status>> + Send;
    /// Answers one GetPreferredAllocation call.
    fn preferred_allocation(
        self: &Arc<Self>,
        request: PreferredAllocationRequest,
    ) -> impl Future<Output = PreferredAllocationResponse> + Send;
    /// The socket's path.
    fn socket_path(&self) -> std::path::PathBuf {
        self.plugin()
            .config
            .device_plugin_dir
            .join(self.socket_name())
    }
}

impl Endpoint for Plugin {
    fn plugin(&self) -> &Plugin {
        self
    }

    fn socket_name(&self) -> String {
        PLUGIN_SOCKET.to_string()
    }

    fn resource(&self) -> String {
        RESOURCE_GPU_MEM.to_string()
    }

    fn set_registered(&self, registered: bool) {
        self.metrics.registered.set(i64::from(registered));
        if registered {
            self.metrics.registrations.inc();
        }
        self.node.set_role_ready(registered);
    }

    fn devices(&self) -> &watch::Sender<Arc<ListAndWatchResponse>> {
        &self.devices_tx
    }

    fn allocate(
        self: &Arc<Self>,
        request: AllocateRequest,
    ) -> impl Future<Output = Result<AllocateResponse, Status>> + Send {
        Plugin::allocate(self, request)
    }

    fn preferred_allocation(
        self: &Arc<Self>,
        request: PreferredAllocationRequest,
    ) -> impl Future<Output = PreferredAllocationResponse> + Send {
        Plugin::preferred_allocation(self, request)
    }
}

/// The service of one serving generation of `endpoint`.
#[derive(Debug)]
pub(crate) struct EndpointService<E> {
    pub(crate) endpoint: Arc<E>,
    /// Fires when this generation stops.
    pub(crate) stop: Shutdown,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<E: Endpoint> DevicePlugin for EndpointService<E> {
    async fn get_device_plugin_options(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let updates = WatchStream::new(self.endpoint.devices().subscribe())
            .map(|msg| Ok(ListAndWatchResponse::clone(&msg)))
            .take_until(self.stop.clone().wait());
        Ok(Response::new(Box::pin(updates)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(
            self.endpoint
                .preferred_allocation(request.into_inner())
                .await,
        ))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        self.endpoint
            .allocate(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
