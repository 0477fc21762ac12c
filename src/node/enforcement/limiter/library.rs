//! The limiter library on the host: what a file is ([`inspect`]: an ELF shared object of this
//! node's architecture, and the newest glibc symbol version it needs, its floor), and its
//! installation into `[node] limiter_dir` ([`install`]): the library and the preload list,
//! each written to a temporary file in that directory and renamed over the old one, never
//! rewritten in place (running containers have the old file mounted and mapped), and only
//! when its content differs.
//!
//! It does not mount anything into containers ([`super::containers`] names the mounts).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// The preload list's file name in `limiter_dir`.
pub const PRELOAD_FILE_NAME: &str = "ld.so.preload";

/// What a limiter library file is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LibraryInfo {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// `x86_64`, `aarch64`, or the ELF machine number.
    pub arch: String,
    /// The newest `GLIBC_x.y` symbol version it needs (`2.17`), when it names any.
    pub glibc_floor: Option<String>,
}

/// Why a file is not a limiter this node can use.
#[derive(Debug, thiserror::Error)]
pub enum LibraryError {
    /// It cannot be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a 64-bit little-endian ELF shared object.
    #[error("{}: not a 64-bit ELF shared object ({why})", path.display())]
    NotSharedObject {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: &'static str,
    },
    /// Built for another architecture.
    #[error("{}: built for {found}, this node is {node}", path.display())]
    WrongArch {
        /// The file.
        path: PathBuf,
        /// Its architecture.
        found: String,
        /// The node's.
        node: &'static str,
    },
}

