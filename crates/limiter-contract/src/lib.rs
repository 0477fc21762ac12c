//! What gpushare's node agent and its CUDA memory limiter agree on: where the limiter's files
//! are inside a container, the limits file the node agent writes, and the usage ledger the
//! limiter keeps and the node agent reads.
//!
//! The limiter itself (`crates/limiter`, the preloaded `libgpushare_limiter.so`) is a
//! `cdylib` with `unsafe` code; this crate is pure, safe Rust, so the main binary depends on
//! it to write limits files and read usage without linking the limiter. The limiter depends
//! on it too: there is one parser of the limits file and one description of the ledger.
//!
//! It does not inject anything into containers (the node roles do) and does not count
//! allocations (the limiter does).
//!
//! # Inside a container
//!
//! | path | what | mounted |
//! | --- | --- | --- |
//! | [`PRELOAD_PATH`] | one line, [`LIBRARY_PATH`] ([`preload_file_contents`]) | read-only file |
//! | [`LIBRARY_PATH`] | the limiter | read-only file |
//! | [`LIMITS_PATH`] | the container's limits ([`limits`]) | read-only file |
//! | [`STATE_DIR`] | the ledgers and liveness files of the container's processes ([`ledger`]) | read-write directory, one per container |
//!
//! The limiter reads nothing from the container's environment: a pod cannot raise its limit
//! or switch the limiter off by its spec. One variable, [`TEST_ROOT_ENV`], exists for tests
//! outside containers and is ignored wherever [`LIMITS_PATH`] exists.
//!
//! # On the node (what the node agent provides)
//!
//! The host side is the node agent's to choose; what the limiter needs of it:
//!
//! - **The library** installed once per node (`make limiter` builds it for glibc 2.17), by
//!   writing a temporary file and renaming it over the old one, never rewriting it in place:
//!   running containers have the old file mounted and mapped. For example
//!   `/var/lib/gpushare/limiter/libgpushare_limiter.so`, with the preload list
//!   ([`preload_file_contents`]) beside it.
//! - **Per container**, created before the container starts and removed once it is gone: the
//!   limits file (written with [`Limits::render`], then mounted read-only) and the state
//!   directory, on a tmpfs (the ledgers are shared memory maps), mode `1777` (the container's
//!   processes may run as any user), shared by no other container; for example
//!   `/run/gpushare/limiter/<pod uid>/<container>/{limits,state}`. The container is known at
//!   `Allocate` (device plugin) or in the claim's CDI spec (DRA).
//! - **The mounts** come after the pod's own volumes (kubelet appends device-plugin and CDI
//!   mounts to the container's; runtimes mount parents first), so no volume of the pod hides
//!   them; the webhook should still refuse pods that mount anything at these paths.
//! - **Usage**: [`read_container`] / [`read_gpu`] on the host's state directory, from a
//!   blocking context.

pub mod ledger;
pub mod limits;
pub mod reader;

pub use ledger::{LedgerError, LedgerSnapshot, SlotRecord};
pub use limits::{GpuUuid, Limits, LimitsError, UuidError};
pub use reader::{GpuUsage, ProcessUsage, ReadError, read_container, read_gpu};

/// File name of the limiter library, on the host and in the container.
pub const LIBRARY_FILE_NAME: &str = "libgpushare_limiter.so";

/// The directory inside a container under which the limiter's files are mounted.
pub const CONTAINER_DIR: &str = "/usr/local/gpushare";

/// Where the library is mounted inside a container (read-only).
pub const LIBRARY_PATH: &str = "/usr/local/gpushare/lib/libgpushare_limiter.so";

/// Where the container's limits file is mounted (read-only). The limiter reads it, and only
/// it, for the limits.
pub const LIMITS_PATH: &str = "/usr/local/gpushare/limits";

/// Where the container's state directory is mounted (read-write, shared by every process of
/// the container, and by no other container).
pub const STATE_DIR: &str = "/usr/local/gpushare/state";

/// The dynamic loader's preload list, mounted over the image's (read-only): every dynamically
/// linked program of the container loads the limiter, whatever its environment says.
pub const PRELOAD_PATH: &str = "/etc/ld.so.preload";

/// For tests outside containers only: a directory holding `limits` and `state/`, used in
/// place of [`LIMITS_PATH`] and [`STATE_DIR`] **only when [`LIMITS_PATH`] does not exist**.
/// In a container where the limiter is injected the limits file is always mounted (after the
/// pod's own mounts, so no volume of the pod hides it), so the variable has no effect there.
pub const TEST_ROOT_ENV: &str = "GPUSHARE_LIMITER_ROOT";

/// The contents of the [`PRELOAD_PATH`] file the node agent mounts.
pub fn preload_file_contents() -> String {
    format!("{LIBRARY_PATH}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_container_paths_hang_together() {
        assert!(LIBRARY_PATH.starts_with(CONTAINER_DIR));
        assert!(LIBRARY_PATH.ends_with(LIBRARY_FILE_NAME));
        assert!(LIMITS_PATH.starts_with(CONTAINER_DIR));
        assert!(STATE_DIR.starts_with(CONTAINER_DIR));
        assert_eq!(
            preload_file_contents(),
            "/usr/local/gpushare/lib/libgpushare_limiter.so\n"
        );
    }
}
