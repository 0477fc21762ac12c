//! The tonic `DevicePlugin` service: one per serving generation (a kubelet restart starts a
//! new one), delegating to the shared [`Plugin`](super::Plugin). ListAndWatch streams end when
//! their generation stops, so kubelet sees the plugin go away and come back.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

use super::Plugin;
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

/// The service of one serving generation.
#[derive(Debug, Clone)]
pub(crate) struct PluginService {
    pub(crate) plugin: Arc<Plugin>,
    /// Fires when this generation stops.
    pub(crate) stop: Shutdown,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
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
        let updates = WatchStream::new(self.plugin.devices_tx.subscribe())
            .map(|msg| Ok(ListAndWatchResponse::clone(&msg)))
            .take_until(self.stop.clone().wait());
        Ok(Response::new(Box::pin(updates)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(
            self.plugin.preferred_allocation(request.into_inner()).await,
        ))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        self.plugin
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
