//! The descriptors the limiter keeps open (ledgers, alive files), so that a forked child can
//! close its copies at once.
//!
//! A child made by `fork` shares the parent's open file descriptions, and with them the
//! parent's alive locks: while such a child lived, the parent's slots would look alive after
//! the parent died. The `pthread_atfork` child handler (registered when the limiter starts
//! accounting, never by a constructor) closes them in the child; the child claims slots of
//! its own when it allocates. Every descriptor is also close-on-exec.

use core::ffi::c_int;
use core::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// Descriptors kept: two per GPU (ledger, alive file) for 64 GPUs and then some.
const KEPT: usize = 256;

static FDS: [AtomicI32; KEPT] = [const { AtomicI32::new(-1) }; KEPT];
static FORKED: AtomicBool = AtomicBool::new(false);
static REGISTERED: AtomicBool = AtomicBool::new(false);

/// Keeps `fd` on the list.
pub fn remember(fd: c_int) {
    for slot in &FDS {
        if slot
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
    }
}

/// Takes `fd` off the list (before closing it).
pub fn forget(fd: c_int) {
    for slot in &FDS {
        if slot
            .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
    }
}

/// In the child after `fork`: closes every kept descriptor and marks the process as forked.
/// Only async-signal-safe calls (`close`).
extern "C" fn in_child_after_fork() {
    for slot in &FDS {
        let fd = slot.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: a descriptor the parent kept; the child's copy is closed, the parent's
            // stays open.
            unsafe { libc::close(fd) };
        }
    }
    FORKED.store(true, Ordering::Release);
}

/// Registers the fork handler, once per process image.
pub fn register_fork_handler() {
    if !REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registering a handler that lives as long as the library (never unloaded:
        // it is preloaded).
        unsafe { libc::pthread_atfork(None, None, Some(in_child_after_fork)) };
    }
}

/// Whether this process is a forked child that has not started over yet (and clears it).
pub fn take_forked() -> bool {
    FORKED.swap(false, Ordering::AcqRel)
}
