//! The accounting of one process: its mode, the GPUs it touched (each with its ledger and
//! slot), and its book of what it holds (pointers, arrays, VMM handles and their mappings,
//! pools), so that a free knows what it gives back.
//!
//! # Admission
//!
//! An allocation on a GPU runs with the GPU held ([`Gpu::hold`]): this process's mutex for
//! the GPU (threads) and then the ledger's OFD lock (processes). With both held it checks
//! that the container's total plus the request fits the limit, calls the driver, and records
//! the result in its slot. Nobody else can pass the check in between, so a container never
//! holds more than its limit, however many processes race for the last bytes.
//!
//! # What counts
//!
//! - `cuMemAlloc_v2`, `cuMemAllocPitch_v2` (pitch × height, as the driver returned it),
//!   `cuMemAllocManaged` (its full size, on the current device: managed memory may all come
//!   to reside there), arrays (the driver's size for them where it can say, else width ×
//!   height × depth × channels × element size): their bytes until freed.
//! - VMM: `cuMemCreate` with a device location: its bytes until the handle is released
//!   **and** no mapping of it is left, which is when the driver frees it. Host and host-NUMA
//!   locations (NCCL's) do not count.
//! - Stream-ordered allocation: what each pool the process allocated from holds from the GPU
//!   (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), re-read after each allocation and free through
//!   it, so memory a pool keeps cached after a free still counts, as it is still taken from
//!   the GPU. When an allocation does not fit, the process's pools on that GPU are trimmed
//!   before it is refused.
//! - Allocations made while their stream is being captured into a CUDA graph do not count:
//!   they become graph memory nodes, allocated when the graph is launched, which the limiter
//!   does not see.

use core::ffi::c_void;
use core::ptr;
use core::sync::atomic::{AtomicPtr, AtomicU8, Ordering};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use gpushare_limiter_contract::{GpuUuid, Limits};

use crate::config::{self, Mode};
use crate::driver::{Resolved, real_fn};
use crate::fds;
use crate::ffi::{
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, CUDA_SUCCESS, CuDevice,
    CuMemoryPool, CuResult, CuUuid, FnCtxGetDevice, FnDeviceGetUuid, FnMemPoolGetAttribute,
    FnMemPoolTrimTo,
};
use crate::ledger::{Ledger, Locked};
use crate::symbols::Sym;

/// Device ordinals cached; higher ones are looked up each time.
const ORDINALS: usize = 64;

/// One process's accounting.
pub struct Process {
    /// What the limiter does here.
    pub mode: Mode,
    pid: u32,
    start_ticks: u64,
    gpus: Mutex<Vec<&'static Gpu>>,
    by_ordinal: [AtomicPtr<Gpu>; ORDINALS],
    book: Mutex<Book>,
}

/// What one allocation holds.
#[derive(Clone, Copy)]
pub struct Charge {
    /// Its GPU.
    pub gpu: &'static Gpu,
    /// Its bytes (for pool allocations: the request, informational).
    pub bytes: u64,
    /// The pool it came from: its charge is the pool's, not its own.
    pub pool: Option<usize>,
}

/// A VMM allocation handle.
#[derive(Clone, Copy)]
pub struct Handle {
    /// Its GPU.
    pub gpu: &'static Gpu,
    /// Its bytes.
    pub bytes: u64,
    /// References: 1 from `cuMemCreate`, one more per `cuMemRetainAllocationHandle`.
    pub refs: u32,
    /// Mappings left.
    pub maps: u32,
}

/// What the process holds.
#[derive(Default)]
pub struct Book {
    /// Device pointers from the `cuMemAlloc*` family.
    pub allocs: HashMap<u64, Charge>,
    /// Arrays.
    pub arrays: HashMap<usize, Charge>,
    /// VMM handles.
    pub handles: HashMap<u64, Handle>,
    /// Mappings of VMM handles: address → (size, handle).
    pub mappings: BTreeMap<u64, (u64, u64)>,
    /// Pools with a device location, by handle.
    pub pools: HashMap<usize, &'static Gpu>,
}

