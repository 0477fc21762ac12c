//! The chart's production values, rendered by the real Helm engine: every pod hardened
//! (seccomp RuntimeDefault, read-only root, no privilege escalation, no capabilities, non-root
//! where the role allows), the device plugin privileged only for the host's /dev/kmsg, image
//! digest, pull secrets, extra flags and environment, pod annotations and security contexts as
//! values, the configuration (JSON) through a ConfigMap that carries every key to the binary's own
//! loader, the ServiceMonitor, node selection per role, and the adoption of the pods an Aliyun
//! installation left running.

use std::collections::BTreeMap;

use figment::Figment;
use figment::providers::{Format, Json, Serialized, Toml};
use yaml_serde::Value;

use gpushare::config::Config;
use gpushare::core::wire;

use crate::support::assert_cli_accepts;
use crate::support::helm_chart::{
    EVERY_OPTION_ON, all_documents, assert_lint_clean, default_values, merged, strings,
};
use crate::support::source_tree::read;

fn render(overlay: &str) -> Option<Vec<Value>> {
    all_documents(merged(
        &default_values(),
        &yaml_serde::from_str(overlay).expect("overlay parses"),
    ))
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// (object name, pod template) of every workload.
fn pods(docs: &[Value]) -> Vec<(String, &Value)> {
    docs.iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("Deployment" | "DaemonSet")))
        .map(|d| {
            (
                d["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                &d["spec"]["template"],
            )
        })
        .collect()
}

/// Container args, or the command for kube-scheduler.
fn argv(c: &Value) -> Vec<String> {
    let a = strings(&c["args"]);
    if a.is_empty() {
        strings(&c["command"])
    } else {
        a
    }
}

const DEVICE_PLUGIN: &str = "gpushare-device-plugin-ds";
const DEDICATED: &str = "scheduler: {mode: dedicated}";

