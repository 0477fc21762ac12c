//! The records `gpushare cdi-hook memory-limit` leaves in the state directory, one file per
//! container (`<container id>.json`): which pod and container it is (from the bundle's CRI
//! annotations), its cgroup (the path in the hierarchy, so the node agent can join its own
//! view of the root), and the limit set on each GPU. The node agent reads them back
//! ([`super::readback`]) and removes a record once its cgroup is gone.
//!
//! Files are replaced atomically (a temporary file in the directory, renamed), so a reader
//! never sees half a record. It does not set or read any limit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One container's limits, as the hook set them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LimitRecord {
    /// The runtime's container id (the OCI state's `id`).
    pub container_id: String,
    /// The pod's namespace (empty when the runtime did not say).
    #[serde(default)]
    pub namespace: String,
    /// The pod's name.
    #[serde(default)]
    pub pod: String,
    /// The pod's UID.
    #[serde(default)]
    pub pod_uid: String,
    /// The container's name.
    #[serde(default)]
    pub container: String,
    /// The container's cgroup in the hierarchy (`/kubepods.slice/…/cri-containerd-<id>.scope`).
    pub cgroup: String,
    /// Bytes (soft = hard) by GPU UUID.
    pub limits: BTreeMap<String, u64>,
}

/// Why a record could not be written.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The container id cannot name a file.
    #[error("container id {0:?} cannot name a record (expected letters, digits, '-', '_', '.')")]
    BadId(String),
    /// The file system refused.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 200
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The record file of container `id` in `dir`.
pub fn path_of(dir: &Path, id: &str) -> Result<PathBuf, RecordError> {
    if !valid_id(id) {
        return Err(RecordError::BadId(id.to_string()));
    }
    Ok(dir.join(format!("{id}.json")))
}

/// Reads container `id`'s record, `None` when there is none (or it cannot be read).
pub fn read(dir: &Path, id: &str) -> Option<LimitRecord> {
    let path = path_of(dir, id).ok()?;
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Writes `record` (replacing the container's previous one).
pub fn write(dir: &Path, record: &LimitRecord) -> Result<PathBuf, RecordError> {
    let path = path_of(dir, &record.container_id)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RecordError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let text = serde_json::to_vec_pretty(record).map_err(|e| RecordError::Io {
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".record.")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io(dir))?;
    std::io::Write::write_all(&mut tmp, &text).map_err(io(tmp.path()))?;
    tmp.as_file().sync_all().map_err(io(tmp.path()))?;
    tmp.persist(&path).map_err(|e| RecordError::Io {
        path: path.clone(),
        source: e.error,
    })?;
    Ok(path)
}

/// Removes container `id`'s record; one already gone is fine.
pub fn remove(dir: &Path, id: &str) -> Result<(), RecordError> {
    let path = path_of(dir, id)?;
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RecordError::Io { path, source }),
    }
}

/// Every record in `dir`, by container id, and the files that could not be read (reported,
/// never fatal).
pub fn read_all(dir: &Path) -> (Vec<LimitRecord>, Vec<String>) {
    let mut records = Vec::new();
    let mut errors = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (records, errors);
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<LimitRecord>(&b).map_err(|e| e.to_string()))
        {
            Ok(r) => records.push(r),
            Err(e) => errors.push(format!("{}: {e}", path.display())),
        }
    }
    records.sort_by(|a, b| a.container_id.cmp(&b.container_id));
    (records, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_refuse_bad_ids() {
        let dir = tempfile::tempdir().expect("dir");
        let record = LimitRecord {
            container_id: "abc123".into(),
            namespace: "d".into(),
            pod: "p".into(),
            container: "c".into(),
            cgroup: "/kubepods/pod1/abc123".into(),
            limits: BTreeMap::from([("GPU-1".to_string(), 4 << 30)]),
            ..LimitRecord::default()
        };
        write(dir.path(), &record).expect("written");
        assert_eq!(read(dir.path(), "abc123"), Some(record.clone()));
        std::fs::write(dir.path().join("junk.json"), "{").expect("junk");
        let (all, errors) = read_all(dir.path());
        assert_eq!(all, [record]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        remove(dir.path(), "abc123").expect("removed");
        remove(dir.path(), "abc123").expect("gone is fine");
        assert!(matches!(
            write(
                dir.path(),
                &LimitRecord {
                    container_id: "../x".into(),
                    ..LimitRecord::default()
                }
            ),
            Err(RecordError::BadId(_))
        ));
    }
}
