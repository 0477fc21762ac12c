//! The scheduling verbs' typed errors on the wire and in the metrics: the HTTP status and the
//! `{"Error": ...}` text stay upstream's (400 for a pod request filter cannot read, 500 for
//! every bind failure), and each answer is counted in `gpushare_extender_errors_total` under
//! its verb and kind.

use http::Method;
use serde_json::{Value, json};

use crate::support::extender_cluster::{extender_config, sandbox, start_extender, wait_http_ok};
use crate::support::extender_http::http;

/// The value of the `gpushare_extender_errors_total` series for `verb` and `kind` (0 when the
/// series is absent).
fn errors_total(page: &str, verb: &str, kind: &str) -> f64 {
    let series = format!("gpushare_extender_errors_total{{verb=\"{verb}\",kind=\"{kind}\"}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_bad_pod_request_and_a_failed_bind_keep_their_status_and_are_counted_by_kind() {
    let api = sandbox(1, 1, 16).await;
    let ext = start_extender(&api, &extender_config(false)).await;
    wait_http_ok(&format!("http://{}/readyz", ext.addr)).await;
    let base = format!("http://{}/gpushare-scheduler", ext.addr);
    let post = |path: &str, body: Value| {
        let url = format!("{base}/{path}");
        async move {
            let (status, body) = http(Method::POST, &url, Some(body.to_string().into_bytes()))
                .await
                .expect("the extender answers");
            let body: Value = serde_json::from_slice(&body).expect("a JSON answer");
            (status, body)
        }
    };

    let unreadable = json!({
        "Pod": { "metadata": { "name": "p", "namespace": "default" },
                 "spec": { "containers": [{ "name": "main",
                     "resources": { "limits": { "aliyun.com/gpu-mem": "lots" } } }] } },
        "NodeNames": ["node-0"],
    });
    let (status, body) = post("filter", unreadable).await;
    assert_eq!(status, 400, "{body}");
    let error = body["Error"].as_str().unwrap_or_default();
    assert!(error.starts_with("ExtenderArgs.Pod: "), "{body}");

    let missing = json!({
        "PodName": "gone", "PodNamespace": "default", "PodUID": "", "Node": "node-0",
    });
    let (status, body) = post("bind", missing).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["Error"], "pod default/gone not found");

    let (status, page) = http(Method::GET, &format!("http://{}/metrics", ext.addr), None)
        .await
        .expect("metrics answer");
    assert_eq!(status, 200);
    let page = String::from_utf8_lossy(&page);
    assert_eq!(
        errors_total(&page, "filter", "bad_pod_request"),
        1.0,
        "{page}"
    );
    assert_eq!(errors_total(&page, "bind", "pod_not_found"), 1.0, "{page}");
    // The request metric's outcomes are what they were.
    assert!(
        page.contains(
            "gpushare_extender_requests_total{verb=\"filter\",outcome=\"bad_request\"} 1"
        ),
        "{page}"
    );
    assert!(
        page.contains("gpushare_extender_requests_total{verb=\"bind\",outcome=\"error\"} 1"),
        "{page}"
    );
    ext.stop().await;
}
