//! A fake kubelet's DRA side for tests and `gpushare demo` — never for production.
//!
//! What it does, as kubelet's plugin manager and DRA manager do:
//! - watches a registry directory (kubelet's `plugins_registry`) for `*-reg.sock` sockets;
//!   for each new one it calls `Registration.GetInfo`, checks the answer (type `DRAPlugin`, a
//!   driver name, an endpoint, a `DRAPlugin` service it can speak), dials the endpoint and
//!   answers `NotifyRegistrationStatus` (registered, or the reason it is not). A registration
//!   that failed is tried again, with kubelet's backoff (0.5 s doubling to 2 min 2 s): a
//!   socket found between its `bind` and `listen`, or whose endpoint is not served yet, is
//!   registered later. A socket that disappears unregisters its plugin;
//! - for a pod bound to its node whose claims are allocated ([`DraKubelet::prepare_pod`]),
//!   calls `NodePrepareResources` on each driver named in the claims' allocation results —
//!   `v1.DRAPlugin` when the plugin lists it, else `v1beta1.DRAPlugin` — with the claims'
//!   namespace, uid and name only, and records the per-claim answers (devices, CDI ids,
//!   share ids, or the claim's error);
//! - [`DraKubelet::unprepare_pod`] calls `NodeUnprepareResources` with what it recorded, so
//!   it works after the claim is gone, as kubelet's checkpoint makes it;
//! - [`DraKubelet::sync`] does both for every pod of its node (prepare the new ones with
//!   allocated claims, unprepare the finished or vanished ones); [`DraKubelet::spawn_sync`]
//!   repeats it;
//! - reads `NodeWatchResources` (`v1.DRAResourceHealth`, else `v1alpha1`) of each plugin that
//!   lists it and keeps the latest complete device list ([`DraPluginInfo::health`]).
//!
//! What it does not: run containers or hand CDI devices to a runtime, its own checkpoint
//! file, rolling-update sockets (`<driver>-<uid>-reg.sock` is treated like any other), the
//! grace periods of a vanished plugin, pod status updates from health, or the device-plugin
//! side (`crate::kubelet`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::ListParams;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use gpushare_kubelet_api::dra::{health_v1, health_v1alpha1, v1, v1beta1};
use gpushare_kubelet_api::pluginregistration::registration_client::RegistrationClient;
use gpushare_kubelet_api::pluginregistration::{DRA_PLUGIN_TYPE, InfoRequest, RegistrationStatus};

use crate::kubelet::{WAIT_DEADLINE, dial_unix};

/// How often the registry directory is scanned.
const SCAN_PERIOD: Duration = Duration::from_millis(20);
/// The wait before a failed registration is tried again, doubled after each failure up to
/// [`RETRY_MAX`] (kubelet's operation executor: `initialDurationBeforeRetry`,
/// `maxDurationBeforeRetry`).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(122);
/// How long one call to a plugin may take (kubelet's own deadline for a DRA call).
const CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// What the kubelet knows about one plugin that announced itself.
#[derive(Clone, Debug, PartialEq)]
pub struct DraPluginInfo {
    /// The registration socket it was found by.
    pub registration_socket: PathBuf,
    /// `PluginInfo.name`: the driver name.
    pub driver: String,
    /// `PluginInfo.endpoint`: the DRA service socket.
    pub endpoint: PathBuf,
    /// `PluginInfo.supported_versions`.
    pub versions: Vec<String>,
    /// Whether registration succeeded (what `NotifyRegistrationStatus` said).
    pub registered: bool,
    /// Why registration failed.
    pub error: Option<String>,
    /// The latest complete device health list from `NodeWatchResources` (empty until one
    /// arrives or when the plugin offers no health service).
    pub health: Vec<DeviceHealth>,
    /// Which health API is read, when any (`v1.DRAResourceHealth`, ...).
    pub health_service: Option<String>,
}

/// One device's health as a plugin reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealth {
    /// The device's pool.
    pub pool: String,
    /// The device's name.
    pub device: String,
    /// `UNKNOWN`, `HEALTHY` or `UNHEALTHY`.
    pub health: String,
    /// The plugin's message.
    pub message: String,
}

