//! The `nvidia-smi` backend: runs `nvidia-smi -q -x` (under a timeout, never hanging) and
//! parses its XML for the driver version and, per `<gpu>`, product name, UUID, minor number
//! (`N/A` allowed), PCI bus id and `fb_memory_usage/total`. The index is the order of
//! appearance (nvidia-smi lists GPUs in NVML enumeration order), never the minor number.
//!
//! This is how the static musl binary reaches the driver: it cannot dlopen
//! `libnvidia-ml.so.1`, but it can run the driver's own glibc tool.
//!
//! Health, from a background thread per watcher:
//! - polling nvidia-smi every [`NvidiaSmiOptions::poll_interval`]: a GPU that vanishes from
//!   the list, or that nvidia-smi says it cannot reach ("Unable to determine the device handle
//!   for GPU 0000:3B:00.0: GPU is lost"), is reported once as [`HealthEvent::Lost`];
//! - tailing the kernel log (`/dev/kmsg` by default, only when readable; a file or FIFO with
//!   `[gpu] kmsg_path` / `--kmsg-path`, from its start with `kmsg_replay`) for
//!   `NVRM: Xid (PCI:0000:3b:00): 79, …` lines, mapped from PCI bus id to UUID; an XID at an
//!   address that is no served GPU is [`HealthEvent::Unattributed`] and marks none.
//!
//! It does not read ECC counters, utilisation or processes.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::driver::{Run, run_args};
use super::{Error, ExcludedGpu, ExclusionReason, GpuBackend, GpuDevice, HealthEvent, Inventory};

/// Words of the error for two GPUs with one UUID (doctor's hint keys on them).
pub(crate) const DUPLICATE_UUIDS: &str = "duplicate UUIDs";
/// Default limit for one nvidia-smi run.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default health poll interval.
pub(crate) const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(30);
/// Default kernel log.
pub(crate) use crate::config::DEFAULT_KMSG;
/// How often the kmsg reader looks for new lines when none are pending.
const KMSG_IDLE: Duration = Duration::from_millis(200);
/// Granularity of the poll thread's sleep, so it notices a dropped receiver soon.
const POLL_STEP: Duration = Duration::from_millis(100);
#[cfg(unix)]
/// Linux `O_NONBLOCK` (the generic value: x86, arm, aarch64, riscv).
const O_NONBLOCK: i32 = 0o4000;

/// How to run nvidia-smi and where to watch for health.
#[derive(Clone, Debug)]
pub struct NvidiaSmiOptions {
    /// The program (a name on PATH or a path).
    pub program: String,
    /// Limit for one run; the child is killed past it.
    pub timeout: Duration,
    /// How often the health thread re-runs nvidia-smi.
    pub poll_interval: Duration,
    /// The kernel log to tail for XIDs (`/dev/kmsg`, a file or a FIFO); `None` disables it.
    pub kmsg: Option<PathBuf>,
    /// Read `kmsg` from its start (a recorded log) instead of only what comes after the
    /// watch starts. A FIFO is always read as it comes.
    pub kmsg_replay: bool,
}

impl NvidiaSmiOptions {
    /// Defaults for `program`: 30 s timeout, 30 s polls, `/dev/kmsg`.
    pub fn new(program: &str) -> NvidiaSmiOptions {
        NvidiaSmiOptions {
            program: if program.is_empty() {
                "nvidia-smi"
            } else {
                program
            }
            .to_string(),
            timeout: DEFAULT_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            kmsg: Some(PathBuf::from(DEFAULT_KMSG)),
            kmsg_replay: false,
        }
    }

    /// The options `[gpu]` describes: program, kernel log path (empty disables it) and replay.
    pub fn from_config(config: &crate::config::GpuConfig) -> NvidiaSmiOptions {
        let mut options = NvidiaSmiOptions::new(&config.nvidia_smi);
        options.kmsg = Some(config.kmsg_path.trim())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        options.kmsg_replay = config.kmsg_replay;
        options
    }
}

