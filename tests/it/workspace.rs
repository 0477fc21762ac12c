//! The repository's own rules, checked: `tests/README.md` lists every module of this test
//! binary and of its `support` (and no module that is gone), and every crate of the workspace
//! opts into the workspace lints, which forbid `unsafe` code, but the named exceptions (the
//! CUDA memory limiter; NVML's per-cgroup memory limits), each with its reason and lints of its
//! own.

use std::collections::BTreeSet;
use std::path::Path;

use crate::support::source_tree::{read, repo_path};

/// The modules a `mod.rs`-like file declares (`mod x;` / `pub mod x;`), `prefix`ed.
fn declared(text: &str, prefix: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let name = l.strip_prefix("mod ")?.strip_suffix(';')?;
            Some(format!("{prefix}{name}"))
        })
        .collect()
}

/// Every module of `tests/it`: top-level ones, the modules of directory modules as
/// `dir::name`, and `support` with its modules.
fn test_modules() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for module in declared(&read("tests/it/main.rs"), "") {
        let dir = repo_path(&format!("tests/it/{module}/mod.rs"));
        if dir.exists() {
            let text = std::fs::read_to_string(&dir).expect("mod.rs reads");
            out.extend(declared(&text, &format!("{module}::")));
        }
        out.insert(module);
    }
    out
}

/// The modules `tests/README.md` lists: the first cell of each table row, in backticks.
fn listed(readme: &str) -> BTreeSet<String> {
    readme
        .lines()
        .filter_map(|l| {
            let cell = l.strip_prefix("| `")?;
            Some(cell.split('`').next()?.to_string())
        })
        .collect()
}

#[test]
fn the_listing_reads_rows_and_declarations() {
    let readme = "| module | what |\n| --- | --- |\n| `a` | x |\n| `b::c` | y |\ntext `d`\n";
    assert_eq!(listed(readme), BTreeSet::from(["a".into(), "b::c".into()]));
    assert_eq!(
        declared("mod a;\npub mod b;\n// mod c;\nmod d {", "p::"),
        ["p::a", "p::b"]
    );
}

#[test]
fn tests_readme_lists_every_test_module() {
    let modules = test_modules();
    assert!(modules.contains("support::wait"), "{modules:?}");
    assert!(modules.contains("packaging::chart"), "{modules:?}");
    let readme = listed(&read("tests/README.md"));
    let missing: Vec<_> = modules.difference(&readme).collect();
    let gone: Vec<_> = readme.difference(&modules).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "tests/README.md must list every module of tests/it, one line each: missing {missing:?}; \
         listed but gone {gone:?}"
    );
}

/// `(path of a Cargo.toml, its text)` of the root package and every workspace member.
fn manifests() -> Vec<(String, toml::Table)> {
    let parse = |rel: &str| -> toml::Table {
        read(rel)
            .parse()
            .unwrap_or_else(|e| panic!("{rel} is not TOML: {e}"))
    };
    let root = parse("Cargo.toml");
    let members: Vec<String> = root["workspace"]["members"]
        .as_array()
        .expect("workspace.members")
        .iter()
        .map(|m| m.as_str().expect("a member path").to_string())
        .collect();
    let mut out = vec![("Cargo.toml".to_string(), root)];
    for member in members {
        let rel = Path::new(&member).join("Cargo.toml");
        let rel = rel.to_string_lossy().into_owned();
        let table = parse(&rel);
        out.push((rel, table));
    }
    out
}

/// A crate allowed `unsafe` code: why, and the lints it must deny instead (every `unsafe` block
/// says why it is sound, and what else its setting needs).
struct UnsafeException {
    manifest: &'static str,
    why: &'static str,
    denies: &'static [(&'static str, &'static str)],
}

/// The crates allowed `unsafe` code.
const UNSAFE_EXCEPTIONS: &[UnsafeException] = &[
    UnsafeException {
        manifest: "crates/limiter/Cargo.toml",
        why: "the CUDA memory limiter is a library the dynamic loader preloads into containers' \
              programs, made of C calls (dlsym, fcntl, mmap) and raw pointers handed over by the \
              driver API; a panic aborts the program it is loaded into",
        denies: &[
            ("rust", "unsafe_op_in_unsafe_fn"),
            ("rust", "missing_docs"),
            ("clippy", "undocumented_unsafe_blocks"),
            ("clippy", "unwrap_used"),
            ("clippy", "expect_used"),
            ("clippy", "panic"),
            ("clippy", "indexing_slicing"),
        ],
    },
    UnsafeException {
        manifest: "crates/nvml-limits/Cargo.toml",
        why: "NVML's per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1 / \
              GetMemoryLimits_v1) have no binding in nvml-wrapper: two C functions called \
              through symbols resolved at run time",
        denies: &[
            ("rust", "unsafe_op_in_unsafe_fn"),
            ("rust", "missing_docs"),
            ("clippy", "undocumented_unsafe_blocks"),
            ("clippy", "multiple_unsafe_ops_per_block"),
        ],
    },
];

#[test]
fn every_crate_forbids_unsafe_code_but_the_named_exceptions() {
    let all = manifests();
    assert!(all.len() >= 7, "the root and its six crates: {}", all.len());
    let root = &all[0].1;
    assert_eq!(
        root["workspace"]["lints"]["rust"]["unsafe_code"].as_str(),
        Some("forbid"),
        "[workspace.lints.rust] unsafe_code = \"forbid\" in Cargo.toml"
    );
    let mut excepted = 0;
    for (path, manifest) in &all {
        let lints = manifest.get("lints");
        let opted_in = lints
            .and_then(|l| l.get("workspace"))
            .and_then(toml::Value::as_bool);
        if let Some(exception) = UNSAFE_EXCEPTIONS.iter().find(|e| e.manifest == path) {
            excepted += 1;
            assert!(!exception.why.is_empty(), "{path}: the reason");
            assert_eq!(
                opted_in, None,
                "{path}: its own [lints], not the workspace's"
            );
            for (group, lint) in exception.denies {
                let level = lints
                    .and_then(|l| l.get(*group))
                    .and_then(|g| g.get(*lint))
                    .and_then(toml::Value::as_str);
                assert_eq!(
                    level,
                    Some("deny"),
                    "{path}: [lints.{group}] {lint} = \"deny\""
                );
            }
            continue;
        }
        assert_eq!(opted_in, Some(true), "{path}: [lints] workspace = true");
    }
    assert_eq!(
        excepted,
        UNSAFE_EXCEPTIONS.len(),
        "every exception is a workspace member"
    );
}
