//! The edge between the program and the limiter: every exported function enters through
//! here.
//!
//! - **Re-entry**: a hook running on a thread that is already inside the limiter (the driver
//!   calling an exported entry point while the limiter calls it, a lookup made while a library
//!   is being resolved) passes straight through to the real function instead of taking the
//!   limiter's locks a second time.
//! - **Panics** never cross into C: a panic in a hook is caught and the hook returns its
//!   error value (for an allocation, `CUDA_ERROR_OUT_OF_MEMORY`: never a crash, never an
//!   uncounted allocation). Release builds abort on panic instead (the workspace's release
//!   profile), which is why the crate denies the lints that find panicking code.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    /// How many limiter frames this thread is in. A `const` initialiser with no destructor:
    /// reading it allocates nothing and registers nothing.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Leaves the limiter when dropped.
pub struct Inside(());

impl Drop for Inside {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Enters the limiter; `None` when this thread is already inside it.
pub fn enter() -> Option<Inside> {
    DEPTH.with(|d| {
        if d.get() > 0 {
            None
        } else {
            d.set(1);
            Some(Inside(()))
        }
    })
}

/// Runs `body` inside the limiter. When this thread is inside it already, or `body` panics,
/// the answer is `fallback()`.
pub fn guarded<T>(fallback: impl FnOnce() -> T, body: impl FnOnce() -> T) -> T {
    let Some(inside) = enter() else {
        return fallback();
    };
    let result = catch_unwind(AssertUnwindSafe(body));
    drop(inside);
    match result {
        Ok(value) => value,
        Err(_) => {
            crate::warn("an internal error was caught; the call was answered with its error value");
            fallback()
        }
    }
}

/// Runs a hook's `body` inside the limiter; `passthrough` (the real function, unaccounted)
/// when this thread is inside it already, `on_panic` when `body` panics.
pub fn hook<T>(passthrough: impl FnOnce() -> T, on_panic: T, body: impl FnOnce() -> T) -> T {
    let Some(inside) = enter() else {
        return passthrough();
    };
    let result = catch_unwind(AssertUnwindSafe(body));
    drop(inside);
    result.unwrap_or_else(|_| {
        crate::warn("an internal error was caught; the call was refused");
        on_panic
    })
}

#[cfg(test)]
#[allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;

    #[test]
    fn a_nested_entry_passes_through_and_panics_become_the_fallback() {
        let nested = guarded(
            || "fallback",
            || guarded(|| "passed through", || "nested body"),
        );
        assert_eq!(nested, "passed through");
        let caught = hook(|| 1, 2, || -> i32 { panic!("boom") });
        assert_eq!(caught, 2);
        // Depth is back to zero after a panic.
        assert_eq!(hook(|| 1, 2, || 3), 3);
    }
}
