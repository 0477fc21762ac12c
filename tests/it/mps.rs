//! MPS mode end to end without a GPU: the device plugin over the sandbox kubelet and API
//! server, with a fake `nvidia-cuda-mps-control` (`tests/fixtures/mps/`) that records what it
//! is told. Start, adopt, restart after a crash (metric and Event), the per-GPU defaults,
//! shutdown (stopped only when started by the plugin), Allocate's envs and mounts, the refusal
//! and the readiness while the daemon is down, and `doctor --mps`.

use std::io::{Read, Write};
use std::time::Duration;

use gpushare::core::wire;
use gpushare::gpu::fake::fake_uuid;
use serde_json::Value;

use gpushare_sandbox::dra_kubelet::ClaimOutcome;

use crate::support::deviceplugin_cluster::{Cluster, cluster, env};
use crate::support::doctor_node::{check_of as check, fake_node_doctor, report_of};
use crate::support::dra_node;
use crate::support::extender_http;
use crate::support::mps::FakeMps;
use crate::support::wait::wait_until;

/// `/readyz` of the plugin's admin server: its status code (a blocking call: the tests run on
/// a multi-threaded runtime, so the admin server answers on another worker).
fn readyz(c: &Cluster) -> u16 {
    let addr = c.plugin().admin_addr().expect("the admin server runs");
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return 0;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn with_admin(cfg: &mut gpushare::config::Config) {
    cfg.device_plugin.admin_address = "127.0.0.1:0".to_string();
}

fn metric(c: &Cluster, name: &str) -> Option<f64> {
    c.plugin()
        .render_metrics()
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_the_daemon_sets_per_gpu_defaults_hands_out_the_pipe_and_stops_it() {
    let fake = FakeMps::new();
    let c = cluster("16GiB,24GiB", |cfg| {
        fake.configure(cfg);
        with_admin(cfg);
        cfg.node.mps_active_thread_percentage = 40;
        cfg.node.mps_pinned_mem_limit_mib = 20480;
        cfg.node.mps_shm_dir = fake.shm_dir.clone();
    })
    .await;
    assert_eq!(fake.starts(), 1, "{:?}", fake.commands());
    assert!(
        fake.sent("start ")[0].ends_with(&format!(
            " CUDA_VISIBLE_DEVICES={},{}",
            fake_uuid(0),
            fake_uuid(1)
        )),
        "the daemon sees the served GPUs: {:?}",
        fake.commands()
    );
    assert!(fake.answers(), "the daemon serves");
    assert_eq!(
        fake.sent("set_default_active_thread_percentage"),
        ["set_default_active_thread_percentage 40"]
    );
    // The ceiling, never more than the GPU has.
    assert_eq!(
        fake.sent("set_default_device_pinned_mem_limit"),
        [
            format!(
                "set_default_device_pinned_mem_limit {} 16384M",
                fake_uuid(0)
            ),
            format!(
                "set_default_device_pinned_mem_limit {} 20480M",
                fake_uuid(1)
            ),
        ]
    );
    // kubelet lists the devices as soon as it answers Register; the plugin marks itself
    // registered when that answer reaches it.
    c.wait_for("ready", |c| readyz(c) == 200).await;
    assert_eq!(
        metric(&c, "gpushare_device_plugin_mps_daemon_up"),
        Some(1.0)
    );

    c.bound_pod("p", &[("main", 3)], Some(1), 1);
    let (_, resp) = c.allocate("p", "main", 3).await.expect("allocated");
    assert_eq!(env(&resp, wire::ENV_MPS_PINNED_MEM_LIMIT), "0=3072M");
    assert_eq!(env(&resp, wire::ENV_MPS_ACTIVE_THREAD_PERCENTAGE), "40");
    let pipe = fake.pipe_dir.display().to_string();
    assert_eq!(env(&resp, wire::ENV_MPS_PIPE_DIRECTORY), pipe);
    let mounts: Vec<(&str, &str)> = resp
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let shm = fake.shm_dir.display().to_string();
    assert_eq!(
        mounts,
        [(pipe.as_str(), pipe.as_str()), (shm.as_str(), "/dev/shm")]
    );

    c.stop().await;
    assert!(!fake.answers(), "the daemon it started is stopped");
    assert_eq!(fake.commands().last().map(String::as_str), Some("quit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopts_a_daemon_already_running_and_leaves_it_running() {
    let fake = FakeMps::new();
    fake.start_by_hand();
    let c = cluster("2x16GiB", |cfg| {
        fake.configure(cfg);
        with_admin(cfg);
    })
    .await;
    assert_eq!(fake.starts(), 1, "no second daemon: {:?}", fake.commands());
    // Unconfigured, the daemon's default ceiling is the smallest safe value, one memory unit
    // (GiB here) per GPU: a client that drops its own limit gets that, never the whole GPU.
    assert_eq!(
        fake.sent("set_default_device_pinned_mem_limit"),
        [
            format!("set_default_device_pinned_mem_limit {} 1024M", fake_uuid(0)),
            format!("set_default_device_pinned_mem_limit {} 1024M", fake_uuid(1)),
        ]
    );
    assert!(
        fake.sent("set_default_active_thread_percentage").is_empty(),
        "0 leaves the percentage alone"
    );
    // kubelet lists the devices as soon as it answers Register; the plugin marks itself
    // registered when that answer reaches it.
    c.wait_for("ready", |c| readyz(c) == 200).await;
    c.bound_pod("p", &[("main", 2)], Some(0), 1);
    c.allocate("p", "main", 2).await.expect("allocated");
    c.stop().await;
    assert!(fake.answers(), "an adopted daemon is left running");
    assert!(!fake.commands().iter().any(|l| l == "quit"));
    assert!(fake.quit());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_a_crashed_daemon_sets_its_defaults_again_and_reports_it() {
    let fake = FakeMps::new();
    let c = cluster("2x16GiB", |cfg| {
        fake.configure(cfg);
        with_admin(cfg);
    })
    .await;
    let first = fake.pid().expect("a daemon");
    fake.kill();
    c.wait_for("the daemon restarted", |c| {
        c.plugin().node_metrics().mps_daemon_restarts.get() == 1
    })
    .await;
    assert_eq!(fake.starts(), 2, "{:?}", fake.commands());
    assert_ne!(fake.pid(), Some(first));
    assert!(fake.answers());
    // The new daemon got the defaults too (two GPUs, twice).
    c.wait_for("the defaults set again", |_| {
        fake.sent("set_default_device_pinned_mem_limit").len() == 4
    })
    .await;
    c.wait_for("a GpuShareMpsDaemonRestarted Event", |c| {
        !c.warning_events("GpuShareMpsDaemonRestarted").is_empty()
    })
    .await;
    let event = &c.warning_events("GpuShareMpsDaemonRestarted")[0];
    assert_eq!(event["type"], "Warning");
    assert!(
        event["note"]
            .as_str()
            .is_some_and(|n| n.contains("stopped answering")),
        "{event:#}"
    );
    assert!(
        c.plugin()
            .render_metrics()
            .contains("gpushare_device_plugin_mps_daemon_restarts_total 1"),
        "{}",
        c.plugin().render_metrics()
    );
    c.wait_for("ready again", |c| readyz(c) == 200).await;
    c.stop().await;
    assert!(!fake.answers(), "the restarted daemon is ours: stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_daemon_is_down_allocate_refuses_and_the_plugin_is_not_ready() {
    let fake = FakeMps::new();
    let c = cluster("2x16GiB", |cfg| {
        fake.configure(cfg);
        with_admin(cfg);
    })
    .await;
    // kubelet lists the devices as soon as it answers Register; the plugin marks itself
    // registered when that answer reaches it.
    c.wait_for("ready", |c| readyz(c) == 200).await;
    fake.refuse_starts(true);
    fake.kill();
    c.wait_for("not ready", |c| readyz(c) == 503).await;
    assert_eq!(
        metric(&c, "gpushare_device_plugin_mps_daemon_up"),
        Some(0.0)
    );
    c.bound_pod("p", &[("main", 2)], Some(0), 1);
    let err = c
        .allocate("p", "main", 2)
        .await
        .expect_err("refused while the daemon is down");
    let msg = format!("{err:#}");
    assert!(msg.contains("MPS control daemon"), "{msg}");
    assert!(msg.contains("gpushare doctor --mps"), "{msg}");
    assert!(
        !c.annotations("p")
            .contains_key(wire::POD_ANN_ALLOCATED_CONTAINERS),
        "nothing claimed or recorded"
    );
    assert_eq!(c.plugin().metrics().allocations_with("mps_not_serving"), 1);
    c.wait_for("a GpuShareMpsDaemonStartFailed Event", |c| {
        !c.warning_events("GpuShareMpsDaemonStartFailed").is_empty()
    })
    .await;
    // Starts work again: the supervisor (backing off) brings it back, and Allocate serves.
    fake.refuse_starts(false);
    c.wait_for("ready again", |c| readyz(c) == 200).await;
    assert!(fake.answers());
    let (_, resp) = c.allocate("p", "main", 2).await.expect("allocated");
    assert_eq!(env(&resp, wire::ENV_MPS_PINNED_MEM_LIMIT), "0=2048M");
    c.stop().await;
    assert!(!fake.answers());
}

/// The DRA plugin follows the same node agent's daemon as the device plugin: not ready and
/// refusing every prepare while the daemon is down (nothing written, the claim's error names
/// the daemon), the node metrics on its own `/metrics`, and serving again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_plugin_refuses_prepare_and_is_not_ready_while_the_daemon_is_down() {
    let fake = FakeMps::new();
    let node = dra_node::node(|cfg| {
        fake.configure(cfg);
        cfg.dra.admin_address = "127.0.0.1:0".to_string();
    })
    .await;
    let plugin = node.start().await;
    let addr = plugin.admin_addr().expect("the admin server runs");
    let kubelet = node.kubelet();
    kubelet
        .wait_registered(wire::DRA_DRIVER_NAME)
        .await
        .expect("registers");
    wait_until("ready", || plugin.is_ready()).await;
    let (_, text) = extender_http::get(addr, "/metrics").await;
    for line in [
        "gpushare_dra_plugin_mps_daemon_up 1\n",
        "gpushare_dra_plugin_unhealthy_gpus 0\n",
        "gpushare_dra_plugin_memory_unit_change_refused 0\n",
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    fake.refuse_starts(true);
    fake.kill();
    wait_until("not ready", || !plugin.is_ready()).await;
    let (status, _) = extender_http::get(addr, "/readyz").await;
    assert_eq!(status, 503);
    let (_, text) = extender_http::get(addr, "/metrics").await;
    assert!(
        text.contains("gpushare_dra_plugin_mps_daemon_up 0\n"),
        "{text}"
    );

    dra_node::submit(&node.api, "p", 2, 1);
    crate::support::dra::allocate_one(&node.api).await;
    let claims = kubelet.prepare_pod("default", "p").await.expect("answers");
    let ClaimOutcome::Failed(why) = &claims[0].outcome else {
        panic!("prepared while the daemon is down: {claims:?}");
    };
    assert!(why.contains("MPS control daemon"), "{why}");
    assert!(why.contains("gpushare doctor --mps"), "{why}");
    assert!(
        !dra_node::spec_file(&node.cdi_dir(), &claims[0].uid).exists(),
        "nothing written"
    );
    c_wait_events(&node).await;

    fake.refuse_starts(false);
    wait_until("ready again", || plugin.is_ready()).await;
    let claims = kubelet.prepare_pod("default", "p").await.expect("answers");
    assert!(
        matches!(claims[0].outcome, ClaimOutcome::Prepared(_)),
        "{claims:?}"
    );
    let spec = std::fs::read_to_string(dra_node::spec_file(&node.cdi_dir(), &claims[0].uid))
        .expect("the spec");
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M"),
        "{spec}"
    );
    plugin.stop().await;
    assert!(!fake.answers());
}

/// Waits for the node's `GpuShareMpsDaemonStartFailed` Event raised by the DRA plugin's agent.
async fn c_wait_events(node: &dra_node::Node) {
    wait_until("a GpuShareMpsDaemonStartFailed Event", || {
        node.api
            .list_objects("events.events.k8s.io", Some("default"))
            .iter()
            .any(|e| e["reason"] == "GpuShareMpsDaemonStartFailed")
    })
    .await;
}

// ---------------------------------------------------------------- doctor --mps

fn doctor_mps(root: &std::path::Path) -> Value {
    let mps = [
        "--mps",
        "--mps-pipe-dir",
        "/run/mps/pipe",
        "--mps-log-dir",
        "/run/mps/log",
    ];
    report_of(&fake_node_doctor(
        root,
        "2x16GiB",
        &[&mps[..], &["-o", "json"]].concat(),
    ))
}

#[test]
fn doctor_mps_checks_the_binary_the_directories_the_user_and_the_daemon() {
    let root = tempfile::Builder::new()
        .prefix("mpsdoc")
        .tempdir_in("/tmp")
        .expect("tempdir");
    // The fake as the host's /usr/bin/nvidia-cuda-mps-control.
    let fake = FakeMps::new();
    let bin = root.path().join("usr/bin");
    std::fs::create_dir_all(&bin).expect("usr/bin");
    std::fs::copy(&fake.program, bin.join("nvidia-cuda-mps-control")).expect("copied");

    let report = doctor_mps(root.path());
    assert_eq!(check(&report, "mps-binary")["status"], "ok", "{report:#}");
    assert!(
        check(&report, "mps-binary")["detail"]
            .as_str()
            .is_some_and(|d| d.contains("/usr/bin/nvidia-cuda-mps-control")),
        "{report:#}"
    );
    assert_eq!(check(&report, "mps-dirs")["status"], "warn", "missing dirs");
    let user = check(&report, "mps-user");
    assert!(
        user["detail"].as_str().is_some_and(|d| d.contains("uid")),
        "{user:#}"
    );
    let daemon = check(&report, "mps-daemon");
    assert_eq!(daemon["status"], "fail", "{daemon:#}");
    assert!(
        daemon["hint"]
            .as_str()
            .is_some_and(|h| h.contains("CUDA_MPS_PIPE_DIRECTORY=/run/mps/pipe")),
        "{daemon:#}"
    );

    // A daemon on the host's pipe directory, and the directories made.
    let pipe = root.path().join("run/mps/pipe");
    std::fs::create_dir_all(root.path().join("run/mps/log")).expect("log dir");
    let mut on_host = FakeMps::new();
    on_host.pipe_dir = pipe;
    on_host.start_by_hand();
    let report = doctor_mps(root.path());
    assert_eq!(check(&report, "mps-dirs")["status"], "ok", "{report:#}");
    let daemon = check(&report, "mps-daemon");
    assert_eq!(daemon["status"], "ok", "{daemon:#}");
    assert!(
        daemon["detail"]
            .as_str()
            .is_some_and(|d| d.contains("answers get_server_list") && d.contains("pid file")),
        "{daemon:#}"
    );
    // The running daemon's user, from its pid file and the host's /proc: not root is a warn.
    let pid = on_host.pid().expect("the daemon's pid file");
    let proc_dir = root.path().join(format!("proc/{pid}"));
    std::fs::create_dir_all(&proc_dir).expect("proc dir");
    std::fs::write(
        proc_dir.join("status"),
        "Name:\tnvidia-cuda-mps\nUid:\t1000\t1000\t1000\t1000\n",
    )
    .expect("status written");
    let report = doctor_mps(root.path());
    let user = check(&report, "mps-user");
    assert_eq!(user["status"], "warn", "{user:#}");
    assert!(
        user["detail"]
            .as_str()
            .is_some_and(|d| d.contains(&format!("pid {pid}")) && d.contains("uid 1000")),
        "{user:#}"
    );
    assert!(on_host.quit());
}
