//! One Rust file read with syn: the paths it names, the modules it declares, the names it
//! defines and imports per module, and which of it is test code.
//!
//! Every path is read where Rust writes one: `use` trees (groups, renames, globs), paths in
//! expressions, types, patterns and trait bounds, macro names, and the tokens of macro bodies
//! and attribute arguments (read by [`crate::tokens`]). Comments and string literals are
//! never code. Test code is decided per item: an item (a `mod tests`, a function, a `use`, an
//! `impl`, a field, a match arm, a `let`) under an attribute `#[cfg(…)]` that requires `test`
//! (`test`, `all(test, …)`, `any` of such) is test code with everything inside it; the items
//! after it are product code again. `#![cfg(test)]` makes the whole file test code.
//!
//! It resolves nothing: [`crate::crate_tree`] does, once every file of the crate is read.

use std::collections::{BTreeMap, BTreeSet};

use syn::punctuated::Punctuated;
use syn::visit::{self, Visit};
use syn::{Attribute, Item, Meta, Token, UseTree};

use crate::tokens::{self, TokenFindings};

/// Where a path was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefKind {
    /// A leaf of a `use` tree: `public` for `pub`/`pub(…)` (a re-export), `glob` for `::*`.
    Use { public: bool, glob: bool },
    /// A path in code (expression, type, pattern, macro name).
    Code,
    /// An identifier chain in the tokens of a macro body or attribute argument.
    Tokens,
}

/// A path as written, with where it was written.
#[derive(Clone, Debug)]
pub struct Reference {
    /// The module it is written in (absolute in its crate: `[extender, bind]`).
    pub module: Vec<String>,
    /// Its segments as written (`[super, state, ExtenderState]`; `$crate` is `crate`).
    pub path: Vec<String>,
    /// For a `use` leaf, the name it binds (`None` for a glob or `as _`).
    pub binds: Option<String>,
    pub kind: RefKind,
    /// Written in test code.
    pub test: bool,
    pub line: usize,
}

/// A `mod name;` declaration (a module in a file of its own).
#[derive(Clone, Debug)]
pub struct ModDecl {
    /// The declared module's absolute path.
    pub module: Vec<String>,
    /// The inline modules of this file it is declared inside (`mod a { mod b; }`: `[a]`).
    pub inline: Vec<String>,
    /// Its `#[path = "…"]`, if any.
    pub path_attr: Option<String>,
    pub test: bool,
    pub line: usize,
}

/// Everything the rules need of one file.
#[derive(Debug, Default)]
pub struct FileFacts {
    pub references: Vec<Reference>,
    pub mod_decls: Vec<ModDecl>,
    /// Inline modules (`mod tests { … }`): path and whether they are test code.
    pub inline_modules: Vec<(Vec<String>, bool)>,
    /// The names each module of this file defines (items, not the ones it imports).
    pub defined: BTreeMap<Vec<String>, BTreeSet<String>>,
    /// Method calls without arguments (`x.inventory()`): name, line, test code.
    pub bare_method_calls: Vec<(String, usize, bool)>,
    /// `Result<…, String>` types: their text (as far as known) and line.
    pub string_results: Vec<(String, usize)>,
}

/// Reads `text`, the file of the module `module`; `test` when the whole file is test code
/// (declared under `#[cfg(test)]`).
pub fn read_file(text: &str, module: &[String], test: bool) -> syn::Result<FileFacts> {
    let file = syn::parse_file(text)?;
    let mut reader = Reader {
        module: module.to_vec(),
        inline: Vec::new(),
        test: usize::from(test || file.attrs.iter().any(requires_test)),
        block_depth: 0,
        facts: FileFacts::default(),
    };
    reader.facts.defined.entry(module.to_vec()).or_default();
    reader.visit_file(&file);
    Ok(reader.facts)
}

struct Reader {
    module: Vec<String>,
    inline: Vec<String>,
    /// How many enclosing items are test code (0: product code).
    test: usize,
    /// How many blocks enclose the current item (0: a module-level item).
    block_depth: usize,
    facts: FileFacts,
}

impl Reader {
    fn in_test(&self) -> bool {
        self.test > 0
    }

