//! `[node] enforcement`: which mechanism holds a container to its share of GPU memory
//! (docs/enforcement.md compares them).
//!
//! It only names the choice; `crate::node::enforcement` decides, per GPU and serving path,
//! what `auto` comes to, and refuses to start where an asked-for mechanism cannot work.

use serde::{Deserialize, Serialize};

/// The enforcement asked for.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Enforcement {
    /// The strongest mechanism each GPU supports: driver, else limiter where the node has the
    /// limiter library, else mps where MPS is on, else none; the node agent logs which it
    /// chose and why.
    #[default]
    Auto,
    /// The driver's per-cgroup memory limits (R615+, cgroup v2, no MIG), set on each
    /// container's own cgroup by a CDI hook at creation; refuses to start without them.
    Driver,
    /// The CUDA memory limiter: a library the node agent installs on the host and preloads
    /// into every container (`/etc/ld.so.preload`, read-only mounts); refuses to start
    /// without the library.
    Limiter,
    /// The MPS control daemon's per-client pinned memory limit (`[node] mps = true`).
    Mps,
    /// No enforcement: the share is what the scheduler counts, nothing stops a container using
    /// more.
    None,
}

impl Enforcement {
    /// The configuration spelling (`auto`, `driver`, `limiter`, `mps`, `none`).
    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::Auto => "auto",
            Enforcement::Driver => "driver",
            Enforcement::Limiter => "limiter",
            Enforcement::Mps => "mps",
            Enforcement::None => "none",
        }
    }
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
