//! The chart with `dra.enabled`, rendered by the real Helm engine: the DRA plugin's DaemonSet
//! (on the nodes of the path label, with the registry, plugin and CDI host directories), the
//! DeviceClass `gpu-mem.gpushare.io` selecting the driver, RBAC that only reads claims and
//! writes slices, and the device plugin kept off the DRA nodes. With device kinds in
//! `config.devices`, a DeviceClass per kind and the host's `/dev` for both node roles. Off (the default), none of it
//! is rendered and the device plugin has no affinity.

use gpushare::core::wire::{dra_gpu_class_selector, dra_kind_class_name, dra_kind_class_selector};
use yaml_serde::Value;

use crate::support::helm_chart::{documents_with as documents, find, strings};

#[test]
fn dra_is_off_by_default() {
    let Some(docs) = documents("{}") else {
        return;
    };
    assert!(
        docs.iter()
            .all(|d| d["metadata"]["name"] != "gpushare-dra-plugin" && d["kind"] != "DeviceClass"),
        "nothing of the DRA path is rendered by default"
    );
    let dp = find(&docs, "DaemonSet", "gpushare-device-plugin-ds").expect("device plugin");
    assert!(dp["spec"]["template"]["spec"].get("affinity").is_none());
}

#[test]
fn dra_enabled_renders_the_plugin_its_class_and_least_privilege() {
    let Some(docs) = documents(
        "{ dra: { enabled: true }, devicePlugin: { gpuBackend: fake, fakeGpus: 2x16GiB } }",
    ) else {
        return;
    };
    let ds = find(&docs, "DaemonSet", "gpushare-dra-plugin").expect("the DRA DaemonSet");
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(spec["nodeSelector"]["gpushare.io/gpu-mem-path"], "dra");
    assert_eq!(spec["serviceAccountName"], "gpushare-dra-plugin");
    let c = &spec["containers"][0];
    let args = strings(&c["args"]);
    for want in [
        "dra-plugin",
        "--driver-name=gpushare.io",
        "--registry-dir=/var/lib/kubelet/plugins_registry",
        "--plugin-dir=/var/lib/kubelet/plugins/gpushare.io",
        "--state-dir=/var/run/gpushare/gpushare.io",
        "--cdi-dir=/var/run/cdi",
        "--gpu-policy=binpack",
        "--memory-unit=GiB",
        "--fake-gpus=2x16GiB",
        "--admin-address=0.0.0.0:9102",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
    }
    let volumes = spec["volumes"].as_sequence().cloned().unwrap_or_default();
    let host = |mount: &str| -> Option<(String, String)> {
        let m = c["volumeMounts"]
            .as_sequence()?
            .iter()
            .find(|m| m["mountPath"] == mount)?;
        let v = volumes.iter().find(|v| v["name"] == m["name"])?;
        Some((
            v["hostPath"]["path"].as_str()?.to_string(),
            v["hostPath"]["type"].as_str()?.to_string(),
        ))
    };
    assert_eq!(
        host("/var/lib/kubelet/plugins_registry"),
        Some((
            "/var/lib/kubelet/plugins_registry".into(),
            "Directory".into()
        ))
    );
    assert_eq!(
        host("/var/lib/kubelet/plugins/gpushare.io"),
        Some((
            "/var/lib/kubelet/plugins/gpushare.io".into(),
            "DirectoryOrCreate".into()
        ))
    );
    assert_eq!(
        host("/var/run/cdi"),
        Some(("/var/run/cdi".into(), "DirectoryOrCreate".into()))
    );
    // The checkpoint lives as long as the CDI specs: both under /var/run.
    assert_eq!(
        host("/var/run/gpushare/gpushare.io"),
        Some((
            "/var/run/gpushare/gpushare.io".into(),
            "DirectoryOrCreate".into()
        ))
    );

    let class = find(&docs, "DeviceClass", "gpu-mem.gpushare.io").expect("the DeviceClass");
    assert_eq!(class["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(
        class["spec"]["selectors"][0]["cel"]["expression"].as_str(),
        Some(dra_gpu_class_selector("gpushare.io").as_str())
    );
    assert_eq!(
        docs.iter().filter(|d| d["kind"] == "DeviceClass").count(),
        1,
        "no device kind enabled, no class of its own"
    );

    let role = find(&docs, "ClusterRole", "gpushare-dra-plugin").expect("ClusterRole");
    let rules: Vec<(Vec<String>, Vec<String>, Vec<String>)> = role["rules"]
        .as_sequence()
        .expect("rules")
        .iter()
        .map(|r| {
            (
                strings(&r["apiGroups"]),
                strings(&r["resources"]),
                strings(&r["verbs"]),
            )
        })
        .collect();
    let s = |l: &[&str]| l.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rules,
        vec![
            (
                s(&["resource.k8s.io"]),
                s(&["resourceclaims"]),
                s(&["get", "list", "watch"])
            ),
            (
                s(&["resource.k8s.io"]),
                s(&["resourceslices"]),
                s(&["list", "create", "update", "delete"])
            ),
            (s(&[""]), s(&["nodes"]), s(&["get", "patch"])),
            (s(&[""]), s(&["pods"]), s(&["list"])),
            (
                s(&["events.k8s.io"]),
                s(&["events"]),
                s(&["create", "patch"])
            ),
        ]
    );
    assert!(
        !args.iter().any(|a| a == "--skip-doctor"),
        "the preflight runs unless skipDoctor: {args:?}"
    );
    let binding =
        find(&docs, "ClusterRoleBinding", "gpushare-dra-plugin").expect("ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["name"], "gpushare-dra-plugin");

    // The device plugin keeps off the DRA nodes.
    let dp = find(&docs, "DaemonSet", "gpushare-device-plugin-ds").expect("device plugin");
    let terms = &dp["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    assert_eq!(terms.as_sequence().map(Vec::len), Some(1), "{terms:?}");
    let expr = &terms[0]["matchExpressions"][0];
    assert_eq!(expr["key"], "gpushare.io/gpu-mem-path");
    assert_eq!(expr["operator"], "NotIn");
    assert_eq!(strings(&expr["values"]), ["dra"]);
}

#[test]
fn skip_doctor_reaches_the_dra_plugin() {
    let Some(docs) = documents("{ dra: { enabled: true }, skipDoctor: true }") else {
        return;
    };
    for (kind, name) in [
        ("DaemonSet", "gpushare-dra-plugin"),
        ("DaemonSet", "gpushare-device-plugin-ds"),
        ("Deployment", "gpushare-schd-extender"),
    ] {
        let role = find(&docs, kind, name).unwrap_or_else(|| panic!("{name}"));
        let args = strings(&role["spec"]["template"]["spec"]["containers"][0]["args"]);
        assert!(
            args.iter().any(|a| a == "--skip-doctor"),
            "{name}: {args:?}"
        );
    }
}

#[test]
fn a_users_node_affinity_keeps_its_terms_and_gains_the_path_rule() {
    let Some(docs) = documents(
        "{ dra: { enabled: true, driverName: example.com }, devicePlugin: { affinity: { nodeAffinity: { requiredDuringSchedulingIgnoredDuringExecution: { nodeSelectorTerms: [ { matchExpressions: [ { key: zone, operator: In, values: [a] } ] }, { matchExpressions: [ { key: zone, operator: In, values: [b] } ] } ] } } } } }",
    ) else {
        return;
    };
    let dp = find(&docs, "DaemonSet", "gpushare-device-plugin-ds").expect("device plugin");
    let terms = dp["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_sequence()
        .cloned()
        .expect("terms");
    assert_eq!(terms.len(), 2);
    for (term, zone) in terms.iter().zip(["a", "b"]) {
        let exprs = term["matchExpressions"].as_sequence().expect("expressions");
        assert_eq!(exprs.len(), 2, "{term:?}");
        assert_eq!(strings(&exprs[0]["values"]), [zone]);
        assert_eq!(exprs[1]["key"], "gpushare.io/gpu-mem-path");
    }
    let class = find(&docs, "DeviceClass", "gpu-mem.gpushare.io").expect("class");
    assert_eq!(
        class["spec"]["selectors"][0]["cel"]["expression"].as_str(),
        Some(dra_gpu_class_selector("example.com").as_str())
    );
    let ds = find(&docs, "DaemonSet", "gpushare-dra-plugin").expect("ds");
    let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(args.contains(&"--plugin-dir=/var/lib/kubelet/plugins/example.com".to_string()));
    assert!(args.contains(&"--state-dir=/var/run/gpushare/example.com".to_string()));
}

#[test]
fn each_device_kind_gets_its_class_and_the_node_roles_read_the_hosts_dev() {
    let Some(docs) = documents(
        "{ dra: { enabled: true }, config: { devices: { rdma: { enabled: true }, generic: [ { resource: example.com/fuse, paths: [ { path: /dev/fuse } ] } ] } } }",
    ) else {
        return;
    };
    for resource in ["gpushare.io/rdma", "example.com/fuse"] {
        let name = dra_kind_class_name(resource).expect("a class name");
        let class = find(&docs, "DeviceClass", &name).unwrap_or_else(|| panic!("the class {name}"));
        assert_eq!(
            class["spec"]["selectors"][0]["cel"]["expression"].as_str(),
            Some(dra_kind_class_selector("gpushare.io", resource).as_str()),
            "{name}"
        );
    }
    assert_eq!(
        docs.iter().filter(|d| d["kind"] == "DeviceClass").count(),
        3
    );
    for ds in ["gpushare-dra-plugin", "gpushare-device-plugin-ds"] {
        let spec =
            &find(&docs, "DaemonSet", ds).expect("the DaemonSet")["spec"]["template"]["spec"];
        let c = &spec["containers"][0];
        let env = c["env"].as_sequence().cloned().unwrap_or_default();
        assert!(
            env.iter()
                .any(|e| e["name"] == "GPUSHARE_DEVICES__DEV_ROOT" && e["value"] == "/host/dev"),
            "{ds}: {env:?}"
        );
        let mount = c["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|m| m["mountPath"] == "/host/dev")
            .unwrap_or_else(|| panic!("{ds}: /host/dev mounted"));
        assert_eq!(mount["readOnly"], true);
        let volume = spec["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == mount["name"])
            .expect("its volume");
        assert_eq!(volume["hostPath"]["path"], "/dev");
    }
    // A dev_root of the user's own: no env of ours overrides it.
    let Some(docs) = documents(
        "{ config: { devices: { dev_root: /mnt/dev, rdma: { enabled: true, resource: example.com/hca } } } }",
    ) else {
        return;
    };
    let dp = find(&docs, "DaemonSet", "gpushare-device-plugin-ds").expect("device plugin");
    let env = dp["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    assert!(
        env.iter()
            .all(|e| e["name"] != "GPUSHARE_DEVICES__DEV_ROOT")
    );
}

/// One device as upstream's DRA CEL environment sees it (`dynamic-resource-allocation/cel`):
/// `device.driver`, `device.allowMultipleAllocations`, and `device.attributes` /
/// `device.capacity` as maps of domain → name → value, unqualified names in the driver's
/// domain. A domain the device has no attribute in is an empty map there (upstream's
/// default), so every domain a selector names is filled in empty.
fn cel_device(driver: &str, device: &k8s_openapi::api::resource::v1::Device) -> serde_json::Value {
    use serde_json::{Map, Value as Json, json};
    let mut attributes: Map<String, Json> = Map::new();
    attributes.insert(driver.to_string(), json!({}));
    for (name, a) in device.attributes.clone().unwrap_or_default() {
        let (domain, id) = match name.split_once('/') {
            Some((d, i)) => (d.to_string(), i.to_string()),
            None => (driver.to_string(), name.clone()),
        };
        let value = a
            .string
            .map(Json::from)
            .or(a.int.map(Json::from))
            .or(a.bool.map(Json::from))
            .or(a.version.map(Json::from))
            .expect("one value");
        attributes
            .entry(domain)
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("a map")
            .insert(id, value);
    }
    let mut capacity: Map<String, Json> = Map::new();
    capacity.insert(driver.to_string(), json!({}));
    for (name, c) in device.capacity.clone().unwrap_or_default() {
        capacity[driver][name] = Json::from(c.value.0);
    }
    json!({
        "driver": driver,
        "allowMultipleAllocations": device.allow_multiple_allocations.unwrap_or(false),
        "attributes": attributes,
        "capacity": capacity,
    })
}

/// Upstream's allocator turns a CEL runtime error of a class selector into an allocation
/// error for the whole claim (not "this device does not match"), so a selector must evaluate
/// to a boolean on every device of the driver's pools, whatever its kind: the GPU class on
/// HCAs and generic devices, each kind's class on GPUs and on the other kinds. Each class
/// selects exactly its own devices.
#[test]
fn every_device_class_selects_its_own_devices_and_errs_on_none() {
    use gpushare::core::wire::{DRA_TYPE_GENERIC, DRA_TYPE_RDMA};
    use gpushare::core::{GpuPolicy, MemoryUnit};
    use gpushare::dra::kinds::KindDevice;
    use gpushare::dra::slices::{SliceGpu, build_slices};
    let driver = "example.com";
    let Some(docs) = documents(&format!(
        "{{ dra: {{ enabled: true, driverName: {driver} }}, config: {{ devices: {{ rdma: {{ enabled: true }}, generic: [ {{ resource: example.com/fuse, paths: [ {{ path: /dev/fuse }} ] }} ] }} }} }}"
    )) else {
        return;
    };
    let kind = |name: &str, resource: &str, kind: &'static str, shares: u32| {
        KindDevice {
            name: name.to_string(),
            resource: resource.to_string(),
            kind,
            id: name.to_string(),
            shares,
            attributes: Default::default(),
        }
        .to_device()
    };
    let gpu = SliceGpu {
        index: 0,
        uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
        product_name: "Tesla T4".into(),
        memory_bytes: 16 << 30,
        place: None,
        unhealthy: None,
        allocated_bytes: 0,
    };
    let slices = build_slices(
        "node-a",
        driver,
        Some("550.54.15"),
        MemoryUnit::GIB,
        GpuPolicy::Binpack,
        &[gpu],
        &[
            kind("rdma-mlx5-0", "gpushare.io/rdma", DRA_TYPE_RDMA, 4),
            kind("fuse-0", "example.com/fuse", DRA_TYPE_GENERIC, 1),
        ],
        1,
    );
    let devices: Vec<_> = slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect();
    assert_eq!(devices.len(), 3);
    let classes: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "DeviceClass").collect();
    assert_eq!(classes.len(), 3);
    let mut selected: Vec<(String, String)> = Vec::new();
    for class in classes {
        let name = class["metadata"]["name"]
            .as_str()
            .expect("named")
            .to_string();
        let expression = class["spec"]["selectors"][0]["cel"]["expression"]
            .as_str()
            .expect("a CEL selector");
        let program = cel::Program::compile(expression)
            .unwrap_or_else(|e| panic!("{name}: {expression}: {e:?}"));
        for device in &devices {
            let mut context = cel::Context::default();
            context
                .add_variable("device", cel_device(driver, device))
                .expect("the device converts");
            match program.execute(&context) {
                Ok(cel::Value::Bool(true)) => selected.push((name.clone(), device.name.clone())),
                Ok(cel::Value::Bool(false)) => {}
                other => panic!(
                    "class {name}: selector {expression:?} on device {}: {other:?} (upstream's \
                     allocator fails every claim of the class on a runtime error)",
                    device.name
                ),
            }
        }
    }
    selected.sort();
    assert_eq!(
        selected,
        [
            ("fuse.example.com".to_string(), "fuse-0".to_string()),
            (
                "gpu-mem.gpushare.io".to_string(),
                "gpu-00000000-0000-0000-0000-000000000000".to_string()
            ),
            ("rdma.gpushare.io".to_string(), "rdma-mlx5-0".to_string()),
        ]
    );
}

fn installed(values: serde_json::Value) -> Option<crate::support::helm_chart::Installed> {
    crate::support::helm_chart::install(&values, "kube-system")
        .map(|r| r.unwrap_or_else(|e| panic!("{values} does not render: {e}")))
}

fn json_strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

fn to_json(v: &Value) -> serde_json::Value {
    serde_json::to_value(v).expect("YAML as JSON")
}

/// `dra.enabled` with the default `scheduler.mode=extender` (docs/dra.md's install): the
/// webhook comes with it, for the DRA path only. It routes no pod to a scheduler (the default
/// kube-scheduler calls the extender), the API server sends it only the pods of the
/// namespaces on the DRA path (labelled `gpushare.io/gpu-mem-path=dra`, or every namespace not
/// labelled `extender` with `webhook.gpuMemPath=dra`), and NOTES says what to label.
#[test]
fn dra_in_extender_mode_brings_the_webhook_for_the_dra_namespaces() {
    use serde_json::json;
    let Some(r) = installed(json!({ "dra": { "enabled": true } })) else {
        return;
    };
    let deploy = to_json(
        r.find("Deployment", "gpushare-webhook")
            .expect("the webhook Deployment"),
    );
    let spec = &deploy["spec"]["template"]["spec"];
    let args = json_strings(&spec["containers"][0]["args"]);
    for want in [
        "--scheduler-name=",
        "--gpu-mem-path=extender",
        "--memory-unit=GiB",
        "--driver-name=gpushare.io",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
    }
    crate::support::assert_cli_accepts(&args, "the webhook of extender mode");
    assert!(
        r.find("Deployment", "gpushare-scheduler").is_none(),
        "no dedicated scheduler"
    );
    let class = spec["priorityClassName"]
        .as_str()
        .expect("a priority class");
    assert!(
        class.starts_with("system-") || r.find("PriorityClass", class).is_some(),
        "the priority class {class} exists"
    );
    r.find("Service", "gpushare-webhook").expect("its Service");
    r.find("PodDisruptionBudget", "gpushare-webhook")
        .expect("its budget");
    r.find("ServiceAccount", "gpushare-webhook")
        .expect("its ServiceAccount");
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        let cfg = to_json(r.find(kind, "gpushare-webhook").expect(kind));
        let exprs = &cfg["webhooks"][0]["namespaceSelector"]["matchExpressions"];
        assert!(
            exprs.as_array().expect("expressions").contains(
                &json!({ "key": "gpushare.io/gpu-mem-path", "operator": "In", "values": ["dra"] })
            ),
            "{kind}: only the DRA namespaces: {exprs}"
        );
    }
    let notes = &r.notes;
    for want in [
        "kubectl label namespace <namespace> gpushare.io/gpu-mem-path=dra",
        "kubectl label node <node> gpushare.io/gpu-mem-path=dra",
        "rollout status deployment/gpushare-webhook",
    ] {
        assert!(notes.contains(want), "{want:?} in the notes:\n{notes}");
    }
    // The cluster-wide default: every namespace but those labelled extender.
    let Some(r) =
        installed(json!({ "dra": { "enabled": true }, "webhook": { "gpuMemPath": "dra" } }))
    else {
        return;
    };
    let cfg = to_json(
        r.find("MutatingWebhookConfiguration", "gpushare-webhook")
            .expect("cfg"),
    );
    assert!(
        cfg["webhooks"][0]["namespaceSelector"]["matchExpressions"]
            .as_array()
            .expect("expressions")
            .contains(&json!({ "key": "gpushare.io/gpu-mem-path", "operator": "NotIn", "values": ["extender"] })),
        "{cfg}"
    );
    assert!(
        r.notes.contains("gpushare.io/gpu-mem-path=extender"),
        "{}",
        r.notes
    );
}

/// One memory unit and one driver name, from one value each, reach every role that needs
/// them: both node roles and the webhook.
#[test]
fn the_unit_and_the_driver_reach_the_webhook_and_the_node_roles() {
    use serde_json::json;
    for mode in ["extender", "dedicated"] {
        let Some(r) = installed(json!({
            "scheduler": { "mode": mode },
            "dra": { "enabled": true, "driverName": "example.com" },
            "devicePlugin": { "memoryUnit": "MiB" },
        })) else {
            return;
        };
        let args_of = |kind: &str, name: &str| {
            json_strings(
                &to_json(r.find(kind, name).unwrap_or_else(|| panic!("{name}")))["spec"]["template"]
                    ["spec"]["containers"][0]["args"],
            )
        };
        let webhook = args_of("Deployment", "gpushare-webhook");
        assert!(
            webhook.contains(&"--memory-unit=MiB".to_string()),
            "{mode}: {webhook:?}"
        );
        assert!(
            webhook.contains(&"--driver-name=example.com".to_string()),
            "{mode}: {webhook:?}"
        );
        let dra = args_of("DaemonSet", "gpushare-dra-plugin");
        assert!(dra.contains(&"--memory-unit=MiB".to_string()), "{dra:?}");
        assert!(
            dra.contains(&"--driver-name=example.com".to_string()),
            "{dra:?}"
        );
        let dp = args_of("DaemonSet", "gpushare-device-plugin-ds");
        assert!(dp.iter().any(|a| a.contains("MiB")), "{dp:?}");
    }
}

/// The webhook reads each gpu-mem pod's Namespace (its path label) in every TLS mode: with a
/// Secret of the user's own (cert-manager) it still gets that, and only the Secret and the
/// caBundle writes go.
#[test]
fn the_webhook_reads_namespaces_in_every_tls_mode() {
    use serde_json::json;
    for (tls, self_signed) in [
        (json!({}), true),
        (
            json!({ "existingSecret": "gpushare-webhook-cert", "injectCaFrom": "kube-system/gpushare-webhook" }),
            false,
        ),
    ] {
        for dra in [false, true] {
            let Some(r) = installed(json!({
                "scheduler": { "mode": "dedicated" },
                "dra": { "enabled": dra },
                "webhook": { "tls": tls },
            })) else {
                return;
            };
            let what = format!("self-signed {self_signed}, dra {dra}");
            let cr = to_json(
                r.find("ClusterRole", "gpushare-webhook")
                    .unwrap_or_else(|| panic!("{what}: the webhook's ClusterRole")),
            );
            let rules = cr["rules"].as_array().expect("rules");
            let grants = |resource: &str| -> Vec<String> {
                rules
                    .iter()
                    .filter(|r| {
                        r["resources"]
                            .as_array()
                            .is_some_and(|l| l.contains(&json!(resource)))
                    })
                    .flat_map(|r| json_strings(&r["verbs"]))
                    .collect()
            };
            assert_eq!(grants("namespaces"), ["get"], "{what}");
            assert_eq!(
                grants("resourceclaimtemplates"),
                if dra { vec!["get", "create"] } else { vec![] },
                "{what}"
            );
            assert_eq!(
                !grants("mutatingwebhookconfigurations").is_empty(),
                self_signed,
                "{what}: the caBundle is written only by --self-signed"
            );
            assert_eq!(
                r.find("Role", "gpushare-webhook").is_some(),
                self_signed,
                "{what}"
            );
            let binding = to_json(
                r.find("ClusterRoleBinding", "gpushare-webhook")
                    .expect("bound"),
            );
            assert_eq!(binding["subjects"][0]["name"], "gpushare-webhook");
        }
    }
}

/// Values that would install a DRA path that cannot work are refused with the reason.
#[test]
fn a_dra_install_that_cannot_work_is_refused_with_the_reason() {
    use serde_json::json;
    for (values, says) in [
        (
            json!({ "dra": { "enabled": true, "nodeSelector": null } }),
            "dra.nodeSelector",
        ),
        (
            json!({ "webhook": { "gpuMemPath": "dra" } }),
            "webhook.gpuMemPath=dra needs dra.enabled",
        ),
    ] {
        let Some(r) = crate::support::helm_chart::install(&values, "kube-system") else {
            return;
        };
        match r {
            Ok(r) => {
                let selector = r
                    .find("DaemonSet", "gpushare-dra-plugin")
                    .map(|ds| to_json(&ds["spec"]["template"]["spec"]["nodeSelector"]));
                panic!("{values} renders: the DRA plugin's nodeSelector {selector:?}")
            }
            Err(e) => assert!(e.contains(says), "{values}: {e}"),
        }
    }
}
