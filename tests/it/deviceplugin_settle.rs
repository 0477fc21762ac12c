//! The device plugin under the orders, repeats and faults a real kubelet and API server
//! produce (issue 15, items 9–14): kubelet admitting pods in another order than they were
//! bound, pods re-created under the same name, a slow first pod list, a hung PATCH, kubelet
//! asking again for a container it already asked about, and a memory-unit change on a node
//! that still runs pods placed under the old unit.
//!
//! Every scenario runs over the sandbox API server (with its fault injection) and the sandbox
//! kubelet, through real unix sockets.

use std::time::Duration;

use gpushare::core::wire;
use gpushare::gpu::fake::fake_uuid;
use gpushare_sandbox::apiserver::{ApiServer, Fault, FaultAction};
use gpushare_sandbox::kubelet::Kubelet;
use k8s_openapi::api::core::v1::Pod;

use crate::support::deviceplugin_cluster::{
    NODE, RESOURCE, cluster, cluster_seeded, env, node_yaml, pod_json,
};
use crate::support::role_process::RoleProcess;
use crate::support::socket_dir::short_tempdir;
use crate::support::wait::DEADLINE;

fn gpu_of(resp: &gpushare::kubelet_api::deviceplugin::ContainerAllocateResponse) -> String {
    env(resp, wire::ENV_VISIBLE_DEVICES).to_string()
}

/// Item 9: kubelet admits a newer two-container pod before an older one-container pod whose
/// container has the size of the second one. The half-allocated pod is finished first, so
/// both its containers get the GPU the extender chose for it.
#[tokio::test]
async fn a_half_allocated_pod_is_finished_before_another_pod_starts() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("two", &[("a", 2), ("b", 3)], Some(0), 2_000);
    c.bound_pod("one", &[("main", 3)], Some(1), 1_000);
    let (_, a) = c.allocate("two", "a", 2).await.expect("allocated");
    let (_, b) = c.allocate("two", "b", 3).await.expect("allocated");
    let (_, one) = c.allocate("one", "main", 3).await.expect("allocated");
    assert_eq!(gpu_of(&a), "0");
    assert_eq!(
        gpu_of(&b),
        "0",
        "the second container of \"two\" stays on its GPU"
    );
    assert_eq!(gpu_of(&one), "1");
    c.plugin().reconcile().await.expect("a reconcile pass");
    let (two_ann, one_ann) = (c.annotations("two"), c.annotations("one"));
    assert_eq!(two_ann[wire::ANN_GPU_INDEX], "0");
    assert_eq!(two_ann[wire::ANN_ASSIGNED], "true");
    assert_eq!(two_ann[wire::POD_ANN_ALLOCATED_CONTAINERS], "a,b");
    assert_eq!(one_ann[wire::ANN_GPU_INDEX], "1");
    assert_eq!(one_ann[wire::ANN_ASSIGNED], "true");
    assert_eq!(c.plugin().metrics().swaps_corrected.get(), 0);
    c.stop().await;
}

/// Item 9: when a pod's containers did end up on different GPUs (kubelet admitted a pod whose
/// first container looked like the head of an older pod), the reconcile does not rewrite any
/// annotation of the pods involved: the per-GPU totals it would write are wrong whichever way.
/// It raises an Event and counts the split instead.
#[tokio::test]
async fn a_pod_split_over_two_gpus_is_reported_not_corrected() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("m", &[("c1", 3), ("c2", 2)], Some(0), 1_000);
    c.bound_pod("p", &[("main", 3)], Some(1), 2_000);
    // The cross-check sees kubelet's allocations only once all three are made (a pass in
    // between would correct the first swap and avoid the split this test is about).
    c.kubelet.pause_pod_resources(true);
    // kubelet starts p first: its container looks like m's first one (older, same size).
    let (_, p) = c.allocate("p", "main", 3).await.expect("allocated");
    let (_, m1) = c.allocate("m", "c1", 3).await.expect("allocated");
    let (_, m2) = c.allocate("m", "c2", 2).await.expect("allocated");
    assert_ne!(gpu_of(&m1), gpu_of(&m2), "the scenario splits m");
    let before = (c.annotations("m"), c.annotations("p"));
    c.kubelet.pause_pod_resources(false);
    c.plugin().reconcile().await.expect("a reconcile pass");
    let after = (c.annotations("m"), c.annotations("p"));
    for (pod, b, a) in [("m", &before.0, &after.0), ("p", &before.1, &after.1)] {
        for key in [wire::ANN_GPU_INDEX, wire::ANN_DEVICE_MEM] {
            assert_eq!(b.get(key), a.get(key), "{pod}: {key} rewritten");
        }
    }
    assert_eq!(gpu_of(&p), "0");
    assert_eq!(c.plugin().metrics().swaps_corrected.get(), 0);
    let metrics = c.plugin().render_metrics();
    assert!(
        metrics.contains("gpushare_device_plugin_split_pods_total 1"),
        "{metrics}"
    );
    c.wait_for("a split Event on the node", |c| {
        c.warning_events("GpuShareAllocationSplit")
            .iter()
            .any(|e| e["note"].as_str().is_some_and(|m| m.contains("default/m")))
    })
    .await;
    c.stop().await;
}

