//! GPU memory enforcement on this node: which mechanism holds each container to its share
//! (`[node] enforcement`), what a container is handed for it, and — for the driver's
//! per-cgroup limits — the proof that every served container has its limit.
//!
//! The mechanisms, strongest first (docs/enforcement.md compares them):
//! - [`Mechanism::Driver`]: the driver's own per-cgroup limits (R615+, cgroup v2, no MIG). A
//!   CDI `createRuntime` hook (`gpushare cdi-hook memory-limit`, [`Enforcer::hook_edit`]) sets
//!   soft = hard = the share on the container's own cgroup before its first process runs, and
//!   records it ([`record`]); the node agent reads every record's limit back ([`readback`]).
//! - [`Mechanism::Limiter`]: the CUDA memory limiter preloaded into the container's programs
//!   through read-only mounts of `/etc/ld.so.preload`, the library, the container's limits
//!   file and its state directory ([`limiter`]); the node agent reads each container's ledger.
//! - [`Mechanism::Mps`]: the MPS control daemon's per-client pinned memory limit (the existing
//!   supervisor, `[node] mps`).
//! - [`Mechanism::None`]: nothing stops a container from using more than its share.
//!
//! `auto` takes the first a serving path can have: driver where [`probe`] finds no problem
//! (and, on the device-plugin path, a CDI strategy hands the hook over), else limiter where
//! [`limiter::probe`] finds the library installed and usable (any strategy: its mounts reach
//! the container on both paths), else mps where MPS is on, else none ([`decide`]).
//! Asked for explicitly, a mechanism that cannot work refuses the role's start with the
//! reason ([`Enforcer::admit`]) — the same reasons doctor's `enforcement` check prints.
//!
//! The hook reaches the container two ways: the DRA path puts it into each share's CDI device
//! of the per-claim spec (`crate::dra`); the device-plugin path hands over one more CDI device
//! per (GPU, size), `gpushare.io/memory-limit=<uuid>_<bytes>`, whose spec this module writes
//! into `enforcement_cdi_dir` ([`Enforcer::device_plugin_limit`]). Both also set NVIDIA's
//! `NVIDIA_GPU_MEMORY_REQUEST` / `NVIDIA_GPU_MEMORY_LIMIT` (MiB), so a runtime that runs
//! NVIDIA's own hook sets the same limit.
//!
//! It does not pick GPUs, speak a kubelet protocol or run the MPS daemon.

pub mod limiter;
pub mod readback;
pub mod record;
pub mod report;
pub mod status;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::paths::ServingPath;
use crate::config::enforcement::Enforcement;
use crate::config::{DeviceListStrategy, NodeConfig};
use crate::core::wire::{ENV_GPU_MEMORY_LIMIT, ENV_GPU_MEMORY_REQUEST};
use crate::gpu::cdi::{CdiHook, ContainerEditsSpec, DeviceSpecEdit, TransientSpec, WriteError};
use crate::gpu::limits::{LimitError, MemoryLimits};
use crate::gpu::{GpuBackend, Inventory};

/// The CDI kind of the device-plugin path's limit devices.
pub const LIMIT_CDI_KIND: &str = "gpushare.io/memory-limit";
/// The name part of the CDI annotation key of a limit device (after the prefix).
pub const LIMIT_CDI_ANNOTATION: &str = "gpushare_memory-limit";
/// The first driver release with per-cgroup memory limits.
pub const MIN_DRIVER_MAJOR: u32 = 615;
/// The OCI stage the hook runs at: the container's cgroup exists, its program has not started.
pub const HOOK_STAGE: &str = "createRuntime";
/// Seconds the runtime lets the hook run.
pub const HOOK_TIMEOUT_SECS: u32 = 30;
/// The hook's whole environment: a PATH to find nvidia-smi on the host.
pub const HOOK_PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const MIB: u64 = 1 << 20;

/// What holds a container to its share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mechanism {
    /// The driver's per-cgroup limits, set by the CDI hook.
    Driver,
    /// The CUDA memory limiter preloaded into the container.
    Limiter,
    /// The MPS daemon's pinned memory limit.
    Mps,
    /// Nothing.
    None,
}

impl Mechanism {
    /// `driver`, `limiter`, `mps`, `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mechanism::Driver => "driver",
            Mechanism::Limiter => "limiter",
            Mechanism::Mps => "mps",
            Mechanism::None => "none",
        }
    }
}