#[test]
fn every_pod_is_hardened_by_default() {
    let Some(extender_mode) = render("{}") else {
        return;
    };
    let dedicated = render(DEDICATED).expect("rendered");
    let mut seen = std::collections::BTreeSet::new();
    for docs in [&extender_mode, &dedicated] {
        for (name, pod) in pods(docs) {
            seen.insert(name.clone());
            let spec = &pod["spec"];
            assert_eq!(
                spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{name}"
            );
            let root = name == DEVICE_PLUGIN;
            if root {
                // kubelet's socket directory is root's; every capability is still dropped.
                assert_eq!(spec["securityContext"]["runAsUser"], 0, "{name}");
            } else {
                assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{name}");
                assert!(
                    spec["securityContext"]["runAsUser"]
                        .as_u64()
                        .is_some_and(|u| u >= 10000),
                    "{name} runs as a high uid"
                );
            }
            for c in spec["containers"].as_sequence().expect("containers") {
                let sc = &c["securityContext"];
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
                assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
                assert!(sc.get("privileged").is_none(), "{name}");
                assert!(sc["capabilities"].get("add").is_none(), "{name}");
            }
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        [
            DEVICE_PLUGIN,
            "gpushare-schd-extender",
            "gpushare-scheduler",
            "gpushare-webhook"
        ]
    );
}

#[test]
fn the_device_plugin_is_privileged_only_for_the_hosts_kmsg_or_the_mps_daemon() {
    let Some(off) = render("{}") else {
        return;
    };
    let dp = |docs: &[Value]| -> Value {
        find(docs, "DaemonSet", DEVICE_PLUGIN)["spec"]["template"]["spec"].clone()
    };
    let kmsg_volume = |spec: &Value| -> Option<Value> {
        spec["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == "kmsg")
            .cloned()
    };
    // Off: no kernel log at all (an explicitly empty --kmsg-path), no mount, no privilege.
    let spec = dp(&off);
    let c = &spec["containers"][0];
    assert!(argv(c).iter().any(|a| a == "--kmsg-path="), "{:?}", argv(c));
    assert!(kmsg_volume(&spec).is_none());
    assert_cli_accepts(&argv(c), "kmsg off");

    // On, the host's /dev/kmsg (also the chart's earlier boolean form): privileged, which
    // Kubernetes accepts only without allowPrivilegeEscalation: false; the root file system
    // stays read-only and the pod keeps its seccomp profile setting.
    for overlay in [
        "devicePlugin: {kmsg: {enabled: true}}",
        "devicePlugin: {kmsg: true}",
    ] {
        let spec = dp(&render(overlay).expect("rendered"));
        let c = &spec["containers"][0];
        let sc = &c["securityContext"];
        assert_eq!(sc["privileged"], true, "{overlay}");
        assert!(sc.get("allowPrivilegeEscalation").is_none(), "{overlay}");
        assert!(sc.get("capabilities").is_none(), "{overlay}");
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{overlay}");
        assert!(
            argv(c).iter().any(|a| a == "--kmsg-path=/dev/kmsg"),
            "{overlay}"
        );
        let v = kmsg_volume(&spec).expect("kmsg volume");
        assert_eq!(v["hostPath"]["path"], "/dev/kmsg");
        assert_eq!(v["hostPath"]["type"], "CharDevice");
        assert_cli_accepts(&argv(c), overlay);
    }

    // MPS: the daemon in the container setuids to its clients (chart_mps.rs has the rest).
    let spec = dp(&render("devicePlugin: {mps: true}").expect("rendered"));
    let sc = &spec["containers"][0]["securityContext"];
    assert_eq!(sc["privileged"], true);
    assert!(sc.get("allowPrivilegeEscalation").is_none());
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert!(kmsg_volume(&spec).is_none());

    // On, a file or FIFO a host service feeds: mounted read-only, no privilege at all.
    let overlay = "devicePlugin: {kmsg: {enabled: true, hostPath: /run/gpushare/kmsg}}";
    let spec = dp(&render(overlay).expect("rendered"));
    let c = &spec["containers"][0];
    assert!(c["securityContext"].get("privileged").is_none());
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(
        argv(c)
            .iter()
            .any(|a| a == "--kmsg-path=/run/gpushare/kmsg")
    );
    let v = kmsg_volume(&spec).expect("kmsg volume");
    assert_eq!(v["hostPath"]["path"], "/run/gpushare/kmsg");
    assert!(v["hostPath"].get("type").is_none());
    let mount = c["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "kmsg")
        .expect("kmsg mount");
    assert_eq!(mount["readOnly"], true);
}

const EVERYTHING: &str = r#"
image: {digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}
imagePullSecrets: [{name: regcred}]
podAnnotations: {example.com/team: gpu, example.com/shared: global}
scheduler: {mode: dedicated, extraArgs: [--v=4], podAnnotations: {example.com/role: scheduler}}
extender:
  extraArgs: [--url-prefix=/gpushare-scheduler]
  extraEnv: [{name: GPUSHARE_HTTP__MAX_CONNECTIONS, value: "512"}]
  podAnnotations: {example.com/role: extender, example.com/shared: mine}
  podSecurityContext: {runAsNonRoot: true, runAsUser: 20000, runAsGroup: 20000, fsGroup: 20000, seccompProfile: {type: RuntimeDefault}}
devicePlugin:
  extraArgs: [--allocate-failure=error]
  extraEnv: [{name: RUST_BACKTRACE, value: "1"}]
  podAnnotations: {example.com/role: device-plugin}
webhook:
  extraArgs: [--bind-address=0.0.0.0]
  extraEnv: [{name: RUST_BACKTRACE, value: "1"}]
  podAnnotations: {example.com/role: webhook}
"#;

#[test]
fn image_pull_secrets_extras_and_annotations_reach_every_pod() {
    let Some(docs) = render(EVERYTHING) else {
        return;
    };
    let config_checksum = pods(&docs)
        .iter()
        .find(|(n, _)| n == DEVICE_PLUGIN)
        .map(|(_, p)| p["metadata"]["annotations"]["checksum/config"].clone())
        .expect("device plugin checksum");
    let roles = [
        (
            "gpushare-schd-extender",
            "extender",
            Some("--url-prefix=/gpushare-scheduler"),
            Some("GPUSHARE_HTTP__MAX_CONNECTIONS"),
        ),
        (
            DEVICE_PLUGIN,
            "device-plugin",
            Some("--allocate-failure=error"),
            Some("RUST_BACKTRACE"),
        ),
        (
            "gpushare-webhook",
            "webhook",
            Some("--bind-address=0.0.0.0"),
            Some("RUST_BACKTRACE"),
        ),
        ("gpushare-scheduler", "scheduler", Some("--v=4"), None),
    ];
    let all = pods(&docs);
    assert_eq!(all.len(), roles.len());
    for (name, role, arg, env) in roles {
        let pod = all
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| *p)
            .unwrap_or_else(|| panic!("no {name}"));
        let spec = &pod["spec"];
        let c = &spec["containers"][0];
        assert_eq!(spec["imagePullSecrets"][0]["name"], "regcred", "{name}");
        let ann = &pod["metadata"]["annotations"];
        assert_eq!(ann["example.com/team"], "gpu", "{name}");
        assert_eq!(ann["example.com/role"], role, "{name}");
        let a = argv(c);
        if let Some(arg) = arg {
            assert_eq!(a.last().map(String::as_str), Some(arg), "{name}: {a:?}");
        }
        if let Some(env) = env {
            assert!(
                c["env"]
                    .as_sequence()
                    .expect("env")
                    .iter()
                    .any(|e| e["name"] == env),
                "{name}"
            );
        }
        if name == "gpushare-scheduler" {
            // kube-scheduler: its own image and configuration.
            assert!(
                c["image"]
                    .as_str()
                    .is_some_and(|i| i.starts_with("registry.k8s.io/"))
            );
            continue;
        }
        assert_eq!(
            c["image"],
            "ghcr.io/gpushare/gpushare@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "{name}"
        );
        // gpushare.json: mounted, passed, and a change restarts the pods.
        assert!(
            a.iter()
                .any(|x| x == "--config=/etc/gpushare/config/gpushare.json"),
            "{name}"
        );
        let mount = c["volumeMounts"]
            .as_sequence()
            .expect("mounts")
            .iter()
            .find(|m| m["name"] == "config")
            .unwrap_or_else(|| panic!("{name} mounts no config"));
        assert_eq!(mount["mountPath"], "/etc/gpushare/config");
        assert_eq!(mount["readOnly"], true);
        let vol = spec["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == "config")
            .expect("config volume");
        assert_eq!(vol["configMap"]["name"], "gpushare-config");
        assert_eq!(ann["checksum/config"], config_checksum, "{name}");
        assert_cli_accepts(&a, name);
    }
    // The role's annotation wins over the global one of the same key.
    let ext = &find(&docs, "Deployment", "gpushare-schd-extender")["spec"]["template"];
    assert_eq!(ext["metadata"]["annotations"]["example.com/shared"], "mine");
    // A security context is a value, taken as given.
    assert_eq!(ext["spec"]["securityContext"]["fsGroup"], 20000);
}

#[test]
fn every_config_key_reaches_the_binary_through_the_configmap() {
    // Every key of packaging/gpushare.toml (the file the binary's defaults are kept equal to),
    // with the config-only ones the issue names changed from their defaults.
    let mut config: serde_json::Value =
        toml::from_str(&read("packaging/gpushare.toml")).expect("gpushare.toml parses");
    let changes = serde_json::json!({
        "extender": {
            "bind_timeout_ms": 3000, "bind_settle_ms": 45000, "watch_stale_after_ms": 20000,
            "lease_duration_secs": 20, "renew_deadline_secs": 15, "retry_period_secs": 3,
            "tls_cert": "/etc/gpushare/tls/tls.crt", "tls_key": "/etc/gpushare/tls/tls.key",
            "max_body_bytes": 1048576,
        },
        "device_plugin": { "allocate_failure": "error" },
        "node": {
            "visible_devices": "uuid", "cdi_spec_dirs": ["/run/cdi"],
            "mps_active_thread_percentage": 50,
        },
        "gpu": { "kmsg_replay": true, "nvidia_smi": "/usr/bin/nvidia-smi" },
        "http": { "max_connections": 1024, "request_timeout_ms": 20000 },
        "webhook": { "cert_validity_days": 90, "renew_before_days": 10 },
        // An array of tables whose entries hold arrays of inline tables.
        "devices": { "generic": [{
            "resource": "example.com/fuse", "shares": 3, "envs": { "FUSE_OK": "1" },
            "paths": [{ "path": "/dev/fuse" }, { "path": "/dev/cuse", "permissions": "r", "optional": true }],
            "mounts": [{ "host_path": "/opt/fuse", "container_path": "/opt/fuse", "read_only": true }],
        }] },
    });
    for (section, keys) in changes.as_object().expect("map") {
        for (k, v) in keys.as_object().expect("map") {
            assert!(
                config[section].get(k).is_some(),
                "{section}.{k} is not a key of packaging/gpushare.toml"
            );
            config[section][k] = v.clone();
        }
    }
    let overlay: Value =
        yaml_serde::to_value(serde_json::json!({ "config": config })).expect("values");
    let Some(docs) = all_documents(merged(&default_values(), &overlay)) else {
        return;
    };
    let text = find(&docs, "ConfigMap", "gpushare-config")["data"]["gpushare.json"]
        .as_str()
        .expect("gpushare.json")
        .to_string();
    // The binary's own loader reads what the chart wrote (JSON, as a `.json` file is read)...
    let load = |text: &str| -> Config {
        Config::from_figment(
            &Figment::from(Serialized::defaults(Config::default())).merge(Json::string(text)),
        )
        .unwrap_or_else(|e| panic!("the binary refuses:\n{text}\n{e}"))
    };
    let from_chart = load(&text);
    // ...and finds exactly what the same values say when the toml crate writes them.
    let toml_text = toml::to_string(&config).expect("toml");
    let direct = Config::from_figment(
        &Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(&toml_text)),
    )
    .unwrap_or_else(|e| panic!("the binary refuses:\n{toml_text}\n{e}"));
    assert_eq!(from_chart, direct);
    assert_ne!(from_chart, Config::default(), "the changes arrived");
    assert_eq!(from_chart.extender.bind_timeout_ms, 3000);
    assert_eq!(from_chart.extender.lease_duration_secs, 20);
    assert_eq!(from_chart.http.max_connections, 1024);
    assert_eq!(from_chart.devices.generic[0].paths.len(), 2);
    assert!(from_chart.devices.generic[0].paths[1].optional);

    // The default render: an empty object, which the binary reads as the defaults.
    let docs = all_documents(default_values()).expect("rendered");
    let text = find(&docs, "ConfigMap", "gpushare-config")["data"]["gpushare.json"]
        .as_str()
        .expect("gpushare.json")
        .to_string();
    assert_eq!(load(&text), Config::default());

    // A value that is not a section is refused with a message, not rendered.
    let answer = crate::support::clients::helm_chart(&serde_json::json!({
        "chart": crate::support::source_tree::repo_path("packaging/helm/gpushare"),
        "release": "gpushare",
        "namespace": "kube-system",
        "renders": [merged(&default_values(), &yaml_serde::from_str("config: {extender: 5}").expect("overlay"))],
    }))
    .expect("engine present");
    let error = answer["renders"][0]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("at '/config/extender': got number, want object"),
        "{answer}"
    );
}

#[test]
fn the_service_monitor_scrapes_the_extender_and_every_device_plugin() {
    let Some(off) = render("{}") else {
        return;
    };
    assert!(!off.iter().any(|d| d["kind"] == "ServiceMonitor"));
    let docs =
        render("serviceMonitor: {enabled: true, labels: {release: prometheus}}").expect("rendered");
    let sm = find(&docs, "ServiceMonitor", "gpushare");
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(
        sm["spec"]["namespaceSelector"]["matchNames"][0],
        "kube-system"
    );
    let selects = |labels: &Value| -> bool {
        sm["spec"]["selector"]["matchExpressions"]
            .as_sequence()
            .expect("matchExpressions")
            .iter()
            .all(|e| {
                let key = e["key"].as_str().expect("key");
                e["operator"] == "In"
                    && strings(&e["values"])
                        .iter()
                        .any(|v| labels[key] == v.as_str())
            })
    };
    let ports: Vec<String> = sm["spec"]["endpoints"]
        .as_sequence()
        .expect("endpoints")
        .iter()
        .map(|e| {
            assert_eq!(e["path"], "/metrics");
            e["port"].as_str().expect("port").to_string()
        })
        .collect();
    let extender = find(&docs, "Service", wire::EXTENDER_COMPONENT);
    let plugins = find(&docs, "Service", "gpushare-device-plugin-metrics");
    for (svc, port) in [(extender, "http"), (plugins, "admin")] {
        assert!(selects(&svc["metadata"]["labels"]), "{svc:?}");
        assert!(
            svc["spec"]["ports"]
                .as_sequence()
                .expect("ports")
                .iter()
                .any(|p| p["name"] == port)
        );
        assert!(ports.iter().any(|p| p == port));
    }
    assert_eq!(plugins["spec"]["clusterIP"], "None");
    // The headless Service selects the device plugin's pods (by their own labels).
    let pod_labels =
        &find(&docs, "DaemonSet", DEVICE_PLUGIN)["spec"]["template"]["metadata"]["labels"];
    for (k, v) in plugins["spec"]["selector"].as_mapping().expect("selector") {
        assert_eq!(&pod_labels[k], v);
    }
}

#[test]
fn each_role_is_placed_by_its_own_values() {
    let overlay = r#"
extender: {nodeSelector: {pool: ext}, tolerations: [{key: ext, operator: Exists}], affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: ext, operator: Exists}]}]}}}}
devicePlugin: {nodeSelector: {pool: dp}, tolerations: [{key: dp, operator: Exists}], affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: dp, operator: Exists}]}]}}}}
webhook: {nodeSelector: {pool: wh}, tolerations: [{key: wh, operator: Exists}], affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: wh, operator: Exists}]}]}}}}
scheduler: {mode: dedicated, nodeSelector: {pool: sch}, tolerations: [{key: sch, operator: Exists}], affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: sch, operator: Exists}]}]}}}}
"#;
    let Some(docs) = render(overlay) else {
        return;
    };
    let expect: BTreeMap<&str, &str> = BTreeMap::from([
        ("gpushare-schd-extender", "ext"),
        (DEVICE_PLUGIN, "dp"),
        ("gpushare-webhook", "wh"),
        ("gpushare-scheduler", "sch"),
    ]);
    for (name, pod) in pods(&docs) {
        let key = expect[name.as_str()];
        let spec = &pod["spec"];
        assert_eq!(spec["nodeSelector"]["pool"], key, "{name}");
        assert_eq!(spec["tolerations"][0]["key"], key, "{name}");
        assert_eq!(
            spec["tolerations"].as_sequence().map(Vec::len),
            Some(1),
            "{name}"
        );
        assert_eq!(
            spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                [0]["matchExpressions"][0]["key"],
            key,
            "{name}"
        );
    }
}

