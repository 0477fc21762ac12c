//! gpushare's CUDA memory limiter: a shared library the dynamic loader preloads into every
//! program of a container (through `/etc/ld.so.preload`, mounted read-only by the node
//! agent), which keeps the container's GPU memory allocations within its limit.
//!
//! It interposes on the driver API where memory is allocated, freed and reported
//! ([`cuda_hooks`], [`nvml_hooks`]), on `dlsym` and on `cuGetProcAddress` ([`interpose`]),
//! so that every route to those entry points leads to its hook. Every process of the
//! container records what it holds in the container's ledger ([`ledger`]), and an allocation
//! is checked against the limit and made under a lock the container's processes share
//! ([`account`]); over the limit it fails with `CUDA_ERROR_OUT_OF_MEMORY`.
//!
//! The library starts nothing when loaded: no constructor of its own, no thread, no file
//! opened until a hooked function is first called. The only code that runs at load time is
//! the toolchain's: the Rust standard library records `argc`/`argv`/`envp` in three statics
//! (`std::sys::args::unix::imp::ARGV_INIT_ARRAY`), and on aarch64 compiler-rt reads the CPU's
//! atomics features (`init_have_lse_atomics`, `__init_cpu_features`). The tests and
//! `make limiter` check that nothing else is in `.init_array`.
//!
//! This is the workspace's one crate with `unsafe` code (its own `[lints]` in `Cargo.toml`):
//! an interposer is made of C calls and raw pointers. Every `unsafe` block says why it is
//! sound (`clippy::undocumented_unsafe_blocks` is denied), and the panicking constructs are
//! denied (`unwrap`, `expect`, indexing, `panic!`), because a panic in a release build aborts
//! the program the limiter is loaded into.
//!
//! What it does not do: count memory that does not pass through the hooked entry points
//! (statically linked programs, a second copy of the driver, graph memory nodes, the CUDA
//! contexts' own memory), or limit anything but memory. See `docs/enforcement.md`.

pub mod account;
pub mod boundary;
pub mod config;
pub mod cuda_hooks;
pub mod driver;
pub mod fds;
pub mod ffi;
pub mod interpose;
pub mod ledger;
pub mod nvml_hooks;
pub mod symbols;

use std::io::Write;

/// Writes one line on the program's standard error, prefixed with the library's name.
pub fn warn(message: &str) {
    // Never panics (eprintln! would, with a closed stderr).
    let _ = writeln!(std::io::stderr(), "gpushare-limiter: {message}");
}

/// [`warn`], once per process for each distinct message's first 32 bytes.
pub fn warn_once(message: &str) {
    use std::sync::Mutex;
    static SAID: Mutex<Vec<[u8; 32]>> = Mutex::new(Vec::new());
    let mut key = [0u8; 32];
    for (k, b) in key.iter_mut().zip(message.bytes()) {
        *k = b;
    }
    let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
    if !said.contains(&key) && said.len() < 64 {
        said.push(key);
        drop(said);
        warn(message);
    }
}
