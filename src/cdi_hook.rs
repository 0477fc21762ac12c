//! `gpushare cdi-hook memory-limit`: the CDI `createRuntime` hook that puts a container's
//! share of GPU memory on the container's own cgroup, through the driver's per-cgroup limits
//! (R615+; docs/enforcement.md).
//!
//! The container runtime runs it as it runs every OCI hook: with the container's OCI state on
//! stdin (`id`, `pid`, `bundle`, `annotations`), after the container's cgroup exists and before
//! its program starts. It then:
//! 1. resolves the container's *leaf* cgroup from `pid` (`<proc-root>/<pid>/cgroup`, under
//!    `<cgroup-root>`; [`crate::cgroup`]) and refuses a cgroup that is not the container's own
//!    (the root, one outside the tree, one whose name does not hold the container's id): it
//!    never touches another container's cgroup;
//! 2. for each `--limit <GPU UUID>=<bytes>`: refuses a GPU in MIG mode, sets soft = hard = the
//!    bytes (NVML or `nvidia-smi memory-limits`, as `--gpu-backend` says) and reads them back;
//! 3. records what it set in `--state-dir` (`<container id>.json`, with the pod and container
//!    names from the bundle's CRI annotations), where the node agent reads every limit back.
//!
//! Setting the same limit again changes nothing, so it is idempotent. Any failure exits
//! non-zero with one line naming the GPU, the cgroup and the driver's error: the runtime then
//! does not start the container, and kubelet shows that line (fail closed).
//!
//! It does not load `gpushare.toml` (a host's configuration file cannot break a container's
//! start) and talks to no API server.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::Deserialize;

use crate::cgroup::{CgroupError, Roots};
use crate::config::{GpuBackendKind, GpuConfig};
use crate::gpu::limits::{LimitError, MemoryLimits};
use crate::node::enforcement::record::{self, LimitRecord, RecordError};

/// The most of stdin read as the OCI state.
const MAX_STATE_BYTES: u64 = 1 << 20;
/// The most of the bundle's `config.json` read.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// `gpushare cdi-hook`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The hook to run.
    #[command(subcommand)]
    pub hook: Hook,
}

/// The hooks.
#[derive(Debug, clap::Subcommand)]
pub enum Hook {
    /// Set a container's GPU memory limit on its own cgroup (a CDI createRuntime hook: reads
    /// the OCI state on stdin).
    MemoryLimit(MemoryLimitArgs),
}

/// `gpushare cdi-hook memory-limit`.
#[derive(Debug, clap::Args)]
pub struct MemoryLimitArgs {
    /// A GPU and the container's share of it, soft = hard limit: `<GPU UUID>=<bytes>`; repeat
    /// for each GPU
    #[arg(long = "limit", value_name = "UUID=BYTES", required = true, value_parser = parse_limit)]
    pub limits: Vec<(String, u64)>,
    /// How to reach the driver: nvml (libnvidia-ml.so.1) or nvidia-smi (memory-limits); auto
    /// tries nvml first
    #[arg(long, value_enum, default_value = "auto")]
    pub gpu_backend: GpuBackendKind,
    /// Path of libnvidia-ml.so.1 [default: the loader's search path]
    #[arg(long, value_name = "PATH")]
    pub nvml_library: Option<String>,
    /// The nvidia-smi program [default: nvidia-smi on PATH]
    #[arg(long, value_name = "PATH")]
    pub nvidia_smi: Option<String>,
    /// /proc as this hook sees it
    #[arg(long, value_name = "DIR", default_value = crate::cgroup::DEFAULT_PROC_ROOT)]
    pub proc_root: PathBuf,
    /// The cgroup v2 root as this hook sees it
    #[arg(long, value_name = "DIR", default_value = crate::cgroup::DEFAULT_CGROUP_ROOT)]
    pub cgroup_root: PathBuf,
    /// Where to record the limits set, for the node agent to read back
    #[arg(long, value_name = "DIR", default_value = "/var/run/gpushare/limits")]
    pub state_dir: PathBuf,
}

/// `<uuid>=<bytes>`.
fn parse_limit(text: &str) -> Result<(String, u64), HookError> {
    let bad = || HookError::BadLimit(text.to_string());
    let (uuid, bytes) = text.split_once('=').ok_or_else(bad)?;
    let bytes: u64 = bytes.trim().parse().map_err(|_| bad())?;
    if uuid.trim().is_empty() || bytes == 0 {
        return Err(bad());
    }
    Ok((uuid.trim().to_string(), bytes))
}

