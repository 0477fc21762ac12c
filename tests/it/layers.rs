//! The house rules, checked: who may use whom inside the `gpushare` crate, and what the pure
//! `gpushare-core` crate and the binary without the `demo` feature may link.
//!
//! The module rules read every `crate::…` path in `src/` (in `use` trees and in code; comments
//! are skipped). The crate rules ask `cargo tree`. The test rule reads `tests/it/`: test
//! modules import shared builders from `support` only. `make layers` runs just this module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Modules every role may use.
const INFRA: &[&str] = &[
    "admin",
    "buildinfo",
    "config",
    "exposition",
    "fd_limit",
    "gpu",
    "http_server",
    "k8s",
    "shutdown",
    "telemetry",
    "tls",
];
/// The roles: never import each other.
const ROLES: &[&str] = &["deviceplugin", "doctor", "extender", "inspect", "webhook"];
/// Re-exported crates, below everything.
const FOUNDATION: &[&str] = &["core", "kubelet_api"];

/// What a top-level module of the crate may import.
fn allowed(from: &str) -> BTreeSet<&'static str> {
    let mut set: BTreeSet<&'static str> = FOUNDATION.iter().copied().collect();
    match from {
        // The dispatcher composes everything.
        "cli" | "main" | "lib" => {
            set.extend(INFRA);
            set.extend(ROLES);
            set.insert("demo");
        }
        // The demo composes the roles, but is started by the dispatcher, never the reverse.
        "demo" => {
            set.extend(INFRA);
            set.extend(ROLES);
        }
        m if ROLES.contains(&m) || INFRA.contains(&m) => {
            set.extend(INFRA);
        }
        _ => {}
    }
    set
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/extender/bind.rs` → `extender`).
fn owner(file: &Path) -> String {
    let rel = file.strip_prefix(src_dir()).expect("under src/");
    let first = rel.components().next().expect("a component");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_string()
}

/// Removes `//` comments (doc comments included). String literals are kept: a `crate::`
/// inside one is rare enough that a failing test which gets looked at is the right answer.
fn without_comments(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Top-level modules named by `crate::` paths, `use crate::{a, b::c}` groups included.
fn imported_modules(code: &str) -> BTreeSet<String> {
    modules_after(code, "crate::")
}

/// The first module named after each `prefix` (`crate::` or `super::`), groups included.
fn modules_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let bytes = code.as_bytes();
    let mut at = 0;
    while let Some(i) = code[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        // `gpushare_core::…` or `$crate::` are other crates or macros.
        if start > 0 {
            let before = bytes[start - 1];
            if before.is_ascii_alphanumeric() || before == b'_' || before == b'$' {
                continue;
            }
        }
        if bytes.get(at) == Some(&b'{') {
            // A group: the first identifier of each element at depth 1.
            let mut depth = 0;
            let mut element_start = true;
            let mut j = at;
            while j < bytes.len() {
                match bytes[j] {
                    b'{' => {
                        depth += 1;
                        element_start = depth == 1;
                    }
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    b',' if depth == 1 => element_start = true,
                    c if element_start && depth == 1 && (c.is_ascii_alphabetic() || c == b'_') => {
                        let end = code[j..]
                            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .map_or(code.len(), |e| j + e);
                        found.insert(code[j..end].to_string());
                        element_start = false;
                        j = end;
                        continue;
                    }
                    _ => {}
                }
                j += 1;
            }
        } else {
            let end = code[at..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(code.len(), |e| at + e);
            if end > at {
                found.insert(code[at..end].to_string());
            }
        }
    }
    found
}

#[test]
fn the_import_scanner_reads_paths_and_groups() {
    let code = "use crate::{config::{self, Config}, k8s, shutdown::Shutdown};\n\
                let x = crate::gpu::fake::Fake::new();\n\
                use gpushare_core::wire;  $crate::thing";
    let got: Vec<String> = imported_modules(code).into_iter().collect();
    assert_eq!(got, ["config", "gpu", "k8s", "shutdown"]);
}

#[test]
fn the_import_scanner_reads_super_paths() {
    let code = "use super::{support::x, ha::y};\nuse super::*;\nlet z = super::chart::f();";
    let got: Vec<String> = modules_after(code, "super::").into_iter().collect();
    assert_eq!(got, ["chart", "ha", "support"]);
}

#[test]
fn roles_never_import_each_other_and_infrastructure_never_imports_a_role() {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    assert!(
        files.len() > 20,
        "found the sources ({} files)",
        files.len()
    );
    let mut broken: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let from = owner(file);
        let text = std::fs::read_to_string(file).expect("readable");
        let rules = allowed(&from);
        for to in imported_modules(&without_comments(&text)) {
            if to != from && !rules.contains(to.as_str()) {
                let rel = file.strip_prefix(src_dir()).unwrap_or(file).display();
                broken
                    .entry(format!("{from} -> {to}"))
                    .or_default()
                    .insert(rel.to_string());
            }
        }
    }
    assert!(
        broken.is_empty(),
        "layer rules broken (see the README's \"Development\" section):\n{broken:#?}"
    );
}

