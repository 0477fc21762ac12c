//! `cargo bench -p gpushare-limiter --bench alloc` (in `make bench`): what the limiter adds to
//! an allocation.
//!
//! The C program `tests/c/bench.c` times each `cuMemAlloc_v2` and `cuMemFree_v2` of 1 MiB
//! against the fake driver (`tests/c/fake_cuda.c`: a mutex and a table, well under a
//! microsecond), 100,000 times after 1,000 warm-up calls, once as it is (the raw call) and
//! once with the limiter preloaded, limited to 4 GiB of a 16 GiB GPU, its state directory on
//! tmpfs (`/dev/shm` where it exists), as `/run` is on a node. Five rounds of each,
//! alternating; the verdict takes the median round. The overhead is the hooked p99 minus the
//! raw p99: the lock, the ledger and the book on every allocation. Budget: 2 µs.
//!
//! Without `--bench` (`cargo test --all-targets`): a 2,000-call smoke run, no verdict.
//! Figures depend on the machine; a FAIL line is reported, not fatal.

// A bench fails by panicking.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

#[path = "../tests/limiter/support.rs"]
#[allow(dead_code)]
mod support;

use std::process::Command;

use support::{GIB, GPU0, built, library};

const BUDGET_NS: i64 = 2_000;

/// (p50, p99, max) of allocations and of frees, in nanoseconds.
#[derive(Clone, Copy, Debug)]
struct Figures {
    alloc: [i64; 3],
    free: [i64; 3],
}

fn parse(line: &str, what: &str) -> [i64; 3] {
    let f: Vec<i64> = line
        .strip_prefix(what)
        .unwrap_or_else(|| panic!("{what} line: {line:?}"))
        .split_whitespace()
        .map(|n| n.parse().expect("a number"))
        .collect();
    [f[0], f[1], f[2]]
}

fn run(calls: usize, preload: Option<&std::path::Path>, root: &std::path::Path) -> Figures {
    let mut cmd = Command::new(built().join("bench"));
    cmd.arg(calls.to_string())
        .env("FAKE_GPUS", format!("{GPU0}={}", 16 * GIB))
        .env_remove("FAKE_CUDA_LOG")
        .env_remove("LD_LIBRARY_PATH")
        .current_dir(built());
    // The fake lies beside the program; its rpath finds it.
    match preload {
        Some(lib) => {
            cmd.env("LD_PRELOAD", lib)
                .env("GPUSHARE_LIMITER_ROOT", root);
        }
        None => {
            cmd.env_remove("LD_PRELOAD")
                .env_remove("GPUSHARE_LIMITER_ROOT");
        }
    }
    let out = cmd.output().expect("bench runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    Figures {
        alloc: parse(lines[0], "alloc"),
        free: parse(lines[1], "free"),
    }
}

fn us(ns: i64) -> String {
    format!("{:.2} µs", ns as f64 / 1000.0)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (calls, rounds) = if full { (100_000, 5) } else { (2_000, 1) };
    let shm = std::path::Path::new("/dev/shm");
    let root = if shm.is_dir() {
        tempfile::tempdir_in(shm).expect("tmpfs dir")
    } else {
        tempfile::tempdir().expect("temp dir")
    };
    std::fs::create_dir(root.path().join("state")).expect("state");
    std::fs::write(
        root.path().join("limits"),
        format!("gpushare-limiter-limits 1\n{GPU0} {}\n", 4 * GIB),
    )
    .expect("limits");
    let lib = library();
    let mut raw = Vec::new();
    let mut hooked = Vec::new();
    for _ in 0..rounds {
        raw.push(run(calls, None, root.path()));
        hooked.push(run(calls, Some(&lib), root.path()));
    }
    let mut overheads: Vec<(i64, usize)> = raw
        .iter()
        .zip(&hooked)
        .enumerate()
        .map(|(i, (r, h))| (h.alloc[1] - r.alloc[1], i))
        .collect();
    overheads.sort();
    let (overhead, median) = overheads[overheads.len() / 2];
    let (r, h) = (raw[median], hooked[median]);
    println!(
        "\nlimiter allocation overhead: {calls} × cuMemAlloc_v2 + cuMemFree_v2 of 1 MiB against the fake driver, {rounds} rounds, state on {}, library {}\n",
        if shm.is_dir() {
            "/dev/shm"
        } else {
            "the temp dir"
        },
        lib.display()
    );
    println!("| figure | raw call | with the limiter | overhead | budget | verdict |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let verdict = if !full {
        ""
    } else if overhead <= BUDGET_NS {
        "PASS"
    } else {
        "FAIL"
    };
    println!(
        "| cuMemAlloc_v2 p50 / p99 (median round) | {} / {} | {} / {} | {} at p99 (rounds: {}) | ≤ 2 µs | {verdict} |",
        us(r.alloc[0]),
        us(r.alloc[1]),
        us(h.alloc[0]),
        us(h.alloc[1]),
        us(overhead),
        overheads
            .iter()
            .map(|(o, _)| us(*o))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    println!(
        "| cuMemFree_v2 p50 / p99 | {} / {} | {} / {} | {} at p99 | | |",
        us(r.free[0]),
        us(r.free[1]),
        us(h.free[0]),
        us(h.free[1]),
        us(h.free[1] - r.free[1])
    );
    println!(
        "| slowest allocation (max) | {} | {} | | | |",
        us(r.alloc[2]),
        us(h.alloc[2])
    );
}
