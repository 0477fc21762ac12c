//! The sandbox DRA kubelet (`gpushare_sandbox::dra_kubelet`) and the Python grpcio DRA
//! kubelet (`tests/clients/dra_kubelet_grpcio.py`), both against a small tonic DRA plugin
//! written here: registration, prepare, unprepare after the claim is gone, the v1beta1
//! fallback, a refused registration, a failed registration tried again, and health.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use gpushare_kubelet_api::dra::{health_v1, v1, v1beta1};
use gpushare_kubelet_api::pluginregistration::registration_server::{
    Registration, RegistrationServer,
};
use gpushare_kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use gpushare_kubelet_api::unix_server;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_allocator::DraAllocator;
use gpushare_sandbox::dra_kubelet::{ClaimOutcome, DraKubelet};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use serde_json::Value;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::support::clients;
use crate::support::objects::claim_pod;
use crate::support::socket_dir::short_tempdir;

const DRIVER: &str = "test.gpushare.io";

const SEED: &str = include_str!("../fixtures/apiserver/dra-test-driver.yaml");

fn pod(name: &str) -> Value {
    claim_pod(name, "t", &[("c", "a")])
}

/// What the test plugin saw.
#[derive(Default)]
struct Seen {
    notified: Vec<RegistrationStatus>,
    prepared: Vec<String>,
    unprepared: Vec<String>,
}

#[derive(Clone)]
struct TestPlugin {
    name: String,
    kind: String,
    endpoint: PathBuf,
    versions: Vec<String>,
    api: kube::Client,
    seen: Arc<Mutex<Seen>>,
    health: watch::Receiver<Vec<(String, i32)>>,
}

impl TestPlugin {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The results for this driver of a claim, read from the API as a real plugin does.
    async fn devices(&self, ns: &str, name: &str, uid: &str) -> Result<Vec<v1::Device>, String> {
        let claim = Api::<ResourceClaim>::namespaced(self.api.clone(), ns)
            .get(name)
            .await
            .map_err(|e| format!("reading claim {ns}/{name}: {e}"))?;
        if claim.metadata.uid.as_deref() != Some(uid) {
            return Err(format!("claim {ns}/{name} has another uid"));
        }
        let results = claim
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .ok_or_else(|| format!("claim {ns}/{name} is not allocated"))?;
        Ok(results
            .into_iter()
            .filter(|r| r.driver == self.name)
            .map(|r| v1::Device {
                request_names: vec![r.request.clone()],
                pool_name: r.pool.clone(),
                cdi_device_ids: vec![format!("k8s.{}/claim={uid}-{}", self.name, r.device)],
                device_name: r.device,
                share_id: r.share_id,
            })
            .collect())
    }
}

