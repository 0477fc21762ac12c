//! Reading a container's usage from its state directory, for the node agent (metrics,
//! `inspect`'s used column).
//!
//! The directory is writable by the container, so the reader trusts nothing in it: files are
//! opened without following symbolic links and without blocking (a FIFO planted in place of
//! a ledger does not hang the reader), must be regular files of the ledger's exact size, and
//! their values are only summed (saturating). A container that holds its ledger's lock
//! forever gets [`ReadError::Busy`] for that GPU, not a stuck node agent.
//!
//! Blocking file I/O, with short waits while a lock is held: call it from a blocking context.

#[cfg(unix)]
use std::fs::File;
#[cfg(unix)]
use std::io::Read;
#[cfg(unix)]
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;
#[cfg(unix)]
use std::time::Instant;

#[cfg(unix)]
use rustix::fs::{FlockOperation, Mode, OFlags};

use crate::ledger::LedgerError;
#[cfg(unix)]
use crate::ledger::{self, FILE_BYTES, SlotRecord};
use crate::limits::GpuUuid;

/// How long [`read_gpu`] waits for a limiter to release a ledger's lock.
pub const LOCK_WAIT: Duration = Duration::from_millis(250);

/// One GPU's usage by one container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuUsage {
    /// The GPU.
    pub uuid: GpuUuid,
    /// The limit the container's processes last read.
    pub limit_bytes: u64,
    /// Bytes the container's live processes hold on it.
    pub used_bytes: u64,
    /// The live processes holding a slot, by slot index.
    pub processes: Vec<ProcessUsage>,
}

/// One live process of the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Its pid in the container's pid namespace.
    pub pid: u32,
    /// Its start time, clock ticks after boot.
    pub start_ticks: u64,
    /// Bytes it holds.
    pub used_bytes: u64,
    /// The most it held at once.
    pub peak_bytes: u64,
}

/// Why a state directory or ledger could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Opening, locking or reading failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a regular file (a link, a FIFO, a directory...).
    #[error("{}: not a regular file", path.display())]
    NotRegular {
        /// The file.
        path: PathBuf,
    },
    /// A limiter held the ledger's lock for longer than [`LOCK_WAIT`].
    #[error("{}: locked by the container for longer than {LOCK_WAIT:?}", path.display())]
    Busy {
        /// The ledger.
        path: PathBuf,
    },
    /// The file is not a ledger this version reads.
    #[error("{}: {source}", path.display())]
    Ledger {
        /// The ledger.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: LedgerError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ReadError + '_ {
    move |source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(unix)]
fn open_dir(dir: &Path) -> Result<OwnedFd, ReadError> {
    rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ReadError::Io {
        path: dir.to_path_buf(),
        source: e.into(),
    })
}

#[cfg(unix)]
/// Opens `name` in `dir` as a regular file, never following a link, never blocking.
/// `Ok(None)` when it does not exist.
fn open_regular(dir: &OwnedFd, dir_path: &Path, name: &str) -> Result<Option<File>, ReadError> {
    let path = dir_path.join(name);
    let fd = match rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => return Err(ReadError::NotRegular { path }),
        Err(e) => return Err(io(&path)(e.into())),
    };
    let stat = rustix::fs::fstat(&fd).map_err(|e| io(&path)(e.into()))?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(ReadError::NotRegular { path });
    }
    Ok(Some(File::from(fd)))
}

/// Reads the ledger of `uuid` in `state_dir`, counting only the slots of live processes.
/// `Ok(None)` when no process of the container has used that GPU yet.
#[cfg(unix)]
pub fn read_gpu(state_dir: &Path, uuid: &GpuUuid) -> Result<Option<GpuUsage>, ReadError> {
    let dir = open_dir(state_dir)?;
    read_one(&dir, state_dir, uuid)
}

/// Elsewhere than on unix there is no ledger to read (the Windows kubectl plugin links this
/// crate for its paths): an `Unsupported` error.
#[cfg(not(unix))]
pub fn read_gpu(state_dir: &Path, _uuid: &GpuUuid) -> Result<Option<GpuUsage>, ReadError> {
    Err(io(state_dir)(std::io::ErrorKind::Unsupported.into()))
}

/// As the unix [`read_gpu`]: an `Unsupported` error.
#[cfg(not(unix))]
pub fn read_container(state_dir: &Path) -> Result<Vec<GpuUsage>, ReadError> {
    Err(io(state_dir)(std::io::ErrorKind::Unsupported.into()))
}

