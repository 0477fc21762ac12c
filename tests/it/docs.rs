//! The documentation in `docs/` against the binary it describes:
//! - `docs/cli.md` is the binary's own `--help` of every command, word for word
//!   (`GPUSHARE_UPDATE_GOLDEN=1 cargo test --test it docs::` rewrites it);
//! - every long flag of every command is named on a page written by hand, not only there;
//! - every configuration key of the compiled-in defaults is named on a page, and
//!   `docs/configuration.md` holds `packaging/gpushare.toml` (every key with its comment) as it is;
//! - the global options are grouped apart from each role's own in `--help`, and `--kubeconfig`
//!   names every place it looks.
//!
//! Links and anchors between the pages are MkDocs' to check (`make docs`, strict); this module
//! does not build the site.

use std::collections::BTreeSet;

use crate::support::doctor_node::doctor_no_cluster;
use crate::support::source_tree::{read, repo_path};
use crate::support::{run, stderr, stdout};

/// The generated page.
const CLI_PAGE: &str = "docs/cli.md";
/// Where the configuration reference holds the example file.
const CONFIG_PAGE: &str = "docs/configuration.md";
const CONFIG_FILE: &str = "packaging/gpushare.toml";

/// `gpushare <command> --help` (the top level for `None`).
fn help(command: Option<&str>) -> String {
    let mut args: Vec<&str> = command.into_iter().collect();
    args.push("--help");
    let out = run(&args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    stdout(&out)
}

/// The commands the top-level help lists, `help` left out.
fn commands() -> Vec<String> {
    let top = help(None);
    let listed: Vec<String> = top
        .split("Commands:\n")
        .nth(1)
        .expect("the help lists its commands")
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect();
    assert!(listed.len() >= 6, "too few commands in:\n{top}");
    listed
}

/// The page generated from the help of every command.
fn cli_page() -> String {
    let mut page = String::from(
        "# Command-line reference\n\n\
         Every command's `--help`, as the binary prints it. The pages of each role explain the \
         flags, and [Configuration](configuration.md) the keys and environment variables behind \
         them. This page is generated: `GPUSHARE_UPDATE_GOLDEN=1 cargo test --test it docs::` \
         rewrites it, and a test fails when it no longer matches the binary.\n",
    );
    let mut section = |title: &str, text: &str| {
        page.push_str(&format!(
            "\n## {title}\n\n```text\n{}\n```\n",
            text.trim_end()
        ));
    };
    section("gpushare", &help(None));
    for command in commands() {
        section(&format!("gpushare {command}"), &help(Some(&command)));
    }
    page
}

/// The pages written by hand: everything under docs/ but the generated page and the drafts.
fn hand_written_pages() -> String {
    let dir = repo_path("docs");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("docs/ exists")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md") && format!("docs/{n}") != CLI_PAGE)
        .collect();
    names.sort();
    names
        .iter()
        .map(|n| read(&format!("docs/{n}")))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Long flags of one help text (`--help` and `--version` left out).
fn long_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter_map(|l| {
            let l = match l.split_once(", ") {
                Some((short, rest)) if short.len() == 2 && short.starts_with('-') => rest,
                _ => l,
            };
            let name = l.strip_prefix("--")?;
            let name: String = name
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            (!name.is_empty()).then(|| format!("--{name}"))
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// Whether `text` names `flag` as a whole (`--mps` is not found in `--mps-control`).
fn names_flag(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        let next = text[at + flag.len()..].chars().next();
        !matches!(next, Some(c) if c.is_ascii_alphanumeric() || c == '-')
    })
}

#[test]
fn the_cli_reference_is_the_binarys_own_help() {
    let page = cli_page();
    if std::env::var_os("GPUSHARE_UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(repo_path(CLI_PAGE), &page).expect("write docs/cli.md");
    }
    assert!(
        read(CLI_PAGE) == page,
        "{CLI_PAGE} is stale: GPUSHARE_UPDATE_GOLDEN=1 cargo test --test it docs:: rewrites it"
    );
}

#[test]
fn every_flag_of_every_command_is_documented() {
    let pages = hand_written_pages();
    let mut missing = Vec::new();
    let mut counted = 0;
    for command in commands() {
        for flag in long_flags(&help(Some(&command))) {
            counted += 1;
            if !names_flag(&pages, &flag) {
                missing.push(format!("gpushare {command} {flag}"));
            }
        }
    }
    assert!(counted > 50, "only {counted} flags read from the help");
    assert!(
        missing.is_empty(),
        "flags no page of docs/ names (docs/cli.md aside):\n{}",
        missing.join("\n")
    );
}

/// `(section path, key)` of every key in a TOML table.
fn keys(prefix: &str, table: &toml::Table, out: &mut Vec<(String, String)>) {
    for (key, value) in table {
        match value {
            toml::Value::Table(inner) => {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                keys(&path, inner, out);
            }
            _ => out.push((prefix.to_string(), key.clone())),
        }
    }
}

#[test]
fn every_configuration_key_is_documented() {
    let defaults: toml::Table = gpushare::config::Config::defaults_toml()
        .parse()
        .expect("the defaults are TOML");
    let mut all = Vec::new();
    keys("", &defaults, &mut all);
    assert!(all.len() > 50, "only {} keys in the defaults", all.len());
    let pages = hand_written_pages();
    let missing: Vec<String> = all
        .iter()
        .filter(|(section, key)| {
            ![
                format!("`{section}.{key}`"),
                format!("[{section}] {key}"),
                format!("`{key}`"),
            ]
            .iter()
            .any(|form| pages.contains(form.as_str()))
        })
        .map(|(section, key)| format!("{section}.{key}"))
        .collect();
    assert!(
        missing.is_empty(),
        "configuration keys no page of docs/ names:\n{}",
        missing.join("\n")
    );
    // The reference holds the example file, every key with its default and comment, as the
    // page's last block (GPUSHARE_UPDATE_GOLDEN=1 copies the file in).
    let file = read(CONFIG_FILE);
    let block = format!("```toml\n{file}```\n");
    let page = read(CONFIG_PAGE);
    if std::env::var_os("GPUSHARE_UPDATE_GOLDEN").is_some_and(|v| v == "1")
        && let Some(at) = page.rfind("```toml\n")
    {
        let updated = format!("{}{block}", &page[..at]);
        std::fs::write(repo_path(CONFIG_PAGE), updated).expect("write the configuration page");
    }
    assert!(
        read(CONFIG_PAGE).ends_with(&block),
        "{CONFIG_PAGE} must end with {CONFIG_FILE} as it is, in a ```toml block \
         (GPUSHARE_UPDATE_GOLDEN=1 cargo test --test it docs:: copies it in)"
    );
}

#[test]
fn global_options_stand_apart_and_kubeconfig_names_where_it_looks() {
    for command in commands() {
        let text = help(Some(&command));
        let Some((own, global)) = text.split_once("Global options (every command):\n") else {
            if command == "version" {
                continue;
            }
            panic!("gpushare {command} --help has no global options heading:\n{text}");
        };
        for flag in ["--config", "--log-level", "--log-format", "--kubeconfig"] {
            assert!(
                names_flag(global, flag) && !names_flag(own, flag),
                "gpushare {command}: {flag} belongs under the global heading only:\n{text}"
            );
        }
        let kubeconfig = global
            .split("--kubeconfig")
            .nth(1)
            .expect("--kubeconfig is global");
        for place in [
            "[cluster] kubeconfig",
            "GPUSHARE_CLUSTER__KUBECONFIG",
            "$KUBECONFIG",
            "~/.kube/config",
            "in-cluster service account",
        ] {
            assert!(
                kubeconfig.contains(place),
                "gpushare {command}: --kubeconfig's help does not name {place}:\n{kubeconfig}"
            );
        }
    }
}

/// The README's tour shows what `gpushare demo` prints: every line of its transcript is in the
/// real output (a line shortened with `…` by its pieces), so the front page cannot drift
/// from the demo.
#[test]
fn the_readme_tour_is_what_the_demo_prints() {
    let readme = read("README.md");
    let tour = readme
        .split("## A 60-second tour")
        .nth(1)
        .and_then(|t| t.split("```text\n").nth(1))
        .and_then(|t| t.split("\n```").next())
        .expect("the README's tour has a ```text transcript");
    let out = run(&["demo"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let printed: String = stdout(&out)
        .lines()
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n");
    let mut checked = 0;
    for line in tour.lines().map(str::trim_end).filter(|l| !l.is_empty()) {
        // A line shortened with `…` (two lines in one, set apart by a run of spaces) keeps
        // its pieces, each found in the output; any other line is found whole.
        let pieces: Vec<&str> = if line.contains('…') {
            line.split('…')
                .flat_map(|p| p.split("   "))
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .collect()
        } else {
            vec![line]
        };
        for piece in pieces {
            assert!(
                printed.contains(piece),
                "the README's tour shows `{piece}`, which the demo does not print:\n{printed}"
            );
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} pieces of the tour checked");
}

/// User text speaks of the product, not of how it was made: no "this round", no issue or
/// section numbers of the project's own papers, upstream bugs named with their repository.
#[test]
fn user_docs_carry_no_process_wording() {
    let mut texts = vec![("README.md".to_string(), read("README.md"))];
    texts.push((CLI_PAGE.to_string(), read(CLI_PAGE)));
    texts.push(("docs/*.md".to_string(), hand_written_pages()));
    let banned = ["this round", "§", "EXT#", "DP#"];
    let mut found = Vec::new();
    for (name, text) in &texts {
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            let issue_number = lower.match_indices("issue ").any(|(at, word)| {
                lower[at + word.len()..]
                    .trim_start_matches('#')
                    .starts_with(|c: char| c.is_ascii_digit())
            });
            for word in banned
                .iter()
                .filter(|w| lower.contains(&w.to_lowercase()))
                .chain(issue_number.then_some(&"issue <number>"))
            {
                found.push(format!("{name}:{}: `{word}` in {line}", n + 1));
            }
        }
    }
    assert!(found.is_empty(), "process wording:\n{}", found.join("\n"));
}

/// `docs/doctor.md` has a row for every check `gpushare doctor` can report (check ids are
/// stable: scripts depend on them), read from the binary's own JSON with every optional
/// check turned on.
#[test]
fn every_doctor_check_has_a_row() {
    let page = read("docs/doctor.md");
    let mut ids = BTreeSet::new();
    let base = [
        "--gpu-backend",
        "fake",
        "--fake-gpus",
        "1x16GiB",
        "-o",
        "json",
    ];
    let extra: [&[&str]; 4] = [
        &[],
        &["--mps", "--device-list-strategy", "cdi-cri"],
        &["--rdma"],
        &["--dra"],
    ];
    for more in extra {
        let args: Vec<&str> = base.iter().chain(more).copied().collect();
        let out = doctor_no_cluster("all", &args);
        let report: serde_json::Value =
            serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        for check in report["checks"].as_array().expect("checks") {
            ids.insert(check["id"].as_str().expect("an id").to_string());
        }
    }
    assert!(ids.len() > 20, "only {ids:?}");
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| !page.contains(&format!("| `{id}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "checks without a row in docs/doctor.md: {missing:?}"
    );
}

/// The README's first command shows the build it waits for: `make demo` builds with cargo's
/// progress (not `--quiet`) before it runs the demo.
#[test]
fn make_demo_shows_the_build_before_the_demo() {
    let out = std::process::Command::new("make")
        .args(["-n", "demo"])
        .current_dir(repo_path(""))
        .output();
    let Ok(out) = out else {
        crate::support::clients::skip("no make(1)");
        return;
    };
    let plan = String::from_utf8_lossy(&out.stdout).into_owned();
    let build = plan
        .lines()
        .position(|l| l.contains("cargo build") && !l.contains("--quiet"));
    let demo = plan.lines().position(|l| l.trim_end().ends_with(" demo"));
    assert!(
        matches!((build, demo), (Some(b), Some(d)) if b < d),
        "make demo must build visibly, then run the demo:\n{plan}"
    );
}

/// The metric names the source registers (`register("gpushare_…", …)` outside tests).
fn registered_metrics() -> BTreeSet<String> {
    let pattern = regex::Regex::new(r#"register\(\s*"(gpushare_[a-z_]+)""#).expect("regex");
    let mut names = BTreeSet::new();
    let mut dirs = vec![repo_path("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ is readable").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                // Unit tests register metrics of their own: read up to the test module only.
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                names.extend(pattern.captures_iter(code).map(|c| c[1].to_string()));
            }
        }
    }
    names
}

/// Every metric a role exposes has a line on its role's page (names as registered: a
/// counter's `_total`, an info's `_info` follow them on the page).
#[test]
fn every_metric_is_documented() {
    let names = registered_metrics();
    assert!(names.len() > 25, "only {names:?}");
    let pages = hand_written_pages();
    let missing: Vec<&String> = names
        .iter()
        .filter(|name| !pages.contains(&format!("`{name}")))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics no page of docs/ names: {missing:?}"
    );
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The README is read outside the site (on the forge, in the release archives): every link it
/// has into the repository names a file that exists and, with `#anchor`, a heading of it.
#[test]
fn the_readme_links_reach_their_pages_and_headings() {
    let readme = read("README.md");
    let link = regex::Regex::new(r"\]\(([^)\s]+)\)").expect("regex");
    let mut checked = 0;
    for target in link.captures_iter(&readme).map(|c| c[1].to_string()) {
        if target.starts_with("http://") || target.starts_with("https://") {
            continue;
        }
        let (file, anchor) = match target.split_once('#') {
            Some((file, anchor)) => (file.to_string(), Some(anchor.to_string())),
            None => (target.clone(), None),
        };
        assert!(
            repo_path(&file).exists(),
            "README links to {target}: no such file"
        );
        if let Some(anchor) = anchor {
            let text = read(&file);
            let anchors: Vec<String> = text
                .lines()
                .filter(|l| l.starts_with('#'))
                .map(|l| github_anchor(l.trim_start_matches('#')))
                .collect();
            assert!(
                anchors.contains(&anchor),
                "README links to {target}: {file} has no heading #{anchor}"
            );
        }
        checked += 1;
    }
    assert!(checked > 15, "only {checked} links checked");
}
