//! The hooks of the CUDA driver API: exported under the exact versioned names they replace,
//! with the exact signatures, and handed out by `dlsym` and `cuGetProcAddress` in place of
//! the driver's functions. Each one enters through [`boundary::hook`]; each calls the real
//! function it replaces (never another version of it).
//!
//! | hook | why |
//! | --- | --- |
//! | `cuGetProcAddress`, `cuGetProcAddress_v2` | runtimes fetch every entry point through them: the answer is routed to the hook of the exact entry point the driver chose |
//! | `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemAllocManaged` | allocations: admitted against the limit |
//! | `cuMemFree_v2` | gives back what those (and stream-ordered ones) held |
//! | `cuMemAllocAsync`, `cuMemAllocFromPoolAsync` (and `_ptsz`) | stream-ordered allocations: admitted, the pool's reservation counted |
//! | `cuMemFreeAsync` (and `_ptsz`) | re-reads the pool's reservation |
//! | `cuMemPoolCreate`, `cuMemPoolDestroy` | which GPU a pool takes memory from; a destroyed pool's charge given back |
//! | `cuMemCreate`, `cuMemRelease`, `cuMemMap`, `cuMemUnmap`, `cuMemRetainAllocationHandle` | VMM (PyTorch's expandable segments, NCCL): a handle counts until released and unmapped |
//! | `cuArrayCreate_v2`, `cuArray3DCreate_v2`, `cuArrayDestroy` | arrays (textures) |
//! | `cuMemGetInfo_v2`, `cuDeviceTotalMem_v2` | the view: the limit as total, what is left of it as free |

use core::ffi::{CStr, c_char, c_int, c_uint, c_void};
use core::ptr;

use crate::account::{self, Charge, Handle, Process, current_device};
use crate::boundary;
use crate::config::Mode;
use crate::driver::{self, Resolved, real_fn};
use crate::ffi::*;
use crate::interpose::route_proc_address;
use crate::symbols::Sym;

/// What a hook does in this process.
enum Setup {
    /// Call the real function and nothing else (the limiter is off, or the driver cannot be
    /// reached to account).
    Pass,
    /// Injected but unusable: allocations refused.
    Closed,
    /// Account.
    Active(&'static Resolved, &'static Process),
}

fn setup() -> Setup {
    let Some(drv) = driver::cuda() else {
        return Setup::Pass;
    };
    let p = account::process();
    match &p.mode {
        Mode::Off => Setup::Pass,
        Mode::Closed(_) => Setup::Closed,
        Mode::Active { .. } => Setup::Active(drv, p),
    }
}

/// The real function `sym` (of type `F`), from the driver.
///
/// # Safety
///
/// `F` is the type of `sym`.
unsafe fn real<F: Copy>(sym: Sym) -> Option<F> {
    let drv = driver::cuda()?;
    // SAFETY: forwarded.
    unsafe { real_fn::<F>(drv, sym) }
}

/// Calls the real `sym` with `call`, or answers "not initialised" when there is none.
///
/// # Safety
///
/// `F` is the type of `sym`.
unsafe fn forward<F: Copy>(sym: Sym, call: impl FnOnce(F) -> CuResult) -> CuResult {
    // SAFETY: forwarded.
    match unsafe { real::<F>(sym) } {
        Some(f) => call(f),
        None => CUDA_ERROR_NOT_INITIALIZED,
    }
}

fn refuse(why: &str) -> CuResult {
    crate::warn_once(why);
    CUDA_ERROR_OUT_OF_MEMORY
}

/// Admits `need` bytes on the GPU of `gpu`, runs `alloc` (the real call) with the GPU held
/// and lets `record` settle the charge. `record` gets the held GPU and the result; it returns
/// the final result (it may undo an allocation that turned out larger than admitted).
fn admit(
    drv: &Resolved,
    p: &Process,
    gpu: Result<&'static account::Gpu, CuResult>,
    need: u64,
    alloc: impl FnOnce() -> CuResult,
    record: impl FnOnce(&mut account::Held<'_>, &'static account::Gpu, CuResult) -> CuResult,
) -> CuResult {
    let gpu = match gpu {
        Ok(g) => g,
        Err(code) => return code,
    };
    let mut held = match gpu.hold(p) {
        Ok(h) => h,
        Err(why) => return refuse(&why),
    };
    if !held.make_room(drv, need) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let r = alloc();
    record(&mut held, gpu, r)
}

