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
//! What it does not: checkpoint files, topology/NUMA alignment, CDI, the grace period before
//! devices of a vanished plugin turn unhealthy, or anything about pods beyond the allocation
//! records.

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::transport::{Channel, Endpoint, Server, Uri};
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
use gpushare_kubelet_api::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpushare_kubelet_api::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};

/// How long the `wait_*` methods wait before they give up with an error.
pub const WAIT_DEADLINE: Duration = Duration::from_secs(30);
/// Longest unix socket path the kernel accepts (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;
/// How long one call from the kubelet to a plugin may take.
const PLUGIN_CALL_TIMEOUT: Duration = Duration::from_secs(10);

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
struct PluginState {
    generation: u64,
    info: PluginInfo,
    client: Option<DevicePluginClient<Channel>>,
    devices: Vec<Device>,
    listed: bool,
    error: Option<String>,
    task: JoinHandle<()>,
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

    /// Forgets the allocations of a pod (it terminated); its IDs become free again.
    pub fn release_pod(&self, namespace: &str, pod: &str) {
        self.inner
            .state()
            .allocations
            .retain(|a| !(a.namespace == namespace && a.pod == pod));
        self.inner.bump();
    }

    /// Makes the PodResources service answer `Unavailable` (`paused`) or serve again, so a
    /// test decides when a plugin's cross-check can see kubelet's allocations.
    pub fn pause_pod_resources(&self, paused: bool) {
        self.inner.state().pod_resources_paused = paused;
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

fn serve_registration(inner: &Arc<Inner>) -> anyhow::Result<ServerHandle> {
    let listener = bind(&inner.device_plugin_dir.join(wire::KUBELET_SOCKET))?;
    let service = RegistrationServer::new(RegistrationService {
        inner: Arc::clone(inner),
    });
    Ok(serve(listener, Routes::new(service), "registration"))
}

fn serve_pod_resources(inner: &Arc<Inner>) -> anyhow::Result<ServerHandle> {
    let listener = bind(&inner.pod_resources_socket)?;
    let service = PodResourcesListerServer::new(PodResourcesService {
        inner: Arc::clone(inner),
    });
    Ok(serve(listener, Routes::new(service), "pod-resources"))
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

    #[test]
    fn long_socket_paths_are_refused() {
        let long = PathBuf::from(format!("/tmp/{}/kubelet.sock", "x".repeat(120)));
        let err = check_socket_path(&long).expect_err("too long").to_string();
        assert!(err.contains("over the 107-byte limit"), "{err}");
        assert!(check_socket_path(Path::new("/tmp/k/kubelet.sock")).is_ok());
    }
}
