//! Links the limiter with a version script that exports exactly `dlsym` and the hooks named
//! in `src/symbols.rs` (the `hooked!` entries of its table), and nothing else: the
//! program's other lookups must never land in the limiter.

// A build script fails by panicking.
#![allow(clippy::panic)]

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let table = std::fs::read_to_string(manifest.join("src/symbols.rs"))
        .unwrap_or_else(|e| panic!("reading src/symbols.rs: {e}"));
    let mut names = vec!["dlsym".to_string()];
    for line in table.lines() {
        let Some(rest) = line.trim().strip_prefix("hooked!(") else {
            continue;
        };
        let Some(name) = rest.split("::").nth(1).and_then(|n| n.strip_suffix("),")) else {
            continue;
        };
        names.push(name.to_string());
    }
    assert!(
        names.len() > 20,
        "src/symbols.rs lists the hooks: {names:?}"
    );
    let mut script = String::from("{\n  global:\n");
    for n in &names {
        let _ = writeln!(script, "    {n};");
    }
    script.push_str("  local:\n    *;\n};\n");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("exports.map");
    std::fs::write(&out, script).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        out.display()
    );
    println!("cargo:rerun-if-changed=src/symbols.rs");
    println!("cargo:rerun-if-changed=build.rs");
}