/// Why the library could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The library to install is not usable.
    #[error(transparent)]
    Library(#[from] LibraryError),
    /// Writing into `limiter_dir` failed.
    #[error("installing into {}: {source}", dir.display())]
    Write {
        /// The directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The ELF machine number's name.
fn machine_name(machine: u16) -> String {
    match machine {
        62 => "x86_64".to_string(),
        183 => "aarch64".to_string(),
        other => format!("ELF machine {other}"),
    }
}

/// What `bytes` (the file at `path`) is: an ELF shared object of this node's architecture.
pub fn inspect_bytes(path: &Path, bytes: &[u8]) -> Result<LibraryInfo, LibraryError> {
    let not = |why| LibraryError::NotSharedObject {
        path: path.to_path_buf(),
        why,
    };
    if bytes.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err(not("no ELF magic"));
    }
    if bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err(not("not 64-bit little-endian"));
    }
    let half = |at: usize| {
        bytes
            .get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    if half(16) != Some(3) {
        return Err(not("not a shared object (ET_DYN)"));
    }
    let arch = machine_name(half(18).ok_or_else(|| not("truncated header"))?);
    if arch != std::env::consts::ARCH {
        return Err(LibraryError::WrongArch {
            path: path.to_path_buf(),
            found: arch,
            node: std::env::consts::ARCH,
        });
    }
    Ok(LibraryInfo {
        path: path.to_path_buf(),
        bytes: bytes.len() as u64,
        arch,
        glibc_floor: glibc_floor(bytes),
    })
}

/// [`inspect_bytes`] of the file at `path`.
pub fn inspect(path: &Path) -> Result<LibraryInfo, LibraryError> {
    let bytes = std::fs::read(path).map_err(|source| LibraryError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    inspect_bytes(path, &bytes)
}

/// The newest `GLIBC_<major>.<minor>[.<patch>]` version named in `bytes` (the dynamic string
/// table holds the versions a library needs), as `2.17`.
pub fn glibc_floor(bytes: &[u8]) -> Option<String> {
    const TAG: &[u8] = b"GLIBC_";
    let mut best: Option<Vec<u32>> = None;
    let mut at = 0;
    while let Some(found) = bytes
        .get(at..)
        .and_then(|rest| rest.windows(TAG.len()).position(|w| w == TAG))
    {
        let start = at + found + TAG.len();
        let text: Vec<u8> = bytes
            .get(start..)
            .unwrap_or_default()
            .iter()
            .take_while(|b| b.is_ascii_digit() || **b == b'.')
            .copied()
            .collect();
        // The version string ends the string (a NUL follows): `GLIBC_PRIVATE` and prose
        // naming a version are not versions needed.
        let terminated = bytes.get(start + text.len()) == Some(&0);
        let parts: Option<Vec<u32>> = std::str::from_utf8(&text)
            .ok()
            .filter(|t| !t.is_empty() && terminated)
            .map(|t| t.split('.').map(|p| p.parse().ok()).collect())
            .and_then(|v: Option<Vec<u32>>| v);
        if let Some(parts) = parts.filter(|p| p.len() >= 2)
            && best.as_ref().is_none_or(|b| parts > *b)
        {
            best = Some(parts);
        }
        at = start;
    }
    best.map(|v| v.iter().map(u32::to_string).collect::<Vec<_>>().join("."))
}

/// Writes `bytes` as `dir/name` (mode `mode`) unless it already holds exactly them: a synced
/// temporary file in `dir` renamed over the name. Whether it wrote.
pub fn replace_file(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> std::io::Result<bool> {
    let target = dir.join(name);
    if std::fs::read(&target).is_ok_and(|old| old == bytes) {
        return Ok(false);
    }
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(mode))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    tmp.persist(&target).map_err(|e| e.error)?;
    Ok(true)
}

/// The installed library in `dir`.
pub fn installed_path(dir: &Path) -> PathBuf {
    dir.join(gpushare_limiter_contract::LIBRARY_FILE_NAME)
}

/// The preload list in `dir`.
pub fn preload_path(dir: &Path) -> PathBuf {
    dir.join(PRELOAD_FILE_NAME)
}

/// What [`install`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installed {
    /// The installed library.
    pub library: LibraryInfo,
    /// Whether the library was (re)written.
    pub wrote_library: bool,
    /// Whether the preload list was (re)written.
    pub wrote_preload: bool,
}

/// Installs `source` (checked first: an ELF shared object of this node's architecture) as
/// `dir/libgpushare_limiter.so` and writes the preload list beside it, each only when it
/// differs, atomically.
pub fn install(source: &Path, dir: &Path) -> Result<Installed, InstallError> {
    let bytes = std::fs::read(source).map_err(|e| LibraryError::Read {
        path: source.to_path_buf(),
        source: e,
    })?;
    inspect_bytes(source, &bytes)?;
    let write = |source| InstallError::Write {
        dir: dir.to_path_buf(),
        source,
    };
    let wrote_library = replace_file(
        dir,
        gpushare_limiter_contract::LIBRARY_FILE_NAME,
        &bytes,
        0o644,
    )
    .map_err(write)?;
    let wrote_preload = replace_file(
        dir,
        PRELOAD_FILE_NAME,
        gpushare_limiter_contract::preload_file_contents().as_bytes(),
        0o644,
    )
    .map_err(write)?;
    let library = inspect_bytes(&installed_path(dir), &bytes)?;
    Ok(Installed {
        library,
        wrote_library,
        wrote_preload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF header of a shared object for `machine`, then `tail`.
    pub(crate) fn elf(machine: u16, tail: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[16..18].copy_from_slice(&3u16.to_le_bytes());
        b[18..20].copy_from_slice(&machine.to_le_bytes());
        b.extend_from_slice(tail);
        b
    }

    fn native() -> u16 {
        match std::env::consts::ARCH {
            "aarch64" => 183,
            _ => 62,
        }
    }

    #[test]
    fn the_floor_is_the_newest_glibc_version_needed() {
        let strings =
            b"\0dlsym\0GLIBC_2.2.5\0GLIBC_2.17\0GLIBC_2.3\0GLIBC_PRIVATE\0see GLIBC_2.99 docs";
        assert_eq!(glibc_floor(strings).as_deref(), Some("2.17"));
        assert_eq!(glibc_floor(b"no versions"), None);
        let info = inspect_bytes(Path::new("x"), &elf(native(), strings)).expect("native");
        assert_eq!(info.glibc_floor.as_deref(), Some("2.17"));
        assert_eq!(info.arch, std::env::consts::ARCH);
    }

    #[test]
    fn other_files_and_architectures_are_refused() {
        let p = Path::new("lib.so");
        assert!(matches!(
            inspect_bytes(p, b"#!/bin/sh\n"),
            Err(LibraryError::NotSharedObject { .. })
        ));
        let mut exec = elf(native(), b"");
        exec[16] = 2;
        assert!(matches!(
            inspect_bytes(p, &exec),
            Err(LibraryError::NotSharedObject { .. })
        ));
        let other = if native() == 62 { 183 } else { 62 };
        let err = inspect_bytes(p, &elf(other, b"")).expect_err("another arch");
        assert!(err.to_string().contains("this node is"), "{err}");
    }

    #[test]
    fn install_writes_only_what_differs_and_never_in_place() {
        let dir = tempfile::tempdir().expect("dir");
        let source = dir.path().join("src.so");
        std::fs::write(&source, elf(native(), b"\0GLIBC_2.17\0")).expect("source");
        let target = dir.path().join("installed");
        let first = install(&source, &target).expect("installs");
        assert!(first.wrote_library && first.wrote_preload);
        assert_eq!(
            std::fs::read_to_string(preload_path(&target)).expect("preload"),
            "/usr/local/gpushare/lib/libgpushare_limiter.so\n"
        );
        let again = install(&source, &target).expect("again");
        assert!(!again.wrote_library && !again.wrote_preload);
        // A running container keeps the file it mapped: the new one is a new inode.
        use std::os::unix::fs::MetadataExt;
        let before = std::fs::metadata(installed_path(&target))
            .expect("meta")
            .ino();
        std::fs::write(&source, elf(native(), b"\0GLIBC_2.17\0v2")).expect("new build");
        assert!(install(&source, &target).expect("update").wrote_library);
        let after = std::fs::metadata(installed_path(&target))
            .expect("meta")
            .ino();
        assert_ne!(before, after);
        std::fs::write(&source, b"not a library").expect("junk");
        assert!(matches!(
            install(&source, &target),
            Err(InstallError::Library(_))
        ));
    }
}