#[tonic::async_trait]
impl Registration for TestPlugin {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: self.kind.clone(),
            name: self.name.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: self.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        self.seen().notified.push(request.into_inner());
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// The test plugin's DRA service, once per API version (`v1`, `v1beta1`); `device` turns a v1
/// device answer into the version's own.
macro_rules! dra_plugin_service {
    ($api:ident, $device:expr) => {
        #[tonic::async_trait]
        impl $api::dra_plugin_server::DraPlugin for TestPlugin {
            async fn node_prepare_resources(
                &self,
                request: Request<$api::NodePrepareResourcesRequest>,
            ) -> Result<Response<$api::NodePrepareResourcesResponse>, Status> {
                let mut out = $api::NodePrepareResourcesResponse::default();
                for c in request.into_inner().claims {
                    let answer = match self.devices(&c.namespace, &c.name, &c.uid).await {
                        Ok(devices) => $api::NodePrepareResourceResponse {
                            devices: devices.into_iter().map($device).collect(),
                            error: String::new(),
                        },
                        Err(error) => $api::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error,
                        },
                    };
                    self.seen().prepared.push(c.uid.clone());
                    out.claims.insert(c.uid, answer);
                }
                Ok(Response::new(out))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$api::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$api::NodeUnprepareResourcesResponse>, Status> {
                let mut out = $api::NodeUnprepareResourcesResponse::default();
                for c in request.into_inner().claims {
                    self.seen().unprepared.push(c.uid.clone());
                    out.claims
                        .insert(c.uid, $api::NodeUnprepareResourceResponse::default());
                }
                Ok(Response::new(out))
            }
        }
    };
}

/// A v1 device answer as v1.
fn v1_device(d: v1::Device) -> v1::Device {
    d
}

/// A v1 device answer as v1beta1 (the same fields).
fn v1beta1_device(d: v1::Device) -> v1beta1::Device {
    v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}

dra_plugin_service!(v1, v1_device);
dra_plugin_service!(v1beta1, v1beta1_device);

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<health_v1::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl health_v1::dra_resource_health_server::DraResourceHealth for TestPlugin {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<health_v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        use futures::StreamExt;
        let stream = tokio_stream::wrappers::WatchStream::new(self.health.clone()).map(|list| {
            Ok(health_v1::NodeWatchResourcesResponse {
                devices: list
                    .into_iter()
                    .map(|(device, health)| health_v1::DeviceHealth {
                        device: Some(health_v1::DeviceIdentifier {
                            pool_name: "node-a".into(),
                            device_name: device,
                        }),
                        health,
                        last_updated_time: 0,
                        health_check_timeout_seconds: 30,
                        message: String::new(),
                    })
                    .collect(),
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// A running test plugin: its registration socket under `<dir>/registry`, its service
/// socket under `<dir>/plugin`.
struct Running {
    plugin: TestPlugin,
    health: watch::Sender<Vec<(String, i32)>>,
    registration: PathBuf,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn serve(
    listener: tokio::net::UnixListener,
    router: tonic::transport::server::Router,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let _ = router
            .serve_with_incoming(unix_server::incoming(listener))
            .await;
    })
}

/// A test plugin of `kind` serving `versions` in a fresh directory (kept alive by the caller),
/// and a sandbox DRA kubelet of node `node-a` watching its registry.
fn plugin_and_kubelet(
    server: &ApiServer,
    kind: &str,
    versions: &[&str],
) -> (tempfile::TempDir, Running, DraKubelet) {
    let dir = short_tempdir();
    let running = start_plugin(dir.path(), server.admin_client(), kind, versions);
    let kubelet = DraKubelet::start(
        &dir.path().join("registry"),
        "node-a",
        server.admin_client(),
    )
    .expect("the DRA kubelet starts");
    (dir, running, kubelet)
}

fn start_plugin(dir: &Path, api: kube::Client, kind: &str, versions: &[&str]) -> Running {
    let registry = dir.join("registry");
    let plugin_dir = dir.join("plugin");
    std::fs::create_dir_all(&registry).expect("registry dir");
    std::fs::create_dir_all(&plugin_dir).expect("plugin dir");
    let endpoint = plugin_dir.join("dra.sock");
    let (health_tx, health) = watch::channel(vec![("gpu-0".to_string(), 1)]);
    let plugin = TestPlugin {
        name: DRIVER.into(),
        kind: kind.into(),
        endpoint: endpoint.clone(),
        versions: versions.iter().map(|v| v.to_string()).collect(),
        api,
        seen: Arc::default(),
        health,
    };
    // The service socket first: kubelet dials it right after GetInfo.
    let service = tokio::net::UnixListener::bind(&endpoint).expect("bind dra.sock");
    let router = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(plugin.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ))
        .add_service(
            health_v1::dra_resource_health_server::DraResourceHealthServer::new(plugin.clone()),
        );
    let t1 = serve(service, router);
    let registration = registry.join(format!("{DRIVER}-reg.sock"));
    let reg = tokio::net::UnixListener::bind(&registration).expect("bind reg.sock");
    let t2 = serve(
        reg,
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone())),
    );
    Running {
        plugin,
        health: health_tx,
        registration,
        tasks: vec![t1, t2],
    }
}

async fn cluster() -> ApiServer {
    crate::support::dra::seeded_api(SEED).await
}

#[tokio::test]
async fn the_dra_kubelet_registers_prepares_reads_health_and_unprepares_after_the_claim_is_gone() {
    let server = cluster().await;
    let (dir, running, kubelet) = plugin_and_kubelet(
        &server,
        "DRAPlugin",
        &[v1::SERVICE, v1beta1::SERVICE, health_v1::SERVICE],
    );
    let info = kubelet.wait_registered(DRIVER).await.expect("registers");
    assert_eq!(info.endpoint, dir.path().join("plugin/dra.sock"));
    assert_eq!(info.health_service.as_deref(), Some(health_v1::SERVICE));
    assert!(
        running
            .plugin
            .seen()
            .notified
            .iter()
            .any(|s| s.plugin_registered),
        "the plugin is told it is registered"
    );

    server.create_object(pod("p")).expect("pod");
    let allocator = DraAllocator::new(server.admin_client());
    assert_eq!(allocator.reconcile().await.expect("a pass").bound.len(), 1);
    let report = kubelet.sync().await.expect("a sync");
    assert_eq!(report.prepared, ["default/p"]);
    let uid = crate::support::objects::pod_uid(&server, "p");
    let claims = kubelet.prepared(&uid).expect("recorded");
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].service, v1::SERVICE);
    let ClaimOutcome::Prepared(devices) = &claims[0].outcome else {
        panic!("prepared: {claims:?}");
    };
    assert_eq!(devices[0].device, "gpu-0");
    assert_eq!(devices[0].request_names, ["a"]);
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("k8s.{DRIVER}/claim={}-gpu-0", claims[0].uid)]
    );
    assert!(devices[0].share_id.is_some(), "v1 carries the share id");
    // A second sync does not prepare again.
    assert!(kubelet.sync().await.expect("sync").prepared.is_empty());

    running.health.send_replace(vec![("gpu-0".into(), 2)]);
    crate::support::dra_node::wait_device_health(&kubelet, "gpu-0", "UNHEALTHY", None).await;

    // The pod finishes; the allocator deletes its claim; unprepare still works.
    server
        .set_pod_phase("default", "p", "Succeeded")
        .expect("phase");
    assert_eq!(
        allocator.reconcile().await.expect("a pass").released.len(),
        1
    );
    assert!(
        server
            .get_object("resourceclaims", Some("default"), &claims[0].name)
            .is_none()
    );
    let report = kubelet.sync().await.expect("a sync");
    assert_eq!(report.unprepared, std::slice::from_ref(&uid));
    assert_eq!(running.plugin.seen().unprepared, [claims[0].uid.clone()]);
    assert!(kubelet.prepared(&uid).is_none());

    // The socket goes away: the plugin is forgotten.
    std::fs::remove_file(&running.registration).expect("remove");
    kubelet
        .wait_plugins("the plugin to go", |ps| ps.is_empty())
        .await
        .expect("forgotten");
}