#[test]
fn every_top_level_module_has_a_rule() {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    let known: BTreeSet<&str> = INFRA
        .iter()
        .chain(ROLES)
        .chain(["cli", "demo", "main", "lib"].iter())
        .copied()
        .collect();
    let unknown: BTreeSet<String> = files
        .iter()
        .map(|f| owner(f))
        .filter(|m| !known.contains(m.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "new top-level modules need a place in tests/it/layers.rs: {unknown:?}"
    );
}

/// Names of the packages in `cargo tree` for `args` (normal dependencies only).
fn dependency_names(args: &[&str]) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_core_crate_links_nothing_of_the_outside_world() {
    let deps = dependency_names(&["-p", "gpushare-core"]);
    assert!(
        deps.contains("gpushare-core"),
        "cargo tree listed the crate: {deps:?}"
    );
    let forbidden = [
        "kube",
        "kube-client",
        "k8s-openapi",
        "hyper",
        "tonic",
        "nvml-wrapper",
        "tokio",
        "gpushare-kubelet-api",
        "gpushare-sandbox",
    ];
    let found: Vec<&str> = forbidden
        .iter()
        .copied()
        .filter(|f| deps.contains(*f))
        .collect();
    assert!(found.is_empty(), "gpushare-core depends on {found:?}");
}

#[test]
fn the_binary_without_the_demo_feature_does_not_link_the_sandbox() {
    let lean = dependency_names(&["-p", "gpushare", "--no-default-features"]);
    assert!(
        lean.contains("gpushare-core"),
        "cargo tree listed the crate: {lean:?}"
    );
    assert!(
        !lean.contains("gpushare-sandbox"),
        "the sandbox is linked without the demo feature"
    );
    let full = dependency_names(&["-p", "gpushare"]);
    assert!(
        full.contains("gpushare-sandbox"),
        "the default build (with `gpushare demo`) links the sandbox"
    );
}

#[test]
fn gpu_backend_calls_stay_off_the_async_runtime() {
    // nvidia-smi runs a process that can hang until its timeout: outside `gpu/`, async code
    // reads the GPUs through `gpu::open_off_runtime` / `gpu::inventory_off_runtime`. The
    // doctor calls the backend directly, on a plain thread of its own (see doctor/gpus.rs).
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    let allowed = [src_dir().join("doctor").join("gpus.rs")];
    let mut direct = Vec::new();
    for file in &files {
        if file.starts_with(src_dir().join("gpu")) || allowed.contains(file) {
            continue;
        }
        let code = without_comments(&std::fs::read_to_string(file).expect("readable"));
        for needle in [".inventory()", "gpu::open("] {
            if code.contains(needle) {
                direct.push(format!("{} calls {needle}", file.display()));
            }
        }
    }
    assert!(
        direct.is_empty(),
        "blocking GPU calls on the runtime: {direct:#?}"
    );
}

/// The paths of the test crate that the file `rel` (under `tests/it/`) may not import: anything
/// but `crate::support`, and, inside `support/`, its sibling modules through `super::`.
fn test_imports_broken(rel: &Path, code: &str) -> BTreeSet<String> {
    let parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let in_support = parts.first().is_some_and(|p| p == "support");
    // `super` of `a.rs` and `a/mod.rs` is the crate root; of `a/b.rs`, the module `a`.
    let parent_is_root = parts.len() == 1 || (parts.len() == 2 && parts[1] == "mod.rs");
    let mut broken = BTreeSet::new();
    for to in modules_after(code, "crate::") {
        if to != "support" {
            broken.insert(format!("crate::{to}"));
        }
    }
    for to in modules_after(code, "super::") {
        let fine = if parent_is_root {
            to == "support"
        } else {
            in_support
        };
        if !fine {
            broken.insert(format!("super::{to}"));
        }
    }
    broken
}

#[test]
fn the_test_import_rule_allows_support_only() {
    let top = Path::new("watch_churn.rs");
    assert!(test_imports_broken(top, "use crate::support::ledger_truth::truth;").is_empty());
    assert!(test_imports_broken(top, "use super::support::run;").is_empty());
    assert_eq!(
        test_imports_broken(top, "use crate::ha::{sandbox, truth};"),
        BTreeSet::from(["crate::ha".to_string()])
    );
    let nested = Path::new("packaging/kubeadm.rs");
    assert_eq!(
        test_imports_broken(nested, "use super::chart::default_values;"),
        BTreeSet::from(["super::chart".to_string()])
    );
    let support = Path::new("support/ledger_truth.rs");
    assert!(test_imports_broken(support, "use super::extender_cluster::http;").is_empty());
    assert_eq!(
        test_imports_broken(support, "use crate::deviceplugin::cluster;"),
        BTreeSet::from(["crate::deviceplugin".to_string()])
    );
}

#[test]
fn test_modules_import_shared_builders_from_support_only() {
    // Shared builders, fixtures and waits live in `tests/it/support/`; a test module that
    // imports another one ties two topics together. `main.rs` declares the modules; this file
    // names forbidden paths in its own strings.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("it");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 20, "found the tests ({} files)", files.len());
    let mut broken: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(&root).expect("under tests/it");
        if rel == Path::new("main.rs") || rel == Path::new("layers.rs") {
            continue;
        }
        let code = without_comments(&std::fs::read_to_string(file).expect("readable"));
        let found = test_imports_broken(rel, &code);
        if !found.is_empty() {
            broken.insert(rel.display().to_string(), found);
        }
    }
    assert!(
        broken.is_empty(),
        "test modules import other test modules; move what they share into tests/it/support/:\n{broken:#?}"
    );
}

