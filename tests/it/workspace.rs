//! The repository's own rules, checked: `tests/README.md` lists every module of this test
//! binary and of its `support` (and no module that is gone), and every crate of the workspace
//! opts into the workspace lints, which forbid `unsafe` code — but for the exceptions named in
//! [`UNSAFE_EXCEPTIONS`], each with its reason and a lint policy of its own that keeps every
//! `unsafe` block to one operation with its reason written next to it.

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

/// The crates that may write `unsafe`, and why.
const UNSAFE_EXCEPTIONS: &[(&str, &str)] = &[(
    "crates/nvml-limits/Cargo.toml",
    "NVML's per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1 / GetMemoryLimits_v1) have \
     no binding in nvml-wrapper: two C functions called through symbols resolved at run time",
)];

#[test]
fn every_crate_forbids_unsafe_code() {
    let all = manifests();
    assert!(
        all.len() >= 5,
        "the root and its four crates: {}",
        all.len()
    );
    let root = &all[0].1;
    assert_eq!(
        root["workspace"]["lints"]["rust"]["unsafe_code"].as_str(),
        Some("forbid"),
        "[workspace.lints.rust] unsafe_code = \"forbid\" in Cargo.toml"
    );
    for (path, manifest) in &all {
        let lints = manifest.get("lints");
        if let Some((_, why)) = UNSAFE_EXCEPTIONS.iter().find(|(p, _)| p == path) {
            assert!(!why.is_empty());
            let rule = |group: &str, lint: &str| {
                lints
                    .and_then(|l| l.get(group))
                    .and_then(|g| g.get(lint))
                    .and_then(toml::Value::as_str)
            };
            for (group, lint) in [
                ("rust", "unsafe_op_in_unsafe_fn"),
                ("clippy", "undocumented_unsafe_blocks"),
                ("clippy", "multiple_unsafe_ops_per_block"),
            ] {
                assert_eq!(
                    rule(group, lint),
                    Some("deny"),
                    "{path}: the unsafe exception keeps [lints.{group}] {lint} = \"deny\""
                );
            }
            continue;
        }
        let opted_in = lints
            .and_then(|l| l.get("workspace"))
            .and_then(toml::Value::as_bool);
        assert_eq!(opted_in, Some(true), "{path}: [lints] workspace = true");
    }
}
