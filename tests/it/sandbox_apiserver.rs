//! The sandbox API server (`gpushare_sandbox::apiserver`) driven through kube-rs and the
//! real `kubectl` binaries, as the components and users will drive it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures::{Stream, StreamExt};
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction, Identity};
use http::Method;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::{reflector, watcher};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

use crate::support::fixture;

/// Upper bound for any single wait on the server; exceeded only when something is broken.
const DEADLINE: Duration = Duration::from_secs(20);

async fn seeded() -> ApiServer {
    let server = ApiServer::start()
        .await
        .expect("the sandbox API server starts");
    let yaml = std::fs::read_to_string(fixture("apiserver/cluster.yaml")).expect("fixture");
    server.seed_yaml(&yaml).expect("the fixture seeds");
    server
}

fn configmap(name: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": "default", "labels": { "set": "watch" } },
        "data": { "k": "v" },
    }))
    .expect("a config map")
}

fn api_code(err: kube::Error) -> u16 {
    match err {
        kube::Error::Api(status) => status.code,
        other => panic!("expected an API Status error, got {other:?}"),
    }
}

/// Next watch event within the deadline.
async fn next_event<S, K>(stream: &mut S) -> WatchEvent<K>
where
    S: Stream<Item = Result<WatchEvent<K>, kube::Error>> + Unpin,
{
    tokio::time::timeout(DEADLINE, stream.next())
        .await
        .expect("a watch event before the deadline")
        .expect("the watch stream is open")
        .expect("a decodable watch event")
}

/// Next non-bookmark watch event.
async fn next_change<S, K>(stream: &mut S) -> WatchEvent<K>
where
    S: Stream<Item = Result<WatchEvent<K>, kube::Error>> + Unpin,
{
    loop {
        match next_event(stream).await {
            WatchEvent::Bookmark(_) => continue,
            other => return other,
        }
    }
}

/// Every page of a list of `api` in pages of `limit`, following the continue tokens.
async fn pages<K>(api: &Api<K>, limit: u32) -> Vec<kube::core::ObjectList<K>>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut pages = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut lp = ListParams::default().limit(limit);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let page = api.list(&lp).await.expect("a page");
        token = page.metadata.continue_.clone().filter(|t| !t.is_empty());
        pages.push(page);
        if token.is_none() {
            return pages;
        }
    }
}

fn names<K: kube::Resource>(items: &[K]) -> Vec<String> {
    items
        .iter()
        .map(|k| k.meta().name.clone().unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn seeded_objects_list_and_get_through_kube_rs() {
    let server = seeded().await;
    let client = server.admin_client();
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default())
        .await
        .expect("lists nodes");
    assert_eq!(names(&list.items), ["gpu-node-1", "gpu-node-2"]);
    let list_rv: u64 = list
        .metadata
        .resource_version
        .as_deref()
        .and_then(|rv| rv.parse().ok())
        .expect("a list resourceVersion");
    assert_eq!(list_rv, server.resource_version());

    let all: Api<Pod> = Api::all(client.clone());
    let pods = all
        .list(&ListParams::default())
        .await
        .expect("lists all pods");
    assert_eq!(names(&pods.items), ["plain", "bound", "trainer"]);
    let ml: Api<Pod> = Api::namespaced(client.clone(), "ml");
    let trainer = ml.get("trainer").await.expect("gets a pod");
    let meta = &trainer.metadata;
    assert!(meta.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(
        trainer.status.and_then(|s| s.phase).as_deref(),
        Some("Pending"),
        "pods default to Pending"
    );
    let plain: Pod = server
        .get_as("pods", Some("default"), "plain")
        .expect("the seeded pod in the default namespace");
    assert_eq!(plain.metadata.namespace.as_deref(), Some("default"));

    let missing = ml.get("nope").await.expect_err("a missing pod");
    match missing {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 404);
            assert_eq!(status.reason, "NotFound");
            assert_eq!(status.message, "pods \"nope\" not found");
        }
        other => panic!("expected a Status, got {other:?}"),
    }
    let cms: Api<ConfigMap> = Api::namespaced(client, "kube-system");
    let settings = cms.get("settings").await.expect("gets the config map");
    assert_eq!(
        settings
            .data
            .and_then(|d| d.get("mode").cloned())
            .as_deref(),
        Some("shared")
    );
}

