//! A crate as rustc lays it out: its modules from the root file through every `mod name;`
//! (to `name.rs` or `name/mod.rs`, or where `#[path = "…"]` says, with rustc's rules for
//! inline modules and for `mod.rs` / non-`mod.rs` files), each file read once by
//! [`crate::reader`]; and the resolution of the paths those files write.
//!
//! [`CrateTree::resolve`] turns a path as written into an absolute one: `crate::`, `self::`,
//! `super::` (climbing), a child module of the module it is written in (`bind::X` in
//! `extender/mod.rs`), a name the module imports (`use super::bind; bind::commit()`), an item
//! the module defines, a name a glob import brings (`use super::*`), or the linked library
//! (`gpushare::` in `main.rs`). [`CrateTree::land`] follows an absolute path to the module that
//! defines its item, through re-exports (`pub use state::ExtenderState` in `extender/mod.rs`
//! sends `super::ExtenderState` to `state.rs`). Not modelled: cfg other than `test` (every
//! module is read whatever its cfg), names a macro defines, and the scoping of a `use`
//! written inside a function body (it counts for its whole module).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use crate::reader::{self, FileFacts, RefKind};
use crate::source::SourceTree;

/// A module of the crate.
#[derive(Clone, Debug)]
pub struct Module {
    /// The file that holds it (an inline module's file is its parent's).
    pub file: PathBuf,
    /// Declared under `#[cfg(test)]` (or inside such a module).
    pub test: bool,
    /// Its child modules (inline or in files).
    pub children: BTreeSet<String>,
}

/// A path resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// Absolute in this crate (`[]` is the root).
    Here(Vec<String>),
    /// Absolute in the linked library (`gpushare::cli::…` in `main.rs`).
    Linked(Vec<String>),
    /// Another crate, by its first segment (`gpushare_sandbox`, `std`, `tokio`).
    Extern(String),
}

/// One crate: its modules, its files' facts, and what could not be loaded.
#[derive(Debug, Default)]
pub struct CrateTree {
    pub modules: BTreeMap<Vec<String>, Module>,
    /// Each file of the crate, with the module it holds and what it says.
    pub files: BTreeMap<PathBuf, (Vec<String>, FileFacts)>,
    /// `mod` declarations without a file, files that do not parse: `(file, line, message)`.
    pub problems: Vec<(PathBuf, usize, String)>,
    /// The library this crate is linked with, by the name it is written (`gpushare`).
    link: Option<String>,
    /// Per module: the names its `use` items bind, to the path as written.
    bindings: BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>,
    /// Per module: the paths of its glob imports, as written.
    globs: BTreeMap<Vec<String>, Vec<Vec<String>>>,
    /// Per module: the names it defines.
    defined: BTreeMap<Vec<String>, BTreeSet<String>>,
}

/// How deep a chain of re-exports is followed before giving up (a cycle of `use`s).
const MAX_DEPTH: usize = 16;

