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
//! The writer ([`TransientSpec`], [`write_spec`], [`remove_spec`]) writes the transient
//! per-claim specs a DRA kubelet plugin hands its containers: `cdiVersion`, `kind` and
//! `devices`, each with `containerEdits` (`env`, `deviceNodes`, `mounts`, `hooks`), as JSON, atomically
//! (a temporary file in the same directory, synced, then renamed over the name), so a runtime
//! never reads half a spec. Removing one that is gone is no error.
//!
//! Why not the `container-device-interface` crate: it links jsonschema, oci-spec, clap and the
//! unmaintained serde_yaml into the shipped binary, and builds a runtime-side cache with
//! file watching, for the few fields used here. This module does no watching; a file that
//! cannot be read or parsed is reported, and the other files still count.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// The `cdiVersion` of the specs [`write_spec`] writes: the fields it uses (env, device
/// nodes, mounts) are all in 0.3.0; 0.5.0 is what nvidia-ctk writes and every CDI-capable
/// containerd and CRI-O reads.
pub const WRITE_CDI_VERSION: &str = "0.5.0";

/// A device node of a written spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNodeEdit {
    /// Path in the container (`/dev/nvidia0`).
    pub path: String,
    /// Path on the host, when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// cgroup permissions (`rw`, `rwm`), when not the runtime's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// A mount of a written spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiMount {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mount options (`bind`, `ro`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// An OCI hook of a written spec (the runtime runs `path` with `args`, argv\[0\] included, and
/// the container's OCI state on stdin, at the stage `hook_name` names).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiHook {
    /// The OCI stage: `createRuntime`, `createContainer`, `startContainer`, `poststart`,
    /// `poststop` (or the old `prestart`).
    pub hook_name: String,
    /// The program, an absolute path in the runtime's namespace.
    pub path: String,
    /// Its arguments, argv\[0\] first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Its whole environment (`NAME=value`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Seconds the runtime lets it run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u32>,
}

/// The OCI hook stages a CDI spec may name.
const HOOK_STAGES: &[&str] = &[
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// The `containerEdits` of one written device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEditsSpec {
    /// `NAME=value` environment entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNodeEdit>,
    /// Mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<CdiMount>,
    /// OCI hooks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<CdiHook>,
}

/// One device of a written spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSpecEdit {
    /// The device name (what `<kind>=<name>` resolves).
    pub name: String,
    /// What the runtime applies to a container that asks for it.
    pub container_edits: ContainerEditsSpec,
}

/// A transient spec: one claim's devices, written for the runtime and removed when the claim
/// is released.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TransientSpec {
    /// `cdiVersion` ([`WRITE_CDI_VERSION`]).
    pub cdi_version: String,
    /// `<vendor>/<class>`.
    pub kind: String,
    /// The devices.
    pub devices: Vec<DeviceSpecEdit>,
}

impl TransientSpec {
    /// An empty spec of `kind` at [`WRITE_CDI_VERSION`].
    pub fn new(kind: &str) -> TransientSpec {
        TransientSpec {
            cdi_version: WRITE_CDI_VERSION.to_string(),
            kind: kind.to_string(),
            devices: Vec::new(),
        }
    }
}

/// Why a spec was not written or removed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The spec or its name breaks a rule of the CDI specification.
    #[error("not a valid CDI spec to write: {0}")]
    Invalid(String),
    /// The file system refused.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The file name (without directory) of the transient spec `id` of `kind`:
/// `<vendor>_<class>_<id>.json`, as the CDI tooling names transient specs. `id` (a claim
/// UID) may hold alphanumerics, `-`, `_` and `.`.
pub fn transient_spec_file(kind: &str, id: &str) -> Result<String, WriteError> {
    if !crate::config::valid_cdi_kind(kind) {
        return Err(WriteError::Invalid(format!(
            "kind {kind:?}: expected <vendor>/<class>"
        )));
    }
    let id_ok = !id.is_empty()
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !id_ok {
        return Err(WriteError::Invalid(format!(
            "spec id {id:?}: expected alphanumerics, '-', '_' or '.'"
        )));
    }
    Ok(format!("{}_{id}.json", kind.replace('/', "_")))
}