#[tokio::test]
async fn selectors_and_pagination() {
    let server = seeded().await;
    let pods: Api<Pod> = Api::all(server.admin_client());
    let list = |lp: ListParams| {
        let pods = pods.clone();
        async move { names(&pods.list(&lp).await.expect("lists").items) }
    };
    // Label selectors, then field selectors, and the pods each lists (in the store's order).
    let by_labels: [(&str, &[&str]); 4] = [
        ("app=trainer", &["trainer"]),
        ("app!=trainer,app", &["plain", "bound"]),
        ("app in (web,server)", &["plain", "bound"]),
        ("!tier", &["plain", "bound"]),
    ];
    for (selector, want) in by_labels {
        let got = list(ListParams::default().labels(selector)).await;
        assert_eq!(got, want, "labels {selector:?}");
    }
    let by_fields: [(&str, &[&str]); 4] = [
        ("spec.nodeName=", &["plain", "trainer"]),
        ("spec.nodeName=gpu-node-1", &["bound"]),
        ("status.phase!=Running,metadata.namespace=ml", &["trainer"]),
        ("metadata.name=plain", &["plain"]),
    ];
    for (selector, want) in by_fields {
        let got = list(ListParams::default().fields(selector)).await;
        assert_eq!(got, want, "fields {selector:?}");
    }

    let mut seen = Vec::new();
    let mut remaining = Vec::new();
    for page in pages(&pods, 2).await {
        assert!(page.items.len() <= 2);
        seen.extend(names(&page.items));
        remaining.push(page.metadata.remaining_item_count);
    }
    assert_eq!(seen, ["plain", "bound", "trainer"]);
    // remainingItemCount as the API server reports it: on every page but the last.
    assert_eq!(remaining, [Some(1), None]);

    // A longer paged list: the count goes down page by page (it is carried in the continue
    // token from the first page's count, not recounted from the store on every page).
    for i in 0..7 {
        server
            .create_object(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("page-{i}"), "namespace": "paged"}}))
            .expect("create");
    }
    let cms: Api<ConfigMap> = Api::namespaced(server.admin_client(), "paged");
    let (mut counts, mut listed) = (Vec::new(), 0);
    for page in pages(&cms, 3).await {
        listed += page.items.len();
        counts.push(page.metadata.remaining_item_count);
    }
    assert_eq!(listed, 7);
    assert_eq!(counts, [Some(4), Some(1), None]);

    // Every page of one list reports the first page's resourceVersion (the snapshot's): an
    // object returned on the first page and deleted before the last one is read must still
    // reach a watch started from the list's version as a deletion.
    let first = cms
        .list(&ListParams::default().limit(3))
        .await
        .expect("first page");
    server
        .delete_object("configmaps", Some("paged"), "page-0")
        .expect("delete");
    let mut token = first.metadata.continue_.clone().filter(|t| !t.is_empty());
    let mut last_rv = first.metadata.resource_version.clone();
    while let Some(t) = token {
        let page = cms
            .list(&ListParams::default().limit(3).continue_token(&t))
            .await
            .expect("a page");
        last_rv = page.metadata.resource_version.clone();
        token = page.metadata.continue_.filter(|t| !t.is_empty());
    }
    assert_eq!(
        last_rv, first.metadata.resource_version,
        "a later page reported a newer version: the deletion in between would be lost"
    );

    let bad = pods
        .list(&ListParams::default().labels("app in (x"))
        .await
        .expect_err("a malformed selector");
    assert_eq!(api_code(bad), 400);
}

#[tokio::test]
async fn watch_from_a_resource_version_sees_changes_in_order() {
    let server = seeded().await;
    let cms: Api<ConfigMap> = Api::namespaced(server.admin_client(), "default");
    let rv = cms
        .list(&ListParams::default())
        .await
        .expect("lists")
        .metadata
        .resource_version
        .expect("a list resourceVersion");
    let stream = cms
        .watch(&WatchParams::default().labels("set=watch"), &rv)
        .await
        .expect("watch opens");
    let mut stream = stream.boxed();

    cms.create(&PostParams::default(), &configmap("w1"))
        .await
        .expect("creates");
    cms.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({ "data": { "k": "v2" } })),
    )
    .await
    .expect("patches");
    // Not matching the selector: never seen.
    server
        .create_object(json!({ "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": "other", "namespace": "default" } }))
        .expect("creates an unrelated config map");
    cms.delete("w1", &DeleteParams::default())
        .await
        .expect("deletes");

    match next_change(&mut stream).await {
        WatchEvent::Added(cm) => assert_eq!(cm.metadata.name.as_deref(), Some("w1")),
        other => panic!("expected ADDED, got {other:?}"),
    }
    match next_change(&mut stream).await {
        WatchEvent::Modified(cm) => {
            assert_eq!(
                cm.data.and_then(|d| d.get("k").cloned()).as_deref(),
                Some("v2")
            )
        }
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    match next_change(&mut stream).await {
        WatchEvent::Deleted(cm) => assert_eq!(cm.metadata.name.as_deref(), Some("w1")),
        other => panic!("expected DELETED, got {other:?}"),
    }

    // A watch resumed from an old version replays the history after it.
    let replay = cms
        .watch(&WatchParams::default().labels("set=watch"), &rv)
        .await
        .expect("watch opens");
    let mut replay = replay.boxed();
    assert!(matches!(
        next_change(&mut replay).await,
        WatchEvent::Added(_)
    ));
    assert!(matches!(
        next_change(&mut replay).await,
        WatchEvent::Modified(_)
    ));
    assert!(matches!(
        next_change(&mut replay).await,
        WatchEvent::Deleted(_)
    ));

    // A version older than the retained history answers 410 Gone.
    server.set_history_limit(1);
    let gone = cms
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("watch opens");
    let mut gone = gone.boxed();
    match next_event(&mut gone).await {
        WatchEvent::Error(status) => assert_eq!(status.code, 410),
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
}

#[tokio::test]
async fn pod_phase_changes_reach_a_field_selected_watch() {
    let server = seeded().await;
    let pods: Api<Pod> = Api::namespaced(server.admin_client(), "ml");
    let rv = server.resource_version().to_string();
    let watch = pods
        .watch(
            &WatchParams::default().fields("status.phase!=Succeeded"),
            &rv,
        )
        .await
        .expect("watch opens");
    let mut watch = watch.boxed();
    server
        .set_pod_phase("ml", "trainer", "Running")
        .expect("sets the phase");
    server
        .set_pod_phase("ml", "trainer", "Succeeded")
        .expect("sets the phase");
    match next_change(&mut watch).await {
        WatchEvent::Modified(p) => {
            assert_eq!(p.status.and_then(|s| s.phase).as_deref(), Some("Running"))
        }
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    // Leaving the selection reads as DELETED, as the real server does.
    match next_change(&mut watch).await {
        WatchEvent::Deleted(p) => {
            assert_eq!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded"))
        }
        other => panic!("expected DELETED, got {other:?}"),
    }
}

/// Polls the reflector stream until `done` holds for the store.
async fn drive_until<S, K>(
    stream: &mut S,
    reader: &reflector::Store<K>,
    what: &str,
    done: impl Fn(&[String]) -> bool,
) where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Unpin,
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let mut state: Vec<String> = reader
            .state()
            .iter()
            .map(|k| k.meta().name.clone().unwrap_or_default())
            .collect();
        state.sort();
        if done(&state) {
            return;
        }
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the watcher stream ended while waiting for {what}"),
            Err(_) => panic!("timed out waiting for {what}; store has {state:?}"),
        }
    }
}

