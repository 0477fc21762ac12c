//! The `enforcement` check: which mechanism holds each GPU's containers to their share of GPU
//! memory on each serving path of this node (`node.enforcement`, docs/enforcement.md), with
//! what stands in the way of the driver's per-cgroup limits and the fix for each: the driver
//! version (R615+) and its calls, cgroup v2 at the cgroup root and the backend it gives (the
//! kernel's `dmem` controller, else the driver's `misc` accounting), the hook the container
//! runtime runs (`node.enforcement_hook`), the state directory, and — on the device-plugin
//! path — a CDI strategy to hand the hook over (the `envvar` strategy cannot). For the CUDA
//! memory limiter: the library installed on the host (`node.limiter_dir`, or the one the node
//! agent installs at start from `node.limiter_library`), its architecture and glibc floor (the
//! newest glibc the containers' programs need; the node cannot see their images), the
//! per-container directory (`node.limiter_run_dir`, a tmpfs).
//!
//! The same decision as the node agent's ([`crate::node::enforcement::decide`]), over the
//! files under `--root`: asked-for `driver` that cannot work fails (the role refuses to start
//! with these reasons); `auto` says what it came to and why, and warns where the driver's
//! limits work but the `envvar` strategy keeps the device-plugin path from them. Fake GPUs
//! skip it. It reads only (the state directory is looked at, never created).

use std::sync::Arc;
use std::time::Duration;

use super::gpus::Probe;
use super::host::HostRoot;
use super::report::{Check, Status};
use crate::config::enforcement::Enforcement;
use crate::config::{Config, NodeConfig};
use crate::gpu::limits::{LimitError, MemoryLimits};
use crate::node::enforcement::limiter::{self, LimiterSupport};
use crate::node::enforcement::{Mechanism, Support, decide, probe};
use crate::node::paths::ServingPath;

const ID: &str = "enforcement";
const TITLE: &str = "GPU memory enforcement";
/// How long opening the way to the driver's limits may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// `[node]` with its host paths under `host` (doctor reads the host through `--root`).
fn under_root(host: &HostRoot, node: &NodeConfig) -> NodeConfig {
    let mut n = node.clone();
    n.cgroup_root = host.path(&node.cgroup_root);
    n.enforcement_hook = host.path(&node.enforcement_hook);
    n.enforcement_state_dir = host.path(&node.enforcement_state_dir);
    n.limiter_dir = host.path(&node.limiter_dir);
    n.limiter_run_dir = host.path(&node.limiter_run_dir);
    if !node.limiter_library.as_os_str().is_empty() {
        n.limiter_library = host.path(&node.limiter_library);
    }
    n
}

/// Opens the configured backend's way to the limits, off the runtime and within a deadline.
async fn open_limits(config: &Config) -> Result<Arc<dyn MemoryLimits>, LimitError> {
    let opened = tokio::time::timeout(OPEN_TIMEOUT, async {
        let backend = crate::gpu::open_off_runtime(&config.gpu)
            .await
            .map_err(|e| LimitError::Unavailable(e.to_string()))?;
        tokio::task::spawn_blocking(move || backend.memory_limits())
            .await
            .map_err(|e| LimitError::Unavailable(format!("the probe did not finish: {e}")))?
    })
    .await;
    opened.unwrap_or_else(|_| {
        Err(LimitError::Unavailable(format!(
            "no answer within {} s",
            OPEN_TIMEOUT.as_secs()
        )))
    })
}