static PROCESS: AtomicPtr<Process> = AtomicPtr::new(ptr::null_mut());
/// 0: not built; 1: being built; 2: built.
static STATE: AtomicU8 = AtomicU8::new(0);

/// The process's accounting, built on first use (and again in a forked child).
pub fn process() -> &'static Process {
    if fds::take_forked() {
        // A forked child starts over: new slots, an empty book. The parent's structures are
        // left alone (another thread of the parent may have held their locks at the fork).
        PROCESS.store(ptr::null_mut(), Ordering::Release);
        STATE.store(0, Ordering::Release);
    }
    loop {
        match STATE.load(Ordering::Acquire) {
            2 => {
                let p = PROCESS.load(Ordering::Acquire);
                // SAFETY: published below from a leaked Box before STATE became 2; never
                // freed.
                if let Some(p) = unsafe { p.as_ref() } {
                    return p;
                }
            }
            0 => {
                if STATE
                    .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let built: &'static Process = Box::leak(Box::new(Process::new(config::load())));
                    fds::register_fork_handler();
                    PROCESS.store(ptr::from_ref(built).cast_mut(), Ordering::Release);
                    STATE.store(2, Ordering::Release);
                    return built;
                }
            }
            _ => std::thread::yield_now(),
        }
    }
}

/// This process's start time in clock ticks after boot (`/proc/self/stat` field 22), 0 if
/// unreadable.
fn start_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // Fields after the command name, which is in parentheses and may hold spaces.
            let after = stat.rsplit_once(')')?.1;
            after.split_whitespace().nth(19)?.parse().ok()
        })
        .unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock was caught at the boundary; the data is still consistent
    // enough to go on (counts are saturating).
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Process {
    fn new(mode: Mode) -> Self {
        if let Mode::Closed(why) = &mode {
            crate::warn(&format!("{why}: every GPU allocation is refused"));
        }
        Process {
            mode,
            pid: std::process::id(),
            start_ticks: start_ticks(),
            gpus: Mutex::new(Vec::new()),
            by_ordinal: [const { AtomicPtr::new(ptr::null_mut()) }; ORDINALS],
            book: Mutex::new(Book::default()),
        }
    }

    /// The book, locked. Never held while calling the driver.
    pub fn book(&self) -> MutexGuard<'_, Book> {
        lock(&self.book)
    }

    fn limits(&self) -> Option<(&Limits, &PathBuf)> {
        match &self.mode {
            Mode::Active { limits, state_dir } => Some((limits, state_dir)),
            _ => None,
        }
    }

    /// The GPU with `uuid`.
    pub fn gpu_by_uuid(&self, uuid: GpuUuid) -> Option<&'static Gpu> {
        let (limits, state_dir) = self.limits()?;
        let mut gpus = lock(&self.gpus);
        if let Some(g) = gpus.iter().find(|g| g.uuid == uuid) {
            return Some(g);
        }
        let limit = limits.get(&uuid).unwrap_or_else(|| {
            crate::warn(&format!(
                "{uuid} is not in the limits file: no memory of it may be allocated"
            ));
            0
        });
        let ledger = Ledger::open(state_dir, &uuid, limit).map_err(|e| {
            let why = format!(
                "the ledger of {uuid} in {} cannot be used: {e}",
                state_dir.display()
            );
            crate::warn(&format!("{why}: allocations on it are refused"));
            why
        });
        let gpu: &'static Gpu = Box::leak(Box::new(Gpu {
            uuid,
            limit,
            ledger,
            local: Mutex::new(Local::default()),
        }));
        gpus.push(gpu);
        Some(gpu)
    }

    /// The GPU of device ordinal `dev`; the driver's error when it cannot say which it is.
    pub fn gpu_for_device(&self, drv: &Resolved, dev: CuDevice) -> Result<&'static Gpu, CuResult> {
        let cached = usize::try_from(dev)
            .ok()
            .and_then(|d| self.by_ordinal.get(d));
        if let Some(c) = cached {
            // SAFETY: only leaked `Gpu`s are ever stored.
            if let Some(g) = unsafe { c.load(Ordering::Acquire).as_ref() } {
                return Ok(g);
            }
        }
        let mut uuid = CuUuid::default();
        // SAFETY: both entry points have the type FnDeviceGetUuid.
        let get = unsafe { real_fn::<FnDeviceGetUuid>(drv, Sym::cuDeviceGetUuid_v2) }
            // SAFETY: as above.
            .or_else(|| unsafe { real_fn::<FnDeviceGetUuid>(drv, Sym::cuDeviceGetUuid) })
            .ok_or(crate::ffi::CUDA_ERROR_NOT_INITIALIZED)?;
        // SAFETY: the driver's function with a live CUuuid.
        let r = unsafe { get(&mut uuid, dev) };
        if r != CUDA_SUCCESS {
            return Err(r);
        }
        let gpu = self
            .gpu_by_uuid(GpuUuid::from_cuda_bytes(&uuid.bytes))
            .ok_or(crate::ffi::CUDA_ERROR_NOT_INITIALIZED)?;
        if let Some(c) = cached {
            c.store(ptr::from_ref(gpu).cast_mut(), Ordering::Release);
        }
        Ok(gpu)
    }

    /// The GPU of the calling thread's current context.
    pub fn current_gpu(&self, drv: &Resolved) -> Result<&'static Gpu, CuResult> {
        let dev = current_device(drv)?;
        self.gpu_for_device(drv, dev)
    }
}