fn watch_requests(server: &ApiServer, resource: &str) -> Vec<String> {
    server
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with(resource) && r.query.contains("watch=true"))
        .map(|r| r.query)
        .collect()
}

fn list_requests(server: &ApiServer, resource: &str) -> usize {
    server
        .requests()
        .into_iter()
        .filter(|r| {
            r.method == Method::GET && r.path.ends_with(resource) && !r.query.contains("watch")
        })
        .count()
}

#[tokio::test]
async fn a_kube_watcher_survives_a_cut_watch_and_a_410_relist() {
    let server = seeded().await;
    let cms: Api<ConfigMap> = Api::namespaced(server.admin_client(), "default");
    server
        .create_object(serde_json::to_value(configmap("a")).expect("json"))
        .expect("a");
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(cms.clone(), watcher::Config::default()));
    let mut stream = stream.boxed();
    drive_until(&mut stream, &reader, "the initial list", |s| s == ["a"]).await;
    server
        .create_object(serde_json::to_value(configmap("b")).expect("json"))
        .expect("b");
    drive_until(&mut stream, &reader, "b through the watch", |s| {
        s == ["a", "b"]
    })
    .await;
    let lists_before = list_requests(&server, "/configmaps");
    let watches_before = watch_requests(&server, "/configmaps").len();

    // Cut the open watch; a change made meanwhile arrives through a resumed watch.
    server.inject(Fault::new(
        Some(Method::GET),
        "/configmaps?",
        FaultAction::CutWatch,
    ));
    server
        .create_object(serde_json::to_value(configmap("c")).expect("json"))
        .expect("c");
    drive_until(&mut stream, &reader, "c after the cut", |s| {
        s == ["a", "b", "c"]
    })
    .await;
    let watches = watch_requests(&server, "/configmaps");
    assert!(
        watches.len() > watches_before,
        "the watcher re-watched: {watches:?}"
    );
    assert_eq!(
        list_requests(&server, "/configmaps"),
        lists_before,
        "a cut is resumed, not relisted"
    );

    // Cut again and let the history move past the watcher's version: 410, then a relist.
    server.set_history_limit(1);
    server.inject(Fault::new(
        Some(Method::GET),
        "/configmaps?",
        FaultAction::CutWatch,
    ));
    server
        .delete_object("configmaps", Some("default"), "a")
        .expect("deletes a");
    server
        .create_object(serde_json::to_value(configmap("d")).expect("json"))
        .expect("d");
    server
        .create_object(serde_json::to_value(configmap("e")).expect("json"))
        .expect("e");
    drive_until(&mut stream, &reader, "the relisted state", |s| {
        s == ["b", "c", "d", "e"]
    })
    .await;
    assert!(
        list_requests(&server, "/configmaps") > lists_before,
        "the watcher relisted after 410 Gone"
    );
}

#[tokio::test]
async fn patches_of_every_content_type() {
    let server = seeded().await;
    let client = server.admin_client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "ml");

    let merged = pods
        .patch(
            "trainer",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { "a": "1", "b": "2" } } })),
        )
        .await
        .expect("merge patch");
    let annotations = merged.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(annotations.get("a").map(String::as_str), Some("1"));
    let removed = pods
        .patch(
            "trainer",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { "a": null } } })),
        )
        .await
        .expect("merge patch removing a key");
    let annotations = removed.metadata.annotations.clone().unwrap_or_default();
    assert!(!annotations.contains_key("a") && annotations.contains_key("b"));
    let rv = |p: &Pod| {
        p.metadata
            .resource_version
            .as_deref()
            .and_then(|r| r.parse::<u64>().ok())
            .expect("a numeric resourceVersion")
    };
    assert!(
        rv(&removed) > rv(&merged),
        "each write bumps the resourceVersion"
    );

    let strategic = pods
        .patch(
            "trainer",
            &PatchParams::default(),
            &Patch::Strategic(json!({ "metadata": { "labels": { "tier": "batch" } } })),
        )
        .await
        .expect("strategic merge patch");
    let labels = strategic.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("tier").map(String::as_str), Some("batch"));
    assert_eq!(labels.get("app").map(String::as_str), Some("trainer"));

    let applied = pods
        .patch(
            "trainer",
            &PatchParams::apply("sandbox-test"),
            &Patch::Apply(json!({ "apiVersion": "v1", "kind": "Pod",
                "metadata": { "name": "trainer", "annotations": { "applied": "yes" } } })),
        )
        .await
        .expect("server-side apply");
    assert_eq!(
        applied
            .metadata
            .annotations
            .unwrap_or_default()
            .get("applied")
            .map(String::as_str),
        Some("yes")
    );
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let created = cms
        .patch(
            "applied-cm",
            &PatchParams::apply("sandbox-test"),
            &Patch::Apply(json!({ "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": { "name": "applied-cm" }, "data": { "x": "1" } })),
        )
        .await
        .expect("apply creates a missing object");
    assert!(created.metadata.uid.is_some());

    // JSON patch (RFC 6902) through a raw request.
    let body = json!([
        { "op": "test", "path": "/metadata/labels/tier", "value": "batch" },
        { "op": "add", "path": "/metadata/labels/json", "value": "patched" },
        { "op": "remove", "path": "/metadata/annotations/b" },
    ]);
    let request = http::Request::patch("/api/v1/namespaces/ml/pods/trainer")
        .header("Content-Type", "application/json-patch+json")
        .body(body.to_string().into_bytes())
        .expect("a request");
    let patched: Pod = client.request(request).await.expect("json patch");
    assert_eq!(
        patched
            .metadata
            .labels
            .unwrap_or_default()
            .get("json")
            .map(String::as_str),
        Some("patched")
    );
    assert!(
        !patched
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("b")
    );
    let failing = http::Request::patch("/api/v1/namespaces/ml/pods/trainer")
        .header("Content-Type", "application/json-patch+json")
        .body(
            json!([{ "op": "test", "path": "/metadata/name", "value": "x" }])
                .to_string()
                .into_bytes(),
        )
        .expect("a request");
    let err = client
        .request::<Pod>(failing)
        .await
        .expect_err("a failed test op");
    assert_eq!(api_code(err), 400);

    // The log shows exactly what each client sent.
    let types: Vec<String> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == Method::PATCH)
        .filter_map(|r| r.content_type)
        .collect();
    for expected in [
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
        "application/apply-patch+yaml",
        "application/json-patch+json",
    ] {
        assert!(
            types.iter().any(|t| t == expected),
            "{expected} in {types:?}"
        );
    }
    let first = server
        .requests()
        .into_iter()
        .find(|r| r.method == Method::PATCH)
        .expect("a recorded patch");
    assert_eq!(first.path, "/api/v1/namespaces/ml/pods/trainer");
    let sent: Value = serde_json::from_str(&first.body).expect("a JSON body");
    assert_eq!(
        sent,
        json!({ "metadata": { "annotations": { "a": "1", "b": "2" } } })
    );
}

