//! Where the limits come from, and what the limiter does when they cannot be read.
//!
//! | situation | mode |
//! | --- | --- |
//! | the limits file at the fixed path exists and reads | [`Mode::Active`] |
//! | it exists but cannot be read or parsed, or the state directory is missing | [`Mode::Closed`]: every allocation refused |
//! | it does not exist and `GPUSHARE_LIMITER_ROOT` names a directory (tests) | [`Mode::Active`] from that directory, or [`Mode::Closed`] |
//! | neither | [`Mode::Off`]: everything passes through |
//!
//! `Off` is fail-open on purpose: the file is missing only where gpushare did not inject the
//! limiter (the library preloaded by hand on a host, say), and there nothing is owed a
//! limit. Wherever gpushare injects it, the node agent mounts the file with the library, so a
//! broken injection is a refusal, not an unlimited container.
//!
//! Nothing is read from the container's environment except the test variable, which only
//! counts where the fixed file does not exist.

use std::io::Read;
use std::path::{Path, PathBuf};

use gpushare_limiter_contract::{LIMITS_PATH, Limits, STATE_DIR, TEST_ROOT_ENV, limits};

/// What the limiter does in this process.
pub enum Mode {
    /// Not injected by gpushare: every call passes through.
    Off,
    /// Injected but unusable: allocations are refused, the view shows no memory.
    Closed(String),
    /// Limits in force.
    Active {
        /// Bytes per GPU.
        limits: Limits,
        /// The container's state directory.
        state_dir: PathBuf,
    },
}

/// Reads the mode from the fixed paths, or the test root where the fixed file is absent.
pub fn load() -> Mode {
    load_from(Path::new(LIMITS_PATH), Path::new(STATE_DIR), || {
        std::env::var_os(TEST_ROOT_ENV).map(PathBuf::from)
    })
}

fn load_from(
    limits_path: &Path,
    state_dir: &Path,
    test_root: impl FnOnce() -> Option<PathBuf>,
) -> Mode {
    match std::fs::symlink_metadata(limits_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match test_root() {
            Some(root) if !root.as_os_str().is_empty() => {
                read(&root.join("limits"), &root.join("state"))
            }
            _ => Mode::Off,
        },
        _ => read(limits_path, state_dir),
    }
}

fn read(limits_path: &Path, state_dir: &Path) -> Mode {
    let text = match read_limited(limits_path) {
        Ok(t) => t,
        Err(e) => {
            return Mode::Closed(format!(
                "the limits file {} cannot be read: {e}",
                limits_path.display()
            ));
        }
    };
    let limits = match Limits::parse(&text) {
        Ok(l) => l,
        Err(e) => {
            return Mode::Closed(format!(
                "the limits file {} is not valid: {e}",
                limits_path.display()
            ));
        }
    };
    if !state_dir.is_dir() {
        return Mode::Closed(format!(
            "the state directory {} is missing",
            state_dir.display()
        ));
    }
    Mode::Active {
        limits,
        state_dir: state_dir.to_path_buf(),
    }
}

fn read_limited(path: &Path) -> std::io::Result<String> {
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limits::MAX_FILE_BYTES as u64 + 1)
        .read_to_string(&mut text)?;
    Ok(text)
}

#[cfg(test)]
#[allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;

    const GPU: &str = "GPU-00000000-0000-0000-0000-000000000001";

    fn root(limits: Option<&str>, state: bool) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some(text) = limits {
            std::fs::write(dir.path().join("limits"), text).expect("limits");
        }
        if state {
            std::fs::create_dir(dir.path().join("state")).expect("state");
        }
        dir
    }

    fn limit_of(mode: &Mode) -> Option<u64> {
        match mode {
            Mode::Active { limits, .. } => {
                limits.get(&gpushare_limiter_contract::GpuUuid::parse(GPU).expect("uuid"))
            }
            _ => None,
        }
    }

    #[test]
    fn the_fixed_file_wins_over_the_test_root() {
        let fixed = root(Some(&format!("{}\n{GPU} 4\n", limits::HEADER)), true);
        let other = root(Some(&format!("{}\n{GPU} 16\n", limits::HEADER)), true);
        let mode = load_from(
            &fixed.path().join("limits"),
            &fixed.path().join("state"),
            || Some(other.path().to_path_buf()),
        );
        assert_eq!(limit_of(&mode), Some(4));
    }

    #[test]
    fn the_test_root_counts_only_where_the_fixed_file_is_absent() {
        let other = root(Some(&format!("{}\n{GPU} 16\n", limits::HEADER)), true);
        let absent = other.path().join("no-such-file");
        let mode = load_from(&absent, &absent, || Some(other.path().to_path_buf()));
        assert_eq!(limit_of(&mode), Some(16));
        assert!(matches!(load_from(&absent, &absent, || None), Mode::Off));
    }

    #[test]
    fn an_unreadable_or_invalid_file_or_a_missing_state_directory_closes() {
        let bad = root(Some("gpushare-limiter-limits 9\n"), true);
        let mode = load_from(
            &bad.path().join("limits"),
            &bad.path().join("state"),
            || None,
        );
        assert!(matches!(&mode, Mode::Closed(why) if why.contains("not valid")));

        let no_state = root(Some(&format!("{}\n", limits::HEADER)), false);
        let mode = load_from(
            &no_state.path().join("limits"),
            &no_state.path().join("state"),
            || None,
        );
        assert!(matches!(&mode, Mode::Closed(why) if why.contains("state directory")));

        // A directory where the file should be exists but cannot be read as one.
        let dir = root(None, true);
        std::fs::create_dir(dir.path().join("limits")).expect("dir");
        let mode = load_from(
            &dir.path().join("limits"),
            &dir.path().join("state"),
            || None,
        );
        assert!(matches!(&mode, Mode::Closed(why) if why.contains("cannot be read")));
    }
}