/// The device of the current context.
pub fn current_device(drv: &Resolved) -> Result<CuDevice, CuResult> {
    // SAFETY: the type of cuCtxGetDevice.
    let get = unsafe { real_fn::<FnCtxGetDevice>(drv, Sym::cuCtxGetDevice) }
        .ok_or(crate::ffi::CUDA_ERROR_NOT_INITIALIZED)?;
    let mut dev: CuDevice = 0;
    // SAFETY: the driver's function with a live out-parameter.
    let r = unsafe { get(&mut dev) };
    if r == CUDA_SUCCESS { Ok(dev) } else { Err(r) }
}

/// One GPU as this process sees it.
pub struct Gpu {
    /// Its UUID.
    pub uuid: GpuUuid,
    /// The container's limit on it.
    pub limit: u64,
    ledger: Result<Ledger, String>,
    local: Mutex<Local>,
}

#[derive(Default)]
struct Local {
    /// This process's slot in the ledger, once claimed.
    slot: Option<u32>,
    /// Pools this process allocated from on this GPU, with what they were last charged.
    pools: Vec<(usize, u64)>,
}

/// A GPU held: this process's lock for it and the ledger's lock, with the slot claimed.
///
/// The ledger's lock is released before this process's lock (fields drop in order): another
/// thread of the process shares the lock's open file description, so it must not get in
/// while the description still holds the lock, or this thread's unlock would end its hold.
pub struct Held<'a> {
    gpu: &'a Gpu,
    locked: Locked<'a>,
    local: MutexGuard<'a, Local>,
    slot: u32,
}

/// A pool's counter.
fn pool_attribute(drv: &Resolved, pool: usize, attribute: core::ffi::c_int) -> Option<u64> {
    // SAFETY: the type of cuMemPoolGetAttribute.
    let get = unsafe { real_fn::<FnMemPoolGetAttribute>(drv, Sym::cuMemPoolGetAttribute) }?;
    let mut value: u64 = 0;
    // SAFETY: both attributes are 64-bit counters written into a live u64.
    let r = unsafe {
        get(
            pool as CuMemoryPool,
            attribute,
            ptr::from_mut(&mut value).cast::<c_void>(),
        )
    };
    (r == CUDA_SUCCESS).then_some(value)
}

