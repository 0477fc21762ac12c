//! The node's CDI (Container Device Interface) specs, read as the runtimes read them: every
//! `*.json` and `*.yaml` file of the spec directories (`/etc/cdi`, `/var/run/cdi` by default;
//! a later directory wins over an earlier one for the same device), each a spec with a
//! `cdiVersion`, a `kind` (`<vendor>/<class>`, e.g. `nvidia.com/gpu`) and named `devices`.
//!
//! Only what gpushare needs is typed: the version, the kind, each device's name and its device
//! nodes (so doctor can tell a stale spec from a current one). Everything else in a spec
//! (hooks, mounts, env, annotations, intelRdt, …) is skipped, never refused: the runtime acts
//! on it, gpushare only names devices. The device plugin uses this to refuse an Allocate whose
//! GPU the runtime could not resolve; doctor uses it for its `cdi-specs` check.
//!
//! Why not the `container-device-interface` crate: it links jsonschema, oci-spec, clap and the
//! unmaintained serde_yaml into the shipped binary, and builds a runtime-side cache with
//! file watching, for the few fields read here. This module does no watching and writes
//! nothing; a file that cannot be read or parsed is reported, and the other files still count.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Spec files larger than this are reported and skipped (real ones are tens of KiB).
const MAX_SPEC_BYTES: u64 = 8 * 1024 * 1024;

/// One device of a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The device name (`0`, `GPU-…`, `all`).
    pub name: String,
    /// Paths of its device nodes in the container (`/dev/nvidia0`, `/dev/dri/card1`).
    pub device_nodes: Vec<String>,
}

/// One spec file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The file it came from (host path as given, under the root it was read from).
    pub path: PathBuf,
    /// Its `cdiVersion`.
    pub version: String,
    /// Its `kind`.
    pub kind: String,
    /// Its devices.
    pub devices: Vec<Device>,
}

/// Why a spec file did not count.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Larger than [`MAX_SPEC_BYTES`].
    #[error("{}: {bytes} bytes, more than a CDI spec should be; skipped", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
    },
    /// Not valid JSON / YAML, or a required field missing.
    #[error("{}: not a CDI spec: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// Parsed, but breaks a rule of the CDI specification.
    #[error("{}: invalid CDI spec: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The rule broken.
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    cdi_version: String,
    kind: String,
    #[serde(default)]
    devices: Vec<RawDevice>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawDevice {
    name: String,
    #[serde(default)]
    container_edits: RawEdits,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawEdits {
    #[serde(default)]
    device_nodes: Vec<RawNode>,
}

#[derive(Deserialize)]
struct RawNode {
    path: String,
}

/// Whether `version` is a CDI spec version this reader knows (0.3.0 up to 1.x; the spec only
/// adds fields within these, and unknown fields are skipped).
fn known_version(version: &str) -> bool {
    let parts: Vec<Option<u64>> = version
        .trim_start_matches('v')
        .split('.')
        .map(|p| p.parse().ok())
        .collect();
    match parts.as_slice() {
        [Some(0), Some(minor), Some(_)] => *minor >= 3,
        [Some(1), Some(_), Some(_)] => true,
        _ => false,
    }
}

/// A device name as the CDI specification allows: alphanumerics, `-`, `_`, `.`, `:`,
/// starting and ending with an alphanumeric.
pub(crate) fn valid_device_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

/// Parses one spec's text; `path` decides JSON (`.json`) or YAML (anything else) and names
/// the file in errors.
pub fn parse(path: &Path, text: &str) -> Result<Spec, SpecError> {
    let parse_error = |message: String| SpecError::Parse {
        path: path.to_path_buf(),
        message,
    };
    let raw: RawSpec = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(text).map_err(|e| parse_error(e.to_string()))?
    } else {
        yaml_serde::from_str(text).map_err(|e| parse_error(e.to_string()))?
    };
    let invalid = |message: String| SpecError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    if !known_version(&raw.cdi_version) {
        return Err(invalid(format!(
            "cdiVersion {:?} is not a CDI version this gpushare knows (0.3.0 to 1.x)",
            raw.cdi_version
        )));
    }
    if !crate::config::valid_cdi_kind(&raw.kind) {
        return Err(invalid(format!(
            "kind {:?}: expected <vendor>/<class>",
            raw.kind
        )));
    }
    let mut devices: Vec<Device> = Vec::with_capacity(raw.devices.len());
    for d in raw.devices {
        if !valid_device_name(&d.name) {
            return Err(invalid(format!("device name {:?} is not valid", d.name)));
        }
        if devices.iter().any(|x| x.name == d.name) {
            return Err(invalid(format!("device {:?} is defined twice", d.name)));
        }
        devices.push(Device {
            name: d.name,
            device_nodes: d
                .container_edits
                .device_nodes
                .into_iter()
                .map(|n| n.path)
                .collect(),
        });
    }
    Ok(Spec {
        path: path.to_path_buf(),
        version: raw.cdi_version,
        kind: raw.kind,
        devices,
    })
}

