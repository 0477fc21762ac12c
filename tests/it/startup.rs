//! A start-up that survives a bad minute: a server role whose API server does not answer yet
//! waits for it with backoff (`cluster.api_wait_secs`), logging each try, and then starts and
//! serves; a set-up mistake (a broken node, a 403) still refuses at once with its hint.
//!
//! The outage is the sandbox API server answering 503 (or dropping the connection) to every
//! request until the test clears the fault — which it does once the role has made at least
//! two tries (read from the server's request log, or the role's own log lines), never after a
//! sleep.

use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare::core::wire;
use gpushare::doctor::{Options, Role, diagnose, preflight};
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};

use crate::support::doctor_node::{NODE, node_root, preflight_config};
use crate::support::extender_http::http;
use crate::support::wait::{poll, wait_until_within};

const DEADLINE: Duration = Duration::from_secs(60);

/// Every request fails with `action` until the faults are cleared.
fn outage(api: &ApiServer, action: FaultAction) {
    api.inject(Fault::new(None, "/", action).times(usize::MAX));
}

fn version_requests(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.path == "/version")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_preflight_waits_out_an_api_server_that_does_not_answer_yet() {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(NODE).expect("seed node");
    let root = node_root("docker-nvidia");
    let plugins = root.path().join("var/lib/kubelet/device-plugins");
    let config = preflight_config(&api, &plugins);

    for (role, action) in [
        (Role::ControlPlane, FaultAction::Status(503)),
        (Role::Node, FaultAction::DropConnection),
    ] {
        outage(&api, action.clone());
        let before = version_requests(&api);
        let running = tokio::spawn({
            let config = config.clone();
            async move { preflight(role, &config).await }
        });
        // The report's own try, then at least two tries of the wait.
        wait_until_within("three tries of GET /version", DEADLINE, || {
            version_requests(&api) >= before + 3 || running.is_finished()
        })
        .await;
        assert!(
            !running.is_finished(),
            "{role:?}: the preflight ended during the outage"
        );
        api.clear_faults();
        let outcome = tokio::time::timeout(DEADLINE, running)
            .await
            .expect("the preflight finishes once the API answers")
            .expect("no panic");
        assert!(outcome.is_ok(), "{role:?} ({action:?}): {outcome:?}");
    }

    // And the role then starts and serves.
    let mut c = config.clone();
    c.extender.bind_address = [127, 0, 0, 1].into();
    c.extender.port = 0;
    let ext = gpushare::extender::start(&c, api.admin_client(), Shutdown::never())
        .await
        .expect("extender starts");
    ext.wait_ready().await.expect("extender ready");
    ext.stop().await;
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_up_mistakes_refuse_at_once_even_while_the_api_server_is_down() {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(NODE).expect("seed node");
    let root = node_root("docker-nvidia");
    let plugins = root.path().join("var/lib/kubelet/device-plugins");

    // A node without its kubelet directory, during an outage: no wait, the node's hint.
    outage(&api, FaultAction::Status(503));
    let mut broken = preflight_config(&api, &plugins);
    broken.device_plugin.device_plugin_dir = root.path().join("no-such-dir");
    // (What the report alone asks, to compare with.)
    let before = version_requests(&api);
    let _ = diagnose(&Options::preflight(Role::Node), &broken).await;
    let report_alone = version_requests(&api) - before;
    let before = version_requests(&api);
    let err = preflight(Role::Node, &broken)
        .await
        .expect_err("device-plugin-dir fails");
    assert!(format!("{err:#}").contains("device-plugin-dir"), "{err:#}");
    // The report's own tries vary by one with scheduling (a try racing its timeout under
    // load); a wait would add the STARTUP_BACKOFF tries of cluster.api_wait_secs (a dozen
    // over its default), so more than one extra try means it waited.
    let preflight_tries = version_requests(&api) - before;
    assert!(
        preflight_tries <= report_alone + 1,
        "only the report's own tries ({report_alone}), nothing waited: {preflight_tries}"
    );

    // 403: the API server answers, and refuses this identity. Waiting will not help.
    api.clear_faults();
    outage(&api, FaultAction::Status(403));
    let config = preflight_config(&api, &plugins);
    let before = version_requests(&api);
    let err = preflight(Role::ControlPlane, &config)
        .await
        .expect_err("a 403 refuses");
    let text = format!("{err:#}");
    assert!(
        text.contains("api-server") && text.contains("refused") && text.contains("credentials"),
        "{text}"
    );
    assert!(
        version_requests(&api) - before <= 2,
        "a 403 was retried: {} tries",
        version_requests(&api) - before
    );

    // An outage longer than cluster.api_wait_secs: given up, with the key to raise.
    api.clear_faults();
    outage(&api, FaultAction::Status(503));
    let mut short = preflight_config(&api, &plugins);
    short.cluster.api_wait_secs = 1;
    let err = preflight(Role::ControlPlane, &short)
        .await
        .expect_err("gives up after the wait");
    assert!(
        format!("{err:#}").contains("cluster.api_wait_secs"),
        "{err:#}"
    );
    api.shutdown().await;
}

/// The binary itself: `gpushare extender` started during an outage logs its tries, then
/// serves once the API server answers, instead of exiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_process_waits_for_the_api_server_and_then_serves() {
    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(NODE).expect("seed node");
    outage(&api, FaultAction::Status(503));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = std::process::Command::new(crate::support::bin())
        .args(["extender", "--skip-doctor", "--bind-address", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .arg("--kubeconfig")
        .arg(api.admin_kubeconfig_path())
        .env("GPUSHARE_LOG__FORMAT", "json")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn({
        let lines = lines.clone();
        move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        }
    });
    let waiting = |lines: &Mutex<Vec<String>>| {
        lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|l| l.contains("not reachable yet"))
            .count()
    };
    wait_until_within("two logged tries", DEADLINE, || {
        waiting(&lines) >= 2 || matches!(child.try_wait(), Ok(Some(_)))
    })
    .await;
    assert!(
        matches!(child.try_wait(), Ok(None)),
        "the extender exited during the outage: {:?}",
        lines.lock().unwrap_or_else(|e| e.into_inner())
    );
    api.clear_faults();
    let url = format!("http://127.0.0.1:{port}/readyz");
    let served = poll("the extender to serve", DEADLINE, || {
        let exited = child.try_wait();
        let url = url.clone();
        async move {
            if let Ok(Some(status)) = exited {
                return Ok(Err(format!("the extender exited: {status}")));
            }
            match http(http::Method::GET, &url, None).await {
                Some((200, _)) => Ok(Ok(())),
                got => Err(got.map(|(s, _)| s)),
            }
        }
    })
    .await;
    assert!(
        served.is_ok(),
        "the extender never served: {served:?} {:?}",
        lines.lock().unwrap_or_else(|e| e.into_inner())
    );
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    api.shutdown().await;
}