/// One device a plugin prepared for a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The requests of the claim it serves.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool: String,
    /// Its name.
    pub device: String,
    /// The CDI device ids to hand to the runtime.
    pub cdi_device_ids: Vec<String>,
    /// The share id (v1 only).
    pub share_id: Option<String>,
}

/// What a plugin answered for one claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Prepared: these devices.
    Prepared(Vec<PreparedDevice>),
    /// The plugin's per-claim error.
    Failed(String),
    /// The plugin's answer had no entry for the claim.
    Missing,
}

/// One claim of a pod, as the kubelet prepared it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedClaim {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// The driver called.
    pub driver: String,
    /// Which API was used (`v1.DRAPlugin` or `v1beta1.DRAPlugin`).
    pub service: String,
    /// What the plugin answered.
    pub outcome: ClaimOutcome,
}

/// What one [`DraKubelet::sync`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Pods prepared, `namespace/name`.
    pub prepared: Vec<String>,
    /// Pods unprepared, by uid.
    pub unprepared: Vec<String>,
}

struct Plugin {
    info: DraPluginInfo,
    channel: Option<Channel>,
    health_task: Option<JoinHandle<()>>,
    /// A failed registration: when it is tried again, and the wait after that one fails too.
    retry: Option<(tokio::time::Instant, Duration)>,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(t) = self.health_task.take() {
            t.abort();
        }
    }
}

#[derive(Default)]
struct State {
    /// By registration socket.
    plugins: BTreeMap<PathBuf, Plugin>,
    /// By pod uid: the pod's `namespace/name` and its prepared claims.
    prepared: HashMap<String, (String, Vec<PreparedClaim>)>,
}

struct Inner {
    registry: PathBuf,
    node: String,
    client: Client,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The sandbox DRA kubelet (see the module docs). Cheap to clone; the registry watcher
/// stops when the last clone is dropped (a [`DraKubelet::spawn_sync`] task holds one).
#[derive(Clone)]
pub struct DraKubelet {
    inner: Arc<Inner>,
    _scanner: Arc<AbortOnDrop>,
}

impl DraKubelet {
    /// Starts watching `registry` (created when missing) for plugins, as the kubelet of
    /// `node`, reading pods and claims through `client`.
    pub fn start(registry: &Path, node: &str, client: Client) -> anyhow::Result<DraKubelet> {
        std::fs::create_dir_all(registry)
            .with_context(|| format!("creating {}", registry.display()))?;
        let (changed, _) = watch::channel(0);
        let inner = Arc::new(Inner {
            registry: registry.to_path_buf(),
            node: node.to_string(),
            client,
            state: Mutex::new(State::default()),
            changed,
        });
        let scanner = tokio::spawn(scan(inner.clone()));
        Ok(DraKubelet {
            inner,
            _scanner: Arc::new(AbortOnDrop(scanner)),
        })
    }

    /// Every plugin that announced itself, registered or not, by registration socket.
    pub fn plugins(&self) -> Vec<DraPluginInfo> {
        self.inner
            .state()
            .plugins
            .values()
            .map(|p| p.info.clone())
            .collect()
    }

    /// Waits until `check` holds for the plugins (or fails after [`WAIT_DEADLINE`]).
    pub async fn wait_plugins(
        &self,
        what: &str,
        check: impl Fn(&[DraPluginInfo]) -> bool,
    ) -> anyhow::Result<Vec<DraPluginInfo>> {
        let mut rx = self.inner.changed.subscribe();
        let wait = async {
            loop {
                let plugins = self.plugins();
                if check(&plugins) {
                    return plugins;
                }
                if rx.changed().await.is_err() {
                    return plugins;
                }
            }
        };
        tokio::time::timeout(WAIT_DEADLINE, wait)
            .await
            .map_err(|_| anyhow!("timed out waiting for {what}: {:?}", self.plugins()))
    }