/// Gives back `charge` after its memory was freed.
fn release(drv: &Resolved, p: &Process, charge: Charge) {
    if let Ok(mut held) = charge.gpu.hold(p) {
        match charge.pool {
            None => held.uncharge(charge.bytes),
            Some(pool) => {
                held.refresh_pool(drv, pool);
            }
        }
    }
}

// ---- cuGetProcAddress --------------------------------------------------------------------

/// Routes `*pfn` after a successful lookup of `symbol`.
///
/// # Safety
///
/// `symbol` is NUL-terminated; `pfn` was written by the driver.
unsafe fn route_answer(r: CuResult, symbol: *const c_char, pfn: *mut *mut c_void) -> CuResult {
    if r == CUDA_SUCCESS && !symbol.is_null() && !pfn.is_null() {
        // SAFETY: the caller's NUL-terminated name.
        let wanted = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        // SAFETY: the driver just wrote the slot.
        let addr = unsafe { pfn.read() };
        // SAFETY: as above.
        unsafe { pfn.write(route_proc_address(addr, wanted)) };
    }
    r
}

/// `cuGetProcAddress` (CUDA 11.3 – 12): the driver's answer, routed to the hook of the exact
/// entry point it is.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnGetProcAddress| unsafe { f(symbol, pfn, cuda_version, flags) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuGetProcAddress, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            // SAFETY: the type of the symbol; then the caller's arguments.
            let r = unsafe { forward(Sym::cuGetProcAddress, call) };
            // SAFETY: the caller's name and slot.
            unsafe { route_answer(r, symbol, pfn) }
        },
    )
}

/// `cuGetProcAddress_v2` (CUDA 12+): as `cuGetProcAddress`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnGetProcAddressV2| unsafe { f(symbol, pfn, cuda_version, flags, status) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuGetProcAddress_v2, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuGetProcAddress_v2, call) };
            // SAFETY: the caller's name and slot.
            unsafe { route_answer(r, symbol, pfn) }
        },
    )
}

// ---- plain allocations -----------------------------------------------------------------

/// `cuMemAlloc_v2` and `cuMemAllocManaged`: `bytes` on the current device.
fn plain_alloc(
    sym: Sym,
    dptr: *mut CuDevicePtr,
    bytes: usize,
    call: impl FnOnce() -> CuResult,
) -> CuResult {
    let (drv, p) = match setup() {
        Setup::Pass => return call(),
        Setup::Closed => return CUDA_ERROR_OUT_OF_MEMORY,
        Setup::Active(d, p) => (d, p),
    };
    let _ = sym;
    admit(
        drv,
        p,
        p.current_gpu(drv),
        bytes as u64,
        call,
        |held, gpu, r| {
            if r == CUDA_SUCCESS && !dptr.is_null() {
                held.charge(bytes as u64);
                // SAFETY: the driver wrote the pointer on success.
                let addr = unsafe { dptr.read() };
                p.book().allocs.insert(
                    addr,
                    Charge {
                        gpu,
                        bytes: bytes as u64,
                        pool: None,
                    },
                );
            }
            r
        },
    )
}

/// `cuMemAlloc_v2`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemAlloc| unsafe { f(dptr, bytesize) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemAlloc_v2, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            plain_alloc(Sym::cuMemAlloc_v2, dptr, bytesize, || {
                // SAFETY: the type of the symbol.
                unsafe { forward(Sym::cuMemAlloc_v2, call) }
            })
        },
    )
}

/// `cuMemAllocManaged`: counted in full on the current device.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    flags: c_uint,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemAllocManaged| unsafe { f(dptr, bytesize, flags) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemAllocManaged, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            plain_alloc(Sym::cuMemAllocManaged, dptr, bytesize, || {
                // SAFETY: the type of the symbol.
                unsafe { forward(Sym::cuMemAllocManaged, call) }
            })
        },
    )
}

