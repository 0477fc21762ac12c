//! One path per GPU across processes: a lock file per GPU in a host directory every node role
//! mounts (`node.gpu_lock_dir`, `/var/run/gpushare/gpus`), held (an exclusive `flock`) by the
//! process whose role serves the GPU for as long as it serves it. The device plugin and the
//! DRA plugin run as separate processes (DaemonSets); before either offers a GPU it takes the
//! GPU's lock, so the other cannot offer it at the same time. The kernel drops the lock when
//! the holder exits however it exits (a crash, `kill -9`), so a dead role never keeps a GPU.
//!
//! The file is `<dir>/<node>_<uuid>.lock` (the node's name keeps in-process sandboxes of
//! several nodes apart); the holder writes who it is into it (`{"path":"dra","pid":…}`), so
//! the other role can say who holds the GPU. A lock taken twice in one process through two
//! handles conflicts too (`flock` locks an open file description), so two roles of one
//! process are kept apart the same way.
//!
//! What it does not do: decide whether a GPU may be offered beyond the lock (the other path's
//! pods may still hold memory on it: [`super::paths`]), or publish anything.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::paths::ServingPath;

/// Who holds a GPU's lock, as written into the lock file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// `device-plugin` or `dra`.
    pub path: String,
    /// The holding process.
    pub pid: u32,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let who = match self.path.as_str() {
            "device-plugin" => "the device plugin",
            "dra" => "the DRA kubelet plugin",
            _ => "another gpushare process",
        };
        write!(f, "{who} (pid {})", self.pid)
    }
}