    /// Waits until `driver` is registered.
    pub async fn wait_registered(&self, driver: &str) -> anyhow::Result<DraPluginInfo> {
        let plugins = self
            .wait_plugins(&format!("{driver} to register"), |ps| {
                ps.iter().any(|p| p.driver == driver && p.registered)
            })
            .await?;
        plugins
            .into_iter()
            .find(|p| p.driver == driver && p.registered)
            .ok_or_else(|| anyhow!("{driver} is not registered"))
    }

    /// The claims recorded for the pod with this uid: prepared, or tried (each outcome says;
    /// a claim whose call got no answer is `Missing`), as kubelet's claim info cache keeps
    /// them until the pod is done and they are unprepared.
    pub fn prepared(&self, pod_uid: &str) -> Option<Vec<PreparedClaim>> {
        self.inner
            .state()
            .prepared
            .get(pod_uid)
            .map(|(_, c)| c.clone())
    }

    /// Prepares the claims of `namespace/name` (bound to this node, claims allocated) and
    /// records the answers; preparing a pod again calls the plugins again (they must be
    /// idempotent) and replaces the record.
    pub async fn prepare_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Vec<PreparedClaim>> {
        let pods: Api<Pod> = Api::namespaced(self.inner.client.clone(), namespace);
        let pod = pods
            .get(name)
            .await
            .with_context(|| format!("reading pod {namespace}/{name}"))?;
        self.prepare(&pod).await
    }

    async fn prepare(&self, pod: &Pod) -> anyhow::Result<Vec<PreparedClaim>> {
        let namespace = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if node != Some(self.inner.node.as_str()) {
            bail!("pod {namespace}/{name} is not bound to {}", self.inner.node);
        }
        let claims_api: Api<ResourceClaim> = Api::namespaced(self.inner.client.clone(), &namespace);
        // driver -> claims (namespace, uid, name)
        let mut by_driver: BTreeMap<String, Vec<(String, String, String)>> = BTreeMap::new();
        for claim_name in pod_claim_names(pod) {
            let claim = claims_api
                .get(&claim_name)
                .await
                .with_context(|| format!("reading claim {namespace}/{claim_name}"))?;
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref())
                .ok_or_else(|| anyhow!("claim {namespace}/{claim_name} is not allocated"))?;
            let drivers: HashSet<&str> = results.iter().map(|r| r.driver.as_str()).collect();
            for d in drivers {
                by_driver.entry(d.to_string()).or_default().push((
                    namespace.clone(),
                    claim.metadata.uid.clone().unwrap_or_default(),
                    claim_name.clone(),
                ));
            }
        }
        // As kubelet's claim info cache: the claims are recorded before the plugins are
        // called, so that a pod that ends without a successful prepare (a lost answer, a
        // plugin killed mid-call) still has its claims unprepared.
        let planned: Vec<PreparedClaim> = by_driver
            .iter()
            .flat_map(|(driver, claims)| {
                claims
                    .iter()
                    .map(move |(namespace, uid, name)| PreparedClaim {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        uid: uid.clone(),
                        driver: driver.clone(),
                        service: String::new(),
                        outcome: ClaimOutcome::Missing,
                    })
            })
            .collect();
        self.inner
            .state()
            .prepared
            .entry(uid.clone())
            .or_insert_with(|| (format!("{namespace}/{name}"), planned));
        let mut out = Vec::new();
        for (driver, claims) in by_driver {
            out.extend(self.prepare_claims(&driver, &claims).await?);
        }
        self.inner
            .state()
            .prepared
            .insert(uid, (format!("{namespace}/{name}"), out.clone()));
        Ok(out)
    }