/// Writes `spec` as `<dir>/<transient_spec_file(kind, id)>` atomically (a synced temporary
/// file in `dir`, renamed over the name); returns the path written. `dir` is created when
/// missing.
pub fn write_spec(dir: &Path, id: &str, spec: &TransientSpec) -> Result<PathBuf, WriteError> {
    let name = transient_spec_file(&spec.kind, id)?;
    if !known_version(&spec.cdi_version) {
        return Err(WriteError::Invalid(format!(
            "cdiVersion {:?}",
            spec.cdi_version
        )));
    }
    for (i, d) in spec.devices.iter().enumerate() {
        if !valid_device_name(&d.name) {
            return Err(WriteError::Invalid(format!(
                "device name {:?} is not valid",
                d.name
            )));
        }
        if spec.devices[..i].iter().any(|x| x.name == d.name) {
            return Err(WriteError::Invalid(format!(
                "device {:?} is defined twice",
                d.name
            )));
        }
        if let Some(bad) = d.container_edits.env.iter().find(|e| !e.contains('=')) {
            return Err(WriteError::Invalid(format!(
                "env entry {bad:?} of device {:?} is not NAME=value",
                d.name
            )));
        }
        for hook in &d.container_edits.hooks {
            if !HOOK_STAGES.contains(&hook.hook_name.as_str()) || !hook.path.starts_with('/') {
                return Err(WriteError::Invalid(format!(
                    "hook {:?} at {:?} of device {:?}: expected an OCI stage and an absolute path",
                    hook.hook_name, hook.path, d.name
                )));
            }
        }
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| WriteError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let text = serde_json::to_vec_pretty(spec)
        .map_err(|e| WriteError::Invalid(format!("cannot encode: {e}")))?;
    let target = dir.join(&name);
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io(dir))?;
    std::io::Write::write_all(&mut tmp, &text).map_err(io(tmp.path()))?;
    tmp.as_file().sync_all().map_err(io(tmp.path()))?;
    tmp.persist(&target).map_err(|e| WriteError::Io {
        path: target.clone(),
        source: e.error,
    })?;
    Ok(target)
}

/// Removes the transient spec `id` of `kind` from `dir`; one already gone is no error.
pub fn remove_spec(dir: &Path, kind: &str, id: &str) -> Result<(), WriteError> {
    let path = dir.join(transient_spec_file(kind, id)?);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(WriteError::Io { path, source }),
    }
}