/// nvidia-smi as a GPU backend.
#[derive(Debug)]
pub struct NvidiaSmiBackend {
    options: Arc<NvidiaSmiOptions>,
}

impl NvidiaSmiBackend {
    /// Runs nvidia-smi once to prove it works and its output parses.
    pub fn open(options: NvidiaSmiOptions) -> Result<NvidiaSmiBackend, Error> {
        let backend = NvidiaSmiBackend {
            options: Arc::new(options),
        };
        backend.inventory()?;
        Ok(backend)
    }
}

impl GpuBackend for NvidiaSmiBackend {
    fn name(&self) -> &'static str {
        "nvidia-smi"
    }

    fn memory_limits(
        &self,
    ) -> Result<Arc<dyn super::limits::MemoryLimits>, super::limits::LimitError> {
        Ok(Arc::new(super::limits::SmiLimits::new(
            &self.options.program,
        )))
    }

    /// Blocking: runs nvidia-smi (call from a blocking context in async code).
    fn inventory(&self) -> Result<Inventory, Error> {
        let run = run(&self.options)?;
        if !run.success {
            return Err(Error::NvidiaSmi(format!(
                "`{} -q -x` {}: {}",
                self.options.program,
                run.status,
                first_lines(&run.text())
            )));
        }
        parse_xml(&run.stdout).map_err(|e| {
            Error::NvidiaSmi(format!("output of `{} -q -x`: {e}", self.options.program))
        })
    }

    fn watch_health(&self) -> Result<mpsc::Receiver<HealthEvent>, Error> {
        let known = self.inventory()?.devices;
        let (tx, rx) = mpsc::channel(64);
        if let Some(kmsg) = &self.options.kmsg {
            match open_kmsg(kmsg, self.options.kmsg_replay) {
                Ok(file) => {
                    let (tx, devices) = (tx.clone(), known.clone());
                    std::thread::Builder::new()
                        .name("kmsg-xid".to_string())
                        .spawn(move || tail_kmsg(file, &devices, &tx))
                        .map_err(|e| {
                            Error::NvidiaSmi(format!("cannot start the kmsg thread: {e}"))
                        })?;
                }
                Err(e) => tracing::info!(
                    path = %kmsg.display(), error = %e,
                    "kernel log not readable; XID health comes only from polling nvidia-smi"
                ),
            }
        }
        let options = Arc::clone(&self.options);
        std::thread::Builder::new()
            .name("nvidia-smi-poll".to_string())
            .spawn(move || poll_health(&options, known, &tx))
            .map_err(|e| Error::NvidiaSmi(format!("cannot start the poll thread: {e}")))?;
        Ok(rx)
    }
}

/// Runs `<program> -q -x` with a timeout; the child is killed when it runs past it.
fn run(options: &NvidiaSmiOptions) -> Result<Run, Error> {
    run_args(&options.program, &["-q", "-x"], options.timeout)
}

fn first_lines(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(3)
        .collect();
    if lines.is_empty() {
        "(no output)".to_string()
    } else {
        lines.join(" | ")
    }
}