/// Item 10: a pod deleted and re-created under the same name (a StatefulSet) is never moved
/// by the record of its predecessor, even when kubelet hands the predecessor's device IDs to
/// another pod; the records of the gone pod are dropped.
#[tokio::test]
async fn a_pod_recreated_under_its_name_is_not_moved_by_a_stale_record() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("web-0", &[("main", 4)], Some(0), 1_000);
    let (old_ids, first) = c.allocate("web-0", "main", 4).await.expect("allocated");
    assert_eq!(gpu_of(&first), "0");
    c.plugin().reconcile().await.expect("a reconcile pass");
    // Deleted and re-created: the new web-0 is bound to GPU 1; another pod to GPU 0.
    c.api
        .delete_object("pods", Some("default"), "web-0")
        .expect("deleted");
    c.kubelet.release_pod("default", "web-0");
    c.bound_pod("web-0", &[("main", 4)], Some(1), 3_000);
    c.bound_pod("other", &[("main", 4)], Some(0), 2_000);
    let (other_ids, other) = c.allocate("other", "main", 4).await.expect("allocated");
    assert_eq!(gpu_of(&other), "0");
    assert_eq!(
        other_ids, old_ids,
        "kubelet reuses the freed IDs (the scenario)"
    );
    c.plugin().reconcile().await.expect("a reconcile pass");
    assert_eq!(c.annotations("web-0")[wire::ANN_GPU_INDEX], "1");
    let (_, web) = c.allocate("web-0", "main", 4).await.expect("allocated");
    assert_eq!(
        gpu_of(&web),
        "1",
        "the new web-0 runs on the GPU chosen for it"
    );
    c.plugin().reconcile().await.expect("a reconcile pass");
    let ann = c.annotations("web-0");
    assert_eq!(ann[wire::ANN_GPU_INDEX], "1");
    assert_eq!(ann[wire::ANN_ASSIGNED], "true");
    assert_eq!(c.plugin().metrics().swaps_corrected.get(), 0);
    let stale: Vec<_> = c
        .plugin()
        .allocations()
        .await
        .into_iter()
        .filter(|r| r.name == "web-0" && r.gpu_index == 0)
        .collect();
    assert!(
        stale.is_empty(),
        "the gone pod's record is dropped: {stale:?}"
    );
    c.stop().await;
}

/// Item 11: the plugin registers with kubelet only once its first pod list is in, so the
/// first Allocate never fails because that list was slow.
#[tokio::test]
async fn registration_waits_for_the_first_pod_list() {
    let c = cluster_seeded(
        "2x16GiB",
        &node_yaml(""),
        |api| {
            api.create_object(pod_json("early", &[], &[("main", 2)], Some(1), 1))
                .expect("pod");
            api.inject(Fault::new(
                Some(http::Method::GET),
                "/api/v1/pods?",
                FaultAction::Delay(Duration::from_secs(3)),
            ));
        },
        |_| {},
    )
    .await
    .expect("starts");
    assert!(
        c.plugin().pods_synced(),
        "registered with kubelet before the pod store synced"
    );
    let (_, resp) = c.allocate("early", "main", 2).await.expect("allocated");
    assert_eq!(gpu_of(&resp), "1");
    c.stop().await;
}

