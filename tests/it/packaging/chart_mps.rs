//! The chart with `devicePlugin.mps: true`, rendered by the real Helm engine: the device
//! plugin runs the MPS daemon (flags, the compute capability for the MPS programs, the pipe,
//! log and shm host directories mounted at the paths Allocate hands to GPU containers), and
//! the binary accepts the flags. Without MPS none of it is there.

use yaml_serde::Value;

use crate::support::assert_cli_accepts;
use crate::support::helm_chart::{self, daemonset_pod_spec, env_value, strings};

fn device_plugin(overlay: &str) -> Option<Value> {
    daemonset_pod_spec(overlay, "gpushare-device-plugin-ds")
}

/// `(mountPath, hostPath)` of each hostPath volume mounted into `container`.
fn host_mounts(spec: &Value, container: &Value) -> Vec<(String, String)> {
    helm_chart::host_mounts(spec, container)
        .into_iter()
        .map(|(mount, host, _)| (mount, host))
        .collect()
}

#[test]
fn mps_true_runs_the_daemon_in_the_device_plugin_with_the_host_directories() {
    let Some(off) = device_plugin("{}") else {
        return;
    };
    let c = &off["containers"][0];
    assert!(!strings(&c["args"]).iter().any(|a| a.starts_with("--mps")));
    assert!(c["securityContext"].get("privileged").is_none());
    assert_eq!(
        env_value(c, "NVIDIA_DRIVER_CAPABILITIES").as_deref(),
        Some("utility")
    );
    assert!(!host_mounts(&off, c).iter().any(|(m, _)| m == "/dev/shm"));

    let on = device_plugin(
        "devicePlugin: {mps: true, mpsPinnedMemLimitMiB: 1000000, mpsActiveThreadPercentage: 50}",
    )
    .expect("rendered");
    let c = &on["containers"][0];
    let args = strings(&c["args"]);
    for want in [
        "--mps",
        "--mps-pipe-dir=/tmp/nvidia-mps",
        "--mps-log-dir=/var/log/nvidia-mps",
        "--mps-shm-dir=/run/gpushare/mps-shm",
        // An integer, not Go's 1e+06.
        "--mps-pinned-mem-limit-mib=1000000",
        "--mps-active-thread-percentage=50",
    ] {
        assert!(
            args.iter().any(|a| a == want),
            "{want} missing from {args:?}"
        );
    }
    assert_cli_accepts(&args, "the device plugin with MPS");
    assert_eq!(
        c["securityContext"]["privileged"], true,
        "the daemon starts each MPS server as its client's user"
    );
    assert_eq!(
        env_value(c, "NVIDIA_DRIVER_CAPABILITIES").as_deref(),
        Some("compute,utility"),
        "the nvidia runtime injects nvidia-cuda-mps-control with the compute capability"
    );
    let mounts = host_mounts(&on, c);
    for want in [
        ("/tmp/nvidia-mps", "/tmp/nvidia-mps"),
        ("/var/log/nvidia-mps", "/var/log/nvidia-mps"),
        ("/dev/shm", "/run/gpushare/mps-shm"),
    ] {
        assert!(
            mounts.iter().any(|(m, h)| (m.as_str(), h.as_str()) == want),
            "{want:?} missing from {mounts:?}"
        );
    }

    // Without a shm directory nothing replaces the container's /dev/shm.
    let no_shm = device_plugin("devicePlugin: {mps: true, mpsShmDir: ''}").expect("rendered");
    let c = &no_shm["containers"][0];
    assert!(
        !strings(&c["args"])
            .iter()
            .any(|a| a.starts_with("--mps-shm-dir"))
    );
    assert!(!host_mounts(&no_shm, c).iter().any(|(m, _)| m == "/dev/shm"));
}