impl std::fmt::Display for Mechanism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the node offers of the driver's per-cgroup limits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Support {
    /// Why the driver's limits cannot be used here, each with its fix; empty: they can.
    pub problems: Vec<String>,
    /// How the limits are reached (`nvml`, `nvidia-smi`), when they can be.
    pub via: Option<&'static str>,
    /// `dmem` (the kernel's controller is there) or `misc` (the driver's own accounting).
    pub backend: Option<&'static str>,
    /// The driver version read.
    pub driver_version: String,
    /// Notes that do not stop the driver's limits (e.g. a GPU missing from dmem.capacity).
    pub notes: Vec<String>,
}

impl Support {
    /// Whether the driver's limits can be used.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The major of a driver version (`615.23.01` → 615).
pub fn driver_major(version: &str) -> Option<u32> {
    version.trim().split('.').next()?.parse().ok()
}

/// What the node offers of the driver's limits: `limits` (the GPU backend's way to them, or
/// why there is none), the driver version and GPUs of `inventory`, the cgroup v2 tree at
/// `config.cgroup_root`, the hook at `config.enforcement_hook` and the state directory
/// (created when `create_state_dir`, else only looked at: doctor changes nothing).
pub fn probe(
    config: &NodeConfig,
    inventory: &Inventory,
    limits: Result<&dyn MemoryLimits, &LimitError>,
    create_state_dir: bool,
) -> Support {
    let mut support = Support {
        driver_version: inventory.driver_version.clone(),
        ..Support::default()
    };
    match limits {
        Ok(l) => {
            support.via = Some(l.via());
            if l.has_limits() == Some(false) {
                support.problems.push(format!(
                    "the driver's NVML has no per-cgroup memory limits \
                     (nvmlDeviceSetMemoryLimits_v1): driver {} is older than R{MIN_DRIVER_MAJOR}; \
                     fix: upgrade the driver to R{MIN_DRIVER_MAJOR} (CUDA 13.4) or newer",
                    display_version(&inventory.driver_version)
                ));
            }
        }
        Err(e) => support.problems.push(format!(
            "no way to set the driver's limits: {e}; fix: run with --gpu-backend nvml (the \
             gpushare-glibc build) or nvidia-smi"
        )),
    }
    if support.problems.is_empty() {
        match driver_major(&inventory.driver_version) {
            Some(major) if major >= MIN_DRIVER_MAJOR => {}
            Some(_) => support.problems.push(format!(
                "driver {} is older than R{MIN_DRIVER_MAJOR}, the first with per-cgroup memory \
                 limits; fix: upgrade the driver to R{MIN_DRIVER_MAJOR} (CUDA 13.4) or newer",
                inventory.driver_version
            )),
            None => support.problems.push(format!(
                "the driver version {} cannot be read, so per-cgroup memory limits (R{MIN_DRIVER_MAJOR}+) \
                 cannot be relied on",
                display_version(&inventory.driver_version)
            )),
        }
    }
    let root = &config.cgroup_root;
    if crate::cgroup::is_v2(root) {
        let controllers = crate::cgroup::controllers(root);
        if controllers.iter().any(|c| c == "dmem") {
            support.backend = Some("dmem");
            let regions: Vec<String> = crate::cgroup::dmem_capacity(root)
                .into_iter()
                .map(|(name, _)| name)
                .collect();
            for gpu in &inventory.devices {
                let region = crate::cgroup::dmem_region(&gpu.pci_bus_id);
                if !regions.contains(&region) {
                    support.notes.push(format!(
                        "GPU {} ({}) has no {region} line in {}: the driver accounts it itself",
                        gpu.index,
                        gpu.uuid,
                        root.join("dmem.capacity").display()
                    ));
                }
            }
        } else {
            support.backend = Some("misc");
        }
    } else {
        support.problems.push(format!(
            "{} is not a cgroup v2 root (no cgroup.controllers): the driver's limits need cgroup \
             v2; fix: boot with systemd.unified_cgroup_hierarchy=1, or point --cgroup-root at \
             the host's cgroup v2 mount",
            root.display()
        ));
    }
    if let Err(why) = hook_present(&config.enforcement_hook) {
        support.problems.push(format!(
            "the hook {} {why}: the container runtime could not run it; fix: install gpushare \
             there on the host, or run the node agent with --enforcement-install-hook and that \
             directory mounted from the host",
            config.enforcement_hook.display()
        ));
    }
    let state = &config.enforcement_state_dir;
    let state_problem = if !create_state_dir {
        let parent_is_dir = state.parent().is_some_and(Path::is_dir);
        (!state.is_dir() && !parent_is_dir).then(|| "neither it nor its parent exists".to_string())
    } else if support.problems.is_empty() {
        // Created only when nothing else stands in the way (it is a host directory).
        std::fs::create_dir_all(state).err().map(|e| e.to_string())
    } else {
        None
    };
    if let Some(why) = state_problem {
        support.problems.push(format!(
            "the state directory {} cannot be used ({why}); fix: mount a host directory there \
             (the hook records the limits it sets in it, the node agent reads them back)",
            state.display()
        ));
    }
    support
}

fn display_version(v: &str) -> &str {
    if v.trim().is_empty() { "(unknown)" } else { v }
}

/// Whether `path` is an executable file.
fn hook_present(path: &Path) -> Result<(), &'static str> {
    let meta = std::fs::metadata(path).map_err(|_| "is not there")?;
    if !meta.is_file() {
        return Err("is not a file");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o111 == 0 {
            return Err("is not executable");
        }
    }
    Ok(())
}

