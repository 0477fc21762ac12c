//! The limits file: how many bytes of each GPU one container may allocate.
//!
//! The node agent writes it ([`Limits::render`]) and mounts it read-only at
//! [`LIMITS_PATH`](crate::LIMITS_PATH); the limiter parses it ([`Limits::parse`]) once per
//! process. Text, one GPU a line, keyed by the GPU's UUID as NVML prints it, so the limit
//! follows the GPU whatever order or subset `CUDA_VISIBLE_DEVICES` gives a process:
//!
//! ```text
//! # comments and blank lines are ignored
//! gpushare-limiter-limits 1
//! GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6a 4294967296
//! ```
//!
//! The first line that is not a comment is the header with the format version; then
//! `<uuid> <bytes>` lines. Anything else is an error, and the limiter then refuses every
//! allocation (fail closed): a file it cannot read is never read as "no limit". A GPU the
//! container can see but the file does not name gets no memory at all.
//!
//! UUIDs of MIG instances (`MIG-…`) are not accepted: gpushare shares whole GPUs.

use std::collections::BTreeMap;
use std::fmt;

/// The header line of version 1 of the format.
pub const HEADER: &str = "gpushare-limiter-limits 1";

/// The largest limits file the limiter reads (a file with thousands of GPUs is not one the
/// node agent wrote).
pub const MAX_FILE_BYTES: usize = 64 * 1024;

/// A whole GPU's UUID in NVML's spelling, lower case: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuUuid(String);

/// Why a string is not a GPU UUID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, hexadecimal)")]
pub struct UuidError {
    /// What was given (at most 64 characters of it).
    pub value: String,
}

