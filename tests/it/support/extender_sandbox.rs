//! One extender in this process over a fresh sandbox API server, as the extender and settle
//! tests drive it: the loopback configuration, the start (the sandbox seeded first, the
//! extender ready), a second extender on the same API state, and the scheduling verbs and
//! API reads those tests repeat. The HTTP client is [`super::extender_http`]'s; several
//! replicas with lease timings are [`super::extender_cluster`]'s.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use gpushare::config::Config;
use gpushare::extender::{self, ExtenderHandle};
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};
use serde_json::{Value, json};

use super::extender_http::{inspect, post};
use super::objects::gpu_node;
use super::wait::eventually;

/// A sandbox API server and one extender serving over it.
pub(crate) struct Env {
    pub(crate) api: ApiServer,
    pub(crate) ext: ExtenderHandle,
}

/// The extender on loopback, any port, a 3 s bind budget, no preflight.
pub(crate) fn config() -> Config {
    let mut c = Config::default();
    c.extender.bind_address = [127, 0, 0, 1].into();
    c.extender.port = 0;
    c.extender.bind_timeout_ms = 3000;
    c.doctor.skip = true;
    c
}

impl Env {
    /// A sandbox seeded by `seed`, then an extender with `config` over it, ready.
    pub(crate) async fn start_with(config: Config, seed: impl FnOnce(&ApiServer)) -> Env {
        let api = ApiServer::start().await.expect("sandbox API server starts");
        seed(&api);
        let ext = extender::start(&config, api.admin_client(), Shutdown::never())
            .await
            .expect("extender starts");
        ext.wait_ready().await.expect("extender becomes ready");
        Env { api, ext }
    }

    /// A second extender on the same API state.
    pub(crate) async fn another(&self) -> ExtenderHandle {
        self.another_with(&config()).await
    }

    /// Another extender with `config` on the same API state (a restart, when the first one
    /// was stopped), ready.
    pub(crate) async fn another_with(&self, config: &Config) -> ExtenderHandle {
        let ext = extender::start(config, self.api.admin_client(), Shutdown::never())
            .await
            .expect("another extender starts");
        ext.wait_ready()
            .await
            .expect("another extender becomes ready");
        ext
    }

    /// A sandbox holding GPU nodes `(name, GPUs, units per GPU)`, then an extender with
    /// `config` over it, ready.
    pub(crate) async fn with_nodes(config: Config, nodes: &[(&str, u64, u64)]) -> Env {
        Env::start_with(config, |api| {
            for (name, gpus, units) in nodes {
                create(api, gpu_node(name, *gpus, *units));
            }
        })
        .await
    }

    /// Where the extender serves.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.ext.addr
    }

    /// Waits (bounded) until the extender's `/inspect` says the GPUs of `node` hold `want`;
    /// `what` names the wait in its failure.
    pub(crate) async fn wait_used(&self, what: &str, node: &str, want: &[u64]) {
        eventually(what, || async {
            used(&inspect(self.addr()).await, node) == want
        })
        .await;
    }
}

/// An extender with `config` over `api` (another replica, or a restart once the first one
/// stopped), ready.
pub(crate) async fn extender_over(api: &ApiServer, config: &Config) -> ExtenderHandle {
    let ext = extender::start(config, api.admin_client(), Shutdown::never())
        .await
        .expect("the extender starts");
    ext.wait_ready().await.expect("the extender becomes ready");
    ext
}

/// A fault on the Binding of pod `pod` (in `default`): kube-scheduler's bind as the extender
/// posts it.
pub(crate) fn binding_fault(pod: &str, action: FaultAction) -> Fault {
    Fault::new(
        Some(http::Method::POST),
        format!("/pods/{pod}/binding"),
        action,
    )
}

/// Creates `obj` as the administrator; the stored object.
pub(crate) fn create(api: &ApiServer, obj: Value) -> Value {
    api.create_object(obj).expect("object created")
}

/// `filter` of `pod` over the nodes named.
pub(crate) async fn filter(addr: SocketAddr, pod: &Value, nodes: &[&str]) -> (u16, Value) {
    post(
        addr,
        "/gpushare-scheduler/filter",
        &json!({"Pod": pod, "NodeNames": nodes}),
    )
    .await
}

/// `bind` of `pod` (in `default`) to `node`.
pub(crate) async fn bind(addr: SocketAddr, pod: &Value, node: &str) -> (u16, Value) {
    post(
        addr,
        "/gpushare-scheduler/bind",
        &json!({"PodName": pod["metadata"]["name"], "PodNamespace": "default",
                "PodUID": pod["metadata"]["uid"], "Node": node}),
    )
    .await
}

/// Pod `name` of `default` as the API server has it (`Null` when it is not there).
pub(crate) fn stored(api: &ApiServer, name: &str) -> Value {
    api.get_object("pods", Some("default"), name)
        .unwrap_or(Value::Null)
}

/// The annotations of pod `name` of `default` (none when it is not there).
pub(crate) fn annotations(api: &ApiServer, name: &str) -> BTreeMap<String, String> {
    serde_json::from_value(stored(api, name)["metadata"]["annotations"].clone()).unwrap_or_default()
}

/// `usedGPU` of each GPU of `node` in an `/inspect` answer.
pub(crate) fn used(inspect: &Value, node: &str) -> Vec<u64> {
    inspect["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["name"] == node)
        .map(|n| {
            n["devs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| d["usedGPU"].as_u64().unwrap_or(u64::MAX))
                .collect()
        })
        .unwrap_or_default()
}