/// The binary itself: `gpushare device-plugin` lists its node's pods while its preflight runs
/// (the preflight held at its `GET /version`, which it cannot pass without, the list is asked
/// all the same), and registers with kubelet once both are done — not before the preflight
/// has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_lists_its_pods_while_its_preflight_runs() {
    use gpushare_sandbox::apiserver::Hold;
    use gpushare_sandbox::kubelet::Kubelet;

    let api = ApiServer::start().await.expect("sandbox API server");
    api.seed_yaml(NODE).expect("seed node");
    let dir = crate::support::socket_dir::short_tempdir();
    let kubelet = Kubelet::start(dir.path()).await.expect("kubelet");
    let hold = Hold::new();
    api.inject(
        Fault::new(
            Some(http::Method::GET),
            "/version",
            FaultAction::Hold(hold.clone()),
        )
        .times(usize::MAX),
    );
    let mut child = tokio::process::Command::new(crate::support::bin())
        .arg("device-plugin")
        .env("KUBECONFIG", api.admin_kubeconfig_path())
        .env("NODE_NAME", "gpu-node-1")
        .env("GPUSHARE_GPU__BACKEND", "fake")
        .env("GPUSHARE_GPU__FAKE_GPUS", "2x16GiB")
        .env(
            "GPUSHARE_DEVICE_PLUGIN__DEVICE_PLUGIN_DIR",
            kubelet.device_plugin_dir(),
        )
        .env(
            "GPUSHARE_DEVICE_PLUGIN__POD_RESOURCES_SOCKET",
            kubelet.pod_resources_socket(),
        )
        .env("GPUSHARE_DEVICE_PLUGIN__ADMIN_ADDRESS", "")
        .kill_on_drop(true)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let pod_list = |api: &ApiServer| {
        api.requests().iter().any(|r| {
            r.path == "/api/v1/pods"
                && r.query.contains("spec.nodeName")
                && !r.query.contains("watch=")
        })
    };
    tokio::time::timeout(DEADLINE, hold.wait_reached(1))
        .await
        .expect("the preflight asks for the version");
    wait_until_within("the pod list while the preflight is held", DEADLINE, || {
        pod_list(&api)
    })
    .await;
    assert!(
        kubelet.plugin(wire::RESOURCE_GPU_MEM).is_none(),
        "not registered before the preflight has passed"
    );
    hold.release();
    kubelet
        .wait_registered(wire::RESOURCE_GPU_MEM)
        .await
        .expect("registers once the preflight passed");
    let _ = child.start_kill();
    let _ = child.wait().await;
    kubelet.stop().await;
    api.shutdown().await;
}
