//! The real libraries: finding the process's `libcuda.so.1` and `libnvidia-ml.so.1`, the
//! real address of every entry point in [`symbols::SYMBOLS`], and mapping an address the
//! process obtained back to the hook that replaces it.
//!
//! A library is resolved once, lazily, the first time a hook or a lookup needs it: from the
//! object a looked-up address belongs to (`dladdr`), else by its soname among the objects
//! already loaded (`RTLD_NOLOAD`). The limiter never loads a driver library itself, so a
//! process that uses no GPU never has one because of it. Only one copy of each library is
//! known per process; a second copy loaded from elsewhere is not limited (documented).

use core::ffi::{CStr, c_void};
use core::ptr;
use core::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering};

use crate::interpose::real_dlsym;
use crate::symbols::{COUNT, Library, SYMBOLS, Sym};

/// One resolved library.
pub struct Resolved {
    /// The address the object is loaded at (`dli_fbase`).
    base: AtomicUsize,
    /// The real address of every entry point of this library, indexed like `SYMBOLS`.
    real: [AtomicPtr<c_void>; COUNT],
    /// 0: not yet; 1: being resolved; 2: resolved (maybe without an object: `base` 0).
    state: AtomicU8,
}

impl Resolved {
    const fn new() -> Self {
        Resolved {
            base: AtomicUsize::new(0),
            real: [const { AtomicPtr::new(ptr::null_mut()) }; COUNT],
            state: AtomicU8::new(0),
        }
    }

    /// The real address of `sym`, null when the library lacks it.
    pub fn real(&self, sym: Sym) -> *mut c_void {
        self.real
            .get(sym as usize)
            .map_or(ptr::null_mut(), |r| r.load(Ordering::Acquire))
    }

    /// Whether `addr` lies in this library's object.
    pub fn contains(&self, addr: *const c_void) -> bool {
        let base = self.base.load(Ordering::Acquire);
        base != 0 && object_base(addr) == Some(base)
    }

    /// Whether `addr` is the real address of any entry point the limiter knows.
    pub fn knows(&self, addr: *mut c_void) -> bool {
        self.real.iter().any(|r| r.load(Ordering::Acquire) == addr)
    }

    /// The hook of the hooked entry point whose real address is `addr` and whose family is
    /// `family` (the name asked for), if any: pointer-based routing. The address says exactly
    /// which versioned entry point the driver chose, so the hook has its exact signature.
    pub fn hook_for(&self, addr: *mut c_void, family: &[u8]) -> Option<*mut c_void> {
        if addr.is_null() {
            return None;
        }
        SYMBOLS.iter().enumerate().find_map(|(i, s)| {
            let hook = s.hook?;
            let real = self.real.get(i)?.load(Ordering::Acquire);
            (real == addr && crate::symbols::family(s.name.to_bytes()) == family).then(hook)
        })
    }
}

static CUDA: Resolved = Resolved::new();
static NVML: Resolved = Resolved::new();

fn slot(library: Library) -> &'static Resolved {
    match library {
        Library::Cuda => &CUDA,
        Library::Nvml => &NVML,
    }
}

fn soname(library: Library) -> &'static CStr {
    match library {
        Library::Cuda => c"libcuda.so.1",
        Library::Nvml => c"libnvidia-ml.so.1",
    }
}

/// The base address of the object `addr` lies in.
// dladdr compares the address with the loaded objects' ranges; it never reads through it.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn object_base(addr: *const c_void) -> Option<usize> {
    let mut info = libc::Dl_info {
        dli_fname: ptr::null(),
        dli_fbase: ptr::null_mut(),
        dli_sname: ptr::null(),
        dli_saddr: ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables and writes into `info`, which lives on
    // this frame; any address may be asked about.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    (found != 0 && !info.dli_fbase.is_null()).then_some(info.dli_fbase as usize)
}

