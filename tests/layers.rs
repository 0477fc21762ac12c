//! The house rules, checked: who may use whom inside the `gpushare` crate, and what the pure
//! `gpushare-core` crate and the binary without the `demo` feature may link.
//!
//! A test target of its own (`cargo test --test layers`, `make layers`): it reads files and
//! asks `cargo tree`, so it needs none of the integration tests compiled.
//!
//! The module rules read every `crate::…`, `super::…` and `gpushare_sandbox::…` path in
//! `src/` (in `use` trees and in code; comments are skipped):
//! - the infrastructure is ordered ([`INFRA`]): a module uses only those before it, so the
//!   infrastructure has no cycle;
//! - a role uses the infrastructure and the foundation, never another role;
//! - inside a role (and inside the node agent), the submodules import each other without a
//!   cycle (the role's own `mod.rs` is the root everything may reach);
//! - `gpushare_sandbox` (the test doubles) is for `demo` and for `#[cfg(test)]` code only.
//!
//! The crate rules ask `cargo tree`. The test rule reads `tests/it/`: test modules import shared
//! builders from `support` only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The infrastructure every role may use, in order: each module may use only the modules
/// before it (and the foundation). A new module goes after everything it uses.
const INFRA: &[&str] = &[
    "buildinfo",
    "shutdown",
    "fd_limit",
    "config",
    "telemetry",
    "exposition",
    "tls",
    "failure",
    "outbound",
    "http_server",
    "admin",
    "k8s",
    "cgroup",
    "gpu",
    "pcie",
    "rdma",
    "devices",
    "node",
];
/// The roles: never import each other.
const ROLES: &[&str] = &[
    "cdi_hook",
    "deviceplugin",
    "doctor",
    "dra",
    "extender",
    "inspect",
    "webhook",
];
/// Re-exported crates, below everything.
const FOUNDATION: &[&str] = &["core", "kubelet_api"];
/// Top-level modules whose submodules must not import each other in a cycle.
const NO_INNER_CYCLES: &[&str] = &[
    "deviceplugin",
    "doctor",
    "dra",
    "extender",
    "inspect",
    "webhook",
    "node",
];
/// Imports inside a role that close a cycle and are known: (role, from, to). Each must still
/// exist (so the list only shrinks); any other cycle fails. The extender's `state` holds the
/// bind owners and the leader's fence, whose modules use `ExtenderState` in turn: moving those
/// two types below `state` (with the split of `leader.rs`) empties this list.
const KNOWN_CYCLE_EDGES: &[(&str, &str, &str)] = &[
    ("extender", "state", "bind"),
    ("extender", "state", "leader"),
];
/// The sandbox crate, as an import target.
const SANDBOX: &str = "gpushare_sandbox";

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
        // The demo composes the roles and the sandbox, but is started by the dispatcher, never
        // the reverse.
        "demo" => {
            set.extend(INFRA);
            set.extend(ROLES);
            set.insert(SANDBOX);
        }
        m if ROLES.contains(&m) => {
            set.extend(INFRA);
        }
        m => {
            if let Some(at) = INFRA.iter().position(|i| *i == m) {
                set.extend(&INFRA[..at]);
            }
        }
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

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The paths of the use tree (or plain path) starting at `i`: `a::b::{c, d::e}` gives
/// `[a, b, c]` and `[a, b, d, e]`; a glob ends its path. Returns where it stopped.
fn parse_tree(b: &[u8], i: usize, depth: usize) -> (Vec<Vec<String>>, usize) {
    let mut i = skip_ws(b, i);
    if depth > 8 || i >= b.len() {
        return (Vec::new(), i);
    }
    if b[i] == b'{' {
        i += 1;
        let mut out = Vec::new();
        loop {
            i = skip_ws(b, i);
            if i >= b.len() {
                break;
            }
            if b[i] == b'}' {
                i += 1;
                break;
            }
            let (paths, next) = parse_tree(b, i, depth + 1);
            out.extend(paths);
            i = skip_ws(b, next.max(i + 1));
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => break,
            }
        }
        return (out, i);
    }
    if b[i] == b'*' {
        return (vec![Vec::new()], i + 1);
    }
    if !(b[i].is_ascii_alphabetic() || b[i] == b'_') {
        return (Vec::new(), i);
    }
    let start = i;
    while i < b.len() && is_ident_byte(b[i]) {
        i += 1;
    }
    let ident = String::from_utf8_lossy(&b[start..i]).into_owned();
    let after = skip_ws(b, i);
    if b.get(after..after + 2) == Some(b"::".as_slice()) {
        let (rest, next) = parse_tree(b, after + 2, depth + 1);
        if rest.is_empty() {
            return (vec![vec![ident]], next);
        }
        let paths = rest
            .into_iter()
            .map(|mut p| {
                p.insert(0, ident.clone());
                p
            })
            .collect();
        return (paths, next);
    }
    (vec![vec![ident]], i)
}

