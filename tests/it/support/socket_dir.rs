//! Temporary directories with short paths, for unix sockets: a socket path longer than
//! `sun_path` (108 bytes on Linux) cannot be bound, and `$TMPDIR` can be long.

/// A fresh temporary directory directly under `/tmp`, removed when dropped.
pub(crate) fn short_tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("gs")
        .tempdir_in("/tmp")
        .expect("a temp dir under /tmp")
}
