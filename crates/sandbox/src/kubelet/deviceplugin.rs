//! The device-plugin side of the fake kubelet: the `Registration` service (v1beta1) on
//! `<dir>/kubelet.sock`, the connection to a registered plugin (`GetDevicePluginOptions`,
//! `ListAndWatch` with kubelet's 4 MiB receive limit, the latest device list with health), and
//! the calls kubelet makes at container start (`GetPreferredAllocation`, `Allocate`,
//! `PreStartContainer`) with the allocation records.
//!
//! It does not serve PodResources ([`super::podresources`]) or own the sockets' lifecycle
//! ([`super::Kubelet`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use gpushare_core::wire;
use gpushare_kubelet_api::KUBELET_MAX_MESSAGE_BYTES;
use gpushare_kubelet_api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpushare_kubelet_api::deviceplugin::registration_server::{Registration, RegistrationServer};
use gpushare_kubelet_api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty,
    PreStartContainerRequest, PreferredAllocationRequest, RegisterRequest,
};

use super::{Allocation, Inner, Kubelet, ServerHandle, WAIT_DEADLINE, bind, dial_unix, serve};

/// How long one call from the kubelet to a plugin may take.
pub(super) const PLUGIN_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What the kubelet knows about one registered plugin.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginInfo {
    /// The plugin's socket name inside the device-plugin dir.
    pub endpoint: String,
    /// The extended resource it serves.
    pub resource_name: String,
    /// The options sent with `Register` (what kubelet acts on).
    pub options: DevicePluginOptions,
    /// What `GetDevicePluginOptions` answered.
    pub served_options: DevicePluginOptions,
    /// How many times a plugin registered this resource since the kubelet started (restarts
    /// included).
    pub registrations: usize,
}

#[derive(Debug)]
pub(super) struct PluginState {
    pub(super) generation: u64,
    pub(super) info: PluginInfo,
    pub(super) client: Option<DevicePluginClient<Channel>>,
    pub(super) devices: Vec<Device>,
    pub(super) listed: bool,
    pub(super) error: Option<String>,
    pub(super) task: JoinHandle<()>,
}

impl Kubelet {
    /// Waits until a plugin for `resource` registered and its first ListAndWatch list arrived;
    /// fails with the plugin's error (dial, options, ListAndWatch) or after [`WAIT_DEADLINE`].
    pub async fn wait_registered(&self, resource: &str) -> anyhow::Result<PluginInfo> {
        self.wait_for(resource, "to register and list its devices", |plugin| {
            plugin.listed.then(|| plugin.info.clone())
        })
        .await
    }

    /// The latest device list (ID, health) of `resource`'s plugin; empty when none.
    pub fn devices(&self, resource: &str) -> Vec<Device> {
        self.inner
            .state()
            .plugins
            .get(resource)
            .map(|p| p.devices.clone())
            .unwrap_or_default()
    }

    /// The last error of `resource`'s plugin connection (dial, options, ListAndWatch — e.g. a
    /// device list over the 4 MiB limit), if any.
    pub fn plugin_error(&self, resource: &str) -> Option<String> {
        self.inner
            .state()
            .plugins
            .get(resource)
            .and_then(|p| p.error.clone())
    }

    /// What the kubelet knows about `resource`'s plugin now.
    pub fn plugin(&self, resource: &str) -> Option<PluginInfo> {
        self.inner
            .state()
            .plugins
            .get(resource)
            .map(|p| p.info.clone())
    }

    /// Waits until the latest device list of `resource` satisfies `pred`; fails on a plugin
    /// error or after [`WAIT_DEADLINE`].
    pub async fn wait_devices(
        &self,
        resource: &str,
        pred: impl Fn(&[Device]) -> bool,
    ) -> anyhow::Result<Vec<Device>> {
        self.wait_for(resource, "to list the expected devices", |plugin| {
            (plugin.listed && pred(&plugin.devices)).then(|| plugin.devices.clone())
        })
        .await
    }

