//! The fatal Xids (48, 79, 95) the node agent has seen, kept in a small JSON file so that a
//! restart of the role does not forget them while the GPU stays listed: the GPU stays down
//! until it is reset or leaves the node.
//!
//! A GPU is taken as reset when the node booted since the Xid (the kernel's boot id changed:
//! a GPU reset without a reboot, `nvidia-smi --gpu-reset`, is not visible to the agent; the
//! file is then removed by hand, see the DRA page), and as gone when the GPUs served at start
//! no longer include its UUID. The file is replaced atomically (a synced temporary file in the
//! same directory, renamed over it). A file that cannot be read is treated as empty, with a
//! warning: health errs towards the GPU being used, as before the file existed.
//!
//! What it does not do: decide which Xids are fatal ([`super::health`]) or publish health.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The format version this build writes and reads.
const VERSION: u32 = 1;
/// Where the kernel tells the boot id.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The fatal Xids recorded, by GPU UUID, and the boot they were seen in.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FatalXids {
    /// The format version.
    pub version: u32,
    /// The kernel's boot id when the file was written.
    pub boot_id: String,
    /// The fatal Xid of each GPU down for good, by UUID.
    pub gpus: BTreeMap<String, u64>,
}

/// Why the file could not be written.
#[derive(Debug, thiserror::Error)]
#[error("writing the fatal Xid record {path}: {source}")]
pub struct SaveError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// The kernel's boot id now (empty when it cannot be read: then no boot is ever seen).
pub fn boot_id() -> String {
    std::fs::read_to_string(BOOT_ID)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl FatalXids {
    /// The record at `path` that still applies: empty when there is none, it cannot be read,
    /// or it is of another boot (`boot_id`); only the GPUs `present` lists now.
    pub fn load(path: &Path, boot_id: &str, present: &[String]) -> FatalXids {
        let empty = FatalXids {
            version: VERSION,
            boot_id: boot_id.to_string(),
            gpus: BTreeMap::new(),
        };
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return empty,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the fatal Xid record; starting without it");
                return empty;
            }
        };
        let read: FatalXids = match serde_json::from_slice(&text) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "the fatal Xid record is corrupt; starting without it");
                return empty;
            }
        };
        if read.version != VERSION || read.boot_id != boot_id {
            return empty;
        }
        FatalXids {
            gpus: read
                .gpus
                .into_iter()
                .filter(|(uuid, _)| present.contains(uuid))
                .collect(),
            ..empty
        }
    }

    /// Replaces the file at `path` with this record, atomically.
    pub fn save(&self, path: &Path) -> Result<(), SaveError> {
        let fail = |source| SaveError {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        std::fs::create_dir_all(dir).map_err(fail)?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".fatal-xids-")
            .tempfile_in(dir)
            .map_err(fail)?;
        let text = serde_json::to_vec_pretty(self).map_err(|e| fail(std::io::Error::other(e)))?;
        tmp.write_all(&text).map_err(fail)?;
        tmp.as_file().sync_all().map_err(fail)?;
        tmp.persist(path).map_err(|e| fail(e.error))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_applies_in_its_boot_to_the_gpus_still_present() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state/fatal-xids.json");
        let present = ["GPU-a".to_string(), "GPU-b".to_string()];
        assert!(FatalXids::load(&path, "boot-1", &present).gpus.is_empty());
        let mut r = FatalXids::load(&path, "boot-1", &present);
        r.gpus.insert("GPU-a".into(), 79);
        r.gpus.insert("GPU-c".into(), 48);
        r.save(&path).expect("saved");
        assert_eq!(
            FatalXids::load(&path, "boot-1", &present).gpus,
            BTreeMap::from([("GPU-a".to_string(), 79)]),
            "GPU-c left the node"
        );
        assert!(
            FatalXids::load(&path, "boot-2", &present).gpus.is_empty(),
            "a reboot reset the GPUs"
        );
        std::fs::write(&path, b"{").expect("corrupt");
        assert!(FatalXids::load(&path, "boot-1", &present).gpus.is_empty());
    }
}
