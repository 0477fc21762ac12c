//! Generic devices declared in configuration (`[[devices.generic]]`): FPGAs, NPUs, serial
//! ports, `/dev/fuse` and the like, offered as an extended resource of their own, each device
//! shared by a set number of pods. The declaration names the device nodes by glob under
//! `/dev`, and the environment and mounts a container gets with them — what users of squat's
//! generic-device-plugin write, as TOML.
//!
//! ```toml
//! [[devices.generic]]
//! resource = "example.com/fuse"
//! shares = 10                      # pods per device
//! paths = [{ path = "/dev/fuse" }]
//!
//! [[devices.generic]]
//! resource = "example.com/serial"
//! paths = [{ path = "/dev/ttyUSB*" }]   # one path: one device per match
//! envs = { SERIAL_BAUD = "115200" }
//! ```
//!
//! One path gives one device per node it matches; several paths give one device holding every
//! node they match (each path that is not `optional` must match). This module checks the
//! declarations ([`GenericDeviceConfig::validate`]) and finds the devices under a dev root
//! ([`discover`]); it opens no device and registers nothing.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::core::wire;

/// One `[[devices.generic]]` declaration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenericDeviceConfig {
    /// The extended resource (`example.com/fuse`).
    pub resource: String,
    /// The device nodes, by glob under `/dev`.
    pub paths: Vec<DevicePathConfig>,
    /// Pods that may hold one device at once.
    #[serde(default = "one")]
    pub shares: u32,
    /// Environment handed to a container with the device.
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    /// Host paths mounted into a container with the device.
    #[serde(default)]
    pub mounts: Vec<MountConfig>,
}

fn one() -> u32 {
    1
}

fn rw() -> String {
    "rw".to_string()
}

/// One device-node glob.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicePathConfig {
    /// Absolute glob under `/dev` (`*`, `?` and `[…]` within one path component).
    pub path: String,
    /// Where the node appears in the container [default: the host path]; only for a path
    /// without glob characters.
    #[serde(default)]
    pub container_path: Option<String>,
    /// Cgroup device permissions, one or more of `r`, `w`, `m`.
    #[serde(default = "rw")]
    pub permissions: String,
    /// The device exists without this node (several paths only).
    #[serde(default)]
    pub optional: bool,
}

/// A host path mounted into the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountConfig {
    /// Absolute host path.
    pub host_path: String,
    /// Absolute path in the container.
    pub container_path: String,
    /// Mount read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// Why a generic device declaration is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenericConfigError {
    /// The resource name.
    #[error("devices.generic: {0}")]
    Resource(#[from] super::ResourceNameError),
    /// No `paths`.
    #[error("devices.generic {resource}: no paths")]
    NoPaths {
        /// The declaration.
        resource: String,
    },
    /// A path is not absolute under `/dev`, or climbs out of it.
    #[error(
        "devices.generic {resource}: path {path:?} must be an absolute path under /dev without '..'"
    )]
    PathNotUnderDev {
        /// The declaration.
        resource: String,
        /// The path.
        path: String,
    },
    /// Permissions other than one or more of `r`, `w`, `m`.
    #[error(
        "devices.generic {resource}: permissions {permissions:?} of {path} must be one or more of r, w, m"
    )]
    BadPermissions {
        /// The declaration.
        resource: String,
        /// The path.
        path: String,
        /// What was written.
        permissions: String,
    },
    /// `container_path` on a glob, or not absolute.
    #[error(
        "devices.generic {resource}: container_path {container_path:?} of {path}: only for a path without glob characters, and absolute"
    )]
    BadContainerPath {
        /// The declaration.
        resource: String,
        /// The path.
        path: String,
        /// What was written.
        container_path: String,
    },
    /// `optional` on the only path.
    #[error("devices.generic {resource}: optional needs more than one path")]
    OptionalAlone {
        /// The declaration.
        resource: String,
    },
    /// `shares` is 0 or too large.
    #[error("devices.generic {resource}: shares must be 1 to {max}, not {shares}", max = crate::rdma::MAX_SHARES)]
    BadShares {
        /// The declaration.
        resource: String,
        /// What was written.
        shares: u32,
    },
    /// An environment variable name that is not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error("devices.generic {resource}: env name {name:?} is not [A-Za-z_][A-Za-z0-9_]*")]
    BadEnvName {
        /// The declaration.
        resource: String,
        /// The name.
        name: String,
    },
    /// A mount path that is not absolute.
    #[error(
        "devices.generic {resource}: mount paths must be absolute ({host_path:?} -> {container_path:?})"
    )]
    RelativeMount {
        /// The declaration.
        resource: String,
        /// Host path.
        host_path: String,
        /// Container path.
        container_path: String,
    },
}