/// Every path after `prefix` in `code` (`crate::`, `gpushare_sandbox::`), groups expanded,
/// not counting `prefix` inside a longer name (`gpushare_core::`, `$crate::`).
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        if start > 0 && (is_ident_byte(b[start - 1]) || b[start - 1] == b'$') {
            continue;
        }
        out.extend(parse_tree(b, at, 0).0);
    }
    out
}

/// Every `super::` path in `code`, resolved against `module` (the path of the module the
/// code is in): `super::super::x` in `a::b::c` is `a::x`. A chain that climbs above the crate
/// is left out.
fn super_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    let prefix = "super::";
    while let Some(i) = code[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        // Inside a longer name, or a later link of a chain already read.
        if start > 0 && (is_ident_byte(b[start - 1]) || b[start - 1] == b':') {
            continue;
        }
        let mut ups = 1;
        while code[at..].starts_with(prefix) {
            ups += 1;
            at += prefix.len();
        }
        let Some(keep) = module.len().checked_sub(ups) else {
            continue;
        };
        for path in parse_tree(b, at, 0).0 {
            let mut full = module[..keep].to_vec();
            full.extend(path);
            out.push(full);
        }
    }
    out
}

/// The module path of a file under `src/` (`extender/bind.rs` → `[extender, bind]`,
/// `node/mod.rs` → `[node]`, `lib.rs` → `[]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] || parts == ["main"] {
        parts.pop();
    }
    parts
}

/// Where a file's test code starts: the first `#[cfg(test)]` (by the house's habit, the
/// tests module at the end). Its `super::` is one module deeper, and it may use the sandbox.
fn split_test_code(code: &str) -> (&str, &str) {
    match code.find("#[cfg(test)]") {
        Some(i) => code.split_at(i),
        None => (code, ""),
    }
}

/// One import found in a file.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Import {
    /// Absolute module path (`[deviceplugin, matching, Match]`), or `[gpushare_sandbox, …]`.
    path: Vec<String>,
    /// In the file's test code.
    test: bool,
}

/// Every import of the file `rel` (under `src/`) with comments removed.
fn imports_of(rel: &Path, code: &str) -> Vec<Import> {
    let module = module_path(rel);
    let (product, tests) = split_test_code(code);
    let mut test_module = module.clone();
    test_module.push("tests".to_string());
    let mut out = Vec::new();
    for (code, module, test) in [(product, &module, false), (tests, &test_module, true)] {
        let mut paths = paths_after(code, "crate::");
        paths.extend(super_paths(code, module));
        paths.extend(
            paths_after(code, &format!("{SANDBOX}::"))
                .into_iter()
                .map(|mut p| {
                    p.insert(0, SANDBOX.to_string());
                    p
                }),
        );
        out.extend(paths.into_iter().map(|path| Import { path, test }));
    }
    out
}

#[test]
fn the_import_scanner_reads_paths_and_groups() {
    let code = "use crate::{config::{self, Config}, k8s, shutdown::Shutdown};\n\
                let x = crate::gpu::fake::Fake::new();\n\
                use gpushare_core::wire;  $crate::thing";
    let got: BTreeSet<String> = paths_after(code, "crate::")
        .into_iter()
        .map(|p| p[0].clone())
        .collect();
    assert_eq!(
        got,
        BTreeSet::from(["config", "gpu", "k8s", "shutdown"].map(String::from))
    );
    let nested = paths_after(
        "use crate::deviceplugin::{matching::{self, M}, records};",
        "crate::",
    );
    assert!(nested.contains(&vec!["deviceplugin".into(), "records".into()]));
    assert!(nested.contains(&vec!["deviceplugin".into(), "matching".into(), "M".into()]));
}

