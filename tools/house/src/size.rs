//! The size rule over `src/`: no file longer than [`MAX_FILE_LINES`] lines before its tests (the
//! first `#[cfg(test)]` module), no function longer than [`MAX_FN_LINES`] lines (from its `fn`
//! to its closing brace; doc comments and attributes not counted). Test code (items under
//! `#[cfg(test)]`) is not measured. It measures; it does not say how to split.
//!
//! [`PENDING`] lists the paths not yet held to the rule (none now).

use std::path::Path;

use syn::visit::{self, Visit};
use syn::{Attribute, Item};

use crate::reader::requires_test;
use crate::source::SourceTree;
use crate::{Finding, Rule};

/// The most lines a file of `src/` may have before its tests.
pub const MAX_FILE_LINES: usize = 800;
/// The most lines a function of `src/` may have.
pub const MAX_FN_LINES: usize = 120;

/// Path prefixes not held to the rule yet; the list only shrinks (empty: all of `src/` is).
pub const PENDING: &[&str] = &[];

/// What is too long in one file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Oversize {
    /// The file's lines before its tests, when over [`MAX_FILE_LINES`].
    pub file_lines: Option<usize>,
    /// Functions over [`MAX_FN_LINES`]: name (`Type::name` in an impl), first line, lines.
    pub functions: Vec<(String, usize, usize)>,
}

/// Measures one file's text; `None` when it does not parse (the module rule reports that).
pub fn measure(text: &str) -> Option<Oversize> {
    let file = syn::parse_file(text).ok()?;
    let before_tests = file
        .items
        .iter()
        .filter_map(|item| match item {
            Item::Mod(m) if m.attrs.iter().any(requires_test) => m
                .attrs
                .iter()
                .map(|a| a.pound_token.span.start().line)
                .min(),
            _ => None,
        })
        .min()
        .map_or_else(|| text.lines().count(), |line| line.saturating_sub(1));
    let mut walker = Walker::default();
    walker.visit_file(&file);
    Some(Oversize {
        file_lines: (before_tests > MAX_FILE_LINES).then_some(before_tests),
        functions: walker.long,
    })
}

/// Every file of `src/` outside [`PENDING`] held to the size rule.
pub fn check(tree: &SourceTree, out: &mut Vec<Finding>) {
    for file in tree.rust_files_under(Path::new("src")) {
        let name = file.display().to_string();
        if PENDING.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let Some(found) = tree.get(file).and_then(measure) else {
            continue;
        };
        if let Some(lines) = found.file_lines {
            out.push(Finding::new(
                Rule::Size,
                name.clone(),
                format!(
                    "{lines} lines before its tests (at most {MAX_FILE_LINES}): split it into \
                     modules named for what they hold"
                ),
            ));
        }
        for (function, line, lines) in found.functions {
            out.push(Finding::new(
                Rule::Size,
                format!("{name}:{line}"),
                format!(
                    "`{function}` is {lines} lines (at most {MAX_FN_LINES}): extract named steps"
                ),
            ));
        }
    }
}

#[derive(Default)]
struct Walker {
    test: usize,
    owner: Option<String>,
    long: Vec<(String, usize, usize)>,
}

impl Walker {
    fn with_attrs(&mut self, attrs: &[Attribute], f: impl FnOnce(&mut Self)) {
        let test = attrs.iter().any(requires_test);
        self.test += usize::from(test);
        f(self);
        self.test -= usize::from(test);
    }

    fn record(&mut self, name: &syn::Ident, sig: &syn::Signature, block: &syn::Block) {
        if self.test > 0 {
            return;
        }
        let first = sig.fn_token.span.start().line;
        let last = block.brace_token.span.close().end().line;
        let lines = last + 1 - first;
        if lines > MAX_FN_LINES {
            let name = match &self.owner {
                Some(owner) => format!("{owner}::{name}"),
                None => name.to_string(),
            };
            self.long.push((name, first, lines));
        }
    }
}

fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(p) => p
            .path
            .segments
            .last()
            .map_or_else(String::new, |s| s.ident.to_string()),
        _ => "_".into(),
    }
}

impl<'ast> Visit<'ast> for Walker {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.with_attrs(&item.attrs, |w| visit::visit_item_mod(w, item));
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.with_attrs(&item.attrs, |w| {
            w.record(&item.sig.ident, &item.sig, &item.block);
            visit::visit_item_fn(w, item);
        });
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.with_attrs(&item.attrs, |w| {
            let outer = w.owner.replace(type_name(&item.self_ty));
            visit::visit_item_impl(w, item);
            w.owner = outer;
        });
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.with_attrs(&item.attrs, |w| {
            let outer = w.owner.replace(item.ident.to_string());
            visit::visit_item_trait(w, item);
            w.owner = outer;
        });
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        self.with_attrs(&item.attrs, |w| {
            w.record(&item.sig.ident, &item.sig, &item.block);
            visit::visit_impl_item_fn(w, item);
        });
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        self.with_attrs(&item.attrs, |w| {
            if let Some(block) = &item.default {
                w.record(&item.sig.ident, &item.sig, block);
            }
            visit::visit_trait_item_fn(w, item);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(lines: usize) -> String {
        let mut text = String::from("fn long() {\n");
        for i in 0..lines.saturating_sub(2) {
            text.push_str(&format!("    let _x{i} = {i};\n"));
        }
        text.push_str("}\n");
        text
    }

    #[test]
    fn a_function_is_measured_from_fn_to_its_closing_brace() {
        let at_limit = body(MAX_FN_LINES);
        assert_eq!(measure(&at_limit).unwrap().functions, vec![]);
        let over = format!("/// doc\n#[inline]\n{}", body(MAX_FN_LINES + 1));
        assert_eq!(
            measure(&over).unwrap().functions,
            vec![("long".to_string(), 3, MAX_FN_LINES + 1)]
        );
    }

    #[test]
    fn methods_are_named_by_their_type_and_test_code_is_not_measured() {
        let text = format!(
            "struct S;\nimpl S {{\n{}}}\n#[cfg(test)]\nmod tests {{\n{}}}\n",
            body(MAX_FN_LINES + 5),
            body(MAX_FN_LINES + 5)
        );
        let found = measure(&text).unwrap();
        assert_eq!(found.functions.len(), 1);
        assert_eq!(found.functions[0].0, "S::long");
    }

    #[test]
    fn a_file_is_measured_before_its_first_test_module() {
        let product = "const A: u8 = 0;\n".repeat(MAX_FILE_LINES);
        let tests = "#[cfg(test)]\nmod tests {\n}\n".repeat(3);
        assert_eq!(
            measure(&(product.clone() + &tests)).unwrap().file_lines,
            None
        );
        let over = product + "const B: u8 = 0;\n" + &tests;
        assert_eq!(measure(&over).unwrap().file_lines, Some(MAX_FILE_LINES + 1));
    }
}