/// `Result<…, String>` types in `code`: the error type is the last top-level argument.
fn string_error_results(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find("Result<") {
        let start = at + i;
        at = start + "Result<".len();
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue; // `FilterResult<`, `io_Result<`: another type.
        }
        let (mut depth, mut last_arg) = (1usize, at);
        let mut end = None;
        for (j, c) in code[at..].char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(at + j);
                        break;
                    }
                }
                ',' if depth == 1 => last_arg = at + j + 1,
                _ => {}
            }
        }
        let Some(end) = end else { break };
        if last_arg > at && matches!(code[last_arg..end].trim(), "String" | "std::string::String") {
            found.push(
                code[start..=end]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
    }
    found
}

#[test]
fn the_string_error_scanner_reads_the_last_argument() {
    let code = "fn a() -> Result<(u16, String), String> {}\n\
                fn b() -> Result<Vec<String>, BindError> {}\n\
                fn c() -> Result<HashMap<String, u8>,\n    String> {}\n\
                fn d() -> anyhow::Result<String> {}\n\
                fn e() -> FilterResult<String, String> {}";
    assert_eq!(
        string_error_results(code),
        [
            "Result<(u16, String), String>",
            "Result<HashMap<String, u8>, String>"
        ]
    );
}

#[test]
fn errors_are_typed_never_result_of_string() {
    // Error enums (thiserror) carry their kind to the HTTP/gRPC status and to a metric label;
    // a `String` carries only words. Roles, infrastructure and the pure core alike.
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/core/src"),
        &mut files,
    );
    let mut found = Vec::new();
    for file in &files {
        let code = without_comments(&std::fs::read_to_string(file).expect("readable"));
        for r in string_error_results(&code) {
            found.push(format!("{}: {r}", file.display()));
        }
    }
    assert!(
        found.is_empty(),
        "Result<_, String> in the product; use a thiserror enum:\n{found:#?}"
    );
}