#[tokio::test]
async fn update_create_and_delete_conflicts() {
    let server = seeded().await;
    let cms: Api<ConfigMap> = Api::namespaced(server.admin_client(), "kube-system");
    let current = cms.get("settings").await.expect("gets");
    let mut stale = current.clone();
    let mut fresh = current.clone();
    fresh.data = Some(BTreeMap::from([(
        "mode".to_string(),
        "exclusive".to_string(),
    )]));
    cms.replace("settings", &PostParams::default(), &fresh)
        .await
        .expect("an update");
    stale.data = Some(BTreeMap::new());
    let err = cms
        .replace("settings", &PostParams::default(), &stale)
        .await
        .expect_err("a stale update");
    match err {
        kube::Error::Api(status) => {
            assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
            assert!(status.message.contains("the object has been modified"));
        }
        other => panic!("expected a Status, got {other:?}"),
    }
    let again = cms
        .create(&PostParams::default(), &current)
        .await
        .expect_err("a duplicate create");
    match again {
        kube::Error::Api(status) => assert_eq!(
            (status.code, status.reason.as_str()),
            (409, "AlreadyExists")
        ),
        other => panic!("expected a Status, got {other:?}"),
    }
    let wrong_uid = cms
        .delete(
            "settings",
            &DeleteParams::default().preconditions(kube::api::Preconditions {
                uid: Some("not-the-uid".into()),
                resource_version: None,
            }),
        )
        .await
        .expect_err("a uid precondition");
    assert_eq!(api_code(wrong_uid), 409);
    cms.delete("settings", &DeleteParams::background())
        .await
        .expect("deletes");
    assert!(
        server
            .get_object("configmaps", Some("kube-system"), "settings")
            .is_none()
    );
    assert_eq!(
        api_code(
            cms.delete("settings", &DeleteParams::default())
                .await
                .expect_err("gone")
        ),
        404
    );
}

#[tokio::test]
async fn binding_sets_the_node_once_with_a_uid_precondition() {
    let server = seeded().await;
    let client = server.admin_client();
    let trainer: Pod = server
        .get_as("pods", Some("ml"), "trainer")
        .expect("seeded");
    let uid = trainer.metadata.uid.clone().expect("a uid");

    let wrong =
        gpushare::k8s::write::bind_pod(&client, "ml", "trainer", "0000-wrong", "gpu-node-1")
            .await
            .expect_err("a UID mismatch");
    assert_eq!(api_code(wrong), 409);
    gpushare::k8s::write::bind_pod(&client, "ml", "trainer", &uid, "gpu-node-1")
        .await
        .expect("binds");
    let bound: Pod = server
        .get_as("pods", Some("ml"), "trainer")
        .expect("still there");
    assert_eq!(
        bound.spec.and_then(|s| s.node_name).as_deref(),
        Some("gpu-node-1")
    );
    let again = gpushare::k8s::write::bind_pod(&client, "ml", "trainer", &uid, "gpu-node-2")
        .await
        .expect_err("already bound");
    match again {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 409);
            assert!(
                status
                    .message
                    .contains("already assigned to node \"gpu-node-1\""),
                "{}",
                status.message
            );
        }
        other => panic!("expected a Status, got {other:?}"),
    }
    let missing = gpushare::k8s::write::bind_pod(&client, "ml", "ghost", &uid, "gpu-node-1")
        .await
        .expect_err("no such pod");
    assert_eq!(api_code(missing), 404);
    let binding = server
        .requests()
        .into_iter()
        .find(|r| r.path.ends_with("/binding"))
        .expect("a recorded binding");
    assert_eq!(binding.method, Method::POST);
    assert_eq!(binding.path, "/api/v1/namespaces/ml/pods/trainer/binding");
}

