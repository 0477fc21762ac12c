//! Per-cgroup GPU memory limits, the driver's own ("MPS v3 memory partitioning", driver R615 /
//! CUDA 13.4): a cgroup's soft limit (its guaranteed share) and hard limit (past it an
//! allocation fails out of memory) on one GPU, set by root and read back by anyone with the
//! memory the cgroup uses. The cgroup is named by the full path of its directory.
//!
//! Two ways in, as GPU access has ([`MemoryLimits`]): NVML's `nvmlDeviceSetMemoryLimits_v1` /
//! `nvmlDeviceGetMemoryLimits_v1` through `gpushare-nvml-limits` (the dynamically linked
//! builds), and `nvidia-smi memory-limits --set/--get` (the static build, which cannot load
//! NVML). [`open`] picks one for `[gpu] backend` as [`super::open`] does. Answers are typed
//! ([`LimitError`]) so that callers can tell "this driver is too old" from "memory
//! partitioning is off" from "this cgroup has no dmem files".
//!
//! It does not find a container's cgroup ([`crate::cgroup`]) or decide which limit applies.

use std::ffi::OsStr;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpushare_nvml_limits::{Nvml, code};

pub use super::backend::{LimitError, LimitReading, MemoryLimits, NO_LIMIT};
use super::driver::{DEFAULT_LIBRARY, run_args};
use crate::config::{GpuBackendKind, GpuConfig};

const MIB: u64 = 1 << 20;
/// How long one `nvidia-smi memory-limits` may run.
const SMI_TIMEOUT: Duration = Duration::from_secs(20);

/// The way to limits `config` selects: `nvml` (its library), `nvidia-smi` (its program),
/// `auto` NVML where it loads, else nvidia-smi; the fake backend has none.
pub fn open(config: &GpuConfig) -> Result<Arc<dyn MemoryLimits>, LimitError> {
    match config.backend {
        GpuBackendKind::Fake => Err(LimitError::Unavailable(
            "the fake GPU backend has no driver to set memory limits with".to_string(),
        )),
        GpuBackendKind::Nvml => Ok(Arc::new(NvmlLimits::open(&config.nvml_library)?)),
        GpuBackendKind::NvidiaSmi => Ok(Arc::new(SmiLimits::new(&config.nvidia_smi))),
        GpuBackendKind::Auto => match NvmlLimits::open(&config.nvml_library) {
            Ok(nvml) => Ok(Arc::new(nvml)),
            Err(e) => {
                tracing::debug!(error = %e, "NVML unavailable for memory limits; using nvidia-smi");
                Ok(Arc::new(SmiLimits::new(&config.nvidia_smi)))
            }
        },
    }
}

/// Limits through NVML.
pub struct NvmlLimits {
    nvml: Nvml,
    library: String,
}

impl fmt::Debug for NvmlLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlLimits")
            .field("nvml", &self.nvml)
            .finish()
    }
}

impl NvmlLimits {
    /// Loads and initialises `library` (empty: `libnvidia-ml.so.1` from the loader's path).
    pub fn open(library: &str) -> Result<NvmlLimits, LimitError> {
        let configured = library.to_string();
        let library = if library.is_empty() {
            DEFAULT_LIBRARY
        } else {
            library
        };
        if cfg!(target_env = "musl") {
            return Err(LimitError::Unavailable(format!(
                "this gpushare build is statically linked (musl) and cannot load {library}; \
                 nvidia-smi memory-limits is its way to the driver"
            )));
        }
        let nvml = Nvml::open(OsStr::new(library)).map_err(|e| match e {
            gpushare_nvml_limits::Error::Load { .. }
            | gpushare_nvml_limits::Error::Symbol { .. } => LimitError::Unavailable(e.to_string()),
            other => nvml_error(other),
        })?;
        Ok(NvmlLimits {
            nvml,
            library: configured,
        })
    }
}

