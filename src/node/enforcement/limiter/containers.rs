//! The limiter's per-container files on the host, under `[node] limiter_run_dir` (a tmpfs):
//! one directory per served container, named by its [`Key`], holding
//!
//! - `limits`: the container's limits (`gpushare_limiter_contract::Limits`), mounted
//!   read-only at `/usr/local/gpushare/limits`;
//! - `state/`: the container's ledgers (mode `1777`: its processes may run as any user),
//!   mounted read-write at `/usr/local/gpushare/state`;
//! - `owner.json`: whose they are ([`Owner`]; the node agent's own, never mounted).
//!
//! [`create`] writes them before the container is answered (Allocate, or the claim's CDI
//! spec), every file replaced atomically, the state directory kept when it exists (kubelet
//! asking again for the same container must not drop its processes' ledgers); [`mounts`] names
//! what the container gets; [`remove`] and [`list`] serve the cleanup.
//!
//! It does not decide when a container is gone ([`super::usage`] does) or read ledgers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpushare_limiter_contract::{GpuUuid, Limits};
use serde::{Deserialize, Serialize};

use super::library::{installed_path, preload_path, replace_file};
use crate::node::contract::MountEdit;

/// The limits file's name in a container's directory.
pub const LIMITS_FILE: &str = "limits";
/// The state directory's name in a container's directory.
pub const STATE_DIR: &str = "state";
/// The owner file's name in a container's directory.
pub const OWNER_FILE: &str = "owner.json";

/// The name of one container's directory: `dp-<pod uid>-<container>` (device plugin),
/// `dp-any-<hash of the device ids>` (the device plugin's single-GPU fallback, whose pod is
/// not known), `dra-<claim uid>-<share>` (one GPU share of a DRA claim).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(String);

/// Why a key cannot name a directory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} cannot name a container's limiter directory (letters, digits, '-', '_', '.')")]
pub struct BadKey(pub String);

impl Key {
    /// A key from its text, checked: letters, digits, `-`, `_`, `.`, not starting with `.`.
    pub fn parse(text: &str) -> Result<Key, BadKey> {
        let ok = !text.is_empty()
            && text.len() <= 200
            && !text.starts_with('.')
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if ok {
            Ok(Key(text.to_string()))
        } else {
            Err(BadKey(text.chars().take(80).collect()))
        }
    }

    /// A device-plugin container of a known pod.
    pub fn device_plugin(pod_uid: &str, container: &str) -> Result<Key, BadKey> {
        Key::parse(&format!("dp-{pod_uid}-{container}"))
    }

