//! What an operator meets after `helm install`, rendered by the real Helm engine: the image
//! defaults to the chart's appVersion, NOTES.txt says what comes next for the mode installed
//! (label the nodes, wire kube-scheduler or not, `gpushare doctor`, the metrics) and names
//! every object gpushare makes at run time that `helm uninstall` leaves behind, the GPU
//! Operator example selects the nodes the operator labels, and combinations of values that
//! cannot work are refused with the reason.

use serde_json::{Value, json};

use gpushare::config::Config;
use gpushare::core::wire;

use crate::support::helm_chart::{CHART, user_renders};
use crate::support::source_tree::read;

/// One render: its manifests (file name -> text) and notes, or Helm's error.
struct Render {
    manifests: serde_json::Map<String, Value>,
    notes: String,
}

/// Renders each of `values` (user values, merged by Helm itself); `None` without the engine.
fn render_all(values: &[Value]) -> Option<Vec<Result<Render, String>>> {
    let renders = user_renders(values, true)?;
    Some(
        renders
            .into_iter()
            .map(|r| {
                r.map(|r| Render {
                    manifests: r["manifests"].as_object().cloned().unwrap_or_default(),
                    notes: r["notes"].as_str().unwrap_or_default().to_string(),
                })
            })
            .collect(),
    )
}

/// The NOTES of each of `values`, each of which must render; `None` without the engine.
fn notes_of(values: &[Value]) -> Option<Vec<String>> {
    let results = render_all(values)?;
    Some(
        results
            .into_iter()
            .map(|r| r.expect("renders").notes)
            .collect(),
    )
}

fn render(values: Value) -> Option<Render> {
    let mut all = render_all(std::slice::from_ref(&values))?;
    Some(
        all.remove(0)
            .unwrap_or_else(|e| panic!("{values} does not render: {e}")),
    )
}

/// The rendered object of `kind` named `name`, in template `file`.
fn object(r: &Render, file: &str, kind: &str, name: &str) -> Value {
    let text = r.manifests[file].as_str().expect("text");
    crate::support::source_tree::yaml_documents(file, text)
        .into_iter()
        .map(|d| serde_json::to_value(d).expect("JSON"))
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in {file}"))
}

fn images(r: &Render) -> Vec<String> {
    let ds = object(
        r,
        "device-plugin-daemonset.yaml",
        "DaemonSet",
        "gpushare-device-plugin-ds",
    );
    let dep = object(
        r,
        "extender-deployment.yaml",
        "Deployment",
        "gpushare-schd-extender",
    );
    [ds, dep]
        .iter()
        .map(|o| {
            o["spec"]["template"]["spec"]["containers"][0]["image"]
                .as_str()
                .expect("image")
                .to_string()
        })
        .collect()
}

