//! The house rules over the repository (`make layers`), and the checker over small fixture
//! trees: each violation the rules exist for, written the ways that slipped past the former
//! line-based reader, makes a finding; the same tree without it makes none.

use std::path::{Path, PathBuf};

use gpushare_house::{Finding, Rule, SourceTree, check_links, check_sources, read_repository};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn report(findings: &[Finding]) -> String {
    findings
        .iter()
        .map(|f| format!("  {f}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_repository_keeps_the_house_rules() {
    let tree = read_repository(&repository()).expect("the repository reads");
    assert!(
        tree.rust_files_under(Path::new("src")).count() > 100,
        "found the sources"
    );
    let findings = check_sources(&tree);
    assert!(
        findings.is_empty(),
        "{} house rules broken (docs/development.md, \"Rules that a build checks\"):\n{}",
        findings.len(),
        report(&findings)
    );
}

#[test]
fn the_crates_link_what_the_house_allows() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let findings = check_links(&cargo, &repository());
    assert!(findings.is_empty(), "{}", report(&findings));
}

/// A small house: three infrastructure modules as directories and one as a file with a
/// directory beside it (as `config` is), two roles, the dispatcher, the binary.
const BASE: &[(&str, &str)] = &[
    (
        "src/lib.rs",
        "//! A house.\npub mod cli;\npub mod config;\npub mod deviceplugin;\npub mod devices;\n\
         pub mod extender;\npub mod gpu;\npub mod k8s;\npub mod rdma;\n",
    ),
    ("src/main.rs", "fn main() { gpushare::cli::run(); }"),
    (
        "src/cli.rs",
        "use crate::{deviceplugin, extender};\npub fn run() { extender::run(); deviceplugin::run(); }",
    ),
    (
        "src/config.rs",
        "mod sections;\npub use sections::Section;\npub struct Config;",
    ),
    ("src/config/sections.rs", "pub struct Section;"),
    (
        "src/k8s/mod.rs",
        "pub mod events;\npub mod retry;\nuse crate::config::Config;\npub fn client(_: &Config) {}",
    ),
    (
        "src/k8s/retry.rs",
        "pub fn retry() {}\n#[cfg(test)]\nmod tests {\n    use super::retry;\n}",
    ),
    (
        "src/k8s/events.rs",
        "use super::retry::retry;\npub struct Events;\npub fn emit() { retry() }",
    ),
    (
        "src/gpu/mod.rs",
        "pub mod backend;\npub mod fake;\npub use backend::Inventory;\n\
         pub fn open() -> Inventory { fake::inventory() }",
    ),
    ("src/gpu/backend.rs", "pub struct Inventory;"),
    (
        "src/gpu/fake.rs",
        "use super::Inventory;\npub fn inventory() -> Inventory { Inventory }",
    ),
    ("src/rdma/mod.rs", "pub mod discover;\npub mod place;"),
    ("src/rdma/discover.rs", "pub struct Hca;"),
    (
        "src/rdma/place.rs",
        "use super::discover::Hca;\npub fn nearest(_: &Hca) {}",
    ),
    ("src/devices/mod.rs", "pub mod generic;\npub mod handover;"),
    (
        "src/devices/generic.rs",
        "use crate::k8s;\npub struct Device;\npub fn list() { k8s::events::emit() }",
    ),
    (
        "src/devices/handover.rs",
        "use super::generic::Device;\npub fn hand(_: Device) {}",
    ),
    (
        "src/extender/mod.rs",
        "pub mod bind;\npub mod state;\nuse crate::k8s::events::Events;\n\
         pub fn run() { bind::bind(&state::State) }\n\
         #[cfg(test)]\nmod tests {\n    use super::*;\n    use gpushare_sandbox::apiserver::ApiServer;\n}",
    ),
    ("src/extender/state.rs", "pub struct State;"),
    (
        "src/extender/bind.rs",
        "use super::state::State;\npub fn bind(_: &State) { crate::gpu::fake::inventory(); }",
    ),
    (
        "src/deviceplugin/mod.rs",
        "pub mod allocate;\npub fn run() { allocate::allocate() }",
    ),
    (
        "src/deviceplugin/allocate.rs",
        "use crate::devices::handover;\npub fn allocate() {}",
    ),
    (
        "tests/it/main.rs",
        "mod support;\nmod extender;\nmod packaging;",
    ),
    (
        "tests/it/support/mod.rs",
        "pub mod cluster;\npub fn run() {}",
    ),
    ("tests/it/support/cluster.rs", "use super::run;"),
    ("tests/it/extender.rs", "use crate::support::cluster;"),
    ("tests/it/packaging/mod.rs", "mod chart;\nmod kubeadm;"),
    ("tests/it/packaging/chart.rs", "pub fn render() {}"),
    (
        "tests/it/packaging/kubeadm.rs",
        "use super::super::support::run;",
    ),
];

/// The base house with `changes` written over it (a file is replaced whole).
fn house(changes: &[(&str, &str)]) -> SourceTree {
    let mut files: Vec<(&str, &str)> = BASE
        .iter()
        .filter(|(path, _)| !changes.iter().any(|(p, _)| p == path))
        .copied()
        .collect();
    files.extend(changes.iter().copied());
    SourceTree::from_files(files)
}

/// The findings of `tree`, but the front door's (the fixture has no docs or `Command` enum).
fn findings(tree: &SourceTree) -> Vec<Finding> {
    check_sources(tree)
        .into_iter()
        .filter(|f| f.rule != Rule::FrontDoor)
        .collect()
}

/// The only finding of `tree`, which must break `rule`.
fn only_finding(tree: &SourceTree, rule: Rule) -> Finding {
    let found = findings(tree);
    assert_eq!(found.len(), 1, "one finding expected:\n{}", report(&found));
    assert_eq!(found[0].rule, rule, "{}", found[0]);
    found[0].clone()
}

#[test]
fn a_function_over_the_size_limit_is_refused() {
    let body = "    let _x = 0;\n".repeat(gpushare_house::size::MAX_FN_LINES);
    let long = format!(
        "use super::state::State;\npub fn place(_: &State) {{\n{body}}}\npub fn bind(s: &State) {{ place(s) }}\n"
    );
    let found = only_finding(&house(&[("src/extender/bind.rs", &long)]), Rule::Size);
    assert_eq!(found.at, "src/extender/bind.rs:2", "{found}");
    let short = "    let _x = 0;\n".repeat(gpushare_house::size::MAX_FN_LINES - 2);
    let fits = format!("use super::state::State;\npub fn bind(_: &State) {{\n{short}}}\n");
    let found = findings(&house(&[("src/extender/bind.rs", &fits)]));
    assert!(found.is_empty(), "{}", report(&found));
}

#[test]
fn the_base_house_keeps_every_rule() {
    let found = findings(&house(&[]));
    assert!(found.is_empty(), "{}", report(&found));
}

#[test]
fn an_import_on_a_line_with_a_string_holding_slashes_is_read() {
    // Mutation (a): the line-based reader cut the line at the `//` inside the string.
    let tree = house(&[(
        "src/extender/state.rs",
        "const DOCS: &str = \"https://gpushare.io/docs\"; use crate::deviceplugin::allocate;\n\
         pub struct State;",
    )]);
    let finding = only_finding(&tree, Rule::Layers);
    assert!(
        finding
            .message
            .starts_with("extender -> deviceplugin: roles never import each other"),
        "{finding}"
    );
    assert!(finding.at.contains("src/extender/state.rs:1"), "{finding}");
}

#[test]
fn product_code_after_the_first_test_module_is_product_code() {
    // Mutation (b): everything after a file's first `#[cfg(test)]` was read as test code.
    for import in [
        "use super::deviceplugin::allocate;",
        "use crate::deviceplugin::allocate;",
        "pub fn f() { crate::deviceplugin::run() }",
        "pub fn f() { tracing::info!(\"{:?}\", crate::deviceplugin::run()) }",
    ] {
        let text = format!(
            "pub mod bind;\npub mod state;\npub fn run() {{ bind::bind(&state::State) }}\n\
             #[cfg(test)]\nmod tests {{\n    use super::*;\n}}\n{import}\n"
        );
        let tree = house(&[("src/extender/mod.rs", &text)]);
        let finding = only_finding(&tree, Rule::Layers);
        assert!(
            finding
                .message
                .starts_with("extender -> deviceplugin: roles never import each other"),
            "{import}: {finding}"
        );
        assert!(
            finding.at.contains("src/extender/mod.rs:8"),
            "{import}: {finding}"
        );
    }
    // And the sandbox after the test module, in product code.
    let tree = house(&[(
        "src/k8s/events.rs",
        "use super::retry::retry;\npub struct Events;\npub fn emit() { retry() }\n\
         #[cfg(test)]\nfn helper() { gpushare_sandbox::apiserver::start(); }\n\
         pub fn later() { gpushare_sandbox::apiserver::start(); }",
    )]);
    let finding = only_finding(&tree, Rule::Layers);
    assert!(
        finding
            .message
            .contains("k8s -> gpushare_sandbox: the sandbox is for `demo` and test code only"),
        "{finding}"
    );
    assert!(finding.at.contains("src/k8s/events.rs:6"), "{finding}");
}

#[test]
fn a_cycle_inside_an_infrastructure_module_is_refused() {
    // Mutation (c): the rule covered the roles and `node` only.
    type File = (&'static str, &'static str);
    let cases: &[(&str, File, File)] = &[
        (
            "k8s",
            (
                "src/k8s/retry.rs",
                "use super::events::Events;\npub fn retry() -> Option<Events> { None }",
            ),
            (
                "src/k8s/events.rs",
                "use super::retry::retry;\npub struct Events;\npub fn emit() { retry(); }",
            ),
        ),
        (
            "gpu",
            (
                "src/gpu/backend.rs",
                "pub struct Inventory;\npub fn probe() { super::fake::inventory(); }",
            ),
            (
                "src/gpu/fake.rs",
                "use super::Inventory;\npub fn inventory() -> Inventory { Inventory }",
            ),
        ),
        (
            "config",
            (
                "src/config.rs",
                "mod sections;\npub use sections::Section;\npub struct Config(Section);",
            ),
            (
                "src/config/sections.rs",
                "pub struct Section(Box<super::Config>);",
            ),
        ),
        (
            "devices",
            (
                "src/devices/generic.rs",
                "use crate::k8s;\npub struct Device;\npub fn list() { k8s::events::emit(); super::handover::hand(Device) }",
            ),
            (
                "src/devices/handover.rs",
                "use super::generic::Device;\npub fn hand(_: Device) {}",
            ),
        ),
        (
            "rdma",
            (
                "src/rdma/discover.rs",
                "pub struct Hca;\npub fn near() { super::place::nearest(&Hca) }",
            ),
            (
                "src/rdma/place.rs",
                "use super::discover::Hca;\npub fn nearest(_: &Hca) {}",
            ),
        ),
    ];
    for (module, one, other) in cases {
        let tree = house(&[*one, *other]);
        let finding = only_finding(&tree, Rule::Cycles);
        assert!(
            finding.at.contains(one.0) && finding.at.contains(other.0),
            "{module}: {finding}"
        );
        assert!(
            finding
                .message
                .contains("an import cycle between files of src/"),
            "{finding}"
        );
    }
}

#[test]
fn a_re_export_sends_its_users_to_the_file_that_defines_the_item() {
    // `super::Inventory` in fake.rs is backend.rs's (gpu/mod.rs only re-exports it), so the
    // base house has no cycle; a type defined in gpu/mod.rs itself closes one.
    let tree = house(&[(
        "src/gpu/mod.rs",
        "pub mod backend;\npub mod fake;\npub struct Inventory;\n\
         pub fn open() -> Inventory { fake::inventory() }",
    )]);
    let finding = only_finding(&tree, Rule::Cycles);
    assert!(
        finding.at.contains("src/gpu/fake.rs, src/gpu/mod.rs"),
        "{finding}"
    );
    assert!(
        finding
            .message
            .contains("src/gpu/fake.rs -> src/gpu/mod.rs: line 1 names super::Inventory"),
        "{finding}"
    );
}

#[test]
fn the_infrastructure_is_ordered_and_roles_stay_apart() {
    let tree = house(&[(
        "src/k8s/retry.rs",
        "pub fn retry() { crate::gpu::fake::inventory(); }",
    )]);
    let finding = only_finding(&tree, Rule::Layers);
    assert!(
        finding
            .message
            .starts_with("k8s -> gpu: the infrastructure is ordered"),
        "{finding}"
    );
    // A path that names a child module alone (`allocate::x` in `deviceplugin/mod.rs` is
    // `crate::deviceplugin::allocate`): the role may not reach the other one through it.
    let tree = house(&[(
        "src/deviceplugin/allocate.rs",
        "use crate::extender as scheduler;\npub fn allocate() { scheduler::run() }",
    )]);
    let finding = only_finding(&tree, Rule::Layers);
    assert!(
        finding.message.starts_with("deviceplugin -> extender"),
        "{finding}"
    );
}

#[test]
fn a_cycle_between_top_level_modules_is_refused() {
    // Both directions allowed for the composer `cli`; the role using it closes a cycle.
    let tree = house(&[(
        "src/deviceplugin/allocate.rs",
        "pub fn allocate() { crate::cli::run() }",
    )]);
    let found = findings(&tree);
    assert!(
        found
            .iter()
            .any(|f| f.rule == Rule::Layers && f.message.starts_with("deviceplugin -> cli")),
        "{}",
        report(&found)
    );
    assert!(
        found
            .iter()
            .any(|f| f.rule == Rule::Layers && f.message.contains("between top-level modules")),
        "{}",
        report(&found)
    );
}

#[test]
fn modules_are_laid_out_as_rustc_does() {
    // A file no `mod` declares is read by no rule: it is a finding of its own.
    let tree = house(&[("src/extender/orphan.rs", "use crate::deviceplugin::run;")]);
    let finding = only_finding(&tree, Rule::Modules);
    assert_eq!(finding.at, "src/extender/orphan.rs");
    // A declaration without its file.
    let tree = house(&[(
        "src/rdma/mod.rs",
        "pub mod discover;\npub mod place;\nmod gone;",
    )]);
    let finding = only_finding(&tree, Rule::Modules);
    assert!(
        finding
            .message
            .contains("src/rdma/gone.rs or src/rdma/gone/mod.rs"),
        "{finding}"
    );
    // `#[path]` is followed: the file it names is read (and here breaks a rule).
    let tree = house(&[
        (
            "src/rdma/mod.rs",
            "pub mod discover;\npub mod place;\n#[path = \"../shared/sysfs.rs\"]\nmod sysfs;",
        ),
        ("src/shared/sysfs.rs", "use crate::extender::run;"),
    ]);
    let finding = only_finding(&tree, Rule::Layers);
    assert!(finding.at.contains("src/shared/sysfs.rs:1"), "{finding}");
    // A top-level module the table does not place.
    let lib = BASE[0].1.to_string() + "pub mod helpers;\n";
    let tree = house(&[("src/lib.rs", &lib), ("src/helpers.rs", "")]);
    let finding = only_finding(&tree, Rule::Modules);
    assert!(
        finding.message.contains("`helpers` has no place"),
        "{finding}"
    );
}

#[test]
fn async_code_reads_the_gpus_off_the_runtime() {
    let tree = house(&[(
        "src/extender/state.rs",
        "pub struct State;\nfn f(b: &dyn X) { let _ = b.inventory(); }\nuse crate::gpu;\nfn g() { gpu::open(); }",
    )]);
    let found = findings(&tree);
    let lines: Vec<&str> = found
        .iter()
        .filter(|f| f.rule == Rule::GpuOffRuntime)
        .map(|f| f.at.as_str())
        .collect();
    assert_eq!(
        lines,
        ["src/extender/state.rs:2", "src/extender/state.rs:4"],
        "{}",
        report(&found)
    );
}

#[test]
fn errors_are_typed() {
    let tree = house(&[
        (
            "src/rdma/discover.rs",
            "pub struct Hca;\npub fn read() -> Result<Hca, String> { todo!() }\n\
             pub fn fine() -> Result<Vec<String>, std::io::Error> { todo!() }\n\
             pub fn also_fine() -> anyhow::Result<String> { todo!() }\n\
             macro_rules! m { () => { fn x() -> Result<(), std::string::String> { Ok(()) } } }",
        ),
        (
            "crates/core/src/lib.rs",
            "pub fn parse() -> Result<u8, String> { Ok(1) }",
        ),
    ]);
    let found = findings(&tree);
    let at: Vec<&str> = found.iter().map(|f| f.at.as_str()).collect();
    assert_eq!(
        at,
        [
            "crates/core/src/lib.rs:1",
            "src/rdma/discover.rs:2",
            "src/rdma/discover.rs:5"
        ],
        "{}",
        report(&found)
    );
    assert!(found.iter().all(|f| f.rule == Rule::TypedErrors));
}

#[test]
fn test_modules_share_through_support_only() {
    for (file, text) in [
        ("tests/it/extender.rs", "use crate::packaging::chart;"),
        (
            "tests/it/extender.rs",
            "fn t() { super::packaging::chart::render() }",
        ),
        ("tests/it/packaging/kubeadm.rs", "use super::chart::render;"),
        ("tests/it/support/cluster.rs", "use crate::extender;"),
    ] {
        let tree = house(&[(file, text)]);
        let finding = only_finding(&tree, Rule::TestImports);
        assert_eq!(finding.at, file, "{finding}");
    }
}

#[test]
fn the_front_door_follows_the_subcommands() {
    let places = [
        "src/cli.rs",
        "src/lib.rs",
        "docs/development.md",
        "Cargo.toml",
    ];
    let tree = SourceTree::read(&repository(), &[], &places).expect("the repository reads");
    let front = |tree: &SourceTree| -> Vec<Finding> {
        check_sources(tree)
            .into_iter()
            .filter(|f| f.rule == Rule::FrontDoor)
            .collect()
    };
    assert!(front(&tree).is_empty(), "{}", report(&front(&tree)));
    // A new subcommand, of a new role module: every list is now behind.
    let cli = tree
        .get(Path::new("src/cli.rs"))
        .expect("src/cli.rs")
        .replace(
            "    Inspect(inspect::Args),",
            "    Inspect(inspect::Args),\n    /// Balance.\n    Rebalance(rebalance::Args),",
        );
    let mut files: Vec<(String, String)> = ["src/lib.rs", "docs/development.md", "Cargo.toml"]
        .iter()
        .map(|p| (p.to_string(), tree.get(Path::new(p)).expect(p).to_string()))
        .collect();
    files.push(("src/cli.rs".into(), cli));
    let changed = SourceTree::from_files(files.iter().map(|(p, t)| (p.as_str(), t.as_str())));
    let found = front(&changed);
    let at: Vec<&str> = found.iter().map(|f| f.at.as_str()).collect();
    for place in [
        "src/cli.rs",
        "src/cli.rs (the --help headline, `struct Cli`'s doc comment)",
        "Cargo.toml (description)",
        "src/lib.rs (the roles)",
        "docs/development.md (the map's roles row)",
    ] {
        assert!(
            at.contains(&place),
            "{place} not found:\n{}",
            report(&found)
        );
    }
}
