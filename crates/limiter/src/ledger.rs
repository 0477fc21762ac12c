//! One GPU's ledger as the limiter uses it: the file mapped shared, the GPU's lock (an OFD
//! `fcntl` write lock on its first byte), this process's slot and the alive file it holds
//! locked. The layout and the rules are `gpushare_limiter_contract::ledger`'s.
//!
//! Every read and write of the mapping happens with the lock held, through atomics (a reader
//! outside the lock, such as another limiter's view, never sees a torn value).

use core::ffi::c_int;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use gpushare_limiter_contract::GpuUuid;
use gpushare_limiter_contract::ledger::{
    self as layout, FILE_BYTES, HEADER_HIGH_WATER, HEADER_LIMIT, SLOT_FREE, SLOT_LIVE, SLOT_PEAK,
    SLOT_PID, SLOT_START, SLOT_STATE, SLOT_USED, SLOTS,
};

use crate::fds;

/// A mapped ledger.
pub struct Ledger {
    fd: c_int,
    base: *mut u8,
    dir: CString,
    uuid: GpuUuid,
}

// SAFETY: the mapping is shared memory accessed only through atomics; the descriptor is an
// integer. Moving or sharing the struct between threads changes neither.
unsafe impl Send for Ledger {}
// SAFETY: as above.
unsafe impl Sync for Ledger {}