/// Whether `s` has glob characters.
fn has_glob(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

impl GenericDeviceConfig {
    /// Checks the declaration.
    pub fn validate(&self) -> Result<(), GenericConfigError> {
        super::check_resource_name(&self.resource)?;
        let resource = || self.resource.clone();
        if self.paths.is_empty() {
            return Err(GenericConfigError::NoPaths {
                resource: resource(),
            });
        }
        if self.shares == 0 || self.shares > crate::rdma::MAX_SHARES {
            return Err(GenericConfigError::BadShares {
                resource: resource(),
                shares: self.shares,
            });
        }
        for p in &self.paths {
            if relative_to_dev(&p.path).is_none() {
                return Err(GenericConfigError::PathNotUnderDev {
                    resource: resource(),
                    path: p.path.clone(),
                });
            }
            if p.permissions.is_empty() || !p.permissions.chars().all(|c| "rwm".contains(c)) {
                return Err(GenericConfigError::BadPermissions {
                    resource: resource(),
                    path: p.path.clone(),
                    permissions: p.permissions.clone(),
                });
            }
            if let Some(c) = &p.container_path
                && (has_glob(&p.path) || !c.starts_with('/'))
            {
                return Err(GenericConfigError::BadContainerPath {
                    resource: resource(),
                    path: p.path.clone(),
                    container_path: c.clone(),
                });
            }
            if p.optional && self.paths.len() == 1 {
                return Err(GenericConfigError::OptionalAlone {
                    resource: resource(),
                });
            }
        }
        for name in self.envs.keys() {
            let mut bytes = name.bytes();
            let first_ok = bytes
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
            if !first_ok || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(GenericConfigError::BadEnvName {
                    resource: resource(),
                    name: name.clone(),
                });
            }
        }
        for m in &self.mounts {
            if !m.host_path.starts_with('/') || !m.container_path.starts_with('/') {
                return Err(GenericConfigError::RelativeMount {
                    resource: resource(),
                    host_path: m.host_path.clone(),
                    container_path: m.container_path.clone(),
                });
            }
        }
        Ok(())
    }
}

/// `/dev/snd/*` as `snd/*`; `None` when not under `/dev` or climbing with `..`.
fn relative_to_dev(path: &str) -> Option<&str> {
    let rel = path.strip_prefix("/dev/")?;
    if rel.is_empty()
        || rel
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return None;
    }
    Some(rel)
}

/// One device node of a generic device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceNode {
    /// Host path (`/dev/ttyUSB0`), whatever the dev root this process reads.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Cgroup permissions.
    pub permissions: String,
}

/// One generic device found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GenericDevice {
    /// The resource it is offered as.
    pub resource: String,
    /// Its id (the first node's path under `/dev`, `/` as `_`: `ttyUSB0`, `snd_controlC0`).
    pub id: String,
    /// Its nodes.
    pub nodes: Vec<DeviceNode>,
    /// Pods per device.
    pub shares: u32,
    /// Environment handed over with it.
    pub envs: BTreeMap<String, String>,
    /// Mounts handed over with it.
    pub mounts: Vec<MountConfig>,
}

impl GenericDevice {
    /// The device ids the device plugin advertises for it: `<id>-_-<n>`, one per share
    /// (the separator of gpushare's fake GPU ids).
    pub fn share_ids(&self) -> Vec<String> {
        (0..u64::from(self.shares))
            .map(|n| wire::fake_device_id(&self.id, n))
            .collect()
    }
}

/// The devices `decl` (already validated) finds under `dev_root`, ordered by id.
pub fn discover(decl: &GenericDeviceConfig, dev_root: &Path) -> Vec<GenericDevice> {
    let matches: Vec<(&DevicePathConfig, Vec<String>)> = decl
        .paths
        .iter()
        .map(|p| {
            let found = relative_to_dev(&p.path)
                .map(|rel| glob_under(dev_root, rel))
                .unwrap_or_default();
            (p, found)
        })
        .collect();
    let node = |p: &DevicePathConfig, rel: &str| DeviceNode {
        host_path: format!("/dev/{rel}"),
        container_path: p
            .container_path
            .clone()
            .unwrap_or_else(|| format!("/dev/{rel}")),
        permissions: p.permissions.clone(),
    };
    let device = |nodes: Vec<DeviceNode>, first: &str| GenericDevice {
        resource: decl.resource.clone(),
        id: first.replace('/', "_"),
        nodes,
        shares: decl.shares,
        envs: decl.envs.clone(),
        mounts: decl.mounts.clone(),
    };
    let mut out = Vec::new();
    if let [(p, found)] = matches.as_slice() {
        for rel in found {
            out.push(device(vec![node(p, rel)], rel));
        }
    } else {
        if matches.iter().any(|(p, f)| !p.optional && f.is_empty()) {
            return out;
        }
        let mut nodes = Vec::new();
        let mut first = None;
        for (p, found) in &matches {
            for rel in found {
                first.get_or_insert(rel.clone());
                nodes.push(node(p, rel));
            }
        }
        if let Some(first) = first {
            out.push(device(nodes, &first));
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

/// The paths under `root` matching `pattern` (relative, `/`-separated, globs within a
/// component), relative to `root`, sorted; directories are not device nodes and never match.
fn glob_under(root: &Path, pattern: &str) -> Vec<String> {
    let mut current: Vec<String> = vec![String::new()];
    let parts: Vec<&str> = pattern.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let mut next = Vec::new();
        for base in &current {
            let dir = root.join(base);
            let join = |name: &str| {
                if base.is_empty() {
                    name.to_string()
                } else {
                    format!("{base}/{name}")
                }
            };
            if has_glob(part) {
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if glob_match(part.as_bytes(), name.as_bytes()) {
                        next.push(join(&name));
                    }
                }
            } else {
                next.push(join(part));
            }
        }
        current = next
            .into_iter()
            .filter(|rel| {
                let p = root.join(rel);
                if last {
                    p.exists() && !p.is_dir()
                } else {
                    p.is_dir()
                }
            })
            .collect();
    }
    current.sort();
    current.dedup();
    current
}

/// Shell-style match of one path component: `*`, `?`, `[abc]`, `[a-z]`, `[!x]` / `[^x]`.
/// A leading `.` is matched only by a literal `.`.
fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    if name.first() == Some(&b'.') && pattern.first() != Some(&b'.') {
        return false;
    }
    glob_from(pattern, name)
}