/// Parses `nvidia-smi -q -x` output.
///
/// Tolerant where real outputs differ and the meaning is unambiguous: whitespace (or a BOM)
/// before the XML declaration, as output captured through ssh / nsenter wrappers carries and
/// Go's encoding/xml (telegraf, netdata) accepts; no declaration or DOCTYPE; a missing
/// `<driver_version>` (the driver is then unknown, an empty string); `attached_gpus` that
/// disagrees with the `<gpu>` elements (only listed GPUs can be addressed). A `<gpu>` without
/// a UUID or a memory total, or with MIG mode enabled, is listed in
/// [`Inventory::excluded`] with the reason, not offered. Refused: not `<nvidia_smi_log>` XML,
/// and two GPUs with the same UUID (their device IDs `<UUID>-_-<n>` would collide).
pub fn parse_xml(xml: &str) -> Result<Inventory, XmlError> {
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    let xml = xml.trim_start_matches(|c: char| c.is_whitespace() || c == '\u{feff}');
    let doc = roxmltree::Document::parse_with_options(xml, options).map_err(XmlError::NotXml)?;
    let root = doc.root_element();
    if root.tag_name().name() != "nvidia_smi_log" {
        return Err(XmlError::WrongRoot(root.tag_name().name().to_string()));
    }
    let driver_version = child_text(root, "driver_version")
        .filter(|v| !is_na(v))
        .unwrap_or("")
        .to_string();
    let mut devices: Vec<GpuDevice> = Vec::new();
    let mut excluded = Vec::new();
    for (i, gpu) in root
        .children()
        .filter(|n| n.has_tag_name("gpu"))
        .enumerate()
    {
        let at = gpu.attribute("id").unwrap_or("?");
        let index = u32::try_from(i).map_err(|_| XmlError::TooManyGpus)?;
        let name = child_text(gpu, "product_name").unwrap_or("").to_string();
        let uuid = child_text(gpu, "uuid")
            .filter(|u| !is_na(u))
            .unwrap_or("")
            .to_string();
        let exclude = |reason: ExclusionReason| ExcludedGpu {
            index,
            uuid: uuid.clone(),
            name: name.clone(),
            reason,
        };
        if uuid.is_empty() {
            excluded.push(exclude(ExclusionReason::Incomplete(format!(
                "GPU {i} ({at}) has no <uuid>"
            ))));
            continue;
        }
        if let Some(first) = devices.iter().find(|d| d.uuid == uuid) {
            return Err(XmlError::DuplicateUuid {
                gpu: i,
                at: at.to_string(),
                uuid,
                first: first.index,
            });
        }
        let minor = match child_text(gpu, "minor_number") {
            None => None,
            Some(m) if is_na(m) => None,
            Some(m) => Some(m.parse().map_err(|_| XmlError::BadMinor {
                gpu: i,
                at: at.to_string(),
                minor: m.to_string(),
            })?),
        };
        let pci_bus_id = gpu
            .children()
            .find(|n| n.has_tag_name("pci"))
            .and_then(|pci| child_text(pci, "pci_bus_id"))
            .or_else(|| gpu.attribute("id"))
            .unwrap_or("")
            .to_string();
        let total = gpu
            .children()
            .find(|n| n.has_tag_name("fb_memory_usage"))
            .and_then(|fb| child_text(fb, "total"));
        let memory_bytes = match total.map(parse_memory) {
            Some(Ok(bytes)) => bytes,
            Some(Err(e)) => {
                excluded.push(exclude(ExclusionReason::Incomplete(format!(
                    "GPU {i} ({at}) memory total: {e}"
                ))));
                continue;
            }
            None => {
                excluded.push(exclude(ExclusionReason::Incomplete(format!(
                    "GPU {i} ({at}) has no <fb_memory_usage><total>"
                ))));
                continue;
            }
        };
        let mig = gpu
            .children()
            .find(|n| n.has_tag_name("mig_mode"))
            .and_then(|m| child_text(m, "current_mig"));
        if mig.is_some_and(|m| m.eq_ignore_ascii_case("Enabled")) {
            excluded.push(exclude(ExclusionReason::MigEnabled));
            continue;
        }
        devices.push(GpuDevice {
            index,
            uuid,
            name,
            minor,
            pci_bus_id,
            memory_bytes,
        });
    }
    Ok(Inventory {
        backend: "nvidia-smi",
        driver_version,
        devices,
        excluded,
    })
}

fn child_text<'a>(node: roxmltree::Node<'a, '_>, tag: &str) -> Option<&'a str> {
    node.children()
        .find(|n| n.has_tag_name(tag))
        .and_then(|n| n.text())
        .map(str::trim)
}

fn is_na(text: &str) -> bool {
    text.eq_ignore_ascii_case("N/A") || text.is_empty()
}