#[test]
fn the_import_scanner_reads_super_paths() {
    let code = "use super::{support::x, ha::y};\nuse super::*;\nlet z = super::chart::f();";
    let got: Vec<String> = modules_after(code, "super::").into_iter().collect();
    assert_eq!(got, ["chart", "ha", "support"]);
    // Resolved against the module the code is in; chains climb.
    let module = ["node".to_string(), "mps".to_string()];
    let paths = super_paths(
        "use super::publish::NodeEvents; super::super::config::X",
        &module,
    );
    assert_eq!(
        paths,
        [
            vec!["node".to_string(), "publish".into(), "NodeEvents".into()],
            vec!["config".to_string(), "X".into()],
        ]
    );
    // A top-level file's `super::` is the crate root.
    let top = super_paths("use super::gpu::x;", &["config".to_string()]);
    assert_eq!(top, [vec!["gpu".to_string(), "x".into()]]);
    // The sandbox is read too; test code is one module deeper.
    let imports = imports_of(
        Path::new("k8s/events.rs"),
        "use super::retry::x;\n#[cfg(test)]\nmod tests { use super::Events; use gpushare_sandbox::apiserver::A; }",
    );
    assert!(imports.contains(&Import {
        path: vec!["k8s".into(), "retry".into(), "x".into()],
        test: false
    }));
    assert!(imports.contains(&Import {
        path: vec!["k8s".into(), "events".into(), "Events".into()],
        test: true
    }));
    assert!(imports.contains(&Import {
        path: vec![SANDBOX.into(), "apiserver".into(), "A".into()],
        test: true
    }));
}