    /// One `NodePrepareResources` call to `driver` for `claims` (`(namespace, uid, name)`),
    /// as kubelet makes it, recording nothing: what the plugin answered for each claim.
    pub async fn prepare_claims(
        &self,
        driver: &str,
        claims: &[(String, String, String)],
    ) -> anyhow::Result<Vec<PreparedClaim>> {
        let driver = driver.to_string();
        let claims = claims.to_vec();
        let mut out = Vec::new();
        let (channel, versions) = self.channel(&driver)?;
        if versions.iter().any(|v| v == v1::SERVICE) {
            let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
            let request = v1::NodePrepareResourcesRequest {
                claims: claims
                    .iter()
                    .map(|(namespace, uid, name)| v1::Claim {
                        namespace: namespace.clone(),
                        uid: uid.clone(),
                        name: name.clone(),
                    })
                    .collect(),
            };
            let answer = tokio::time::timeout(CALL_TIMEOUT, client.node_prepare_resources(request))
                .await
                .map_err(|_| anyhow!("NodePrepareResources on {driver} timed out"))?
                .with_context(|| format!("NodePrepareResources on {driver}"))?
                .into_inner();
            for (namespace, uid, name) in claims {
                let outcome = match answer.claims.get(&uid) {
                    None => ClaimOutcome::Missing,
                    Some(r) if !r.error.is_empty() => ClaimOutcome::Failed(r.error.clone()),
                    Some(r) => ClaimOutcome::Prepared(
                        r.devices
                            .iter()
                            .map(|d| PreparedDevice {
                                request_names: d.request_names.clone(),
                                pool: d.pool_name.clone(),
                                device: d.device_name.clone(),
                                cdi_device_ids: d.cdi_device_ids.clone(),
                                share_id: d.share_id.clone(),
                            })
                            .collect(),
                    ),
                };
                out.push(PreparedClaim {
                    namespace,
                    name,
                    uid,
                    driver: driver.clone(),
                    service: v1::SERVICE.into(),
                    outcome,
                });
            }
        } else {
            let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
            let request = v1beta1::NodePrepareResourcesRequest {
                claims: claims
                    .iter()
                    .map(|(namespace, uid, name)| v1beta1::Claim {
                        namespace: namespace.clone(),
                        uid: uid.clone(),
                        name: name.clone(),
                    })
                    .collect(),
            };
            let answer = tokio::time::timeout(CALL_TIMEOUT, client.node_prepare_resources(request))
                .await
                .map_err(|_| anyhow!("NodePrepareResources on {driver} timed out"))?
                .with_context(|| format!("NodePrepareResources (v1beta1) on {driver}"))?
                .into_inner();
            for (namespace, uid, name) in claims {
                let outcome = match answer.claims.get(&uid) {
                    None => ClaimOutcome::Missing,
                    Some(r) if !r.error.is_empty() => ClaimOutcome::Failed(r.error.clone()),
                    Some(r) => ClaimOutcome::Prepared(
                        r.devices
                            .iter()
                            .map(|d| PreparedDevice {
                                request_names: d.request_names.clone(),
                                pool: d.pool_name.clone(),
                                device: d.device_name.clone(),
                                cdi_device_ids: d.cdi_device_ids.clone(),
                                share_id: None,
                            })
                            .collect(),
                    ),
                };
                out.push(PreparedClaim {
                    namespace,
                    name,
                    uid,
                    driver: driver.clone(),
                    service: v1beta1::SERVICE.into(),
                    outcome,
                });
            }
        }
        Ok(out)
    }

    /// Unprepares every claim recorded for the pod with this uid (the claims need not exist
    /// any more) and forgets the record; returns each claim's error, empty when none.
    pub async fn unprepare_pod(&self, pod_uid: &str) -> anyhow::Result<Vec<(String, String)>> {
        let claims = self
            .inner
            .state()
            .prepared
            .get(pod_uid)
            .map(|(_, c)| c.clone())
            .ok_or_else(|| anyhow!("nothing prepared for pod {pod_uid}"))?;
        let mut by_driver: BTreeMap<String, Vec<&PreparedClaim>> = BTreeMap::new();
        for c in &claims {
            by_driver.entry(c.driver.clone()).or_default().push(c);
        }
        let mut errors = Vec::new();
        for (driver, claims) in by_driver {
            let refs: Vec<(String, String, String)> = claims
                .iter()
                .map(|c| (c.namespace.clone(), c.uid.clone(), c.name.clone()))
                .collect();
            let answers = self.unprepare_claims(&driver, &refs).await?;
            for c in claims {
                match answers.get(&c.uid) {
                    Some(e) if e.is_empty() => {}
                    Some(e) => errors.push((c.uid.clone(), e.clone())),
                    None => errors.push((c.uid.clone(), "no answer for the claim".into())),
                }
            }
        }
        if errors.is_empty() {
            self.inner.state().prepared.remove(pod_uid);
        }
        Ok(errors)
    }