/// Item 12: one hung PATCH (a slow API server) holds up neither the Allocate of another pod
/// (no plugin-wide lock across an API call) nor, for long, its own (each call has a request
/// timeout and is tried again within the Allocate deadline).
#[tokio::test]
async fn a_hung_patch_stalls_no_other_allocate() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("slow", &[("main", 2)], Some(0), 1);
    c.bound_pod("fast", &[("main", 3)], Some(1), 2);
    c.api.inject(Fault::new(
        Some(http::Method::PATCH),
        "/pods/slow",
        FaultAction::Delay(Duration::from_secs(60)),
    ));
    let (fast, slow) = {
        let slow = c.allocate("slow", "main", 2);
        let fast = async {
            c.wait_for("the slow pod's PATCH to be in flight", |c| {
                c.api
                    .requests()
                    .iter()
                    .any(|r| r.method == http::Method::PATCH && r.path.ends_with("/pods/slow"))
            })
            .await;
            c.allocate("fast", "main", 3).await
        };
        tokio::pin!(slow);
        let fast = tokio::select! {
            r = &mut slow => panic!("the slow pod's Allocate ended before the other one: {r:?}"),
            r = fast => r.expect("the other pod is allocated"),
        };
        (fast, slow.await)
    };
    assert_eq!(gpu_of(&fast.1), "1");
    let (_, slow) = slow.expect("the slow pod's Allocate succeeds on a second try");
    assert_eq!(gpu_of(&slow), "0");
    assert_eq!(c.annotations("slow")[wire::ANN_ASSIGNED], "true");
    c.api.clear_faults();
    c.stop().await;
}

/// Item 13: kubelet asks again for a container it already asked about (a kubelet restart
/// before it recorded the answer, a cancelled RPC), with the same device IDs or with others:
/// the container gets the same GPU again, not the failure envs.
#[tokio::test]
async fn allocate_again_for_the_same_container_gives_the_same_gpu() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("again", &[("main", 4)], Some(1), 1);
    let ids: Vec<String> = (0..4)
        .map(|n| wire::fake_device_id(&fake_uuid(1), n))
        .collect();
    for attempt in 0..2 {
        let resp = c
            .kubelet
            .allocate(RESOURCE, ids.clone())
            .await
            .expect("answered");
        assert_eq!(
            gpu_of(&resp.container_responses[0]),
            "1",
            "attempt {attempt} with the same IDs"
        );
    }
    // kubelet never recorded those answers; it asks again, choosing IDs anew.
    let (_, resp) = c.allocate("again", "main", 4).await.expect("answered");
    assert_eq!(gpu_of(&resp), "1", "asked again with other IDs");
    let ann = c.annotations("again");
    assert_eq!(ann[wire::ANN_GPU_INDEX], "1");
    assert_eq!(ann[wire::ANN_ASSIGNED], "true");

    // The second container of a two-container pod, asked again.
    c.bound_pod("pair", &[("a", 2), ("b", 3)], Some(0), 2);
    let (_, a) = c.allocate("pair", "a", 2).await.expect("allocated");
    assert_eq!(gpu_of(&a), "0");
    let lost: Vec<String> = (10..13)
        .map(|n| wire::fake_device_id(&fake_uuid(0), n))
        .collect();
    let resp = c.kubelet.allocate(RESOURCE, lost).await.expect("answered");
    assert_eq!(gpu_of(&resp.container_responses[0]), "0");
    let (_, b) = c.allocate("pair", "b", 3).await.expect("answered again");
    assert_eq!(gpu_of(&b), "0");
    assert_eq!(c.plugin().metrics().allocations_with("no_candidate"), 0);
    c.stop().await;
}

fn node_with_unit(unit: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels:\n    gpushare: \"true\"\n  annotations:\n    {}: {unit}\nstatus:\n  capacity:\n    cpu: \"8\"\n",
        wire::NODE_ANN_MEMORY_UNIT
    )
}

