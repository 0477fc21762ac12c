//! The PodResources v1 side of the fake kubelet: `List`, `Get` and `GetAllocatableResources`
//! on `<root>/pod-resources/kubelet.sock`, answered from the allocations the device-plugin
//! side recorded; pausable ([`Kubelet::pause_pod_resources`]), so a test decides when a
//! plugin's cross-check can see them.
//!
//! It does not allocate anything ([`super::deviceplugin`] does).

use std::sync::Arc;

use tonic::service::Routes;
use tonic::{Request, Response, Status};

use gpushare_core::wire;
use gpushare_kubelet_api::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpushare_kubelet_api::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};

use super::{Inner, Kubelet, ServerHandle, bind, serve};

impl Kubelet {
    /// Makes the PodResources service answer `Unavailable` (`paused`) or serve again, so a
    /// test decides when a plugin's cross-check can see kubelet's allocations.
    pub fn pause_pod_resources(&self, paused: bool) {
        self.inner.state().pod_resources_paused = paused;
        self.inner.bump();
    }
}

pub(super) fn serve_pod_resources(inner: &Arc<Inner>) -> anyhow::Result<ServerHandle> {
    let listener = bind(&inner.pod_resources_socket)?;
    let service = PodResourcesListerServer::new(PodResourcesService {
        inner: Arc::clone(inner),
    });
    Ok(serve(listener, Routes::new(service), "pod-resources"))
}

struct PodResourcesService {
    inner: Arc<Inner>,
}

impl PodResourcesService {
    fn check_paused(&self) -> Result<(), Status> {
        if self.inner.state().pod_resources_paused {
            return Err(Status::unavailable("PodResources paused by the test"));
        }
        Ok(())
    }

    fn pods(&self) -> Vec<PodResources> {
        let state = self.inner.state();
        let mut pods: Vec<PodResources> = Vec::new();
        for a in &state.allocations {
            let pod = match pods
                .iter_mut()
                .find(|p| p.namespace == a.namespace && p.name == a.pod)
            {
                Some(p) => p,
                None => {
                    pods.push(PodResources {
                        name: a.pod.clone(),
                        namespace: a.namespace.clone(),
                        containers: Vec::new(),
                    });
                    let last = pods.len() - 1;
                    &mut pods[last]
                }
            };
            let container = match pod
                .containers
                .iter_mut()
                .position(|c| c.name == a.container)
            {
                Some(i) => &mut pod.containers[i],
                None => {
                    pod.containers.push(ContainerResources {
                        name: a.container.clone(),
                        ..ContainerResources::default()
                    });
                    let last = pod.containers.len() - 1;
                    &mut pod.containers[last]
                }
            };
            container.devices.push(ContainerDevices {
                resource_name: a.resource.clone(),
                device_ids: a.device_ids.clone(),
                topology: None,
            });
        }
        pods
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.check_paused()?;
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: self.pods(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        self.check_paused()?;
        let state = self.inner.state();
        let mut devices: Vec<ContainerDevices> = state
            .plugins
            .iter()
            .map(|(resource, p)| ContainerDevices {
                resource_name: resource.clone(),
                device_ids: p
                    .devices
                    .iter()
                    .filter(|d| d.health == wire::HEALTHY)
                    .map(|d| d.id.clone())
                    .collect(),
                topology: None,
            })
            .collect();
        devices.sort_by(|a, b| a.resource_name.cmp(&b.resource_name));
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        self.check_paused()?;
        let request = request.into_inner();
        self.pods()
            .into_iter()
            .find(|p| p.name == request.pod_name && p.namespace == request.pod_namespace)
            .map(|p| {
                Response::new(GetPodResourcesResponse {
                    pod_resources: Some(p),
                })
            })
            .ok_or_else(|| {
                Status::not_found(format!(
                    "pod {} not found in namespace {}",
                    request.pod_name, request.pod_namespace
                ))
            })
    }
}
