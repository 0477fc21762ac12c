//! The one watch driver's lists against the sandbox API server's watch cache: a list from the
//! cache is one request whatever its size and is paged only by a server that pages it (then
//! followed without the version, as upstream requires), a fresh list reads the collection's
//! current version and then the cache at it, a cache held behind etcd serves an informer its
//! old state but never a fresh list, and `410 Gone` lists again not older than the version
//! seen. Then the roles over a cache held behind: the extender is never ready without a pod
//! bound before it started (its lists are fresh), the device plugin lists its pods from the
//! cache and a match that misses reads the truth.

use std::sync::{Arc, Mutex};

use gpushare::k8s::watch::{DefaultBackoff, ListFrom, WatchConfig, drive};
use gpushare::shutdown;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, Hold, RecordedRequest};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::watcher::Event;
use serde_json::json;

use crate::support::deviceplugin_cluster::{cluster_seeded, env, node_yaml, pod_json};
use crate::support::extender_cluster::{extender_config, sandbox, start_extender};
use crate::support::ledger_truth::ledger;
use crate::support::objects::bound_pod;
use crate::support::wait::wait_until;

/// What a watch of the ConfigMaps in `default` delivered.
#[derive(Debug, Default)]
struct Seen {
    /// The names of each completed list, in order.
    lists: Vec<Vec<String>>,
    /// Names listed since the last `Init`.
    listing: Vec<String>,
    /// Names applied by the watch after a list.
    applied: Vec<String>,
    errors: Vec<String>,
}

struct Watching {
    seen: Arc<Mutex<Seen>>,
    stop: shutdown::Trigger,
    task: tokio::task::JoinHandle<()>,
}

impl Watching {
    fn start(api: &ApiServer, list_from: ListFrom) -> Watching {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop, shutdown) = shutdown::channel();
        let cms: Api<ConfigMap> = Api::namespaced(api.admin_client(), "default");
        let (events, errors) = (seen.clone(), seen.clone());
        let task = tokio::spawn(async move {
            drive(
                cms,
                WatchConfig::new(list_from),
                DefaultBackoff::default(),
                shutdown,
                move |e| errors.lock().unwrap().errors.push(e.to_string()),
                move |ev| {
                    let mut s = events.lock().unwrap();
                    match ev {
                        Event::Init => s.listing.clear(),
                        Event::InitApply(cm) => {
                            s.listing.push(cm.metadata.name.unwrap_or_default())
                        }
                        Event::InitDone => {
                            let done = std::mem::take(&mut s.listing);
                            s.lists.push(done);
                        }
                        Event::Apply(cm) => s.applied.push(cm.metadata.name.unwrap_or_default()),
                        Event::Delete(_) => {}
                    }
                },
            )
            .await
        });
        Watching { seen, stop, task }
    }

    fn lists(&self) -> usize {
        self.seen.lock().unwrap().lists.len()
    }

    fn list(&self, n: usize) -> Vec<String> {
        self.seen.lock().unwrap().lists[n].clone()
    }

    fn applied(&self) -> Vec<String> {
        self.seen.lock().unwrap().applied.clone()
    }

    async fn stop(self) {
        self.stop.trigger();
        let _ = self.task.await;
    }
}

async fn with_config_maps(n: usize) -> ApiServer {
    let api = ApiServer::start().await.expect("api server");
    for i in 0..n {
        api.create_object(config_map(&format!("cm-{i:05}")))
            .expect("seed");
    }
    api
}

fn config_map(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": "default"}, "data": {"k": "v"}})
}

/// The list requests for ConfigMaps in `default` from the `from`-th request on.
fn lists_after(api: &ApiServer, from: usize) -> Vec<RecordedRequest> {
    api.requests()
        .into_iter()
        .skip(from)
        .filter(|r| {
            r.path == "/api/v1/namespaces/default/configmaps" && !r.query.contains("watch=")
        })
        .collect()
}

fn query_has(r: &RecordedRequest, pair: &str) -> bool {
    r.query.split('&').any(|p| p == pair)
}

fn query_key(r: &RecordedRequest, key: &str) -> bool {
    r.query.split('&').any(|p| p.split('=').next() == Some(key))
}