/// Item 14: a node whose device plugin served GiB is restarted with `--memory-unit MiB` while
/// a pod placed under GiB still runs: the change is refused loudly (the old unit is kept, a
/// Warning Event names the pods); once no such pod is left the change applies.
#[tokio::test]
async fn a_memory_unit_change_is_refused_while_pods_placed_under_the_old_unit_remain() {
    let mib = |cfg: &mut gpushare::config::Config| {
        cfg.node.memory_unit = "MiB".parse().expect("unit");
    };
    let c = cluster_seeded(
        "2x16GiB",
        &node_with_unit("GiB"),
        |api| {
            let mut pod = pod_json("placed-in-gib", &[], &[("main", 4)], Some(0), 1);
            pod["metadata"]["annotations"][wire::ANN_ASSIGNED] = "true".into();
            pod["status"]["phase"] = "Running".into();
            api.create_object(pod).expect("pod");
        },
        mib,
    )
    .await
    .expect("starts");
    assert_eq!(
        c.kubelet.devices(RESOURCE).len(),
        32,
        "still 16 GiB units per GPU"
    );
    let node = c
        .api
        .get_as::<k8s_openapi::api::core::v1::Node>("nodes", None, NODE)
        .expect("node");
    let ann = node.metadata.annotations.unwrap_or_default();
    assert_eq!(ann[wire::NODE_ANN_MEMORY_UNIT], "GiB");
    c.wait_for("the refusal as a Warning Event", |c| {
        c.warning_events("GpuShareMemoryUnitChangeRefused")
            .iter()
            .any(|e| {
                e["note"]
                    .as_str()
                    .is_some_and(|m| m.contains("default/placed-in-gib"))
            })
    })
    .await;
    c.stop().await;

    // Without pods placed under GiB the change applies.
    let c = cluster_seeded("2x16GiB", &node_with_unit("GiB"), |_| {}, mib)
        .await
        .expect("starts");
    assert_eq!(c.kubelet.devices(RESOURCE).len(), 2 * 16 * 1024);
    let node = c
        .api
        .get_as::<k8s_openapi::api::core::v1::Node>("nodes", None, NODE)
        .expect("node");
    assert_eq!(
        node.metadata.annotations.unwrap_or_default()[wire::NODE_ANN_MEMORY_UNIT],
        "MiB"
    );
    c.stop().await;
}

/// A lagging pod store never hands a deleted pod's GPU to a new pod that kubelet gives the
/// same device IDs: the plugin's pod watch is held, so its store still shows the deleted pod
/// and not the new one; the answer names the GPU the extender chose for the new pod.
#[tokio::test]
async fn a_lagging_store_never_answers_a_deleted_pods_gpu_for_its_device_ids() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("gone", &[("main", 4)], Some(0), 1_000);
    let (old_ids, first) = c.allocate("gone", "main", 4).await.expect("allocated");
    assert_eq!(gpu_of(&first), "0");
    // The plugin's pod watch is cut and every re-watch held: its store stops here.
    let hold = gpushare_sandbox::apiserver::Hold::new();
    c.api.inject(
        Fault::new(
            Some(http::Method::GET),
            "watch=true",
            FaultAction::Hold(hold.clone()),
        )
        .times(1_000),
    );
    c.api.inject(Fault::new(
        Some(http::Method::GET),
        "/pods?",
        FaultAction::CutWatch,
    ));
    hold.wait_reached(1).await;
    c.api
        .delete_object("pods", Some("default"), "gone")
        .expect("deleted");
    c.kubelet.release_pod("default", "gone");
    c.bound_pod("new", &[("main", 4)], Some(1), 2_000);
    // kubelet hands the freed IDs to the new pod.
    let resp = c
        .kubelet
        .allocate(RESOURCE, old_ids)
        .await
        .expect("answered");
    assert_eq!(
        gpu_of(&resp.container_responses[0]),
        "1",
        "the new pod's GPU, never the deleted pod's"
    );
    hold.release();
    c.stop().await;
}

/// Waits until the plugin's pod watch shows each of `pods`.
async fn watched(c: &crate::support::deviceplugin_cluster::Cluster, pods: &[&str]) {
    c.wait_for("the plugin's pod watch to show the pods", |c| {
        pods.iter()
            .all(|p| c.plugin().watched_pod("default", p).is_some())
    })
    .await;
}