#[tokio::test]
async fn node_status_patches_change_only_the_status() {
    let server = seeded().await;
    let client = server.admin_client();
    gpushare::k8s::write::patch_node_gpu_count(&client, "gpu-node-2", 4)
        .await
        .expect("patches nodes/status");
    let node: Node = server.get_as("nodes", None, "gpu-node-2").expect("seeded");
    let status = node.status.expect("a status");
    let capacity = status.capacity.unwrap_or_default();
    assert_eq!(
        capacity.get("aliyun.com/gpu-count").map(|q| q.0.as_str()),
        Some("4")
    );
    assert_eq!(
        capacity.get("aliyun.com/gpu-mem").map(|q| q.0.as_str()),
        Some("16")
    );

    // A status subresource patch cannot change labels; a main-resource patch cannot change status.
    let nodes: Api<Node> = Api::all(client);
    nodes
        .patch_status(
            "gpu-node-2",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "sneaky": "yes" } } })),
        )
        .await
        .expect("patches status");
    nodes
        .patch(
            "gpu-node-2",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "capacity": { "aliyun.com/gpu-count": "99" } } })),
        )
        .await
        .expect("patches the node");
    let node: Node = server.get_as("nodes", None, "gpu-node-2").expect("seeded");
    assert!(
        !node
            .metadata
            .labels
            .unwrap_or_default()
            .contains_key("sneaky")
    );
    let capacity = node.status.and_then(|s| s.capacity).unwrap_or_default();
    assert_eq!(
        capacity.get("aliyun.com/gpu-count").map(|q| q.0.as_str()),
        Some("4")
    );
}

#[tokio::test]
async fn injected_faults_reach_the_client_then_expire() {
    let server = seeded().await;
    let pods: Api<Pod> = Api::namespaced(server.admin_client(), "ml");
    let patch = Patch::Merge(json!({ "metadata": { "annotations": { "f": "1" } } }));

    for (code, reason) in [(409, "Conflict"), (500, "InternalError")] {
        server.inject(Fault::new(
            Some(Method::PATCH),
            "/pods/trainer",
            FaultAction::Status(code),
        ));
        match pods.patch("trainer", &PatchParams::default(), &patch).await {
            Err(kube::Error::Api(status)) => {
                assert_eq!((status.code, status.reason.as_str()), (code, reason));
                assert!(gpushare::k8s::retry::is_transient(&kube::Error::Api(
                    status
                )));
            }
            other => panic!("expected a {code} Status, got {other:?}"),
        }
    }
    // kube-rs retries 503 (and 429/504) by itself: two 503s are invisible to the caller...
    let patches = |server: &ApiServer| {
        server
            .requests()
            .iter()
            .filter(|r| r.method == Method::PATCH)
            .count()
    };
    let before = patches(&server);
    server.inject(
        Fault::new(
            Some(Method::PATCH),
            "/pods/trainer",
            FaultAction::Status(503),
        )
        .times(2),
    );
    pods.patch("trainer", &PatchParams::default(), &patch)
        .await
        .expect("kube-rs retried through two 503s");
    assert_eq!(
        patches(&server) - before,
        3,
        "two 503 answers, then success"
    );
    // ...and a client without the default retry layer sees the Status.
    let mut config = kube::Config::new(server.url().parse().expect("a URL"));
    config.auth_info.token = Some(server.admin_token().into());
    config.default_retry = false;
    let no_retry: Api<Pod> =
        Api::namespaced(kube::Client::try_from(config).expect("a client"), "ml");
    server.inject(Fault::new(
        Some(Method::PATCH),
        "/pods/trainer",
        FaultAction::Status(503),
    ));
    match no_retry
        .patch("trainer", &PatchParams::default(), &patch)
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!(
                (status.code, status.reason.as_str()),
                (503, "ServiceUnavailable")
            )
        }
        other => panic!("expected a 503 Status, got {other:?}"),
    }

    // Method mismatch: a GET is untouched by a PATCH fault.
    server.inject(
        Fault::new(
            Some(Method::PATCH),
            "/pods/trainer",
            FaultAction::Status(500),
        )
        .times(2),
    );
    pods.get("trainer").await.expect("GET is not faulted");
    assert!(
        pods.patch("trainer", &PatchParams::default(), &patch)
            .await
            .is_err()
    );
    assert!(
        pods.patch("trainer", &PatchParams::default(), &patch)
            .await
            .is_err()
    );
    pods.patch("trainer", &PatchParams::default(), &patch)
        .await
        .expect("the fault expired after two uses");

    server.inject(Fault::new(
        None,
        "/pods/trainer",
        FaultAction::DropConnection,
    ));
    match pods.get("trainer").await {
        Err(kube::Error::Api(status)) => panic!("a dropped connection is not a Status: {status:?}"),
        Err(_) => {}
        Ok(_) => panic!("a dropped connection cannot answer"),
    }
    pods.get("trainer").await.expect("answers again");

    server.inject(Fault::new(
        None,
        "/pods/trainer",
        FaultAction::Delay(Duration::from_millis(50)),
    ));
    pods.get("trainer")
        .await
        .expect("a delayed request still succeeds");

    server.inject(Fault::new(None, "/pods/trainer", FaultAction::Status(500)).times(5));
    server.clear_faults();
    pods.get("trainer")
        .await
        .expect("cleared faults do not apply");
}

#[tokio::test]
async fn self_subject_access_reviews_answer_from_the_stored_rbac() {
    let server = seeded().await;
    server
        .seed_yaml(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: patcher, namespace: ml}\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: patch-pods, namespace: ml}\n\
             rules: [{apiGroups: [''], resources: [pods], verbs: [patch]}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: patcher, namespace: ml}\n\
             roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: patch-pods}\n\
             subjects: [{kind: ServiceAccount, name: patcher}]\n",
        )
        .expect("RBAC seeded");
    let patcher = server.client_for(&Identity::service_account("ml", "patcher"));
    let reviews: Api<SelfSubjectAccessReview> = Api::all(patcher);
    let review = |verb: &str, resource: &str, subresource: Option<&str>| SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some("ml".into()),
                verb: Some(verb.into()),
                resource: Some(resource.into()),
                subresource: subresource.map(str::to_string),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let allowed = reviews
        .create(&PostParams::default(), &review("patch", "pods", None))
        .await
        .expect("a review");
    assert!(allowed.status.expect("a status").allowed);
    let denied = reviews
        .create(
            &PostParams::default(),
            &review("create", "pods", Some("binding")),
        )
        .await
        .expect("a review");
    assert!(!denied.status.expect("a status").allowed);
    // The administrator (system:masters) may do anything.
    let admin: Api<SelfSubjectAccessReview> = Api::all(server.admin_client());
    let review = admin
        .create(
            &PostParams::default(),
            &review("create", "pods", Some("binding")),
        )
        .await
        .expect("a review");
    assert!(review.status.expect("a status").allowed);
}

