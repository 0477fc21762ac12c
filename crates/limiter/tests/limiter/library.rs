//! The library's shape: it exports exactly `dlsym` and its hooks, runs no constructor of
//! its own, and does nothing in a process until a hooked function is called.

use std::collections::BTreeSet;
use std::process::Command;

use crate::support::*;

/// Every symbol the library may export, and why: `dlsym` (every lookup passes through it)
/// and the hooks (the linked-symbol route).
const EXPORTS: &[&str] = &[
    "dlsym",
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemRetainAllocationHandle",
    "cuArrayCreate_v2",
    "cuArray3DCreate_v2",
    "cuArrayDestroy",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem_v2",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
];

fn tool(name: &str, args: &[&str]) -> String {
    let out = Command::new(name)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{name} runs (binutils): {e}"));
    assert!(
        out.status.success(),
        "{name} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn it_exports_exactly_dlsym_and_its_hooks() {
    let lib = library();
    let listing = tool(
        "nm",
        &["-D", "--defined-only", lib.to_str().expect("utf-8 path")],
    );
    let exported: BTreeSet<&str> = listing
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    let expected: BTreeSet<&str> = EXPORTS.iter().copied().collect();
    assert_eq!(exported, expected, "{listing}");
}

#[test]
fn it_runs_no_constructor_of_its_own() {
    let lib = library();
    let path = lib.to_str().expect("utf-8 path");
    let dynamic = tool("readelf", &["-d", "-W", path]);
    assert!(!dynamic.contains("(PREINIT_ARRAY)"), "{dynamic}");
    // The entries of .init_array, by the symbol at each address.
    let relocations = tool("readelf", &["-r", "-W", path]);
    let sections = tool("readelf", &["-S", "-W", path]);
    let Some(init) = sections.lines().find(|l| l.contains(".init_array")) else {
        return; // no .init_array at all
    };
    let fields: Vec<&str> = init.split_whitespace().collect();
    let at = fields
        .iter()
        .position(|f| *f == "INIT_ARRAY")
        .expect("type column");
    let start = u64::from_str_radix(fields[at + 1], 16).expect("address");
    let size = u64::from_str_radix(fields[at + 3], 16).expect("size");
    let symbols = Command::new("nm").arg(path).output().expect("nm runs");
    let stripped = !symbols.status.success() || symbols.stdout.is_empty();
    let symbols = String::from_utf8_lossy(&symbols.stdout).into_owned();
    let name_at = |addr: u64| -> String {
        symbols
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let a = u64::from_str_radix(f.next()?, 16).ok()?;
                let _kind = f.next()?;
                (a == addr).then(|| f.next().unwrap_or("").to_string())
            })
            .next()
            .unwrap_or_else(|| format!("{addr:#x}"))
    };
    let mut entries = Vec::new();
    for line in relocations.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let Some(offset) = f.first().and_then(|o| u64::from_str_radix(o, 16).ok()) else {
            continue;
        };
        if offset >= start
            && offset < start + size
            && f.get(2).is_some_and(|t| t.ends_with("_RELATIVE"))
        {
            let target = u64::from_str_radix(f[3], 16).expect("addend");
            entries.push(name_at(target));
        }
    }
    // The C runtime's frame_dummy and the Rust standard library's argv capture (three
    // stores into statics) are the only code that runs at load time. A stripped release
    // build names nothing: it has the standard library's entry alone.
    if stripped {
        assert!(entries.len() <= 1, "constructors: {entries:?}");
        return;
    }
    for entry in &entries {
        assert!(
            entry == "frame_dummy"
                || entry.contains("ARGV_INIT_ARRAY")
                || entry.contains("really_init"),
            "an unexpected constructor: {entry} (all: {entries:?})"
        );
    }
}

#[test]
fn a_program_that_never_calls_the_driver_is_left_alone() {
    let c = Container::four_of_sixteen();
    // Not even a ledger: nothing was opened, nothing was written.
    let out = run_to_end(&mut c.command("wrapcheck"));
    assert_eq!(out.len(), 1, "{out:?}");
    let out = run_to_end(
        c.command("probe")
            .args(["dlsym-handle", "which", "cuInit", "ctx", "0"]),
    );
    assert_eq!(out, ["which cuInit libcuda.so.1 cuInit", "ctx 0 0"]);
    assert_eq!(std::fs::read_dir(c.state()).expect("state").count(), 0);
}