/// The API server down while GPU containers start: Allocate answers from the pod store (each
/// pod its own GPU: the first answer is not matched again), and `ASSIGNED=true` lands on both
/// pods once the API server answers again.
#[tokio::test]
async fn containers_start_while_the_api_server_is_down_and_assigned_lands_after() {
    let c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("first", &[("main", 4)], Some(0), 1);
    c.bound_pod("second", &[("main", 4)], Some(1), 2);
    watched(&c, &["first", "second"]).await;
    c.api
        .inject(Fault::new(None, "/", FaultAction::DropConnection).times(usize::MAX));
    let (_, first) = c
        .kubelet
        .allocate_container(RESOURCE, "default", "first", "main", 4)
        .await
        .expect("answered with the API server down");
    let (_, second) = c
        .kubelet
        .allocate_container(RESOURCE, "default", "second", "main", 4)
        .await
        .expect("answered with the API server down");
    assert_eq!(gpu_of(&first), "0");
    assert_eq!(gpu_of(&second), "1");
    assert_eq!(c.plugin().metrics().allocations_with("matched"), 2);
    assert_eq!(c.annotations("first")[wire::ANN_ASSIGNED], "false");
    assert_eq!(c.annotations("second")[wire::ANN_ASSIGNED], "false");
    assert_eq!(c.plugin().pending_writes(), 2);
    c.api.clear_faults();
    c.wait_for("ASSIGNED=true on both pods", |c| {
        ["first", "second"]
            .iter()
            .all(|p| c.annotations(p)[wire::ANN_ASSIGNED] == "true")
    })
    .await;
    assert_eq!(c.annotations("second")[wire::ANN_GPU_INDEX], "1");
    c.stop().await;
}

/// The API server refuses every write to pod `answered` (503) from now on; its container of
/// 4 units is then answered, on GPU 0.
async fn answer_while_its_writes_are_refused(api: &ApiServer, kubelet: &Kubelet) {
    api.inject(
        Fault::new(
            Some(http::Method::PATCH),
            "/pods/answered",
            FaultAction::Status(503),
        )
        .times(usize::MAX),
    );
    let (_, answered) = kubelet
        .allocate_container(RESOURCE, "default", "answered", "main", 4)
        .await
        .expect("answered");
    assert_eq!(gpu_of(&answered), "0");
}

/// After the plugin's restart: pod `next` (4 units, GPU 1) is answered on its own GPU, not
/// matched to the container `answered` was given (which the API still shows unallocated, and
/// older); then the API server takes writes again.
async fn answer_next_on_its_own_gpu(api: &ApiServer, kubelet: &Kubelet) {
    let (_, next) = kubelet
        .allocate_container(RESOURCE, "default", "next", "main", 4)
        .await
        .expect("answered");
    assert_eq!(
        gpu_of(&next),
        "1",
        "the answered pod is not matched a second time"
    );
    api.clear_faults();
}

/// Whether the plugin has tried to write pod `answered`.
fn write_tried(api: &ApiServer) -> bool {
    api.requests()
        .iter()
        .any(|r| r.method == http::Method::PATCH && r.path.ends_with("/pods/answered"))
}

/// The plugin stops between its answer and the write of `ASSIGNED` (the API server refuses
/// that pod's writes meanwhile): the restarted plugin finishes the write, and the next
/// Allocate of the same size matches the other pod, not the answered one again.
#[tokio::test]
async fn a_restart_between_an_answer_and_its_write_finishes_the_write_and_matches_no_second_pod() {
    let mut c = cluster("2x16GiB", |_| {}).await;
    c.bound_pod("answered", &[("main", 4)], Some(0), 1);
    c.bound_pod("next", &[("main", 4)], Some(1), 2);
    watched(&c, &["answered", "next"]).await;
    answer_while_its_writes_are_refused(&c.api, &c.kubelet).await;
    c.wait_for("the write to be tried", |c| write_tried(&c.api))
        .await;
    c.restart_plugin().await.expect("the plugin starts again");
    watched(&c, &["answered", "next"]).await;
    assert_eq!(c.annotations("answered")[wire::ANN_ASSIGNED], "false");
    answer_next_on_its_own_gpu(&c.api, &c.kubelet).await;
    c.wait_for("ASSIGNED=true on both pods", |c| {
        ["answered", "next"]
            .iter()
            .all(|p| c.annotations(p)[wire::ANN_ASSIGNED] == "true")
    })
    .await;
    assert_eq!(c.annotations("answered")[wire::ANN_GPU_INDEX], "0");
    assert_eq!(c.plugin().metrics().allocations_with("no_candidate"), 0);
    c.stop().await;
}

