//! The rules of the house over the sources: the table of who may use whom (the ordered
//! infrastructure, the roles, the foundation, the composers), and the checks that read
//! `src/`, `tests/it/` and `crates/core/src/` through [`CrateTree`].
//!
//! - layers: a top-level module of `src/` uses only what [`allowed`] gives it (the roles never
//!   each other; an infrastructure module only those before it in [`INFRA`]); the sandbox
//!   crate only from `demo` and test code; the top-level modules import each other without a
//!   cycle. Every reference counts: `use` trees, paths in code, and paths in macro bodies.
//! - cycles: no import cycle among the files of `src/` (every role, every infrastructure
//!   module, and across them). An edge is a file naming an item another file defines,
//!   re-exports followed to the definer (a `pub use` is no edge of the file that re-exports);
//!   naming a module alone (`use super::bind;`) is no edge, its uses are. Product code only: a
//!   test module may use any sibling of its file, as it may use the sandbox.
//! - modules: every `mod` has its file, every file of `src/` is a module of the library or the
//!   binary, every top-level module has a place in this table.
//! - gpu off the runtime: outside `gpu/` (and doctor's own thread, `doctor/gpus.rs`), no call of
//!   `.inventory()` and no use of `gpu::open`: async code reads the GPUs through
//!   `gpu::open_off_runtime` / `gpu::inventory_off_runtime`.
//! - typed errors: no `Result<_, String>` in `src/` or `crates/core/src/`.
//! - test imports: a module of `tests/it/` uses only `support` and its own submodules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::crate_tree::{CrateTree, Resolved};
use crate::graph::Graph;
use crate::reader::RefKind;
use crate::source::SourceTree;
use crate::{Finding, Rule};

/// The infrastructure every role may use, in order: each module may use only the modules
/// before it (and the foundation). A new module goes after everything it uses.
pub const INFRA: &[&str] = &[
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
/// The roles, one subcommand each: they never import each other.
pub const ROLES: &[&str] = &[
    "cdi_hook",
    "deviceplugin",
    "doctor",
    "dra",
    "extender",
    "inspect",
    "webhook",
];
/// Re-exported crates, below everything.
pub const FOUNDATION: &[&str] = &["core", "kubelet_api"];
/// The composers: `cli` dispatches to the roles, `demo` wires a cluster from the sandbox.
pub const COMPOSERS: &[&str] = &["cli", "demo"];
/// The sandbox crate, as it is written in a path.
pub const SANDBOX: &str = "gpushare_sandbox";

/// The crate roots' names as a "top-level module": the library's `lib.rs`, the binary's
/// `main.rs`.
const LIB: &str = "lib";
const MAIN: &str = "main";

/// What a top-level module of `src/` may import.
pub fn allowed(from: &str) -> BTreeSet<&'static str> {
    let mut set: BTreeSet<&'static str> = FOUNDATION.iter().copied().collect();
    match from {
        // The dispatcher composes everything.
        "cli" | MAIN | LIB => {
            set.extend(INFRA);
            set.extend(ROLES);
            set.insert("demo");
            set.insert("cli");
        }
        // The demo composes the roles and the sandbox, but is started by the dispatcher,
        // never the reverse.
        "demo" => {
            set.extend(INFRA);
            set.extend(ROLES);
            set.insert(SANDBOX);
        }
        m if ROLES.contains(&m) => set.extend(INFRA),
        m => {
            if let Some(at) = INFRA.iter().position(|i| *i == m) {
                set.extend(&INFRA[..at]);
            }
        }
    }
    set
}

/// The rule broken by `from` importing `to` (top-level modules), if any; `test` for test code,
/// which may also use the sandbox.
pub fn broken_rule(from: &str, to: &str, test: bool) -> Option<String> {
    if to == from || allowed(from).contains(to) || (test && to == SANDBOX) {
        return None;
    }
    let why = if to == SANDBOX {
        "the sandbox is for `demo` and test code only".to_string()
    } else if ROLES.contains(&from) && ROLES.contains(&to) {
        "roles never import each other".to_string()
    } else if let (Some(_), Some(_)) = (
        INFRA.iter().position(|m| *m == from),
        INFRA.iter().position(|m| *m == to),
    ) {
        format!(
            "the infrastructure is ordered: {from} comes before {to} (move {to} before {from} \
             in INFRA and docs/development.md if {to} does not use {from}; otherwise this is a \
             cycle)"
        )
    } else {
        format!("{from} may use only {:?}", allowed(from))
    };
    Some(why)
}

