//! Builds a stub `libnvidia-ml.so.1` (from `nvml_stub.c`) for testing the NVML backend through
//! the same nvml-wrapper code that loads the real driver library — tests and demos only.
//!
//! The stub reads its GPUs from `nvml_stub.conf` beside the library (or the file named by env
//! `NVML_STUB_CONFIG`, for child processes), and delivers XID events appended at run time to
//! `nvml_stub.events` beside the config. [`write_config`] and [`append_xid`] write both. The
//! file format is documented at the top of `nvml_stub.c`.
//!
//! [`build`] compiles with the system C compiler (`$CC`, else `cc`) once per source content
//! (cached under the temp dir) and copies the result into the caller's directory, so every
//! test gets its own library file — and so its own configuration and NVML state, even inside
//! one test process. It needs a C compiler; it does not need a GPU or a driver.
//!
//! The per-cgroup memory limits of driver R615 ([`enable_memory_limits`]: a backend, `dmem`
//! or `misc`, over a fake cgroup tree) are the stub's too; [`build_without_memory_limits`]
//! builds a library without those functions (an older driver), and [`build_workload`] a
//! program that uses a GPU from inside a cgroup as a container's workload would (what it sees
//! of the memory, and allocations that fail past the cgroup's hard limit).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The stub's C source.
pub const SOURCE: &str = include_str!("nvml_stub.c");
/// File name of the built library.
pub const LIBRARY_NAME: &str = "libnvidia-ml.so.1";
/// The configuration file the stub reads beside itself.
pub const CONFIG_NAME: &str = "nvml_stub.conf";
/// The events file the stub re-reads on every event wait.
pub const EVENTS_NAME: &str = "nvml_stub.events";
/// Env var naming a configuration file elsewhere (for child processes).
pub const CONFIG_ENV: &str = "NVML_STUB_CONFIG";
/// Env var naming the cgroup directory (a full path) the stub takes the calling process to be
/// in (else its `/proc/self/cgroup` under the fake root).
pub const CGROUP_ENV: &str = "NVML_STUB_CGROUP";
/// The workload program's C source.
pub const WORKLOAD_SOURCE: &str = include_str!("nvml_stub_workload.c");
/// File name of the built workload program.
pub const WORKLOAD_NAME: &str = "nvml_stub_workload";

/// How the stub keeps per-cgroup memory limits (the driver picks one when it loads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryAccounting {
    /// The kernel's dmem controller: limits in the cgroup's `dmem.*` files.
    Dmem,
    /// The driver's own map, no hierarchy.
    Misc,
    /// Memory partitioning off: the limit calls answer Not Supported.
    Off,
}

/// Turns the per-cgroup memory limits on with `backend`, over the fake cgroup tree at
/// `cgroup_root` (append to the configuration beside `library` before it is first initialised).
pub fn enable_memory_limits(
    library: &Path,
    backend: MemoryAccounting,
    cgroup_root: &Path,
) -> anyhow::Result<()> {
    let backend = match backend {
        MemoryAccounting::Dmem => "dmem",
        MemoryAccounting::Misc => "misc",
        MemoryAccounting::Off => "off",
    };
    append_line(library, &format!("memacct {backend}"))?;
    append_line(library, &format!("cgroup_root {}", cgroup_root.display()))
}

/// Makes every `nvmlDeviceSetMemoryLimits_v1` answer NVML error `code` (e.g. 4, No
/// Permission).
pub fn fail_set_limits(library: &Path, code: u32) -> anyhow::Result<()> {
    append_line(library, &format!("fail_set {code}"))
}

fn append_line(library: &Path, line: &str) -> anyhow::Result<()> {
    let path = beside(library, CONFIG_NAME);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{line}").with_context(|| format!("writing {}", path.display()))
}

/// One GPU the stub reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StubGpu {
    /// `GPU-…` UUID (no spaces).
    pub uuid: String,
    /// Product name (may contain spaces).
    pub name: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Minor number; `None` makes `nvmlDeviceGetMinorNumber` answer "Not Supported".
    pub minor: Option<u32>,
    /// PCI bus id, e.g. `00000000:3B:00.0`.
    pub pci_bus_id: String,
}

/// Turns MIG mode on for GPU `index` of the configuration beside `library` (append after
/// [`write_config`], before the library is first initialised).
pub fn enable_mig(library: &Path, index: usize) -> anyhow::Result<()> {
    let path = beside(library, CONFIG_NAME);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "mig {index}").with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Builds the stub into `out_dir/libnvidia-ml.so.1` and returns that path.
pub fn build(out_dir: &Path) -> anyhow::Result<PathBuf> {
    build_variant(out_dir, &[])
}

/// Builds the stub without the memory-limit functions (a driver older than R615) into
/// `out_dir/libnvidia-ml.so.1`.
pub fn build_without_memory_limits(out_dir: &Path) -> anyhow::Result<PathBuf> {
    build_variant(out_dir, &["-DNVML_STUB_NO_MEMORY_LIMITS"])
}