/// Copies the running program to `target` when its content differs (a temporary file in the
/// same directory, made executable, renamed over it), so the container runtime finds the hook.
pub fn install_hook(target: &Path) -> std::io::Result<bool> {
    let me = std::env::current_exe()?;
    let ours = std::fs::read(&me)?;
    if std::fs::read(target).is_ok_and(|theirs| theirs == ours) {
        return Ok(false);
    }
    let dir = target.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".gpushare.")
        .tempfile_in(dir)?;
    std::io::Write::write_all(&mut tmp, &ours)?;
    tmp.as_file().sync_all()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))?;
    }
    tmp.persist(target).map_err(|e| e.error)?;
    Ok(true)
}

/// What a serving path's containers get, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    /// The mechanism.
    pub mechanism: Mechanism,
    /// Why this one (what `auto` found, or that it was asked for).
    pub why: String,
}

/// An asked-for mechanism that cannot work on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("enforcement = {asked} cannot work for {path} on this node: {}", .reasons.join("; "))]
pub struct Refused {
    /// What was asked.
    pub asked: Enforcement,
    /// The serving path.
    pub path: ServingPath,
    /// Why, each with its fix (doctor's `enforcement` check prints the same).
    pub reasons: Vec<String>,
}

/// Whether `path` can hand the hook over: the DRA path always (its spec carries it), the
/// device-plugin path with a CDI strategy.
fn hands_over_cdi(config: &NodeConfig, path: ServingPath) -> bool {
    match path {
        ServingPath::Dra => true,
        ServingPath::DevicePlugin => config.device_list_strategy.any_cdi(),
    }
}

const NEEDS_CDI: &str = "the device-plugin path hands the hook over as a CDI device, so \
     enforcement needs a CDI strategy and --device-list-strategy has none; fix: add cdi-cri \
     (kubelet 1.28+) or cdi-annotations to --device-list-strategy";