    /// Runs `f` with the test depth raised when `attrs` make this item test code.
    fn with_attrs(&mut self, attrs: &[Attribute], f: impl FnOnce(&mut Self)) {
        let test = attrs.iter().any(requires_test);
        self.test += usize::from(test);
        f(self);
        self.test -= usize::from(test);
    }

    fn define(&mut self, name: String) {
        if self.block_depth == 0 {
            self.facts
                .defined
                .entry(self.module.clone())
                .or_default()
                .insert(name);
        }
    }

    fn push_tokens(&mut self, found: TokenFindings) {
        let test = self.in_test();
        for (path, line) in found.paths {
            self.facts.references.push(Reference {
                module: self.module.clone(),
                path,
                binds: None,
                kind: RefKind::Tokens,
                test,
                line,
            });
        }
        for (name, line) in found.bare_method_calls {
            self.facts.bare_method_calls.push((name, line, test));
        }
        self.facts.string_results.extend(found.string_results);
    }
}

/// Whether the attribute is a `#[cfg(…)]` whose predicate requires `test`.
pub fn requires_test(attr: &Attribute) -> bool {
    if !attr.path().is_ident("cfg") {
        return false;
    }
    attr.parse_args::<Meta>()
        .is_ok_and(|meta| predicate_requires_test(&meta))
}