/// Removes the transient spec file at `path` (one recorded by a writer, in whatever directory
/// it was written to); a file already gone is no error.
pub fn remove_spec_file(path: &Path) -> Result<(), WriteError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(WriteError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The ids of the transient specs of `kind` present in `dir` (`<vendor>_<class>_<id>.json`),
/// sorted; none when `dir` cannot be read. Temporary files of a write in progress are not ids.
pub fn transient_spec_ids(dir: &Path, kind: &str) -> Vec<String> {
    let prefix = format!("{}_", kind.replace('/', "_"));
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut ids: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = name
                .strip_prefix(&prefix)?
                .strip_suffix(".json")?
                .to_string();
            transient_spec_file(kind, &id).ok().filter(|n| *n == name)?;
            Some(id)
        })
        .collect();
    ids.sort();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_spec_ids_lists_the_specs_of_one_kind() {
        let dir = tempfile::tempdir().expect("dir");
        let spec = TransientSpec::new("gpushare.io/gpu");
        write_spec(dir.path(), "uid-1", &spec).expect("written");
        write_spec(dir.path(), "uid-2", &spec).expect("written");
        write_spec(dir.path(), "x", &TransientSpec::new("nvidia.com/gpu")).expect("written");
        std::fs::write(dir.path().join(".gpushare.io_gpu_uid-3.json.tmp"), b"{}").expect("tmp");
        assert_eq!(
            transient_spec_ids(dir.path(), "gpushare.io/gpu"),
            ["uid-1", "uid-2"]
        );
        remove_spec_file(&dir.path().join("gpushare.io_gpu_uid-1.json")).expect("removed");
        remove_spec_file(&dir.path().join("gpushare.io_gpu_uid-1.json")).expect("gone is fine");
        assert_eq!(transient_spec_ids(dir.path(), "gpushare.io/gpu"), ["uid-2"]);
        assert!(transient_spec_ids(&dir.path().join("none"), "gpushare.io/gpu").is_empty());
    }

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

    fn claim_spec() -> TransientSpec {
        let mut spec = TransientSpec::new("gpushare.io/gpu-mem");
        spec.devices.push(DeviceSpecEdit {
            name: "claim-1.gpu-0".to_string(),
            container_edits: ContainerEditsSpec {
                env: vec![
                    "NVIDIA_VISIBLE_DEVICES=void".to_string(),
                    "ALIYUN_COM_GPU_MEM_IDX=0".to_string(),
                ],
                device_nodes: vec![DeviceNodeEdit {
                    path: "/dev/nvidia0".to_string(),
                    host_path: None,
                    permissions: Some("rw".to_string()),
                }],
                mounts: vec![CdiMount {
                    host_path: "/tmp/nvidia-mps".to_string(),
                    container_path: "/tmp/nvidia-mps".to_string(),
                    options: vec!["bind".to_string()],
                }],
                hooks: vec![CdiHook {
                    hook_name: "createRuntime".to_string(),
                    path: "/usr/local/bin/gpushare".to_string(),
                    args: vec!["gpushare".to_string(), "cdi-hook".to_string()],
                    env: vec!["PATH=/usr/bin".to_string()],
                    timeout: Some(30),
                }],
            },
        });
        spec
    }

    #[test]
    fn a_written_spec_reads_back_and_is_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cdi = dir.path().join("run-cdi");
        let spec = claim_spec();
        let path = write_spec(&cdi, "0f6c-uid", &spec).expect("written");
        assert_eq!(path, cdi.join("gpushare.io_gpu-mem_0f6c-uid.json"));
        // The reader (what doctor and Allocate use) finds the device and its node.
        let registry = Registry::read(Path::new("/"), std::slice::from_ref(&cdi));
        assert!(registry.errors.is_empty(), "{:?}", registry.errors);
        let (read, device) = registry
            .device("gpushare.io/gpu-mem", "claim-1.gpu-0")
            .expect("the device");
        assert_eq!(read.version, WRITE_CDI_VERSION);
        assert_eq!(device.device_nodes, ["/dev/nvidia0"]);
        // Every edit is on disk as the CDI specification spells it.
        let text = std::fs::read_to_string(&path).expect("readable");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        let edits = &json["devices"][0]["containerEdits"];
        assert_eq!(edits["env"][0], "NVIDIA_VISIBLE_DEVICES=void");
        assert_eq!(edits["deviceNodes"][0]["permissions"], "rw");
        assert_eq!(edits["mounts"][0]["hostPath"], "/tmp/nvidia-mps");
        assert_eq!(edits["mounts"][0]["containerPath"], "/tmp/nvidia-mps");
        assert_eq!(edits["hooks"][0]["hookName"], "createRuntime");
        assert_eq!(edits["hooks"][0]["path"], "/usr/local/bin/gpushare");
        assert_eq!(edits["hooks"][0]["args"][1], "cdi-hook");
        assert_eq!(edits["hooks"][0]["timeout"], 30);
        let back: TransientSpec = serde_json::from_str(&text).expect("round trip");
        assert_eq!(back, spec);
        // Rewriting replaces it whole, and leaves no temporary file behind.
        let mut smaller = spec.clone();
        smaller.devices[0].container_edits.mounts.clear();
        write_spec(&cdi, "0f6c-uid", &smaller).expect("rewritten");
        let names: Vec<_> = std::fs::read_dir(&cdi)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["gpushare.io_gpu-mem_0f6c-uid.json"]);
        let back: TransientSpec =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("readable")).expect("json");
        assert_eq!(back, smaller);
        remove_spec(&cdi, "gpushare.io/gpu-mem", "0f6c-uid").expect("removed");
        assert!(!path.exists());
        remove_spec(&cdi, "gpushare.io/gpu-mem", "0f6c-uid").expect("gone is no error");
    }

    #[test]
    fn the_writer_refuses_what_the_spec_forbids() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = claim_spec();
        for id in ["", "../x", "a/b", ".hidden"] {
            assert!(
                matches!(
                    write_spec(dir.path(), id, &spec),
                    Err(WriteError::Invalid(_))
                ),
                "{id:?}"
            );
        }
        let mut bad = spec.clone();
        bad.kind = "gpu-mem".to_string();
        assert!(write_spec(dir.path(), "c", &bad).is_err());
        let mut bad = spec.clone();
        bad.devices.push(bad.devices[0].clone());
        let err = write_spec(dir.path(), "c", &bad).expect_err("twice");
        assert!(err.to_string().contains("defined twice"), "{err}");
        let mut bad = spec.clone();
        bad.devices[0]
            .container_edits
            .env
            .push("NOVALUE".to_string());
        assert!(write_spec(dir.path(), "c", &bad).is_err());
        for (stage, path) in [("createRuntime", "gpushare"), ("preStart", "/bin/x")] {
            let mut bad = spec.clone();
            bad.devices[0].container_edits.hooks[0].hook_name = stage.to_string();
            bad.devices[0].container_edits.hooks[0].path = path.to_string();
            let err = write_spec(dir.path(), "c", &bad).expect_err("bad hook");
            assert!(err.to_string().contains("OCI stage"), "{err}");
        }
        let mut bad = spec;
        bad.devices[0].name = "-x".to_string();
        assert!(write_spec(dir.path(), "c", &bad).is_err());
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("dir").count(),
            0,
            "nothing written"
        );
    }
}