/// What `path`'s containers get on a node that offers `support` (the driver's limits) and
/// `limiter`, for `config.enforcement`.
pub fn decide(
    config: &NodeConfig,
    support: &Support,
    limiter: &limiter::LimiterSupport,
    path: ServingPath,
) -> Result<Decision, Refused> {
    let cdi = hands_over_cdi(config, path);
    let mut driver_problems = support.problems.clone();
    if !cdi {
        driver_problems.push(NEEDS_CDI.to_string());
    }
    let driver_why = || {
        format!(
            "driver {} has per-cgroup memory limits ({} backend, through {})",
            support.driver_version,
            support.backend.unwrap_or("?"),
            support.via.unwrap_or("?")
        )
    };
    let limiter_why = || match &limiter.library {
        Some(lib) => format!(
            "the CUDA memory limiter is installed ({}, {}, needs glibc {} in containers)",
            lib.path.display(),
            lib.arch,
            lib.glibc_floor.as_deref().unwrap_or("?")
        ),
        None => "the CUDA memory limiter is installed".to_string(),
    };
    match config.enforcement {
        Enforcement::Limiter if limiter.ok() => Ok(Decision {
            mechanism: Mechanism::Limiter,
            why: format!("asked for; {}", limiter_why()),
        }),
        Enforcement::Limiter => Err(Refused {
            asked: Enforcement::Limiter,
            path,
            reasons: limiter.problems.clone(),
        }),
        Enforcement::Driver if driver_problems.is_empty() => Ok(Decision {
            mechanism: Mechanism::Driver,
            why: format!("asked for; {}", driver_why()),
        }),
        Enforcement::Driver => Err(Refused {
            asked: Enforcement::Driver,
            path,
            reasons: driver_problems,
        }),
        Enforcement::Mps => Ok(Decision {
            mechanism: Mechanism::Mps,
            why: "asked for".to_string(),
        }),
        Enforcement::None => Ok(Decision {
            mechanism: Mechanism::None,
            why: "asked for".to_string(),
        }),
        Enforcement::Auto if driver_problems.is_empty() => Ok(Decision {
            mechanism: Mechanism::Driver,
            why: driver_why(),
        }),
        Enforcement::Auto if limiter.ok() => Ok(Decision {
            mechanism: Mechanism::Limiter,
            why: format!(
                "{}; not driver: {}",
                limiter_why(),
                driver_problems.join("; ")
            ),
        }),
        Enforcement::Auto => {
            let not_driver = format!(
                "not driver: {}; not limiter: {}",
                driver_problems.join("; "),
                limiter.problems.join("; ")
            );
            Ok(if config.mps {
                Decision {
                    mechanism: Mechanism::Mps,
                    why: format!("MPS is on; {not_driver}"),
                }
            } else {
                Decision {
                    mechanism: Mechanism::None,
                    why: format!("MPS is off; {not_driver}"),
                }
            })
        }
    }
}

/// `bytes` rounded down to whole MiB (the granularity `nvidia-smi memory-limits` sets).
pub fn whole_mib(bytes: u64) -> u64 {
    bytes / MIB * MIB
}

/// The envs a container under driver enforcement gets for a share of `bytes`: NVIDIA's
/// request and limit, in MiB.
pub fn limit_envs(bytes: u64) -> [(String, String); 2] {
    let mib = (bytes / MIB).to_string();
    [
        (ENV_GPU_MEMORY_REQUEST.to_string(), mib.clone()),
        (ENV_GPU_MEMORY_LIMIT.to_string(), mib),
    ]
}

/// The node agent's enforcement: what was found, what each path gets, the hook it hands
/// over, and the readback's state.
pub struct Enforcer {
    config: NodeConfig,
    support: Support,
    limiter: limiter::Limiter,
    limits: Option<Arc<dyn MemoryLimits>>,
    decisions: BTreeMap<ServingPath, Result<Decision, Refused>>,
    status: Arc<readback::Status>,
}

impl std::fmt::Debug for Enforcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enforcer")
            .field("support", &self.support)
            .field("limiter", &self.limiter)
            .field("decisions", &self.decisions)
            .finish_non_exhaustive()
    }
}

impl Enforcer {
    /// Finds what the node offers (blocking: loads NVML or runs nothing, reads the cgroup
    /// tree; installs the hook first when `enforcement_install_hook`, and the limiter library
    /// when the limiter may be chosen) and decides each path.
    pub fn prepare(
        config: &NodeConfig,
        backend: &Arc<dyn GpuBackend>,
        inventory: &Inventory,
    ) -> Enforcer {
        let wants_driver = matches!(config.enforcement, Enforcement::Auto | Enforcement::Driver);
        if wants_driver && config.enforcement_install_hook {
            match install_hook(&config.enforcement_hook) {
                Ok(true) => {
                    tracing::info!(hook = %config.enforcement_hook.display(), "installed the memory-limit hook")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(hook = %config.enforcement_hook.display(), error = %e, "could not install the memory-limit hook")
                }
            }
        }
        let (support, limits) = if wants_driver {
            let limits = backend.memory_limits();
            let support = probe(config, inventory, limits.as_ref().map(|l| l.as_ref()), true);
            (support, limits.ok())
        } else {
            (
                Support {
                    problems: vec![format!("enforcement = {}", config.enforcement)],
                    driver_version: inventory.driver_version.clone(),
                    ..Support::default()
                },
                None,
            )
        };
        let wants_limiter = matches!(config.enforcement, Enforcement::Auto | Enforcement::Limiter);
        let limiter_support = if wants_limiter {
            limiter::probe(config, inventory, true)
        } else {
            limiter::LimiterSupport::not_asked(format!("enforcement = {}", config.enforcement))
        };
        let decisions = [ServingPath::DevicePlugin, ServingPath::Dra]
            .into_iter()
            .map(|p| (p, decide(config, &support, &limiter_support, p)))
            .collect();
        Enforcer {
            config: config.clone(),
            support,
            limiter: limiter::Limiter::new(config, limiter_support),
            limits,
            decisions,
            status: Arc::new(readback::Status::default()),
        }
    }

