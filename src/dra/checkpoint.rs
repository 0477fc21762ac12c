//! The DRA plugin's checkpoint: every claim prepared on this node, with what prepare gave it,
//! in one JSON file written atomically.
//!
//! kubelet's `NodeUnprepareResources` names a claim by namespace, name and uid only, and the
//! claim may be gone by then; after a restart the plugin has forgotten everything. So prepare
//! records each claim here before it answers, and unprepare reads what to undo (the CDI spec
//! to remove) from here, then drops the claim. [`Checkpoint::held`] is what prepared claims
//! hold on each GPU, for the over-consumption check. It lives in the plugin's state directory
//! (`dra.state_dir`, `/var/run/gpushare/<driver>`: tmpfs, like the CDI specs it protects), so
//! a reboot clears both together.
//!
//! The file is replaced atomically (a temporary file in the same directory, `fsync`, rename,
//! `fsync` of the directory), so a crash leaves the old or the new checkpoint, never half of
//! one. A missing file is an empty checkpoint; an unreadable one is an error (the caller must
//! not forget prepared claims silently). What it does not do: locking between processes (one
//! plugin per node).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::claims::{ClaimError, ClaimShare, DeviceShare};

/// The format version this build writes and reads.
pub const VERSION: u32 = 1;

/// One share of a prepared claim and the CDI devices answered for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedShare {
    /// The share.
    #[serde(flatten)]
    pub share: ClaimShare,
    /// The CDI device ids answered to kubelet for it.
    pub cdi_device_ids: Vec<String>,
}

/// One device of another kind held by a prepared claim, and the CDI devices answered for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    /// The device share.
    #[serde(flatten)]
    pub share: DeviceShare,
    /// The CDI device ids answered to kubelet for it.
    pub cdi_device_ids: Vec<String>,
}

/// One prepared claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// Its shares of this node's GPUs, in the order of the allocation results.
    pub shares: Vec<PreparedShare>,
    /// Its devices of other kinds (RDMA HCAs, generic devices), in the order of the results.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<PreparedDevice>,
    /// The transient CDI spec file written for it, removed on unprepare.
    pub cdi_spec: Option<PathBuf>,
}

/// Every prepared claim, by claim uid.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The format version.
    pub version: u32,
    /// By claim uid.
    pub claims: BTreeMap<String, PreparedClaim>,
}

/// Why the checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading failed.
    #[error("reading the DRA checkpoint {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint.
    #[error("the DRA checkpoint {path} is corrupt: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Written by another format version.
    #[error("the DRA checkpoint {path} has version {found}; this build reads version {VERSION}")]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// Writing failed.
    #[error("writing the DRA checkpoint {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Checkpoint {
        Checkpoint {
            version: VERSION,
            claims: BTreeMap::new(),
        }
    }

    /// The checkpoint at `path`; empty when the file does not exist.
    pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Checkpoint::new()),
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let cp: Checkpoint =
            serde_json::from_slice(&text).map_err(|source| CheckpointError::Corrupt {
                path: path.to_path_buf(),
                source,
            })?;
        if cp.version != VERSION {
            return Err(CheckpointError::Version {
                path: path.to_path_buf(),
                found: cp.version,
            });
        }
        Ok(cp)
    }

    /// Replaces the file at `path` with this checkpoint, atomically.
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let write = |source| CheckpointError::Write {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        std::fs::create_dir_all(dir).map_err(write)?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".checkpoint-")
            .tempfile_in(dir)
            .map_err(write)?;
        let text = serde_json::to_vec_pretty(self).map_err(|e| write(std::io::Error::other(e)))?;
        tmp.write_all(&text).map_err(write)?;
        tmp.as_file().sync_all().map_err(write)?;
        tmp.persist(path).map_err(|e| write(e.error))?;
        // The rename itself must reach the disk.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// What the prepared claims, except `except` (the claim being prepared again), hold on
    /// each device (by device name), in the device's unit: bytes of a GPU's memory, shares of
    /// a device of another kind. Sums that do not fit in 64 bits are an error, never a wrap.
    pub fn held(&self, except: Option<&str>) -> Result<BTreeMap<String, u64>, HeldOverflow> {
        let mut out: BTreeMap<String, u64> = BTreeMap::new();
        let mut add = |device: &str, amount: u64| {
            let held = out.entry(device.to_string()).or_default();
            *held = held.checked_add(amount).ok_or_else(|| HeldOverflow {
                device: device.to_string(),
            })?;
            Ok(())
        };
        for (uid, c) in &self.claims {
            if Some(uid.as_str()) == except {
                continue;
            }
            for s in &c.shares {
                add(&s.share.device, s.share.memory_bytes)?;
            }
            for d in &c.devices {
                add(&d.share.device, u64::from(d.share.shares))?;
            }
        }
        Ok(out)
    }
}