/// The library, resolved from the object `hint` (an address inside it) if given and the
/// library is not resolved yet, else from its soname. `None` while another frame of this
/// thread is resolving it, and when it is not loaded.
pub fn library(library: Library, hint: *const c_void) -> Option<&'static Resolved> {
    let lib = slot(library);
    let mut waited_since: Option<std::time::Instant> = None;
    loop {
        match lib.state.load(Ordering::Acquire) {
            2 => {
                return (lib.base.load(Ordering::Acquire) != 0).then_some(lib);
            }
            0 => {
                if lib
                    .state
                    .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let found = resolve(lib, library, hint);
                    // Not found: try again on the next call (the process may load the
                    // library later), unless it was resolved.
                    lib.state
                        .store(if found { 2 } else { 0 }, Ordering::Release);
                    return found.then_some(lib);
                }
            }
            // Another thread resolves it, a matter of microseconds. The wait is bounded: the
            // resolving thread takes the loader's lock (dlopen, dlsym), and this thread may
            // hold it (a library's constructor looking a driver symbol up during dlopen).
            // Rather than deadlock, that lookup is answered unhooked after a second.
            _ => {
                let since = *waited_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > std::time::Duration::from_secs(1) {
                    crate::warn_once(
                        "a driver library was being resolved by another thread for over a second: one lookup answered without the limiter",
                    );
                    return None;
                }
                std::thread::yield_now();
            }
        }
    }
}

fn resolve(lib: &Resolved, library: Library, hint: *const c_void) -> bool {
    let handle = open_handle(library, hint);
    if handle.is_null() {
        return false;
    }
    let Some(dlsym) = real_dlsym() else {
        return false;
    };
    let mut any: *mut c_void = ptr::null_mut();
    for (i, symbol) in SYMBOLS.iter().enumerate() {
        if symbol.library != library {
            continue;
        }
        // SAFETY: the real dlsym with a handle the loader gave us and a NUL-terminated name.
        let addr = unsafe { dlsym(handle, symbol.name.as_ptr()) };
        if let Some(r) = lib.real.get(i) {
            r.store(addr, Ordering::Release);
        }
        if any.is_null() {
            any = addr;
        }
    }
    let base = object_base(if hint.is_null() { any } else { hint });
    match base {
        Some(b) => {
            lib.base.store(b, Ordering::Release);
            true
        }
        None => false,
    }
}

/// A handle of the loaded object: the one `hint` lies in, else the one with the soname.
fn open_handle(library: Library, hint: *const c_void) -> *mut c_void {
    if !hint.is_null() {
        let mut info = libc::Dl_info {
            dli_fname: ptr::null(),
            dli_fbase: ptr::null_mut(),
            dli_sname: ptr::null(),
            dli_saddr: ptr::null_mut(),
        };
        // SAFETY: as in `object_base`.
        let found = unsafe { libc::dladdr(hint, &mut info) };
        if found != 0 && !info.dli_fname.is_null() {
            // SAFETY: a path the loader gave; RTLD_NOLOAD only finds an object already loaded
            // (it runs no constructor and loads nothing).
            let handle =
                unsafe { libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if !handle.is_null() {
                return handle;
            }
        }
    }
    // SAFETY: as above, by soname.
    unsafe {
        libc::dlopen(
            soname(library).as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        )
    }
}

/// The CUDA driver, resolved by soname if it is not yet.
pub fn cuda() -> Option<&'static Resolved> {
    library(Library::Cuda, ptr::null())
}

/// NVML, resolved by soname if it is not yet.
pub fn nvml() -> Option<&'static Resolved> {
    library(Library::Nvml, ptr::null())
}

/// The real function `sym` of `lib` as a function pointer of type `F`.
///
/// # Safety
///
/// `F` must be the function-pointer type of `sym` (see `ffi`).
pub unsafe fn real_fn<F: Copy>(lib: &Resolved, sym: Sym) -> Option<F> {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    let addr = lib.real(sym);
    if addr.is_null() {
        return None;
    }
    // SAFETY: `F` is a function-pointer type (the caller's promise) of the same size as a
    // data pointer, and `addr` is the non-null address of that very function.
    Some(unsafe { core::mem::transmute_copy::<*mut c_void, F>(&addr) })
}