/// Every rule over `src/` (and `crates/core/src/` for typed errors).
pub fn check_src(tree: &SourceTree, out: &mut Vec<Finding>) {
    let lib = CrateTree::load(tree, Path::new("src/lib.rs"), None);
    let bin = CrateTree::load(tree, Path::new("src/main.rs"), Some("gpushare"));
    let core = CrateTree::load(tree, Path::new("crates/core/src/lib.rs"), None);
    for krate in [&lib, &bin, &core] {
        for (file, line, message) in &krate.problems {
            out.push(Finding::new(
                Rule::Modules,
                at(file, *line),
                message.clone(),
            ));
        }
    }
    if lib.files.is_empty() {
        out.push(Finding::new(
            Rule::Modules,
            "src/lib.rs".into(),
            "no library to read".into(),
        ));
        return;
    }
    for file in tree.rust_files_under(Path::new("src")) {
        if !lib.files.contains_key(file) && !bin.files.contains_key(file) {
            out.push(Finding::new(
                Rule::Modules,
                file.display().to_string(),
                "no `mod` declares this file: it is part of no crate, and no rule reads it".into(),
            ));
        }
    }
    let tops = lib
        .module(&[])
        .map(|m| m.children.clone())
        .unwrap_or_default();
    for top in &tops {
        let known = INFRA.contains(&top.as_str())
            || ROLES.contains(&top.as_str())
            || COMPOSERS.contains(&top.as_str());
        if !known {
            out.push(Finding::new(
                Rule::Modules,
                lib.file_of(std::slice::from_ref(top))
                    .map_or_else(|| top.clone(), |f| f.display().to_string()),
                format!(
                    "the top-level module `{top}` has no place in the house's table \
                     (tools/house/src/rules.rs: INFRA, ROLES or COMPOSERS) nor in \
                     docs/development.md's map"
                ),
            ));
        }
    }
    layers(&lib, &bin, &tops, out);
    file_cycles(&lib, out);
    gpu_off_runtime(&lib, &bin, out);
    for krate in [&lib, &bin, &core] {
        for (file, (_, facts)) in &krate.files {
            for (text, line) in &facts.string_results {
                out.push(Finding::new(
                    Rule::TypedErrors,
                    at(file, *line),
                    format!("{text}: errors are thiserror enums, never a String"),
                ));
            }
        }
    }
}

fn at(file: &Path, line: usize) -> String {
    format!("{}:{line}", file.display())
}

/// The top-level module an absolute path of the library lands in, if it names one (or the
/// foundation, re-exported at the root); `None` for an item of the root.
fn top_of(tops: &BTreeSet<String>, abs: &[String]) -> Option<String> {
    let first = abs.first()?;
    (tops.contains(first) || FOUNDATION.contains(&first.as_str())).then(|| first.clone())
}

/// The layer rules and the cycle rule between top-level modules.
fn layers(lib: &CrateTree, bin: &CrateTree, tops: &BTreeSet<String>, out: &mut Vec<Finding>) {
    let mut graph = Graph::default();
    let mut broken: BTreeMap<(String, String), (String, Vec<String>)> = BTreeMap::new();
    for (krate, is_bin) in [(lib, false), (bin, true)] {
        for (file, (module, facts)) in &krate.files {
            let from = if is_bin {
                MAIN.to_string()
            } else {
                module.first().cloned().unwrap_or_else(|| LIB.to_string())
            };
            for r in &facts.references {
                let to = match krate.resolve(&r.module, &r.path) {
                    Some(Resolved::Here(abs)) if !is_bin => top_of(tops, &abs),
                    Some(Resolved::Linked(abs)) => top_of(tops, &abs),
                    Some(Resolved::Extern(name)) if name == SANDBOX => Some(SANDBOX.to_string()),
                    _ => None,
                };
                let Some(to) = to else { continue };
                if to == from {
                    continue;
                }
                let written = r.path.join("::");
                graph.add(&from, &to, format!("{} names {written}", at(file, r.line)));
                if let Some(why) = broken_rule(&from, &to, r.test) {
                    let entry = broken
                        .entry((from.clone(), to.clone()))
                        .or_insert_with(|| (why, Vec::new()));
                    entry.1.push(format!("{} ({written})", at(file, r.line)));
                }
            }
        }
    }
    for ((from, to), (why, places)) in broken {
        out.push(Finding::new(
            Rule::Layers,
            places.join(", "),
            format!("{from} -> {to}: {why}"),
        ));
    }
    for cycle in graph.cycles() {
        out.push(cycle_finding(Rule::Layers, "top-level modules", &cycle));
    }
}

fn cycle_finding(rule: Rule, what: &str, cycle: &crate::graph::Cycle) -> Finding {
    let edges: Vec<String> = cycle
        .edges
        .iter()
        .map(|(from, to, evidence)| {
            let first = evidence.first().cloned().unwrap_or_default();
            let more = match evidence.len() {
                0 | 1 => String::new(),
                n => format!(" and {} more", n - 1),
            };
            format!("\n    {from} -> {to}: {first}{more}")
        })
        .collect();
    Finding::new(
        rule,
        cycle.nodes.join(", "),
        format!(
            "an import cycle between {what}; move what both sides need below them (a module \
             of its own that imports neither), then the edges go:{}",
            edges.concat()
        ),
    )
}