/// Why `nvidia-smi -q -x` output is refused as a whole.
#[derive(Debug, thiserror::Error)]
pub enum XmlError {
    /// Not XML at all (an error message, a truncated file).
    #[error("not the expected XML: {0}")]
    NotXml(roxmltree::Error),
    /// XML, but not `<nvidia_smi_log>`.
    #[error("root element is <{0}>, expected <nvidia_smi_log>")]
    WrongRoot(String),
    /// More `<gpu>` elements than a GPU index can count.
    #[error("too many GPUs")]
    TooManyGpus,
    /// Two GPUs share a UUID: their device IDs `<UUID>-_-<n>` would collide.
    #[error(
        "GPU {gpu} ({at}) has the same UUID {uuid} as GPU {first}: {dup} would give \
         both the same device IDs",
        dup = DUPLICATE_UUIDS
    )]
    DuplicateUuid {
        /// Position of the second GPU.
        gpu: usize,
        /// Its `id` attribute.
        at: String,
        /// The shared UUID.
        uuid: String,
        /// Index of the first GPU with it.
        first: u32,
    },
    /// A `<minor_number>` that is neither a number nor N/A.
    #[error("GPU {gpu} ({at}): minor number {minor:?} is not a number")]
    BadMinor {
        /// Position of the GPU.
        gpu: usize,
        /// Its `id` attribute.
        at: String,
        /// The text found.
        minor: String,
    },
}

/// Why a memory text such as `16160 MiB` cannot be read (that GPU is excluded).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum MemoryTextError {
    /// Not `<number> <unit>`.
    #[error("{0:?} is not `<number> MiB`")]
    NotNumberAndUnit(String),
    /// A unit other than KiB, MiB, GiB.
    #[error("unknown unit {unit:?} in {text:?}")]
    UnknownUnit {
        /// The unit found.
        unit: String,
        /// The whole text.
        text: String,
    },
    /// More bytes than a u64 holds.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// `16160 MiB` -> bytes (KiB, MiB, GiB accepted).
fn parse_memory(text: &str) -> Result<u64, MemoryTextError> {
    let mut parts = text.split_whitespace();
    let not_memory = || MemoryTextError::NotNumberAndUnit(text.to_string());
    let (Some(number), Some(unit), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(not_memory());
    };
    let n: u64 = number.parse().map_err(|_| not_memory())?;
    let factor: u64 = match unit {
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(MemoryTextError::UnknownUnit {
                unit: other.to_string(),
                text: text.to_string(),
            });
        }
    };
    n.checked_mul(factor)
        .ok_or_else(|| MemoryTextError::TooLarge(text.to_string()))
}

/// A PCI location without the function: (domain, bus, device).
type PciLocation = (u32, u32, u32);

/// `00000000:3B:00.0`, `0000:3b:00` or `PCI:0000:3b:00` -> (domain, bus, device).
pub(crate) fn pci_location(text: &str) -> Option<PciLocation> {
    let text = text.trim();
    let text = text.strip_prefix("PCI:").unwrap_or(text);
    let mut parts = text.split(':');
    let (domain, bus, rest) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let device = rest.split('.').next()?;
    Some((
        u32::from_str_radix(domain, 16).ok()?,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(device, 16).ok()?,
    ))
}

/// One `NVRM: Xid` kernel line: where and which XID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KmsgXid {
    /// The PCI location as the driver printed it (`0000:3b:00`).
    pub pci: String,
    /// The XID number.
    pub xid: u64,
}

/// Parses a kernel log line (a `/dev/kmsg` record or a `dmesg` line) for an NVIDIA XID:
/// `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, …`.
pub(crate) fn parse_kmsg_xid(line: &str) -> Option<KmsgXid> {
    let rest = &line[line.find("NVRM: Xid (")? + "NVRM: Xid (".len()..];
    let (pci, rest) = rest.split_once("):")?;
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let xid = digits.parse().ok()?;
    let pci = pci
        .trim()
        .strip_prefix("PCI:")
        .unwrap_or(pci.trim())
        .to_string();
    Some(KmsgXid { pci, xid })
}