    /// One `NodeUnprepareResources` call to `driver` for `claims` (`(namespace, uid, name)`),
    /// recording nothing: each claim's error by uid, empty when done.
    pub async fn unprepare_claims(
        &self,
        driver: &str,
        claims: &[(String, String, String)],
    ) -> anyhow::Result<HashMap<String, String>> {
        let (channel, versions) = self.channel(driver)?;
        let answers: HashMap<String, String> = if versions.iter().any(|v| v == v1::SERVICE) {
            let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
            let request = v1::NodeUnprepareResourcesRequest {
                claims: claims
                    .iter()
                    .map(|(namespace, uid, name)| v1::Claim {
                        namespace: namespace.clone(),
                        uid: uid.clone(),
                        name: name.clone(),
                    })
                    .collect(),
            };
            tokio::time::timeout(CALL_TIMEOUT, client.node_unprepare_resources(request))
                .await
                .map_err(|_| anyhow!("NodeUnprepareResources on {driver} timed out"))?
                .with_context(|| format!("NodeUnprepareResources on {driver}"))?
                .into_inner()
                .claims
                .into_iter()
                .map(|(k, v)| (k, v.error))
                .collect()
        } else {
            let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
            let request = v1beta1::NodeUnprepareResourcesRequest {
                claims: claims
                    .iter()
                    .map(|(namespace, uid, name)| v1beta1::Claim {
                        namespace: namespace.clone(),
                        uid: uid.clone(),
                        name: name.clone(),
                    })
                    .collect(),
            };
            tokio::time::timeout(CALL_TIMEOUT, client.node_unprepare_resources(request))
                .await
                .map_err(|_| anyhow!("NodeUnprepareResources on {driver} timed out"))?
                .with_context(|| format!("NodeUnprepareResources (v1beta1) on {driver}"))?
                .into_inner()
                .claims
                .into_iter()
                .map(|(k, v)| (k, v.error))
                .collect()
        };
        Ok(answers)
    }

    /// One pass over the pods of this node: prepares those not prepared yet whose claims are
    /// all allocated; unprepares those prepared whose pods are finished or gone.
    pub async fn sync(&self) -> anyhow::Result<SyncReport> {
        let mut report = SyncReport::default();
        let pods = Api::<Pod>::all(self.inner.client.clone())
            .list(&ListParams::default().fields(&format!("spec.nodeName={}", self.inner.node)))
            .await
            .context("listing the node's pods")?
            .items;
        let mut live = HashSet::new();
        for pod in &pods {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let done = matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            );
            if done || pod_claim_names(pod).is_empty() {
                continue;
            }
            live.insert(uid.clone());
            let done = self
                .inner
                .state()
                .prepared
                .get(&uid)
                .is_some_and(|(_, claims)| {
                    claims
                        .iter()
                        .all(|c| matches!(c.outcome, ClaimOutcome::Prepared(_)))
                });
            if done {
                continue;
            }
            // Claims not allocated (or not created) yet, or a claim the plugin did not prepare
            // (its error): a later pass tries again, as kubelet does before it starts the pod.
            match self.prepare(pod).await {
                Ok(claims)
                    if claims
                        .iter()
                        .all(|c| matches!(c.outcome, ClaimOutcome::Prepared(_))) =>
                {
                    report.prepared.push(format!(
                        "{}/{}",
                        pod.metadata.namespace.as_deref().unwrap_or_default(),
                        pod.metadata.name.as_deref().unwrap_or_default()
                    ));
                }
                // Recorded: tried again on the next pass while the pod lives, unprepared when
                // it is done.
                Ok(_) | Err(_) => {}
            }
        }
        let gone: Vec<String> = self
            .inner
            .state()
            .prepared
            .keys()
            .filter(|uid| !live.contains(*uid))
            .cloned()
            .collect();
        for uid in gone {
            if self.unprepare_pod(&uid).await?.is_empty() {
                report.unprepared.push(uid);
            }
        }
        Ok(report)
    }

    /// Runs [`DraKubelet::sync`] every `period` until the handle is aborted.
    pub fn spawn_sync(&self, period: Duration) -> JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                if let Err(e) = this.sync().await {
                    tracing::debug!(error = %e, "sandbox DRA kubelet sync failed");
                }
            }
        })
    }

    fn channel(&self, driver: &str) -> anyhow::Result<(Channel, Vec<String>)> {
        let state = self.inner.state();
        let plugin = state
            .plugins
            .values()
            .find(|p| p.info.driver == driver && p.info.registered)
            .ok_or_else(|| anyhow!("no registered DRA plugin for driver {driver}"))?;
        let channel = plugin
            .channel
            .clone()
            .ok_or_else(|| anyhow!("no connection to {driver}"))?;
        Ok((channel, plugin.info.versions.clone()))
    }
}

