//! Migrating from Aliyun gpushare, end to end against the sandbox API server: a cluster set
//! up by Aliyun's guide (`kubectl create`, fixture `doctor/aliyun/guide.yaml`) makes
//! `gpushare doctor --role control-plane` warn in `aliyun-leftovers` and print the commands
//! that clear the chart's way; a real kubectl (`support::clients`) runs exactly those
//! commands; the chart's objects (`packaging/manifests/`, the default render) are created
//! where the deleted ones were; and doctor then finds nothing in the way.

use gpushare::doctor::report::{Check, Status};
use gpushare_sandbox::apiserver::ApiServer;

use crate::support::doctor_node::control_plane_checks;
use crate::support::{clients, fixture};

async fn leftovers(api: &ApiServer) -> Check {
    control_plane_checks(api, None)
        .await
        .into_iter()
        .find(|c| c.id == "aliyun-leftovers")
        .expect("the aliyun-leftovers check runs in the control-plane role")
}

/// Runs one printed `kubectl …` command line (no shell: split on blanks) on a blocking thread.
async fn kubectl(bin: std::path::PathBuf, kubeconfig: String, line: String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = line.split_whitespace().skip(1).collect();
        let out = std::process::Command::new(&bin)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(&args)
            .output()
            .expect("kubectl runs");
        assert!(
            out.status.success(),
            "`{line}` failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    })
    .await
    .expect("kubectl thread");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_names_the_aliyun_leftovers_and_its_commands_clear_the_way() {
    let Some((bin, _version)) = clients::kubectls().into_iter().next_back() else {
        clients::missing::<()>("kubectl", "no kubectl on PATH or in the SDK folder");
        return;
    };
    let api = ApiServer::start().await.expect("sandbox API server");
    assert_eq!(leftovers(&api).await.status, Status::Ok);

    let guide = std::fs::read_to_string(fixture("doctor/aliyun/guide.yaml")).expect("fixture");
    api.seed_yaml(&guide).expect("seeded");
    let check = leftovers(&api).await;
    assert_eq!(check.status, Status::Warn, "{check:#?}");
    for line in [
        "Deployment gpushare-schd-extender (kubectl create): hostNetwork: true, nodeSelector node-role.kubernetes.io/master",
        "DaemonSet gpushare-device-plugin-ds (kubectl create): hostNetwork: true",
        "Service gpushare-schd-extender (kubectl create)",
        "ClusterRoleBinding gpushare-device-plugin (kubectl create)",
    ] {
        assert!(check.detail.lines().any(|l| l == line), "{}", check.detail);
    }

    // The sequence doctor prints, run as printed by a real kubectl.
    let commands: Vec<String> = check
        .hint
        .lines()
        .filter_map(|l| l.split_once(". kubectl "))
        .flat_map(|(_, rest)| {
            format!("kubectl {rest}")
                .split(" && ")
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        commands.len(),
        2 + 2 * 7,
        "two orphaning deletes, then an annotate and a label for the Service, 2 ServiceAccounts, \
         2 ClusterRoles and 2 bindings:\n{}",
        check.hint
    );
    let kubeconfig = api.admin_kubeconfig_path().display().to_string();
    for line in commands {
        kubectl(bin.clone(), kubeconfig.clone(), line).await;
    }
    assert!(
        api.get_object("deployments", Some("kube-system"), "gpushare-schd-extender")
            .is_none()
    );
    assert!(
        api.get_object(
            "daemonsets",
            Some("kube-system"),
            "gpushare-device-plugin-ds"
        )
        .is_none()
    );
    let svc = api
        .get_object("services", Some("kube-system"), "gpushare-schd-extender")
        .expect("the Service stays (NodePort 32766 keeps answering)");
    assert_eq!(
        svc["metadata"]["annotations"]["meta.helm.sh/release-name"],
        "gpushare"
    );
    assert_eq!(
        svc["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "Helm"
    );
    let role = api
        .get_object("clusterroles", None, "gpushare-device-plugin")
        .expect("ClusterRole");
    assert_eq!(
        role["metadata"]["annotations"]["meta.helm.sh/release-namespace"],
        "kube-system"
    );

    // What `helm install` then creates in place of the deleted workloads (the chart's
    // default render): doctor finds nothing left in the way.
    for file in ["extender-deployment.yaml", "device-plugin-daemonset.yaml"] {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("packaging/manifests")
                .join(file),
        )
        .expect("manifest");
        api.seed_yaml(&text).expect("chart object created");
    }
    let check = leftovers(&api).await;
    assert_eq!(check.status, Status::Ok, "{check:#?}");
    api.shutdown().await;
}