#[tokio::test]
async fn a_list_from_the_cache_is_one_request_whatever_its_size() {
    let api = with_config_maps(1234).await;
    let from = api.request_count();
    let w = Watching::start(&api, ListFrom::Cache);
    wait_until("the first list", || w.lists() == 1).await;
    assert_eq!(w.list(0).len(), 1234, "every object, once");
    let lists = lists_after(&api, from);
    assert_eq!(lists.len(), 1, "one request: {lists:?}");
    assert!(
        query_has(&lists[0], "resourceVersion=0") && query_has(&lists[0], "limit=500"),
        "the informer's list: {:?}",
        lists[0].query
    );
    api.create_object(config_map("after")).expect("create");
    wait_until("the watch from the list's version", || {
        w.applied() == ["after"]
    })
    .await;
    w.stop().await;
}

#[tokio::test]
async fn a_server_without_a_watch_cache_pages_and_is_followed_without_the_version() {
    let api = with_config_maps(1234).await;
    api.set_watch_cache(false);
    let from = api.request_count();
    let w = Watching::start(&api, ListFrom::Cache);
    wait_until("the first list", || w.lists() == 1).await;
    let mut names = w.list(0);
    assert_eq!(names.len(), 1234);
    names.dedup();
    assert_eq!(names.len(), 1234, "no object twice");
    let lists = lists_after(&api, from);
    assert_eq!(lists.len(), 3, "pages of 500: {lists:?}");
    assert!(query_has(&lists[0], "resourceVersion=0"));
    for later in &lists[1..] {
        assert!(
            query_key(later, "continue")
                && !query_key(later, "resourceVersion")
                && !query_key(later, "resourceVersionMatch"),
            "a continued page carries neither the version nor the match: {:?}",
            later.query
        );
    }
    assert!(
        w.seen.lock().unwrap().errors.is_empty(),
        "{:?}",
        w.seen.lock().unwrap().errors
    );
    w.stop().await;
}

#[tokio::test]
async fn a_fresh_list_reads_the_current_version_then_the_cache_at_it() {
    let api = with_config_maps(1234).await;
    let from = api.request_count();
    let w = Watching::start(&api, ListFrom::Fresh);
    wait_until("the first list", || w.lists() == 1).await;
    assert_eq!(w.list(0).len(), 1234);
    let lists = lists_after(&api, from);
    assert_eq!(lists.len(), 2, "{lists:?}");
    assert!(
        query_has(&lists[0], "limit=1") && !query_key(&lists[0], "resourceVersion"),
        "first a consistent read of one object: {:?}",
        lists[0].query
    );
    assert!(
        query_has(&lists[1], "resourceVersionMatch=NotOlderThan")
            && query_key(&lists[1], "resourceVersion")
            && !query_key(&lists[1], "limit"),
        "then the cache at that version, in one answer: {:?}",
        lists[1].query
    );
    w.stop().await;
}

#[tokio::test]
async fn a_cache_held_behind_serves_an_informer_its_old_state_but_never_a_fresh_list() {
    let api = with_config_maps(3).await;
    api.hold_watch_cache();
    api.create_object(config_map("late")).expect("create");

    // The informer's list is the cache's: "late" is not in it, nor in the watch, until the
    // cache catches up.
    let informer = Watching::start(&api, ListFrom::Cache);
    wait_until("the informer's list", || informer.lists() == 1).await;
    assert!(!informer.list(0).contains(&"late".to_string()));

    // A fresh list cannot be served by the held cache (504 Too large resource version) and
    // reads the truth instead.
    let from = api.request_count();
    let fresh = Watching::start(&api, ListFrom::Fresh);
    wait_until("the fresh list", || fresh.lists() == 1).await;
    assert!(
        fresh.list(0).contains(&"late".to_string()),
        "{:?}",
        fresh.list(0)
    );
    // The current version (limit=1), the cache at it (asked again by kube-rs's retries of
    // the 504 until gpushare's wait for the cache ends), then a consistent paged list.
    let lists = lists_after(&api, from);
    let (first, last) = (&lists[0], &lists[lists.len() - 1]);
    assert!(query_has(first, "limit=1"), "{lists:?}");
    assert!(
        lists[1..lists.len() - 1]
            .iter()
            .all(|r| query_has(r, "resourceVersionMatch=NotOlderThan"))
            && lists.len() >= 3,
        "{lists:?}"
    );
    assert!(
        query_has(last, "limit=500") && !query_key(last, "resourceVersion"),
        "{lists:?}"
    );

    api.release_watch_cache();
    wait_until("the informer catching up", || {
        informer.applied() == ["late"]
    })
    .await;
    assert!(
        fresh.applied().is_empty(),
        "listed already: not applied again"
    );
    informer.stop().await;
    fresh.stop().await;
}