impl CrateTree {
    /// Loads the crate whose root file is `root` (`src/lib.rs`); `link` names the library the
    /// crate's paths may start with (`Some("gpushare")` for `src/main.rs`).
    pub fn load(tree: &SourceTree, root: &Path, link: Option<&str>) -> CrateTree {
        let mut krate = CrateTree {
            link: link.map(str::to_string),
            ..CrateTree::default()
        };
        let root_dir = root.parent().unwrap_or(Path::new("")).to_path_buf();
        let mut queue =
            VecDeque::from([(root.to_path_buf(), Vec::<String>::new(), false, root_dir)]);
        while let Some((file, module, test, child_dir)) = queue.pop_front() {
            if krate.files.contains_key(&file) {
                krate.problems.push((
                    file.clone(),
                    0,
                    "the file is declared as two modules".into(),
                ));
                continue;
            }
            let Some(text) = tree.get(&file) else {
                continue; // checked when the declaration was read
            };
            let facts = match reader::read_file(text, &module, test) {
                Ok(facts) => facts,
                Err(e) => {
                    let line = e.span().start().line;
                    krate
                        .problems
                        .push((file.clone(), line, format!("does not parse: {e}")));
                    continue;
                }
            };
            krate.modules.insert(
                module.clone(),
                Module {
                    file: file.clone(),
                    test,
                    children: BTreeSet::new(),
                },
            );
            for (inline, inline_test) in &facts.inline_modules {
                krate.modules.insert(
                    inline.clone(),
                    Module {
                        file: file.clone(),
                        test: *inline_test,
                        children: BTreeSet::new(),
                    },
                );
            }
            for decl in &facts.mod_decls {
                let name = decl.module.last().cloned().unwrap_or_default();
                let mut base = child_dir.clone();
                base.extend(&decl.inline);
                let candidates = match &decl.path_attr {
                    Some(attr) if decl.inline.is_empty() => {
                        vec![normalize(
                            &file.parent().unwrap_or(Path::new("")).join(attr),
                        )]
                    }
                    Some(attr) => vec![normalize(&base.join(attr))],
                    None => vec![
                        base.join(format!("{name}.rs")),
                        base.join(&name).join("mod.rs"),
                    ],
                };
                let found: Vec<&PathBuf> = candidates.iter().filter(|c| tree.contains(c)).collect();
                let child = match found.as_slice() {
                    [one] => (*one).clone(),
                    [] => {
                        krate.problems.push((
                            file.clone(),
                            decl.line,
                            format!("`mod {name};` has no file: {}", show(&candidates)),
                        ));
                        continue;
                    }
                    _ => {
                        krate.problems.push((
                            file.clone(),
                            decl.line,
                            format!("`mod {name};` has two files: {}", show(&candidates)),
                        ));
                        continue;
                    }
                };
                let is_mod_rs = child.file_name().is_some_and(|n| n == "mod.rs");
                let grandchildren = if decl.path_attr.is_some() || is_mod_rs {
                    child.parent().unwrap_or(Path::new("")).to_path_buf()
                } else {
                    child.with_extension("")
                };
                queue.push_back((child, decl.module.clone(), decl.test, grandchildren));
            }
            krate.files.insert(file, (module, facts));
        }
        krate.index();
        krate
    }

    /// Fills the children, bindings, globs and definitions of every module.
    fn index(&mut self) {
        let paths: Vec<Vec<String>> = self.modules.keys().cloned().collect();
        for path in paths {
            if let Some((name, parent)) = path.split_last()
                && let Some(parent) = self.modules.get_mut(parent)
            {
                parent.children.insert(name.clone());
            }
        }
        for (_, facts) in self.files.values() {
            for (module, names) in &facts.defined {
                self.defined
                    .entry(module.clone())
                    .or_default()
                    .extend(names.iter().cloned());
            }
            for r in &facts.references {
                let RefKind::Use { glob, .. } = r.kind else {
                    continue;
                };
                if glob {
                    self.globs
                        .entry(r.module.clone())
                        .or_default()
                        .push(r.path.clone());
                } else if let Some(name) = &r.binds {
                    self.bindings
                        .entry(r.module.clone())
                        .or_default()
                        .insert(name.clone(), r.path.clone());
                }
            }
        }
    }

    /// The module `path`, if the crate has it.
    pub fn module(&self, path: &[String]) -> Option<&Module> {
        self.modules.get(path)
    }

    /// The path `path` written in the module `module`, made absolute; `None` for a name of no
    /// module (a local variable, a type parameter, a prelude name).
    pub fn resolve(&self, module: &[String], path: &[String]) -> Option<Resolved> {
        self.resolve_at(module, path, 0)
    }