fn predicate_requires_test(meta: &Meta) -> bool {
    match meta {
        Meta::Path(path) => path.is_ident("test"),
        Meta::List(list) => {
            let Ok(nested) = list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
            else {
                return false;
            };
            if list.path.is_ident("all") {
                nested.iter().any(predicate_requires_test)
            } else if list.path.is_ident("any") {
                !nested.is_empty() && nested.iter().all(predicate_requires_test)
            } else {
                false // `not(test)` and the rest
            }
        }
        Meta::NameValue(_) => false,
    }
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// The name an item defines in its module, if any.
fn item_name(item: &Item) -> Option<String> {
    let ident = match item {
        Item::Const(i) => &i.ident,
        Item::Enum(i) => &i.ident,
        Item::ExternCrate(i) => i.rename.as_ref().map_or(&i.ident, |(_, r)| r),
        Item::Fn(i) => &i.sig.ident,
        Item::Macro(i) => i.ident.as_ref()?,
        Item::Mod(i) => &i.ident,
        Item::Static(i) => &i.ident,
        Item::Struct(i) => &i.ident,
        Item::Trait(i) => &i.ident,
        Item::TraitAlias(i) => &i.ident,
        Item::Type(i) => &i.ident,
        Item::Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
}

/// The leaves of a use tree: `(path, the name bound or None, glob, line)`.
fn use_leaves(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<UseLeaf>) {
    match tree {
        UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        UseTree::Name(n) => {
            let line = n.ident.span().start().line;
            if n.ident == "self" {
                out.push((prefix.clone(), prefix.last().cloned(), false, line));
            } else {
                let mut path = prefix.clone();
                path.push(n.ident.to_string());
                out.push((path, Some(n.ident.to_string()), false, line));
            }
        }
        UseTree::Rename(r) => {
            let line = r.ident.span().start().line;
            let mut path = prefix.clone();
            if r.ident != "self" {
                path.push(r.ident.to_string());
            }
            let name = (r.rename != "_").then(|| r.rename.to_string());
            out.push((path, name, false, line));
        }
        UseTree::Glob(g) => {
            let line = g.star_token.spans[0].start().line;
            out.push((prefix.clone(), None, true, line));
        }
        UseTree::Group(g) => {
            for item in &g.items {
                use_leaves(item, prefix, out);
            }
        }
    }
}

type UseLeaf = (Vec<String>, Option<String>, bool, usize);

impl<'ast> Visit<'ast> for Reader {
    fn visit_item(&mut self, item: &'ast Item) {
        if let Some(name) = item_name(item) {
            self.define(name);
        }
        self.with_attrs(item_attrs(item), |me| visit::visit_item(me, item));
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        let name = item.ident.to_string();
        let mut module = self.module.clone();
        module.push(name.clone());
        let test = self.in_test();
        match &item.content {
            Some((_, items)) => {
                self.facts.inline_modules.push((module.clone(), test));
                self.facts.defined.entry(module.clone()).or_default();
                let outer = std::mem::replace(&mut self.module, module);
                let outer_blocks = std::mem::replace(&mut self.block_depth, 0);
                self.inline.push(name);
                for attr in &item.attrs {
                    self.visit_attribute(attr);
                }
                for inner in items {
                    self.visit_item(inner);
                }
                self.inline.pop();
                self.block_depth = outer_blocks;
                self.module = outer;
            }
            None => {
                let path_attr = item.attrs.iter().find_map(|a| match &a.meta {
                    Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
                        syn::Expr::Lit(syn::ExprLit {
                            lit: syn::Lit::Str(s),
                            ..
                        }) => Some(s.value()),
                        _ => None,
                    },
                    _ => None,
                });
                self.facts.mod_decls.push(ModDecl {
                    module,
                    inline: self.inline.clone(),
                    path_attr,
                    test,
                    line: item.ident.span().start().line,
                });
            }
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let public = !matches!(item.vis, syn::Visibility::Inherited);
        let mut leaves = Vec::new();
        let mut prefix = Vec::new();
        if item.leading_colon.is_some() {
            return; // `use ::name::…`: another crate
        }
        use_leaves(&item.tree, &mut prefix, &mut leaves);
        let test = self.in_test();
        for (path, binds, glob, line) in leaves {
            self.facts.references.push(Reference {
                module: self.module.clone(),
                path,
                binds,
                kind: RefKind::Use { public, glob },
                test,
                line,
            });
        }
    }

    fn visit_block(&mut self, block: &'ast syn::Block) {
        self.block_depth += 1;
        visit::visit_block(self, block);
        self.block_depth -= 1;
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none()
            && let Some(first) = path.segments.first()
        {
            self.facts.references.push(Reference {
                module: self.module.clone(),
                path: path.segments.iter().map(|s| s.ident.to_string()).collect(),
                binds: None,
                kind: RefKind::Code,
                test: self.in_test(),
                line: first.ident.span().start().line,
            });
        }
        for segment in &path.segments {
            string_result_segment(segment, &mut self.facts.string_results);
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        let mut found = TokenFindings::default();
        tokens::scan(mac.tokens.clone(), &mut found);
        self.push_tokens(found);
    }

    fn visit_meta_list(&mut self, list: &'ast syn::MetaList) {
        self.visit_path(&list.path);
        let mut found = TokenFindings::default();
        tokens::scan(list.tokens.clone(), &mut found);
        self.push_tokens(found);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        if call.args.is_empty() {
            self.facts.bare_method_calls.push((
                call.method.to_string(),
                call.method.span().start().line,
                self.in_test(),
            ));
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs: &[Attribute] = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            syn::ImplItem::Macro(i) => &i.attrs,
            _ => &[],
        };
        self.with_attrs(attrs, |me| visit::visit_impl_item(me, item));
    }

    fn visit_trait_item(&mut self, item: &'ast syn::TraitItem) {
        let attrs: &[Attribute] = match item {
            syn::TraitItem::Const(i) => &i.attrs,
            syn::TraitItem::Fn(i) => &i.attrs,
            syn::TraitItem::Type(i) => &i.attrs,
            syn::TraitItem::Macro(i) => &i.attrs,
            _ => &[],
        };
        self.with_attrs(attrs, |me| visit::visit_trait_item(me, item));
    }

    fn visit_field(&mut self, field: &'ast syn::Field) {
        self.with_attrs(&field.attrs, |me| visit::visit_field(me, field));
    }

    fn visit_variant(&mut self, variant: &'ast syn::Variant) {
        self.with_attrs(&variant.attrs, |me| visit::visit_variant(me, variant));
    }

    fn visit_arm(&mut self, arm: &'ast syn::Arm) {
        self.with_attrs(&arm.attrs, |me| visit::visit_arm(me, arm));
    }

    fn visit_local(&mut self, local: &'ast syn::Local) {
        self.with_attrs(&local.attrs, |me| visit::visit_local(me, local));
    }

    fn visit_stmt_macro(&mut self, stmt: &'ast syn::StmtMacro) {
        self.with_attrs(&stmt.attrs, |me| visit::visit_stmt_macro(me, stmt));
    }
}

/// Records the segment if it is `Result<_, String>`.
fn string_result_segment(segment: &syn::PathSegment, out: &mut Vec<(String, usize)>) {
    if segment.ident != "Result" {
        return;
    }
    let syn::PathArguments::AngleBracketed(args) = &segment.arguments else {
        return;
    };
    if args.args.len() != 2 {
        return;
    }
    if let Some(syn::GenericArgument::Type(syn::Type::Path(error))) = args.args.last()
        && error.qself.is_none()
    {
        let text: Vec<String> = error
            .path
            .segments
            .iter()
            .map(|s| s.ident.to_string())
            .collect();
        if error.path.segments.iter().all(|s| s.arguments.is_none())
            && tokens::is_string_type(&text.join("::"))
        {
            out.push((
                format!("Result<_, {}>", text.join("::")),
                segment.ident.span().start().line,
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(path: &[&str]) -> Vec<String> {
        path.iter().map(|s| s.to_string()).collect()
    }

    fn refs(facts: &FileFacts) -> Vec<(String, bool)> {
        facts
            .references
            .iter()
            .filter(|r| r.path.len() > 1)
            .map(|r| (r.path.join("::"), r.test))
            .collect()
    }

    #[test]
    fn test_code_is_per_item_and_product_code_follows_it() {
        let code = r#"
            use super::a::X;
            #[cfg(test)]
            mod tests { use super::b::Y; }
            use crate::c::Z;
            #[cfg(all(test, unix))]
            fn helper() { crate::d::f(); }
            #[cfg(not(test))]
            fn real() { crate::e::g(); }
        "#;
        let facts = read_file(code, &module(&["m"]), false).expect("parses");
        assert_eq!(
            refs(&facts),
            [
                ("super::a::X".to_string(), false),
                ("super::b::Y".to_string(), true),
                ("crate::c::Z".to_string(), false),
                ("crate::d::f".to_string(), true),
                ("crate::e::g".to_string(), false),
            ]
        );
        assert_eq!(facts.inline_modules, [(module(&["m", "tests"]), true)]);
        let tests = &facts.references[1];
        assert_eq!(tests.module, module(&["m", "tests"]));
    }

    #[test]
    fn a_string_holding_slashes_hides_no_import() {
        let code = "use crate::k8s::X; const URL: &str = \"http://a\"; use crate::gpu::Y;\n\
                    fn f() { let s = \"//\"; crate::rdma::z(s) }";
        let facts = read_file(code, &[], false).expect("parses");
        let found: Vec<String> = refs(&facts).into_iter().map(|(p, _)| p).collect();
        assert_eq!(found, ["crate::k8s::X", "crate::gpu::Y", "crate::rdma::z"]);
    }

    #[test]
    fn use_trees_expand_with_their_bindings() {
        let code = "pub use state::{self as st, ExtenderState, inner::*};";
        let facts = read_file(code, &module(&["extender"]), false).expect("parses");
        let leaves: Vec<(String, Option<String>, RefKind)> = facts
            .references
            .iter()
            .map(|r| (r.path.join("::"), r.binds.clone(), r.kind))
            .collect();
        let public = RefKind::Use {
            public: true,
            glob: false,
        };
        assert_eq!(
            leaves,
            [
                ("state".to_string(), Some("st".to_string()), public),
                (
                    "state::ExtenderState".to_string(),
                    Some("ExtenderState".to_string()),
                    public
                ),
                (
                    "state::inner".to_string(),
                    None,
                    RefKind::Use {
                        public: true,
                        glob: true
                    }
                ),
            ]
        );
    }

    #[test]
    fn declarations_and_definitions_are_recorded() {
        let code =
            "#[path = \"other.rs\"] mod a; mod b { mod c; pub struct S; } fn f() { struct Local; }";
        let facts = read_file(code, &[], false).expect("parses");
        let decls: Vec<(Vec<String>, Vec<String>, Option<String>)> = facts
            .mod_decls
            .iter()
            .map(|d| (d.module.clone(), d.inline.clone(), d.path_attr.clone()))
            .collect();
        assert_eq!(
            decls,
            [
                (module(&["a"]), vec![], Some("other.rs".to_string())),
                (module(&["b", "c"]), module(&["b"]), None),
            ]
        );
        assert_eq!(
            facts.defined[&module(&[])],
            BTreeSet::from(["a", "b", "f"].map(String::from))
        );
        assert_eq!(
            facts.defined[&module(&["b"])],
            BTreeSet::from(["c", "S"].map(String::from))
        );
    }
}
