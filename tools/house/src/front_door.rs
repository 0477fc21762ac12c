//! The front door in step with the subcommands: the roles are the modules the `Command` enum
//! of `src/cli.rs` runs (read with syn: each variant's argument type names its module; the
//! composers `cli` and `demo` aside), and every place that lists them says the same:
//!
//! - the house's own table ([`ROLES`], [`INFRA`]);
//! - `src/lib.rs`'s crate documentation: its bullet of the roles names each role module and
//!   each role's subcommand, its bullet of the infrastructure names each infrastructure
//!   module, and a count of roles ("seven roles") anywhere in it is the count;
//! - docs/development.md's map: the roles row names each role and its subcommand, the
//!   infrastructure row lists [`INFRA`] in its order;
//! - the `--help` headline (the doc comment of `Cli`) and the package description in
//!   `Cargo.toml` name every role's subcommand in words (`device-plugin`: "device plugin").

use std::collections::BTreeSet;
use std::path::Path;

use syn::{Expr, ExprLit, Fields, Item, Lit, Meta, Type};

use crate::rules::{COMPOSERS, INFRA, ROLES};
use crate::source::SourceTree;
use crate::{Finding, Rule};

/// A subcommand of `Command`: its name on the command line and the module it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subcommand {
    pub name: String,
    pub module: Option<String>,
}

/// `DevicePlugin` → `device-plugin` (clap's name for a variant).
fn kebab(variant: &str) -> String {
    let mut out = String::new();
    for (i, c) in variant.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('-');
        }
        out.extend(c.to_lowercase());
    }
    out
}

