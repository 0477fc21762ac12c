//! The Helm chart, rendered and linted by the real Helm v4 engine (helm-python-sdk: Helm's Go
//! SDK as a library, driven by `tests/clients/helm_chart.py`; release `gpushare` in
//! `kube-system`): `helm lint --strict` is clean, the default render equals
//! `packaging/manifests/`, every object of every optional feature is a valid Kubernetes
//! object, and the upstream names, labels and ports existing clusters depend on are kept.
//! Without the SDK the render tests skip loudly (fail under CI; see `support::clients`).
//!
//! `make manifests` (`GPUSHARE_UPDATE_GOLDEN=1 cargo test --test it
//! packaging::chart::rendered_chart_equals_the_plain_manifests`) rewrites
//! `packaging/manifests/` from the chart (one file per template, same name).

use std::collections::BTreeMap;
use std::path::Path;

use yaml_serde::Value;

use gpushare::core::wire;

use crate::support::assert_cli_accepts;
use crate::support::helm_chart::{
    CHART, NAMESPACE, RELEASE, all_documents, assert_lint_clean, assert_scheduler_config,
    check_typed, default_extender_url, default_values, helm, merged, render_chart, strings,
};
use crate::support::source_tree::{read, repo_path, yaml_documents};

const MANIFESTS: &str = "packaging/manifests";

#[test]
fn helm_lint_strict_is_clean_with_every_option() {
    let overlays = [
        "{}",
        "extender: {leaderElect: false, replicas: 1, hostNetwork: true}",
        "devicePlugin: {kmsg: true, mps: true, hostNetwork: true, runtimeClassName: nvidia}",
        "devicePlugin: {deviceListStrategy: [envvar, cdi-cri], deviceIdStrategy: uuid, passDeviceSpecs: true}",
    ];
    let values: Vec<Value> = overlays
        .iter()
        .map(|o| yaml_serde::from_str(o).expect("overlay parses"))
        .collect();
    let Some(answer) = helm(&[], &values.iter().collect::<Vec<_>>()) else {
        return;
    };
    for (overlay, report) in overlays
        .iter()
        .zip(answer["lints"].as_array().expect("lints"))
    {
        assert_eq!(report["total_charts_linted"], 1, "{report}");
        assert_lint_clean(report, overlay);
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn golden_header(template: &str) -> String {
    format!(
        "# Rendered from {CHART}/templates/{template} (release {RELEASE}, namespace {NAMESPACE},\n\
         # default values). Do not edit: change the chart, then regenerate with\n\
         #   make manifests\n"
    )
}

/// The manifests as (file name, documents).
fn manifest_documents() -> BTreeMap<String, Vec<Value>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(repo_path(MANIFESTS)).expect("manifests dir") {
        let path = entry.expect("dir entry").path();
        let name = file_name(&path);
        let text = std::fs::read_to_string(&path).expect("manifest readable");
        out.insert(name.clone(), yaml_documents(&name, &text));
    }
    out
}

#[test]
fn rendered_chart_equals_the_plain_manifests() {
    let Some(mut rendered) = render_chart(default_values()) else {
        return;
    };
    // Templates that render nothing with the default values (templates/managed/, for
    // `scheduler.mode: dedicated`) have no plain manifest.
    rendered.retain(|name, text| !yaml_documents(name, text).is_empty());
    if std::env::var_os("GPUSHARE_UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        let dir = repo_path(MANIFESTS);
        for entry in std::fs::read_dir(&dir).expect("manifests dir") {
            let path = entry.expect("dir entry").path();
            if !rendered.contains_key(&file_name(&path)) {
                std::fs::remove_file(&path).expect("remove stale manifest");
            }
        }
        for (name, text) in &rendered {
            let body = text.trim_start_matches('\n');
            std::fs::write(dir.join(name), format!("{}{body}", golden_header(name)))
                .expect("write manifest");
        }
    }
    let manifests = manifest_documents();
    assert_eq!(
        manifests.keys().collect::<Vec<_>>(),
        rendered.keys().collect::<Vec<_>>(),
        "packaging/manifests/ must hold one file per chart template \
         (regenerate: make manifests)"
    );
    for (name, text) in &rendered {
        let docs = yaml_documents(name, text);
        assert!(!docs.is_empty(), "{name} renders no object");
        assert_eq!(
            &docs, &manifests[name],
            "{MANIFESTS}/{name} differs from the chart \
             (regenerate: make manifests)"
        );
    }
}

#[test]
fn every_manifest_is_a_valid_kubernetes_object() {
    let mut kinds = std::collections::BTreeSet::new();
    for (name, docs) in manifest_documents() {
        for doc in &docs {
            match check_typed(doc) {
                Ok(kind) => kinds.insert(kind),
                Err(e) => panic!("{MANIFESTS}/{name}: {e}"),
            };
        }
    }
    let expected = [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ];
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), expected);
}