/// The file graph of the library's product code, with its evidence.
pub fn file_graph(lib: &CrateTree) -> Graph {
    let mut graph = Graph::default();
    for (file, (_, facts)) in &lib.files {
        let from = file.display().to_string();
        for r in &facts.references {
            if matches!(r.kind, RefKind::Use { public: true, .. }) {
                continue;
            }
            let Some(Resolved::Here(abs)) = lib.resolve(&r.module, &r.path) else {
                continue;
            };
            let Some((module, Some(_item))) = lib.land(&abs) else {
                continue; // a module named alone: its uses are the edges
            };
            let Some(target) = lib.file_of(&module) else {
                continue;
            };
            graph.add(
                &from,
                &target.display().to_string(),
                format!("line {} names {}", r.line, r.path.join("::")),
            );
        }
    }
    graph
}

fn file_cycles(lib: &CrateTree, out: &mut Vec<Finding>) {
    for cycle in file_graph(lib).cycles() {
        out.push(cycle_finding(Rule::Cycles, "files of src/", &cycle));
    }
}

fn gpu_off_runtime(lib: &CrateTree, bin: &CrateTree, out: &mut Vec<Finding>) {
    let exempt =
        |file: &Path| file.starts_with("src/gpu") || file == Path::new("src/doctor/gpus.rs");
    for krate in [lib, bin] {
        for (file, (_, facts)) in &krate.files {
            if exempt(file) {
                continue;
            }
            for (name, line, _) in &facts.bare_method_calls {
                if name == "inventory" {
                    out.push(Finding::new(
                        Rule::GpuOffRuntime,
                        at(file, *line),
                        "calls `.inventory()` of a GPU backend: on the async runtime, use \
                         gpu::inventory_off_runtime"
                            .into(),
                    ));
                }
            }
            for r in &facts.references {
                let abs = match krate.resolve(&r.module, &r.path) {
                    Some(Resolved::Here(abs) | Resolved::Linked(abs)) => abs,
                    _ => continue,
                };
                if abs == ["gpu", "open"] {
                    out.push(Finding::new(
                        Rule::GpuOffRuntime,
                        at(file, r.line),
                        format!(
                            "names {}: on the async runtime, use gpu::open_off_runtime",
                            r.path.join("::")
                        ),
                    ));
                }
            }
        }
    }
}

/// The test rule: a module of `tests/it/` uses, of the test crate, only `support` and its own
/// submodules (never another topic, nor a sibling inside `packaging/`).
pub fn check_tests(tree: &SourceTree, out: &mut Vec<Finding>) {
    let root = Path::new("tests/it/main.rs");
    if !tree.contains(root) {
        return;
    }
    let it = CrateTree::load(tree, root, Some("gpushare"));
    for (file, line, message) in &it.problems {
        out.push(Finding::new(
            Rule::Modules,
            at(file, *line),
            message.clone(),
        ));
    }
    let tops = it
        .module(&[])
        .map(|m| m.children.clone())
        .unwrap_or_default();
    for (file, (module, facts)) in &it.files {
        if module.is_empty() {
            continue; // main.rs declares the modules
        }
        let mut broken = BTreeSet::new();
        for r in &facts.references {
            let Some(Resolved::Here(abs)) = it.resolve(&r.module, &r.path) else {
                continue;
            };
            let Some(first) = abs.first() else { continue };
            let fine = first == "support" || abs.starts_with(module) || !tops.contains(first);
            if !fine {
                broken.insert(format!("{} ({})", r.path.join("::"), at(file, r.line)));
            }
        }
        if !broken.is_empty() {
            out.push(Finding::new(
                Rule::TestImports,
                file.display().to_string(),
                format!(
                    "a test module imports another one; move what they share into \
                     tests/it/support/: {}",
                    broken.into_iter().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_direction_of_a_former_cycle_goes_up_the_order_on_one_side() {
        // The cycles this house had: config <-> gpu and admin <-> http_server.
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
        assert!(broken_rule("demo", SANDBOX, false).is_none());
        assert!(broken_rule("demo", "cli", false).is_some());
    }

    #[test]
    fn the_table_names_each_module_once() {
        let all: Vec<&str> = INFRA
            .iter()
            .chain(ROLES)
            .chain(COMPOSERS)
            .copied()
            .collect();
        let unique: BTreeSet<&str> = all.iter().copied().collect();
        assert_eq!(all.len(), unique.len(), "{all:?}");
    }
}