/// The GPU's lock, held until dropped.
pub struct Locked<'a> {
    ledger: &'a Ledger,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Failing to unlock is impossible for a lock this description holds; closing the
        // descriptor (process exit) would release it anyway.
        let _ = ofd_lock(self.ledger.fd, libc::F_UNLCK as i16);
    }
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn path_c(dir: &Path, name: &str) -> std::io::Result<CString> {
    let mut bytes = dir.as_os_str().as_bytes().to_vec();
    bytes.push(b'/');
    bytes.extend_from_slice(name.as_bytes());
    CString::new(bytes).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

/// Sets (`F_WRLCK`) or clears (`F_UNLCK`) the OFD lock on the ledger's lock byte, waiting.
fn ofd_lock(fd: c_int, kind: i16) -> std::io::Result<()> {
    loop {
        // SAFETY: a zeroed `flock` is a valid value of the plain C struct.
        let mut lock: libc::flock = unsafe { core::mem::zeroed() };
        lock.l_type = kind;
        lock.l_whence = libc::SEEK_SET as i16;
        lock.l_start = layout::LOCK_OFFSET as libc::off_t;
        lock.l_len = 1;
        // SAFETY: fcntl on our descriptor with a pointer to a live `flock`.
        let r = unsafe { libc::fcntl(fd, libc::F_OFD_SETLKW, &mut lock) };
        if r == 0 {
            return Ok(());
        }
        let e = errno();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Opens `path` with `flags` (always close-on-exec, never following a link) and mode 0666.
fn open(path: &CString, flags: c_int) -> std::io::Result<c_int> {
    // SAFETY: a NUL-terminated path; the mode argument is read only with O_CREAT.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            flags | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            0o666 as libc::c_uint,
        )
    };
    if fd < 0 { Err(errno()) } else { Ok(fd) }
}

fn close(fd: c_int) {
    fds::forget(fd);
    // SAFETY: a descriptor this process opened and nobody else closes.
    unsafe { libc::close(fd) };
}

impl Ledger {
    /// Opens (creating if need be) the ledger of `uuid` in `dir` and maps it.
    pub fn open(dir: &Path, uuid: &GpuUuid, limit: u64) -> std::io::Result<Ledger> {
        let path = path_c(dir, &layout::ledger_file_name(uuid))?;
        let fd = open(&path, libc::O_RDWR | libc::O_CREAT)?;
        fds::remember(fd);
        let ledger = Ledger {
            fd,
            base: core::ptr::null_mut(),
            dir: CString::new(dir.as_os_str().as_bytes())
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?,
            uuid: uuid.clone(),
        };
        match ledger.initialise(limit) {
            Ok(base) => Ok(Ledger { base, ..ledger }),
            Err(e) => {
                close(fd);
                Err(e)
            }
        }
    }

    /// Under the lock: gives a new file its size and header (or checks an existing one's),
    /// then maps it.
    fn initialise(&self, limit: u64) -> std::io::Result<*mut u8> {
        ofd_lock(self.fd, libc::F_WRLCK as i16)?;
        let result = self.initialise_locked(limit);
        let _ = ofd_lock(self.fd, libc::F_UNLCK as i16);
        result
    }

    fn initialise_locked(&self, limit: u64) -> std::io::Result<*mut u8> {
        // SAFETY: a zeroed `stat` is a valid value; fstat fills it.
        let mut st: libc::stat = unsafe { core::mem::zeroed() };
        // SAFETY: fstat on our descriptor into a live struct.
        if unsafe { libc::fstat(self.fd, &mut st) } != 0 {
            return Err(errno());
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(std::io::Error::other("the ledger is not a regular file"));
        }
        // Every process of the container may run as another user: the creator opens it to
        // all (the state directory is the container's alone).
        // SAFETY: fchmod on our descriptor; failing (not the owner) is harmless.
        unsafe { libc::fchmod(self.fd, 0o666) };
        if st.st_size == 0 {
            let empty = layout::empty_file(limit);
            let mut written = 0usize;
            while written < empty.len() {
                let rest = empty.get(written..).unwrap_or_default();
                // SAFETY: writing from a live buffer of `rest.len()` bytes at an offset.
                let n = unsafe {
                    libc::pwrite(
                        self.fd,
                        rest.as_ptr().cast(),
                        rest.len(),
                        written as libc::off_t,
                    )
                };
                if n <= 0 {
                    let e = errno();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
                written += n as usize;
            }
        } else if st.st_size as usize != FILE_BYTES {
            return Err(std::io::Error::other(format!(
                "the ledger has {} bytes, not {FILE_BYTES}",
                st.st_size
            )));
        }
        // SAFETY: mapping FILE_BYTES of a file that has exactly that size, shared, for
        // reading and writing; the mapping is never unmapped (the process keeps it).
        let base = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                FILE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(errno());
        }
        let mapped = base.cast::<u8>();
        let mut header = [0u8; layout::HEADER_BYTES];
        // SAFETY: the mapping is FILE_BYTES long, longer than the header.
        unsafe { core::ptr::copy_nonoverlapping(mapped, header.as_mut_ptr(), header.len()) };
        let mut probe = layout::empty_file(0);
        if let Some(h) = probe.get_mut(..layout::HEADER_BYTES) {
            h.copy_from_slice(&header);
        }
        if let Err(e) = layout::decode(&probe) {
            // SAFETY: unmapping the mapping just made.
            unsafe { libc::munmap(base, FILE_BYTES) };
            return Err(std::io::Error::other(e.to_string()));
        }
        Ok(mapped)
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset + 4 <= FILE_BYTES && offset.is_multiple_of(4));
        // SAFETY: `base` maps FILE_BYTES bytes for the life of the process; every offset used
        // is a 4-aligned field inside it (the layout's constants), and the mapping is only
        // accessed through atomics.
        unsafe { AtomicU32::from_ptr(self.base.add(offset).cast()) }
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= FILE_BYTES && offset.is_multiple_of(8));
        // SAFETY: as in `u32_at`, 8-aligned.
        unsafe { AtomicU64::from_ptr(self.base.add(offset).cast()) }
    }

    fn slot_field(&self, slot: u32, field: usize) -> usize {
        layout::slot_offset((slot as usize).min(SLOTS - 1)) + field
    }

    /// Takes the GPU's lock, waiting for the process holding it.
    pub fn lock(&self) -> std::io::Result<Locked<'_>> {
        ofd_lock(self.fd, libc::F_WRLCK as i16)?;
        Ok(Locked { ledger: self })
    }
}

