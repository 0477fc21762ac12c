//! `gpushare inspect`: golden outputs of every format over fixture clusters (built in-process
//! from YAML), the extender source against a tiny HTTP server, an unreachable API server, and
//! the real `kubectl` finding the plugin against the sandbox API server.
//!
//! Golden files live in `tests/golden/inspect/`; set `GPUSHARE_UPDATE_GOLDEN=1` to rewrite
//! them (then review the diff).

use std::path::PathBuf;

use gpushare::inspect::dra::DraCluster;
use gpushare::inspect::report::{Report, cluster_from_yaml};
use gpushare::inspect::{Format, render_report};

use crate::support::canned_http::CannedServer;
use crate::support::{closed_port, fixture, kubeconfig_for, run, run_with_env, stderr, stdout};

const FORMATS: [(&str, Format, bool); 5] = [
    ("table", Format::Table, false),
    ("details", Format::Table, true),
    ("wide", Format::Wide, false),
    ("json", Format::Json, false),
    ("yaml", Format::Yaml, false),
];

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/inspect")
        .join(name)
}

/// Compares `actual` with the golden file `name` (or rewrites it when asked to).
fn check_golden(name: &str, actual: &str) {
    let path = golden_path(name);
    if std::env::var("GPUSHARE_UPDATE_GOLDEN").as_deref() == Ok("1") {
        let tmp = path.with_extension("txt.new");
        std::fs::write(&tmp, actual).expect("golden file written");
        std::fs::rename(&tmp, &path).expect("golden file replaced");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden file {} unreadable ({e}); run with GPUSHARE_UPDATE_GOLDEN=1",
            path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "output differs from {}\n--- actual ---\n{actual}",
        path.display()
    );
}

fn report_of(fixture_name: &str) -> Report {
    let text = std::fs::read_to_string(fixture(&format!("inspect/{fixture_name}.yaml")))
        .expect("fixture readable");
    let (nodes, pods) = cluster_from_yaml(&text).expect("fixture parses");
    Report::from_cluster(&nodes, &pods, None)
}

fn check_all_formats(fixture_name: &str) {
    let report = report_of(fixture_name);
    for (suffix, format, details) in FORMATS {
        check_golden(
            &format!("{fixture_name}.{suffix}.txt"),
            &render_report(&report, format, details),
        );
    }
}

#[test]
fn golden_userguide_cluster() {
    check_all_formats("userguide");
}

/// Devices other than GPUs (RDMA HCAs, generic devices) in a section below the GPU table,
/// with the pods holding them.
#[test]
fn golden_other_devices() {
    check_all_formats("other-devices");
    let report = report_of("other-devices");
    let hgx = &report.nodes[0];
    assert_eq!(hgx.name, "hgx-1");
    let rdma = hgx
        .devices
        .iter()
        .find(|d| d.resource == "gpushare.io/rdma")
        .expect("rdma");
    assert_eq!((rdma.used, rdma.total), (1, 8));
    assert_eq!(rdma.pods.len(), 1);
    assert_eq!(
        (rdma.pods[0].pod.as_str(), rdma.pods[0].count),
        ("ml/trainer-0", 1)
    );
    assert!(report.nodes[1].devices.is_empty());
}

#[test]
fn golden_pending_pods() {
    check_all_formats("pending");
}

#[test]
fn golden_unhealthy_gpu() {
    check_all_formats("unhealthy");
}

#[test]
fn golden_multi_container_and_allocation_annotation() {
    check_all_formats("multi-container");
}

#[test]
fn golden_heterogeneous_gpus() {
    check_all_formats("heterogeneous");
}

/// DRA allocations (slices and claims) in the same table as the annotation ledger; HCAs and
/// generic devices on the DRA path in the table of other devices.
/// The DRA objects of another driver name (`dra.driverName`, `--driver-name`) are read when
/// inspect is told that name, and only then.
#[test]
fn another_dra_driver_is_read_when_named() {
    let text = std::fs::read_to_string(fixture("inspect/dra.yaml"))
        .expect("fixture readable")
        .replace("gpushare.io", "gpu.example.com");
    let (nodes, pods) = cluster_from_yaml(&text).expect("fixture parses");
    let dra = DraCluster::from_yaml(&text).expect("DRA objects parse");
    let default = Report::from_cluster_with_dra(&nodes, &pods, &dra, None);
    assert_eq!(default.nodes.len(), 1, "the default driver's objects only");
    let named =
        Report::from_cluster_with_dra(&nodes, &pods, &dra.with_driver("gpu.example.com"), None);
    let node2 = &named.nodes[1];
    assert_eq!(
        (node2.name.as_str(), node2.total, node2.used),
        ("node-2", 32, 11)
    );
}