/// The text of the `#[doc]` attributes.
fn doc_lines(attrs: &[syn::Attribute]) -> Vec<String> {
    attrs
        .iter()
        .filter_map(|a| match &a.meta {
            Meta::NameValue(nv) if nv.path.is_ident("doc") => match &nv.value {
                Expr::Lit(ExprLit {
                    lit: Lit::Str(s), ..
                }) => Some(s.value().trim().to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// The subcommands of `enum Command` in `cli` and the `--help` headline (the first line of
/// `struct Cli`'s documentation).
pub fn read_cli(cli: &str) -> syn::Result<(Vec<Subcommand>, Option<String>)> {
    let file = syn::parse_file(cli)?;
    let mut subcommands = Vec::new();
    let mut headline = None;
    for item in &file.items {
        match item {
            Item::Enum(e) if e.ident == "Command" => {
                for variant in &e.variants {
                    let module = match &variant.fields {
                        Fields::Unnamed(fields) => {
                            fields.unnamed.first().and_then(|f| match &f.ty {
                                Type::Path(p) if p.path.segments.len() > 1 => {
                                    p.path.segments.first().map(|s| s.ident.to_string())
                                }
                                _ => None,
                            })
                        }
                        _ => None,
                    };
                    subcommands.push(Subcommand {
                        name: kebab(&variant.ident.to_string()),
                        module,
                    });
                }
            }
            Item::Struct(s) if s.ident == "Cli" => {
                // The first paragraph, its lines joined as clap joins them.
                let paragraph: Vec<String> = doc_lines(&s.attrs)
                    .into_iter()
                    .skip_while(String::is_empty)
                    .take_while(|l| !l.is_empty())
                    .collect();
                headline = (!paragraph.is_empty()).then(|| paragraph.join(" "));
            }
            _ => {}
        }
    }
    Ok((subcommands, headline))
}

/// The names in backticks in `text` that stand outside parentheses.
fn ticked_outside_parens(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut depth = 0usize;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            '`' => {
                let Some(end) = rest[1..].find('`') else {
                    break;
                };
                if depth == 0 {
                    names.push(rest[1..=end].to_string());
                }
                rest = &rest[end + 2..];
                continue;
            }
            _ => {}
        }
        rest = &rest[c.len_utf8()..];
    }
    names
}

const NUMBERS: &[&str] = &[
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
];

/// Every "<number word> roles" in `text` that is not the number of roles.
fn wrong_counts(text: &str) -> Vec<String> {
    let words: Vec<String> = text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    words
        .windows(2)
        .filter(|w| w[1] == "roles")
        .filter_map(|w| {
            let n = NUMBERS.iter().position(|n| *n == w[0])?;
            (n != ROLES.len()).then(|| format!("{} roles", w[0]))
        })
        .collect()
}

/// The front-door rules over the tree.
pub fn check(tree: &SourceTree, out: &mut Vec<Finding>) {
    let mut finding = |at: &str, message: String| {
        out.push(Finding::new(Rule::FrontDoor, at.to_string(), message));
    };
    let read = |path: &str| tree.get(Path::new(path));
    let Some(cli) = read("src/cli.rs") else {
        finding(
            "src/cli.rs",
            "missing: the subcommands are read from it".into(),
        );
        return;
    };
    let (subcommands, headline) = match read_cli(cli) {
        Ok(read) => read,
        Err(e) => {
            finding("src/cli.rs", format!("does not parse: {e}"));
            return;
        }
    };
    let roles: Vec<&Subcommand> = subcommands
        .iter()
        .filter(|s| s.module.as_deref().is_some_and(|m| !COMPOSERS.contains(&m)))
        .collect();
    let role_modules: BTreeSet<&str> = roles.iter().filter_map(|s| s.module.as_deref()).collect();
    let table: BTreeSet<&str> = ROLES.iter().copied().collect();
    if role_modules != table {
        finding(
            "src/cli.rs",
            format!(
                "the subcommands run the modules {role_modules:?}; the house's ROLES are \
                 {table:?} (tools/house/src/rules.rs)"
            ),
        );
    }
    let role_names: Vec<&str> = roles.iter().map(|s| s.name.as_str()).collect();
    let in_words = |text: &str| -> Vec<&str> {
        let lower = text.to_lowercase();
        role_names
            .iter()
            .copied()
            .filter(|name| !lower.contains(&name.replace('-', " ")))
            .collect()
    };

    // The --help headline.
    match &headline {
        None => finding(
            "src/cli.rs",
            "`struct Cli` has no doc comment (the --help headline)".into(),
        ),
        Some(line) => {
            let missing = in_words(line);
            if !missing.is_empty() {
                finding(
                    "src/cli.rs (the --help headline, `struct Cli`'s doc comment)",
                    format!("\"{line}\" does not name the subcommands {missing:?}"),
                );
            }
            for count in wrong_counts(line) {
                finding(
                    "src/cli.rs",
                    format!(
                        "the --help headline says \"{count}\"; there are {}",
                        ROLES.len()
                    ),
                );
            }
        }
    }

    // The package description.
    if let Some(manifest) = read("Cargo.toml") {
        let description = manifest
            .lines()
            .find_map(|l| l.strip_prefix("description = \""))
            .map(|d| d.trim_end_matches('"'));
        match description {
            None => finding("Cargo.toml", "the package has no description".into()),
            Some(d) => {
                let missing = in_words(d);
                if !missing.is_empty() {
                    finding(
                        "Cargo.toml (description)",
                        format!("\"{d}\" does not name the subcommands {missing:?}"),
                    );
                }
                for count in wrong_counts(d) {
                    finding(
                        "Cargo.toml (description)",
                        format!("says \"{count}\"; there are {}", ROLES.len()),
                    );
                }
            }
        }
    }

    // lib.rs's crate documentation.
    if let Some(lib) = read("src/lib.rs") {
        let doc: Vec<&str> = lib
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .map(str::trim)
            .collect();
        let bullet = |start: &str| -> Option<String> {
            let at = doc.iter().position(|l| l.starts_with(start))?;
            let mut text = doc[at].to_string();
            for line in &doc[at + 1..] {
                if line.starts_with("- ") || line.is_empty() {
                    break;
                }
                text.push(' ');
                text.push_str(line);
            }
            Some(text)
        };
        let links = |text: &str| -> BTreeSet<String> {
            text.split("[`")
                .skip(1)
                .filter_map(|s| s.split_once("`]").map(|(name, _)| name.to_string()))
                .collect()
        };
        match bullet("- the roles") {
            None => finding(
                "src/lib.rs",
                "the crate documentation has no bullet \"- the roles…\"".into(),
            ),
            Some(text) => {
                let listed = links(&text);
                let want: BTreeSet<String> = ROLES.iter().map(|r| r.to_string()).collect();
                if listed != want {
                    finding(
                        "src/lib.rs (the roles)",
                        format!("lists {listed:?}; the roles are {want:?}"),
                    );
                }
                let unnamed: Vec<&str> = role_names
                    .iter()
                    .copied()
                    .filter(|n| !text.contains(&format!("`{n}`")))
                    .collect();
                if !unnamed.is_empty() {
                    finding(
                        "src/lib.rs (the roles)",
                        format!("does not name the subcommands {unnamed:?} (in backticks)"),
                    );
                }
            }
        }
        match bullet("- infrastructure") {
            None => finding(
                "src/lib.rs",
                "the crate documentation has no bullet \"- infrastructure…\"".into(),
            ),
            Some(text) => {
                let listed = links(&text);
                let want: BTreeSet<String> = INFRA.iter().map(|r| r.to_string()).collect();
                if listed != want {
                    let missing: Vec<&String> = want.difference(&listed).collect();
                    let extra: Vec<&String> = listed.difference(&want).collect();
                    finding(
                        "src/lib.rs (the infrastructure)",
                        format!("misses {missing:?}, lists {extra:?} beyond INFRA"),
                    );
                }
            }
        }
        for count in wrong_counts(&doc.join(" ")) {
            finding(
                "src/lib.rs",
                format!("says \"{count}\"; there are {}", ROLES.len()),
            );
        }
    }

    // docs/development.md's map.
    if let Some(dev) = read("docs/development.md") {
        let row = |start: &str| dev.lines().find(|l| l.starts_with(start));
        match row("| `src/` roles:") {
            None => finding(
                "docs/development.md",
                "the map has no row \"| `src/` roles: …\"".into(),
            ),
            Some(line) => {
                let first = line.split('|').nth(1).unwrap_or_default();
                let listed: BTreeSet<String> = ticked_outside_parens(first)
                    .into_iter()
                    .filter(|n| n != "src/")
                    .collect();
                let want: BTreeSet<String> = ROLES.iter().map(|r| r.to_string()).collect();
                if listed != want {
                    finding(
                        "docs/development.md (the map's roles row)",
                        format!("lists {listed:?}; the roles are {want:?}"),
                    );
                }
                let unnamed: Vec<&str> = role_names
                    .iter()
                    .copied()
                    .filter(|n| !line.contains(&format!("`{n}`")))
                    .collect();
                if !unnamed.is_empty() {
                    finding(
                        "docs/development.md (the map's roles row)",
                        format!("does not name the subcommands {unnamed:?} (in backticks)"),
                    );
                }
            }
        }
        match row("| `src/` infrastructure, in this order:") {
            None => finding(
                "docs/development.md",
                "the map has no row \"| `src/` infrastructure, in this order: …\"".into(),
            ),
            Some(line) => {
                let first = line.split('|').nth(1).unwrap_or_default();
                let listed: Vec<String> = ticked_outside_parens(first)
                    .into_iter()
                    .filter(|n| n != "src/")
                    .collect();
                if listed != INFRA {
                    finding(
                        "docs/development.md (the map's infrastructure row)",
                        format!("lists {listed:?}; the order is {INFRA:?}"),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_are_named_as_clap_names_them() {
        assert_eq!(kebab("DevicePlugin"), "device-plugin");
        assert_eq!(kebab("Version"), "version");
        let (subs, headline) = read_cli(
            "/// GPU sharing:\n/// extender.\n///\n/// More.\nstruct Cli;\n\
             enum Command { Extender(extender::Args), DraPlugin(dra::role::Args), Version }",
        )
        .expect("parses");
        assert_eq!(headline.as_deref(), Some("GPU sharing: extender."));
        assert_eq!(
            subs,
            [
                Subcommand {
                    name: "extender".into(),
                    module: Some("extender".into())
                },
                Subcommand {
                    name: "dra-plugin".into(),
                    module: Some("dra".into())
                },
                Subcommand {
                    name: "version".into(),
                    module: None
                },
            ]
        );
    }

    #[test]
    fn names_in_parentheses_and_counts_are_read() {
        assert_eq!(
            ticked_outside_parens("`src/` x: `a`, `b` (see `c::d`), `e`"),
            ["src/", "a", "b", "e"]
        );
        assert_eq!(wrong_counts("one binary with four roles"), ["four roles"]);
        assert!(wrong_counts("one binary, seven roles").is_empty());
    }
}
