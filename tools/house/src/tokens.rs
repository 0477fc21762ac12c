//! What a token stream that is not parsed as Rust syntax names: the bodies of macro calls
//! (`format!`, `assert!`, `tokio::select!`, `macro_rules!` definitions) and the arguments of
//! attributes (`#[arg(value_parser = crate::config::parse)]`).
//!
//! A macro body is not parsed as expressions (it may be any tokens); it is read at the token
//! level: every chain `a::b::c` of identifiers (a leading `$crate` counts as `crate`; a
//! `$name` metavariable does not; `::{a, b::c}` groups are expanded as in a `use`), every
//! method call without arguments (`.inventory()`), and every `Result<…, String>`. String
//! literals and comments are tokens of their own kind, so a `//` or a `crate::` inside a
//! string is never read as code. What this does not do: expand macros, so a path a macro
//! builds from pieces (`concat_idents!`, `paste!`) is not seen.

use proc_macro2::{Delimiter, Spacing, TokenStream, TokenTree};

/// What one token stream names.
#[derive(Debug, Default)]
pub struct TokenFindings {
    /// Every identifier chain, with the line of its first identifier.
    pub paths: Vec<(Vec<String>, usize)>,
    /// Every method call without arguments (`x.inventory()`): its name and line.
    pub bare_method_calls: Vec<(String, usize)>,
    /// Every `Result<…, String>`: its text and line.
    pub string_results: Vec<(String, usize)>,
}

/// Reads `stream` (and every group inside it) into `out`.
pub fn scan(stream: TokenStream, out: &mut TokenFindings) {
    let tokens: Vec<TokenTree> = stream.into_iter().collect();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Group(group) => {
                scan(group.stream(), out);
                i += 1;
            }
            TokenTree::Ident(ident) => {
                let name = ident.to_string();
                let line = ident.span().start().line;
                if is_punct(tokens.get(i.wrapping_sub(1)), '.') && i > 0 {
                    if let Some(TokenTree::Group(args)) = tokens.get(i + 1)
                        && args.delimiter() == Delimiter::Parenthesis
                        && args.stream().is_empty()
                    {
                        out.bare_method_calls.push((name, line));
                    }
                    i += 1;
                    continue;
                }
                if i > 0 && is_punct(tokens.get(i - 1), '$') && name != "crate" {
                    i += 1; // a metavariable of a macro_rules definition
                    continue;
                }
                if i >= 2 && is_path_sep(&tokens, i - 2) {
                    i += 1; // `::std::…`: a path from the extern prelude
                    continue;
                }
                if name == "Result" {
                    string_result(&tokens, i, out);
                }
                let (paths, next) = chain(&tokens, i);
                out.paths.extend(paths.into_iter().map(|p| (p, line)));
                i = next;
            }
            _ => i += 1,
        }
    }
}

fn is_punct(token: Option<&TokenTree>, c: char) -> bool {
    matches!(token, Some(TokenTree::Punct(p)) if p.as_char() == c)
}

