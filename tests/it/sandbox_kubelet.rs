//! The sandbox kubelet against a tiny in-test device plugin over real unix sockets:
//! Register -> options -> ListAndWatch -> GetPreferredAllocation / Allocate / PreStartContainer,
//! PodResources, kubelet's 4 MiB ListAndWatch limit, and a kubelet restart.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use gpushare::core::wire;
use gpushare::kubelet_api::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use gpushare::kubelet_api::deviceplugin::registration_client::RegistrationClient;
use gpushare::kubelet_api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, RegisterRequest,
};
use gpushare::kubelet_api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use gpushare::kubelet_api::podresources::{GetPodResourcesRequest, ListPodResourcesRequest};
use gpushare_sandbox::kubelet::{Kubelet, dial_unix};
use tokio::sync::{oneshot, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tonic::{Request, Response, Status};

use crate::support::socket_dir::short_tempdir;

const RESOURCE: &str = wire::RESOURCE_GPU_MEM;
const ENDPOINT: &str = "test-plugin.sock";

fn healthy(ids: &[&str]) -> Vec<Device> {
    ids.iter()
        .map(|id| Device {
            id: id.to_string(),
            health: wire::HEALTHY.to_string(),
            topology: None,
        })
        .collect()
}

/// What the test plugin saw.
#[derive(Default)]
struct Calls {
    preferred: Vec<PreferredAllocationRequest>,
    allocate: Vec<AllocateRequest>,
    pre_start: Vec<Vec<String>>,
}

/// A minimal device plugin: serves a device list from a watch channel, prefers the
/// highest-sorting available IDs, and answers Allocate with the IDs in an env.
#[derive(Clone)]
struct TestPlugin {
    options: DevicePluginOptions,
    devices: watch::Receiver<Vec<Device>>,
    calls: Arc<Mutex<Calls>>,
}

#[tonic::async_trait]
impl DevicePlugin for TestPlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(self.options))
    }

    type ListAndWatchStream =
        Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        use tokio_stream::StreamExt;
        let stream = WatchStream::new(self.devices.clone())
            .map(|devices| Ok(ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let request = request.into_inner();
        let container_responses = request
            .container_requests
            .iter()
            .map(|c| {
                let mut ids = c.must_include_device_i_ds.clone();
                let mut rest = c.available_device_i_ds.clone();
                rest.sort_by(|a, b| b.cmp(a));
                for id in rest {
                    if ids.len() >= c.allocation_size as usize {
                        break;
                    }
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
                ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect();
        self.calls.lock().expect("calls").preferred.push(request);
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let request = request.into_inner();
        let container_responses = request
            .container_requests
            .iter()
            .map(|c| ContainerAllocateResponse {
                envs: [("TEST_DEVICE_IDS".to_string(), c.devices_ids.join(","))].into(),
                ..Default::default()
            })
            .collect();
        self.calls.lock().expect("calls").allocate.push(request);
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        self.calls
            .lock()
            .expect("calls")
            .pre_start
            .push(request.into_inner().devices_ids);
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// The test plugin's server on `<dir>/<ENDPOINT>`; stops when dropped.
struct Served {
    socket: PathBuf,
    _stop: oneshot::Sender<()>,
}

fn serve(plugin: &TestPlugin, dir: &Path) -> Served {
    let socket = dir.join(ENDPOINT);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind plugin socket");
    let (stop, stopped) = oneshot::channel::<()>();
    let service = DevicePluginServer::new(plugin.clone());
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            })
            .await;
    });
    Served {
        socket,
        _stop: stop,
    }
}

async fn register(
    kubelet: &Kubelet,
    version: &str,
    options: DevicePluginOptions,
) -> Result<(), Status> {
    let channel = dial_unix(&kubelet.registration_socket())
        .await
        .expect("dial kubelet.sock");
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: version.to_string(),
            endpoint: ENDPOINT.to_string(),
            resource_name: RESOURCE.to_string(),
            options: Some(options),
        })
        .await
        .map(|_| ())
}

fn plugin(
    options: DevicePluginOptions,
    devices: Vec<Device>,
) -> (TestPlugin, watch::Sender<Vec<Device>>) {
    let (tx, rx) = watch::channel(devices);
    (
        TestPlugin {
            options,
            devices: rx,
            calls: Arc::default(),
        },
        tx,
    )
}

const FULL_OPTIONS: DevicePluginOptions = DevicePluginOptions {
    pre_start_required: true,
    get_preferred_allocation_available: true,
};

