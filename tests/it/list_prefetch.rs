//! Paged lists one page ahead (`k8s::list_prefetch`), over the sandbox API server with the
//! client every role uses: the next page is asked for before the caller asks, handed over
//! when it does (never fetched twice), and a whole list through kube-runtime's watcher holds
//! every object exactly once.

use std::collections::BTreeSet;

use futures::StreamExt as _;
use gpushare::k8s::client::{ClientOptions, client};
use gpushare_sandbox::apiserver::ApiServer;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use kube::runtime::watcher;
use serde_json::json;

use crate::support::extender_cluster::wait_until;

async fn sandbox_with_pods(n: usize) -> ApiServer {
    let api = ApiServer::start().await.expect("sandbox API server");
    for i in 0..n {
        api.create_object(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("p{i:04}"), "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "x"}]}
        }))
        .expect("create pod");
    }
    api
}

async fn our_client(api: &ApiServer) -> kube::Client {
    let path = api.kubeconfig_path();
    client(&ClientOptions {
        kubeconfig: path.to_str(),
        ..ClientOptions::default()
    })
    .await
    .expect("client")
}

/// The `continue` tokens of the pod list requests the server received, in order.
fn continue_requests(api: &ApiServer) -> Vec<String> {
    api.requests()
        .iter()
        .filter(|r| r.method == http::Method::GET && r.path == "/api/v1/namespaces/default/pods")
        .filter_map(|r| {
            form_urlencoded::parse(r.query.as_bytes())
                .find(|(k, _)| k == "continue")
                .map(|(_, v)| v.into_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_page_is_asked_for_before_the_caller_asks_and_is_never_fetched_twice() {
    let api = sandbox_with_pods(250).await;
    let pods: Api<Pod> = Api::namespaced(our_client(&api).await, "default");
    let first = pods
        .list(&ListParams::default().limit(100))
        .await
        .expect("first page");
    assert_eq!(first.items.len(), 100);
    let token = first.metadata.continue_.clone().expect("more pages");
    // Nobody asked for page 2 yet, and the server is already serving it.
    wait_until("the second page asked for ahead", || {
        continue_requests(&api).contains(&token)
    })
    .await;
    let second = pods
        .list(&ListParams::default().limit(100).continue_token(&token))
        .await
        .expect("second page");
    assert_eq!(
        continue_requests(&api)
            .iter()
            .filter(|t| **t == token)
            .count(),
        1,
        "page 2 was fetched once, ahead, and handed over"
    );
    let names = |l: &kube::api::ObjectList<Pod>| {
        l.items
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect::<Vec<_>>()
    };
    let expected: Vec<String> = (100..200).map(|i| format!("p{i:04}")).collect();
    assert_eq!(names(&second), expected, "page 2 is the list's page 2");
    // Page 3 (the last: no token) was fetched ahead too; asking for it gets the 50 left.
    let third_token = second.metadata.continue_.clone().expect("a third page");
    let third = pods
        .list(
            &ListParams::default()
                .limit(100)
                .continue_token(&third_token),
        )
        .await
        .expect("third page");
    assert_eq!(third.items.len(), 50);
    assert!(third.metadata.continue_.as_deref().unwrap_or("").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_list_through_the_watcher_holds_every_object_once() {
    let api = sandbox_with_pods(230).await;
    let pods: Api<Pod> = Api::namespaced(our_client(&api).await, "default");
    let mut stream = std::pin::pin!(watcher(pods, watcher::Config::default().page_size(40)));
    let mut seen = Vec::new();
    while let Some(event) = stream.next().await {
        match event.expect("watch event") {
            watcher::Event::InitApply(p) => seen.push(p.metadata.name.unwrap_or_default()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(seen.len(), 230, "every pod once");
    assert_eq!(unique.len(), 230);
    // 6 pages: 5 continue requests, each once (the ahead fetch served the watcher).
    let tokens = continue_requests(&api);
    let distinct: BTreeSet<&String> = tokens.iter().collect();
    assert_eq!(tokens.len(), 5, "{tokens:?}");
    assert_eq!(distinct.len(), 5, "{tokens:?}");
}
