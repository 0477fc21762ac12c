//! Interposition: the exported `dlsym`, and the routing of addresses to hooks that both it and
//! the `cuGetProcAddress` hooks use.
//!
//! # `dlsym`
//!
//! Programs and runtimes (cudart, PyTorch, pynvml, `nvidia-smi`) reach the driver through
//! `dlopen` + `dlsym` more often than through linked symbols, so the limiter exports `dlsym`.
//! The exported function is a few instructions of assembly that call [`route`] and then
//! either return its answer or **jump** (a tail call) to the real `dlsym`. The jump matters:
//! glibc resolves `RTLD_NEXT` (and the scope of `RTLD_DEFAULT`) relative to the code that
//! called `dlsym`, which it reads from the return address. A wrapper that *called* the real
//! `dlsym` would make every `RTLD_NEXT` lookup relative to the limiter, and a library that
//! wraps, say, `malloc` and looks up the next `malloc` with `RTLD_NEXT` would find its own
//! and recurse forever. With the jump, every name the limiter does not hook is answered by
//! glibc exactly as if the limiter were not there.
//!
//! For the names it hooks, [`route`] asks the real `dlsym` itself, then maps the address it
//! got to the hook (pointer-based, see [`crate::driver::Resolved::hook_for`]). `RTLD_NEXT`
//! for a hooked name therefore yields the hook, never the real function: a program cannot
//! step around the limiter by asking for "the next one". Lookups made by the driver
//! libraries themselves are answered unchanged.
//!
//! The real `dlsym` is found with `dlvsym(RTLD_NEXT, "dlsym", <version>)`, which the limiter
//! does not export, so finding it cannot recurse.
//!
//! `dlvsym` and the `dlinfo`/`dl_iterate_phdr` family are not interposed.

use core::ffi::{CStr, c_char, c_void};
use core::ptr;
use core::sync::atomic::{AtomicPtr, Ordering};

use crate::boundary;
use crate::driver::{self, object_base};
use crate::symbols::{self, Library, SYMBOLS};

/// The type of `dlsym`.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// The real `dlsym`, once found. The trampoline jumps through it.
static GPUSHARE_LIMITER_REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(ptr::null_mut());

/// The glibc versions `dlsym` has been published under, newest first: 2.34 moved it into
/// libc; before that it lived in libdl as 2.2.5 (x86_64) or 2.17 (aarch64).
const DLSYM_VERSIONS: [&CStr; 3] = [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"];

/// The real `dlsym`.
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut addr = GPUSHARE_LIMITER_REAL_DLSYM.load(Ordering::Acquire);
    if addr.is_null() {
        for version in DLSYM_VERSIONS {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated strings; the limiter does not
            // export dlvsym, so this reaches glibc's.
            addr = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !addr.is_null() {
                break;
            }
        }
        if addr.is_null() {
            return None;
        }
        GPUSHARE_LIMITER_REAL_DLSYM.store(addr, Ordering::Release);
    }
    // SAFETY: `addr` is glibc's dlsym, whose type is `DlsymFn`.
    Some(unsafe { core::mem::transmute::<*mut c_void, DlsymFn>(addr) })
}

/// Decides a `dlsym` call. Returns `false` to let the trampoline jump to the real `dlsym`
/// (every name the limiter does not hook), `true` with the answer in `*out`.
///
/// # Safety
///
/// Called only by the trampoline: `name` is the caller's argument, `out` a valid slot.
#[cfg_attr(test, allow(dead_code))]
unsafe extern "C" fn route(
    handle: *mut c_void,
    name: *const c_char,
    out: *mut *mut c_void,
    caller: *const c_void,
) -> bool {
    let Some(real) = real_dlsym() else {
        // Without the real dlsym nothing can be answered; the jump would go nowhere.
        // SAFETY: `out` is the trampoline's slot.
        unsafe { out.write(ptr::null_mut()) };
        return true;
    };
    if name.is_null() {
        return false;
    }
    // SAFETY: dlsym's contract: `name` is a NUL-terminated string.
    let wanted = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(index) = symbols::hooked_by_name(wanted) else {
        return false;
    };
    let answer = boundary::guarded(
        || None,
        // SAFETY: forwarded from this function's contract.
        || unsafe { hooked_lookup(real, handle, name, index, caller) },
    );
    match answer {
        Some(addr) => {
            // SAFETY: `out` is the trampoline's slot.
            unsafe { out.write(addr) };
            true
        }
        None => false,
    }
}