/// `cuMemAllocPitch_v2`: admitted for width × height, counted as pitch × height.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CuDevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemAllocPitch| unsafe { f(dptr, pitch, width, height, element_size) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemAllocPitch_v2, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            let (drv, p) = match setup() {
                // SAFETY: the type of the symbol.
                Setup::Pass => return unsafe { forward(Sym::cuMemAllocPitch_v2, call) },
                Setup::Closed => return CUDA_ERROR_OUT_OF_MEMORY,
                Setup::Active(d, p) => (d, p),
            };
            let need = (width as u64).saturating_mul(height as u64);
            admit(
                drv,
                p,
                p.current_gpu(drv),
                need,
                // SAFETY: the type of the symbol.
                || unsafe { forward(Sym::cuMemAllocPitch_v2, call) },
                |held, gpu, r| {
                    if r != CUDA_SUCCESS || dptr.is_null() || pitch.is_null() {
                        return r;
                    }
                    // SAFETY: the driver wrote both on success.
                    let (addr, row) = unsafe { (dptr.read(), pitch.read()) };
                    let bytes = (row as u64).saturating_mul(height as u64).max(need);
                    if bytes > need && !held.fits(bytes) {
                        // SAFETY: freeing what the driver just allocated.
                        unsafe { forward(Sym::cuMemFree_v2, |f: FnMemFree| f(addr)) };
                        return CUDA_ERROR_OUT_OF_MEMORY;
                    }
                    held.charge(bytes);
                    p.book().allocs.insert(
                        addr,
                        Charge {
                            gpu,
                            bytes,
                            pool: None,
                        },
                    );
                    r
                },
            )
        },
    )
}

/// A free of `dptr` through `call`: the book entry is taken out before the driver frees
/// (another thread may get the same address back at once) and put back if the free fails.
fn free_pointer(dptr: CuDevicePtr, call: impl FnOnce() -> CuResult) -> CuResult {
    let (drv, p) = match setup() {
        Setup::Pass | Setup::Closed => return call(),
        Setup::Active(d, p) => (d, p),
    };
    let taken = p.book().allocs.remove(&dptr);
    let r = call();
    match taken {
        Some(charge) if r == CUDA_SUCCESS => release(drv, p, charge),
        Some(charge) => {
            p.book().allocs.insert(dptr, charge);
        }
        None => {}
    }
    r
}

/// `cuMemFree_v2`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CuDevicePtr) -> CuResult {
    // SAFETY: the caller's argument to the real function of the same type.
    let call = |f: FnMemFree| unsafe { f(dptr) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemFree_v2, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        // SAFETY: the type of the symbol.
        || free_pointer(dptr, || unsafe { forward(Sym::cuMemFree_v2, call) }),
    )
}

// ---- stream-ordered allocations ----------------------------------------------------------

/// The device a stream allocates on: the stream's (CUDA 12.8+), else the current context's.
fn stream_device(drv: &Resolved, stream: CuStream, ptsz: bool) -> Result<CuDevice, CuResult> {
    let sym = if ptsz {
        Sym::cuStreamGetDevice_ptsz
    } else {
        Sym::cuStreamGetDevice
    };
    // SAFETY: the type of the symbol.
    if let Some(get) = unsafe { real_fn::<FnStreamGetDevice>(drv, sym) } {
        let mut dev: CuDevice = 0;
        // SAFETY: the caller's stream and a live out-parameter.
        if unsafe { get(stream, &mut dev) } == CUDA_SUCCESS {
            return Ok(dev);
        }
    }
    current_device(drv)
}

/// Whether `stream` is being captured into a graph.
fn capturing(drv: &Resolved, stream: CuStream, ptsz: bool) -> bool {
    let sym = if ptsz {
        Sym::cuStreamIsCapturing_ptsz
    } else {
        Sym::cuStreamIsCapturing
    };
    // SAFETY: the type of the symbol.
    let Some(is) = (unsafe { real_fn::<FnStreamIsCapturing>(drv, sym) }) else {
        return false;
    };
    let mut status: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's stream and a live out-parameter.
    let r = unsafe { is(stream, &mut status) };
    r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE
}