/// The `enforcement` check for the serving paths of this node: the device plugin's, and the
/// DRA path's when `dra`.
pub async fn check(host: &HostRoot, config: &Config, gpus: &Probe, dra: bool) -> Check {
    let node = under_root(host, &config.node);
    if config.gpu.backend == crate::config::GpuBackendKind::Fake {
        return Check::new(
            ID,
            TITLE,
            Status::Skip,
            "fake GPUs: there is no driver to enforce GPU memory shares with",
        );
    }
    let Ok(inventory) = &gpus.result else {
        return Check::new(
            ID,
            TITLE,
            Status::Skip,
            "GPU discovery failed (see gpu-access): nothing to decide for",
        );
    };
    let wants_driver = matches!(node.enforcement, Enforcement::Auto | Enforcement::Driver);
    let support = if wants_driver {
        let limits = open_limits(config).await;
        probe(&node, inventory, limits.as_ref().map(|l| l.as_ref()), false)
    } else {
        Support {
            problems: vec![format!("enforcement = {}", node.enforcement)],
            driver_version: inventory.driver_version.clone(),
            ..Support::default()
        }
    };
    let wants_limiter = matches!(node.enforcement, Enforcement::Auto | Enforcement::Limiter);
    let limiter = if wants_limiter {
        let (node, inventory) = (node.clone(), inventory.clone());
        tokio::task::spawn_blocking(move || limiter::probe(&node, &inventory, false))
            .await
            .unwrap_or_else(|e| LimiterSupport::not_asked(format!("the probe did not finish: {e}")))
    } else {
        LimiterSupport::not_asked(format!("enforcement = {}", node.enforcement))
    };
    let mut paths = vec![ServingPath::DevicePlugin];
    if dra {
        paths.push(ServingPath::Dra);
    }
    let mut lines = Vec::new();
    let mut used_limiter = false;
    let mut status = Status::Ok;
    let mut hints: Vec<String> = Vec::new();
    for path in paths {
        match decide(&node, &support, &limiter, path) {
            Ok(d) => {
                let backend = match (d.mechanism, support.backend) {
                    (Mechanism::Driver, Some(b)) => format!(" ({b} backend)"),
                    _ => String::new(),
                };
                for gpu in &inventory.devices {
                    lines.push(format!(
                        "GPU {} ({}) on {path}: {}{backend}",
                        gpu.index, gpu.uuid, d.mechanism
                    ));
                }
                lines.push(format!("  why: {}", d.why));
                if d.mechanism == Mechanism::Limiter {
                    used_limiter = true;
                }
                // The driver's limits are there, but the envvar strategy cannot hand the hook
                // over: the one fallback that a flag fixes.
                if d.mechanism != Mechanism::Driver
                    && node.enforcement == Enforcement::Auto
                    && support.ok()
                    && path == ServingPath::DevicePlugin
                {
                    if status == Status::Ok {
                        status = Status::Warn;
                    }
                    hints.push(
                        "the driver's per-cgroup limits work on this node, but the device-plugin \
                         path needs a CDI strategy to hand their hook over: add cdi-cri (kubelet \
                         1.28+) or cdi-annotations to --device-list-strategy"
                            .to_string(),
                    );
                }
            }
            Err(refused) => {
                status = Status::Fail;
                lines.push(refused.to_string());
                hints.push(refused_hint(path, node.enforcement));
            }
        }
    }
    lines.extend(support.notes.iter().cloned());
    if used_limiter && let Some(lib) = &limiter.library {
        lines.extend(limiter_library_lines(lib, &node));
    }
    if wants_limiter {
        lines.extend(limiter.notes.iter().map(|n| format!("limiter: {n}")));
    }
    if wants_driver && support.ok() {
        lines.push(
            "the container runtime must apply CDI devices, hooks included (see the cdi-runtime \
             check; containerd needs enable_cdi)"
                .to_string(),
        );
    }
    let mut check = Check::new(ID, TITLE, status, lines.join("\n"));
    if !hints.is_empty() {
        hints.dedup();
        check = check.hint(hints.join("\n"));
    }
    check
}

/// The hint for a serving path whose enforcement was refused.
fn refused_hint(path: ServingPath, enforcement: Enforcement) -> String {
    format!(
        "the {} role refuses to start with enforcement = {} until each reason \
         above is fixed, or choose --enforcement auto",
        match path {
            ServingPath::DevicePlugin => "device-plugin",
            ServingPath::Dra => "dra-plugin",
        },
        enforcement,
    )
}

/// What the report says of the limiter library `lib` containers get on node `node`.
fn limiter_library_lines(lib: &limiter::library::LibraryInfo, node: &NodeConfig) -> [String; 2] {
    [
        format!(
            "limiter: {} ({}, {} KiB), needs glibc {} or newer in the containers' images \
             (statically linked and musl programs are not limited: the node cannot see images)",
            lib.path.display(),
            lib.arch,
            lib.bytes / 1024,
            lib.glibc_floor.as_deref().unwrap_or("(no version named)")
        ),
        format!(
            "limiter: each container's limits and ledgers in {}",
            node.limiter_run_dir.display()
        ),
    ]
}