    /// A device-plugin container whose pod is not known, by its device ids.
    pub fn device_plugin_unmatched(device_ids: &[String]) -> Key {
        let mut ids = device_ids.to_vec();
        ids.sort();
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for id in &ids {
            for b in id.bytes().chain([0]) {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        Key(format!("dp-any-{h:016x}"))
    }

    /// The prefix of every key of DRA claim `claim_uid`.
    pub fn dra_prefix(claim_uid: &str) -> String {
        format!("dra-{claim_uid}-")
    }

    /// Share `share` of DRA claim `claim_uid`.
    pub fn dra(claim_uid: &str, share: usize) -> Result<Key, BadKey> {
        Key::parse(&format!("{}{share}", Key::dra_prefix(claim_uid)))
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whose a container's directory is: what the node agent knows of the container when it
/// creates it, and what the readback learns later (a DRA share's pod and container).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    /// `device-plugin` or `dra`.
    pub path: String,
    /// The pod's namespace (empty while unknown).
    #[serde(default)]
    pub namespace: String,
    /// The pod's name (empty while unknown).
    #[serde(default)]
    pub pod: String,
    /// The pod's UID (empty while unknown).
    #[serde(default)]
    pub pod_uid: String,
    /// The container's name (empty while unknown).
    #[serde(default)]
    pub container: String,
    /// The device plugin's fake device ids (the single-GPU fallback's only name for it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_ids: Vec<String>,
    /// The DRA claim's UID.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub claim_uid: String,
    /// The DRA claim's request the share serves.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request: String,
    /// The limit per GPU UUID, in bytes (what the limits file says).
    pub limits: BTreeMap<String, u64>,
}

/// `device-plugin` in [`Owner::path`].
pub const PATH_DEVICE_PLUGIN: &str = "device-plugin";
/// `dra` in [`Owner::path`].
pub const PATH_DRA: &str = "dra";

/// Why a container's files could not be written.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// A GPU UUID the limits file cannot name.
    #[error("GPU {uuid}: the limiter names GPUs by UUID and cannot name this one: {source}")]
    Uuid {
        /// The UUID.
        uuid: String,
        /// Why.
        #[source]
        source: gpushare_limiter_contract::UuidError,
    },
    /// The file system refused.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The host paths of one container's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerFiles {
    /// Its directory.
    pub dir: PathBuf,
    /// Its limits file.
    pub limits: PathBuf,
    /// Its state directory.
    pub state: PathBuf,
}

/// The files of container `key` under `run_dir`.
pub fn files(run_dir: &Path, key: &Key) -> ContainerFiles {
    let dir = run_dir.join(key.as_str());
    ContainerFiles {
        limits: dir.join(LIMITS_FILE),
        state: dir.join(STATE_DIR),
        dir,
    }
}

/// The limits file's text for `owner.limits`.
pub fn limits_of(owner: &Owner) -> Result<Limits, CreateError> {
    let mut limits = Limits::new();
    for (uuid, bytes) in &owner.limits {
        let parsed = GpuUuid::parse(uuid).map_err(|source| CreateError::Uuid {
            uuid: uuid.clone(),
            source,
        })?;
        limits.set(parsed, *bytes);
    }
    Ok(limits)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CreateError + '_ {
    move |source| CreateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes container `key`'s directory under `run_dir`: its limits file from `owner.limits`,
/// its state directory (kept when it exists), its owner file. Blocking.
pub fn create(run_dir: &Path, key: &Key, owner: &Owner) -> Result<ContainerFiles, CreateError> {
    let limits = limits_of(owner)?;
    let f = files(run_dir, key);
    std::fs::create_dir_all(&f.dir).map_err(io(&f.dir))?;
    replace_file(&f.dir, LIMITS_FILE, limits.render().as_bytes(), 0o644).map_err(io(&f.limits))?;
    match std::fs::create_dir(&f.state) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(&f.state)(e)),
    }
    // Every user the container's processes run as records its use there; sticky, as /tmp.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f.state, std::fs::Permissions::from_mode(0o1777))
            .map_err(io(&f.state))?;
    }
    write_owner(run_dir, key, owner)?;
    Ok(f)
}

/// Replaces container `key`'s owner file.
pub fn write_owner(run_dir: &Path, key: &Key, owner: &Owner) -> Result<(), CreateError> {
    let dir = run_dir.join(key.as_str());
    let text = serde_json::to_vec_pretty(owner).map_err(|e| CreateError::Io {
        path: dir.join(OWNER_FILE),
        source: std::io::Error::other(e),
    })?;
    replace_file(&dir, OWNER_FILE, &text, 0o644).map_err(io(&dir.join(OWNER_FILE)))?;
    Ok(())
}

/// What a container served by the limiter gets mounted: the preload list and the library
/// installed in `limiter_dir`, its own limits file (read-only) and state directory.
pub fn mounts(limiter_dir: &Path, container: &ContainerFiles) -> Vec<MountEdit> {
    use gpushare_limiter_contract as c;
    let m = |host: &Path, at: &str, read_only| MountEdit {
        container_path: at.to_string(),
        host_path: host.display().to_string(),
        read_only,
    };
    vec![
        m(&installed_path(limiter_dir), c::LIBRARY_PATH, true),
        m(&container.limits, c::LIMITS_PATH, true),
        m(&container.state, c::STATE_DIR, false),
        m(&preload_path(limiter_dir), c::PRELOAD_PATH, true),
    ]
}