    fn resolve_at(&self, module: &[String], path: &[String], depth: usize) -> Option<Resolved> {
        let (first, rest) = path.split_first()?;
        if depth > MAX_DEPTH {
            return None;
        }
        let joined = |base: &[String], tail: &[String]| -> Vec<String> {
            base.iter().chain(tail).cloned().collect()
        };
        match first.as_str() {
            "crate" => return Some(Resolved::Here(rest.to_vec())),
            "self" => return Some(Resolved::Here(joined(module, rest))),
            "super" => {
                let ups = path.iter().take_while(|s| *s == "super").count();
                let keep = module.len().checked_sub(ups)?;
                return Some(Resolved::Here(joined(&module[..keep], &path[ups..])));
            }
            _ => {}
        }
        if self.link.as_deref() == Some(first.as_str()) {
            return Some(Resolved::Linked(rest.to_vec()));
        }
        if self.names_here(module, first) {
            return Some(Resolved::Here(joined(module, path)));
        }
        if let Some(target) = self.bindings.get(module).and_then(|b| b.get(first)) {
            return match self.resolve_at(module, target, depth + 1)? {
                Resolved::Here(p) => Some(Resolved::Here(joined(&p, rest))),
                Resolved::Linked(p) => Some(Resolved::Linked(joined(&p, rest))),
                other => Some(other),
            };
        }
        for glob in self.globs.get(module).into_iter().flatten() {
            if let Some(Resolved::Here(source)) = self.resolve_at(module, glob, depth + 1)
                && (self.names_here(&source, first)
                    || self
                        .bindings
                        .get(&source)
                        .is_some_and(|b| b.contains_key(first)))
            {
                return self.resolve_at(&source, path, depth + 1);
            }
        }
        (!rest.is_empty()).then(|| Resolved::Extern(first.clone()))
    }

    /// Whether `module` has a child module or defines an item called `name`.
    fn names_here(&self, module: &[String], name: &str) -> bool {
        self.modules
            .get(module)
            .is_some_and(|m| m.children.contains(name))
            || self.defined.get(module).is_some_and(|d| d.contains(name))
    }

    /// Where the absolute path `abs` lands: the module that defines its item (re-exports
    /// followed) and the item's name, or the module itself (`None`) when the path names a
    /// module. `None` when it leaves the crate.
    pub fn land(&self, abs: &[String]) -> Option<(Vec<String>, Option<String>)> {
        self.land_at(abs, 0)
    }

    fn land_at(&self, abs: &[String], depth: usize) -> Option<(Vec<String>, Option<String>)> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut module: Vec<String> = Vec::new();
        let mut at = 0;
        while let Some(next) = abs.get(at) {
            let has_child = self
                .modules
                .get(&module)
                .is_some_and(|m| m.children.contains(next));
            if !has_child {
                break;
            }
            module.push(next.clone());
            at += 1;
        }
        let Some(name) = abs.get(at) else {
            return Some((module, None));
        };
        if self.defined.get(&module).is_some_and(|d| d.contains(name)) {
            return Some((module, Some(name.clone())));
        }
        let tail = &abs[at + 1..];
        if let Some(target) = self.bindings.get(&module).and_then(|b| b.get(name)) {
            return match self.resolve_at(&module, target, depth + 1)? {
                Resolved::Here(p) => {
                    let full: Vec<String> = p.iter().chain(tail).cloned().collect();
                    self.land_at(&full, depth + 1)
                }
                _ => None,
            };
        }
        for glob in self.globs.get(&module).into_iter().flatten() {
            if let Some(Resolved::Here(source)) = self.resolve_at(&module, glob, depth + 1)
                && (self.names_here(&source, name)
                    || self
                        .bindings
                        .get(&source)
                        .is_some_and(|b| b.contains_key(name)))
            {
                let full: Vec<String> = source.iter().chain(&abs[at..]).cloned().collect();
                return self.land_at(&full, depth + 1);
            }
        }
        Some((module, Some(name.clone())))
    }

    /// The file holding `module`.
    pub fn file_of(&self, module: &[String]) -> Option<&Path> {
        self.modules.get(module).map(|m| m.file.as_path())
    }
}

