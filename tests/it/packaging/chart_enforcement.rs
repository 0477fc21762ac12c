//! The chart's `devicePlugin.enforcement`, rendered by the real Helm engine, on both node roles:
//! `none` (the default) only passes the flag; `auto` and `driver` also install the hook (the
//! host's /var/lib/gpushare/bin at the same path, `--enforcement-install-hook`), mount the state
//! directory, the host's /var/run/cdi for the device-plugin path's limit specs and the host's
//! cgroup tree read-only, and the binary accepts the flags; `limiter` and `auto` install the
//! CUDA memory limiter the image carries into the host's /var/lib/gpushare/limiter and keep the
//! containers' limits under the host's /run/gpushare/limiter, both at the same paths.

use yaml_serde::Value;

use crate::support::assert_cli_accepts;
use crate::support::helm_chart::{self, daemonset_pod_spec, strings};

fn daemonset(overlay: &str, name: &str) -> Option<Value> {
    daemonset_pod_spec(overlay, name)
}

fn args(spec: &Value) -> Vec<String> {
    strings(&spec["containers"][0]["args"])
}

/// `(mountPath, hostPath, readOnly)` of each hostPath volume of the first container.
fn host_mounts(spec: &Value) -> Vec<(String, String, bool)> {
    helm_chart::host_mounts(spec, &spec["containers"][0])
}

#[test]
fn enforcement_reaches_both_node_roles_with_the_hook_installed_on_the_host() {
    let Some(off) = daemonset("{}", "gpushare-device-plugin-ds") else {
        return;
    };
    assert!(args(&off).iter().any(|a| a == "--enforcement=none"));
    assert!(!args(&off).iter().any(|a| a.starts_with("--enforcement-")));
    assert!(
        !host_mounts(&off)
            .iter()
            .any(|(m, _, _)| m == "/var/lib/gpushare/bin")
    );
    for (overlay, name, what) in [
        (
            "devicePlugin: {enforcement: driver, deviceListStrategy: cdi-cri}",
            "gpushare-device-plugin-ds",
            "the device plugin",
        ),
        (
            "{devicePlugin: {enforcement: auto}, dra: {enabled: true}}",
            "gpushare-dra-plugin",
            "the DRA plugin",
        ),
    ] {
        let spec = daemonset(overlay, name).expect("rendered");
        let args = args(&spec);
        for want in [
            "--enforcement-hook=/var/lib/gpushare/bin/gpushare",
            "--enforcement-install-hook",
            "--enforcement-state-dir=/var/run/gpushare/limits",
            "--enforcement-cdi-dir=/run/gpushare/limit-cdi",
            "--cgroup-root=/host/sys/fs/cgroup",
        ] {
            assert!(args.iter().any(|a| a == want), "{what}: {want} in {args:?}");
        }
        assert_cli_accepts(&args, what);
        let mounts = host_mounts(&spec);
        for want in [
            ("/var/lib/gpushare/bin", "/var/lib/gpushare/bin", false),
            (
                "/var/run/gpushare/limits",
                "/var/run/gpushare/limits",
                false,
            ),
            ("/run/gpushare/limit-cdi", "/var/run/cdi", false),
            ("/host/sys/fs/cgroup", "/sys/fs/cgroup", true),
        ] {
            let want = (want.0.to_string(), want.1.to_string(), want.2);
            assert!(mounts.contains(&want), "{what}: {want:?} in {mounts:?}");
        }
    }
}

#[test]
fn the_limiter_is_installed_on_the_host_and_its_containers_files_kept_there() {
    let limiter_args = [
        "--limiter-library=/usr/local/lib/gpushare/libgpushare_limiter.so",
        "--limiter-dir=/var/lib/gpushare/limiter",
        "--limiter-run-dir=/run/gpushare/limiter",
    ];
    // The mounts it hands containers name host paths: the node agent sees them at the same.
    let limiter_mounts = [
        (
            "/var/lib/gpushare/limiter",
            "/var/lib/gpushare/limiter",
            false,
        ),
        ("/run/gpushare/limiter", "/run/gpushare/limiter", false),
    ];
    let Some(off) = daemonset("{}", "gpushare-device-plugin-ds") else {
        return;
    };
    assert!(!args(&off).iter().any(|a| a.starts_with("--limiter-")));
    for (overlay, name, what, driver) in [
        (
            "devicePlugin: {enforcement: limiter}",
            "gpushare-device-plugin-ds",
            "the device plugin",
            false,
        ),
        (
            "{devicePlugin: {enforcement: limiter}, dra: {enabled: true}}",
            "gpushare-dra-plugin",
            "the DRA plugin",
            false,
        ),
        (
            "devicePlugin: {enforcement: auto}",
            "gpushare-device-plugin-ds",
            "the device plugin with auto",
            true,
        ),
    ] {
        let spec = daemonset(overlay, name).expect("rendered");
        let args = args(&spec);
        for want in limiter_args {
            assert!(args.iter().any(|a| a == want), "{what}: {want} in {args:?}");
        }
        assert_eq!(
            args.iter().any(|a| a == "--enforcement-install-hook"),
            driver,
            "{what}: the driver's hook only where the driver's limits may be chosen"
        );
        assert_cli_accepts(&args, what);
        let mounts = host_mounts(&spec);
        for want in limiter_mounts {
            let want = (want.0.to_string(), want.1.to_string(), want.2);
            assert!(mounts.contains(&want), "{what}: {want:?} in {mounts:?}");
        }
    }
}
