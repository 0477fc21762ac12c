//! The usage ledger: one file per GPU in the container's state directory, in which every
//! process of the container records how many bytes of that GPU it holds.
//!
//! # Files
//!
//! - `<uuid>.ledger` ([`ledger_file_name`]): [`FILE_BYTES`] bytes, a header and [`SLOTS`]
//!   slots, integers in the node's native byte order. The limiter maps it shared and changes
//!   it only while holding the GPU's lock.
//! - `<uuid>.<slot>.alive` ([`alive_file_name`]): empty; the process owning slot `<slot>`
//!   holds an exclusive `flock` on it for as long as it lives. The kernel drops the lock when
//!   the process dies, however it dies (`SIGKILL` included), so a slot whose alive file is not
//!   locked belongs to a dead process and its bytes no longer count. Liveness is read this way,
//!   not from process ids, because the processes' pid namespace is not the reader's (the node
//!   agent's, or a nested container's) and pids are reused.
//!
//! # Locks
//!
//! - **The GPU's lock**: an open-file-description (OFD) `fcntl` write lock on byte
//!   [`LOCK_OFFSET`] of the ledger file, taken by the limiter around *check the limit, call
//!   the driver, record the result*, so two processes of the container never both pass the
//!   check for the last free bytes. A process that dies holding it releases it.
//! - **Readers** take a shared `fcntl` lock on the whole file while they read (it excludes the
//!   limiter's write lock), so a snapshot is never half-updated.
//!
//! # Layout (version 1)
//!
//! | offset | header field |
//! | --- | --- |
//! | 0 | magic [`MAGIC`] (8 bytes) |
//! | 8 | version, `u32` ([`VERSION`]) |
//! | 12 | slot size, `u32` ([`SLOT_BYTES`]) |
//! | 16 | slot count, `u32` ([`SLOTS`]) |
//! | 20 | high water, `u32`: slots at or above it were never used |
//! | 24 | the limit, `u64`: as the last process to claim a slot read it |
//!
//! Slot `i` starts at `HEADER_BYTES + i * SLOT_BYTES`:
//!
//! | offset | slot field |
//! | --- | --- |
//! | 0 | pid, `u32`, in the container's pid namespace (informational) |
//! | 4 | state, `u32`: [`SLOT_FREE`] or [`SLOT_LIVE`] |
//! | 8 | start time of the process, `u64`, clock ticks after boot (`/proc/<pid>/stat` field 22; informational) |
//! | 16 | bytes the process holds on this GPU, `u64` |
//! | 24 | the most it held at once, `u64` |

/// The first 8 bytes of a ledger file.
pub const MAGIC: [u8; 8] = *b"GPSLDGR\x01";
/// The layout version this crate reads and the limiter writes.
pub const VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 64;
/// Bytes of one slot.
pub const SLOT_BYTES: usize = 32;
/// Slots per ledger: processes of one container that hold memory of one GPU at once.
pub const SLOTS: usize = 1024;
/// The size of a ledger file.
pub const FILE_BYTES: usize = HEADER_BYTES + SLOT_BYTES * SLOTS;
/// The byte of the ledger file the GPU's lock covers (one byte long).
pub const LOCK_OFFSET: u64 = 0;

/// Header offsets.
pub const HEADER_VERSION: usize = 8;
/// Offset of the slot size in the header.
pub const HEADER_SLOT_BYTES: usize = 12;
/// Offset of the slot count in the header.
pub const HEADER_SLOTS: usize = 16;
/// Offset of the high water mark in the header.
pub const HEADER_HIGH_WATER: usize = 20;
/// Offset of the limit in the header.
pub const HEADER_LIMIT: usize = 24;

/// Slot offsets.
pub const SLOT_PID: usize = 0;
/// Offset of the state in a slot.
pub const SLOT_STATE: usize = 4;
/// Offset of the start time in a slot.
pub const SLOT_START: usize = 8;
/// Offset of the bytes held in a slot.
pub const SLOT_USED: usize = 16;
/// Offset of the peak in a slot.
pub const SLOT_PEAK: usize = 24;

/// A slot no process owns.
pub const SLOT_FREE: u32 = 0;
/// A slot a process claimed (alive while its alive file is locked).
pub const SLOT_LIVE: u32 = 1;