/// A stream-ordered allocation of `bytes` from `pool` (the device's current pool when
/// `None`) on `stream`. `call` allocates; `undo` frees an address on the stream.
#[allow(clippy::too_many_arguments)]
fn pool_alloc(
    dptr: *mut CuDevicePtr,
    bytes: usize,
    pool: Option<CuMemoryPool>,
    stream: CuStream,
    ptsz: bool,
    call: impl FnOnce() -> CuResult,
    undo: impl FnOnce(CuDevicePtr) -> CuResult,
) -> CuResult {
    let (drv, p) = match setup() {
        Setup::Pass => return call(),
        Setup::Closed => return CUDA_ERROR_OUT_OF_MEMORY,
        Setup::Active(d, p) => (d, p),
    };
    if capturing(drv, stream, ptsz) {
        // A graph memory node: allocated at launch, not counted (documented).
        return call();
    }
    let known_gpu = pool.and_then(|pl| p.book().pools.get(&(pl as usize)).copied());
    let gpu = match known_gpu {
        Some(g) => Ok(g),
        None => stream_device(drv, stream, ptsz).and_then(|dev| p.gpu_for_device(drv, dev)),
    };
    let pool = pool.map(|pl| pl as usize).or_else(|| {
        let dev = stream_device(drv, stream, ptsz).ok()?;
        // SAFETY: the type of the symbol.
        let get = unsafe { real_fn::<FnDeviceGetMemPool>(drv, Sym::cuDeviceGetMemPool) }?;
        let mut current: CuMemoryPool = ptr::null_mut();
        // SAFETY: a live out-parameter.
        (unsafe { get(&mut current, dev) } == CUDA_SUCCESS && !current.is_null())
            .then_some(current as usize)
    });
    let gpu = match gpu {
        Ok(g) => g,
        Err(code) => return code,
    };
    let mut held = match gpu.hold(p) {
        Ok(h) => h,
        Err(why) => return refuse(&why),
    };
    // What the pool has cached and unused is reused before it grows.
    let need = match pool.and_then(|pl| held.refresh_pool(drv, pl)) {
        Some((reserved, used)) => (bytes as u64).saturating_sub(reserved.saturating_sub(used)),
        None => bytes as u64,
    };
    if !held.make_room(drv, need) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let r = call();
    if r != CUDA_SUCCESS || dptr.is_null() {
        return r;
    }
    // SAFETY: the driver wrote the pointer on success.
    let addr = unsafe { dptr.read() };
    match pool {
        Some(pl) => {
            held.refresh_pool(drv, pl);
            if held.over() {
                // The pool grew by more than the request: give it back and refuse.
                undo(addr);
                held.refresh_pool(drv, pl);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
        }
        None => held.charge(bytes as u64),
    }
    p.book().allocs.insert(
        addr,
        Charge {
            gpu,
            bytes: bytes as u64,
            pool,
        },
    );
    r
}

macro_rules! alloc_async_hooks {
    ($($name:ident, $free:ident, $ptsz:expr;)*) => {$(
        /// A stream-ordered allocation from the device's current pool.
        ///
        /// # Safety
        ///
        /// The driver API's contract.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CuDevicePtr,
            bytesize: usize,
            stream: CuStream,
        ) -> CuResult {
            // SAFETY: the caller's arguments to the real function of the same type.
            let call = |f: FnMemAllocAsync| unsafe { f(dptr, bytesize, stream) };
            boundary::hook(
                // SAFETY: the type of the symbol.
                || unsafe { forward(Sym::$name, call) },
                CUDA_ERROR_OUT_OF_MEMORY,
                || {
                    pool_alloc(
                        dptr,
                        bytesize,
                        None,
                        stream,
                        $ptsz,
                        // SAFETY: the type of the symbol.
                        || unsafe { forward(Sym::$name, call) },
                        // SAFETY: the matching free, on the caller's stream.
                        |addr| unsafe { forward(Sym::$free, |f: FnMemFreeAsync| f(addr, stream)) },
                    )
                },
            )
        }
    )*};
}

