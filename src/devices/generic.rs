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

use serde::Serialize;

use crate::core::wire;

pub use crate::config::devices::{
    DevicePathConfig, GenericConfigError, GenericDeviceConfig, MountConfig,
};
use crate::config::devices::{has_glob, relative_to_dev};

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