/// The OCI state a runtime hands a hook on stdin (what this hook reads of it).
#[derive(Debug, Default, Deserialize)]
pub struct OciState {
    /// The container's id.
    #[serde(default)]
    pub id: String,
    /// Its first process (in the runtime's PID namespace).
    #[serde(default)]
    pub pid: u32,
    /// The bundle directory (its `config.json`).
    #[serde(default)]
    pub bundle: String,
    /// The container's annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
struct BundleConfig {
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

/// Why the hook failed (the runtime then does not start the container).
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// A `--limit` value that is not `<uuid>=<bytes>`.
    #[error("--limit {0:?}: expected <GPU UUID>=<bytes>, bytes above 0")]
    BadLimit(String),
    /// stdin is not an OCI state.
    #[error("the OCI state on stdin cannot be read: {0}")]
    State(String),
    /// The container's cgroup could not be resolved or is refused.
    #[error("container {id}: {source}")]
    Cgroup {
        /// The container.
        id: String,
        /// Why.
        source: CgroupError,
    },
    /// The cgroup is not the container's own.
    #[error(
        "container {id}: cgroup {} is not the container's own (its name does not hold the \
         container id); refusing to limit a cgroup another container may share",
        cgroup.display()
    )]
    NotOwn {
        /// The container.
        id: String,
        /// The cgroup.
        cgroup: PathBuf,
    },
    /// No way to reach the driver.
    #[error("no way to set GPU memory limits: {0}")]
    Limits(LimitError),
    /// The GPU is in MIG mode.
    #[error(
        "GPU {gpu}, cgroup {}: the GPU is in MIG mode, where the driver's per-cgroup memory \
         limits do not apply",
        cgroup.display()
    )]
    Mig {
        /// The GPU.
        gpu: String,
        /// The cgroup.
        cgroup: PathBuf,
    },
    /// The driver refused the limit.
    #[error("GPU {gpu}, cgroup {}: cannot set the limit of {bytes} bytes: {error}", cgroup.display())]
    Set {
        /// The GPU.
        gpu: String,
        /// The cgroup.
        cgroup: PathBuf,
        /// The limit.
        bytes: u64,
        /// The driver's answer.
        error: LimitError,
    },
    /// The limit read back is not the one set.
    #[error("GPU {gpu}, cgroup {}: the limit reads back as {read}, not {bytes} bytes", cgroup.display())]
    Readback {
        /// The GPU.
        gpu: String,
        /// The cgroup.
        cgroup: PathBuf,
        /// The limit set.
        bytes: u64,
        /// What was read back (or why nothing was).
        read: String,
    },
    /// The record could not be written.
    #[error("the limit is set, but its record could not be written: {0}")]
    Record(#[from] RecordError),
}

/// Runs `gpushare cdi-hook`.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.hook {
        Hook::MemoryLimit(a) => {
            let mut stdin = Vec::new();
            std::io::stdin()
                .take(MAX_STATE_BYTES)
                .read_to_end(&mut stdin)
                .map_err(|e| HookError::State(e.to_string()))?;
            let done = tokio::task::spawn_blocking(move || memory_limit(&a, &stdin))
                .await
                .map_err(|e| anyhow::anyhow!("the hook did not finish: {e}"))??;
            tracing::info!(
                container = done.container_id,
                cgroup = done.cgroup,
                limits = ?done.limits,
                "GPU memory limit set"
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The pod and container names of the CRI annotations (containerd's `io.kubernetes.cri.*`,
/// CRI-O's `io.kubernetes.pod.*` / `io.kubernetes.container.name`).
fn identity(annotations: &BTreeMap<String, String>) -> (String, String, String, String) {
    let get = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| annotations.get(*k))
            .cloned()
            .unwrap_or_default()
    };
    (
        get(&[
            "io.kubernetes.cri.sandbox-namespace",
            "io.kubernetes.pod.namespace",
        ]),
        get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"]),
        get(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]),
        get(&[
            "io.kubernetes.cri.container-name",
            "io.kubernetes.container.name",
        ]),
    )
}

fn read_bundle(bundle: &str) -> BTreeMap<String, String> {
    if bundle.is_empty() {
        return BTreeMap::new();
    }
    let path = Path::new(bundle).join("config.json");
    let read = std::fs::File::open(&path).and_then(|f| {
        let mut bytes = Vec::new();
        f.take(MAX_CONFIG_BYTES).read_to_end(&mut bytes)?;
        Ok(bytes)
    });
    match read.map(|b| serde_json::from_slice::<BundleConfig>(&b)) {
        Ok(Ok(config)) => config.annotations,
        Ok(Err(e)) => {
            tracing::warn!(path = %path.display(), error = %e, "bundle config.json not understood; no pod names in the record");
            BTreeMap::new()
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "bundle config.json unreadable; no pod names in the record");
            BTreeMap::new()
        }
    }
}

