//! The chart installed as rendered, in the sandbox: what `helm install` and a cluster do with
//! it, for the chart-mode tier (`tests/it/chart_modes.rs`).
//!
//! 1. The chart is rendered by the real Helm engine with the mode's values
//!    ([`super::helm_chart::install`]), and every object is checked against every Kubernetes
//!    version's schema from 1.34 on ([`super::kube_validate`]).
//! 2. Every rendered object is created in the sandbox API server (which authenticates,
//!    authorizes with the stored RBAC, admits with the stored webhook configurations and
//!    admission policies, and validates `resource.k8s.io` as upstream does), as the
//!    administrator `helm install` runs as. With `webhook.tls.existingSecret` the harness plays
//!    cert-manager: it issues the Secret and injects the CA into both webhook configurations.
//! 3. Each GPU node of the mode is simulated: a host directory, the sandbox kubelet (device
//!    plugins) and the sandbox DRA kubelet, both in the node's `/var/lib/kubelet`.
//! 4. Each pod of a gpushare workload is started as the built binary with exactly its
//!    container's arguments and environment, under a token of its ServiceAccount (pod-bound:
//!    with its node's name), its mounts, defaults and ports mapped as
//!    [`super::container_mapping`] documents: a Deployment's pod once, a DaemonSet's on every
//!    simulated node its node selector and required node affinity select. A container of
//!    another image (the dedicated kube-scheduler) is not run: the harness schedules as it
//!    would, from the rendered KubeSchedulerConfiguration ([`super::chart_workloads`]).
//! 5. Each role must get ready (the extender's and the webhook's `/readyz`, the device plugin
//!    and the DRA plugin registered with their kubelets); a role that exits fails the test
//!    with its log (its container would crash-loop), and so does every request of a role that
//!    the API server refused (401, 403), with the RBAC objects rendered for its
//!    ServiceAccount, template by template.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare::core::wire;
use gpushare_sandbox::apiserver::ApiServer;
use gpushare_sandbox::dra_kubelet::DraKubelet;
use gpushare_sandbox::kubelet::Kubelet;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{NodeSelectorRequirement, PodSpec};
use serde_json::{Value, json};

use super::container_mapping::{self, CannotStart, PodFacts, VolumeSources};
use super::helm_chart::{self, Installed};
use super::kube_validate::{self, Checked};
use super::role_process::RoleProcess;
use super::socket_dir::short_tempdir;

/// The release namespace of every mode.
pub(crate) const NAMESPACE: &str = "kube-system";
/// The node Deployments' pods run on (a control-plane node, no GPU).
pub(crate) const CONTROL_PLANE: &str = "control-plane-1";
/// How long a role has to get ready.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// A GPU node of a mode.
#[derive(Clone, Debug)]
pub(crate) struct SimNodeSpec {
    /// Its name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
}

/// A chart mode: the user's values and the cluster it is installed into.
#[derive(Clone, Debug)]
pub(crate) struct Mode {
    /// What it is called in failures.
    pub name: String,
    /// The values a user passes (`-f` / `--set`).
    pub values: Value,
    /// The GPU nodes.
    pub nodes: Vec<SimNodeSpec>,
    /// The namespaces of the workloads, with their labels.
    pub namespaces: Vec<(String, BTreeMap<String, String>)>,
    /// A recorded sysfs tree every node has (RDMA), else an empty one.
    pub sysfs: Option<PathBuf>,
    /// Fills a node's `/dev` (generic devices, `/dev/infiniband`).
    pub dev: Option<fn(&Path)>,
}

/// A simulated node.
pub(crate) struct SimNode {
    /// Its name.
    pub name: String,
    /// Its host root (`<host>/var/lib/kubelet`, `<host>/var/run/cdi`, ...).
    pub host: PathBuf,
    /// The kubelet's device-plugin side.
    pub kubelet: Kubelet,
    /// The kubelet's DRA side.
    pub dra_kubelet: DraKubelet,
    /// Its sysfs.
    pub sysfs: PathBuf,
}