    /// [`Enforcer::prepare`] on a blocking thread.
    pub async fn prepare_off_runtime(
        config: &NodeConfig,
        backend: &Arc<dyn GpuBackend>,
        inventory: &Inventory,
    ) -> Enforcer {
        let (config, backend, inventory) = (config.clone(), backend.clone(), inventory.clone());
        match tokio::task::spawn_blocking(move || Enforcer::prepare(&config, &backend, &inventory))
            .await
        {
            Ok(e) => e,
            Err(e) => Enforcer {
                support: Support {
                    problems: vec![format!("probing the node did not finish: {e}")],
                    ..Support::default()
                },
                limits: None,
                limiter: limiter::Limiter::new(
                    &NodeConfig::default(),
                    limiter::LimiterSupport::not_asked("the probe did not finish".to_string()),
                ),
                decisions: BTreeMap::new(),
                status: Arc::new(readback::Status::default()),
                config: NodeConfig::default(),
            },
        }
    }

    /// What `path` gets, or why the asked-for mechanism cannot work (a role refuses to start
    /// on it); logs the choice.
    pub fn admit(&self, path: ServingPath) -> Result<Decision, Refused> {
        let decided = self.decisions.get(&path).cloned().unwrap_or_else(|| {
            Err(Refused {
                asked: self.config.enforcement,
                path,
                reasons: self.support.problems.clone(),
            })
        });
        match &decided {
            Ok(d) => tracing::info!(
                path = %path,
                asked = %self.config.enforcement,
                mechanism = %d.mechanism,
                why = %d.why,
                "GPU memory enforcement"
            ),
            Err(e) => tracing::error!("{e}"),
        }
        decided
    }

    /// The mechanism `path`'s containers get (none when refused).
    pub fn mechanism(&self, path: ServingPath) -> Mechanism {
        match self.decisions.get(&path) {
            Some(Ok(d)) => d.mechanism,
            _ => Mechanism::None,
        }
    }

    /// What the node offers of the driver's limits.
    pub fn support(&self) -> &Support {
        &self.support
    }

    /// The CUDA memory limiter: what was found, the containers' files.
    pub fn limiter(&self) -> &limiter::Limiter {
        &self.limiter
    }

    /// The way to the driver's limits, when there is one.
    pub fn limits(&self) -> Option<&Arc<dyn MemoryLimits>> {
        self.limits.as_ref()
    }

    /// `[node]` as the enforcer read it.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The readback's state (rows, counters) and its watch.
    pub fn status(&self) -> &Arc<readback::Status> {
        &self.status
    }

    /// The `createRuntime` hook that sets `bytes` (rounded down to MiB, what `nvidia-smi`
    /// can set) on GPU `uuid` for the container it runs for.
    pub fn hook_edit(&self, uuid: &str, bytes: u64) -> CdiHook {
        let bytes = whole_mib(bytes);
        let mut args = vec![
            "gpushare".to_string(),
            "cdi-hook".to_string(),
            "memory-limit".to_string(),
            "--limit".to_string(),
            format!("{uuid}={bytes}"),
        ];
        if let Some(limits) = &self.limits {
            args.extend(limits.hook_args());
        }
        args.extend([
            "--state-dir".to_string(),
            self.config.enforcement_state_dir.display().to_string(),
        ]);
        if self.config.runtime_cgroup_root != Path::new(crate::cgroup::DEFAULT_CGROUP_ROOT) {
            args.extend([
                "--cgroup-root".to_string(),
                self.config.runtime_cgroup_root.display().to_string(),
            ]);
        }
        if self.config.runtime_proc_root != Path::new(crate::cgroup::DEFAULT_PROC_ROOT) {
            args.extend([
                "--proc-root".to_string(),
                self.config.runtime_proc_root.display().to_string(),
            ]);
        }
        CdiHook {
            hook_name: HOOK_STAGE.to_string(),
            path: self.config.enforcement_hook.display().to_string(),
            args,
            env: vec![HOOK_PATH_ENV.to_string()],
            timeout: Some(HOOK_TIMEOUT_SECS),
        }
    }