/// Why a GPU's lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process (or another role of this one) holds it.
    #[error("GPU {uuid} is served by {holder}")]
    Held {
        /// The GPU.
        uuid: String,
        /// Who holds it (what its file says; empty when it could not be read).
        holder: Holder,
    },
    /// The lock file could not be opened or locked.
    #[error("cannot lock GPU {uuid} in {path}: {source}")]
    Io {
        /// The GPU.
        uuid: String,
        /// The lock file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The lock directory of a node.
#[derive(Clone, Debug)]
pub struct GpuLocks {
    dir: PathBuf,
    node: String,
}

/// A held lock: the GPU is this role's until it is dropped.
#[derive(Debug)]
pub struct GpuLock {
    file: File,
    uuid: String,
}

impl GpuLock {
    /// The GPU.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }
}

impl Drop for GpuLock {
    fn drop(&mut self) {
        // Say nobody holds it before letting go, for whoever reads the file next.
        let _ = self.file.set_len(0);
        let _ = self.file.unlock();
    }
}

impl GpuLocks {
    /// The locks of node `node` in `dir`.
    pub fn new(dir: &Path, node: &str) -> GpuLocks {
        GpuLocks {
            dir: dir.to_path_buf(),
            node: node.to_string(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The lock file of GPU `uuid`.
    pub fn file(&self, uuid: &str) -> PathBuf {
        let safe = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '-' | '.') {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        self.dir
            .join(format!("{}_{}.lock", safe(&self.node), safe(uuid)))
    }

    /// Takes GPU `uuid`'s lock for `path`, without waiting: refused when anyone holds it.
    pub fn try_take(&self, uuid: &str, path: ServingPath) -> Result<GpuLock, LockError> {
        let file_path = self.file(uuid);
        let io = |source| LockError::Io {
            uuid: uuid.to_string(),
            path: file_path.clone(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&file_path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(LockError::Held {
                    uuid: uuid.to_string(),
                    holder: read_holder(&mut file),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let holder = Holder {
            path: path_name(path).to_string(),
            pid: std::process::id(),
        };
        let text = serde_json::to_vec(&holder).unwrap_or_default();
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        file.write_all(&text).map_err(io)?;
        file.flush().map_err(io)?;
        Ok(GpuLock {
            file,
            uuid: uuid.to_string(),
        })
    }

    /// Who holds GPU `uuid`'s lock now, if anyone (a lock taken and let go at once to look).
    pub fn holder(&self, uuid: &str) -> Option<Holder> {
        let mut file = OpenOptions::new().read(true).open(self.file(uuid)).ok()?;
        match file.try_lock_shared() {
            Ok(()) => {
                let _ = file.unlock();
                None
            }
            Err(TryLockError::WouldBlock) => Some(read_holder(&mut file)),
            Err(TryLockError::Error(_)) => None,
        }
    }
}

impl GpuLocks {
    /// Every GPU of this node whose lock someone holds now, with who (the lock files of the
    /// directory, each taken shared and let go at once to look): what `doctor` reports.
    pub fn holders(&self) -> Vec<(String, Holder)> {
        let prefix = self.file("").file_name().map(|n| {
            let n = n.to_string_lossy();
            n.trim_end_matches(".lock").to_string()
        });
        let Some(prefix) = prefix else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<(String, Holder)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let uuid = name
                    .strip_prefix(&prefix)?
                    .strip_suffix(".lock")?
                    .to_string();
                let holder = self.holder(&uuid)?;
                Some((uuid, holder))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// The name of `path` in a lock file and on the Node (`device-plugin`, `dra`).
pub fn path_name(path: ServingPath) -> &'static str {
    match path {
        ServingPath::DevicePlugin => "device-plugin",
        ServingPath::Dra => "dra",
    }
}

fn read_holder(file: &mut File) -> Holder {
    let mut text = Vec::new();
    let _ = file.rewind();
    let _ = file.read_to_end(&mut text);
    serde_json::from_slice(&text).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_lock_is_held_by_one_taker_at_a_time_and_names_it() {
        let dir = tempfile::tempdir().expect("dir");
        let locks = GpuLocks::new(dir.path(), "node-a");
        let dp = locks
            .try_take("GPU-0", ServingPath::DevicePlugin)
            .expect("free");
        let err = locks
            .try_take("GPU-0", ServingPath::Dra)
            .expect_err("held, even by this process through another handle");
        let LockError::Held { holder, .. } = &err else {
            panic!("{err}");
        };
        assert_eq!(holder.path, "device-plugin");
        assert_eq!(holder.pid, std::process::id());
        assert!(
            err.to_string().contains("served by the device plugin"),
            "{err}"
        );
        assert_eq!(
            locks.holder("GPU-0").map(|h| h.path),
            Some("device-plugin".into())
        );
        // Another node's GPU of the same UUID (an in-process sandbox) is another lock.
        GpuLocks::new(dir.path(), "node-b")
            .try_take("GPU-0", ServingPath::Dra)
            .expect("another node");
        drop(dp);
        assert_eq!(locks.holder("GPU-0"), None);
        let dra = locks.try_take("GPU-0", ServingPath::Dra).expect("let go");
        assert_eq!(dra.uuid(), "GPU-0");
    }

    /// A lock held by another process (util-linux `flock` holding the file) is refused, and
    /// free again once that process is gone.
    #[test]
    fn a_lock_held_by_another_process_is_refused_until_it_exits() {
        let dir = tempfile::tempdir().expect("dir");
        let locks = GpuLocks::new(dir.path(), "n");
        std::fs::create_dir_all(dir.path()).expect("dir");
        let file = locks.file("GPU-9");
        std::fs::write(&file, br#"{"path":"dra","pid":1}"#).expect("holder");
        let Ok(mut child) = std::process::Command::new("flock")
            .arg("-x")
            .arg(&file)
            .args(["-c", "read line"])
            .stdin(std::process::Stdio::piped())
            .spawn()
        else {
            eprintln!("SKIPPED: flock (util-linux) is not installed");
            return;
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while locks.holder("GPU-9").is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "flock never took the lock"
            );
            std::thread::yield_now();
        }
        let err = locks
            .try_take("GPU-9", ServingPath::DevicePlugin)
            .expect_err("held by the other process");
        assert!(
            err.to_string().contains("DRA kubelet plugin (pid 1)"),
            "{err}"
        );
        drop(child.stdin.take());
        child.wait().expect("flock exits");
        locks
            .try_take("GPU-9", ServingPath::DevicePlugin)
            .expect("free once the holder is gone");
    }
}