/// Iterative matching with one backtrack point (the last `*`): linear in practice, never
/// exponential whatever the pattern.
fn glob_from(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        let step = match pattern.get(p) {
            Some(b'*') => {
                star = Some((p + 1, n));
                p += 1;
                continue;
            }
            Some(b'?') => Some(p + 1),
            Some(b'[') => match class_match(&pattern[p + 1..], name[n]) {
                Some((true, after)) => Some(pattern.len() - after.len()),
                Some((false, _)) => None,
                // No closing `]`: a literal `[`.
                None => (name[n] == b'[').then_some(p + 1),
            },
            Some(&c) => (name[n] == c).then_some(p + 1),
            None => None,
        };
        match (step, star) {
            (Some(next), _) => {
                p = next;
                n += 1;
            }
            (None, Some((sp, sn))) => {
                p = sp;
                n = sn + 1;
                star = Some((sp, sn + 1));
            }
            (None, None) => return false,
        }
    }
    pattern[p..].iter().all(|&b| b == b'*')
}

/// Matches `c` against the class starting after `[`; the match and the pattern after `]`.
fn class_match(class: &[u8], c: u8) -> Option<(bool, &[u8])> {
    let (negate, mut i) = match class.first() {
        Some(b'!' | b'^') => (true, 1),
        _ => (false, 0),
    };
    let mut hit = false;
    let mut first = true;
    while i < class.len() {
        let b = class[i];
        if b == b']' && !first {
            return Some((hit != negate, &class[i + 1..]));
        }
        first = false;
        if i + 2 < class.len() && class[i + 1] == b'-' && class[i + 2] != b']' {
            hit |= (b..=class[i + 2]).contains(&c);
            i += 3;
        } else {
            hit |= b == c;
            i += 1;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_the_shell() {
        let m = |p: &str, n: &str| glob_match(p.as_bytes(), n.as_bytes());
        assert!(m("ttyUSB*", "ttyUSB0"));
        assert!(m("ttyUSB*", "ttyUSB"));
        assert!(!m("ttyUSB*", "ttyACM0"));
        assert!(m("video?", "video1"));
        assert!(!m("video?", "video10"));
        assert!(m("nvme[0-9]", "nvme3"));
        assert!(!m("nvme[!0-3]", "nvme3"));
        assert!(m("nvme[!0-3]", "nvme7"));
        assert!(m("a[]]b", "a]b"));
        assert!(m("a[b", "a[b"));
        assert!(!m("*", ".hidden"));
        assert!(m(".h*", ".hidden"));
        assert!(m("a*b*c", "axxbyyc"));
        assert!(!m("a*b*c", "axxbyy"));
        assert!(m("*[0-9]", "ttyUSB12"));
        // A pathological pattern answers at once.
        let stars = "*a".repeat(40) + "b";
        assert!(!m(&stars, &"a".repeat(200)));
    }

    proptest::proptest! {
        #[test]
        fn glob_never_panics_and_a_literal_matches_only_itself(
            pattern in "[a-z*?\\[\\]!^-]{0,12}",
            name in "[a-z\\[\\]]{0,12}",
        ) {
            let _ = glob_match(pattern.as_bytes(), name.as_bytes());
            if !has_glob(&name) {
                proptest::prop_assert!(glob_match(name.as_bytes(), name.as_bytes()));
            }
        }
    }

    #[test]
    fn paths_must_stay_under_dev() {
        assert_eq!(relative_to_dev("/dev/snd/*"), Some("snd/*"));
        for bad in [
            "/dev/",
            "/dev/../etc/shadow",
            "dev/fuse",
            "/sys/x",
            "/dev//x",
            "/dev/./x",
        ] {
            assert_eq!(relative_to_dev(bad), None, "{bad}");
        }
    }
}
