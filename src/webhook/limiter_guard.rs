//! What the webhook refuses so that a pod cannot switch off the CUDA memory limiter by its own
//! spec (docs/enforcement.md, "A pod cannot opt out"). Pure.
//!
//! The limiter reaches a container as four read-only bind mounts the node adds after the pod's
//! own (the preload list at `/etc/ld.so.preload`, the library, the limits file and state
//! directory under `/usr/local/gpushare`). A pod that asks for GPU memory (or was rewritten
//! for the DRA path) is refused when
//!
//! - a container or init container mounts a volume (any kind, with or without `subPath`) or
//!   a block device **at or below** one of those paths: the runtime orders mounts by depth, and
//!   two mounts at the same path race for the top; one mounted above (at `/etc` or `/usr`)
//!   goes first and the node's mounts land on top of it, so it is allowed;
//! - it has a `hostPath` volume that reaches the limiter's files on the host (`[node]
//!   limiter_dir`, `limiter_run_dir`: at, below or above them, `/var/run` read as `/run`):
//!   through it a container could rewrite its own or another container's limits file.
//!
//! Environment variables are not judged: the dynamic loader reads `/etc/ld.so.preload` whatever
//! the environment says (`LD_PRELOAD` only adds libraries; a variable such as HAMi's
//! `CUDA_DISABLE_CONTROL` means nothing to gpushare), and the limiter reads its limits from
//! the read-only file only.
//!
//! It does not see what a container does at run time (a privileged container can unmount
//! anything: the limiter is a guard, not a security boundary) and does not know which node a
//! pod lands on (it refuses the same on every node: the paths are gpushare's own).

use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;

/// The host directories the limiter's files live in (`[node] limiter_dir`,
/// `limiter_run_dir`), which no pod's `hostPath` may reach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimiterGuard {
    /// The host directories.
    pub host_dirs: Vec<PathBuf>,
}

impl LimiterGuard {
    /// The guard of `node`'s limiter directories.
    pub fn of(node: &crate::config::NodeConfig) -> LimiterGuard {
        LimiterGuard {
            host_dirs: vec![node.limiter_dir.clone(), node.limiter_run_dir.clone()],
        }
    }
}

impl Default for LimiterGuard {
    fn default() -> Self {
        LimiterGuard::of(&crate::config::NodeConfig::default())
    }
}

/// `path` made absolute and plain: `.` and empty parts dropped, `..` applied, `/var/run` read
/// as `/run` (the usual symlink).
fn normal(path: &str) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in Path::new(path).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    match out.strip_prefix("/var/run") {
        Ok(rest) => Path::new("/run").join(rest),
        Err(_) => out,
    }
}

/// Whether one of `a`, `b` is the other or holds it.
fn overlaps(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// The container paths the limiter's mounts take.
const CONTAINER_PATHS: [&str; 2] = [
    gpushare_limiter_contract::PRELOAD_PATH,
    gpushare_limiter_contract::CONTAINER_DIR,
];

/// Each way `pod`'s spec would take the limiter's place, as "container X mounts volume V at
/// P" (empty: none). The caller decides whether the pod is one the limiter serves.
pub fn escapes(pod: &Pod, guard: &LimiterGuard) -> Vec<String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| ("init container", c))
        .chain(spec.containers.iter().map(|c| ("container", c)));
    for (what, c) in containers {
        let mounts = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| (&m.name, &m.mount_path, "mounts volume"));
        let devices = c
            .volume_devices
            .iter()
            .flatten()
            .map(|d| (&d.name, &d.device_path, "puts block volume"));
        for (volume, at, verb) in mounts.chain(devices) {
            let at_path = normal(at);
            if let Some(taken) = CONTAINER_PATHS
                .iter()
                .find(|p| at_path.starts_with(Path::new(p)))
            {
                out.push(format!(
                    "{what} {:?} {verb} {volume:?} at {at}, over the limiter's {taken}",
                    c.name
                ));
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        let Some(host) = &v.host_path else {
            continue;
        };
        let host_path = normal(&host.path);
        if let Some(dir) = guard
            .host_dirs
            .iter()
            .find(|d| overlaps(&host_path, &normal(&d.to_string_lossy())))
        {
            out.push(format!(
                "hostPath volume {:?} ({}) reaches the limiter's files on the node ({})",
                v.name,
                host.path,
                dir.display()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(mounts: serde_json::Value, volumes: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": "p" },
            "spec": {
                "initContainers": [{ "name": "init", "image": "x" }],
                "containers": [{ "name": "main", "image": "x", "volumeMounts": mounts }],
                "volumes": volumes,
            },
        }))
        .expect("pod")
    }

    fn at(path: &str) -> Vec<String> {
        escapes(
            &pod(
                json!([{ "name": "v", "mountPath": path, "subPath": "x" }]),
                json!([{ "name": "v", "emptyDir": {} }]),
            ),
            &LimiterGuard::default(),
        )
    }

    #[test]
    fn mounts_at_or_below_the_limiters_paths_are_refused_and_above_them_allowed() {
        for refused in [
            "/etc/ld.so.preload",
            "/etc//ld.so.preload/",
            "/etc/./ld.so.preload",
            "/usr/local/gpushare",
            "/usr/local/gpushare/state",
            "/usr/local/gpushare/lib/libgpushare_limiter.so",
            "/usr/local/x/../gpushare/limits",
        ] {
            let found = at(refused);
            assert_eq!(found.len(), 1, "{refused}: {found:?}");
            assert!(
                found[0].contains("container \"main\" mounts volume \"v\""),
                "{found:?}"
            );
        }
        for allowed in [
            "/etc",
            "/usr",
            "/usr/local",
            "/",
            "/etc/ld.so.preload.d",
            "/usr/local/gpushare2",
        ] {
            assert!(at(allowed).is_empty(), "{allowed}");
        }
    }

    #[test]
    fn host_paths_that_reach_the_limiters_files_are_refused() {
        let guard = LimiterGuard::default();
        let with_host = |path: &str| {
            escapes(
                &pod(
                    json!([{ "name": "h", "mountPath": "/data" }]),
                    json!([{ "name": "h", "hostPath": { "path": path } }]),
                ),
                &guard,
            )
        };
        for refused in [
            "/",
            "/run",
            "/var/run/gpushare",
            "/run/gpushare/limiter/dp-x-main",
            "/var/lib",
            "/var/lib/gpushare/limiter",
        ] {
            assert_eq!(with_host(refused).len(), 1, "{refused}");
        }
        for allowed in [
            "/var/log",
            "/run/containerd",
            "/var/lib/kubelet",
            "/dev/shm",
        ] {
            assert!(with_host(allowed).is_empty(), "{allowed}");
        }
    }

    #[test]
    fn block_devices_at_the_paths_are_refused() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": { "name": "p" },
            "spec": { "containers": [{ "name": "main", "image": "x",
                "volumeDevices": [{ "name": "b", "devicePath": "/etc/ld.so.preload" }] }] },
        }))
        .expect("pod");
        assert_eq!(escapes(&p, &LimiterGuard::default()).len(), 1);
    }
}
