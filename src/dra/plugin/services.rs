//! The plugin's gRPC services over its [`Core`]: `pluginregistration.Registration`
//! (`GetInfo`, `NotifyRegistrationStatus`), `DRAPlugin` v1 and v1beta1 (prepare and unprepare
//! in each version's types) and `DRAResourceHealth` v1 and v1alpha1 (the device list with its
//! health on every change). It decides nothing about claims ([`super::preparation`]) and binds
//! no socket ([`super::sockets`]).

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::preparation::{ClaimRef, Core};
use crate::dra::checkpoint::PreparedClaim;
use crate::kubelet_api::dra::{health_v1, health_v1alpha1, v1, v1beta1};
use crate::kubelet_api::pluginregistration::registration_server::Registration;
use crate::kubelet_api::pluginregistration::{
    DRA_PLUGIN_TYPE, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};

/// The services `GetInfo` lists, newest first.
pub const SERVICES: [&str; 4] = [
    v1::SERVICE,
    v1beta1::SERVICE,
    health_v1::SERVICE,
    health_v1alpha1::SERVICE,
];
/// `health_check_timeout_seconds` of every device in `NodeWatchResources`.
const HEALTH_TIMEOUT_SECONDS: i64 = 60;

/// One device of a prepared claim as kubelet is told of it.
struct Answered {
    request: String,
    device: String,
    cdi_device_ids: Vec<String>,
    share_id: Option<String>,
}

/// The devices of a prepared claim in the answer's order: its GPU shares, then its devices
/// of other kinds.
fn answered(p: PreparedClaim) -> impl Iterator<Item = Answered> {
    let gpus = p.shares.into_iter().map(|s| Answered {
        request: s.share.request,
        device: s.share.device,
        cdi_device_ids: s.cdi_device_ids,
        share_id: s.share.share_id,
    });
    let others = p.devices.into_iter().map(|d| Answered {
        request: d.share.request,
        device: d.share.device,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share.share_id,
    });
    gpus.chain(others)
}

fn claim_refs<I>(claims: I) -> Vec<ClaimRef>
where
    I: IntoIterator<Item = (String, String, String)>,
{
    claims
        .into_iter()
        .map(|(namespace, uid, name)| ClaimRef {
            namespace,
            uid,
            name,
        })
        .collect()
}

#[derive(Clone)]
pub(super) struct Service(pub(super) Arc<Core>);

#[tonic::async_trait]
impl Registration for Service {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: self.0.config.driver.clone(),
            endpoint: self.0.config.service_socket().display().to_string(),
            supported_versions: SERVICES.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.0.config.driver, "registered with kubelet");
        } else {
            tracing::warn!(driver = %self.0.config.driver, error = %status.error, "kubelet refused the registration");
        }
        self.0.registration.send_replace(Some(status));
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `DRAPlugin` of one protocol version (`v1`, `v1beta1`): the same prepare and unprepare,
/// answered in that version's types; `$device` builds one answered device (`v1` carries its
/// `share_id`, `v1beta1` has none).
macro_rules! dra_plugin_service {
    ($v:ident, $device:expr) => {
        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for Service {
            async fn node_prepare_resources(
                &self,
                request: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims = claim_refs(
                    request
                        .into_inner()
                        .claims
                        .into_iter()
                        .map(|c| (c.namespace, c.uid, c.name)),
                );
                let node = self.0.config.node.clone();
                let device: fn(Answered, String) -> $v::Device = $device;
                let claims = self
                    .0
                    .prepare(claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| {
                        let answer = match r {
                            Ok(p) => $v::NodePrepareResourceResponse {
                                devices: answered(p).map(|a| device(a, node.clone())).collect(),
                                error: String::new(),
                            },
                            Err(e) => $v::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: e.to_string(),
                            },
                        };
                        (uid, answer)
                    })
                    .collect();
                Ok(Response::new($v::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let uids = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| c.uid)
                    .collect();
                let claims = self
                    .0
                    .unprepare(uids)
                    .await
                    .into_iter()
                    .map(|(uid, error)| (uid, $v::NodeUnprepareResourceResponse { error }))
                    .collect();
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_plugin_service!(v1, |a, pool_name| v1::Device {
    request_names: vec![a.request],
    pool_name,
    device_name: a.device,
    cdi_device_ids: a.cdi_device_ids,
    share_id: a.share_id,
});
dra_plugin_service!(v1beta1, |a, pool_name| v1beta1::Device {
    request_names: vec![a.request],
    pool_name,
    device_name: a.device,
    cdi_device_ids: a.cdi_device_ids,
});

/// The health list on every change of [`Served`], as `(device, healthy, message)`.
fn health_stream(core: Arc<Core>) -> impl Stream<Item = Vec<(String, bool, String)>> + Send {
    let rx = core.served.clone();
    tokio_stream::wrappers::WatchStream::new(rx).map(move |_| core.health())
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// `DRAResourceHealth` of one protocol version (`health_v1`, `health_v1alpha1` for kubelets up
/// to 1.36): the complete device list with its health on every change of [`Served`].
macro_rules! dra_health_service {
    ($v:ident) => {
        #[tonic::async_trait]
        impl $v::dra_resource_health_server::DraResourceHealth for Service {
            type NodeWatchResourcesStream =
                Pin<Box<dyn Stream<Item = Result<$v::NodeWatchResourcesResponse, Status>> + Send>>;

            async fn node_watch_resources(
                &self,
                _: Request<$v::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                let pool = self.0.config.node.clone();
                let stream = health_stream(self.0.clone()).map(move |list| {
                    let now = unix_now();
                    Ok($v::NodeWatchResourcesResponse {
                        devices: list
                            .into_iter()
                            .map(|(device, healthy, message)| $v::DeviceHealth {
                                device: Some($v::DeviceIdentifier {
                                    pool_name: pool.clone(),
                                    device_name: device,
                                }),
                                health: if healthy {
                                    $v::HealthStatus::Healthy
                                } else {
                                    $v::HealthStatus::Unhealthy
                                } as i32,
                                last_updated_time: now,
                                health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                                message: message.chars().take(1024).collect(),
                            })
                            .collect(),
                    })
                });
                Ok(Response::new(Box::pin(stream)))
            }
        }
    };
}

dra_health_service!(health_v1);
dra_health_service!(health_v1alpha1);