impl Gpu {
    /// Holds the GPU, claiming this process's slot on first use. The reason when its ledger
    /// cannot be used.
    pub fn hold(&self, p: &Process) -> Result<Held<'_>, String> {
        let ledger = self.ledger.as_ref().map_err(Clone::clone)?;
        let mut local = lock(&self.local);
        let locked = ledger
            .lock()
            .map_err(|e| format!("the ledger of {} cannot be locked: {e}", self.uuid))?;
        let slot = match local.slot {
            Some(s) => s,
            None => {
                let (s, _alive) = locked
                    .claim(p.pid, p.start_ticks, self.limit)
                    .map_err(|e| format!("no slot in the ledger of {}: {e}", self.uuid))?;
                local.slot = Some(s);
                s
            }
        };
        Ok(Held {
            gpu: self,
            locked,
            local,
            slot,
        })
    }

    /// Bytes the container's live processes hold on the GPU (dead ones' slots freed first);
    /// `None` when the ledger cannot be used.
    pub fn used(&self) -> Option<u64> {
        let ledger = self.ledger.as_ref().ok()?;
        let local = lock(&self.local);
        let locked = ledger.lock().ok()?;
        locked.reclaim_dead(local.slot);
        Some(locked.total())
    }
}

impl Held<'_> {
    /// Whether `bytes` more fit the limit now.
    pub fn fits(&self, bytes: u64) -> bool {
        self.locked.total().saturating_add(bytes) <= self.gpu.limit
    }

    /// Whether the container holds more than the limit.
    pub fn over(&self) -> bool {
        !self.fits(0)
    }

    /// Makes `need` more bytes fit if it can: frees dead processes' slots, then trims this
    /// process's pools on the GPU. Whether they fit.
    pub fn make_room(&mut self, drv: &Resolved, need: u64) -> bool {
        if self.fits(need) {
            return true;
        }
        self.locked.reclaim_dead(Some(self.slot));
        if self.fits(need) {
            return true;
        }
        if self.local.pools.is_empty() {
            return false;
        }
        // SAFETY: the type of cuMemPoolTrimTo.
        if let Some(trim) = unsafe { real_fn::<FnMemPoolTrimTo>(drv, Sym::cuMemPoolTrimTo) } {
            let pools: Vec<usize> = self.local.pools.iter().map(|(p, _)| *p).collect();
            for pool in pools {
                // SAFETY: trimming a pool this process allocated from; it releases only
                // memory nothing uses.
                unsafe { trim(pool as CuMemoryPool, 0) };
                self.refresh_pool(drv, pool);
            }
        }
        self.fits(need)
    }

    /// Adds `bytes` to this process's slot.
    pub fn charge(&self, bytes: u64) {
        self.locked.add(self.slot, bytes);
    }

    /// Takes `bytes` from this process's slot.
    pub fn uncharge(&self, bytes: u64) {
        self.locked.sub(self.slot, bytes);
    }

    /// Re-reads what `pool` holds from the GPU and charges the difference; starts tracking
    /// it if new. Returns (reserved, used) of the pool when the driver says.
    pub fn refresh_pool(&mut self, drv: &Resolved, pool: usize) -> Option<(u64, u64)> {
        let reserved = pool_attribute(drv, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = pool_attribute(drv, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT).unwrap_or(reserved);
        let before = match self.local.pools.iter_mut().find(|(p, _)| *p == pool) {
            Some((_, charged)) => core::mem::replace(charged, reserved),
            None => {
                self.local.pools.push((pool, reserved));
                0
            }
        };
        if reserved >= before {
            self.charge(reserved - before);
        } else {
            self.uncharge(before - reserved);
        }
        Some((reserved, used))
    }

    /// Stops tracking `pool` (destroyed) and gives back its charge.
    pub fn forget_pool(&mut self, pool: usize) {
        if let Some(i) = self.local.pools.iter().position(|(p, _)| *p == pool) {
            let (_, charged) = self.local.pools.swap_remove(i);
            self.uncharge(charged);
        }
    }
}