    async fn wait_for<T>(
        &self,
        resource: &str,
        what: &str,
        check: impl Fn(&PluginState) -> Option<T>,
    ) -> anyhow::Result<T> {
        let mut changes = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + WAIT_DEADLINE;
        loop {
            {
                let state = self.inner.state();
                if let Some(plugin) = state.plugins.get(resource) {
                    if let Some(found) = check(plugin) {
                        return Ok(found);
                    }
                    if let Some(error) = &plugin.error {
                        bail!("plugin for {resource}: {error}");
                    }
                }
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => bail!("the fake kubelet stopped"),
                Err(_) => {
                    let seen = self.devices(resource).len();
                    bail!(
                        "waited {}s for the plugin of {resource} {what} (registered: {}, devices \
                         listed: {seen})",
                        WAIT_DEADLINE.as_secs(),
                        self.plugin(resource).is_some()
                    )
                }
            }
        }
    }

    /// What kubelet does at container start: choose `units` free healthy device IDs (asking
    /// GetPreferredAllocation first when the plugin offers it), call Allocate for ONE
    /// container, call PreStartContainer when the plugin requires it, and record the
    /// allocation (for PodResources, and so the IDs are not reused until
    /// [`Kubelet::release_pod`]).
    pub async fn allocate_container(
        &self,
        resource: &str,
        namespace: &str,
        pod: &str,
        container: &str,
        units: usize,
    ) -> anyhow::Result<(Vec<String>, ContainerAllocateResponse)> {
        let (options, free) = {
            let state = self.inner.state();
            let plugin = state
                .plugins
                .get(resource)
                .ok_or_else(|| anyhow!("no plugin registered for {resource}"))?;
            let used: std::collections::HashSet<&String> = state
                .allocations
                .iter()
                .filter(|a| a.resource == resource)
                .flat_map(|a| a.device_ids.iter())
                .collect();
            let mut free: Vec<String> = plugin
                .devices
                .iter()
                .filter(|d| d.health == wire::HEALTHY && !used.contains(&d.id))
                .map(|d| d.id.clone())
                .collect();
            free.sort();
            (plugin.info.options, free)
        };
        if units == 0 {
            bail!("a container needs at least one {resource} unit to be allocated");
        }
        if free.len() < units {
            bail!(
                "{namespace}/{pod} container {container}: requested {units} {resource}, only {} \
                 free healthy devices",
                free.len()
            );
        }
        let chosen = if options.get_preferred_allocation_available {
            let size = i32::try_from(units).context("allocation size")?;
            let preferred = self
                .preferred_allocation(resource, free.clone(), Vec::new(), size)
                .await?;
            let mut distinct = preferred.clone();
            distinct.sort();
            distinct.dedup();
            if distinct.len() != units {
                bail!(
                    "GetPreferredAllocation answered {} distinct IDs for a request of {units}: \
                     {preferred:?}",
                    distinct.len()
                );
            }
            let free_set: std::collections::HashSet<&String> = free.iter().collect();
            if let Some(bad) = preferred.iter().find(|id| !free_set.contains(id)) {
                bail!("GetPreferredAllocation chose {bad}, which is not among the available IDs");
            }
            preferred
        } else {
            free[..units].to_vec()
        };
        let mut response = self.allocate(resource, chosen.clone()).await?;
        if response.container_responses.len() != 1 {
            bail!(
                "Allocate for one container answered {} container responses",
                response.container_responses.len()
            );
        }
        let container_response = response.container_responses.remove(0);
        if options.pre_start_required {
            self.pre_start_container(resource, chosen.clone()).await?;
        }
        self.inner.state().allocations.push(Allocation {
            namespace: namespace.to_string(),
            pod: pod.to_string(),
            container: container.to_string(),
            resource: resource.to_string(),
            device_ids: chosen.clone(),
        });
        self.inner.bump();
        Ok((chosen, container_response))
    }