/// The answer for a hooked name; `None` to leave it to the real `dlsym`.
///
/// # Safety
///
/// `name` is NUL-terminated.
#[cfg_attr(test, allow(dead_code))]
unsafe fn hooked_lookup(
    real: DlsymFn,
    handle: *mut c_void,
    name: *const c_char,
    index: usize,
    caller: *const c_void,
) -> Option<*mut c_void> {
    let symbol = SYMBOLS.get(index)?;
    let own = (symbol.hook?)();
    // SAFETY: the real dlsym, with the caller's handle and name.
    let mut addr = unsafe { real(handle, name) };
    if addr == own {
        // The lookup found the limiter's own export (RTLD_DEFAULT: the limiter precedes the
        // driver). What the program would have found without it lies behind it.
        // SAFETY: as above; RTLD_NEXT relative to the limiter.
        addr = unsafe { real(libc::RTLD_NEXT, name) };
    }
    if addr.is_null() {
        return Some(ptr::null_mut());
    }
    let lib = driver::library(symbol.library, addr)?;
    // The driver libraries' own lookups are theirs.
    if !caller.is_null() && lib.contains(caller) {
        return None;
    }
    if !lib.contains(addr) {
        note_foreign_copy(symbol.library, addr);
        return Some(addr);
    }
    Some(
        lib.hook_for(addr, symbols::family(symbol.name.to_bytes()))
            .unwrap_or(addr),
    )
}

/// Says once that a second copy of a driver library escapes the limiter.
#[cfg_attr(test, allow(dead_code))]
fn note_foreign_copy(library: Library, addr: *mut c_void) {
    static SAID: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::AcqRel) {
        crate::warn(&format!(
            "{library:?}: an entry point at {addr:p} (object at {:#x}) belongs to another copy of the library than the one limited; its allocations are not counted",
            object_base(addr).unwrap_or(0)
        ));
    }
}

/// `cuGetProcAddress`'s answer `addr` for the name `wanted`, mapped to the hook of the exact
/// entry point it is (or left alone). An address the limiter cannot place in a family it
/// hooks (CUDA 3.1's `cuMemAlloc`, or a driver that hands out addresses its symbol table does
/// not have) is left alone and said once on standard error: what it allocates is not counted.
pub fn route_proc_address(addr: *mut c_void, wanted: &[u8]) -> *mut c_void {
    let Some(lib) = driver::library(Library::Cuda, addr) else {
        return addr;
    };
    let family = symbols::family(wanted);
    if let Some(hook) = lib.hook_for(addr, family) {
        return hook;
    }
    let hooked_family = SYMBOLS.iter().any(|s| {
        s.hook.is_some()
            && s.library == Library::Cuda
            && symbols::family(s.name.to_bytes()) == family
    });
    if hooked_family && !addr.is_null() && !lib.knows(addr) {
        crate::warn_once(&format!(
            "{}: cuGetProcAddress answered an entry point the limiter does not know ({addr:p}); what it allocates is not counted",
            String::from_utf8_lossy(family)
        ));
    }
    addr
}

/// The exported `dlsym`: calls [`route`], then returns its answer or jumps to the real one.
///
/// # Safety
///
/// `dlsym`'s contract.
#[cfg(all(target_arch = "x86_64", not(test)))]
#[unsafe(no_mangle)]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // Entry: rsp is 8 mod 16 (the return address). Two pushes and 24 bytes keep the call
    // aligned; [rsp] is the answer slot, [rsp + 40] the caller's return address.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 24",
        "mov rdx, rsp",
        "mov rcx, [rsp + 40]",
        "call {route}",
        "mov rdx, [rsp]",
        "add rsp, 24",
        "pop rsi",
        "pop rdi",
        "test al, al",
        "jz 2f",
        "mov rax, rdx",
        "ret",
        "2:",
        "jmp qword ptr [rip + {real}]",
        route = sym route,
        real = sym GPUSHARE_LIMITER_REAL_DLSYM,
    )
}

/// The exported `dlsym` (aarch64): as on x86_64.
///
/// # Safety
///
/// `dlsym`'s contract.
#[cfg(all(target_arch = "aarch64", not(test)))]
#[unsafe(no_mangle)]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // A 48-byte frame: fp/lr at 0, the arguments at 16, the answer slot at 32.
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-48]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "add x2, sp, #32",
        "mov x3, x30",
        "bl {route}",
        "and w10, w0, #0xff",
        "ldr x9, [sp, #32]",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #48",
        "cbz w10, 2f",
        "mov x0, x9",
        "ret",
        "2:",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "br x16",
        route = sym route,
        real = sym GPUSHARE_LIMITER_REAL_DLSYM,
    )
}