/// The names of the pod's claims: direct ones, and those the resourceclaim controller
/// recorded in `status.resourceClaimStatuses` for templates.
fn pod_claim_names(pod: &Pod) -> Vec<String> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default();
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|pc| {
            pc.resource_claim_name.clone().or_else(|| {
                statuses
                    .iter()
                    .find(|s| s.name == pc.name)
                    .and_then(|s| s.resource_claim_name.clone())
            })
        })
        .collect()
}

/// The registry watcher: registers new `*-reg.sock` sockets, forgets vanished ones.
async fn scan(inner: Arc<Inner>) {
    let mut tick = tokio::time::interval(SCAN_PERIOD);
    loop {
        tick.tick().await;
        let mut found = HashSet::new();
        if let Ok(entries) = std::fs::read_dir(&inner.registry) {
            for e in entries.flatten() {
                let path = e.path();
                if path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with("-reg.sock"))
                {
                    found.insert(path);
                }
            }
        }
        let known: Vec<PathBuf> = inner.state().plugins.keys().cloned().collect();
        let mut changed = false;
        for k in &known {
            if !found.contains(k) {
                inner.state().plugins.remove(k);
                changed = true;
            }
        }
        let now = tokio::time::Instant::now();
        for path in found {
            let wait = match inner.state().plugins.get(&path) {
                None => RETRY_FIRST,
                Some(Plugin {
                    retry: Some((at, wait)),
                    ..
                }) if *at <= now => *wait,
                Some(_) => continue,
            };
            let mut plugin = register(&inner, &path).await;
            if !plugin.info.registered {
                plugin.retry = Some((
                    tokio::time::Instant::now() + wait,
                    (wait * 2).min(RETRY_MAX),
                ));
            }
            inner.state().plugins.insert(path, plugin);
            changed = true;
        }
        if changed {
            inner.bump();
        }
    }
}

/// GetInfo, validation, dialing the endpoint, NotifyRegistrationStatus.
async fn register(inner: &Arc<Inner>, socket: &Path) -> Plugin {
    let mut plugin = Plugin {
        info: DraPluginInfo {
            registration_socket: socket.to_path_buf(),
            driver: String::new(),
            endpoint: PathBuf::new(),
            versions: Vec::new(),
            registered: false,
            error: None,
            health: Vec::new(),
            health_service: None,
        },
        channel: None,
        health_task: None,
        retry: None,
    };
    let reg_channel = match dial_unix(socket).await {
        Ok(c) => c,
        Err(e) => {
            plugin.info.error = Some(format!("dialing {}: {e:#}", socket.display()));
            return plugin;
        }
    };
    let mut reg = RegistrationClient::new(reg_channel);
    let info = match tokio::time::timeout(CALL_TIMEOUT, reg.get_info(InfoRequest {})).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(e)) => {
            plugin.info.error = Some(format!("GetInfo: {e}"));
            return plugin;
        }
        Err(_) => {
            plugin.info.error = Some("GetInfo timed out".into());
            return plugin;
        }
    };
    plugin.info.driver = info.name.clone();
    plugin.info.endpoint = PathBuf::from(&info.endpoint);
    plugin.info.versions = info.supported_versions.clone();
    let verdict = validate(&info).map(|_| ());
    let verdict = match verdict {
        Ok(()) => match dial_unix(Path::new(&info.endpoint)).await {
            Ok(c) => {
                plugin.channel = Some(c);
                Ok(())
            }
            Err(e) => Err(format!("dialing the endpoint {}: {e:#}", info.endpoint)),
        },
        Err(e) => Err(e),
    };
    let status = match &verdict {
        Ok(()) => RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        },
        Err(e) => RegistrationStatus {
            plugin_registered: false,
            error: e.clone(),
        },
    };
    // The plugin learns the verdict; a plugin that does not listen any more is its business.
    let _ = tokio::time::timeout(CALL_TIMEOUT, reg.notify_registration_status(status)).await;
    match verdict {
        Ok(()) => {
            plugin.info.registered = true;
            if let Some(channel) = plugin.channel.clone() {
                let service = if info
                    .supported_versions
                    .iter()
                    .any(|v| v == health_v1::SERVICE)
                {
                    Some(health_v1::SERVICE)
                } else if info
                    .supported_versions
                    .iter()
                    .any(|v| v == health_v1alpha1::SERVICE)
                {
                    Some(health_v1alpha1::SERVICE)
                } else {
                    None
                };
                if let Some(service) = service {
                    plugin.info.health_service = Some(service.into());
                    plugin.health_task = Some(tokio::spawn(watch_health(
                        inner.clone(),
                        socket.to_path_buf(),
                        channel,
                        service,
                    )));
                }
            }
        }
        Err(e) => plugin.info.error = Some(e),
    }
    plugin
}