    /// The device-plugin path's limit device for `bytes` of GPU `uuid`: writes (or rewrites)
    /// its spec into `enforcement_cdi_dir` and returns its qualified CDI name
    /// (`gpushare.io/memory-limit=<uuid>_<bytes>`). Blocking (a file write).
    pub fn device_plugin_limit(&self, uuid: &str, bytes: u64) -> Result<String, WriteError> {
        let bytes = whole_mib(bytes);
        let name = format!("{uuid}_{bytes}");
        let spec = TransientSpec {
            devices: vec![DeviceSpecEdit {
                name: name.clone(),
                container_edits: ContainerEditsSpec {
                    hooks: vec![self.hook_edit(uuid, bytes)],
                    ..ContainerEditsSpec::default()
                },
            }],
            ..TransientSpec::new(LIMIT_CDI_KIND)
        };
        crate::gpu::cdi::write_spec(&self.config.enforcement_cdi_dir, &name, &spec)?;
        Ok(format!("{LIMIT_CDI_KIND}={name}"))
    }

    /// The CDI annotation key of a limit device (`cdi-annotations`).
    pub fn limit_annotation_key(&self) -> String {
        format!(
            "{}{LIMIT_CDI_ANNOTATION}",
            self.config.cdi_annotation_prefix
        )
    }

    /// How the device-plugin path names the limit device: as a CDI device (`cdi-cri`) and/or
    /// in the annotation (`cdi-annotations`).
    pub fn device_plugin_strategies(&self) -> (bool, bool) {
        let s = &self.config.device_list_strategy;
        (
            s.includes(DeviceListStrategy::CdiCri),
            s.includes(DeviceListStrategy::CdiAnnotations),
        )
    }