#[tokio::test]
async fn register_list_allocate_and_pod_resources() {
    let root = short_tempdir();
    let kubelet = Kubelet::start(root.path()).await.expect("kubelet starts");
    let (test_plugin, devices) = plugin(FULL_OPTIONS, healthy(&["d0", "d1", "d2", "d3"]));
    let _served = serve(&test_plugin, &kubelet.device_plugin_dir());
    register(&kubelet, wire::DEVICE_PLUGIN_API_VERSION, FULL_OPTIONS)
        .await
        .expect("register");

    let info = kubelet.wait_registered(RESOURCE).await.expect("registered");
    assert_eq!(info.endpoint, ENDPOINT);
    assert_eq!(info.resource_name, RESOURCE);
    assert_eq!(info.options, FULL_OPTIONS);
    assert_eq!(info.served_options, FULL_OPTIONS);
    assert_eq!(info.registrations, 1);
    assert_eq!(kubelet.devices(RESOURCE).len(), 4);

    // The plugin prefers the highest IDs; kubelet follows, calls Allocate and PreStart.
    let (ids, response) = kubelet
        .allocate_container(RESOURCE, "default", "pod-a", "main", 2)
        .await
        .expect("allocate");
    assert_eq!(ids, vec!["d3", "d2"]);
    assert_eq!(
        response.envs.get("TEST_DEVICE_IDS").map(String::as_str),
        Some("d3,d2")
    );
    {
        let calls = test_plugin.calls.lock().expect("calls");
        assert_eq!(calls.preferred.len(), 1);
        let asked = &calls.preferred[0].container_requests[0];
        assert_eq!(asked.available_device_i_ds, vec!["d0", "d1", "d2", "d3"]);
        assert_eq!(asked.allocation_size, 2);
        assert_eq!(
            calls.allocate[0].container_requests[0].devices_ids,
            vec!["d3", "d2"]
        );
        assert_eq!(
            calls.pre_start,
            vec![vec!["d3".to_string(), "d2".to_string()]]
        );
    }

    // Allocated IDs are not offered again; an unhealthy one is never offered.
    devices
        .send(vec![
            Device {
                id: "d0".into(),
                health: wire::UNHEALTHY.into(),
                topology: None,
            },
            healthy(&["d1"]).remove(0),
            healthy(&["d2"]).remove(0),
            healthy(&["d3"]).remove(0),
        ])
        .expect("plugin list");
    kubelet
        .wait_devices(RESOURCE, |d| d.iter().any(|d| d.health == wire::UNHEALTHY))
        .await
        .expect("health change seen");
    let (ids, _) = kubelet
        .allocate_container(RESOURCE, "default", "pod-b", "main", 1)
        .await
        .expect("allocate");
    assert_eq!(ids, vec!["d1"]);
    let err = kubelet
        .allocate_container(RESOURCE, "default", "pod-c", "main", 1)
        .await
        .expect_err("nothing free");
    assert!(
        err.to_string().contains("only 0 free healthy devices"),
        "{err}"
    );

    // PodResources answers from the recorded allocations.
    let channel = dial_unix(&kubelet.pod_resources_socket())
        .await
        .expect("dial pod-resources");
    let mut pod_resources = PodResourcesListerClient::new(channel);
    let list = pod_resources
        .list(ListPodResourcesRequest {})
        .await
        .expect("List")
        .into_inner()
        .pod_resources;
    assert_eq!(list.len(), 2);
    assert_eq!(list[0].name, "pod-a");
    assert_eq!(list[0].containers[0].name, "main");
    assert_eq!(list[0].containers[0].devices[0].resource_name, RESOURCE);
    assert_eq!(
        list[0].containers[0].devices[0].device_ids,
        vec!["d3", "d2"]
    );
    let got = pod_resources
        .get(GetPodResourcesRequest {
            pod_name: "pod-b".into(),
            pod_namespace: "default".into(),
        })
        .await
        .expect("Get")
        .into_inner();
    assert_eq!(
        got.pod_resources.expect("pod").containers[0].devices[0].device_ids,
        vec!["d1"]
    );
    let missing = pod_resources
        .get(GetPodResourcesRequest {
            pod_name: "nope".into(),
            pod_namespace: "default".into(),
        })
        .await
        .expect_err("unknown pod");
    assert_eq!(missing.code(), tonic::Code::NotFound);

    // Releasing a pod frees its IDs.
    kubelet.release_pod("default", "pod-a");
    let (ids, _) = kubelet
        .allocate_container(RESOURCE, "default", "pod-d", "main", 2)
        .await
        .expect("allocate after release");
    assert_eq!(ids, vec!["d3", "d2"]);
    kubelet.stop().await;
}

#[tokio::test]
async fn without_preferred_allocation_kubelet_picks_and_raw_calls_work() {
    let root = short_tempdir();
    let kubelet = Kubelet::start(root.path()).await.expect("kubelet starts");
    let options = DevicePluginOptions::default();
    let (test_plugin, _devices) = plugin(options, healthy(&["b", "a", "c"]));
    let _served = serve(&test_plugin, &kubelet.device_plugin_dir());
    register(&kubelet, wire::DEVICE_PLUGIN_API_VERSION, options)
        .await
        .expect("register");
    kubelet.wait_registered(RESOURCE).await.expect("registered");

    let (ids, _) = kubelet
        .allocate_container(RESOURCE, "ns", "p", "c", 2)
        .await
        .expect("allocate");
    assert_eq!(ids, vec!["a", "b"]);
    {
        let calls = test_plugin.calls.lock().expect("calls");
        assert!(calls.preferred.is_empty(), "not offered, not asked");
        assert!(calls.pre_start.is_empty(), "not required, not called");
    }

    let preferred = kubelet
        .preferred_allocation(
            RESOURCE,
            vec!["a".into(), "b".into(), "c".into()],
            vec!["a".into()],
            2,
        )
        .await
        .expect("raw GetPreferredAllocation");
    assert_eq!(preferred, vec!["a", "c"]);
    let response = kubelet
        .allocate(RESOURCE, vec!["c".into()])
        .await
        .expect("raw Allocate");
    assert_eq!(response.container_responses.len(), 1);
    kubelet
        .pre_start_container(RESOURCE, vec!["c".into()])
        .await
        .expect("raw PreStart");
    assert_eq!(
        test_plugin.calls.lock().expect("calls").pre_start,
        vec![vec!["c".to_string()]]
    );
    kubelet.stop().await;
}