/// Reads every ledger in `state_dir` (one per GPU the container's processes used), in UUID
/// order. Files that are not ledgers' are skipped; a ledger that cannot be read is an error.
#[cfg(unix)]
pub fn read_container(state_dir: &Path) -> Result<Vec<GpuUsage>, ReadError> {
    let dir = open_dir(state_dir)?;
    let mut uuids: Vec<GpuUuid> = std::fs::read_dir(state_dir)
        .map_err(io(state_dir))?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name();
            let uuid = name.to_str()?.strip_suffix(".ledger")?;
            GpuUuid::parse(uuid).ok()
        })
        .collect();
    uuids.sort();
    let mut out = Vec::new();
    for uuid in uuids {
        if let Some(usage) = read_one(&dir, state_dir, &uuid)? {
            out.push(usage);
        }
    }
    Ok(out)
}

#[cfg(unix)]
fn read_one(dir: &OwnedFd, dir_path: &Path, uuid: &GpuUuid) -> Result<Option<GpuUsage>, ReadError> {
    let name = ledger::ledger_file_name(uuid);
    let path = dir_path.join(&name);
    let Some(mut file) = open_regular(dir, dir_path, &name)? else {
        return Ok(None);
    };
    lock_shared(&file, &path)?;
    let mut bytes = Vec::with_capacity(FILE_BYTES);
    (&mut file)
        .take(FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io(&path))?;
    // Closing the file releases the lock.
    drop(file);
    let snapshot = ledger::decode(&bytes).map_err(|source| ReadError::Ledger {
        path: path.clone(),
        source,
    })?;
    let mut processes = Vec::new();
    for slot in &snapshot.claimed {
        if alive(dir, dir_path, uuid, slot)? {
            processes.push(ProcessUsage {
                pid: slot.pid,
                start_ticks: slot.start_ticks,
                used_bytes: slot.used_bytes,
                peak_bytes: slot.peak_bytes,
            });
        }
    }
    Ok(Some(GpuUsage {
        uuid: uuid.clone(),
        limit_bytes: snapshot.limit_bytes,
        used_bytes: processes
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.used_bytes)),
        processes,
    }))
}