#[tokio::test]
async fn a_v1beta1_plugin_is_called_through_v1beta1_and_a_wrong_type_is_refused() {
    let server = cluster().await;
    let (_dir, running, kubelet) = plugin_and_kubelet(&server, "DRAPlugin", &[v1beta1::SERVICE]);
    kubelet.wait_registered(DRIVER).await.expect("registers");
    server.create_object(pod("p")).expect("pod");
    crate::support::dra::allocate_one(&server).await;
    let claims = kubelet.prepare_pod("default", "p").await.expect("prepares");
    assert_eq!(claims[0].service, v1beta1::SERVICE);
    let ClaimOutcome::Prepared(devices) = &claims[0].outcome else {
        panic!("prepared: {claims:?}");
    };
    assert_eq!(devices[0].share_id, None, "v1beta1 has no share id");
    drop(running);

    let (_dir, wrong, kubelet) = plugin_and_kubelet(&server, "CSIPlugin", &[v1::SERVICE]);
    let plugins = kubelet
        .wait_plugins("a refusal", |ps| ps.iter().any(|p| p.error.is_some()))
        .await
        .expect("refused");
    assert!(!plugins[0].registered);
    assert!(
        plugins[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("CSIPlugin"))
    );
    let notified = &wrong.plugin.seen().notified;
    assert!(
        notified
            .iter()
            .any(|s| !s.plugin_registered && s.error.contains("CSIPlugin")),
        "{notified:?}"
    );
}

