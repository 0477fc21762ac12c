//! How a rendered container becomes a process on the build machine: the mapping table of the
//! chart-mode tier ([`super::chart_install`]). The process gets exactly the container's
//! command (the image's entrypoint, the built `gpushare`), arguments and environment, with
//! what a container runtime would provide mapped onto temporary directories and loopback
//! ports, and nothing else:
//!
//! | in the container | on the build machine |
//! | --- | --- |
//! | a `volumeMount` of a `configMap` | a directory holding the ConfigMap's keys as files |
//! | a `volumeMount` of a `secret` | a directory holding the Secret's keys (decoded) |
//! | a `volumeMount` of a `hostPath` | `<node>/host/<path>` of the simulated node, shared with its kubelet and its other pods; `type: Directory` must exist there (else the pod cannot start) |
//! | a `volumeMount` of an `emptyDir` | a directory of the pod's own |
//! | any other absolute path | `<pod>/rootfs/<path>`: the image's file system, where only the binary is, so what is not mounted does not exist |
//! | an argument or `env` value that is an absolute path (or `--flag=<path>`) | the path above |
//! | the paths the binary uses by default inside a mount (`device_plugin.device_plugin_dir`, `device_plugin.pod_resources_socket`) | the same keys set through `GPUSHARE_*` variables to the mapped path, so no default escapes the mapping |
//! | the runtime's `/sys` (read-only sysfs in every container) | `devices.sysfs_root` (`GPUSHARE_DEVICES__SYSFS_ROOT`) at the node's sysfs: a recorded tree, or an empty one |
//! | the projected ServiceAccount token (`/var/run/secrets/kubernetes.io/serviceaccount`) | `KUBECONFIG` naming the sandbox API server with a token of the pod's ServiceAccount (with the node-name claim of a pod-bound token); `in-cluster` configuration cannot be pointed elsewhere |
//! | `fieldRef` env (`spec.nodeName`, `status.podIP`, `metadata.name`, `metadata.namespace`) | the node's name, `127.0.0.1`, the pod's name, its namespace |
//! | a `containerPort` (each pod has its own network namespace) | a free loopback port: an argument ending `=<port>` or `:<port>` names the mapped one |
//!
//! The doctor preflight reads host files under `/` (driver files, runtime configurations):
//! with the fake GPU backend of these tests none of them is needed, and the build machine's
//! have nothing to offer either.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec, Volume};
use serde_json::Value;

/// Where one pod's container paths land.
#[derive(Clone, Debug)]
pub(crate) struct Mounts {
    /// (container path, host path), longest container path first.
    mounts: Vec<(PathBuf, PathBuf)>,
    /// The image's file system (nothing but the binary).
    rootfs: PathBuf,
}

impl Mounts {
    /// Mounts of (container path, host path) over an image file system at `rootfs`.
    pub(crate) fn new(mut mounts: Vec<(PathBuf, PathBuf)>, rootfs: PathBuf) -> Mounts {
        mounts.sort_by_key(|(inside, _)| std::cmp::Reverse(inside.as_os_str().len()));
        Mounts { mounts, rootfs }
    }

    /// The host path of container path `p`: under the longest mount holding it, else in the
    /// image's (empty) file system.
    pub(crate) fn map(&self, p: &Path) -> PathBuf {
        for (inside, outside) in &self.mounts {
            if let Ok(rest) = p.strip_prefix(inside) {
                return if rest.as_os_str().is_empty() {
                    outside.clone()
                } else {
                    outside.join(rest)
                };
            }
        }
        let rel = p.strip_prefix("/").unwrap_or(p);
        self.rootfs.join(rel)
    }

    /// Whether `p` is under a mount.
    pub(crate) fn mounted(&self, p: &Path) -> bool {
        self.mounts.iter().any(|(inside, _)| p.starts_with(inside))
    }
}

/// What the pod's volumes are made of (the harness provides them).
pub(crate) struct VolumeSources<'a> {
    /// The rendered ConfigMaps by name (`data`).
    pub config_maps: &'a BTreeMap<String, Value>,
    /// The Secrets by name, as the API holds them (`data`, base64).
    pub secrets: &'a BTreeMap<String, Value>,
    /// The simulated node's host root.
    pub node_host: &'a Path,
    /// The pod's own directory.
    pub pod_dir: &'a Path,
}