/// Raw HTTP against the server, for malformed input.
async fn raw(
    server: &ApiServer,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> (u16, Value) {
    let client = server.admin_client();
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("Content-Type", content_type)
        .body(body.as_bytes().to_vec())
        .expect("a request");
    match client.request::<Value>(request).await {
        Ok(v) => (200, v),
        Err(kube::Error::Api(status)) => {
            (status.code, serde_json::to_value(&*status).expect("json"))
        }
        Err(other) => panic!("expected a Status, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_input_gets_status_objects() {
    let server = seeded().await;
    let (code, status) = raw(&server, "GET", "/api/v1/widgets", "application/json", "").await;
    assert_eq!(code, 404);
    assert_eq!(status["reason"], "NotFound");
    assert_eq!(
        raw(&server, "GET", "/openapi/v9", "application/json", "")
            .await
            .0,
        404
    );
    assert_eq!(
        raw(
            &server,
            "POST",
            "/api/v1/namespaces/default/pods",
            "application/json",
            "{garbage"
        )
        .await
        .0,
        400
    );
    assert_eq!(
        raw(
            &server,
            "POST",
            "/api/v1/namespaces/default/pods",
            "application/json",
            "[1,2]"
        )
        .await
        .0,
        400
    );
    assert_eq!(
        raw(&server, "PUT", "/api/v1/nodes", "application/json", "{}")
            .await
            .0,
        405
    );
    assert_eq!(
        raw(
            &server,
            "PATCH",
            "/api/v1/nodes/gpu-node-1",
            "text/plain",
            "{}"
        )
        .await
        .0,
        415
    );
    assert_eq!(
        raw(
            &server,
            "PATCH",
            "/api/v1/nodes/gpu-node-1",
            "application/merge-patch+json",
            "\u{0}\u{1}"
        )
        .await
        .0,
        400
    );
    assert_eq!(
        raw(
            &server,
            "POST",
            "/api/v1/namespaces/ml/pods/trainer/binding",
            "application/json",
            "{}"
        )
        .await
        .0,
        422
    );
    assert_eq!(
        raw(
            &server,
            "GET",
            "/api/v1/pods?continue=zz",
            "application/json",
            ""
        )
        .await
        .0,
        400
    );
    let (code, _) = raw(
        &server,
        "GET",
        "/api/v1/pods?watch=true&resourceVersion=abc",
        "application/json",
        "",
    )
    .await;
    assert_eq!(code, 400);
    assert!(
        server.get_object("pods", Some("ml"), "trainer").is_some(),
        "the store is intact"
    );
}

#[tokio::test]
async fn discovery_documents() {
    let server = ApiServer::start().await.expect("starts");
    let client = server.admin_client();
    let version = client.apiserver_version().await.expect("/version");
    assert_eq!(version.major, "1");
    let core = client.list_core_api_resources("v1").await.expect("/api/v1");
    let find = |name: &str| core.resources.iter().find(|r| r.name == name);
    assert!(
        find("pods").is_some_and(
            |r| r.namespaced && r.short_names.as_deref() == Some(&["po".to_string()][..])
        )
    );
    assert!(find("nodes").is_some_and(|r| !r.namespaced));
    assert!(find("pods/binding").is_some_and(|r| r.verbs == ["create"]));
    assert!(find("pods/status").is_some());
    assert!(find("nodes/status").is_some());
    let groups = client.list_api_groups().await.expect("/apis");
    let group_names: Vec<&str> = groups.groups.iter().map(|g| g.name.as_str()).collect();
    for g in [
        "coordination.k8s.io",
        "authorization.k8s.io",
        "events.k8s.io",
    ] {
        assert!(group_names.contains(&g), "{g} in {group_names:?}");
    }
    let leases = client
        .list_api_group_resources("coordination.k8s.io/v1")
        .await
        .expect("/apis/coordination.k8s.io/v1");
    assert_eq!(leases.resources[0].name, "leases");
    let namespaces = server.list_objects("namespaces", None);
    assert_eq!(namespaces.len(), 4);
}

#[tokio::test]
async fn shutdown_stops_serving() {
    let server = ApiServer::start().await.expect("starts");
    let addr = server.addr();
    tokio::net::TcpStream::connect(addr)
        .await
        .expect("listening");
    server.shutdown().await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the port is closed"
    );
}

// ---------------------------------------------------------------------------------------
// Real kubectl.

const SDK_BIN: &str = "/usr/lib/google-cloud-sdk/bin";

/// The kubectl binary `name` (`kubectl` from PATH, or `kubectl.1.27` etc. from the SDK);
/// panics loudly when it is missing: every machine of this project has them.
fn kubectl_binary(name: &str) -> PathBuf {
    let candidates: Vec<PathBuf> = if name == "kubectl" {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).map(|d| d.join(name)).collect())
            .unwrap_or_default()
    } else {
        vec![Path::new(SDK_BIN).join(name)]
    };
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed (looked on PATH and in {SDK_BIN}); the real-kubectl tests \
                 need kubectl, kubectl.1.27 and kubectl.1.33 (Google Cloud SDK component \
                 'kubectl'), which every machine of this project has"
            )
        })
}

struct Kubectl {
    binary: PathBuf,
    kubeconfig: PathBuf,
    cache: tempfile::TempDir,
}