#[test]
fn every_chart_option_renders_valid_objects() {
    let variants = [
        "extender: {leaderElect: false, replicas: 1, hostNetwork: true, nodeSelector: {node-role.kubernetes.io/control-plane: ''}}",
        "devicePlugin: {kmsg: true, mps: true, hostNetwork: true, runtimeClassName: nvidia, tolerations: []}",
        "skipDoctor: true\nlogFormat: json\ndevicePlugin: {memoryUnit: 256MiB, healthCheck: false}",
        "devicePlugin: {gpuBackend: fake, fakeGpus: 2x16GiB}",
        "extender: {tolerations: [], affinity: {}}",
    ];
    for overlay in variants {
        let values = merged(
            &default_values(),
            &yaml_serde::from_str(overlay).expect("variant parses"),
        );
        let Some(rendered) = render_chart(values) else {
            return;
        };
        for (name, text) in rendered {
            for doc in yaml_documents(&name, &text) {
                if let Err(e) = check_typed(&doc) {
                    panic!("{name} with {overlay}: {e}");
                }
                for c in doc["spec"]["template"]["spec"]["containers"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                {
                    assert_cli_accepts(&args(c), &format!("{name} with {overlay}"));
                }
            }
        }
    }
}

#[test]
fn the_binary_accepts_the_manifests_arguments() {
    let mut checked = 0;
    for (name, docs) in manifest_documents() {
        for doc in docs {
            for c in doc["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .into_iter()
                .flatten()
            {
                assert_cli_accepts(&args(c), &name);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2, "extender and device-plugin containers");
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect()
}

#[test]
fn upstream_names_labels_and_ports_are_kept() {
    let Some(docs) = all_documents(default_values()) else {
        return;
    };
    let labels = |pairs: &[(&str, &str)]| -> Value {
        yaml_serde::to_value(pairs.iter().copied().collect::<BTreeMap<_, _>>()).expect("labels")
    };
    let extender_labels = labels(&[
        ("app", "gpushare"),
        (wire::LABEL_COMPONENT, wire::EXTENDER_COMPONENT),
    ]);

    // Service: name, namespace, NodePort 32766 -> 12345 named http, upstream selector.
    let svc = find(&docs, "Service", wire::EXTENDER_COMPONENT);
    assert_eq!(svc["metadata"]["namespace"], NAMESPACE);
    assert_eq!(svc["spec"]["type"], "NodePort");
    let port = &svc["spec"]["ports"][0];
    assert_eq!(
        (port["name"].as_str(), port["port"].as_u64()),
        (Some("http"), Some(12345))
    );
    assert_eq!(
        (port["targetPort"].as_u64(), port["nodePort"].as_u64()),
        (Some(12345), Some(32766))
    );
    assert_eq!(svc["spec"]["selector"], extender_labels);

    // Deployment: same selector, pods carry it, served on 12345, probes, HA defaults.
    let dep = find(&docs, "Deployment", wire::EXTENDER_COMPONENT);
    assert_eq!(dep["metadata"]["namespace"], NAMESPACE);
    assert_eq!(dep["spec"]["selector"]["matchLabels"], extender_labels);
    assert_eq!(dep["spec"]["replicas"], 2);
    let pod = &dep["spec"]["template"];
    for (k, v) in extender_labels.as_mapping().expect("map") {
        assert_eq!(&pod["metadata"]["labels"][k], v);
    }
    assert_eq!(pod["spec"]["serviceAccountName"], wire::EXTENDER_COMPONENT);
    // EXT#36: no master-only node selector; control-plane and master taints tolerated.
    assert!(pod["spec"].get("nodeSelector").is_none());
    let tolerated: Vec<&str> = pod["spec"]["tolerations"]
        .as_sequence()
        .expect("tolerations")
        .iter()
        .filter_map(|t| t["key"].as_str())
        .collect();
    for key in [
        "node-role.kubernetes.io/control-plane",
        "node-role.kubernetes.io/master",
    ] {
        assert!(tolerated.contains(&key), "extender must tolerate {key}");
    }
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["ports"][0]["containerPort"], 12345);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    let a = args(c);
    assert_eq!(a[0], "extender");
    for flag in [
        "--port=12345",
        "--leader-elect",
        "--lease-namespace=kube-system",
    ] {
        assert!(
            a.iter().any(|x| x == flag),
            "extender args lack {flag}: {a:?}"
        );
    }

    // DaemonSet: upstream name, labels, selector, node label, sockets.
    let ds = find(&docs, "DaemonSet", "gpushare-device-plugin-ds");
    assert_eq!(ds["metadata"]["namespace"], NAMESPACE);
    let ds_labels = labels(&[
        ("app", "gpushare"),
        (wire::LABEL_COMPONENT, wire::DEVICE_PLUGIN_COMPONENT),
        ("name", "gpushare-device-plugin-ds"),
    ]);
    assert_eq!(ds["spec"]["selector"]["matchLabels"], ds_labels);
    let pod = &ds["spec"]["template"];
    for (k, v) in ds_labels.as_mapping().expect("map") {
        assert_eq!(&pod["metadata"]["labels"][k], v);
        assert_eq!(&ds["metadata"]["labels"][k], v);
    }
    assert_eq!(
        pod["spec"]["nodeSelector"],
        labels(&[(wire::LABEL_GPUSHARE, "true")])
    );
    assert_eq!(
        pod["spec"]["serviceAccountName"],
        wire::DEVICE_PLUGIN_COMPONENT
    );
    assert_eq!(pod["spec"]["priorityClassName"], "system-node-critical");
    let host_paths: Vec<&str> = pod["spec"]["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert!(
        host_paths.contains(&wire::DEFAULT_DEVICE_PLUGIN_DIR),
        "{host_paths:?}"
    );
    let pod_resources_dir = Path::new(wire::DEFAULT_POD_RESOURCES_SOCKET)
        .parent()
        .and_then(Path::to_str)
        .expect("socket dir");
    assert!(host_paths.contains(&pod_resources_dir), "{host_paths:?}");
    let c = &pod["spec"]["containers"][0];
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    assert!(
        mounts.contains(&wire::DEFAULT_DEVICE_PLUGIN_DIR),
        "{mounts:?}"
    );
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?, e)))
        .collect();
    assert_eq!(
        env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    assert_eq!(env[wire::ENV_VISIBLE_DEVICES]["value"], "all");
    assert_eq!(env["NVIDIA_DRIVER_CAPABILITIES"]["value"], "utility");
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    assert_eq!(args(c)[0], "device-plugin");
    assert!(args(c).iter().any(|a| a == "--memory-unit=GiB"));

    // Every object carries the recommended labels from _helpers.tpl (selectors do not).
    for d in &docs {
        let l = &d["metadata"]["labels"];
        assert_eq!(l["app.kubernetes.io/instance"], RELEASE, "{d:?}");
        assert_eq!(l["app.kubernetes.io/managed-by"], "Helm", "{d:?}");
        assert_eq!(
            l["helm.sh/chart"],
            format!("gpushare-{}", env!("CARGO_PKG_VERSION")).as_str(),
            "{d:?}"
        );
    }

    // ServiceAccounts and cluster roles keep the upstream names.
    for name in [wire::EXTENDER_COMPONENT, wire::DEVICE_PLUGIN_COMPONENT] {
        find(&docs, "ServiceAccount", name);
        find(&docs, "ClusterRole", name);
        find(&docs, "ClusterRoleBinding", name);
    }
}

/// The (group, resource, verb) triples a set of RBAC rules grants.
fn grants(rules: &Value) -> std::collections::BTreeSet<(String, String, String)> {
    let mut out = std::collections::BTreeSet::new();
    for rule in rules.as_sequence().into_iter().flatten() {
        let list = |k: &str| -> Vec<String> {
            rule[k]
                .as_sequence()
                .map(|s| {
                    s.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        for g in list("apiGroups") {
            for r in list("resources") {
                for v in list("verbs") {
                    out.insert((g.clone(), r.clone(), v));
                }
            }
        }
    }
    out
}

fn triples(spec: &[(&str, &str, &[&str])]) -> std::collections::BTreeSet<(String, String, String)> {
    spec.iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(move |v| (g.to_string(), r.to_string(), v.to_string()))
        })
        .collect()
}

#[test]
fn rbac_grants_exactly_what_each_role_uses() {
    let Some(docs) = all_documents(default_values()) else {
        return;
    };
    let ext = find(&docs, "ClusterRole", wire::EXTENDER_COMPONENT);
    assert_eq!(
        grants(&ext["rules"]),
        triples(&[
            ("", "pods", &["get", "list", "watch", "patch"]),
            ("", "pods/binding", &["create"]),
            ("", "bindings", &["create"]),
            ("", "nodes", &["get", "list", "watch"]),
            ("events.k8s.io", "events", &["create", "patch"]),
        ])
    );
    // ConfigMaps: read-only and only in the namespace of the unhealthy-gpu-* maps.
    let cm_role = docs
        .iter()
        .find(|d| d["kind"] == "Role" && grants(&d["rules"]).iter().any(|g| g.1 == "configmaps"))
        .expect("a Role for configmaps");
    assert_eq!(
        cm_role["metadata"]["namespace"],
        wire::UNHEALTHY_CONFIGMAP_NAMESPACE
    );
    assert_eq!(
        grants(&cm_role["rules"]),
        triples(&[("", "configmaps", &["get", "list", "watch"])])
    );
    // Leases: a Role in the release namespace; everything but create limited to the
    // extender's Lease. The election's watch lists and watches with the field selector
    // metadata.name=<lease>, which the API server authorizes as a request for that name: a
    // resourceNames rule covers it only when it names list and watch.
    let lease_role = find(&docs, "Role", "gpushare-schd-extender-lease");
    assert_eq!(lease_role["metadata"]["namespace"], NAMESPACE);
    assert_eq!(
        grants(&lease_role["rules"]),
        triples(&[(
            "coordination.k8s.io",
            "leases",
            &["create", "get", "list", "update", "watch"]
        )])
    );
    assert_eq!(
        lease_role["rules"][1]["resourceNames"][0],
        "gpushare-schd-extender"
    );
    assert_eq!(
        strings(&lease_role["rules"][1]["verbs"]),
        ["get", "update", "list", "watch"],
        "{lease_role:?}"
    );
    // Without leader election there is no Lease access at all.
    let Some(single) = all_documents(merged(
        &default_values(),
        &yaml_serde::from_str("extender: {leaderElect: false, replicas: 1}").expect("overlay"),
    )) else {
        return;
    };
    assert!(
        !single
            .iter()
            .any(|d| grants(&d["rules"]).iter().any(|g| g.1 == "leases"))
    );

    let dp = find(&docs, "ClusterRole", wire::DEVICE_PLUGIN_COMPONENT);
    assert_eq!(
        grants(&dp["rules"]),
        triples(&[
            ("", "pods", &["get", "list", "watch", "patch"]),
            ("", "nodes", &["get", "list", "watch", "patch"]),
            ("", "nodes/status", &["patch"]),
            ("events.k8s.io", "events", &["create", "patch"]),
            ("resource.k8s.io", "resourceslices", &["list"]),
            ("resource.k8s.io", "resourceclaims", &["list"]),
        ])
    );
    // Every binding points at its role and the right ServiceAccount.
    for d in docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding")
    {
        let role = d["roleRef"]["name"].as_str().expect("roleRef");
        let role_kind = if d["kind"] == "RoleBinding" {
            "Role"
        } else {
            "ClusterRole"
        };
        let role_doc = find(&docs, role_kind, role);
        if role_kind == "Role" {
            assert_eq!(
                role_doc["metadata"]["namespace"],
                d["metadata"]["namespace"]
            );
        }
        assert_eq!(d["subjects"][0]["kind"], "ServiceAccount");
        assert_eq!(d["subjects"][0]["namespace"], NAMESPACE);
        let sa = d["subjects"][0]["name"].as_str().expect("subject");
        assert!(role.starts_with(sa), "{role} bound to {sa}");
    }
}

#[test]
fn scheduler_config_is_the_same_in_chart_and_file() {
    let file: Value =
        yaml_serde::from_str(&read("packaging/scheduler/scheduler-config.yaml")).expect("parses");
    assert_scheduler_config(&file, &default_extender_url());
    let Some(docs) = all_documents(default_values()) else {
        return;
    };
    let cm = find(&docs, "ConfigMap", "gpushare-scheduler-config");
    let embedded: Value = yaml_serde::from_str(
        cm["data"]["scheduler-config.yaml"]
            .as_str()
            .expect("scheduler-config.yaml key"),
    )
    .expect("embedded config parses");
    assert_eq!(embedded, file);
}

#[test]
fn chart_version_follows_the_crate() {
    let chart: Value = yaml_serde::from_str(&read(&format!("{CHART}/Chart.yaml"))).expect("parses");
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "gpushare");
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    // Empty: the appVersion (chart_operator::an_empty_image_tag_is_the_chart_app_version).
    assert_eq!(default_values()["image"]["tag"], "");
}

fn pod_spec_of<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    &find(docs, kind, name)["spec"]["template"]["spec"]
}