#[test]
fn an_empty_image_tag_is_the_chart_app_version() {
    let chart: Value =
        yaml_serde::from_str(&read(&format!("{CHART}/Chart.yaml"))).expect("Chart.yaml");
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    let Some(defaults) = render(json!({})) else {
        return;
    };
    let app = format!("ghcr.io/gpushare/gpushare:{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(images(&defaults), [app.clone(), app]);
    let Some(tagged) = render(json!({"image": {"repository": "gpushare", "tag": "dev"}})) else {
        return;
    };
    assert_eq!(images(&tagged), ["gpushare:dev", "gpushare:dev"]);
}

#[test]
fn the_notes_say_what_comes_next_for_the_mode_installed() {
    let Some(notes) = notes_of(&[
        json!({}),
        json!({"scheduler": {"mode": "dedicated"}}),
        json!({"serviceMonitor": {"enabled": true}}),
    ]) else {
        return;
    };
    let (extender, dedicated, monitored) = (&notes[0], &notes[1], &notes[2]);
    for n in [extender, dedicated] {
        for what in [
            "kubectl label node <gpu-node> gpushare=true",
            "rollout status daemonset/gpushare-device-plugin-ds",
            "exec daemonset/gpushare-device-plugin-ds -- gpushare doctor",
            "kubectl inspect gpushare",
            "http://gpushare-schd-extender.kube-system.svc:12345/metrics",
            "port 9101 (admin)",
            "Prometheus Operator: set serviceMonitor.enabled=true",
            "helm uninstall gpushare -n kube-system",
        ] {
            assert!(n.contains(what), "{what:?} not in the notes:\n{n}");
        }
    }
    // Extender mode: kube-scheduler must be wired (and unwired before uninstalling).
    assert!(extender.contains("Wire kube-scheduler to the extender"));
    assert!(extender.contains("packaging/kubeadm/install-scheduler-extender.sh\n"));
    assert!(extender.contains("http://127.0.0.1:32766/gpushare-scheduler"));
    assert!(extender.contains("install-scheduler-extender.sh --revert"));
    assert!(extender.contains("gpushare doctor --role control-plane"));
    assert!(!extender.contains("Nothing to wire"));
    // Dedicated mode: nothing to wire, the scheduler and webhook to wait for.
    assert!(dedicated.contains("Nothing to wire"));
    assert!(dedicated.contains("rollout status deployment/gpushare-scheduler"));
    assert!(dedicated.contains("rollout status deployment/gpushare-webhook"));
    assert!(!dedicated.contains("install-scheduler-extender.sh"));
    assert!(monitored.contains("scraped through the ServiceMonitor gpushare"));
}

#[test]
fn the_notes_name_what_gpushare_makes_at_run_time_and_uninstall_leaves() {
    let Some(notes) = notes_of(&[
        json!({}),
        json!({"scheduler": {"mode": "dedicated"}, "devicePlugin": {"mps": true, "enforcement": "limiter"}}),
        json!({"extender": {"leaseName": "my-lease"}, "scheduler": {"mode": "dedicated", "leaseName": "my-sched"}, "webhook": {"tls": {"secretName": "my-hook-tls"}}}),
    ]) else {
        return;
    };
    let defaults = Config::default();
    // What the roles write, by the names the binary uses.
    for n in &notes {
        for what in [
            wire::NODE_ANN_DEVICES,
            wire::NODE_ANN_MEMORY_UNIT,
            wire::NODE_ANN_EXCLUDED_GPUS,
            wire::RESOURCE_GPU_COUNT,
            wire::RESOURCE_GPU_MEM,
        ] {
            assert!(n.contains(what), "{what} not in the uninstall notes:\n{n}");
        }
    }
    let lease = format!("Lease kube-system/{}", defaults.extender.lease_name);
    assert!(notes[0].contains(&lease), "{}", notes[0]);
    assert!(!notes[0].contains("Secret"), "no webhook in extender mode");
    let secret = format!("Secret kube-system/{}", defaults.webhook.tls_secret);
    assert!(notes[1].contains(&secret), "{}", notes[1]);
    assert!(notes[1].contains("PRIVATE KEY"));
    assert!(notes[1].contains("Lease kube-system/gpushare-scheduler"));
    assert!(notes[1].contains("/tmp/nvidia-mps, /var/log/nvidia-mps and /run/gpushare/mps-shm"));
    // The limiter's host directories, where the node roles keep them.
    let d = &defaults.node;
    for dir in [&d.limiter_dir, &d.limiter_run_dir] {
        let dir = dir.display().to_string();
        assert!(notes[1].contains(&dir), "{dir} not in:\n{}", notes[1]);
        assert!(!notes[0].contains(&dir), "enforcement none: {}", notes[0]);
    }
    // The names follow the values.
    for what in [
        "Lease kube-system/my-lease",
        "Lease kube-system/my-sched",
        "Secret kube-system/my-hook-tls",
        "delete secret my-hook-tls",
    ] {
        assert!(notes[2].contains(what), "{what:?}:\n{}", notes[2]);
    }
}

#[test]
fn the_gpu_operator_example_selects_the_nodes_the_operator_labels() {
    let example: Value =
        yaml_serde::from_str(&read(&format!("{CHART}/examples/gpu-operator.yaml")))
            .expect("the example parses");
    let Some(r) = render(example) else {
        return;
    };
    let ds = object(
        &r,
        "device-plugin-daemonset.yaml",
        "DaemonSet",
        "gpushare-device-plugin-ds",
    );
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        json!({"nvidia.com/gpu.present": "true"}),
        "only the operator's label: the chart's gpushare=true is dropped"
    );
    assert_eq!(pod["runtimeClassName"], "nvidia");
    assert!(r.notes.contains("nothing to label"), "{}", r.notes);
}