alloc_async_hooks! {
    cuMemAllocAsync, cuMemFreeAsync, false;
    cuMemAllocAsync_ptsz, cuMemFreeAsync_ptsz, true;
}

macro_rules! alloc_from_pool_hooks {
    ($($name:ident, $free:ident, $ptsz:expr;)*) => {$(
        /// A stream-ordered allocation from a given pool.
        ///
        /// # Safety
        ///
        /// The driver API's contract.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CuDevicePtr,
            bytesize: usize,
            pool: CuMemoryPool,
            stream: CuStream,
        ) -> CuResult {
            // SAFETY: the caller's arguments to the real function of the same type.
            let call = |f: FnMemAllocFromPoolAsync| unsafe { f(dptr, bytesize, pool, stream) };
            boundary::hook(
                // SAFETY: the type of the symbol.
                || unsafe { forward(Sym::$name, call) },
                CUDA_ERROR_OUT_OF_MEMORY,
                || {
                    pool_alloc(
                        dptr,
                        bytesize,
                        Some(pool),
                        stream,
                        $ptsz,
                        // SAFETY: the type of the symbol.
                        || unsafe { forward(Sym::$name, call) },
                        // SAFETY: the matching free, on the caller's stream.
                        |addr| unsafe { forward(Sym::$free, |f: FnMemFreeAsync| f(addr, stream)) },
                    )
                },
            )
        }
    )*};
}

alloc_from_pool_hooks! {
    cuMemAllocFromPoolAsync, cuMemFreeAsync, false;
    cuMemAllocFromPoolAsync_ptsz, cuMemFreeAsync_ptsz, true;
}

macro_rules! free_async_hooks {
    ($($name:ident;)*) => {$(
        /// A stream-ordered free.
        ///
        /// # Safety
        ///
        /// The driver API's contract.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CuDevicePtr, stream: CuStream) -> CuResult {
            // SAFETY: the caller's arguments to the real function of the same type.
            let call = |f: FnMemFreeAsync| unsafe { f(dptr, stream) };
            boundary::hook(
                // SAFETY: the type of the symbol.
                || unsafe { forward(Sym::$name, call) },
                CUDA_ERROR_NOT_INITIALIZED,
                // SAFETY: the type of the symbol.
                || free_pointer(dptr, || unsafe { forward(Sym::$name, call) }),
            )
        }
    )*};
}

free_async_hooks! {
    cuMemFreeAsync;
    cuMemFreeAsync_ptsz;
}

/// `cuMemPoolCreate`: remembers which GPU a device pool takes memory from.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CuMemoryPool,
    props: *const CuMemPropHead,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemPoolCreate| unsafe { f(pool, props) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemPoolCreate, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemPoolCreate, call) };
            let Setup::Active(drv, p) = setup() else {
                return r;
            };
            if r != CUDA_SUCCESS || pool.is_null() || props.is_null() {
                return r;
            }
            // SAFETY: the caller's properties (their head) and the pool the driver wrote.
            let (location, created) = unsafe { ((*props).location, pool.read()) };
            if location.kind == CU_MEM_LOCATION_TYPE_DEVICE
                && let Ok(gpu) = p.gpu_for_device(drv, location.id)
            {
                p.book().pools.insert(created as usize, gpu);
            }
            r
        },
    )
}

/// `cuMemPoolDestroy`: gives back the pool's charge.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CuMemoryPool) -> CuResult {
    // SAFETY: the caller's argument to the real function of the same type.
    let call = |f: FnMemPoolDestroy| unsafe { f(pool) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemPoolDestroy, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            let Setup::Active(_, p) = setup() else {
                // SAFETY: the type of the symbol.
                return unsafe { forward(Sym::cuMemPoolDestroy, call) };
            };
            let gpu = p.book().pools.remove(&(pool as usize));
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemPoolDestroy, call) };
            match gpu {
                Some(g) if r != CUDA_SUCCESS => {
                    p.book().pools.insert(pool as usize, g);
                }
                Some(g) => {
                    if let Ok(mut held) = g.hold(p) {
                        held.forget_pool(pool as usize);
                    }
                }
                None => {}
            }
            r
        },
    )
}