/// A started pod of a gpushare workload.
pub(crate) struct RolePod {
    /// `DaemonSet/gpushare-dra-plugin`.
    pub workload: String,
    /// The template it was rendered from.
    pub template: String,
    /// The role (the first argument: `extender`, `device-plugin`, `dra-plugin`, `webhook`).
    pub role: String,
    /// The node it runs on.
    pub node: String,
    /// Its ServiceAccount.
    pub service_account: String,
    /// Container port → the loopback port it is mapped to.
    pub ports: BTreeMap<u16, u16>,
    /// Container port name → container port.
    pub port_names: BTreeMap<String, u16>,
    /// The process.
    pub process: RoleProcess,
}

impl RolePod {
    /// The loopback address of container port `port`.
    pub(crate) fn addr(&self, port: u16) -> SocketAddr {
        let mapped = self.ports.get(&port).copied().unwrap_or(port);
        SocketAddr::from(([127, 0, 0, 1], mapped))
    }
}

/// The chart installed and running in the sandbox.
pub(crate) struct ChartCluster {
    /// The mode.
    pub mode: Mode,
    /// The sandbox API server.
    pub api: ApiServer,
    /// What the chart rendered.
    pub installed: Installed,
    /// The simulated GPU nodes.
    pub nodes: Vec<SimNode>,
    /// The pods of the gpushare workloads.
    pub pods: Vec<RolePod>,
    /// The Kubernetes versions every rendered object was checked at.
    pub validated_at: Vec<String>,
    _dir: tempfile::TempDir,
}

/// A free loopback port (bound, then let go).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("addr").port()
}

/// Whether a node with `labels` satisfies `req` (`In`, `NotIn`, `Exists`, `DoesNotExist`).
fn requirement_holds(req: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let have = labels.get(&req.key);
    let values = req.values.clone().unwrap_or_default();
    match req.operator.as_str() {
        "In" => have.is_some_and(|v| values.contains(v)),
        "NotIn" => have.is_none_or(|v| !values.contains(v)),
        "Exists" => have.is_some(),
        "DoesNotExist" => have.is_none(),
        _ => false,
    }
}

/// Whether a DaemonSet pod of `spec` runs on a node with `labels`: its `nodeSelector` and
/// its required node affinity (terms ORed, expressions ANDed).
fn schedules_on(spec: &PodSpec, labels: &BTreeMap<String, String>) -> bool {
    let selector = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .map(|r| r.node_selector_terms.clone());
    let affinity = terms.is_none_or(|terms| {
        terms.iter().any(|t| {
            t.match_expressions
                .iter()
                .flatten()
                .all(|r| requirement_holds(r, labels))
        })
    });
    selector && affinity
}

impl ChartCluster {
    /// Installs `mode` (see the module docs); `None` when a client the tier needs (the Helm
    /// engine, kubernetes-validate) is missing (skipped; CI fails).
    pub(crate) async fn install(mode: Mode) -> Option<ChartCluster> {
        let installed = match helm_chart::install(&mode.values, NAMESPACE)? {
            Ok(i) => i,
            Err(e) => panic!("mode {}: Helm cannot render the chart: {e}", mode.name),
        };
        let as_json: Vec<Value> = installed
            .objects
            .iter()
            .map(|r| serde_json::to_value(&r.object).expect("YAML as JSON"))
            .collect();
        let checked: Vec<Checked<'_>> = installed
            .objects
            .iter()
            .zip(&as_json)
            .map(|(r, object)| Checked {
                label: format!(
                    "{} {} {}",
                    r.template,
                    r.object["kind"].as_str().unwrap_or_default(),
                    r.object["metadata"]["name"].as_str().unwrap_or_default()
                ),
                object,
            })
            .collect();
        let validated_at = kube_validate::assert_valid_at_every_version(&checked)?;
        let dir = short_tempdir();
        let api = ApiServer::start().await.expect("the sandbox API server");
        Self::seed_cluster(&api, &mode);
        for r in &installed.objects {
            let object = serde_json::to_value(&r.object).expect("YAML as JSON");
            if let Err(e) = api.create_object(object) {
                panic!(
                    "mode {}: the API server refuses {} {} of {}: {e:#}",
                    mode.name,
                    r.object["kind"].as_str().unwrap_or_default(),
                    r.object["metadata"]["name"].as_str().unwrap_or_default(),
                    r.template
                );
            }
        }
        if let Some(secret) = mode.values["webhook"]["tls"]["existingSecret"].as_str() {
            play_cert_manager(&api, secret).await;
        }
        let mut nodes = Vec::new();
        for n in &mode.nodes {
            nodes.push(Self::start_node(&api, dir.path(), n, &mode).await);
        }
        let mut cluster = ChartCluster {
            mode,
            api,
            installed,
            nodes,
            pods: Vec::new(),
            validated_at,
            _dir: dir,
        };
        cluster.start_pods();
        cluster.wait_ready().await;
        cluster.publish_node_capacity().await;
        cluster.assert_no_refusals();
        Some(cluster)
    }