/// Why a pod cannot start as rendered (kubelet would keep it in `ContainerCreating`).
#[derive(Debug)]
pub(crate) struct CannotStart(pub String);

/// The mounts of container `c` of `spec`, each volume made ready on the build machine.
pub(crate) fn mounts(
    spec: &PodSpec,
    c: &Container,
    src: &VolumeSources<'_>,
) -> Result<Mounts, CannotStart> {
    let volumes: BTreeMap<&str, &Volume> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| (v.name.as_str(), v))
        .collect();
    let mut out = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        let v = volumes.get(m.name.as_str()).ok_or_else(|| {
            CannotStart(format!(
                "container {}: volumeMount {} names no volume of the pod",
                c.name, m.name
            ))
        })?;
        let host = volume_dir(v, src)?;
        out.push((PathBuf::from(&m.mount_path), host));
    }
    let rootfs = src.pod_dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).expect("the pod's root file system");
    Ok(Mounts::new(out, rootfs))
}

/// One volume on the build machine.
fn volume_dir(v: &Volume, src: &VolumeSources<'_>) -> Result<PathBuf, CannotStart> {
    let dir = src.pod_dir.join("volumes").join(&v.name);
    let write_keys = |data: BTreeMap<String, Vec<u8>>| {
        std::fs::create_dir_all(&dir).expect("a volume directory");
        for (k, bytes) in data {
            std::fs::write(dir.join(&k), bytes).expect("a volume file");
        }
        Ok(dir.clone())
    };
    // A ConfigMap's or Secret's `data`, each value decoded by `decode`, as the volume's files.
    let write_data = |found: &Value, decode: &dyn Fn(&str) -> Vec<u8>| {
        let data = found["data"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), decode(v.as_str().unwrap_or_default())))
            .collect();
        write_keys(data)
    };
    if let Some(cm) = &v.config_map {
        let name = cm.name.as_str();
        let found = src.config_maps.get(name).ok_or_else(|| {
            CannotStart(format!(
                "volume {}: ConfigMap {name} is not rendered by the chart",
                v.name
            ))
        })?;
        return write_data(found, &|text| text.as_bytes().to_vec());
    }
    if let Some(s) = &v.secret {
        let name = s.secret_name.clone().unwrap_or_default();
        let found = src.secrets.get(&name).ok_or_else(|| {
            CannotStart(format!(
                "volume {}: Secret {name} does not exist (kubelet: MountVolume.SetUp failed)",
                v.name
            ))
        })?;
        return write_data(found, &|text| {
            base64::engine::general_purpose::STANDARD
                .decode(text)
                .unwrap_or_default()
        });
    }
    if let Some(h) = &v.host_path {
        let rel = h.path.trim_start_matches('/');
        let dir = src.node_host.join(rel);
        match h.type_.as_deref().unwrap_or("") {
            "Directory" if !dir.is_dir() => {
                return Err(CannotStart(format!(
                    "volume {}: hostPath {} (type Directory) does not exist on the node",
                    v.name, h.path
                )));
            }
            "DirectoryOrCreate" => {
                std::fs::create_dir_all(&dir).expect("a hostPath directory");
            }
            "CharDevice" | "File" | "Socket" if !dir.exists() => {
                return Err(CannotStart(format!(
                    "volume {}: hostPath {} does not exist on the node",
                    v.name, h.path
                )));
            }
            _ => {}
        }
        return Ok(dir);
    }
    if v.empty_dir.is_some() {
        std::fs::create_dir_all(&dir).expect("an emptyDir");
        return Ok(dir);
    }
    Err(CannotStart(format!(
        "volume {}: a kind of volume the chart-mode tier does not provide",
        v.name
    )))
}