/// The top-level modules of `src/` (files and directories).
fn top_level_modules() -> BTreeSet<String> {
    std::fs::read_dir(src_dir())
        .expect("src/")
        .flatten()
        .map(|e| {
            e.file_name()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect()
}

/// The submodules of the top-level module `top` (`src/<top>/<x>.rs` or `src/<top>/<x>/`).
fn submodules(top: &str) -> BTreeSet<String> {
    let Ok(entries) = std::fs::read_dir(src_dir().join(top)) else {
        return BTreeSet::new();
    };
    entries
        .flatten()
        .map(|e| {
            e.file_name()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .filter(|n| n != "mod")
        .collect()
}

/// A cycle of `graph`, as the nodes along it with the first repeated at the end, if any.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, done, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut done, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

/// The rule broken by `from` importing `to` (top-level modules), if any.
fn broken_rule(from: &str, to: &str, test: bool) -> Option<String> {
    if to == from || allowed(from).contains(to) || (test && to == SANDBOX) {
        return None;
    }
    let why = if to == SANDBOX {
        "the sandbox is for `demo` and test code only".to_string()
    } else if ROLES.contains(&from) && ROLES.contains(&to) {
        "roles never import each other".to_string()
    } else if let (Some(a), Some(b)) = (
        INFRA.iter().position(|m| *m == from),
        INFRA.iter().position(|m| *m == to),
    ) {
        debug_assert!(b > a);
        format!(
            "the infrastructure is ordered: {from} comes before {to} (swap them in INFRA if \
             {to} does not use {from}; otherwise this is a cycle)"
        )
    } else {
        format!("{from} may use only {:?}", allowed(from))
    };
    Some(why)
}

#[test]
fn an_import_cycle_in_the_infrastructure_or_between_roles_is_refused() {
    // The cycles this house had: config <-> gpu and admin <-> http_server. Each direction of
    // a cycle goes up the order on one side.
    for (a, b) in [("config", "gpu"), ("admin", "http_server")] {
        let up = [(a, b), (b, a)]
            .iter()
            .filter(|(from, to)| broken_rule(from, to, false).is_some())
            .count();
        assert_eq!(up, 1, "{a} <-> {b}: exactly one direction is allowed");
    }
    assert!(broken_rule("node", "deviceplugin", false).is_some());
    assert!(broken_rule("deviceplugin", "extender", false).is_some());
    assert!(broken_rule("deviceplugin", "node", false).is_none());
    assert!(broken_rule("k8s", SANDBOX, false).is_some());
    assert!(broken_rule("k8s", SANDBOX, true).is_none());
    let graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::from([
        (
            "allocate".to_string(),
            BTreeSet::from(["matching".to_string()]),
        ),
        (
            "matching".to_string(),
            BTreeSet::from(["records".to_string()]),
        ),
        (
            "records".to_string(),
            BTreeSet::from(["allocate".to_string()]),
        ),
    ]);
    assert_eq!(
        find_cycle(&graph).expect("a cycle"),
        ["allocate", "matching", "records", "allocate"]
    );
    let mut acyclic = graph.clone();
    acyclic.remove("records");
    assert_eq!(find_cycle(&acyclic), None);
}

#[test]
fn roles_never_import_each_other_and_the_infrastructure_is_ordered() {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    assert!(
        files.len() > 20,
        "found the sources ({} files)",
        files.len()
    );
    let tops = top_level_modules();
    let mut broken: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let from = owner(file);
        let rel = file.strip_prefix(src_dir()).unwrap_or(file);
        let text = without_comments(&std::fs::read_to_string(file).expect("readable"));
        for import in imports_of(rel, &text) {
            let Some(to) = import.path.first() else {
                continue;
            };
            // `crate::x` must name an allowed module; a `super::` path counts where it
            // lands on a module (an item of the crate root is no import of a module).
            let known = tops.contains(to) || FOUNDATION.contains(&to.as_str()) || to == SANDBOX;
            if !known && import.path.len() == 1 {
                continue;
            }
            if to != &from {
                graph.entry(from.clone()).or_default().insert(to.clone());
            }
            if let Some(why) = broken_rule(&from, to, import.test) {
                broken
                    .entry(format!("{from} -> {to}: {why}"))
                    .or_default()
                    .insert(rel.display().to_string());
            }
        }
    }
    assert!(
        broken.is_empty(),
        "layer rules broken (see docs/development.md):\n{broken:#?}"
    );
    assert_eq!(
        find_cycle(&graph),
        None,
        "an import cycle between top-level modules"
    );
}

#[test]
fn the_modules_inside_a_role_import_each_other_without_a_cycle() {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    let mut cycles = Vec::new();
    for top in NO_INNER_CYCLES {
        let subs = submodules(top);
        assert!(!subs.is_empty(), "{top} has submodules");
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in files.iter().filter(|f| owner(f) == *top) {
            let rel = file.strip_prefix(src_dir()).unwrap_or(file);
            let Some(from) = module_path(rel).get(1).cloned() else {
                continue; // the role's root: everything may reach it, it declares them all
            };
            let text = without_comments(&std::fs::read_to_string(file).expect("readable"));
            for import in imports_of(rel, &text) {
                if import.path.first().map(String::as_str) != Some(top) {
                    continue;
                }
                if let Some(to) = import
                    .path
                    .get(1)
                    .filter(|t| subs.contains(*t) && **t != from)
                {
                    graph.entry(from.clone()).or_default().insert(to.clone());
                }
            }
        }
        for (role, from, to) in KNOWN_CYCLE_EDGES.iter().filter(|(r, _, _)| r == top) {
            let present = graph.get_mut(*from).is_some_and(|t| t.remove(*to));
            assert!(
                present,
                "{role}: {from} -> {to} is gone: remove it from KNOWN_CYCLE_EDGES"
            );
        }
        if let Some(cycle) = find_cycle(&graph) {
            cycles.push(format!("{top}: {}", cycle.join(" -> ")));
        }
    }
    assert!(
        cycles.is_empty(),
        "import cycles between the modules of a role: move what both need into one of them \
         (or a module below both):\n{cycles:#?}"
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
        "new top-level modules need a place in tests/layers.rs: {unknown:?}"
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
fn the_limiter_is_never_linked_and_its_contract_links_nothing_heavy() {
    // The limiter is a library preloaded into containers; the node roles read its ledger
    // through the contract crate and never link the limiter itself.
    let full = dependency_names(&["-p", "gpushare"]);
    assert!(
        !full.contains("gpushare-limiter"),
        "the binary links the limiter: {full:?}"
    );
    let contract = dependency_names(&["-p", "gpushare-limiter-contract"]);
    assert!(
        contract.contains("gpushare-limiter-contract"),
        "cargo tree listed the crate: {contract:?}"
    );
    let forbidden = [
        "gpushare-limiter",
        "kube",
        "k8s-openapi",
        "hyper",
        "tonic",
        "nvml-wrapper",
        "tokio",
        "libc",
    ];
    let found: Vec<&str> = forbidden
        .iter()
        .copied()
        .filter(|f| contract.contains(*f))
        .collect();
    assert!(
        found.is_empty(),
        "gpushare-limiter-contract depends on {found:?}"
    );
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
    assert!(test_imports_broken(support, "use super::extender_http::http;").is_empty());
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
        if rel == Path::new("main.rs") {
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