/// What kubelet checks in `GetInfo`'s answer.
fn validate(info: &gpushare_kubelet_api::pluginregistration::PluginInfo) -> Result<(), String> {
    if info.r#type != DRA_PLUGIN_TYPE {
        return Err(format!(
            "plugin type {:?} is not {DRA_PLUGIN_TYPE:?}",
            info.r#type
        ));
    }
    if info.name.is_empty() {
        return Err("the plugin has no name (the driver name)".into());
    }
    if info.endpoint.is_empty() {
        return Err("the plugin has no endpoint".into());
    }
    if !info
        .supported_versions
        .iter()
        .any(|v| v == v1::SERVICE || v == v1beta1::SERVICE)
    {
        return Err(format!(
            "none of the supported versions {:?} is {} or {}",
            info.supported_versions,
            v1::SERVICE,
            v1beta1::SERVICE
        ));
    }
    Ok(())
}

/// Reads `NodeWatchResources` and keeps the latest list on the plugin.
async fn watch_health(inner: Arc<Inner>, socket: PathBuf, channel: Channel, service: &str) {
    let store = |devices: Vec<DeviceHealth>| {
        if let Some(p) = inner.state().plugins.get_mut(&socket) {
            p.info.health = devices;
        }
        inner.bump();
    };
    let name = |h: i32| match h {
        1 => "HEALTHY",
        2 => "UNHEALTHY",
        _ => "UNKNOWN",
    };
    if service == health_v1::SERVICE {
        let mut client =
            health_v1::dra_resource_health_client::DraResourceHealthClient::new(channel);
        let Ok(stream) = client
            .node_watch_resources(health_v1::NodeWatchResourcesRequest {})
            .await
        else {
            return;
        };
        let mut stream = stream.into_inner();
        while let Ok(Some(msg)) = stream.message().await {
            store(
                msg.devices
                    .into_iter()
                    .map(|d| {
                        let id = d.device.unwrap_or_default();
                        DeviceHealth {
                            pool: id.pool_name,
                            device: id.device_name,
                            health: name(d.health).into(),
                            message: d.message,
                        }
                    })
                    .collect(),
            );
        }
    } else {
        let mut client =
            health_v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel);
        let Ok(stream) = client
            .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
            .await
        else {
            return;
        };
        let mut stream = stream.into_inner();
        while let Ok(Some(msg)) = stream.message().await {
            store(
                msg.devices
                    .into_iter()
                    .map(|d| {
                        let id = d.device.unwrap_or_default();
                        DeviceHealth {
                            pool: id.pool_name,
                            device: id.device_name,
                            health: name(d.health).into(),
                            message: d.message,
                        }
                    })
                    .collect(),
            );
        }
    }
}