/// The ledger file of a GPU.
pub fn ledger_file_name(uuid: &crate::GpuUuid) -> String {
    format!("{uuid}.ledger")
}

/// The alive file of slot `slot` of a GPU's ledger.
pub fn alive_file_name(uuid: &crate::GpuUuid, slot: u32) -> String {
    format!("{uuid}.{slot}.alive")
}

/// Byte offset of slot `index` in the file.
pub const fn slot_offset(index: usize) -> usize {
    HEADER_BYTES + index * SLOT_BYTES
}

/// Why a ledger file's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// Not [`FILE_BYTES`] long.
    #[error("a ledger has {expected} bytes, this one {found}")]
    Size {
        /// [`FILE_BYTES`].
        expected: usize,
        /// What was read.
        found: usize,
    },
    /// Not a ledger, or another version's.
    #[error(
        "not a version-{VERSION} gpushare ledger (magic {magic:02x?}, version {version}, {slot_bytes}-byte slots, {slots} slots)"
    )]
    Format {
        /// The first 8 bytes.
        magic: [u8; 8],
        /// The version field.
        version: u32,
        /// The slot size field.
        slot_bytes: u32,
        /// The slot count field.
        slots: u32,
    },
}

/// One claimed slot, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRecord {
    /// The slot's index.
    pub index: u32,
    /// The owner's pid in the container's pid namespace.
    pub pid: u32,
    /// The owner's start time (clock ticks after boot).
    pub start_ticks: u64,
    /// Bytes it holds.
    pub used_bytes: u64,
    /// The most it held at once.
    pub peak_bytes: u64,
}

/// A ledger file read: the limit and the claimed slots (live or not: liveness is in the alive
/// files, see [`crate::reader`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerSnapshot {
    /// The limit as last recorded.
    pub limit_bytes: u64,
    /// Slots at or above this index were never used.
    pub high_water: u32,
    /// Slots in state [`SLOT_LIVE`], by index.
    pub claimed: Vec<SlotRecord>,
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    if let Some(s) = bytes.get(at..at + 4) {
        b.copy_from_slice(s);
    }
    u32::from_ne_bytes(b)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    if let Some(s) = bytes.get(at..at + 8) {
        b.copy_from_slice(s);
    }
    u64::from_ne_bytes(b)
}

/// Reads a ledger file's bytes. Values are as recorded: a container can write its own state
/// directory, so nothing read here is trusted further than its range (an index beyond
/// [`SLOTS`] is never looked at).
pub fn decode(bytes: &[u8]) -> Result<LedgerSnapshot, LedgerError> {
    if bytes.len() != FILE_BYTES {
        return Err(LedgerError::Size {
            expected: FILE_BYTES,
            found: bytes.len(),
        });
    }
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&bytes[..8]);
    let version = u32_at(bytes, HEADER_VERSION);
    let slot_bytes = u32_at(bytes, HEADER_SLOT_BYTES);
    let slots = u32_at(bytes, HEADER_SLOTS);
    if magic != MAGIC
        || version != VERSION
        || slot_bytes as usize != SLOT_BYTES
        || slots as usize != SLOTS
    {
        return Err(LedgerError::Format {
            magic,
            version,
            slot_bytes,
            slots,
        });
    }
    let high_water = u32_at(bytes, HEADER_HIGH_WATER).min(SLOTS as u32);
    let claimed = (0..high_water as usize)
        .filter(|&i| u32_at(bytes, slot_offset(i) + SLOT_STATE) == SLOT_LIVE)
        .map(|i| {
            let at = slot_offset(i);
            SlotRecord {
                index: i as u32,
                pid: u32_at(bytes, at + SLOT_PID),
                start_ticks: u64_at(bytes, at + SLOT_START),
                used_bytes: u64_at(bytes, at + SLOT_USED),
                peak_bytes: u64_at(bytes, at + SLOT_PEAK),
            }
        })
        .collect();
    Ok(LedgerSnapshot {
        limit_bytes: u64_at(bytes, HEADER_LIMIT),
        high_water,
        claimed,
    })
}