/// A string as the process sees it: an absolute path (or `--flag=<path>`, `KEY=<path>`) mapped
/// through `mounts`, a container port (`…=<port>`, `…:<port>`) through `ports`; anything else
/// as it is.
pub(crate) fn map_value(value: &str, mounts: &Mounts, ports: &BTreeMap<u16, u16>) -> String {
    let (head, tail) = match value.split_once('=') {
        Some((h, t)) if h.starts_with('-') => (Some(h), t),
        _ => (None, value),
    };
    let mapped = if tail.starts_with('/') {
        tail.split(',')
            .map(|p| {
                if p.starts_with('/') {
                    mounts.map(Path::new(p)).display().to_string()
                } else {
                    p.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    } else {
        map_port(tail, ports)
    };
    match head {
        Some(h) => format!("{h}={mapped}"),
        None => mapped,
    }
}

/// `0.0.0.0:9101` or `9443` with the port mapped; anything else as it is.
fn map_port(value: &str, ports: &BTreeMap<u16, u16>) -> String {
    let (host, port) = match value.rsplit_once(':') {
        Some((h, p)) => (Some(h), p),
        None => (None, value),
    };
    match port.parse::<u16>().ok().and_then(|p| ports.get(&p)) {
        Some(mapped) => match host {
            Some(h) => format!("{h}:{mapped}"),
            None => mapped.to_string(),
        },
        None => value.to_string(),
    }
}

/// What the downward API gives the pod.
pub(crate) struct PodFacts<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub node: &'a str,
}

/// The container's environment: each rendered variable (values mapped by [`map_value`],
/// `fieldRef`s from the pod's facts), then what the mapping table adds.
pub(crate) fn environment(
    c: &Container,
    facts: &PodFacts<'_>,
    mounts: &Mounts,
    ports: &BTreeMap<u16, u16>,
) -> Result<Vec<(String, String)>, CannotStart> {
    let mut out = Vec::new();
    for e in c.env.iter().flatten() {
        out.push((e.name.clone(), env_value(e, facts, mounts, ports)?));
    }
    Ok(out)
}

fn env_value(
    e: &EnvVar,
    facts: &PodFacts<'_>,
    mounts: &Mounts,
    ports: &BTreeMap<u16, u16>,
) -> Result<String, CannotStart> {
    if let Some(v) = &e.value {
        return Ok(map_value(v, mounts, ports));
    }
    let Some(from) = &e.value_from else {
        return Ok(String::new());
    };
    if let Some(f) = &from.field_ref {
        return match f.field_path.as_str() {
            "spec.nodeName" => Ok(facts.node.to_string()),
            "status.podIP" | "status.hostIP" => Ok("127.0.0.1".to_string()),
            "metadata.name" => Ok(facts.name.to_string()),
            "metadata.namespace" => Ok(facts.namespace.to_string()),
            other => Err(CannotStart(format!(
                "env {}: fieldRef {other} is not provided by the chart-mode tier",
                e.name
            ))),
        };
    }
    Err(CannotStart(format!(
        "env {}: a valueFrom the chart-mode tier does not provide",
        e.name
    )))
}

/// The defaults the binary reads inside a mount, pointed at the mapped path: (container
/// path, environment variable, the file or directory the key names below it).
const DEFAULTS_IN_MOUNTS: &[(&str, &str, &str)] = &[
    (
        "/var/lib/kubelet/device-plugins",
        "GPUSHARE_DEVICE_PLUGIN__DEVICE_PLUGIN_DIR",
        "",
    ),
    (
        "/var/lib/kubelet/pod-resources",
        "GPUSHARE_DEVICE_PLUGIN__POD_RESOURCES_SOCKET",
        "kubelet.sock",
    ),
];

/// What the mapping table adds to a container's environment: the defaults inside its mounts
/// (unless the container sets them), sysfs, and the ServiceAccount's kubeconfig.
pub(crate) fn mapped_defaults(
    env: &[(String, String)],
    mounts: &Mounts,
    sysfs: &Path,
    kubeconfig: &Path,
) -> Vec<(String, String)> {
    let set = |k: &str| env.iter().any(|(name, _)| name == k);
    let mut out = Vec::new();
    for (inside, key, below) in DEFAULTS_IN_MOUNTS {
        let p = Path::new(inside);
        if mounts.mounted(p) && !set(key) {
            let mapped = mounts.map(p);
            let value = if below.is_empty() {
                mapped
            } else {
                mapped.join(below)
            };
            out.push((key.to_string(), value.display().to_string()));
        }
    }
    if !set("GPUSHARE_DEVICES__SYSFS_ROOT") {
        out.push((
            "GPUSHARE_DEVICES__SYSFS_ROOT".to_string(),
            sysfs.display().to_string(),
        ));
    }
    out.push(("KUBECONFIG".to_string(), kubeconfig.display().to_string()));
    out
}