/// Removes container `key`'s directory (gone is fine). Links the container planted in its
/// state directory are removed, never followed.
pub fn remove(run_dir: &Path, key: &Key) -> std::io::Result<()> {
    match std::fs::remove_dir_all(run_dir.join(key.as_str())) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Container `key`'s owner, when its directory and owner file are there.
pub fn list_one(run_dir: &Path, key: &Key) -> Option<(Key, Owner)> {
    let text = std::fs::read(run_dir.join(key.as_str()).join(OWNER_FILE)).ok()?;
    Some((key.clone(), serde_json::from_slice(&text).ok()?))
}

/// Every container directory under `run_dir` with its owner, in key order, and the entries
/// that could not be read (reported, never fatal). A missing `run_dir` holds none.
pub fn list(run_dir: &Path) -> (Vec<(Key, Owner)>, Vec<String>) {
    let mut found = Vec::new();
    let mut errors = Vec::new();
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return (found, errors);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(key) = Key::parse(&name) else {
            continue;
        };
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path().join(OWNER_FILE);
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Owner>(&b).map_err(|e| e.to_string()))
        {
            Ok(owner) => found.push((key, owner)),
            Err(e) => errors.push(format!("{}: {e}", path.display())),
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    (found, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: &str = "GPU-00000000-0000-0000-0000-000000000001";

    fn owner(bytes: u64) -> Owner {
        Owner {
            path: PATH_DEVICE_PLUGIN.into(),
            namespace: "default".into(),
            pod: "p".into(),
            pod_uid: "6f0c5a52-8bd3-4c2e-9a55-2f7b1f0c0a11".into(),
            container: "main".into(),
            limits: BTreeMap::from([(GPU.to_string(), bytes)]),
            ..Owner::default()
        }
    }

    #[test]
    fn a_containers_files_are_written_and_listed_and_the_state_survives_a_repeat() {
        use std::os::unix::fs::PermissionsExt;
        let run = tempfile::tempdir().expect("dir");
        let o = owner(4 << 30);
        let key = Key::device_plugin(&o.pod_uid, &o.container).expect("key");
        let f = create(run.path(), &key, &o).expect("created");
        let limits = std::fs::read_to_string(&f.limits).expect("limits");
        assert_eq!(
            Limits::parse(&limits)
                .expect("parses")
                .get(&GpuUuid::parse(GPU).expect("uuid")),
            Some(4 << 30)
        );
        let mode = std::fs::metadata(&f.state)
            .expect("state")
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o1777);
        std::fs::write(f.state.join("x.ledger"), b"kept").expect("a ledger");
        create(run.path(), &key, &o).expect("again");
        assert!(
            f.state.join("x.ledger").exists(),
            "kubelet asking again keeps the ledgers"
        );
        let (all, errors) = list(run.path());
        assert_eq!(all, vec![(key.clone(), o)]);
        assert!(errors.is_empty(), "{errors:?}");
        remove(run.path(), &key).expect("removed");
        remove(run.path(), &key).expect("gone is fine");
        assert!(list(run.path()).0.is_empty());
    }

    #[test]
    fn the_mounts_are_the_contracts_paths() {
        let f = files(Path::new("/run/l"), &Key::dra("c1", 0).expect("key"));
        let got: Vec<(String, String, bool)> = mounts(Path::new("/var/lib/l"), &f)
            .into_iter()
            .map(|m| (m.container_path, m.host_path, m.read_only))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "/usr/local/gpushare/lib/libgpushare_limiter.so".to_string(),
                    "/var/lib/l/libgpushare_limiter.so".to_string(),
                    true
                ),
                (
                    "/usr/local/gpushare/limits".into(),
                    "/run/l/dra-c1-0/limits".into(),
                    true
                ),
                (
                    "/usr/local/gpushare/state".into(),
                    "/run/l/dra-c1-0/state".into(),
                    false
                ),
                (
                    "/etc/ld.so.preload".into(),
                    "/var/lib/l/ld.so.preload".into(),
                    true
                ),
            ]
        );
    }

    #[test]
    fn keys_refuse_what_cannot_name_a_directory_and_bad_uuids_are_refused() {
        assert!(Key::parse("../x").is_err());
        assert!(Key::parse(".hidden").is_err());
        assert!(Key::device_plugin("uid/..", "c").is_err());
        let a = Key::device_plugin_unmatched(&["b".into(), "a".into()]);
        let b = Key::device_plugin_unmatched(&["a".into(), "b".into()]);
        assert_eq!(a, b, "the order of the ids does not matter");
        assert!(a.as_str().starts_with("dp-any-"));
        let mut o = owner(1);
        o.limits = BTreeMap::from([("GPU-fake-0".to_string(), 1)]);
        let run = tempfile::tempdir().expect("dir");
        assert!(matches!(
            create(run.path(), &Key::dra("c", 0).expect("key"), &o),
            Err(CreateError::Uuid { .. })
        ));
    }
}