/// The labels of the pods Aliyun's manifests (`kubectl create -f`) and its Helm installer
/// (`type: runtime` added) leave running, from reference/aliyun-gpushare-spec.md §7.
fn aliyun_pod_labels(component: &str, installer: bool) -> BTreeMap<&'static str, String> {
    let mut l = BTreeMap::from([
        ("app", "gpushare".to_string()),
        ("component", component.to_string()),
    ]);
    if component == wire::DEVICE_PLUGIN_COMPONENT {
        l.insert("name", DEVICE_PLUGIN.to_string());
    }
    if installer {
        l.insert("type", "runtime".to_string());
    }
    l
}

#[test]
fn the_chart_adopts_the_pods_an_aliyun_installation_left_running() {
    // The migration (docs/migration.md) deletes Aliyun's Deployment
    // and DaemonSet with --cascade=orphan and installs the chart: the new controllers must
    // select the running pods (so they are replaced one by one, never all at once), whatever
    // extra labels the installer put on them.
    let Some(docs) = render("{}") else {
        return;
    };
    for (kind, name, component) in [
        (
            "Deployment",
            wire::EXTENDER_COMPONENT,
            wire::EXTENDER_COMPONENT,
        ),
        ("DaemonSet", DEVICE_PLUGIN, wire::DEVICE_PLUGIN_COMPONENT),
    ] {
        let selector = &find(&docs, kind, name)["spec"]["selector"];
        assert!(selector.get("matchExpressions").is_none());
        for installer in [false, true] {
            let labels = aliyun_pod_labels(component, installer);
            for (k, v) in selector["matchLabels"].as_mapping().expect("matchLabels") {
                let k = k.as_str().expect("key");
                assert_eq!(
                    labels.get(k).map(String::as_str),
                    v.as_str(),
                    "{kind} {name} must select Aliyun's pods (installer: {installer})"
                );
            }
        }
        // Nothing of the kubectl-create leftovers is in the chart's objects, so none survives
        // a fresh create (an adopted object would keep them: Helm removes only fields it set).
        let spec = &find(&docs, kind, name)["spec"]["template"]["spec"];
        assert!(spec.get("hostNetwork").is_none(), "{name}");
        assert!(
            spec["nodeSelector"]
                .get("node-role.kubernetes.io/master")
                .is_none(),
            "{name}"
        );
    }
}

#[test]
fn helm_lint_strict_is_clean_with_every_production_option() {
    let values = [
        merged(
            &default_values(),
            &yaml_serde::from_str(EVERY_OPTION_ON).expect("values parse"),
        ),
        merged(
            &default_values(),
            &yaml_serde::from_str(EVERYTHING).expect("values parse"),
        ),
    ];
    let Some(answer) = crate::support::clients::helm_chart(&serde_json::json!({
        "chart": crate::support::source_tree::repo_path("packaging/helm/gpushare"),
        "release": "gpushare",
        "namespace": "kube-system",
        "lints": values,
    })) else {
        return;
    };
    for report in answer["lints"].as_array().expect("lints") {
        assert_lint_clean(report, "every production option");
    }
}