/// The UUID of the device at `pci` among `devices`.
fn uuid_at(devices: &[GpuDevice], pci: &str) -> Option<String> {
    let wanted = pci_location(pci)?;
    devices
        .iter()
        .find(|d| pci_location(&d.pci_bus_id) == Some(wanted))
        .map(|d| d.uuid.clone())
}

/// The health event of a kernel-log XID: the GPU at its PCI address, or
/// [`HealthEvent::Unattributed`] when no served GPU is there (an NVSwitch / NVLink XID at
/// `PCI:0000:00:00`, a GPU this inventory does not list). The kernel names a device on every
/// XID line, so none is taken to concern every GPU.
pub(crate) fn attribute(devices: &[GpuDevice], found: KmsgXid) -> HealthEvent {
    match uuid_at(devices, &found.pci) {
        Some(uuid) => HealthEvent::Xid {
            uuid: Some(uuid),
            xid: found.xid,
        },
        None => HealthEvent::Unattributed {
            pci: found.pci,
            xid: found.xid,
        },
    }
}

/// Opens the kernel log. `/dev/kmsg` and files start at their end (history is not news, and
/// kmsg replays its whole buffer) unless `replay`; a FIFO cannot seek and is read as it comes.
fn open_kmsg(path: &std::path::Path, replay: bool) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // No /dev/kmsg off Linux: there the open fails and health is read from nvidia-smi alone.
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, O_NONBLOCK);
    let mut file = options.open(path)?;
    #[cfg(unix)]
    let fifo = std::os::unix::fs::FileTypeExt::is_fifo(&file.metadata()?.file_type());
    #[cfg(not(unix))]
    let fifo = false;
    if !replay && !fifo {
        file.seek(SeekFrom::End(0))?;
    }
    Ok(file)
}

/// Reads new kernel log lines until `tx` closes; sends one event per XID line.
fn tail_kmsg(mut file: std::fs::File, devices: &[GpuDevice], tx: &mpsc::Sender<HealthEvent>) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    while !tx.is_closed() {
        match file.read(&mut buf) {
            Ok(0) => std::thread::sleep(KMSG_IDLE),
            Ok(n) => {
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    let line = String::from_utf8_lossy(&line);
                    if let Some(found) = parse_kmsg_xid(&line)
                        && tx.blocking_send(attribute(devices, found)).is_err()
                    {
                        return;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(KMSG_IDLE),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // kmsg: records were overwritten before we read them; carry on from the next.
            Err(e) if e.raw_os_error() == Some(32) => {}
            Err(e) => {
                tracing::warn!(error = %e, "reading the kernel log failed; XIDs from it stop");
                return;
            }
        }
    }
}

/// Re-runs nvidia-smi every poll interval; reports each GPU that vanished or is unreachable
/// once (again only after it came back and went again).
fn poll_health(options: &NvidiaSmiOptions, known: Vec<GpuDevice>, tx: &mpsc::Sender<HealthEvent>) {
    let mut lost: Vec<String> = Vec::new();
    loop {
        let wake = Instant::now() + options.poll_interval;
        while Instant::now() < wake {
            if tx.is_closed() {
                return;
            }
            std::thread::sleep(POLL_STEP.min(wake.saturating_duration_since(Instant::now())));
        }
        let missing = match run(options) {
            Ok(r) if r.success => match parse_xml(&r.stdout) {
                Ok(now) => known
                    .iter()
                    .filter(|k| !now.devices.iter().any(|d| d.uuid == k.uuid))
                    .map(|k| k.uuid.clone())
                    .collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "nvidia-smi output not understood during a health poll");
                    continue;
                }
            },
            Ok(r) => {
                let unreachable = unreachable_gpus(&r.text(), &known);
                if unreachable.is_empty() {
                    tracing::warn!(output = %first_lines(&r.text()), "nvidia-smi failed during a health poll");
                    continue;
                }
                unreachable
            }
            Err(e) => {
                tracing::warn!(error = %e, "nvidia-smi health poll failed");
                continue;
            }
        };
        lost.retain(|uuid| missing.contains(uuid));
        for uuid in missing {
            if lost.contains(&uuid) {
                continue;
            }
            lost.push(uuid.clone());
            if tx.blocking_send(HealthEvent::Lost { uuid }).is_err() {
                return;
            }
        }
    }
}