#[test]
fn golden_dra_allocations_beside_the_annotation_ledger() {
    let text = std::fs::read_to_string(fixture("inspect/dra.yaml")).expect("fixture readable");
    let (nodes, pods) = cluster_from_yaml(&text).expect("fixture parses");
    let dra = DraCluster::from_yaml(&text).expect("DRA objects parse");
    let report = Report::from_cluster_with_dra(&nodes, &pods, &dra, None);
    let node2 = &report.nodes[1];
    assert_eq!(
        (node2.name.as_str(), node2.total, node2.used),
        ("node-2", 32, 11)
    );
    // Its HCA and generic device on the DRA path, and who holds them.
    let rdma = node2
        .devices
        .iter()
        .find(|d| d.resource == "gpushare.io/rdma")
        .expect("the HCA row");
    assert_eq!((rdma.used, rdma.total), (1, 4));
    assert_eq!(rdma.pods[0].pod, "research/train");
    for (suffix, format, details) in FORMATS {
        check_golden(
            &format!("dra.{suffix}.txt"),
            &render_report(&report, format, details),
        );
    }
    // Without the DRA objects (an API server without resource.k8s.io), node-2 is not there.
    let plain = Report::from_cluster(&nodes, &pods, None);
    assert_eq!(plain.nodes.len(), 1);
}

#[test]
fn golden_odd_names_and_a_node_without_the_resource() {
    check_all_formats("odd-names");
}

#[test]
fn the_userguide_summary_is_the_upstream_one() {
    let out = render_report(&report_of("userguide"), Format::Table, false);
    let lines: Vec<&str> = out.split('\n').collect();
    assert_eq!(
        lines[0],
        "NAME                                IPADDRESS     GPU0(Allocated/Total)  GPU Memory(GiB)"
    );
    assert_eq!(
        lines[1],
        "cn-shanghai.i-uf61h64dz1tmlob9hmtb  192.168.0.71  6/15                   6/15"
    );
    assert_eq!(
        lines[2],
        "cn-shanghai.i-uf61h64dz1tmlob9hmtc  192.168.0.70  3/15                   3/15"
    );
    assert_eq!(
        lines[3],
        "-".repeat(78),
        "the upstream user guide shows 78 dashes"
    );
    assert_eq!(lines[4], "Allocated/Total GPU Memory In Cluster:");
    assert_eq!(
        lines[5], "9/30 (30%)  ",
        "a trailing tab becomes two spaces"
    );
    assert_eq!(lines[6], "");
    assert_eq!(lines.len(), 7);
}

#[test]
fn percent_signs_in_names_print_literally() {
    let report = report_of("odd-names");
    let details = render_report(&report, Format::Table, true);
    assert!(
        details
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["%d%s", "100%v", "4"]),
        "{details}"
    );
    let table = render_report(&report, Format::Table, false);
    assert!(
        !table.contains("cpu-node"),
        "a node without gpu-mem is skipped: {table}"
    );
}

#[test]
fn json_output_has_the_documented_schema() {
    let report = report_of("pending");
    let value: serde_json::Value =
        serde_json::from_str(&render_report(&report, Format::Json, false)).expect("valid JSON");
    for key in ["source", "unit", "nodes", "total", "used", "notes"] {
        assert!(value.get(key).is_some(), "missing {key}");
    }
    let node = &value["nodes"][0];
    for key in [
        "name",
        "address",
        "unit",
        "gpus",
        "pending",
        "total",
        "used",
        "largestFit",
    ] {
        assert!(node.get(key).is_some(), "missing node key {key}");
    }
    let gpu = &node["gpus"][1];
    for key in ["index", "total", "used", "healthy", "pods"] {
        assert!(gpu.get(key).is_some(), "missing gpu key {key}");
    }
    let pod = &gpu["pods"][0];
    for key in ["namespace", "name", "uid", "memory", "state"] {
        assert!(pod.get(key).is_some(), "missing pod key {key}");
    }
    // The YAML output is the same document.
    let yaml: serde_json::Value =
        yaml_serde::from_str(&render_report(&report, Format::Yaml, false)).expect("valid YAML");
    assert_eq!(yaml, value);
}