/// `a/./b/../c` → `a/c`, without asking the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn show(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(path: &str) -> Vec<String> {
        if path.is_empty() {
            return Vec::new();
        }
        path.split("::").map(str::to_string).collect()
    }

    fn fixture() -> CrateTree {
        let tree = SourceTree::from_files([
            (
                "src/lib.rs",
                "pub mod extender; #[path = \"elsewhere/gpu.rs\"] pub mod gpu;",
            ),
            (
                "src/extender/mod.rs",
                "mod bind; pub mod state; pub use state::ExtenderState;\n\
                 #[cfg(test)] mod tests { use super::*; fn t() { ExtenderState::new(); } }",
            ),
            (
                "src/extender/bind.rs",
                "use super::{state, ExtenderState}; fn f() { state::x(); }",
            ),
            (
                "src/extender/state.rs",
                "pub struct ExtenderState; mod inner { pub fn y() {} }",
            ),
            ("src/elsewhere/gpu.rs", "pub mod fake;"),
            ("src/elsewhere/fake.rs", "pub fn open() {}"),
        ]);
        let krate = CrateTree::load(&tree, Path::new("src/lib.rs"), None);
        assert!(krate.problems.is_empty(), "{:?}", krate.problems);
        krate
    }

    #[test]
    fn modules_are_found_through_declarations_and_path_attributes() {
        let krate = fixture();
        let modules: Vec<String> = krate.modules.keys().map(|m| m.join("::")).collect();
        assert_eq!(
            modules,
            [
                "",
                "extender",
                "extender::bind",
                "extender::state",
                "extender::state::inner",
                "extender::tests",
                "gpu",
                "gpu::fake"
            ]
        );
        assert_eq!(
            krate.file_of(&v("gpu::fake")),
            Some(Path::new("src/elsewhere/fake.rs"))
        );
        assert!(krate.module(&v("extender::tests")).is_some_and(|m| m.test));
    }

    #[test]
    fn paths_resolve_through_children_bindings_and_globs() {
        let krate = fixture();
        let here = |m: &str, p: &str| krate.resolve(&v(m), &v(p));
        assert_eq!(
            here("extender", "state::ExtenderState"),
            Some(Resolved::Here(v("extender::state::ExtenderState")))
        );
        assert_eq!(
            here("extender::bind", "state::x"),
            Some(Resolved::Here(v("extender::state::x")))
        );
        assert_eq!(
            here("extender::bind", "super::super::gpu"),
            Some(Resolved::Here(v("gpu")))
        );
        // Through the glob, then through the parent's own import.
        assert_eq!(
            here("extender::tests", "ExtenderState::new"),
            Some(Resolved::Here(v("extender::state::ExtenderState::new")))
        );
        assert_eq!(
            here("extender", "tokio::spawn"),
            Some(Resolved::Extern("tokio".into()))
        );
        assert_eq!(here("extender", "value"), None);
        assert_eq!(here("", "super::x"), None);
    }

    #[test]
    fn re_exports_land_where_the_item_is_defined() {
        let krate = fixture();
        assert_eq!(
            krate.land(&v("extender::ExtenderState::new")),
            Some((v("extender::state"), Some("ExtenderState".into())))
        );
        assert_eq!(
            krate.land(&v("extender::state")),
            Some((v("extender::state"), None))
        );
        assert_eq!(
            krate.land(&v("gpu::fake::open")),
            Some((v("gpu::fake"), Some("open".into())))
        );
    }

    #[test]
    fn a_missing_module_file_is_a_problem() {
        let tree = SourceTree::from_files([("src/lib.rs", "mod gone;")]);
        let krate = CrateTree::load(&tree, Path::new("src/lib.rs"), None);
        assert_eq!(krate.problems.len(), 1);
        assert!(
            krate.problems[0]
                .2
                .contains("src/gone.rs or src/gone/mod.rs"),
            "{:?}",
            krate.problems
        );
    }
}