#[test]
fn optional_features_switch_what_they_should() {
    let with = |overlay: &str| {
        all_documents(merged(
            &default_values(),
            &yaml_serde::from_str(overlay).expect("overlay parses"),
        ))
    };
    let Some(defaults) = with("{}") else {
        return;
    };
    let dp = pod_spec_of(&defaults, "DaemonSet", "gpushare-device-plugin-ds");
    assert!(dp.get("hostNetwork").is_none() && dp.get("runtimeClassName").is_none());
    assert!(
        !args(&dp["containers"][0])
            .iter()
            .any(|a| a.starts_with("--mps"))
    );

    // /dev/kmsg: mounted, and the container privileged (the device cgroup demands it), which
    // Kubernetes only accepts without allowPrivilegeEscalation: false.
    let docs =
        with("devicePlugin: {kmsg: true, mps: true, hostNetwork: true, runtimeClassName: nvidia}")
            .expect("rendered");
    let dp = pod_spec_of(&docs, "DaemonSet", "gpushare-device-plugin-ds");
    let c = &dp["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], true);
    assert!(
        c["securityContext"]
            .get("allowPrivilegeEscalation")
            .is_none()
    );
    let volumes = dp["volumes"].as_sequence().expect("volumes");
    let kmsg = volumes
        .iter()
        .find(|v| v["hostPath"]["path"] == "/dev/kmsg")
        .expect("kmsg volume");
    assert_eq!(kmsg["hostPath"]["type"], "CharDevice");
    assert!(
        volumes
            .iter()
            .any(|v| v["hostPath"]["path"] == "/tmp/nvidia-mps")
    );
    let a = args(c);
    assert!(
        a.iter().any(|x| x == "--mps") && a.iter().any(|x| x == "--mps-pipe-dir=/tmp/nvidia-mps")
    );
    assert_eq!(dp["hostNetwork"], true);
    assert_eq!(dp["dnsPolicy"], "ClusterFirstWithHostNet");
    assert_eq!(dp["runtimeClassName"], "nvidia");

    let docs =
        with("extender: {leaderElect: false, replicas: 1, hostNetwork: true}").expect("rendered");
    let dep = find(&docs, "Deployment", wire::EXTENDER_COMPONENT);
    assert_eq!(dep["spec"]["replicas"], 1);
    let pod = &dep["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert!(
        !args(&pod["containers"][0])
            .iter()
            .any(|a| a.starts_with("--lease") || a == "--leader-elect")
    );
}

#[test]
fn each_device_list_strategy_renders_its_flags_and_cdi_mounts() {
    let with = |overlay: &str| {
        all_documents(merged(
            &default_values(),
            &yaml_serde::from_str(overlay).expect("overlay parses"),
        ))
    };
    let cases: [(&str, Option<&str>, bool); 6] = [
        ("{}", None, false),
        ("devicePlugin: {deviceListStrategy: envvar}", None, false),
        (
            "devicePlugin: {deviceListStrategy: volume-mounts, deviceIdStrategy: uuid}",
            Some("volume-mounts"),
            false,
        ),
        (
            "devicePlugin: {deviceListStrategy: cdi-annotations}",
            Some("cdi-annotations"),
            true,
        ),
        (
            "devicePlugin: {deviceListStrategy: cdi-cri, passDeviceSpecs: true}",
            Some("cdi-cri"),
            true,
        ),
        (
            "devicePlugin: {deviceListStrategy: [envvar, cdi-cri], cdi: {kind: example.com/gpu, specDirs: [/run/cdi]}}",
            Some("envvar,cdi-cri"),
            true,
        ),
    ];
    for (overlay, strategy, cdi) in cases {
        let Some(docs) = with(overlay) else {
            return;
        };
        let dp = pod_spec_of(&docs, "DaemonSet", "gpushare-device-plugin-ds");
        let c = &dp["containers"][0];
        let a = args(c);
        assert_cli_accepts(&a, overlay);
        let flag = a
            .iter()
            .find_map(|x| x.strip_prefix("--device-list-strategy="));
        assert_eq!(flag, strategy, "{overlay}: {a:?}");
        assert_eq!(
            a.iter().any(|x| x == "--device-id-strategy=uuid"),
            overlay.contains("uuid"),
            "{overlay}"
        );
        assert_eq!(
            a.iter().any(|x| x == "--pass-device-specs"),
            overlay.contains("passDeviceSpecs"),
            "{overlay}"
        );
        let cdi_mounts: Vec<String> = c["volumeMounts"]
            .as_sequence()
            .expect("mounts")
            .iter()
            .filter(|m| {
                m["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("cdi-specs"))
            })
            .map(|m| {
                assert_eq!(m["readOnly"], true, "{overlay}");
                m["mountPath"].as_str().unwrap_or_default().to_string()
            })
            .collect();
        let cdi_volumes = dp["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .filter(|v| {
                v["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("cdi-specs"))
            })
            .count();
        assert_eq!(cdi_mounts.len(), cdi_volumes, "{overlay}");
        if !cdi {
            assert!(cdi_mounts.is_empty(), "{overlay}: {cdi_mounts:?}");
            assert!(
                !a.iter().any(|x| x.starts_with("--cdi-")),
                "{overlay}: {a:?}"
            );
            continue;
        }
        if overlay.contains("example.com") {
            assert_eq!(cdi_mounts, ["/run/cdi"]);
            assert!(a.iter().any(|x| x == "--cdi-kind=example.com/gpu"), "{a:?}");
            assert!(a.iter().any(|x| x == "--cdi-spec-dirs=/run/cdi"), "{a:?}");
        } else {
            assert_eq!(cdi_mounts, ["/etc/cdi", "/var/run/cdi"]);
            assert!(a.iter().any(|x| x == "--cdi-kind=nvidia.com/gpu"), "{a:?}");
            assert!(
                a.iter().any(|x| x == "--cdi-annotation-prefix=cdi.k8s.io/"),
                "{a:?}"
            );
            assert!(
                a.iter()
                    .any(|x| x == "--cdi-spec-dirs=/etc/cdi,/var/run/cdi"),
                "{a:?}"
            );
        }
    }
}