// ---- VMM -----------------------------------------------------------------------------------

/// `cuMemCreate`: a device location counts its size until released and unmapped.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CuMemHandle,
    size: usize,
    prop: *const CuMemPropHead,
    flags: u64,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemCreate| unsafe { f(handle, size, prop, flags) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemCreate, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            let (drv, p) = match setup() {
                // SAFETY: the type of the symbol.
                Setup::Pass => return unsafe { forward(Sym::cuMemCreate, call) },
                Setup::Closed => return CUDA_ERROR_OUT_OF_MEMORY,
                Setup::Active(d, p) => (d, p),
            };
            if prop.is_null() {
                // SAFETY: the type of the symbol (the driver refuses it).
                return unsafe { forward(Sym::cuMemCreate, call) };
            }
            // SAFETY: the caller's properties (their head).
            let location = unsafe { (*prop).location };
            if location.kind != CU_MEM_LOCATION_TYPE_DEVICE {
                // Host or host-NUMA memory (NCCL): not the GPU's.
                // SAFETY: the type of the symbol.
                return unsafe { forward(Sym::cuMemCreate, call) };
            }
            admit(
                drv,
                p,
                p.gpu_for_device(drv, location.id),
                size as u64,
                // SAFETY: the type of the symbol.
                || unsafe { forward(Sym::cuMemCreate, call) },
                |held, gpu, r| {
                    if r == CUDA_SUCCESS && !handle.is_null() {
                        held.charge(size as u64);
                        // SAFETY: the driver wrote the handle on success.
                        let h = unsafe { handle.read() };
                        p.book().handles.insert(
                            h,
                            Handle {
                                gpu,
                                bytes: size as u64,
                                refs: 1,
                                maps: 0,
                            },
                        );
                    }
                    r
                },
            )
        },
    )
}

/// Gives back a handle's bytes if it is gone (no reference, no mapping).
fn settle_handle(drv: &Resolved, p: &Process, h: Handle) {
    if h.refs == 0 && h.maps == 0 {
        release(
            drv,
            p,
            Charge {
                gpu: h.gpu,
                bytes: h.bytes,
                pool: None,
            },
        );
    }
}

/// `cuMemRelease`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CuMemHandle) -> CuResult {
    // SAFETY: the caller's argument to the real function of the same type.
    let call = |f: FnMemRelease| unsafe { f(handle) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemRelease, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            let Setup::Active(drv, p) = setup() else {
                // SAFETY: the type of the symbol.
                return unsafe { forward(Sym::cuMemRelease, call) };
            };
            let before = {
                let mut book = p.book();
                let before = book.handles.get(&handle).copied();
                if let Some(h) = before {
                    let after = Handle {
                        refs: h.refs.saturating_sub(1),
                        ..h
                    };
                    if after.refs == 0 && after.maps == 0 {
                        book.handles.remove(&handle);
                    } else {
                        book.handles.insert(handle, after);
                    }
                }
                before
            };
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemRelease, call) };
            if let Some(h) = before {
                if r == CUDA_SUCCESS {
                    settle_handle(
                        drv,
                        p,
                        Handle {
                            refs: h.refs.saturating_sub(1),
                            ..h
                        },
                    );
                } else {
                    p.book().handles.insert(handle, h);
                }
            }
            r
        },
    )
}

/// `cuMemMap`: one more mapping of a counted handle.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    va: CuDevicePtr,
    size: usize,
    offset: usize,
    handle: CuMemHandle,
    flags: u64,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemMap| unsafe { f(va, size, offset, handle, flags) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemMap, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemMap, call) };
            let Setup::Active(_, p) = setup() else {
                return r;
            };
            if r == CUDA_SUCCESS {
                let mut book = p.book();
                if let Some(h) = book.handles.get_mut(&handle) {
                    h.maps = h.maps.saturating_add(1);
                    book.mappings.insert(va, (size as u64, handle));
                }
            }
            r
        },
    )
}