impl Locked<'_> {
    fn high_water(&self) -> u32 {
        self.ledger
            .u32_at(HEADER_HIGH_WATER)
            .load(Ordering::Relaxed)
            .min(SLOTS as u32)
    }

    /// Bytes every claimed slot holds together.
    pub fn total(&self) -> u64 {
        (0..self.high_water())
            .filter(|&s| self.state(s) == SLOT_LIVE)
            .fold(0u64, |sum, s| sum.saturating_add(self.used(s)))
    }

    fn state(&self, slot: u32) -> u32 {
        self.ledger
            .u32_at(self.ledger.slot_field(slot, SLOT_STATE))
            .load(Ordering::Relaxed)
    }

    /// Bytes slot `slot` holds.
    pub fn used(&self, slot: u32) -> u64 {
        self.ledger
            .u64_at(self.ledger.slot_field(slot, SLOT_USED))
            .load(Ordering::Relaxed)
    }

    /// Adds `bytes` to slot `slot`.
    pub fn add(&self, slot: u32, bytes: u64) {
        let used = self.used(slot).saturating_add(bytes);
        self.set_used(slot, used);
    }

    /// Takes `bytes` from slot `slot`.
    pub fn sub(&self, slot: u32, bytes: u64) {
        let used = self.used(slot).saturating_sub(bytes);
        self.set_used(slot, used);
    }

    fn set_used(&self, slot: u32, used: u64) {
        let l = self.ledger;
        l.u64_at(l.slot_field(slot, SLOT_USED))
            .store(used, Ordering::Relaxed);
        l.u64_at(l.slot_field(slot, SLOT_PEAK))
            .fetch_max(used, Ordering::Relaxed);
    }

    /// Whether the owner of `slot` is gone: its alive file is missing or not locked.
    fn owner_gone(&self, slot: u32) -> bool {
        let Ok(path) = path_c(
            Path::new(std::ffi::OsStr::from_bytes(self.ledger.dir.as_bytes())),
            &layout::alive_file_name(&self.ledger.uuid, slot),
        ) else {
            return false;
        };
        let fd = match open(&path, libc::O_RDONLY) {
            Ok(fd) => fd,
            Err(e) => return e.kind() == std::io::ErrorKind::NotFound,
        };
        // SAFETY: flock on a descriptor just opened; a lock we get goes away with it.
        let got = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
        // SAFETY: closing the descriptor just opened (it was never remembered).
        unsafe { libc::close(fd) };
        got
    }

    fn free(&self, slot: u32) {
        let l = self.ledger;
        l.u64_at(l.slot_field(slot, SLOT_USED))
            .store(0, Ordering::Relaxed);
        l.u32_at(l.slot_field(slot, SLOT_PID))
            .store(0, Ordering::Relaxed);
        l.u32_at(l.slot_field(slot, SLOT_STATE))
            .store(SLOT_FREE, Ordering::Relaxed);
    }

    /// Frees the slots of dead processes (every one but `mine`); returns the bytes freed.
    pub fn reclaim_dead(&self, mine: Option<u32>) -> u64 {
        let mut freed = 0u64;
        for slot in 0..self.high_water() {
            if Some(slot) != mine && self.state(slot) == SLOT_LIVE && self.owner_gone(slot) {
                freed = freed.saturating_add(self.used(slot));
                self.free(slot);
            }
        }
        freed
    }

    /// Claims a slot for this process: a free one, or one whose owner is gone. Returns the
    /// slot and its alive file's descriptor, locked: keep it open for as long as the process
    /// lives.
    pub fn claim(&self, pid: u32, start_ticks: u64, limit: u64) -> std::io::Result<(u32, c_int)> {
        let dir = Path::new(std::ffi::OsStr::from_bytes(self.ledger.dir.as_bytes()));
        let high = self.high_water();
        for slot in 0..SLOTS as u32 {
            let usable = slot >= high || self.state(slot) == SLOT_FREE || self.owner_gone(slot);
            if !usable {
                continue;
            }
            let path = path_c(dir, &layout::alive_file_name(&self.ledger.uuid, slot))?;
            let fd = open(&path, libc::O_RDONLY | libc::O_CREAT)?;
            // SAFETY: fchmod/flock on the descriptor just opened.
            unsafe { libc::fchmod(fd, 0o666) };
            // SAFETY: as above.
            if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                // Someone holds it (a reader looking, for a moment): another slot.
                // SAFETY: closing the descriptor just opened.
                unsafe { libc::close(fd) };
                continue;
            }
            fds::remember(fd);
            let l = self.ledger;
            self.free(slot);
            l.u32_at(l.slot_field(slot, SLOT_PID))
                .store(pid, Ordering::Relaxed);
            l.u64_at(l.slot_field(slot, SLOT_START))
                .store(start_ticks, Ordering::Relaxed);
            l.u64_at(l.slot_field(slot, SLOT_PEAK))
                .store(0, Ordering::Relaxed);
            l.u32_at(l.slot_field(slot, SLOT_STATE))
                .store(SLOT_LIVE, Ordering::Relaxed);
            l.u32_at(HEADER_HIGH_WATER)
                .fetch_max(slot + 1, Ordering::Relaxed);
            l.u64_at(HEADER_LIMIT).store(limit, Ordering::Relaxed);
            return Ok((slot, fd));
        }
        Err(std::io::Error::other(format!(
            "all {SLOTS} slots of the ledger belong to live processes"
        )))
    }
}