impl Kubectl {
    fn new(name: &str, server: &ApiServer) -> Kubectl {
        Kubectl {
            binary: kubectl_binary(name),
            kubeconfig: server.admin_kubeconfig_path(),
            cache: tempfile::tempdir().expect("a cache dir"),
        }
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.cache.path())
            .args(args)
            .env("HOME", self.cache.path())
            .env_remove("KUBECONFIG")
            .kill_on_drop(true);
        cmd
    }

    /// Runs kubectl; returns stdout, panicking with stderr on failure.
    async fn ok(&self, args: &[&str]) -> String {
        let out = tokio::time::timeout(DEADLINE, self.command(args).output())
            .await
            .expect("kubectl finishes")
            .expect("kubectl runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{} {args:?} failed: {stderr}",
            self.binary.display()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs kubectl expecting failure; returns stderr.
    async fn fails(&self, args: &[&str]) -> String {
        let out = tokio::time::timeout(DEADLINE, self.command(args).output())
            .await
            .expect("kubectl finishes")
            .expect("kubectl runs");
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

fn annotation(server: &ApiServer, ns: &str, pod: &str, key: &str) -> Option<String> {
    server
        .get_object("pods", Some(ns), pod)?
        .pointer(&format!("/metadata/annotations/{}", key.replace('/', "~1")))?
        .as_str()
        .map(str::to_string)
}

async fn kubectl_basics(name: &str) {
    let server = seeded().await;
    let k = Kubectl::new(name, &server);

    let pods = k.ok(&["get", "pods", "-A"]).await;
    for expected in [
        "NAMESPACE",
        "trainer",
        "bound",
        "plain",
        "Running",
        "Pending",
    ] {
        assert!(pods.contains(expected), "{name}: {expected} in\n{pods}");
    }
    let wide = k.ok(&["get", "pods", "-n", "ml", "-o", "wide"]).await;
    assert!(
        wide.contains("gpu-node-1") && wide.contains("NODE"),
        "{name}: {wide}"
    );
    let nodes = k.ok(&["get", "nodes"]).await;
    assert!(
        nodes.contains("gpu-node-1") && nodes.contains("NotReady"),
        "{name}: {nodes}"
    );
    let json_out: Value =
        serde_json::from_str(&k.ok(&["get", "nodes", "-o", "json"]).await).expect("JSON");
    assert_eq!(json_out["kind"], "List");
    assert_eq!(json_out["items"].as_array().map(Vec::len), Some(2));
    let one: Value = serde_json::from_str(
        &k.ok(&["get", "pod", "trainer", "-n", "ml", "-o", "json"])
            .await,
    )
    .expect("JSON");
    assert_eq!(one["metadata"]["name"], "trainer");
    let short = k
        .ok(&["get", "po", "-n", "ml", "-l", "app=trainer", "-o", "name"])
        .await;
    assert_eq!(short.trim(), "pod/trainer");

    let file = fixture("apiserver/new-pod.yaml");
    let file = file.to_str().expect("a UTF-8 path");
    let created = k.ok(&["create", "-f", file]).await;
    assert!(
        created.contains("created-by-kubectl created"),
        "{name}: {created}"
    );
    assert!(
        server
            .get_object("pods", Some("default"), "created-by-kubectl")
            .is_some()
    );
    let err = k.fails(&["create", "-f", file]).await;
    assert!(
        err.contains("AlreadyExists") || err.contains("already exists"),
        "{name}: {err}"
    );

    k.ok(&[
        "annotate",
        "pod",
        "created-by-kubectl",
        "example.com/note=hello",
    ])
    .await;
    assert_eq!(
        annotation(&server, "default", "created-by-kubectl", "example.com/note").as_deref(),
        Some("hello")
    );
    k.ok(&["label", "pod", "created-by-kubectl", "team=gpu"])
        .await;
    let labelled = k.ok(&["get", "pods", "-l", "team=gpu", "-o", "name"]).await;
    assert_eq!(labelled.trim(), "pod/created-by-kubectl");
    k.ok(&["annotate", "pod", "created-by-kubectl", "example.com/note-"])
        .await;
    assert_eq!(
        annotation(&server, "default", "created-by-kubectl", "example.com/note"),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_1_27_gets_creates_annotates() {
    kubectl_basics("kubectl.1.27").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_1_33_gets_creates_annotates() {
    kubectl_basics("kubectl.1.33").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_on_path_patches_deletes_and_watches() {
    let server = seeded().await;
    let k = Kubectl::new("kubectl", &server);
    kubectl_basics("kubectl").await;

    // A pod patched in each of the three patch types (the default: strategic merge); each
    // leaves its value at a JSON pointer of the stored pod.
    for (patch_type, patch, pointer, want) in [
        (
            Some("merge"),
            r#"{"metadata":{"annotations":{"m":"merged"}}}"#,
            "/metadata/annotations/m",
            "merged",
        ),
        (
            Some("json"),
            r#"[{"op":"add","path":"/metadata/annotations/j","value":"json"}]"#,
            "/metadata/annotations/j",
            "json",
        ),
        (
            None,
            r#"{"metadata":{"labels":{"s":"strategic"}}}"#,
            "/metadata/labels/s",
            "strategic",
        ),
    ] {
        let mut args = vec!["patch", "pod", "trainer", "-n", "ml", "-p", patch];
        if let Some(patch_type) = patch_type {
            args.extend(["--type", patch_type]);
        }
        k.ok(&args).await;
        let pod = server
            .get_object("pods", Some("ml"), "trainer")
            .expect("pod");
        assert_eq!(
            pod.pointer(pointer).and_then(Value::as_str),
            Some(want),
            "{patch_type:?} patch {patch}: {pod}"
        );
    }
    k.ok(&[
        "patch",
        "node",
        "gpu-node-2",
        "--subresource",
        "status",
        "--type",
        "merge",
        "-p",
        r#"{"status":{"capacity":{"aliyun.com/gpu-count":"2"}}}"#,
    ])
    .await;
    let node = server
        .get_object("nodes", None, "gpu-node-2")
        .expect("node");
    assert_eq!(node["status"]["capacity"]["aliyun.com/gpu-count"], "2");

    // get --watch prints a line for a change made while it runs.
    let mut child = k
        .command(&[
            "get",
            "pods",
            "-n",
            "ml",
            "--watch",
            "--output-watch-events",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl --watch starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut next_line = async || {
        tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("kubectl --watch prints before the deadline")
            .expect("reads stdout")
            .expect("kubectl --watch keeps running")
    };
    // The initial listing: a header and both pods.
    let mut initial = Vec::new();
    while initial.len() < 3 {
        initial.push(next_line().await);
    }
    assert!(initial[0].contains("NAME"), "{initial:?}");
    server
        .set_pod_phase("ml", "trainer", "Running")
        .expect("sets the phase");
    let changed = next_line().await;
    assert!(
        changed.contains("MODIFIED") && changed.contains("trainer") && changed.contains("Running"),
        "{changed}"
    );
    server
        .delete_object("pods", Some("ml"), "bound")
        .expect("deletes");
    let deleted = next_line().await;
    assert!(
        deleted.contains("DELETED") && deleted.contains("bound"),
        "{deleted}"
    );
    child.kill().await.expect("kubectl --watch stops");

    let out = k
        .ok(&["delete", "pod", "trainer", "-n", "ml", "--wait=false"])
        .await;
    assert!(out.contains("deleted"), "{out}");
    assert!(server.get_object("pods", Some("ml"), "trainer").is_none());
    let err = k.fails(&["get", "pod", "trainer", "-n", "ml"]).await;
    assert!(
        err.contains("NotFound") || err.contains("not found"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sdk_kubectl_lists_and_creates() {
    for minor in 28..=32 {
        let name = format!("kubectl.1.{minor}");
        let server = seeded().await;
        let k = Kubectl::new(&name, &server);
        let pods = k.ok(&["get", "pods", "-A"]).await;
        assert!(
            pods.contains("trainer") && pods.contains("ml"),
            "{name}: {pods}"
        );
        let file = fixture("apiserver/new-pod.yaml");
        let created = k
            .ok(&["create", "-f", file.to_str().expect("a UTF-8 path")])
            .await;
        assert!(
            created.contains("created-by-kubectl created"),
            "{name}: {created}"
        );
    }
}

#[tokio::test]
async fn watches_send_bookmarks_end_on_timeout_and_stream_initial_events() {
    let server = seeded().await;
    let cms: Api<ConfigMap> = Api::namespaced(server.admin_client(), "default");
    let rv = server.resource_version().to_string();
    let mut bookmarked = cms
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("watch opens")
        .boxed();
    match next_event(&mut bookmarked).await {
        WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, rv),
        other => panic!("expected a BOOKMARK, got {other:?}"),
    }
    let mut timed = cms
        .watch(&WatchParams::default().disable_bookmarks().timeout(1), &rv)
        .await
        .expect("watch opens")
        .boxed();
    let end = tokio::time::timeout(DEADLINE, timed.next())
        .await
        .expect("the watch ends after timeoutSeconds");
    assert!(end.is_none(), "no event, just the end: {end:?}");

    // Streaming lists (sendInitialEvents + the initial-events-end bookmark).
    server
        .create_object(serde_json::to_value(configmap("before")).expect("json"))
        .expect("creates");
    let (reader, writer) = reflector::store();
    let config = watcher::Config::default().streaming_lists();
    let mut stream = reflector(writer, watcher(cms, config)).boxed();
    drive_until(&mut stream, &reader, "the streamed initial state", |s| {
        s == ["before"]
    })
    .await;
    server
        .create_object(serde_json::to_value(configmap("streamed")).expect("json"))
        .expect("creates");
    drive_until(&mut stream, &reader, "a change after the stream", |s| {
        s.contains(&"streamed".to_string())
    })
    .await;
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.query.contains("sendInitialEvents=true")),
        "the watcher used a streaming list"
    );
}

#[tokio::test]
async fn leases_and_events_round_trip() {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::events::v1::Event as NewEvent;
    let server = ApiServer::start().await.expect("starts");
    let client = server.admin_client();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": { "name": "gpushare-extender" },
        "spec": { "holderIdentity": "a", "leaseDurationSeconds": 15 },
    }))
    .expect("a lease");
    let created = leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("creates");
    let mut taken = created.clone();
    taken
        .spec
        .get_or_insert_with(Default::default)
        .holder_identity = Some("b".into());
    leases
        .replace("gpushare-extender", &PostParams::default(), &taken)
        .await
        .expect("the first replace wins");
    let err = leases
        .replace("gpushare-extender", &PostParams::default(), &created)
        .await
        .expect_err("a stale replace loses");
    assert_eq!(api_code(err), 409);
    let held: Lease = server
        .get_as("leases", Some("kube-system"), "gpushare-extender")
        .expect("stored");
    assert_eq!(
        held.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("b")
    );

    let events: Api<NewEvent> = Api::namespaced(client.clone(), "default");
    let event: NewEvent = serde_json::from_value(json!({
        "metadata": { "generateName": "pod-" },
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reason": "GpuAllocated", "action": "Binding", "type": "Normal",
        "reportingController": "gpushare.io/extender", "reportingInstance": "x",
        "note": "allocated",
    }))
    .expect("an event");
    let stored = events
        .create(&PostParams::default(), &event)
        .await
        .expect("creates");
    let name = stored.metadata.name.expect("a generated name");
    assert!(name.starts_with("pod-") && name.len() == 9, "{name}");
    let listed = server.list_objects("events.events.k8s.io", Some("default"));
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["reason"], "GpuAllocated");
    assert!(
        server.list_objects("events", Some("default")).is_empty(),
        "core events are apart"
    );
}
