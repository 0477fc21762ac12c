//! gpushare's house rules, checked (`make layers`, and `make test` through this crate's tests):
//! who may import whom in `src/`, no import cycle among its files, what the crates link,
//! typed errors, async code off the GPU backends, tests sharing through `support` only, and
//! the front door (`lib.rs`, docs/development.md's map, `--help`) in step with the
//! subcommands. docs/development.md ("Rules that a build checks") says the same for readers.
//!
//! A workspace member of its own that depends on syn alone, so it builds in seconds on a cold
//! target directory and never compiles the library it checks: it reads the sources as
//! syntax trees ([`reader`], [`tokens`]), lays the crates out as rustc does ([`crate_tree`]),
//! and asks `cargo tree` for the links ([`links`]). The rules are in [`rules`] and
//! [`front_door`]; [`graph`] finds the cycles. It links nothing of gpushare and nothing links
//! it.

pub mod crate_tree;
pub mod front_door;
pub mod graph;
pub mod links;
pub mod reader;
pub mod rules;
pub mod size;
pub mod source;
pub mod tokens;

use std::fmt;
use std::io;
use std::path::Path;

pub use links::check_links;
pub use source::SourceTree;

/// Which rule a finding breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rule {
    /// Every `mod` has its file, every file of `src/` is a module, every top-level module has
    /// a place in the table.
    Modules,
    /// Who may import whom between the top-level modules of `src/`, the sandbox, and no cycle
    /// between top-level modules.
    Layers,
    /// No import cycle among the files of `src/`.
    Cycles,
    /// Async code reads the GPUs through the off-runtime calls.
    GpuOffRuntime,
    /// No `Result<_, String>`.
    TypedErrors,
    /// `tests/it/` modules import `support` only.
    TestImports,
    /// What the crates link (`cargo tree`).
    Links,
    /// `lib.rs`, docs/development.md's map and `--help` in step with the subcommands.
    FrontDoor,
    /// No file of `src/` over 800 lines before its tests, no function over 120 lines.
    Size,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Rule::Modules => "modules",
            Rule::Layers => "layers",
            Rule::Cycles => "cycles",
            Rule::GpuOffRuntime => "gpu-off-runtime",
            Rule::TypedErrors => "typed-errors",
            Rule::TestImports => "test-imports",
            Rule::Links => "links",
            Rule::FrontDoor => "front-door",
            Rule::Size => "size",
        };
        f.write_str(name)
    }
}

/// One broken rule: where, and what to do.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Finding {
    pub rule: Rule,
    pub at: String,
    pub message: String,
}

impl Finding {
    pub fn new(rule: Rule, at: String, message: String) -> Finding {
        Finding { rule, at, message }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}: {}", self.rule, self.at, self.message)
    }
}

/// The files the source rules read, from the repository at `root`: besides the three trees
/// the rules are about, `crates/limiter/tests`, whose shared support `tests/it` includes by
/// `#[path]` (read as a module of `tests/it`, as rustc compiles it).
pub fn read_repository(root: &Path) -> io::Result<SourceTree> {
    SourceTree::read(
        root,
        &["src", "tests/it", "crates/core/src", "crates/limiter/tests"],
        &["Cargo.toml", "docs/development.md"],
    )
}

/// Every rule that reads files (all but [`check_links`]), sorted.
pub fn check_sources(tree: &SourceTree) -> Vec<Finding> {
    let mut out = Vec::new();
    rules::check_src(tree, &mut out);
    rules::check_tests(tree, &mut out);
    front_door::check(tree, &mut out);
    size::check(tree, &mut out);
    out.sort();
    out.dedup();
    out
}