#[tokio::test]
async fn after_410_gone_the_cache_lists_again_not_older_than_the_version_seen() {
    let api = with_config_maps(3).await;
    let w = Watching::start(&api, ListFrom::Cache);
    wait_until("the first list", || w.lists() == 1).await;
    wait_until("the watch open", || {
        api.requests()
            .iter()
            .any(|r| r.query.contains("watch=true"))
    })
    .await;
    // The watch is cut and its reopening held while the history moves past its version.
    let hold = Hold::new();
    api.inject(Fault::new(
        None,
        "watch=true",
        FaultAction::Hold(hold.clone()),
    ));
    api.inject(Fault::new(None, "watch=true", FaultAction::CutWatch));
    hold.wait_reached(1).await;
    let seen_version = api.resource_version();
    api.set_history_limit(1);
    for i in 0..3 {
        api.create_object(config_map(&format!("moved-{i}")))
            .expect("create");
    }
    let from = api.request_count();
    hold.release();
    wait_until("the list after 410 Gone", || w.lists() == 2).await;
    assert_eq!(w.list(1).len(), 6, "{:?}", w.list(1));
    let lists = lists_after(&api, from);
    assert!(
        query_has(&lists[0], &format!("resourceVersion={seen_version}"))
            && query_has(&lists[0], "resourceVersionMatch=NotOlderThan"),
        "{:?}",
        lists[0].query
    );
    assert!(
        w.seen
            .lock()
            .unwrap()
            .errors
            .iter()
            .any(|e| e.contains("410")),
        "{:?}",
        w.seen.lock().unwrap().errors
    );
    w.stop().await;
}

#[tokio::test]
async fn the_extender_is_never_ready_without_a_pod_bound_before_it_started() {
    let api = sandbox(2, 2, 16).await;
    api.create_object(bound_pod("early", "node-0", 0, 4, 16))
        .expect("seed");
    // The cache stays behind the pod bound now: an extender that trusted it would be ready
    // with GPU 1 of node-1 empty.
    api.hold_watch_cache();
    let late = api
        .create_object(bound_pod("late", "node-1", 1, 12, 16))
        .expect("seed");
    let ext = start_extender(&api, &extender_config(false)).await;
    ext.wait_ready().await.expect("ready");
    let held = ledger(ext.addr).await.expect("the ledger");
    let late_uid = late["metadata"]["uid"].as_str().unwrap_or_default();
    assert_eq!(
        held.get(&("node-1".to_string(), 1))
            .and_then(|pods| pods.get(late_uid)),
        Some(&12),
        "ready only with the pod bound before it started: {held:?}"
    );
    assert_eq!(
        held.get(&("node-0".to_string(), 0)).map(|p| p.len()),
        Some(1)
    );
    api.release_watch_cache();
    ext.stop().await;
}

#[tokio::test]
async fn the_device_plugin_lists_its_pods_from_the_cache_and_a_miss_reads_the_truth() {
    let c = cluster_seeded(
        "2x16GiB",
        &node_yaml(""),
        |api| {
            api.hold_watch_cache();
            api.create_object(pod_json("late", &[], &[("main", 4)], Some(1), 1))
                .expect("seed");
        },
        |_| {},
    )
    .await
    .expect("the device plugin registers from the cache's list");
    assert!(c.plugin().pods_synced());
    assert!(
        c.plugin().watched_pod("default", "late").is_none(),
        "its list came from the cache, which is behind the pod"
    );
    let (_, resp) = c.allocate("late", "main", 4).await.expect("Allocate");
    assert_eq!(env(&resp, gpushare::core::wire::ENV_VISIBLE_DEVICES), "1");
    assert_eq!(
        c.annotations("late")
            .get(gpushare::core::wire::ANN_ASSIGNED)
            .map(String::as_str),
        Some("true")
    );
    c.api.release_watch_cache();
    c.stop().await;
}