#[test]
fn combinations_that_cannot_work_are_refused_with_the_reason() {
    let refused: Vec<(Value, &str)> = vec![
        (
            json!({"extender": {"networkPolicy": {"enabled": true}}}),
            "extender.networkPolicy.enabled with scheduler.mode=extender needs extender.networkPolicy.schedulerCIDRs: kube-scheduler runs on the control-plane nodes' host network",
        ),
        (
            json!({"extender": {"leaderElect": false}}),
            "extender.replicas=2 needs extender.leaderElect=true",
        ),
        (
            json!({"devicePlugin": {"gpuBackend": "fake"}}),
            "devicePlugin.gpuBackend=fake needs devicePlugin.fakeGpus",
        ),
        (
            json!({"devicePlugin": {"fakeGpus": "2x16GiB"}}),
            "devicePlugin.fakeGpus is read only with devicePlugin.gpuBackend=fake (it is auto)",
        ),
        (
            json!({"scheduler": {"mode": "dedicated"}, "webhook": {"tls": {"existingSecret": "mine"}}}),
            "webhook.tls.existingSecret needs webhook.tls.injectCaFrom",
        ),
    ];
    let fine = [
        json!({"extender": {"networkPolicy": {"enabled": true, "schedulerCIDRs": ["10.0.0.0/24"]}}}),
        json!({"scheduler": {"mode": "dedicated"}, "extender": {"networkPolicy": {"enabled": true}}}),
        json!({"extender": {"leaderElect": false, "replicas": 1}}),
        json!({"devicePlugin": {"gpuBackend": "fake", "fakeGpus": "2x16GiB"}}),
    ];
    let mut all: Vec<Value> = refused.iter().map(|(v, _)| v.clone()).collect();
    all.extend(fine.iter().cloned());
    let Some(results) = render_all(&all) else {
        return;
    };
    for ((values, reason), result) in refused.iter().zip(&results) {
        match result {
            Ok(_) => panic!("{values} must be refused"),
            Err(e) => assert!(e.contains(reason), "{values}: {reason:?} not in {e}"),
        }
    }
    for (values, result) in fine.iter().zip(&results[refused.len()..]) {
        assert!(result.is_ok(), "{values}: {:?}", result.as_ref().err());
    }
}

#[test]
fn the_notes_of_the_dra_path_say_how_a_node_moves() {
    let Some(off) = render(json!({})) else {
        return;
    };
    assert!(!off.notes.contains("DRA path"), "{}", off.notes);
    let on = render(json!({"dra": {"enabled": true}})).expect("renders");
    for what in [
        "gpushare.io/gpu-mem-path=dra (the device plugin keeps",
        "kubectl label node <node> gpushare.io/gpu-mem-path=dra --overwrite",
        "kubectl label namespace <namespace> gpushare.io/gpu-mem-path=dra",
        "exec daemonset/gpushare-dra-plugin -- gpushare doctor --role node --dra --driver-name=gpushare.io",
        "gpushare doctor --role control-plane --dra",
        "DeviceClass gpu-mem.gpushare.io (driver gpushare.io)",
        "DRAConsumableCapacity",
        "DRADeviceTaints",
    ] {
        assert!(
            on.notes.contains(what),
            "{what:?} not in the notes:\n{}",
            on.notes
        );
    }
}