/// Every spec of some directories, and the files that did not count.
#[derive(Debug, Default)]
pub struct Registry {
    /// The directories read, in priority order (later wins), as given.
    pub dirs: Vec<PathBuf>,
    /// The specs, in reading order (directory order, then file name).
    pub specs: Vec<Spec>,
    /// The files that did not count, and why.
    pub errors: Vec<SpecError>,
}

impl Registry {
    /// Reads the spec files of `dirs` (missing directories are empty), each under `root`
    /// (`/` on the node, the host's root in a doctor run on a mounted host).
    pub fn read(root: &Path, dirs: &[PathBuf]) -> Registry {
        let mut registry = Registry {
            dirs: dirs.to_vec(),
            ..Registry::default()
        };
        for dir in dirs {
            let on_disk = root.join(dir.strip_prefix("/").unwrap_or(dir));
            let Ok(entries) = std::fs::read_dir(&on_disk) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.extension().is_some_and(|e| e == "json" || e == "yaml") && p.is_file()
                })
                .collect();
            files.sort();
            for file in files {
                let shown = dir.join(file.file_name().unwrap_or_default());
                match read_one(&file, &shown) {
                    Ok(spec) => registry.specs.push(spec),
                    Err(e) => registry.errors.push(e),
                }
            }
        }
        registry
    }

    /// The device `kind=name` the runtime would resolve (the last definition wins, as with the
    /// runtimes' priority of later directories), with its spec.
    pub fn device(&self, kind: &str, name: &str) -> Option<(&Spec, &Device)> {
        self.specs
            .iter()
            .rev()
            .filter(|s| s.kind == kind)
            .find_map(|s| s.devices.iter().find(|d| d.name == name).map(|d| (s, d)))
    }

    /// The device names of `kind`, each once, sorted.
    pub(crate) fn names_of_kind(&self, kind: &str) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .specs
            .iter()
            .filter(|s| s.kind == kind)
            .flat_map(|s| s.devices.iter().map(|d| d.name.as_str()))
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// The kinds seen, with the files declaring each.
    pub fn kinds(&self) -> BTreeMap<&str, Vec<&Path>> {
        let mut kinds: BTreeMap<&str, Vec<&Path>> = BTreeMap::new();
        for s in &self.specs {
            kinds.entry(s.kind.as_str()).or_default().push(&s.path);
        }
        kinds
    }

    /// The directories, comma-joined, for messages.
    pub(crate) fn dirs_text(&self) -> String {
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        dirs.join(", ")
    }
}

fn read_one(file: &Path, shown: &Path) -> Result<Spec, SpecError> {
    let bytes = std::fs::metadata(file)
        .map_err(|source| SpecError::Read {
            path: shown.to_path_buf(),
            source,
        })?
        .len();
    if bytes > MAX_SPEC_BYTES {
        return Err(SpecError::TooLarge {
            path: shown.to_path_buf(),
            bytes,
        });
    }
    let text = std::fs::read_to_string(file).map_err(|source| SpecError::Read {
        path: shown.to_path_buf(),
        source,
    })?;
    parse(shown, &text)
}