/// `cuMemUnmap`: the mappings in the range are gone; handles released and unmapped give
/// their bytes back.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(va: CuDevicePtr, size: usize) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemUnmap| unsafe { f(va, size) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemUnmap, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            let Setup::Active(drv, p) = setup() else {
                // SAFETY: the type of the symbol.
                return unsafe { forward(Sym::cuMemUnmap, call) };
            };
            let end = va.saturating_add(size as u64);
            let removed: Vec<(u64, (u64, u64))> = {
                let mut book = p.book();
                let keys: Vec<u64> = book.mappings.range(va..end).map(|(k, _)| *k).collect();
                keys.into_iter()
                    .filter_map(|k| book.mappings.remove(&k).map(|m| (k, m)))
                    .collect()
            };
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemUnmap, call) };
            if r != CUDA_SUCCESS {
                p.book().mappings.extend(removed);
                return r;
            }
            let mut gone = Vec::new();
            {
                let mut book = p.book();
                for (_, (_, handle)) in removed {
                    if let Some(h) = book.handles.get_mut(&handle) {
                        h.maps = h.maps.saturating_sub(1);
                        if h.refs == 0 && h.maps == 0 {
                            gone.extend(book.handles.remove(&handle));
                        }
                    }
                }
            }
            for h in gone {
                settle_handle(drv, p, h);
            }
            r
        },
    )
}

/// `cuMemRetainAllocationHandle`: one more reference to a counted handle.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CuMemHandle,
    addr: *mut c_void,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemRetainAllocationHandle| unsafe { f(handle, addr) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemRetainAllocationHandle, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemRetainAllocationHandle, call) };
            let Setup::Active(_, p) = setup() else {
                return r;
            };
            if r == CUDA_SUCCESS && !handle.is_null() {
                // SAFETY: the driver wrote the handle on success.
                let h = unsafe { handle.read() };
                if let Some(entry) = p.book().handles.get_mut(&h) {
                    entry.refs = entry.refs.saturating_add(1);
                }
            }
            r
        },
    )
}

// ---- arrays --------------------------------------------------------------------------------

/// An array creation: admitted for `estimate`, counted at the driver's size for it.
fn array_create(array: *mut CuArray, estimate: u64, call: impl FnOnce() -> CuResult) -> CuResult {
    let (drv, p) = match setup() {
        Setup::Pass => return call(),
        Setup::Closed => return CUDA_ERROR_OUT_OF_MEMORY,
        Setup::Active(d, p) => (d, p),
    };
    let dev = current_device(drv);
    admit(
        drv,
        p,
        dev.and_then(|d| p.gpu_for_device(drv, d)),
        estimate,
        call,
        |held, gpu, r| {
            if r != CUDA_SUCCESS || array.is_null() {
                return r;
            }
            // SAFETY: the driver wrote the array on success.
            let created = unsafe { array.read() };
            let exact = dev.ok().and_then(|d| {
                // SAFETY: the type of the symbol.
                let get = unsafe {
                    real_fn::<FnArrayGetMemoryRequirements>(drv, Sym::cuArrayGetMemoryRequirements)
                }?;
                let mut req = CudaArrayMemoryRequirements::default();
                // SAFETY: the array just created, its device, a live out-parameter.
                (unsafe { get(&mut req, created, d) } == CUDA_SUCCESS).then_some(req.size as u64)
            });
            let bytes = exact.unwrap_or(estimate);
            if bytes > estimate && !held.fits(bytes) {
                // SAFETY: destroying the array just created.
                unsafe { forward(Sym::cuArrayDestroy, |f: FnArrayDestroy| f(created)) };
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            held.charge(bytes);
            p.book().arrays.insert(
                created as usize,
                Charge {
                    gpu,
                    bytes,
                    pool: None,
                },
            );
            r
        },
    )
}

fn elements(dims: &[usize], channels: c_uint, format: c_uint) -> u64 {
    dims.iter()
        .fold(1u64, |n, &d| n.saturating_mul((d as u64).max(1)))
        .saturating_mul(u64::from(channels.max(1)))
        .saturating_mul(array_format_bytes(format))
}

/// `cuArrayCreate_v2`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut CuArray,
    desc: *const CudaArrayDescriptor,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnArrayCreate| unsafe { f(array, desc) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuArrayCreate_v2, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            // SAFETY: the caller's descriptor, when given.
            let estimate = unsafe { desc.as_ref() }.map_or(0, |d| {
                elements(&[d.width, d.height], d.num_channels, d.format)
            });
            // SAFETY: the type of the symbol.
            array_create(array, estimate, || unsafe {
                forward(Sym::cuArrayCreate_v2, call)
            })
        },
    )
}