/// A registration that fails is tried again, as kubelet's reconciler does: a plugin whose
/// registration socket answers before its endpoint is served (or a socket found between its
/// `bind` and `listen`) is registered once it serves. Before, the fake kubelet gave up at the
/// first failure and a chart test waited 60 s for a registration that never came.
#[tokio::test]
async fn a_failed_registration_is_tried_again_until_the_plugin_serves() {
    let server = cluster().await;
    let dir = short_tempdir();
    let registry = dir.path().join("registry");
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&registry).expect("registry dir");
    std::fs::create_dir_all(&plugin_dir).expect("plugin dir");
    let endpoint = plugin_dir.join("dra.sock");
    let (_health_tx, health) = watch::channel(Vec::new());
    let plugin = TestPlugin {
        name: DRIVER.into(),
        kind: "DRAPlugin".into(),
        endpoint: endpoint.clone(),
        versions: vec![v1::SERVICE.to_string()],
        api: server.admin_client(),
        seen: Arc::default(),
        health,
    };
    // The registration socket first; the endpoint is not served yet.
    let reg = tokio::net::UnixListener::bind(registry.join(format!("{DRIVER}-reg.sock")))
        .expect("bind reg.sock");
    let reg_task = serve(
        reg,
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone())),
    );
    let kubelet =
        DraKubelet::start(&registry, "node-a", server.admin_client()).expect("the DRA kubelet");
    let plugins = kubelet
        .wait_plugins("a failed registration", |ps| {
            ps.iter().any(|p| p.error.is_some())
        })
        .await
        .expect("refused while the endpoint is not served");
    assert!(!plugins[0].registered);
    assert!(
        plugins[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("dialing the endpoint")),
        "{plugins:?}"
    );
    // The plugin serves its endpoint now.
    let service = tokio::net::UnixListener::bind(&endpoint).expect("bind dra.sock");
    let service_task = serve(
        service,
        tonic::transport::Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(plugin.clone())),
    );
    let info = kubelet
        .wait_registered(DRIVER)
        .await
        .expect("registered on a later try");
    assert_eq!(info.error, None);
    let notified = plugin.seen().notified.clone();
    assert!(
        notified.first().is_some_and(|s| !s.plugin_registered)
            && notified.last().is_some_and(|s| s.plugin_registered),
        "told it was refused, then registered: {notified:?}"
    );
    reg_task.abort();
    service_task.abort();
}

/// The Python grpcio DRA kubelet against the tonic plugin, with the socket path as
/// `:authority` (kubelet <= 1.25) and with `localhost`.
#[tokio::test]
async fn grpcio_dra_kubelet_registers_prepares_watches_health_and_unprepares() {
    let Some(python) = clients::grpcio_python() else {
        return;
    };
    let server = cluster().await;
    server.create_object(pod("p")).expect("pod");
    crate::support::dra::allocate_one(&server).await;
    let claims: Vec<ResourceClaim> =
        Api::<ResourceClaim>::namespaced(server.admin_client(), "default")
            .list(&Default::default())
            .await
            .expect("claims")
            .items;
    let claim = &claims[0];
    let uid = claim.metadata.uid.clone().expect("uid");
    let name = claim.metadata.name.clone().expect("name");
    let dir = short_tempdir();
    let running = start_plugin(
        dir.path(),
        server.admin_client(),
        "DRAPlugin",
        &[v1::SERVICE, v1beta1::SERVICE, health_v1::SERVICE],
    );
    for authority in ["path", "localhost"] {
        let claim = format!("default/{uid}/{name}");
        let args = clients::grpcio_round(authority, &[], &[&claim, "default/no-such-uid/gone"]);
        let report = clients::dra_kubelet_grpcio(&python, &running.registration, &args).await;
        assert_eq!(report["info"]["type"], "DRAPlugin");
        assert_eq!(report["info"]["name"], DRIVER);
        assert_eq!(report["api"], "v1");
        let prepared = &report["prepare"][&uid];
        assert_eq!(prepared["error"], "", "{report}");
        assert_eq!(prepared["devices"][0]["device"], "gpu-0");
        assert!(prepared["devices"][0]["share_id"].is_string(), "{report}");
        assert!(
            report["prepare"]["no-such-uid"]["error"]
                .as_str()
                .is_some_and(|e| !e.is_empty()),
            "a claim that does not exist gets its own error: {report}"
        );
        assert_eq!(report["health"][0]["health"], "HEALTHY");
        assert_eq!(report["health_api"], "health_v1");
        assert_eq!(report["unprepare"][&uid], "");
    }
    let seen = running.plugin.seen();
    assert!(seen.notified.iter().filter(|s| s.plugin_registered).count() >= 2);
    let prepared: BTreeSet<&String> = seen.prepared.iter().collect();
    assert!(prepared.contains(&uid));
}