/// The fully qualified CDI device name `kind=name`.
pub(crate) fn qualified_name(kind: &str, name: &str) -> String {
    format!("{kind}={name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  env: [NVIDIA_VISIBLE_DEVICES=void]\n  hooks:\n  - hookName: createContainer\n    path: /usr/bin/nvidia-cdi-hook\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- name: GPU-abc\n  containerEdits:\n    deviceNodes: [{path: /dev/nvidia0}]\n- name: all\n";

    #[test]
    fn parses_names_nodes_and_skips_the_rest() {
        let spec = parse(Path::new("/etc/cdi/nvidia.yaml"), YAML).expect("parses");
        assert_eq!(spec.version, "0.5.0");
        assert_eq!(spec.kind, "nvidia.com/gpu");
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["0", "GPU-abc", "all"]);
        assert_eq!(spec.devices[0].device_nodes, ["/dev/nvidia0"]);
        assert!(spec.devices[2].device_nodes.is_empty());
    }

    #[test]
    fn json_is_json() {
        let json = r#"{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":[{"name":"1","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia1"}]}}]}"#;
        let spec = parse(Path::new("/var/run/cdi/x.json"), json).expect("parses");
        assert_eq!(spec.devices[0].name, "1");
        let broken = parse(Path::new("/var/run/cdi/x.json"), "{\"cdiVersion\": ");
        assert!(matches!(broken, Err(SpecError::Parse { .. })));
    }

    #[test]
    fn refuses_what_the_spec_forbids() {
        for (text, what) in [
            ("kind: nvidia.com/gpu\ndevices: []\n", "cdiVersion"),
            ("cdiVersion: 0.2.0\nkind: nvidia.com/gpu\n", "cdiVersion"),
            ("cdiVersion: 7.0.0\nkind: nvidia.com/gpu\n", "cdiVersion"),
            ("cdiVersion: 0.5.0\nkind: gpu\n", "kind"),
            (
                "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: a\n- name: a\n",
                "twice",
            ),
            (
                "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"-x\"\n",
                "name",
            ),
        ] {
            let err = parse(Path::new("/etc/cdi/a.yaml"), text).expect_err(text);
            assert!(err.to_string().contains(what), "{text}: {err}");
        }
    }

    #[test]
    fn versions() {
        for v in ["0.3.0", "0.5.0", "0.8.0", "1.0.0", "1.1.0"] {
            assert!(known_version(v), "{v}");
        }
        for v in ["", "0.2.0", "2.0.0", "1.0", "x.y.z"] {
            assert!(!known_version(v), "{v}");
        }
    }

    #[test]
    fn later_directories_win_and_bad_files_are_reported() {
        let root = tempfile::tempdir().expect("tempdir");
        let etc = root.path().join("etc/cdi");
        let run = root.path().join("var/run/cdi");
        std::fs::create_dir_all(&etc).expect("mkdir");
        std::fs::create_dir_all(&run).expect("mkdir");
        std::fs::write(etc.join("nvidia.yaml"), YAML).expect("write");
        std::fs::write(
            run.join("nvidia.json"),
            r#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"0","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia3"}]}}]}"#,
        )
        .expect("write");
        std::fs::write(run.join("broken.yaml"), "cdiVersion: [").expect("write");
        std::fs::write(run.join("notes.txt"), "not a spec").expect("write");
        let dirs = [PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")];
        let reg = Registry::read(root.path(), &dirs);
        assert_eq!(reg.specs.len(), 2);
        assert_eq!(reg.errors.len(), 1, "{:?}", reg.errors);
        assert!(
            reg.errors[0]
                .to_string()
                .contains("/var/run/cdi/broken.yaml")
        );
        let (spec, dev) = reg.device("nvidia.com/gpu", "0").expect("found");
        assert_eq!(spec.path, Path::new("/var/run/cdi/nvidia.json"));
        assert_eq!(dev.device_nodes, ["/dev/nvidia3"]);
        assert!(reg.device("nvidia.com/gpu", "GPU-abc").is_some());
        assert!(reg.device("example.com/gpu", "0").is_none());
        assert_eq!(reg.names_of_kind("nvidia.com/gpu"), ["0", "GPU-abc", "all"]);
    }
}