impl GpuUuid {
    /// Parses `GPU-` and 32 hexadecimal digits in groups of 8-4-4-4-12, in either case.
    pub fn parse(text: &str) -> Result<Self, UuidError> {
        let fail = || UuidError {
            value: text.chars().take(64).collect(),
        };
        let rest = text
            .get(..4)
            .filter(|p| p.eq_ignore_ascii_case("GPU-"))
            .and_then(|_| text.get(4..))
            .ok_or_else(fail)?;
        let groups: Vec<&str> = rest.split('-').collect();
        let lengths: Vec<usize> = groups.iter().map(|g| g.len()).collect();
        if lengths != [8, 4, 4, 4, 12]
            || !groups
                .iter()
                .all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(fail());
        }
        Ok(GpuUuid(format!("GPU-{}", rest.to_ascii_lowercase())))
    }

    /// The UUID of a `CUuuid` (`cuDeviceGetUuid`'s 16 bytes), spelled as NVML spells it.
    pub fn from_cuda_bytes(bytes: &[u8; 16]) -> Self {
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        GpuUuid(format!(
            "GPU-{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        ))
    }

    /// The UUID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a limits file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// Larger than [`MAX_FILE_BYTES`].
    #[error("the limits file has {bytes} bytes, more than the {MAX_FILE_BYTES} read")]
    TooLarge {
        /// Its size.
        bytes: usize,
    },
    /// No header line (an empty file, or comments only).
    #[error("the limits file has no header line ({HEADER:?})")]
    MissingHeader,
    /// The first line is not the header this version reads.
    #[error("the limits file starts with {line:?}, not {HEADER:?} (written by another version?)")]
    UnsupportedHeader {
        /// The line found.
        line: String,
    },
    /// A GPU line that does not read.
    #[error("line {line}: {reason}")]
    BadLine {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// One GPU named twice.
    #[error("line {line}: {uuid} is named twice")]
    DuplicateGpu {
        /// 1-based line number of the second mention.
        line: usize,
        /// The GPU.
        uuid: GpuUuid,
    },
}

/// The limits of one container: bytes per GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    per_gpu: BTreeMap<GpuUuid, u64>,
}

impl Limits {
    /// No GPU at all.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the limit of `uuid` to `bytes`.
    pub fn set(&mut self, uuid: GpuUuid, bytes: u64) {
        self.per_gpu.insert(uuid, bytes);
    }

    /// The limit of `uuid`, if the file names it.
    pub fn get(&self, uuid: &GpuUuid) -> Option<u64> {
        self.per_gpu.get(uuid).copied()
    }

    /// Every GPU and its limit, in UUID order.
    pub fn iter(&self) -> impl Iterator<Item = (&GpuUuid, u64)> {
        self.per_gpu.iter().map(|(u, b)| (u, *b))
    }

    /// The file's text.
    pub fn render(&self) -> String {
        let mut out = format!(
            "# gpushare: GPU memory limits of this container, in bytes (read by {})\n{HEADER}\n",
            crate::LIBRARY_FILE_NAME
        );
        for (uuid, bytes) in &self.per_gpu {
            out.push_str(&format!("{uuid} {bytes}\n"));
        }
        out
    }

    /// Reads a limits file's text.
    pub fn parse(text: &str) -> Result<Self, LimitsError> {
        if text.len() > MAX_FILE_BYTES {
            return Err(LimitsError::TooLarge { bytes: text.len() });
        }
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
        let (_, header) = lines.next().ok_or(LimitsError::MissingHeader)?;
        if header.split_whitespace().collect::<Vec<_>>() != HEADER.split(' ').collect::<Vec<_>>() {
            return Err(LimitsError::UnsupportedHeader {
                line: header.chars().take(80).collect(),
            });
        }
        let mut limits = Limits::new();
        for (line, text) in lines {
            let bad = |reason: String| LimitsError::BadLine { line, reason };
            let fields: Vec<&str> = text.split_whitespace().collect();
            let [uuid, bytes] = fields[..] else {
                return Err(bad(format!(
                    "expected `<GPU uuid> <bytes>`, found {} fields",
                    fields.len()
                )));
            };
            let uuid = GpuUuid::parse(uuid).map_err(|e| bad(e.to_string()))?;
            let bytes: u64 = bytes.parse().map_err(|_| {
                bad(format!(
                    "{:?} is not a number of bytes (a decimal integer)",
                    bytes.chars().take(32).collect::<String>()
                ))
            })?;
            if limits.per_gpu.contains_key(&uuid) {
                return Err(LimitsError::DuplicateGpu { line, uuid });
            }
            limits.set(uuid, bytes);
        }
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6a";
    const B: &str = "GPU-00000000-0000-0000-0000-000000000001";

    #[test]
    fn uuids_read_in_either_case_and_print_lower_case() {
        let upper = GpuUuid::parse(&A.to_uppercase().replace("GPU-", "gpu-")).expect("upper");
        assert_eq!(upper.as_str(), A);
        for bad in [
            "",
            "GPU-",
            "MIG-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6a",
            "GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6",
            "GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6az",
            "GPU-3c1b7e8a5b2f-4d0e-9a4c-1f2e3d4c5b6a",
            "GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6g",
            "GPU-ü3c1b7e8-5b2f-4d0e-9a4c-1f2e3d4c5b6a",
        ] {
            assert!(GpuUuid::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn cuda_bytes_spell_as_nvml_does() {
        let bytes = [
            0x3c, 0x1b, 0x7e, 0x8a, 0x5b, 0x2f, 0x4d, 0x0e, 0x9a, 0x4c, 0x1f, 0x2e, 0x3d, 0x4c,
            0x5b, 0x6a,
        ];
        assert_eq!(GpuUuid::from_cuda_bytes(&bytes).as_str(), A);
    }

    #[test]
    fn a_rendered_file_reads_back() {
        let mut limits = Limits::new();
        limits.set(GpuUuid::parse(A).expect("a"), 4 << 30);
        limits.set(GpuUuid::parse(B).expect("b"), 0);
        let text = limits.render();
        assert!(text.contains(&format!("\n{HEADER}\n")), "{text}");
        assert_eq!(Limits::parse(&text), Ok(limits));
    }

    #[test]
    fn every_malformed_file_is_refused_with_its_line() {
        let cases: &[(&str, &str)] = &[
            ("", "no header"),
            ("# only a comment\n\n", "no header"),
            ("gpushare-limiter-limits 2\n", "starts with"),
            (&format!("{A} 1\n"), "starts with"),
            (&format!("{HEADER}\n{A}\n"), "line 2: expected"),
            (&format!("{HEADER}\n{A} 1 2\n"), "line 2: expected"),
            (
                &format!("{HEADER}\n{A} 4GiB\n"),
                "line 2: \"4GiB\" is not a number",
            ),
            (&format!("{HEADER}\n{A} -1\n"), "not a number"),
            (
                &format!("{HEADER}\n{A} 18446744073709551616\n"),
                "not a number",
            ),
            (
                &format!("{HEADER}\nMIG-1 1\n"),
                "line 2: \"MIG-1\" is not a GPU UUID",
            ),
            (&format!("{HEADER}\n{A} 1\n\n{A} 2\n"), "line 4: GPU-3c1b"),
            (&"#".repeat(MAX_FILE_BYTES + 1), "more than"),
        ];
        for (text, expected) in cases {
            let err = Limits::parse(text).expect_err(text);
            assert!(
                err.to_string().contains(expected),
                "{text:?}: {err} lacks {expected:?}"
            );
        }
    }

    #[test]
    fn comments_blank_lines_and_spacing_are_allowed() {
        let text = format!("# written by the node agent\n\n  {HEADER}  \n# a GPU\n{A}\t4096\n");
        let limits = Limits::parse(&text).expect("reads");
        assert_eq!(
            limits.get(&GpuUuid::parse(A).expect("a")),
            Some(4096),
            "{limits:?}"
        );
        assert_eq!(limits.get(&GpuUuid::parse(B).expect("b")), None);
    }
}