#[test]
fn from_extender_renders_the_extenders_view() {
    let body = std::fs::read_to_string(fixture("inspect/extender-inspect.json")).expect("fixture");
    let extender = CannedServer::start(200, body);
    for (suffix, format, details) in FORMATS {
        let mut args = vec!["inspect", "--from-extender", extender.url.as_str()];
        if details {
            args.push("-d");
        }
        let flag = match format {
            Format::Table => "table",
            Format::Wide => "wide",
            Format::Json => "json",
            Format::Yaml => "yaml",
        };
        args.extend(["-o", flag]);
        let out = run(&args);
        assert!(out.status.success(), "{suffix}: {}", stderr(&out));
        check_golden(&format!("extender.{suffix}.txt"), &stdout(&out));
    }
    let out = run(&[
        "inspect",
        "node-a",
        "--from-extender",
        &format!("{}/gpushare-scheduler/inspect", extender.url),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let paths = extender.paths();
    assert!(
        paths[..FORMATS.len()]
            .iter()
            .all(|p| p == "/gpushare-scheduler/inspect"),
        "{paths:?}"
    );
    assert_eq!(
        paths.last().map(String::as_str),
        Some("/gpushare-scheduler/inspect/node-a")
    );
}

#[test]
fn an_extender_error_is_one_line_and_exit_1() {
    let extender = CannedServer::start(500, r#"{"error":"cache not ready"}"#.to_string());
    let out = run(&["inspect", "--from-extender", &extender.url]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("gpushare inspect: "), "{err}");
    assert!(err.contains("500"), "{err}");
    assert!(stdout(&out).is_empty());
}

#[test]
fn an_unreachable_api_server_is_one_line_and_exit_1() {
    let server = format!("http://127.0.0.1:{}", closed_port());
    let kubeconfig = kubeconfig_for(&server);
    let path = kubeconfig.path().to_string_lossy().into_owned();
    for out in [
        run(&["inspect", "--kubeconfig", &path]),
        run_with_env(&["inspect", "-d"], &[("KUBECONFIG", &path)]),
    ] {
        assert_eq!(out.status.code(), Some(1));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with(&format!(
                "gpushare inspect: cannot reach the API server at {server}"
            )),
            "{err}"
        );
        assert!(stdout(&out).is_empty());
    }
}

#[test]
fn a_node_the_api_does_not_have_is_named_not_an_unreachable_server() {
    let (runtime, server) = sandbox_on_runtime(1, None);
    let kubeconfig = server
        .admin_kubeconfig_path()
        .to_string_lossy()
        .into_owned();
    let out = run(&["inspect", "no-such-node", "--kubeconfig", &kubeconfig]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert_eq!(
        err.trim_end(),
        "gpushare inspect: node \"no-such-node\" not found (kubectl get nodes lists them)",
        "the API answered: nothing about reaching it"
    );
    runtime.block_on(server.shutdown());
}
/// Seeds the sandbox API server with every item of a fixture `List`.
fn seed_fixture(server: &gpushare_sandbox::apiserver::ApiServer, fixture_name: &str) {
    let text = std::fs::read_to_string(fixture(&format!("inspect/{fixture_name}.yaml")))
        .expect("fixture readable");
    let list: serde_json::Value = yaml_serde::from_str(&text).expect("fixture parses");
    for item in list["items"].as_array().expect("a List") {
        server
            .create_object(item.clone())
            .unwrap_or_else(|e| panic!("seeding {item}: {e:#}"));
    }
}

/// A runtime of `workers` workers (the binaries run on the test's thread) and on it a sandbox
/// API server, seeded with the inspect fixture `fixture` where given.
fn sandbox_on_runtime(
    workers: usize,
    fixture: Option<&str>,
) -> (
    tokio::runtime::Runtime,
    gpushare_sandbox::apiserver::ApiServer,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    let server = runtime
        .block_on(gpushare_sandbox::apiserver::ApiServer::start())
        .expect("sandbox API server starts");
    if let Some(fixture) = fixture {
        seed_fixture(&server, fixture);
    }
    (runtime, server)
}

#[test]
fn kubectl_runs_the_plugin_against_the_sandbox_api_server() {
    let (runtime, server) = sandbox_on_runtime(2, Some("userguide"));
    let kubeconfig = server.admin_kubeconfig_path();
    let plugin_dir = tempfile::tempdir().expect("temp dir");
    std::os::unix::fs::symlink(
        crate::support::bin(),
        plugin_dir.path().join("kubectl-inspect-gpushare"),
    )
    .expect("symlink");
    // The in-process rendering, which `golden_userguide_cluster` checks against the golden
    // files (reading those here would race with their rewrite under GPUSHARE_UPDATE_GOLDEN).
    let expected = report_of("userguide");
    let table = render_report(&expected, Format::Table, false);
    let details = render_report(&expected, Format::Table, true);
    let mut ran = 0;
    // Every kubectl installed (1.27-1.33 on the build machines), see `support::clients`.
    let kubectls = crate::support::clients::kubectls();
    if kubectls.is_empty() {
        crate::support::clients::missing::<()>(
            "kubectl",
            "no kubectl on PATH or in the SDK folder",
        );
        return;
    }
    for (kubectl, _version) in &kubectls {
        let kubectl = kubectl.as_path();
        let kubectl_dir = kubectl.parent().expect("a folder");
        let path = std::env::join_paths([plugin_dir.path(), kubectl_dir]).expect("PATH");
        let command = || {
            let mut c = std::process::Command::new(kubectl);
            // A clean environment: the test's own GPUSHARE_UPDATE_GOLDEN would otherwise
            // reach the binary's configuration (GPUSHARE_* variables are configuration).
            c.env_clear().env("PATH", &path);
            if let Some(home) = std::env::var_os("HOME") {
                c.env("HOME", home);
            }
            c
        };
        // What `c` printed, after asserting it succeeded.
        let printed = |c: &mut std::process::Command| {
            let out = c.output().expect("kubectl runs");
            assert!(
                out.status.success(),
                "{} {c:?}: {}",
                kubectl.display(),
                stderr(&out)
            );
            stdout(&out)
        };
        // kubectl refuses flags before the plugin name: they go after it; the kubeconfig
        // given by flag, then by KUBECONFIG.
        let by_flag = printed(
            command()
                .args(["inspect", "gpushare", "--kubeconfig"])
                .arg(&kubeconfig),
        );
        assert_eq!(by_flag, table, "{} inspect gpushare", kubectl.display());
        let by_env = printed(
            command()
                .args(["inspect", "gpushare", "-d"])
                .env("KUBECONFIG", &kubeconfig),
        );
        assert_eq!(by_env, details, "{} inspect gpushare -d", kubectl.display());
        // Discovery: `kubectl plugin list` names the plugin.
        let out = command()
            .args(["plugin", "list"])
            .output()
            .expect("kubectl runs");
        assert!(
            stdout(&out).contains("kubectl-inspect-gpushare"),
            "{} plugin list: {}{}",
            kubectl.display(),
            stdout(&out),
            stderr(&out)
        );
        // Help reads like a kubectl plugin: usage and description as the user types it.
        let out = command()
            .args(["inspect", "gpushare", "--help"])
            .output()
            .expect("kubectl runs");
        assert!(out.status.success(), "{}", stderr(&out));
        let help = stdout(&out);
        assert!(help.starts_with("Show GPU memory allocation"), "{help}");
        assert!(
            help.contains("Usage: kubectl inspect gpushare [flags] [NODE]"),
            "{help}"
        );
        // A flag before the plugin name: kubectl refuses it itself; the plugin never runs.
        let out = command()
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["inspect", "gpushare"])
            .output()
            .expect("kubectl runs");
        assert!(!out.status.success(), "{}", stdout(&out));
        assert!(
            stderr(&out).contains("flags cannot be placed before plugin name"),
            "{}: {}",
            kubectl.display(),
            stderr(&out)
        );
        ran += 1;
    }
    assert_eq!(ran, kubectls.len());
    // A named node reads only that node's pods (field selector) and prints only that row.
    let out = run(&[
        "inspect",
        "cn-shanghai.i-uf61h64dz1tmlob9hmtc",
        "--kubeconfig",
        &kubeconfig.to_string_lossy(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("192.168.0.70  3/15"), "{text}");
    assert!(!text.contains("hmtb"), "{text}");
    // $KUBECONFIG with several files, merged as kubectl does; --context picks one.
    let other = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        other.path(),
        "apiVersion: v1\nkind: Config\nclusters:\n- name: elsewhere\n  cluster:\n    \
         server: http://127.0.0.1:1\ncontexts:\n- name: elsewhere\n  context:\n    \
         cluster: elsewhere\n    user: nobody\nusers:\n- name: nobody\n  user: {}\n",
    )
    .expect("kubeconfig written");
    let list = std::env::join_paths([other.path(), kubeconfig.as_path()]).expect("list");
    let list = list.to_string_lossy().into_owned();
    let out = run_with_env(&["inspect", "-o", "json"], &[("KUBECONFIG", &list)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(json["used"], 9);
    let out = run_with_env(
        &["inspect", "--context", "elsewhere"],
        &[("KUBECONFIG", &list)],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("cannot reach the API server at http://127.0.0.1:1"),
        "{}",
        stderr(&out)
    );
    let out = run(&[
        "inspect",
        "no-such-node",
        "--kubeconfig",
        &kubeconfig.to_string_lossy(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    runtime.block_on(server.shutdown());
    let versions: Vec<&str> = kubectls.iter().map(|(_, v)| v.as_str()).collect();
    eprintln!("kubectl versions exercised ({ran}): {versions:?}");
}

#[test]
fn from_extender_agrees_with_the_api_view_of_the_same_cluster() {
    let (runtime, server) = sandbox_on_runtime(2, Some("userguide"));
    let mut config = gpushare::config::Config::default();
    config.extender.bind_address = std::net::IpAddr::from([127, 0, 0, 1]);
    config.extender.port = 0;
    let (stop, stopped) = gpushare::shutdown::channel();
    let extender = runtime
        .block_on(async {
            let handle = gpushare::extender::start(&config, server.admin_client(), stopped).await?;
            handle.wait_ready().await?;
            anyhow::Ok(handle)
        })
        .expect("the extender starts and syncs");
    let kubeconfig = server
        .admin_kubeconfig_path()
        .to_string_lossy()
        .into_owned();
    let from_api = run(&["inspect", "-o", "json", "--kubeconfig", &kubeconfig]);
    assert!(from_api.status.success(), "{}", stderr(&from_api));
    let url = format!("http://{}", extender.addr);
    let from_ext = run(&["inspect", "-o", "json", "--from-extender", &url]);
    assert!(from_ext.status.success(), "{}", stderr(&from_ext));
    let api: Report = serde_json::from_str(&stdout(&from_api)).expect("JSON");
    let ext: Report = serde_json::from_str(&stdout(&from_ext)).expect("JSON");
    assert_eq!((ext.used, ext.total), (api.used, api.total));
    assert_eq!(ext.nodes.len(), api.nodes.len());
    for (e, a) in ext.nodes.iter().zip(&api.nodes) {
        assert_eq!(e.name, a.name);
        assert_ne!(
            a.address, "unknown",
            "the fixture's nodes have an InternalIP"
        );
        assert_eq!(e.address, a.address, "{}: the extender's address", e.name);
        assert_eq!(e.gpus.len(), a.gpus.len());
        for (eg, ag) in e.gpus.iter().zip(&a.gpus) {
            assert_eq!(
                (eg.total, eg.used),
                (ag.total, ag.used),
                "{} GPU {}",
                e.name,
                eg.index
            );
            let names = |g: &gpushare::inspect::report::GpuReport| {
                g.pods
                    .iter()
                    .map(|p| (p.namespace.clone(), p.name.clone(), p.memory))
                    .collect::<Vec<_>>()
            };
            assert_eq!(names(eg), names(ag));
        }
    }
    // The same pods per GPU in the details view, whichever the source.
    let details = run(&["inspect", "-d", "--from-extender", &url]);
    assert!(details.status.success(), "{}", stderr(&details));
    assert!(
        stdout(&details).contains("binpack-2-0  demo"),
        "{}",
        stdout(&details)
    );
    // The table names each node's address, as the API view does.
    let table = run(&["inspect", "--from-extender", &url]);
    assert!(table.status.success(), "{}", stderr(&table));
    for node in &api.nodes {
        assert!(
            stdout(&table).contains(&node.address),
            "{} missing:\n{}",
            node.address,
            stdout(&table)
        );
    }
    stop.trigger();
    runtime.block_on(async {
        extender.stop().await;
        server.shutdown().await;
    });
}