/// Builds the workload program (see `nvml_stub_workload.c`) into `out_dir`; returns its path.
pub fn build_workload(out_dir: &Path) -> anyhow::Result<PathBuf> {
    let cached = cached_build(WORKLOAD_SOURCE, WORKLOAD_NAME, &[], &["-O1", "-Wall"])?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let target = out_dir.join(WORKLOAD_NAME);
    std::fs::copy(&cached, &target)
        .with_context(|| format!("copying {} to {}", cached.display(), target.display()))?;
    Ok(target)
}

fn build_variant(out_dir: &Path, defines: &[&str]) -> anyhow::Result<PathBuf> {
    let cached = cached_build(
        SOURCE,
        LIBRARY_NAME,
        defines,
        &["-shared", "-fPIC", "-O1", "-Wall"],
    )?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let target = out_dir.join(LIBRARY_NAME);
    // A copy, not a link: the loader treats one inode as one library, and each test needs its
    // own (its own config, its own NVML state).
    std::fs::copy(&cached, &target)
        .with_context(|| format!("copying {} to {}", cached.display(), target.display()))?;
    Ok(target)
}

/// Compiles `source` (with `defines`) once per content; returns the cached output `name`.
fn cached_build(
    source_text: &str,
    name: &str,
    defines: &[&str],
    flags: &[&str],
) -> anyhow::Result<PathBuf> {
    let key = format!("{source_text}{}", defines.join(" "));
    let dir = std::env::temp_dir().join(format!("gpushare-nvml-stub-{:016x}", fnv1a(&key)));
    let library = dir.join(name);
    if library.is_file() {
        return Ok(library);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id());
    let unique: String = unique.chars().filter(char::is_ascii_alphanumeric).collect();
    let source = dir.join(format!("nvml_stub-{unique}.c"));
    let partial = dir.join(format!("{name}.{unique}.tmp"));
    std::fs::write(&source, source_text)
        .with_context(|| format!("writing {}", source.display()))?;
    let cc = std::env::var("CC")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "cc".into());
    let output = Command::new(&cc)
        .args(flags)
        .args(defines)
        .arg("-o")
        .arg(&partial)
        .arg(&source)
        .args(["-ldl", "-lpthread"])
        .output()
        .with_context(|| format!("running the C compiler `{cc}` (set CC to another)"))?;
    let _ = std::fs::remove_file(&source);
    if !output.status.success() {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "`{cc}` failed to build {name} ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // Atomic publish: parallel builders race harmlessly.
    std::fs::rename(&partial, &library)
        .with_context(|| format!("publishing {}", library.display()))?;
    Ok(library)
}

/// 64-bit FNV-1a: a content hash that is stable across Rust versions.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes `nvml_stub.conf` beside `library` with `driver` and `gpus`; returns its path.
pub fn write_config(library: &Path, driver: &str, gpus: &[StubGpu]) -> anyhow::Result<PathBuf> {
    let path = beside(library, CONFIG_NAME);
    let mut text = format!("driver {driver}\n");
    for g in gpus {
        if g.uuid.is_empty() || g.uuid.contains(char::is_whitespace) {
            bail!(
                "stub GPU UUID {:?} must be non-empty without spaces",
                g.uuid
            );
        }
        let minor = g.minor.map_or_else(|| "-".to_string(), |m| m.to_string());
        text.push_str(&format!(
            "gpu {} {} {minor} {} {}\n",
            g.uuid, g.memory_mib, g.pci_bus_id, g.name
        ));
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Appends an XID for GPU `index` to the events file beside `library`; every event set open
/// in the stub delivers it once.
pub fn append_xid(library: &Path, index: u32, xid: u64) -> anyhow::Result<()> {
    let path = beside(library, EVENTS_NAME);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // One write of a whole line, so the stub never sees half of it as complete.
    file.write_all(format!("xid {index} {xid}\n").as_bytes())
        .with_context(|| format!("appending to {}", path.display()))
}

fn beside(library: &Path, name: &str) -> PathBuf {
    library
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_hash_is_stable() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn config_lines_put_the_name_last() {
        let dir = tempfile::tempdir().expect("tempdir");
        let library = dir.path().join(LIBRARY_NAME);
        let gpu = StubGpu {
            uuid: "GPU-1".into(),
            name: "Tesla V100-SXM2-16GB".into(),
            memory_mib: 16160,
            minor: None,
            pci_bus_id: "00000000:3B:00.0".into(),
        };
        let path = write_config(&library, "535.104.05", &[gpu]).expect("write");
        let text = std::fs::read_to_string(path).expect("read");
        assert_eq!(
            text,
            "driver 535.104.05\ngpu GPU-1 16160 - 00000000:3B:00.0 Tesla V100-SXM2-16GB\n"
        );
    }
}