/// The hook's work for the OCI state `stdin` (blocking); returns the record written.
pub fn memory_limit(args: &MemoryLimitArgs, stdin: &[u8]) -> Result<LimitRecord, HookError> {
    let state: OciState =
        serde_json::from_slice(stdin).map_err(|e| HookError::State(e.to_string()))?;
    if state.pid == 0 {
        return Err(HookError::State(
            "no pid: the hook must run at createRuntime (or later), when the container's \
             process exists"
                .to_string(),
        ));
    }
    let roots = Roots {
        proc: args.proc_root.clone(),
        cgroup: args.cgroup_root.clone(),
    };
    let leaf = crate::cgroup::leaf_of(&roots, state.pid).map_err(|source| HookError::Cgroup {
        id: state.id.clone(),
        source,
    })?;
    if !state.id.is_empty() && !leaf.name().contains(&state.id) {
        return Err(HookError::NotOwn {
            id: state.id,
            cgroup: leaf.path,
        });
    }
    let config = GpuConfig {
        backend: args.gpu_backend,
        nvml_library: args.nvml_library.clone().unwrap_or_default(),
        nvidia_smi: args
            .nvidia_smi
            .clone()
            .unwrap_or_else(|| "nvidia-smi".to_string()),
        ..GpuConfig::default()
    };
    let limits = crate::gpu::limits::open(&config).map_err(HookError::Limits)?;
    for (gpu, bytes) in &args.limits {
        apply(limits.as_ref(), gpu, &leaf.path, *bytes)?;
    }
    let mut annotations = state.annotations.clone();
    annotations.extend(read_bundle(&state.bundle));
    let (namespace, pod, pod_uid, container) = identity(&annotations);
    let id = if state.id.is_empty() {
        leaf.name().to_string()
    } else {
        state.id.clone()
    };
    let mut rec = record::read(&args.state_dir, &id).unwrap_or_default();
    if rec.cgroup != leaf.relative {
        rec.limits.clear();
    }
    rec.container_id = id;
    rec.cgroup = leaf.relative.clone();
    rec.namespace = namespace;
    rec.pod = pod;
    rec.pod_uid = pod_uid;
    rec.container = container;
    rec.limits.extend(args.limits.iter().cloned());
    record::write(&args.state_dir, &rec)?;
    Ok(rec)
}

/// Sets soft = hard = `bytes` of GPU `gpu` on `cgroup` and reads it back.
fn apply(limits: &dyn MemoryLimits, gpu: &str, cgroup: &Path, bytes: u64) -> Result<(), HookError> {
    if limits.mig_enabled(gpu) == Some(true) {
        return Err(HookError::Mig {
            gpu: gpu.to_string(),
            cgroup: cgroup.to_path_buf(),
        });
    }
    limits
        .set(gpu, cgroup, bytes, bytes)
        .map_err(|error| HookError::Set {
            gpu: gpu.to_string(),
            cgroup: cgroup.to_path_buf(),
            bytes,
            error,
        })?;
    let read = limits.get(gpu, cgroup);
    match read {
        Ok(r) if r.soft == bytes && r.hard == bytes => Ok(()),
        Ok(r) => Err(HookError::Readback {
            gpu: gpu.to_string(),
            cgroup: cgroup.to_path_buf(),
            bytes,
            read: format!("soft {} and hard {} bytes", r.soft, r.hard),
        }),
        Err(e) => Err(HookError::Readback {
            gpu: gpu.to_string(),
            cgroup: cgroup.to_path_buf(),
            bytes,
            read: format!("nothing ({e})"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse() {
        assert_eq!(
            parse_limit("GPU-1=4294967296").expect("ok"),
            ("GPU-1".to_string(), 4294967296)
        );
        for bad in ["GPU-1", "=5", "GPU-1=0", "GPU-1=x"] {
            assert!(parse_limit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pod_names_come_from_either_runtime() {
        let containerd = BTreeMap::from([
            (
                "io.kubernetes.cri.sandbox-namespace".to_string(),
                "d".to_string(),
            ),
            (
                "io.kubernetes.cri.sandbox-name".to_string(),
                "p".to_string(),
            ),
            (
                "io.kubernetes.cri.container-name".to_string(),
                "c".to_string(),
            ),
        ]);
        assert_eq!(
            identity(&containerd),
            ("d".into(), "p".into(), String::new(), "c".into())
        );
        let crio = BTreeMap::from([
            ("io.kubernetes.pod.namespace".to_string(), "d".to_string()),
            ("io.kubernetes.pod.uid".to_string(), "u".to_string()),
        ]);
        assert_eq!(identity(&crio).2, "u");
    }
}