    /// Rewrites the limit specs already in `enforcement_cdi_dir` with the hook as configured
    /// now (a container restarted after an upgrade runs the current hook); returns how many.
    pub fn refresh_limit_specs(&self) -> usize {
        let dir = &self.config.enforcement_cdi_dir;
        let prefix = format!("{}_", LIMIT_CDI_KIND.replace('/', "_"));
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        let mut n = 0;
        for entry in entries.flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = file
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".json"))
            else {
                continue;
            };
            let Some((uuid, bytes)) = id.rsplit_once('_') else {
                continue;
            };
            let Ok(bytes) = bytes.parse::<u64>() else {
                continue;
            };
            if self.device_plugin_limit(uuid, bytes).is_ok() {
                n += 1;
            }
        }
        n
    }

    /// Where the hook records the limits it set.
    pub fn state_dir(&self) -> &PathBuf {
        &self.config.enforcement_state_dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeviceListStrategies;

    fn supported() -> Support {
        Support {
            via: Some("nvml"),
            backend: Some("dmem"),
            driver_version: "615.10".to_string(),
            ..Support::default()
        }
    }

    fn no_limiter() -> limiter::LimiterSupport {
        limiter::LimiterSupport::not_asked("the limiter library is not installed".into())
    }

    fn installed() -> limiter::LimiterSupport {
        limiter::LimiterSupport {
            library: Some(limiter::library::LibraryInfo {
                path: "/var/lib/gpushare/limiter/libgpushare_limiter.so".into(),
                bytes: 1,
                arch: "x86_64".into(),
                glibc_floor: Some("2.17".into()),
            }),
            ..limiter::LimiterSupport::default()
        }
    }

    fn config(enforcement: Enforcement, mps: bool, cdi: bool) -> NodeConfig {
        NodeConfig {
            enforcement,
            mps,
            device_list_strategy: DeviceListStrategies::new(if cdi {
                vec![DeviceListStrategy::CdiCri]
            } else {
                vec![DeviceListStrategy::Envvar]
            }),
            ..NodeConfig::default()
        }
    }

    #[test]
    fn auto_prefers_driver_then_mps_then_none() {
        let ok = supported();
        let bad = Support {
            problems: vec!["driver 550 is older than R615".into()],
            ..supported()
        };
        let d =
            |c: &NodeConfig, s: &Support, p| decide(c, s, &no_limiter(), p).expect("auto decides");
        let dra = ServingPath::Dra;
        let dp = ServingPath::DevicePlugin;
        assert_eq!(
            d(&config(Enforcement::Auto, true, false), &ok, dra).mechanism,
            Mechanism::Driver
        );
        // The device-plugin path without a CDI strategy cannot hand the hook over.
        let no_cdi = d(&config(Enforcement::Auto, true, false), &ok, dp);
        assert_eq!(no_cdi.mechanism, Mechanism::Mps);
        assert!(no_cdi.why.contains("cdi-cri"), "{}", no_cdi.why);
        assert_eq!(
            d(&config(Enforcement::Auto, true, true), &ok, dp).mechanism,
            Mechanism::Driver
        );
        let fallback = d(&config(Enforcement::Auto, false, true), &bad, dp);
        assert_eq!(fallback.mechanism, Mechanism::None);
        assert!(fallback.why.contains("older than R615"), "{}", fallback.why);
    }

    #[test]
    fn driver_asked_for_refuses_with_the_reasons() {
        let bad = Support {
            problems: vec!["driver 550 is older than R615; fix: upgrade".into()],
            ..supported()
        };
        let err = decide(
            &config(Enforcement::Driver, false, false),
            &bad,
            &no_limiter(),
            ServingPath::DevicePlugin,
        )
        .expect_err("refused");
        let msg = err.to_string();
        assert!(msg.contains("older than R615"), "{msg}");
        assert!(msg.contains("cdi-cri"), "{msg}");
        assert!(
            decide(
                &config(Enforcement::Driver, false, false),
                &supported(),
                &no_limiter(),
                ServingPath::Dra
            )
            .is_ok()
        );
        assert_eq!(
            decide(
                &config(Enforcement::None, true, true),
                &supported(),
                &installed(),
                ServingPath::Dra
            )
            .expect("none")
            .mechanism,
            Mechanism::None
        );
    }

    #[test]
    fn auto_takes_the_limiter_after_the_driver_and_before_mps_on_either_strategy() {
        let bad = Support {
            problems: vec!["driver 550 is older than R615".into()],
            ..supported()
        };
        for (path, cdi) in [
            (ServingPath::DevicePlugin, false),
            (ServingPath::DevicePlugin, true),
            (ServingPath::Dra, false),
        ] {
            let d = decide(
                &config(Enforcement::Auto, true, cdi),
                &bad,
                &installed(),
                path,
            )
            .expect("auto decides");
            assert_eq!(d.mechanism, Mechanism::Limiter, "{path} cdi={cdi}");
            assert!(d.why.contains("glibc 2.17"), "{}", d.why);
            assert!(d.why.contains("older than R615"), "{}", d.why);
        }
        // The driver's limits still come first where they work.
        assert_eq!(
            decide(
                &config(Enforcement::Auto, true, true),
                &supported(),
                &installed(),
                ServingPath::DevicePlugin
            )
            .expect("auto")
            .mechanism,
            Mechanism::Driver
        );
        let mps = decide(
            &config(Enforcement::Auto, true, true),
            &bad,
            &no_limiter(),
            ServingPath::Dra,
        )
        .expect("auto");
        assert_eq!(mps.mechanism, Mechanism::Mps);
        assert!(
            mps.why.contains("not limiter: the limiter library"),
            "{}",
            mps.why
        );
    }

    #[test]
    fn limiter_asked_for_refuses_without_the_library_and_needs_no_driver() {
        let err = decide(
            &config(Enforcement::Limiter, false, false),
            &supported(),
            &no_limiter(),
            ServingPath::DevicePlugin,
        )
        .expect_err("refused");
        assert!(
            err.to_string()
                .contains("enforcement = limiter cannot work"),
            "{err}"
        );
        assert!(err.to_string().contains("not installed"), "{err}");
        let ok = decide(
            &config(Enforcement::Limiter, false, false),
            &Support {
                problems: vec!["enforcement = limiter".into()],
                ..Support::default()
            },
            &installed(),
            ServingPath::DevicePlugin,
        )
        .expect("the envvar strategy is enough");
        assert_eq!(ok.mechanism, Mechanism::Limiter);
        assert!(ok.why.starts_with("asked for"), "{}", ok.why);
    }

    #[test]
    fn limit_envs_are_mib() {
        assert_eq!(
            limit_envs(4 << 30),
            [
                ("NVIDIA_GPU_MEMORY_REQUEST".to_string(), "4096".to_string()),
                ("NVIDIA_GPU_MEMORY_LIMIT".to_string(), "4096".to_string())
            ]
        );
        assert_eq!(driver_major("615.23.01"), Some(615));
        assert_eq!(driver_major(""), None);
    }
}