    /// Raw `Allocate` with one container request of `device_ids`.
    pub async fn allocate(
        &self,
        resource: &str,
        device_ids: Vec<String>,
    ) -> anyhow::Result<AllocateResponse> {
        let mut client = self.client(resource)?;
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: device_ids,
            }],
        };
        let response = tokio::time::timeout(PLUGIN_CALL_TIMEOUT, client.allocate(request))
            .await
            .context("Allocate timed out")?
            .map_err(|s| anyhow!("Allocate failed: {}: {}", s.code(), s.message()))?;
        Ok(response.into_inner())
    }

    /// Raw `GetPreferredAllocation` for one container; returns the preferred IDs.
    pub async fn preferred_allocation(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: i32,
    ) -> anyhow::Result<Vec<String>> {
        let mut client = self.client(resource)?;
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: must_include,
                allocation_size: size,
            }],
        };
        let response = tokio::time::timeout(
            PLUGIN_CALL_TIMEOUT,
            client.get_preferred_allocation(request),
        )
        .await
        .context("GetPreferredAllocation timed out")?
        .map_err(|s| {
            anyhow!(
                "GetPreferredAllocation failed: {}: {}",
                s.code(),
                s.message()
            )
        })?
        .into_inner();
        match response.container_responses.as_slice() {
            [one] => Ok(one.device_i_ds.clone()),
            other => bail!(
                "GetPreferredAllocation for one container answered {} container responses",
                other.len()
            ),
        }
    }

    /// Raw `GetDevicePluginOptions`: the plugin's options (a round trip that does no work of
    /// the plugin's, the floor under every other call).
    pub async fn device_plugin_options(
        &self,
        resource: &str,
    ) -> anyhow::Result<DevicePluginOptions> {
        let mut client = self.client(resource)?;
        let response = tokio::time::timeout(
            PLUGIN_CALL_TIMEOUT,
            client.get_device_plugin_options(Empty {}),
        )
        .await
        .context("GetDevicePluginOptions timed out")?
        .map_err(|s| {
            anyhow!(
                "GetDevicePluginOptions failed: {}: {}",
                s.code(),
                s.message()
            )
        })?;
        Ok(response.into_inner())
    }

    /// Raw `PreStartContainer`.
    pub async fn pre_start_container(
        &self,
        resource: &str,
        device_ids: Vec<String>,
    ) -> anyhow::Result<()> {
        let mut client = self.client(resource)?;
        let request = PreStartContainerRequest {
            devices_ids: device_ids,
        };
        tokio::time::timeout(PLUGIN_CALL_TIMEOUT, client.pre_start_container(request))
            .await
            .context("PreStartContainer timed out")?
            .map_err(|s| anyhow!("PreStartContainer failed: {}: {}", s.code(), s.message()))?;
        Ok(())
    }

    fn client(&self, resource: &str) -> anyhow::Result<DevicePluginClient<Channel>> {
        let state = self.inner.state();
        let plugin = state
            .plugins
            .get(resource)
            .ok_or_else(|| anyhow!("no plugin registered for {resource}"))?;
        plugin.client.clone().ok_or_else(|| match &plugin.error {
            Some(e) => anyhow!("plugin for {resource} is not connected: {e}"),
            None => anyhow!("plugin for {resource} is not connected yet"),
        })
    }
}

pub(super) fn serve_registration(inner: &Arc<Inner>) -> anyhow::Result<ServerHandle> {
    let listener = bind(&inner.device_plugin_dir.join(wire::KUBELET_SOCKET))?;
    let service = RegistrationServer::new(RegistrationService {
        inner: Arc::clone(inner),
    });
    Ok(serve(listener, Routes::new(service), "registration"))
}

