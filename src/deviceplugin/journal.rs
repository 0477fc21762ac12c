//! What Allocate answered, made durable on the node before the answer leaves: one file per pod
//! whose annotations do not say so yet (`<pod uid>.json` in `device_plugin.state_dir`),
//! replaced atomically (a temporary file, `fsync`, rename) at each answer for the pod and
//! removed once the API server has the write ([`super::writeback`]).
//!
//! A plugin that stops between an answer and its write (a crash, `kill -9`, a node agent
//! upgrade) reads the files back at start ([`Journal::load`]), before it registers with
//! kubelet: the containers they name count as answered (no other pod's container matches
//! them), and their writes are finished. Without it a pod answered but not yet marked
//! `ASSIGNED=true` would still look like it waits for Allocate, and could take the answer of
//! another pod of its size.
//!
//! Pure file handling: it neither matches nor talks to the API server. The directory should
//! live as long as the node's containers do (tmpfs, `/var/run/gpushare/device-plugin` by
//! default: a reboot restarts every container, and kubelet allocates again).

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One container's answer, as kept in the journal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AnsweredContainer {
    /// The container's name.
    pub container: String,
    /// The device IDs kubelet passed.
    pub device_ids: Vec<String>,
    /// The GPU the container was given.
    pub gpu_index: u32,
}

/// A pod's annotations as Allocate's answers make them, not yet written to the API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PendingWrite {
    /// `metadata.uid`: the write applies to this pod only (a pod re-created under the same
    /// name is another pod).
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The containers answered since the pod's annotations last listed them (what the
    /// annotations are made from when written: the pod's own list and these).
    pub answered: Vec<AnsweredContainer>,
    /// Grows with each answer for the pod: a write only clears the file it was made from.
    pub generation: u64,
}

/// Why the journal could not be used.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file system refused.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A pod UID that cannot name a file (the API server never makes one).
    #[error("pod UID {0:?} cannot name a journal file")]
    BadUid(String),
    /// A record could not be encoded.
    #[error("encoding a journal record: {0}")]
    Encode(#[from] serde_json::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The journal directory.
#[derive(Debug)]
pub(crate) struct Journal {
    dir: PathBuf,
}

impl Journal {
    /// Opens (creating) the journal in `dir`, and proves it writable.
    pub fn open(dir: &Path) -> Result<Journal, JournalError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let probe = dir.join(".writable");
        std::fs::write(&probe, b"").map_err(io(&probe))?;
        std::fs::remove_file(&probe).map_err(io(&probe))?;
        Ok(Journal {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    #[cfg(test)]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_of(&self, uid: &str) -> Result<PathBuf, JournalError> {
        let valid = !uid.is_empty()
            && uid.len() <= 128
            && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !valid {
            return Err(JournalError::BadUid(uid.to_string()));
        }
        Ok(self.dir.join(format!("{uid}.json")))
    }

    /// Makes `write` durable, replacing the pod's earlier one.
    pub fn record(&self, write: &PendingWrite) -> Result<(), JournalError> {
        let path = self.path_of(&write.uid)?;
        let tmp = self.dir.join(format!(".{}.tmp", write.uid));
        let bytes = serde_json::to_vec(write)?;
        let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(&bytes).map_err(io(&tmp))?;
        file.sync_data().map_err(io(&tmp))?;
        drop(file);
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        // The rename itself, on a disk (free on tmpfs).
        if let Ok(dir) = std::fs::File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    }

    /// Removes the pod's record if it is still the one of `generation` (a later answer's
    /// record stays for its own write).
    pub fn clear(&self, uid: &str, generation: u64) -> Result<(), JournalError> {
        let path = self.path_of(uid)?;
        let current = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<PendingWrite>(&b).ok());
        match current {
            Some(w) if w.generation != generation => Ok(()),
            None if !path.exists() => Ok(()),
            _ => match std::fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io(&path)(e)),
            },
        }
    }

    /// Every record left, oldest generation first; files that cannot be read are named in
    /// the second list (and left in place for a person to look at).
    pub fn load(&self) -> (Vec<PendingWrite>, Vec<(PathBuf, String)>) {
        let mut out = Vec::new();
        let mut bad = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return (out, bad);
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let is_record = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".json") && !n.starts_with('.'));
            if !is_record {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<PendingWrite>(&b).map_err(|e| e.to_string()))
            {
                Ok(w) if self.path_of(&w.uid).ok().as_deref() == Some(path.as_path()) => {
                    out.push(w)
                }
                Ok(w) => bad.push((path, format!("names pod UID {:?}, not its file", w.uid))),
                Err(e) => bad.push((path, e)),
            }
        }
        out.sort_by_key(|w| w.generation);
        (out, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(uid: &str, generation: u64) -> PendingWrite {
        PendingWrite {
            uid: uid.to_string(),
            namespace: "ns".to_string(),
            name: format!("pod-{uid}"),
            answered: vec![AnsweredContainer {
                container: "main".to_string(),
                device_ids: vec!["GPU-1-_-0".to_string()],
                gpu_index: 1,
            }],
            generation,
        }
    }

    #[test]
    fn records_survive_a_reopen_and_clear_only_their_own_generation() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(&dir.path().join("dp")).unwrap();
        journal.record(&write("u-1", 1)).unwrap();
        journal.record(&write("u-2", 2)).unwrap();
        journal.record(&write("u-1", 3)).unwrap();
        let again = Journal::open(journal.dir()).unwrap();
        let (left, bad) = again.load();
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            left.iter()
                .map(|w| (w.uid.as_str(), w.generation))
                .collect::<Vec<_>>(),
            [("u-2", 2), ("u-1", 3)]
        );
        again.clear("u-1", 1).unwrap();
        assert_eq!(
            again.load().0.len(),
            2,
            "an older write does not clear a newer record"
        );
        again.clear("u-1", 3).unwrap();
        again.clear("u-9", 1).unwrap();
        assert_eq!(again.load().0, vec![write("u-2", 2)]);
    }

    #[test]
    fn bad_names_and_broken_files_are_refused_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        assert!(matches!(
            journal.record(&write("../etc", 1)),
            Err(JournalError::BadUid(_))
        ));
        std::fs::write(dir.path().join("u-3.json"), b"{not json").unwrap();
        std::fs::write(
            dir.path().join("u-4.json"),
            serde_json::to_vec(&write("u-5", 1)).unwrap(),
        )
        .unwrap();
        let (left, bad) = journal.load();
        assert!(left.is_empty());
        assert_eq!(bad.len(), 2, "{bad:?}");
    }
}