/// GPUs named in nvidia-smi's "Unable to determine the device handle for GPU <pci>: …" lines.
fn unreachable_gpus(output: &str, known: &[GpuDevice]) -> Vec<String> {
    const MARK: &str = "Unable to determine the device handle for GPU";
    output
        .lines()
        .filter_map(|l| {
            let rest = l[l.find(MARK)? + MARK.len()..].trim_start();
            let pci = rest.split_whitespace().next()?;
            uuid_at(known, pci.trim_end_matches(':'))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kmsg_lines_of_several_shapes() {
        let cases = [
            (
                "4,1234,5678901234,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
                Some(("0000:3b:00", 79)),
            ),
            (
                "[123456.789012] NVRM: Xid (PCI:0000:86:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
                Some(("0000:86:00", 48)),
            ),
            (
                "NVRM: Xid (0000:07:00): 31, Ch 00000008, engmask 00000101, intr 10000000",
                Some(("0000:07:00", 31)),
            ),
            (
                "NVRM: GPU at PCI:0000:3b:00: GPU-8f4c3a62-1d2b-8a8e-7c0a-3e5f1b2c4d6e",
                None,
            ),
            ("NVRM: Xid (PCI:0000:3b:00): , garbage", None),
            ("usb 1-1: new high-speed USB device", None),
        ];
        for (line, want) in cases {
            let got = parse_kmsg_xid(line);
            let want = want.map(|(pci, xid)| KmsgXid {
                pci: pci.to_string(),
                xid,
            });
            assert_eq!(got, want, "{line}");
        }
    }

    #[test]
    fn pci_locations_match_across_formats() {
        assert_eq!(pci_location("00000000:3B:00.0"), Some((0, 0x3b, 0)));
        assert_eq!(pci_location("0000:3b:00"), Some((0, 0x3b, 0)));
        assert_eq!(pci_location("PCI:0000:3b:00"), Some((0, 0x3b, 0)));
        assert_eq!(pci_location("00000001:00:1E.0"), Some((1, 0, 0x1e)));
        assert_eq!(pci_location("nonsense"), None);
    }

    #[test]
    fn memory_totals() {
        assert_eq!(parse_memory("16160 MiB"), Ok(16160 << 20));
        assert_eq!(parse_memory("80 GiB"), Ok(80 << 30));
        assert!(parse_memory("N/A").is_err());
        assert!(parse_memory("12 MB").is_err());
    }

    #[test]
    fn garbage_is_a_clear_error() {
        assert!(
            parse_xml("NVIDIA-SMI has failed")
                .unwrap_err()
                .to_string()
                .contains("not the expected XML")
        );
        assert!(
            parse_xml("<other/>")
                .unwrap_err()
                .to_string()
                .contains("expected <nvidia_smi_log>")
        );
        let empty = parse_xml("<nvidia_smi_log/>").expect("an empty log parses");
        assert_eq!(empty.driver_version, "");
        assert!(empty.devices.is_empty());
        let no_uuid = "<nvidia_smi_log><driver_version>1</driver_version><gpu id=\"x\"></gpu></nvidia_smi_log>";
        let inv = parse_xml(no_uuid).expect("parses");
        assert!(inv.devices.is_empty());
        assert!(
            matches!(&inv.excluded[0].reason, ExclusionReason::Incomplete(r) if r.contains("no <uuid>")),
            "{inv:?}"
        );
    }

    const TWO_GPUS: &str = "<nvidia_smi_log><driver_version>550.54.15</driver_version>\
        <gpu id=\"00000000:3B:00.0\"><product_name>A</product_name><uuid>GPU-a</uuid>\
        <pci><pci_bus_id>00000000:3B:00.0</pci_bus_id></pci>\
        <fb_memory_usage><total>16384 MiB</total></fb_memory_usage>\
        <mig_mode><current_mig>Disabled</current_mig></mig_mode></gpu>\
        <gpu id=\"00000000:86:00.0\"><product_name>B</product_name><uuid>GPU-b</uuid>\
        <pci><pci_bus_id>00000000:86:00.0</pci_bus_id></pci>\
        <fb_memory_usage><total>40960 MiB</total></fb_memory_usage>\
        <mig_mode><current_mig>Enabled</current_mig></mig_mode></gpu></nvidia_smi_log>";

    #[test]
    fn real_world_variations() {
        // Whitespace before the declaration (a wrapper's newline), as Go's encoding/xml accepts.
        let padded = format!("\n  \u{feff}<?xml version=\"1.0\" ?>\n{TWO_GPUS}");
        let inv = parse_xml(&padded).expect("leading whitespace is accepted");
        assert_eq!(inv.devices.len(), 1);
        // MIG on: left out with the reason, index kept.
        assert_eq!(inv.devices[0].uuid, "GPU-a");
        assert_eq!(inv.excluded.len(), 1);
        assert_eq!(
            (inv.excluded[0].index, inv.excluded[0].uuid.as_str()),
            (1, "GPU-b")
        );
        assert_eq!(inv.excluded[0].reason, ExclusionReason::MigEnabled);
        // No driver version: the driver is unknown, the GPUs stay.
        let no_driver = TWO_GPUS.replace("<driver_version>550.54.15</driver_version>", "");
        let inv = parse_xml(&no_driver).expect("parses");
        assert_eq!(inv.driver_version, "");
        assert_eq!(inv.devices.len(), 1);
        // One UUID twice: refused, naming it.
        let dup = TWO_GPUS
            .replace("GPU-b", "GPU-a")
            .replace("Enabled", "Disabled");
        let err = parse_xml(&dup).unwrap_err().to_string();
        assert!(
            err.contains("same UUID GPU-a") && err.contains(DUPLICATE_UUIDS),
            "{err}"
        );
    }

    #[test]
    fn xids_at_unknown_addresses_are_unattributed() {
        let inv = parse_xml(TWO_GPUS).expect("parses");
        let at = |line: &str| attribute(&inv.devices, parse_kmsg_xid(line).expect("an Xid"));
        assert_eq!(
            at("NVRM: Xid (PCI:0000:3b:00): 62, pid=1"),
            HealthEvent::Xid {
                uuid: Some("GPU-a".to_string()),
                xid: 62
            }
        );
        assert_eq!(
            at("NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00"),
            HealthEvent::Unattributed {
                pci: "0000:00:00".to_string(),
                xid: 149
            }
        );
        // The MIG GPU is not served: its XIDs mark nothing either.
        assert!(matches!(
            at("NVRM: Xid (PCI:0000:86:00): 79, GPU has fallen off the bus"),
            HealthEvent::Unattributed { xid: 79, .. }
        ));
    }

    #[test]
    fn unreachable_lines_name_the_gpu() {
        let known = vec![GpuDevice {
            index: 0,
            uuid: "GPU-a".into(),
            name: "x".into(),
            minor: Some(0),
            pci_bus_id: "00000000:3B:00.0".into(),
            memory_bytes: 1,
        }];
        let out = "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.  Reboot the system to recover this GPU";
        assert_eq!(unreachable_gpus(out, &known), vec!["GPU-a".to_string()]);
        assert!(unreachable_gpus("No devices were found", &known).is_empty());
    }
}