#[tokio::test]
async fn wrong_api_version_is_refused() {
    let root = short_tempdir();
    let kubelet = Kubelet::start(root.path()).await.expect("kubelet starts");
    let status = register(&kubelet, "v1alpha", DevicePluginOptions::default())
        .await
        .expect_err("v1alpha is not supported");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("v1alpha"), "{}", status.message());
    assert!(kubelet.plugin(RESOURCE).is_none());
    kubelet.stop().await;
}

#[tokio::test]
async fn list_over_four_mib_fails_like_kubelet() {
    let root = short_tempdir();
    let kubelet = Kubelet::start(root.path()).await.expect("kubelet starts");
    let many: Vec<Device> = (0..80_000)
        .map(|i| Device {
            id: format!("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee-_-{i:08}"),
            health: wire::HEALTHY.to_string(),
            topology: None,
        })
        .collect();
    let encoded = prost::Message::encoded_len(&ListAndWatchResponse {
        devices: many.clone(),
    });
    assert!(
        encoded > gpushare::kubelet_api::KUBELET_MAX_MESSAGE_BYTES,
        "{encoded} bytes"
    );
    let (test_plugin, _devices) = plugin(DevicePluginOptions::default(), many);
    let _served = serve(&test_plugin, &kubelet.device_plugin_dir());
    register(
        &kubelet,
        wire::DEVICE_PLUGIN_API_VERSION,
        DevicePluginOptions::default(),
    )
    .await
    .expect("register is accepted; the list fails later");
    let err = kubelet
        .wait_registered(RESOURCE)
        .await
        .expect_err("over the limit");
    let text = err.to_string();
    assert!(text.contains("ListAndWatch failed"), "{text}");
    assert!(text.contains("too large"), "{text}");
    assert!(kubelet.plugin_error(RESOURCE).is_some());
    assert!(kubelet.devices(RESOURCE).is_empty());
    kubelet.stop().await;
}

#[tokio::test]
async fn restart_removes_sockets_and_plugins_register_again() {
    let root = short_tempdir();
    let kubelet = Kubelet::start(root.path()).await.expect("kubelet starts");
    let options = DevicePluginOptions::default();
    let (test_plugin, _devices) = plugin(options, healthy(&["x0", "x1"]));
    let served = serve(&test_plugin, &kubelet.device_plugin_dir());
    register(&kubelet, wire::DEVICE_PLUGIN_API_VERSION, options)
        .await
        .expect("register");
    kubelet.wait_registered(RESOURCE).await.expect("registered");
    kubelet
        .allocate_container(RESOURCE, "ns", "kept", "c", 1)
        .await
        .expect("allocate");
    let stray = kubelet.device_plugin_dir().join("other.sock");
    let _other = std::os::unix::net::UnixListener::bind(&stray).expect("bind a stray socket");
    let keep = kubelet
        .device_plugin_dir()
        .join("kubelet_internal_checkpoint");
    std::fs::write(&keep, "{}").expect("write a plain file");

    kubelet.restart().await.expect("restart");
    assert!(
        !served.socket.exists(),
        "kubelet removes plugin sockets on restart"
    );
    assert!(!stray.exists(), "every socket in the dir goes");
    assert!(keep.exists(), "plain files stay");
    assert!(
        kubelet.registration_socket().exists(),
        "a fresh kubelet.sock is served"
    );
    assert!(
        kubelet.plugin(RESOURCE).is_none(),
        "plugin connections are dropped"
    );

    // The plugin notices, serves again and re-registers.
    drop(served);
    let _served = serve(&test_plugin, &kubelet.device_plugin_dir());
    register(&kubelet, wire::DEVICE_PLUGIN_API_VERSION, options)
        .await
        .expect("re-register");
    let info = kubelet
        .wait_registered(RESOURCE)
        .await
        .expect("registered again");
    assert_eq!(info.registrations, 2);
    // Allocations survive the restart (kubelet's checkpoint): only x0/x1 minus the kept one.
    let (ids, _) = kubelet
        .allocate_container(RESOURCE, "ns", "new", "c", 1)
        .await
        .expect("allocate");
    assert_eq!(ids, vec!["x1"]);
    kubelet.stop().await;
    assert!(
        !root
            .path()
            .join("device-plugins")
            .join(wire::KUBELET_SOCKET)
            .exists()
    );
}