struct RegistrationService {
    inner: Arc<Inner>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != wire::DEVICE_PLUGIN_API_VERSION {
            return Err(Status::invalid_argument(format!(
                "requested API version {:?} is not supported by kubelet. Supported versions are \
                 [{:?}]",
                request.version,
                wire::DEVICE_PLUGIN_API_VERSION
            )));
        }
        if !is_extended_resource_name(&request.resource_name) {
            return Err(Status::invalid_argument(format!(
                "invalid name of device plugin resource: {:?}",
                request.resource_name
            )));
        }
        if request.endpoint.is_empty() || request.endpoint.contains('/') {
            return Err(Status::invalid_argument(format!(
                "invalid endpoint {:?}: a socket name inside the device-plugin directory",
                request.endpoint
            )));
        }
        let options = request.options.unwrap_or_default();
        let resource = request.resource_name.clone();
        let socket = self.inner.device_plugin_dir.join(&request.endpoint);
        let inner = Arc::clone(&self.inner);
        let mut state = self.inner.state();
        state.next_generation += 1;
        let generation = state.next_generation;
        let registrations = {
            let n = state.registrations.entry(resource.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let task_resource = resource.clone();
        let task = tokio::spawn(async move {
            connect_plugin(inner, task_resource, generation, socket).await;
        });
        let plugin = PluginState {
            generation,
            info: PluginInfo {
                endpoint: request.endpoint,
                resource_name: resource.clone(),
                options,
                served_options: DevicePluginOptions::default(),
                registrations,
            },
            client: None,
            devices: Vec::new(),
            listed: false,
            error: None,
            task,
        };
        if let Some(old) = state.plugins.insert(resource, plugin) {
            old.task.abort();
        }
        drop(state);
        self.inner.bump();
        Ok(Response::new(Empty {}))
    }
}

/// kubelet's `IsExtendedResourceName`, reduced to what matters here: `<domain>/<name>`, not in
/// the `kubernetes.io` namespace.
fn is_extended_resource_name(name: &str) -> bool {
    match name.split_once('/') {
        Some((domain, rest)) => {
            !domain.is_empty()
                && !rest.is_empty()
                && !rest.contains('/')
                && !domain.ends_with("kubernetes.io")
                && !name.chars().any(char::is_whitespace)
        }
        None => false,
    }
}

/// Dials the plugin, reads its options, then follows ListAndWatch until it ends or the task
/// is aborted.
async fn connect_plugin(inner: Arc<Inner>, resource: String, generation: u64, socket: PathBuf) {
    let fail = |inner: &Inner, error: String| {
        inner.update(&resource, generation, |p| {
            p.error = Some(error);
        });
    };
    let channel = match dial_unix(&socket).await {
        Ok(c) => c,
        Err(e) => return fail(&inner, format!("cannot dial {}: {e:#}", socket.display())),
    };
    let mut client =
        DevicePluginClient::new(channel).max_decoding_message_size(KUBELET_MAX_MESSAGE_BYTES);
    let options = match tokio::time::timeout(
        PLUGIN_CALL_TIMEOUT,
        client.get_device_plugin_options(Empty {}),
    )
    .await
    {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => {
            return fail(
                &inner,
                format!(
                    "GetDevicePluginOptions failed: {}: {}",
                    s.code(),
                    s.message()
                ),
            );
        }
        Err(_) => return fail(&inner, "GetDevicePluginOptions timed out".to_string()),
    };
    inner.update(&resource, generation, |p| {
        p.info.served_options = options;
        p.client = Some(client.clone());
    });
    let mut stream = match client.list_and_watch(Empty {}).await {
        Ok(r) => r.into_inner(),
        Err(s) => {
            return fail(
                &inner,
                format!("ListAndWatch failed: {}: {}", s.code(), s.message()),
            );
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(list)) => inner.update(&resource, generation, |p| {
                p.devices = list.devices;
                p.listed = true;
                p.error = None;
            }),
            Ok(None) => return fail(&inner, "ListAndWatch stream ended".to_string()),
            Err(s) => {
                return fail(
                    &inner,
                    format!("ListAndWatch failed: {}: {}", s.code(), s.message()),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names() {
        assert!(is_extended_resource_name(wire::RESOURCE_GPU_MEM));
        assert!(is_extended_resource_name("example.com/foo"));
        assert!(!is_extended_resource_name("gpu-mem"));
        assert!(!is_extended_resource_name("kubernetes.io/foo"));
        assert!(!is_extended_resource_name("a/b/c"));
        assert!(!is_extended_resource_name("/b"));
    }
}
