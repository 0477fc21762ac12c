//! The binary as an operator meets it: help, version, config errors, the kubectl alias.

use gpushare_sandbox::apiserver::ApiServer;

use crate::support::canned_http::CannedServer;
use crate::support::{bin, closed_port, kubeconfig_for, run, run_with_env, stderr, stdout};

#[test]
fn every_subcommand_has_help() {
    for sub in [
        "extender",
        "device-plugin",
        "dra-plugin",
        "webhook",
        "inspect",
        "doctor",
        "demo",
        "version",
    ] {
        let out = run(&[sub, "--help"]);
        let (text, err) = (stdout(&out), stderr(&out));
        assert!(out.status.success(), "{sub} --help failed: {err}");
        assert!(text.contains("Usage: gpushare"), "{sub}: {text}");
    }
}

/// The top-level help and the crate name every role; each node role names itself, not the
/// other one, in the errors of its start-up.
#[test]
fn help_names_every_role_and_each_node_role_names_itself() {
    let out = run(&["--help"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&out);
    let about = help.lines().next().unwrap_or_default().to_string();
    for role in [
        "extender",
        "device plugin",
        "DRA",
        "webhook",
        "inspect",
        "doctor",
    ] {
        assert!(about.contains(role), "{role} in the first line: {about}");
    }
    assert!(!help.contains("four roles"), "{help}");
    for role in ["device-plugin", "dra-plugin"] {
        let out = run_with_env(&[role, "--skip-doctor"], &[("NODE_NAME", "")]);
        assert_eq!(out.status.code(), Some(78), "{role}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.starts_with(&format!("gpushare: {role}: the node name is required")),
            "{role}: {err}"
        );
    }
}

#[test]
fn version_reports_commit_target_and_linkage() {
    let out = run(&["version"]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("gpushare {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    for field in ["commit: ", "target: x86_64-unknown-linux-", "linkage: "] {
        assert!(text.contains(field), "missing {field}: {text}");
    }
    let out = run(&["--version"]);
    assert_eq!(
        stdout(&out).trim(),
        format!("gpushare {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn a_bad_configuration_exits_78_naming_key_and_source() {
    let out = run_with_env(&["doctor"], &[("GPUSHARE_EXTENDER__GPU_POLICY", "random")]);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("extender.gpu_policy"), "{err}");
    assert!(err.contains("GPUSHARE_EXTENDER__GPU_POLICY"), "{err}");
    let out = run(&["--config", "/nonexistent/gpushare.toml", "doctor"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(stderr(&out).contains("/nonexistent/gpushare.toml"));
    let out = run_with_env(&["doctor"], &[("PORT", "not-a-port")]);
    assert_eq!(out.status.code(), Some(78));
    assert!(
        stderr(&out).contains("environment variable PORT"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn usage_errors_exit_64() {
    let out = run(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(64));
}

#[test]
fn invoked_as_kubectl_plugin_it_is_inspect() {
    let dir = tempfile::tempdir().unwrap();
    // `--help` of the binary linked as `name`, which must succeed and read as the plugin's.
    let help_as = |name: &str| {
        let link = dir.path().join(name);
        std::os::unix::fs::symlink(bin(), &link).unwrap();
        let out = std::process::Command::new(&link)
            .arg("--help")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{name}: {text}");
        let usage = "Usage: kubectl inspect gpushare [flags] [NODE]";
        assert!(text.contains(usage), "{name}: {text}");
        text
    };
    let text = help_as("kubectl-inspect-gpushare");
    assert!(text.starts_with("Show GPU memory allocation"), "{text}");
    assert!(!text.contains("plugin name`"), "{text}");
    // krew links it under this name.
    let text = help_as("kubectl-inspect_gpushare");
    assert!(text.contains("--details"), "not inspect's help: {text}");
}

#[test]
fn the_upstream_device_plugin_command_line_is_accepted() {
    // DP:device-plugin-ds.yaml runs `gpushare-device-plugin-v2 -logtostderr --v=5 --memory-unit=GiB`.
    let out = run(&[
        "device-plugin",
        "-logtostderr",
        "--v=5",
        "--memory-unit=GiB",
        "--skip-doctor",
    ]);
    // Accepted: what stops it is the missing node name, a configuration error.
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    assert!(stderr(&out).contains("node name"), "{}", stderr(&out));
}

/// One bad input of a role: the command line, extra environment, the exit status it must
/// end with and what its stderr must name.
struct BadInput<'a> {
    args: Vec<&'a str>,
    env: Vec<(&'a str, &'a str)>,
    status: i32,
    names: &'a [&'a str],
}

fn bad<'a>(args: &[&'a str], status: i32, names: &'a [&'a str]) -> BadInput<'a> {
    BadInput {
        args: args.to_vec(),
        env: vec![("GPUSHARE_CLUSTER__API_WAIT_SECS", "0")],
        status,
        names,
    }
}

/// Every role's bad inputs against the built binary: 64 for a bad command-line value, 78 for
/// missing or invalid configuration, 1 for a run that failed; stderr names the problem (and
/// the cause of a failed connection), and no client log line per failed request gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_roles_bad_inputs_exit_with_the_documented_status_naming_the_problem() {
    let api = ApiServer::start().await.expect("sandbox API server");
    let sandbox = api.admin_kubeconfig_path().to_string_lossy().into_owned();
    let refused = kubeconfig_for(&format!("http://127.0.0.1:{}", closed_port()));
    let refused = refused.path().to_string_lossy().into_owned();
    // Something that is not an API server answers 404 with an HTML page to everything.
    // (It runs its own runtime, started and dropped outside this one's workers.)
    let not_api = tokio::task::block_in_place(|| {
        CannedServer::start(404, "<html><body>404 Not Found</body></html>".into())
    });
    let not_api_kc = kubeconfig_for(&not_api.url);
    let not_api_kc = not_api_kc.path().to_string_lossy().into_owned();
    let closed_extender = format!("http://127.0.0.1:{}", closed_port());
    let https_extender = format!("https://127.0.0.1:{}", closed_port());

    const MISSING_TLS: [&str; 4] = [
        "--tls-cert",
        "/nonexistent/tls.crt",
        "--tls-key",
        "/nonexistent/tls.key",
    ];
    let mut cases = vec![
        // 64: a command-line value that cannot work.
        bad(&["extender", "--port", "99999"], 64, &["--port", "99999"]),
        bad(
            &["extender", "--gpu-policy", "random"],
            64,
            &["--gpu-policy"],
        ),
        bad(
            &["device-plugin", "--fake-gpus", "0x16GiB"],
            64,
            &["--fake-gpus", "zero GPUs"],
        ),
        bad(
            &["device-plugin", "--memory-unit", "KiB"],
            64,
            &["--memory-unit"],
        ),
        bad(
            &["doctor", "--fake-gpus", "lots"],
            64,
            &["--fake-gpus", "lots"],
        ),
        bad(&["doctor", "--role", "bogus"], 64, &["--role"]),
        bad(&["inspect", "-o", "html"], 64, &["--output"]),
        bad(
            &["inspect", "--from-extender", "ftp://x"],
            64,
            &["--from-extender", "ftp://x"],
        ),
        bad(
            &["inspect", "--from-extender", &https_extender],
            64,
            &["--extender-ca"],
        ),
        bad(
            &[
                "inspect",
                "--from-extender",
                &https_extender,
                "--extender-ca",
                "/nonexistent/ca.crt",
            ],
            64,
            &["/nonexistent/ca.crt", "No such file"],
        ),
        bad(&["webhook", "--port", "x"], 64, &["--port"]),
        bad(&["demo", "--no-such-flag"], 64, &["--no-such-flag"]),
        bad(
            &["demo", "--fake-gpus", "lots"],
            64,
            &["--fake-gpus", "lots"],
        ),
        // 78: configuration missing or invalid.
        bad(
            &["device-plugin", "--skip-doctor"],
            78,
            &["node name", "NODE_NAME"],
        ),
        bad(
            &[
                "device-plugin",
                "--skip-doctor",
                "--node-name",
                "n1",
                "--gpu-backend",
                "fake",
            ],
            78,
            &["fake_gpus"],
        ),
        bad(
            &["webhook", "--kubeconfig", &sandbox],
            78,
            &["--tls-cert", "--self-signed"],
        ),
        bad(
            &[&["webhook"][..], &MISSING_TLS].concat(),
            78,
            &["/nonexistent/tls.crt"],
        ),
        bad(
            &[
                &["extender", "--skip-doctor", "--kubeconfig", &sandbox][..],
                &MISSING_TLS,
            ]
            .concat(),
            78,
            &["/nonexistent/tls.crt"],
        ),
        bad(
            &[
                "extender",
                "--skip-doctor",
                "--kubeconfig",
                "/nonexistent/kc",
            ],
            78,
            &["/nonexistent/kc"],
        ),
        bad(
            &["inspect", "--kubeconfig", "/nonexistent/kc"],
            78,
            &["/nonexistent/kc"],
        ),
        BadInput {
            env: vec![("GPUSHARE_EXTENDER__GPU_POLICY", "random")],
            ..bad(
                &["extender"],
                78,
                &["extender.gpu_policy", "GPUSHARE_EXTENDER__GPU_POLICY"],
            )
        },
        // 1: the run failed; the cause is kept.
        bad(
            &["inspect", "--kubeconfig", &refused],
            1,
            &["Connection refused"],
        ),
        bad(
            &["extender", "--skip-doctor", "--kubeconfig", &refused],
            1,
            &["Connection refused"],
        ),
        bad(
            &["inspect", "--from-extender", &closed_extender],
            1,
            &["Connection refused"],
        ),
        bad(
            &["inspect", "--kubeconfig", &not_api_kc],
            1,
            &["not found (HTTP 404)", "not a Kubernetes status"],
        ),
        bad(
            &["extender", "--skip-doctor", "--kubeconfig", &not_api_kc],
            1,
            &["not found (HTTP 404)"],
        ),
    ];
    // The node name must not come from the environment.
    cases.iter_mut().for_each(|c| c.env.push(("NODE_NAME", "")));
    // The binary runs while the sandbox API server serves on the other worker.
    let runs = tokio::task::block_in_place(|| {
        cases
            .into_iter()
            .map(|c| {
                let out = run_with_env(&c.args, &c.env);
                (c.args.join(" "), c.status, c.names, out)
            })
            .collect::<Vec<_>>()
    });
    let mut wrong = Vec::new();
    for (args, status, names, out) in &runs {
        let err = stderr(out);
        let mut problems = Vec::new();
        if out.status.code() != Some(*status) {
            problems.push(format!("exit {:?}, want {status}", out.status.code()));
        }
        for name in names.iter().filter(|n| !err.contains(*n)) {
            problems.push(format!("stderr does not name {name:?}"));
        }
        if err.contains(" ERROR ") || err.contains("failed with error") {
            problems.push("a client ERROR log line".to_string());
        }
        if err.contains("cannot reach the API server") && err.contains("404") {
            problems.push("a 404 read as unreachable".to_string());
        }
        if !problems.is_empty() {
            wrong.push(format!(
                "gpushare {args}: {}\n  stderr: {err}",
                problems.join("; ")
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    tokio::task::block_in_place(|| drop(not_api));
    api.shutdown().await;
}