/// The same as the binary runs on a node: `gpushare device-plugin` killed with SIGKILL (no
/// shutdown path of its own) between an answer and the write of `ASSIGNED` (the API server
/// refuses that pod's writes meanwhile), then started again with the same flags and state
/// directory, as its DaemonSet restarts it. The answer was durable before kubelet had it: the
/// restarted process matches the next Allocate of the same size to the other pod (the
/// answered one still looks unallocated in the API, and is older), and finishes the write
/// once the API server takes it; the journal is empty after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_plugin_killed_between_an_answer_and_its_write_finishes_it_after_its_restart() {
    let dir = short_tempdir();
    let api = ApiServer::start().await.expect("the sandbox API server");
    api.seed_yaml(&node_yaml("")).expect("the node");
    for (name, gpu, assumed) in [("answered", 0, 1), ("next", 1, 2)] {
        api.create_object(pod_json(name, &[], &[("main", 4)], Some(gpu), assumed))
            .expect("the pod");
    }
    let kubelet = Kubelet::start(dir.path())
        .await
        .expect("the sandbox kubelet");
    let state = dir.path().join("state");
    let flag = |name: &str, path: &std::path::Path| format!("--{name}={}", path.display());
    let args: Vec<String> = vec![
        "device-plugin".into(),
        format!("--node-name={NODE}"),
        "--gpu-backend=fake".into(),
        "--fake-gpus=2x16GiB".into(),
        flag("device-plugin-dir", &kubelet.device_plugin_dir()),
        flag("pod-resources-socket", &kubelet.pod_resources_socket()),
        flag("state-dir", &state),
        "--admin-address=".into(),
        flag("kubeconfig", &api.admin_kubeconfig_path()),
        "--skip-doctor".into(),
    ];
    let mut role = RoleProcess::start("device-plugin", None, &args, &[]);
    let registrations = |k: &Kubelet| k.plugin(RESOURCE).map_or(0, |p| p.registrations);
    role.wait_for("its registration", DEADLINE, || registrations(&kubelet) > 0)
        .await;
    kubelet.wait_registered(RESOURCE).await.expect("registered");
    let annotations = |pod: &str| {
        api.get_as::<Pod>("pods", Some("default"), pod)
            .and_then(|p| p.metadata.annotations)
            .unwrap_or_default()
    };
    answer_while_its_writes_are_refused(&api, &kubelet).await;
    let journal = || {
        std::fs::read_dir(&state)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
                    .count()
            })
            .unwrap_or(0)
    };
    assert_eq!(
        journal(),
        1,
        "the answer is in the journal before kubelet has it"
    );
    role.wait_for("the write to be tried", DEADLINE, || write_tried(&api))
        .await;

    let before = registrations(&kubelet);
    role.kill_and_restart();
    role.wait_for("its registration after the restart", DEADLINE, || {
        registrations(&kubelet) > before
    })
    .await;
    kubelet
        .wait_registered(RESOURCE)
        .await
        .expect("registered again");
    assert_eq!(annotations("answered")[wire::ANN_ASSIGNED], "false");
    answer_next_on_its_own_gpu(&api, &kubelet).await;
    role.wait_for("ASSIGNED=true on both pods", DEADLINE, || {
        ["answered", "next"]
            .iter()
            .all(|p| annotations(p).get(wire::ANN_ASSIGNED).map(String::as_str) == Some("true"))
    })
    .await;
    assert_eq!(annotations("answered")[wire::ANN_GPU_INDEX], "0");
    assert_eq!(annotations("next")[wire::ANN_GPU_INDEX], "1");
    role.wait_for("the journal to empty", DEADLINE, || journal() == 0)
        .await;
    kubelet.stop().await;
    api.shutdown().await;
}