fn nvml_error(e: gpushare_nvml_limits::Error) -> LimitError {
    let text = e.to_string();
    match e {
        gpushare_nvml_limits::Error::NoMemoryLimits => LimitError::TooOld(text),
        gpushare_nvml_limits::Error::Load { .. } | gpushare_nvml_limits::Error::Symbol { .. } => {
            LimitError::Unavailable(text)
        }
        gpushare_nvml_limits::Error::Nul { .. } => LimitError::Failed(text),
        gpushare_nvml_limits::Error::Call(c) => match c.code {
            code::NOT_SUPPORTED => LimitError::NotSupported(text),
            code::NOT_FOUND => LimitError::NotFound(text),
            code::NO_PERMISSION => LimitError::NoPermission(text),
            code::FUNCTION_NOT_FOUND => LimitError::TooOld(text),
            code::DRIVER_NOT_LOADED => LimitError::Unavailable(text),
            _ => LimitError::Failed(text),
        },
    }
}

/// A UUID the driver does not know answers `NOT_FOUND` or `INVALID_ARGUMENT` from the handle
/// lookup: that is an unknown GPU, not a missing cgroup.
fn device_error(e: gpushare_nvml_limits::Error) -> LimitError {
    if let gpushare_nvml_limits::Error::Call(c) = &e
        && c.call == "nvmlDeviceGetHandleByUUID"
        && matches!(c.code, code::NOT_FOUND | code::INVALID_ARGUMENT)
    {
        return LimitError::UnknownGpu(e.to_string());
    }
    nvml_error(e)
}

fn path_text(cgroup: &Path) -> Result<&str, LimitError> {
    cgroup
        .to_str()
        .ok_or_else(|| LimitError::Failed(format!("{} is not UTF-8", cgroup.display())))
}

impl MemoryLimits for NvmlLimits {
    fn via(&self) -> &'static str {
        "nvml"
    }

    fn set(&self, gpu: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), LimitError> {
        self.nvml
            .set_limits(gpu, path_text(cgroup)?, soft, hard)
            .map_err(device_error)
    }

    fn get(&self, gpu: &str, cgroup: &Path) -> Result<LimitReading, LimitError> {
        let got = self
            .nvml
            .get_limits(gpu, path_text(cgroup)?)
            .map_err(device_error)?;
        Ok(LimitReading {
            soft: got.soft,
            hard: got.hard,
            used: got.used,
        })
    }

    fn mig_enabled(&self, gpu: &str) -> Option<bool> {
        self.nvml.mig_enabled(gpu).ok().flatten()
    }

    fn has_limits(&self) -> Option<bool> {
        Some(self.nvml.has_limits())
    }

    fn hook_args(&self) -> Vec<String> {
        let mut args = vec!["--gpu-backend".to_string(), "nvml".to_string()];
        if !self.library.is_empty() && self.library != DEFAULT_LIBRARY {
            args.extend(["--nvml-library".to_string(), self.library.clone()]);
        }
        args
    }
}

/// Limits through `nvidia-smi memory-limits` (values in MiB; `max` is no hard limit).
#[derive(Clone, Debug)]
pub struct SmiLimits {
    program: String,
}

impl SmiLimits {
    /// `program` (empty: `nvidia-smi` on PATH).
    pub fn new(program: &str) -> SmiLimits {
        SmiLimits {
            program: if program.is_empty() {
                "nvidia-smi".to_string()
            } else {
                program.to_string()
            },
        }
    }

    fn run(&self, args: &[&str]) -> Result<String, LimitError> {
        let run = run_args(&self.program, args, SMI_TIMEOUT)
            .map_err(|e| LimitError::Unavailable(e.reason()))?;
        let text = run.text();
        if run.success {
            return Ok(run.stdout);
        }
        let shown = format!(
            "`{} {}` failed ({}): {}",
            self.program,
            args.join(" "),
            run.status,
            if text.is_empty() {
                "(no output)"
            } else {
                &text
            }
        );
        Err(classify_smi(&text, shown))
    }
}

/// What a failed `nvidia-smi memory-limits` said, as a [`LimitError`].
fn classify_smi(text: &str, shown: String) -> LimitError {
    let lower = text.to_ascii_lowercase();
    if lower.contains("not recognized")
        || lower.contains("unknown option")
        || lower.contains("invalid option")
        || lower.contains("invalid command")
    {
        LimitError::TooOld(shown)
    } else if lower.contains("not supported") {
        LimitError::NotSupported(shown)
    } else if lower.contains("permission") {
        LimitError::NoPermission(shown)
    } else if lower.contains("no devices were found")
        || lower.contains("invalid gpu")
        || lower.contains("no gpu")
        || lower.contains("unable to find")
    {
        LimitError::UnknownGpu(shown)
    } else if lower.contains("not found") || lower.contains("no such file") {
        LimitError::NotFound(shown)
    } else {
        LimitError::Failed(shown)
    }
}