/// A ledger file's bytes with the header written and every slot free: what the limiter
/// writes into a new file (and what tests build ledgers from).
pub fn empty_file(limit_bytes: u64) -> Vec<u8> {
    let mut out = vec![0u8; FILE_BYTES];
    out[..8].copy_from_slice(&MAGIC);
    out[HEADER_VERSION..HEADER_VERSION + 4].copy_from_slice(&VERSION.to_ne_bytes());
    out[HEADER_SLOT_BYTES..HEADER_SLOT_BYTES + 4]
        .copy_from_slice(&(SLOT_BYTES as u32).to_ne_bytes());
    out[HEADER_SLOTS..HEADER_SLOTS + 4].copy_from_slice(&(SLOTS as u32).to_ne_bytes());
    out[HEADER_LIMIT..HEADER_LIMIT + 8].copy_from_slice(&limit_bytes.to_ne_bytes());
    out
}

/// Writes `record` into a ledger file's bytes (state [`SLOT_LIVE`], high water raised):
/// for tests of readers.
pub fn put_slot(file: &mut [u8], record: &SlotRecord) {
    let at = slot_offset(record.index as usize);
    let mut put = |off: usize, v: &[u8]| {
        if let Some(s) = file.get_mut(at + off..at + off + v.len()) {
            s.copy_from_slice(v);
        }
    };
    put(SLOT_PID, &record.pid.to_ne_bytes());
    put(SLOT_STATE, &SLOT_LIVE.to_ne_bytes());
    put(SLOT_START, &record.start_ticks.to_ne_bytes());
    put(SLOT_USED, &record.used_bytes.to_ne_bytes());
    put(SLOT_PEAK, &record.peak_bytes.to_ne_bytes());
    let high = u32_at(file, HEADER_HIGH_WATER).max(record.index + 1);
    if let Some(s) = file.get_mut(HEADER_HIGH_WATER..HEADER_HIGH_WATER + 4) {
        s.copy_from_slice(&high.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(index: u32, used: u64) -> SlotRecord {
        SlotRecord {
            index,
            pid: 100 + index,
            start_ticks: 5000 + u64::from(index),
            used_bytes: used,
            peak_bytes: used * 2,
        }
    }

    #[test]
    fn a_written_ledger_decodes_to_its_claimed_slots() {
        let mut file = empty_file(4 << 30);
        put_slot(&mut file, &record(0, 1 << 30));
        put_slot(&mut file, &record(7, 3));
        let snapshot = decode(&file).expect("decodes");
        assert_eq!(snapshot.limit_bytes, 4 << 30);
        assert_eq!(snapshot.high_water, 8);
        assert_eq!(snapshot.claimed, vec![record(0, 1 << 30), record(7, 3)]);
    }

    #[test]
    fn the_layout_fits_its_slots() {
        assert_eq!(FILE_BYTES, 64 + 32 * 1024);
        const { assert!(SLOT_PEAK + 8 <= SLOT_BYTES) };
        const { assert!(HEADER_LIMIT + 8 <= HEADER_BYTES) };
        assert_eq!(slot_offset(SLOTS), FILE_BYTES);
    }

    #[test]
    fn foreign_or_truncated_files_are_refused() {
        let file = empty_file(0);
        assert!(matches!(
            decode(&file[..FILE_BYTES - 1]),
            Err(LedgerError::Size { .. })
        ));
        let mut other = file.clone();
        other[0] = b'X';
        assert!(matches!(decode(&other), Err(LedgerError::Format { .. })));
        let mut newer = file.clone();
        newer[HEADER_VERSION..HEADER_VERSION + 4].copy_from_slice(&2u32.to_ne_bytes());
        let err = decode(&newer).expect_err("version 2");
        assert!(err.to_string().contains("version 2"), "{err}");
    }

    #[test]
    fn a_hostile_high_water_mark_is_clamped() {
        let mut file = empty_file(0);
        file[HEADER_HIGH_WATER..HEADER_HIGH_WATER + 4].copy_from_slice(&u32::MAX.to_ne_bytes());
        let snapshot = decode(&file).expect("decodes");
        assert_eq!(snapshot.high_water, SLOTS as u32);
        assert!(snapshot.claimed.is_empty());
    }
}