    /// The workload namespaces and the nodes (the GPU nodes and the control-plane node).
    fn seed_cluster(api: &ApiServer, mode: &Mode) {
        for (name, labels) in &mode.namespaces {
            let mut labels = labels.clone();
            labels.insert("kubernetes.io/metadata.name".into(), name.clone());
            api.create_object(json!({ "apiVersion": "v1", "kind": "Namespace",
                "metadata": { "name": name, "labels": labels } }))
                .expect("a namespace");
        }
        let mut all = mode.nodes.clone();
        all.push(SimNodeSpec {
            name: CONTROL_PLANE.into(),
            labels: BTreeMap::from([(
                "node-role.kubernetes.io/control-plane".into(),
                String::new(),
            )]),
        });
        for n in &all {
            let mut labels = n.labels.clone();
            labels.insert("kubernetes.io/hostname".into(), n.name.clone());
            api.create_object(json!({ "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": n.name, "labels": labels },
                "status": { "capacity": { "cpu": "8" }, "allocatable": { "cpu": "8" } } }))
                .expect("a node");
        }
    }

    async fn start_node(api: &ApiServer, root: &Path, n: &SimNodeSpec, mode: &Mode) -> SimNode {
        let host = root.join("n").join(&n.name);
        let kubelet_root = host.join("var/lib/kubelet");
        let registry = kubelet_root.join("plugins_registry");
        std::fs::create_dir_all(&registry).expect("the plugin registry");
        std::fs::create_dir_all(host.join("dev")).expect("/dev");
        if let Some(fill) = mode.dev {
            fill(&host.join("dev"));
        }
        let sysfs = match &mode.sysfs {
            Some(tree) => tree.clone(),
            None => {
                let empty = host.join("sys");
                std::fs::create_dir_all(&empty).expect("/sys");
                empty
            }
        };
        let kubelet = Kubelet::start(&kubelet_root)
            .await
            .expect("the sandbox kubelet");
        // The kubelet reads claims as its node; the sandbox has no Node authorizer: the
        // administrator stands in for it.
        let dra_kubelet = DraKubelet::start(&registry, &n.name, api.admin_client())
            .expect("the sandbox DRA kubelet");
        SimNode {
            name: n.name.clone(),
            host,
            kubelet,
            dra_kubelet,
            sysfs,
        }
    }

    /// The rendered ConfigMaps by name.
    fn config_maps(&self) -> BTreeMap<String, Value> {
        self.installed
            .of_kind("ConfigMap")
            .into_iter()
            .map(|c| {
                let j = serde_json::to_value(c).expect("json");
                (
                    j["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    j,
                )
            })
            .collect()
    }

    /// The Secrets of the release namespace, as the API holds them.
    fn secrets(&self) -> BTreeMap<String, Value> {
        self.api
            .list_objects("secrets", Some(NAMESPACE))
            .into_iter()
            .map(|s| {
                (
                    s["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    s,
                )
            })
            .collect()
    }

    /// Starts every pod of every gpushare workload (see the module docs).
    fn start_pods(&mut self) {
        let image = self.gpushare_image();
        let mut planned: Vec<(String, String, PodSpec, String)> = Vec::new();
        for r in &self.installed.objects {
            let kind = r.object["kind"].as_str().unwrap_or_default();
            let name = r.object["metadata"]["name"].as_str().unwrap_or_default();
            let spec = match kind {
                "Deployment" => yaml_serde::from_value::<Deployment>(r.object.clone())
                    .ok()
                    .map(|d| d.spec)
                    .and_then(|s| s.template.spec),
                "DaemonSet" => yaml_serde::from_value::<DaemonSet>(r.object.clone())
                    .ok()
                    .map(|d| d.spec)
                    .and_then(|s| s.template.spec),
                _ => continue,
            };
            let spec =
                spec.unwrap_or_else(|| panic!("{kind} {name} of {} has no pod spec", r.template));
            let runs_gpushare = spec
                .containers
                .iter()
                .any(|c| c.image.as_deref() == Some(&image));
            if !runs_gpushare {
                continue;
            }
            let nodes: Vec<String> = if kind == "Deployment" {
                vec![CONTROL_PLANE.to_string()]
            } else {
                self.mode
                    .nodes
                    .iter()
                    .filter(|n| schedules_on(&spec, &n.labels))
                    .map(|n| n.name.clone())
                    .collect()
            };
            for node in nodes {
                planned.push((
                    format!("{kind}/{name}"),
                    r.template.clone(),
                    spec.clone(),
                    node,
                ));
            }
        }
        let config_maps = self.config_maps();
        let secrets = self.secrets();
        for (workload, template, spec, node) in planned {
            let pod = self.start_pod(
                &workload,
                &template,
                &spec,
                &node,
                &image,
                &config_maps,
                &secrets,
            );
            self.pods.push(pod);
        }
    }

    fn gpushare_image(&self) -> String {
        let v = &self.mode.values["image"];
        let repo = v["repository"]
            .as_str()
            .unwrap_or("ghcr.io/gpushare/gpushare");
        let deployment = self
            .installed
            .find("Deployment", "gpushare-schd-extender")
            .map(|d| serde_json::to_value(d).expect("json"));
        deployment
            .and_then(|d| {
                d["spec"]["template"]["spec"]["containers"][0]["image"]
                    .as_str()
                    .map(str::to_string)
            })
            .unwrap_or_else(|| repo.to_string())
    }

    #[allow(clippy::too_many_arguments)]
    fn start_pod(
        &self,
        workload: &str,
        template: &str,
        spec: &PodSpec,
        node: &str,
        image: &str,
        config_maps: &BTreeMap<String, Value>,
        secrets: &BTreeMap<String, Value>,
    ) -> RolePod {
        let c = spec
            .containers
            .iter()
            .find(|c| c.image.as_deref() == Some(image))
            .expect("the gpushare container");
        let pod_name = format!(
            "{}-{}",
            workload.rsplit('/').next().unwrap_or(workload),
            node
        );
        let pod_dir = self._dir.path().join("p").join(&pod_name);
        let node_host = self
            .nodes
            .iter()
            .find(|n| n.name == node)
            .map(|n| n.host.clone())
            .unwrap_or_else(|| self._dir.path().join("n").join(node));
        let sysfs = self
            .nodes
            .iter()
            .find(|n| n.name == node)
            .map(|n| n.sysfs.clone())
            .unwrap_or_else(|| node_host.join("sys"));
        std::fs::create_dir_all(&sysfs).expect("/sys");
        let fail = |e: CannotStart| -> ! {
            panic!(
                "mode {}: the pod of {workload} ({template}) on {node} cannot start: {}",
                self.mode.name, e.0
            )
        };
        let mounts = container_mapping::mounts(
            spec,
            c,
            &VolumeSources {
                config_maps,
                secrets,
                node_host: &node_host,
                pod_dir: &pod_dir,
            },
        )
        .unwrap_or_else(|e| fail(e));
        let mut ports = BTreeMap::new();
        let mut port_names = BTreeMap::new();
        for p in c.ports.iter().flatten() {
            let inside = u16::try_from(p.container_port).expect("a port");
            ports.insert(inside, free_port());
            if let Some(n) = &p.name {
                port_names.insert(n.clone(), inside);
            }
        }
        let args: Vec<String> = c
            .command
            .iter()
            .flatten()
            .skip(1)
            .chain(c.args.iter().flatten())
            .map(|a| container_mapping::map_value(a, &mounts, &ports))
            .collect();
        let service_account = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let kubeconfig = self
            .api
            .service_account_kubeconfig(NAMESPACE, &service_account, Some(node))
            .expect("a pod-bound token of the ServiceAccount");
        let facts = PodFacts {
            name: &pod_name,
            namespace: NAMESPACE,
            node,
        };
        let mut env =
            container_mapping::environment(c, &facts, &mounts, &ports).unwrap_or_else(|e| fail(e));
        let added = container_mapping::mapped_defaults(&env, &mounts, &sysfs, &kubeconfig);
        env.extend(added);
        let role = c.args.iter().flatten().next().cloned().unwrap_or_default();
        let process = RoleProcess::start(&format!("{workload} on {node}"), None, &args, &env);
        RolePod {
            workload: workload.to_string(),
            template: template.to_string(),
            role,
            node: node.to_string(),
            service_account,
            ports,
            port_names,
            process,
        }
    }

    /// Waits until every role is ready (see the module docs); routes the webhook Service.
    async fn wait_ready(&mut self) {
        for i in 0..self.pods.len() {
            let role = self.pods[i].role.clone();
            match role.as_str() {
                "extender" | "webhook" => {
                    let port = self.pods[i]
                        .port_names
                        .values()
                        .next()
                        .copied()
                        .expect("a container port");
                    let addr = self.pods[i].addr(port);
                    if role == "webhook" {
                        self.api.route_service(NAMESPACE, "gpushare-webhook", addr);
                    }
                    let pod = &mut self.pods[i];
                    pod.process
                        .wait_for("its port to answer", READY_WITHIN, || {
                            std::net::TcpStream::connect(addr).is_ok()
                        })
                        .await;
                    if role == "extender" {
                        wait_http_ready(pod, addr).await;
                    }
                }
                "device-plugin" => {
                    let node = self.pods[i].node.clone();
                    let kubelet = &self
                        .nodes
                        .iter()
                        .find(|n| n.name == node)
                        .expect("its node")
                        .kubelet;
                    let pod = &mut self.pods[i];
                    pod.process
                        .wait_for("its registration with the kubelet", READY_WITHIN, || {
                            !kubelet.devices(wire::RESOURCE_GPU_MEM).is_empty()
                        })
                        .await;
                }
                "dra-plugin" => {
                    let node = self.pods[i].node.clone();
                    let driver = self.driver();
                    let dra = &self
                        .nodes
                        .iter()
                        .find(|n| n.name == node)
                        .expect("its node")
                        .dra_kubelet;
                    let pod = &mut self.pods[i];
                    pod.process
                        .wait_for_seen(
                            "its registration with the kubelet",
                            READY_WITHIN,
                            || {
                                dra.plugins()
                                    .iter()
                                    .any(|p| p.driver == driver && p.registered)
                            },
                            || format!("the kubelet's plugins {:?}", dra.plugins()),
                        )
                        .await;
                }
                other => panic!("a gpushare container whose role is {other:?}"),
            }
        }
        if self.pods.iter().any(|p| p.role == "webhook") {
            self.wait_ca_bundles().await;
        }
    }

    /// The webhook configurations carry a CA (written by `--self-signed`, or injected).
    async fn wait_ca_bundles(&mut self) {
        let api = &self.api;
        let bundled = || {
            [
                "mutatingwebhookconfigurations",
                "validatingwebhookconfigurations",
            ]
            .iter()
            .all(|r| {
                api.get_object(r, None, "gpushare-webhook")
                    .is_some_and(|c| {
                        c["webhooks"][0]["clientConfig"]["caBundle"]
                            .as_str()
                            .is_some_and(|b| !b.is_empty())
                    })
            })
        };
        let webhook = self
            .pods
            .iter_mut()
            .find(|p| p.role == "webhook")
            .expect("the webhook");
        webhook
            .process
            .wait_for(
                "the caBundle of both webhook configurations",
                READY_WITHIN,
                bundled,
            )
            .await;
    }

    /// The simulated node `name`.
    pub(crate) fn node(&self, name: &str) -> &SimNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no simulated node {name}"))
    }

    /// The DRA driver the mode installs.
    pub(crate) fn driver(&self) -> String {
        self.mode.values["dra"]["driverName"]
            .as_str()
            .unwrap_or(wire::DRA_DRIVER_NAME)
            .to_string()
    }

    /// What the kubelet reports for a node whose device plugins registered: each resource's
    /// device count as the node's capacity and allocatable (a status patch as the kubelet
    /// writes it; the administrator stands in for the node's identity).
    async fn publish_node_capacity(&self) {
        use k8s_openapi::api::core::v1::Node;
        use kube::api::{Patch, PatchParams};
        let nodes: kube::Api<Node> = kube::Api::all(self.api.admin_client());
        for n in &self.nodes {
            let mut resources = serde_json::Map::new();
            resources.insert("cpu".into(), json!("8"));
            for resource in [
                wire::RESOURCE_GPU_MEM.to_string(),
                "gpushare.io/rdma".to_string(),
            ]
            .into_iter()
            .chain(self.generic_resources())
            {
                let count = n.kubelet.devices(&resource).len();
                if count > 0 {
                    resources.insert(resource, json!(count.to_string()));
                }
            }
            let patch = json!({ "status": { "capacity": resources, "allocatable": resources } });
            nodes
                .patch_status(&n.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("the node's capacity");
        }
    }

    /// The resources of the generic devices the mode declares.
    pub(crate) fn generic_resources(&self) -> Vec<String> {
        self.mode.values["config"]["devices"]["generic"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|g| g["resource"].as_str().map(str::to_string))
            .collect()
    }

    /// Fails the test on a role that exited, and on every request of a role's ServiceAccount
    /// the API server refused for its identity (401) or its RBAC (403): the request, and the
    /// RBAC objects rendered for that ServiceAccount, with their templates.
    pub(crate) fn assert_no_refusals(&mut self) {
        for p in &mut self.pods {
            p.process.assert_running();
        }
        let findings = self.refusals();
        assert!(
            findings.is_empty(),
            "mode {}: the API server refused requests of the chart's roles:\n{}",
            self.mode.name,
            findings.join("\n")
        );
    }

    /// Each request of a role's ServiceAccount refused for its identity (401) or its RBAC
    /// (403), with the RBAC objects rendered for that ServiceAccount.
    pub(crate) fn refusals(&self) -> Vec<String> {
        let mut findings = Vec::new();
        for r in self.api.refusals() {
            let user = r.username.clone().unwrap_or_else(|| "<no identity>".into());
            let Some(pod) = self.pods.iter().find(|p| {
                user == format!("system:serviceaccount:{NAMESPACE}:{}", p.service_account)
            }) else {
                continue;
            };
            findings.push(format!(
                "{} for {} ({}, {user}): {} {}{}: {}",
                r.code,
                pod.workload,
                pod.template,
                r.method,
                r.path,
                if r.query.is_empty() {
                    String::new()
                } else {
                    format!("?{}", r.query)
                },
                r.message
            ));
            findings.push(self.rbac_of(&pod.service_account));
        }
        findings.dedup();
        findings
    }

    /// The rendered RBAC of ServiceAccount `sa`: each binding naming it and the rules of the
    /// role it binds, with their templates.
    fn rbac_of(&self, sa: &str) -> String {
        let mut out = vec![format!(
            "  the RBAC the chart renders for ServiceAccount {sa}:"
        )];
        for b in &self.installed.objects {
            let kind = b.object["kind"].as_str().unwrap_or_default();
            if kind != "RoleBinding" && kind != "ClusterRoleBinding" {
                continue;
            }
            let names_it = b.object["subjects"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|s| s["name"].as_str() == Some(sa));
            if !names_it {
                continue;
            }
            let role_kind = b.object["roleRef"]["kind"].as_str().unwrap_or_default();
            let role_name = b.object["roleRef"]["name"].as_str().unwrap_or_default();
            out.push(format!(
                "    {kind} {} ({}) → {role_kind} {role_name}",
                b.object["metadata"]["name"].as_str().unwrap_or_default(),
                b.template
            ));
            if let Some(role) = self.installed.objects.iter().find(|r| {
                r.object["kind"].as_str() == Some(role_kind)
                    && r.object["metadata"]["name"].as_str() == Some(role_name)
            }) {
                let rules = serde_json::to_string(
                    &serde_json::to_value(&role.object["rules"]).unwrap_or_default(),
                )
                .unwrap_or_default();
                out.push(format!(
                    "      rules of {} ({}): {rules}",
                    role_name, role.template
                ));
            }
        }
        out.join("\n")
    }

    /// What the roles created in the API as they ran (ResourceSlices, ResourceClaimTemplates,
    /// Leases, Secrets, Events), each checked as the rendered objects are: every Kubernetes
    /// version's schema from 1.34 on, strictly.
    fn assert_created_objects_valid(&self) {
        let mut created: Vec<(String, Value)> = Vec::new();
        for (resource, namespace) in [
            ("resourceslices", None),
            ("resourceclaimtemplates", None),
            ("leases", Some(NAMESPACE)),
            ("secrets", Some(NAMESPACE)),
            ("events.events.k8s.io", None),
        ] {
            for o in self.api.list_objects(resource, namespace) {
                let label = format!(
                    "created at run time: {} {}/{}",
                    o["kind"].as_str().unwrap_or(resource),
                    o["metadata"]["namespace"].as_str().unwrap_or_default(),
                    o["metadata"]["name"].as_str().unwrap_or_default()
                );
                created.push((label, o));
            }
        }
        assert!(
            created.iter().any(|(label, _)| label.contains("Lease")),
            "mode {}: the extender's Lease was made: {:?}",
            self.mode.name,
            created.iter().map(|(l, _)| l).collect::<Vec<_>>()
        );
        let checked: Vec<Checked<'_>> = created
            .iter()
            .map(|(label, object)| Checked {
                label: label.clone(),
                object,
            })
            .collect();
        kube_validate::assert_valid_at_every_version(&checked);
    }

    /// Checks that nothing was refused and that what the roles created is valid, stops every
    /// role and the sandbox.
    pub(crate) async fn finish(mut self) {
        self.assert_no_refusals();
        self.assert_created_objects_valid();
        self.pods.clear();
        for n in self.nodes.drain(..) {
            n.kubelet.stop().await;
        }
        self.api.shutdown().await;
    }
}

/// Waits for `GET /readyz` of the extender at `addr` to answer 200.
async fn wait_http_ready(pod: &mut RolePod, addr: SocketAddr) {
    let end = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        let (code, _) = super::extender_http::get(addr, "/readyz").await;
        if code == 200 {
            return;
        }
        pod.process.assert_running();
        assert!(
            tokio::time::Instant::now() < end,
            "{} never got ready ({code}); its log:\n{}",
            pod.workload,
            pod.process.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What cert-manager does for `webhook.tls.existingSecret`: a CA, a `kubernetes.io/tls`
/// Secret for `gpushare-webhook.<ns>.svc` signed by it, and the CA injected into both webhook
/// configurations (the chart's `cert-manager.io/inject-ca-from` annotation).
async fn play_cert_manager(api: &ApiServer, secret: &str) {
    use base64::Engine as _;
    use gpushare::webhook::certs;
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let now = std::time::SystemTime::now();
    let ca = certs::issue_ca(now, Duration::from_secs(86_400)).expect("a CA");
    let serving = certs::issue_serving(
        &ca,
        &certs::service_dns_names("gpushare-webhook", NAMESPACE),
        now - Duration::from_secs(60),
        now + Duration::from_secs(86_400),
    )
    .expect("a serving certificate");
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    api.create_object(json!({ "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": { "name": secret, "namespace": NAMESPACE },
        "data": { "tls.crt": b64(&serving.cert), "tls.key": b64(&serving.key), "ca.crt": b64(&ca.cert) } }))
        .expect("the cert-manager Secret");
    // cainjector's write: every webhook's clientConfig.caBundle (a merge patch replaces the
    // list, so the list is sent whole).
    let bundle = b64(&ca.cert);
    inject_ca::<MutatingWebhookConfiguration>(api, &bundle).await;
    inject_ca::<ValidatingWebhookConfiguration>(api, &bundle).await;
}

/// Sets `bundle` as the caBundle of every webhook of configuration `gpushare-webhook` of kind
/// `K` (mutating or validating), as cainjector writes it.
async fn inject_ca<K>(api: &ApiServer, bundle: &str)
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let configs: kube::Api<K> = kube::Api::all(api.admin_client());
    let stored = configs
        .get("gpushare-webhook")
        .await
        .expect("the webhook configuration");
    let mut hooks = serde_json::to_value(&stored).expect("json")["webhooks"].take();
    for h in hooks.as_array_mut().into_iter().flatten() {
        h["clientConfig"]["caBundle"] = json!(bundle);
    }
    configs
        .patch(
            "gpushare-webhook",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&json!({ "webhooks": hooks })),
        )
        .await
        .expect("the CA injected");
}