fn mib_arg(bytes: u64) -> String {
    if bytes == NO_LIMIT {
        "max".to_string()
    } else {
        (bytes / MIB).to_string()
    }
}

/// A `<n> MiB` or `max` value of `nvidia-smi memory-limits --get`.
fn parse_mib(value: &str) -> Option<u64> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("max") || value.eq_ignore_ascii_case("unlimited") {
        return Some(NO_LIMIT);
    }
    let number = value.strip_suffix("MiB").unwrap_or(value).trim();
    number.parse::<u64>().ok()?.checked_mul(MIB)
}

/// Parses `nvidia-smi memory-limits --get` (`soft limit: 4096 MiB`, `hard limit: …`, `current
/// used: …`).
pub fn parse_smi_get(text: &str) -> Option<LimitReading> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim().eq_ignore_ascii_case(name)).then(|| parse_mib(v))?
        })
    };
    Some(LimitReading {
        soft: field("soft limit")?,
        hard: field("hard limit")?,
        used: field("current used").unwrap_or(0),
    })
}

impl MemoryLimits for SmiLimits {
    fn via(&self) -> &'static str {
        "nvidia-smi"
    }

    fn set(&self, gpu: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), LimitError> {
        let (soft, hard) = (mib_arg(soft), mib_arg(hard));
        self.run(&[
            "memory-limits",
            "--set",
            "-n",
            path_text(cgroup)?,
            "--soft-limit",
            &soft,
            "--hard-limit",
            &hard,
            "-i",
            gpu,
        ])
        .map(|_| ())
    }

    fn get(&self, gpu: &str, cgroup: &Path) -> Result<LimitReading, LimitError> {
        let out = self.run(&[
            "memory-limits",
            "--get",
            "-n",
            path_text(cgroup)?,
            "-i",
            gpu,
        ])?;
        parse_smi_get(&out).ok_or_else(|| {
            LimitError::Failed(format!(
                "`{} memory-limits --get` printed no soft and hard limit: {}",
                self.program,
                out.trim()
            ))
        })
    }

    fn mig_enabled(&self, _gpu: &str) -> Option<bool> {
        None
    }

    fn has_limits(&self) -> Option<bool> {
        None
    }

    fn hook_args(&self) -> Vec<String> {
        let mut args = vec!["--gpu-backend".to_string(), "nvidia-smi".to_string()];
        if self.program != "nvidia-smi" {
            args.extend(["--nvidia-smi".to_string(), self.program.clone()]);
        }
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smi_get_output_parses() {
        let text = "namespace: /sys/fs/cgroup/mygroup\nsoft limit: 4096 MiB\nhard limit: 8192 MiB\n\
                    current used: 512 MiB\n";
        assert_eq!(
            parse_smi_get(text),
            Some(LimitReading {
                soft: 4096 * MIB,
                hard: 8192 * MIB,
                used: 512 * MIB
            })
        );
        let unlimited = parse_smi_get("soft limit: 0 MiB\nhard limit: max\n").expect("parses");
        assert!(unlimited.is_unlimited());
        assert_eq!(parse_smi_get("garbage"), None);
        assert_eq!(mib_arg(NO_LIMIT), "max");
        assert_eq!(mib_arg(4 << 30), "4096");
    }

    #[test]
    fn smi_failures_are_told_apart() {
        let kind = |t: &str| classify_smi(t, t.to_string());
        assert!(matches!(
            kind("Option memory-limits is not recognized"),
            LimitError::TooOld(_)
        ));
        assert!(matches!(kind("Not Supported"), LimitError::NotSupported(_)));
        assert!(matches!(
            kind("Insufficient Permissions"),
            LimitError::NoPermission(_)
        ));
        assert!(matches!(
            kind("No devices were found"),
            LimitError::UnknownGpu(_)
        ));
        assert!(matches!(kind("Not Found"), LimitError::NotFound(_)));
        assert!(matches!(kind("boom"), LimitError::Failed(_)));
    }

    #[test]
    fn the_fake_backend_has_no_limits() {
        let config = GpuConfig {
            backend: GpuBackendKind::Fake,
            ..GpuConfig::default()
        };
        assert!(matches!(open(&config), Err(LimitError::Unavailable(_))));
    }
}