/// `cuArray3DCreate_v2`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut CuArray,
    desc: *const CudaArray3dDescriptor,
) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnArray3dCreate| unsafe { f(array, desc) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuArray3DCreate_v2, call) },
        CUDA_ERROR_OUT_OF_MEMORY,
        || {
            // SAFETY: the caller's descriptor, when given.
            let estimate = unsafe { desc.as_ref() }.map_or(0, |d| {
                elements(&[d.width, d.height, d.depth], d.num_channels, d.format)
            });
            // SAFETY: the type of the symbol.
            array_create(array, estimate, || unsafe {
                forward(Sym::cuArray3DCreate_v2, call)
            })
        },
    )
}

/// `cuArrayDestroy`.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: CuArray) -> CuResult {
    // SAFETY: the caller's argument to the real function of the same type.
    let call = |f: FnArrayDestroy| unsafe { f(array) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuArrayDestroy, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            let Setup::Active(drv, p) = setup() else {
                // SAFETY: the type of the symbol.
                return unsafe { forward(Sym::cuArrayDestroy, call) };
            };
            let taken = p.book().arrays.remove(&(array as usize));
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuArrayDestroy, call) };
            match taken {
                Some(c) if r == CUDA_SUCCESS => release(drv, p, c),
                Some(c) => {
                    p.book().arrays.insert(array as usize, c);
                }
                None => {}
            }
            r
        },
    )
}

// ---- the view ------------------------------------------------------------------------------

/// `cuMemGetInfo_v2`: total is the limit (or the GPU's size, if smaller), free what is left
/// of the limit (or the GPU's free memory, if less).
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnMemGetInfo| unsafe { f(free, total) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuMemGetInfo_v2, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuMemGetInfo_v2, call) };
            if r != CUDA_SUCCESS || free.is_null() || total.is_null() {
                return r;
            }
            let (limit, used) = match setup() {
                Setup::Pass => return r,
                Setup::Closed => (0, 0),
                Setup::Active(drv, p) => match p.current_gpu(drv) {
                    Ok(gpu) => (gpu.limit, gpu.used().unwrap_or(gpu.limit)),
                    Err(_) => return r,
                },
            };
            // SAFETY: the driver wrote both on success.
            let (real_free, real_total) = unsafe { (free.read() as u64, total.read() as u64) };
            let shown_total = real_total.min(limit);
            let shown_free = real_free.min(shown_total.saturating_sub(used));
            // SAFETY: the caller's out-parameters.
            unsafe {
                total.write(shown_total as usize);
                free.write(shown_free as usize);
            }
            r
        },
    )
}

/// `cuDeviceTotalMem_v2`: the limit, or the GPU's size if smaller.
///
/// # Safety
///
/// The driver API's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CuDevice) -> CuResult {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnDeviceTotalMem| unsafe { f(bytes, dev) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::cuDeviceTotalMem_v2, call) },
        CUDA_ERROR_NOT_INITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::cuDeviceTotalMem_v2, call) };
            if r != CUDA_SUCCESS || bytes.is_null() {
                return r;
            }
            let limit = match setup() {
                Setup::Pass => return r,
                Setup::Closed => 0,
                Setup::Active(drv, p) => match p.gpu_for_device(drv, dev) {
                    Ok(gpu) => gpu.limit,
                    Err(_) => return r,
                },
            };
            // SAFETY: the driver wrote it on success; the caller's out-parameter.
            unsafe { bytes.write((bytes.read() as u64).min(limit) as usize) };
            r
        },
    )
}