/// What the prepared claims hold on a device does not fit in 64 bits (a record no admission
/// would have let in: the checkpoint was written by hand, or by a build without the check).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("what the prepared claims hold on device {device} does not fit in 64 bits")]
pub struct HeldOverflow {
    /// The device.
    pub device: String,
}

impl HeldOverflow {
    /// The error of claim `claim` (`namespace/name`) refused because of it.
    pub fn for_claim(self, claim: &str) -> ClaimError {
        ClaimError::Overflow {
            claim: claim.to_string(),
            device: self.device,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::GpuMem;

    fn prepared(device: &str, bytes: u64) -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            shares: vec![PreparedShare {
                share: ClaimShare {
                    request: "main".into(),
                    device: device.into(),
                    uuid: "GPU-A".into(),
                    index: 0,
                    share_id: Some("s".into()),
                    memory_bytes: bytes,
                    units: GpuMem::new(bytes >> 30),
                },
                cdi_device_ids: vec!["k8s.gpushare.io/claim=u-gpu-a".into()],
            }],
            devices: Vec::new(),
            cdi_spec: Some(PathBuf::from("/var/run/cdi/k8s.gpushare.io-claim_u.json")),
        }
    }

    #[test]
    fn a_saved_checkpoint_reads_back_and_nothing_temporary_is_left() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state/checkpoint.json");
        assert_eq!(
            Checkpoint::load(&path).expect("missing is empty"),
            Checkpoint::new()
        );
        let mut cp = Checkpoint::new();
        cp.claims.insert("u-1".into(), prepared("gpu-a", 2 << 30));
        cp.claims.insert("u-2".into(), prepared("gpu-a", 3 << 30));
        cp.save(&path).expect("saves");
        cp.claims.remove("u-2");
        cp.save(&path).expect("saves again");
        assert_eq!(Checkpoint::load(&path).expect("loads"), cp);
        let names: Vec<String> = std::fs::read_dir(path.parent().expect("parent"))
            .expect("lists")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["checkpoint.json"]);
    }

    #[test]
    fn held_memory_counts_every_claim_but_the_one_prepared_again() {
        let mut cp = Checkpoint::new();
        cp.claims.insert("u-1".into(), prepared("gpu-a", 2 << 30));
        cp.claims.insert("u-2".into(), prepared("gpu-a", 3 << 30));
        assert_eq!(cp.held(None).expect("fits")["gpu-a"], 5 << 30);
        assert_eq!(cp.held(Some("u-2")).expect("fits")["gpu-a"], 2 << 30);
    }

    #[test]
    fn held_memory_that_does_not_fit_in_64_bits_is_an_error_not_a_wrap() {
        let mut cp = Checkpoint::new();
        cp.claims
            .insert("u-1".into(), prepared("gpu-a", i64::MAX as u64));
        cp.claims
            .insert("u-2".into(), prepared("gpu-a", i64::MAX as u64));
        cp.claims.insert("u-3".into(), prepared("gpu-a", 2));
        assert_eq!(
            cp.held(None),
            Err(HeldOverflow {
                device: "gpu-a".into()
            })
        );
        assert_eq!(cp.held(Some("u-3")).expect("fits")["gpu-a"], u64::MAX - 1);
    }

    #[test]
    fn a_corrupt_or_foreign_checkpoint_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("checkpoint.json");
        std::fs::write(&path, b"{\"version\":1,\"claims\":{").expect("write");
        assert!(matches!(
            Checkpoint::load(&path),
            Err(CheckpointError::Corrupt { .. })
        ));
        std::fs::write(&path, b"{\"version\":2,\"claims\":{}}").expect("write");
        assert!(matches!(
            Checkpoint::load(&path),
            Err(CheckpointError::Version { found: 2, .. })
        ));
    }
}