/// Whether `tokens[at..]` starts with `::`.
fn is_path_sep(tokens: &[TokenTree], at: usize) -> bool {
    matches!(
        (tokens.get(at), tokens.get(at + 1)),
        (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
            if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':'
    )
}

/// The paths of the chain starting with the identifier at `start` (`a::b::{c, d::e}` gives
/// `a::b::c` and `a::b::d::e`), and the index after it.
fn chain(tokens: &[TokenTree], start: usize) -> (Vec<Vec<String>>, usize) {
    let mut segments = Vec::new();
    let mut i = start;
    if let Some(TokenTree::Ident(first)) = tokens.get(i) {
        segments.push(first.to_string());
        i += 1;
    }
    while is_path_sep(tokens, i) {
        match tokens.get(i + 2) {
            Some(TokenTree::Ident(next)) => {
                segments.push(next.to_string());
                i += 3;
            }
            Some(TokenTree::Group(group)) if group.delimiter() == Delimiter::Brace => {
                let inner: Vec<TokenTree> = group.stream().into_iter().collect();
                let paths = use_group(&inner)
                    .into_iter()
                    .map(|tail| {
                        let mut p = segments.clone();
                        p.extend(tail);
                        p
                    })
                    .collect();
                return (paths, i + 3);
            }
            // `::<T>` (a turbofish) or `::*` ends the chain.
            _ => break,
        }
    }
    (vec![segments], i)
}

/// The paths of the elements of a `{…}` group of a `use` (`self` is the group's own prefix).
fn use_group(tokens: &[TokenTree]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for element in tokens.split(|t| is_punct(Some(t), ',')) {
        if let Some(TokenTree::Ident(first)) = element.first() {
            if first == "self" {
                out.push(Vec::new());
                continue;
            }
            out.extend(chain(element, 0).0);
        } else if let Some(TokenTree::Punct(p)) = element.first()
            && p.as_char() == '*'
        {
            out.push(Vec::new());
        }
    }
    out
}

/// Records `Result<…, String>` if the generic arguments after the `Result` at `at` end with
/// `String` (`std::string::String`) as the second of two arguments.
fn string_result(tokens: &[TokenTree], at: usize, out: &mut TokenFindings) {
    let mut i = at + 1;
    if is_path_sep(tokens, i) {
        i += 2; // `Result::<T, E>`
    }
    if !is_punct(tokens.get(i), '<') {
        return;
    }
    let mut depth = 0usize;
    let mut args: Vec<Vec<&TokenTree>> = Vec::new();
    let mut current: Vec<&TokenTree> = Vec::new();
    while let Some(token) = tokens.get(i) {
        i += 1;
        // The `>` of `->` and `=>` closes nothing.
        let arrow = matches!(tokens.get(i.wrapping_sub(2)),
            Some(TokenTree::Punct(p)) if matches!(p.as_char(), '-' | '=') && p.spacing() == Spacing::Joint);
        let c = match token {
            TokenTree::Punct(p) => Some(p.as_char()),
            _ => None,
        };
        match c {
            Some('<') => {
                depth += 1;
                if depth == 1 {
                    continue; // the opening bracket itself
                }
            }
            Some('>') if !arrow => {
                depth -= 1;
                if depth == 0 {
                    args.push(std::mem::take(&mut current));
                    break;
                }
            }
            Some(',') if depth == 1 => {
                args.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(token);
    }
    if args.last().is_some_and(Vec::is_empty) {
        args.pop(); // a trailing comma
    }
    let text = |arg: &[&TokenTree]| -> String {
        arg.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join("")
            .replace(" ,", ",")
    };
    if args.len() == 2 && is_string_type(&text(&args[1])) {
        let whole = format!("Result<{}, {}>", text(&args[0]), text(&args[1]));
        let line = tokens[at].span().start().line;
        out.string_results.push((whole, line));
    }
}

/// Whether the text of a type (no spaces) is `String`.
pub fn is_string_type(text: &str) -> bool {
    matches!(
        text.trim_start_matches("::"),
        "String" | "std::string::String" | "alloc::string::String"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn findings(code: &str) -> TokenFindings {
        let stream: TokenStream = code.parse().expect("tokens");
        let mut out = TokenFindings::default();
        scan(stream, &mut out);
        out
    }

    fn paths(code: &str) -> Vec<String> {
        findings(code)
            .paths
            .into_iter()
            .map(|(p, _)| p.join("::"))
            .filter(|p| p.contains("::"))
            .collect()
    }

    #[test]
    fn chains_groups_and_crate_metavariables_are_read() {
        assert_eq!(
            paths("assert_eq!(crate::gpu::fake::Fake::new(), super::x::{self, a::B, c})"),
            [
                "crate::gpu::fake::Fake::new",
                "super::x",
                "super::x::a::B",
                "super::x::c"
            ]
        );
        assert_eq!(paths("$crate::k8s::retry($x::y)"), ["crate::k8s::retry"]);
        assert_eq!(
            paths("x.collect::<Vec<_>>() ::std::mem::take(a)"),
            Vec::<String>::new()
        );
    }

    #[test]
    fn strings_are_never_code() {
        assert!(
            paths(r#"format!("see crate::extender // {}", crate::k8s::x)"#) == ["crate::k8s::x"]
        );
    }

    #[test]
    fn bare_method_calls_and_string_results_are_found() {
        let f = findings(
            "let a = backend.inventory(); b.open(x); fn f() -> Result<(u8, String), String> {} fn g() -> Result<Vec<String>, E> {} type H = FilterResult<String, String>;",
        );
        let calls: Vec<&str> = f
            .bare_method_calls
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(calls, ["inventory"]);
        let results: Vec<&str> = f.string_results.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(results, ["Result<(u8, String), String>"]);
    }
}