#[cfg(unix)]
/// Takes a shared `fcntl` lock on the whole file, waiting at most [`LOCK_WAIT`].
fn lock_shared(file: &File, path: &Path) -> Result<(), ReadError> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match rustix::fs::fcntl_lock(file.as_fd(), FlockOperation::NonBlockingLockShared) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::ACCESS) => {
                if Instant::now() >= deadline {
                    return Err(ReadError::Busy {
                        path: path.to_path_buf(),
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(io(path)(e.into())),
        }
    }
}

#[cfg(unix)]
/// Whether the owner of `slot` lives: its alive file is locked.
fn alive(
    dir: &OwnedFd,
    dir_path: &Path,
    uuid: &GpuUuid,
    slot: &SlotRecord,
) -> Result<bool, ReadError> {
    let name = ledger::alive_file_name(uuid, slot.index);
    let Some(file) = open_regular(dir, dir_path, &name)? else {
        return Ok(false);
    };
    match file.try_lock_shared() {
        // Nobody holds it exclusively: the owner is gone. Dropping the file unlocks it.
        Ok(()) => Ok(false),
        Err(std::fs::TryLockError::WouldBlock) => Ok(true),
        Err(std::fs::TryLockError::Error(e)) => Err(io(&dir_path.join(&name))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{empty_file, put_slot};

    const A: &str = "GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6a";
    const B: &str = "GPU-00000000-0000-0000-0000-000000000002";

    fn record(index: u32, used: u64) -> SlotRecord {
        SlotRecord {
            index,
            pid: 10 + index,
            start_ticks: 99,
            used_bytes: used,
            peak_bytes: used,
        }
    }

    /// A state directory with a ledger of `uuid` holding `slots`; the alive files of the
    /// slots in `live` are created and locked exclusively by the returned files.
    fn state(dir: &Path, uuid: &GpuUuid, slots: &[SlotRecord], live: &[u32]) -> Vec<File> {
        let mut file = empty_file(4 << 30);
        for s in slots {
            put_slot(&mut file, s);
        }
        std::fs::write(dir.join(ledger::ledger_file_name(uuid)), file).expect("ledger");
        live.iter()
            .map(|&i| {
                let path = dir.join(ledger::alive_file_name(uuid, i));
                let f = File::create(&path).expect("alive file");
                f.lock().expect("flock");
                f
            })
            .collect()
    }

    #[test]
    fn only_live_processes_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let uuid = GpuUuid::parse(A).expect("uuid");
        let slots = [record(0, 1 << 30), record(1, 2 << 30), record(2, 5)];
        // Slot 1's alive file exists unlocked (its owner died); slot 2 has none.
        std::fs::write(dir.path().join(ledger::alive_file_name(&uuid, 1)), b"").expect("dead");
        let _held = state(dir.path(), &uuid, &slots, &[0]);
        let usage = read_gpu(dir.path(), &uuid)
            .expect("reads")
            .expect("present");
        assert_eq!(usage.used_bytes, 1 << 30);
        assert_eq!(usage.limit_bytes, 4 << 30);
        assert_eq!(
            usage.processes,
            vec![ProcessUsage {
                pid: 10,
                start_ticks: 99,
                used_bytes: 1 << 30,
                peak_bytes: 1 << 30
            }]
        );
        drop(_held);
        let usage = read_gpu(dir.path(), &uuid)
            .expect("reads")
            .expect("present");
        assert_eq!(usage.used_bytes, 0, "the owner of slot 0 is gone too");
    }

    #[test]
    fn a_container_lists_every_gpu_it_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = GpuUuid::parse(A).expect("a");
        let b = GpuUuid::parse(B).expect("b");
        let _ha = state(dir.path(), &a, &[record(0, 7)], &[0]);
        let _hb = state(dir.path(), &b, &[record(3, 9)], &[3]);
        std::fs::write(dir.path().join("notes.txt"), b"not a ledger").expect("other file");
        let all = read_container(dir.path()).expect("reads");
        let got: Vec<(&str, u64)> = all
            .iter()
            .map(|g| (g.uuid.as_str(), g.used_bytes))
            .collect();
        assert_eq!(got, vec![(B, 9), (A, 7)]);
        assert_eq!(
            read_gpu(
                dir.path(),
                &GpuUuid::parse("GPU-11111111-1111-1111-1111-111111111111").expect("c")
            )
            .expect("reads"),
            None
        );
    }

    #[test]
    fn links_fifos_and_foreign_files_are_refused_without_hanging() {
        let dir = tempfile::tempdir().expect("tempdir");
        let uuid = GpuUuid::parse(A).expect("uuid");
        let ledger_path = dir.path().join(ledger::ledger_file_name(&uuid));
        std::os::unix::fs::symlink("/etc/passwd", &ledger_path).expect("symlink");
        let err = read_gpu(dir.path(), &uuid).expect_err("a link");
        assert!(matches!(err, ReadError::NotRegular { .. }), "{err}");

        std::fs::remove_file(&ledger_path).expect("rm");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &ledger_path,
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .expect("mkfifo");
        let err = read_gpu(dir.path(), &uuid).expect_err("a fifo");
        assert!(matches!(err, ReadError::NotRegular { .. }), "{err}");

        std::fs::remove_file(&ledger_path).expect("rm");
        std::fs::write(&ledger_path, b"short").expect("short");
        let err = read_gpu(dir.path(), &uuid).expect_err("short");
        assert!(err.to_string().contains("5"), "{err}");
        assert!(matches!(err, ReadError::Ledger { .. }), "{err}");
    }

    #[test]
    fn a_ledger_locked_for_writing_is_busy_not_a_hang() {
        let dir = tempfile::tempdir().expect("tempdir");
        let uuid = GpuUuid::parse(A).expect("uuid");
        let _held = state(dir.path(), &uuid, &[record(0, 1)], &[0]);
        // Another process holds the write lock (a child: fcntl locks of this process never
        // conflict with each other).
        let path = dir.path().join(ledger::ledger_file_name(&uuid));
        let mut holder = std::process::Command::new("python3")
            .args([
                "-c",
                "import fcntl,sys;f=open(sys.argv[1],'r+b');fcntl.lockf(f,fcntl.LOCK_EX,1,0);print('locked',flush=True);sys.stdin.read()",
            ])
            .arg(&path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs (the tests' clients need it too)");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.as_mut().expect("stdout")),
            &mut line,
        )
        .expect("read");
        assert_eq!(line.trim(), "locked");
        let err = read_gpu(dir.path(), &uuid).expect_err("busy");
        assert!(matches!(err, ReadError::Busy { .. }), "{err}");
        drop(holder.stdin.take());
        holder.wait().expect("exits");
        assert!(read_gpu(dir.path(), &uuid).expect("reads after").is_some());
    }
}
