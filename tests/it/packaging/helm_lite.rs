//! A renderer for the small part of Helm's template language the gpushare chart uses, so the
//! chart is tested without a Helm binary (none is installable here or in CI).
//!
//! Supported, with Go `text/template` semantics: text; `{{ pipeline }}`; whitespace trimming
//! with `{{- ` and ` -}}` (all adjacent spaces, tabs and newlines); comments `{{/* … */}}`;
//! `{{ if }}` / `{{ else if }}` / `{{ else }}` / `{{ end }}` with Go truthiness (false, 0, "",
//! nil, empty map or list are false); field chains `.Values.a.b`, `.Release.Name`,
//! `.Release.Namespace`, `.Chart.Name|Version|AppVersion`; string and integer literals;
//! pipelines `x | f args` (the piped value is the last argument); the functions `quote`,
//! `toYaml` (keys sorted, no trailing newline, as Helm's), `indent` and `nindent`.
//!
//! Not supported (an error, never a silent difference): `range`, `with`, `define`/`include`,
//! variables, parentheses, any other function. It is stricter than Helm in one way on
//! purpose: printing a missing value is an error instead of an empty string.

use std::fmt;

use yaml_serde::{Mapping, Value};

/// Why a template did not render.
#[derive(Debug)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error(msg.into()))
}

/// What a template sees as `.`: `Values`, `Release` and `Chart`.
pub struct Context {
    root: Value,
}

impl Context {
    /// The context of a release `name` in `namespace` of the chart described by `chart_yaml`
    /// (Chart.yaml text) with `values`.
    pub fn new(
        chart_yaml: &str,
        values: Value,
        name: &str,
        namespace: &str,
    ) -> Result<Self, Error> {
        let chart: Value =
            yaml_serde::from_str(chart_yaml).map_err(|e| Error(format!("Chart.yaml: {e}")))?;
        let Value::Mapping(chart) = chart else {
            return err("Chart.yaml is not a mapping");
        };
        // Helm exposes Chart.yaml's fields capitalised: appVersion -> .Chart.AppVersion.
        let mut chart_fields = Mapping::new();
        for (k, v) in chart {
            if let Value::String(k) = k {
                let mut chars = k.chars();
                let cap = match chars.next() {
                    Some(first) => first.to_uppercase().chain(chars).collect::<String>(),
                    None => k,
                };
                chart_fields.insert(Value::String(cap), v);
            }
        }
        let mut release = Mapping::new();
        release.insert("Name".into(), name.into());
        release.insert("Namespace".into(), namespace.into());
        let mut root = Mapping::new();
        root.insert("Values".into(), values);
        root.insert("Release".into(), Value::Mapping(release));
        root.insert("Chart".into(), Value::Mapping(chart_fields));
        Ok(Context {
            root: Value::Mapping(root),
        })
    }
}

/// Renders `template` (named `name` in errors) in `ctx`.
pub fn render(name: &str, template: &str, ctx: &Context) -> Result<String, Error> {
    let tokens = lex(template).map_err(|e| Error(format!("{name}: {}", e.0)))?;
    let mut pos = 0;
    let (nodes, stop) =
        parse_block(&tokens, &mut pos).map_err(|e| Error(format!("{name}: {}", e.0)))?;
    if let Some(stop) = stop {
        return err(format!("{name}: unexpected {{{{ {stop} }}}}"));
    }
    let mut out = String::new();
    exec(&nodes, ctx, &mut out).map_err(|e| Error(format!("{name}: {}", e.0)))?;
    Ok(out)
}

// ---------------------------------------------------------------- lexing

#[derive(Debug)]
enum Token {
    Text(String),
    /// The inside of `{{ … }}`, trim markers and surrounding spaces removed.
    Action(String),
}

fn is_go_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

fn lex(src: &str) -> Result<Vec<Token>, Error> {
    let mut tokens = Vec::new();
    let mut rest = src;
    let mut trim_next_text = false;
    loop {
        let (text, after) = match rest.find("{{") {
            Some(i) => (&rest[..i], Some(&rest[i + 2..])),
            None => (rest, None),
        };
        let mut text = text.to_string();
        if trim_next_text {
            text = text.trim_start_matches(is_go_space).to_string();
        }
        let Some(after) = after else {
            tokens.push(Token::Text(text));
            return Ok(tokens);
        };
        // `{{- ` trims the text before; the dash must be followed by a space (Go's rule).
        let (trim_prev, body_start) = match after.strip_prefix('-') {
            Some(b) if b.starts_with(is_go_space) => (true, b),
            _ => (false, after),
        };
        if trim_prev {
            text = text.trim_end_matches(is_go_space).to_string();
        }
        tokens.push(Token::Text(text));
        let Some(close) = body_start.find("}}") else {
            return err("unclosed action {{");
        };
        let mut body = &body_start[..close];
        trim_next_text = false;
        if let Some(b) = body.strip_suffix('-')
            && b.ends_with(is_go_space)
        {
            trim_next_text = true;
            body = b;
        }
        let body = body.trim_matches(is_go_space);
        if !(body.starts_with("/*") && body.ends_with("*/")) {
            tokens.push(Token::Action(body.to_string()));
        }
        rest = &body_start[close + 2..];
    }
}

// ---------------------------------------------------------------- parsing

#[derive(Debug)]
enum Node {
    Text(String),
    Print(Pipeline),
    If {
        branches: Vec<(Pipeline, Vec<Node>)>,
        otherwise: Vec<Node>,
    },
}

type Pipeline = Vec<Command>;

#[derive(Debug)]
struct Command {
    /// A function name, or empty for a plain operand.
    func: String,
    args: Vec<Operand>,
}

#[derive(Debug, Clone)]
enum Operand {
    Field(Vec<String>),
    Str(String),
    Int(i64),
    Bool(bool),
}

/// Parses nodes up to an `else…` or `end` action (returned as the stop word) or the end.
fn parse_block(tokens: &[Token], pos: &mut usize) -> Result<(Vec<Node>, Option<String>), Error> {
    let mut nodes = Vec::new();
    while let Some(token) = tokens.get(*pos) {
        *pos += 1;
        match token {
            Token::Text(t) => {
                if !t.is_empty() {
                    nodes.push(Node::Text(t.clone()));
                }
            }
            Token::Action(a) => {
                let (word, rest) = split_word(a);
                match word {
                    "end" | "else" => return Ok((nodes, Some(a.clone()))),
                    "if" => nodes.push(parse_if(rest, tokens, pos)?),
                    "range" | "with" | "define" | "template" | "include" | "block" => {
                        return err(format!("`{word}` is outside the supported subset"));
                    }
                    _ => nodes.push(Node::Print(parse_pipeline(a)?)),
                }
            }
        }
    }
    Ok((nodes, None))
}

fn parse_if(cond: &str, tokens: &[Token], pos: &mut usize) -> Result<Node, Error> {
    let mut branches = Vec::new();
    let mut cond = parse_pipeline(cond)?;
    loop {
        let (body, stop) = parse_block(tokens, pos)?;
        let Some(stop) = stop else {
            return err("`if` without `end`");
        };
        branches.push((cond, body));
        let (word, rest) = split_word(&stop);
        match word {
            "end" if rest.is_empty() => {
                return Ok(Node::If {
                    branches,
                    otherwise: Vec::new(),
                });
            }
            "else" if rest.is_empty() => {
                let (otherwise, stop) = parse_block(tokens, pos)?;
                return match stop.as_deref() {
                    Some("end") => Ok(Node::If {
                        branches,
                        otherwise,
                    }),
                    _ => err("`else` without `end`"),
                };
            }
            "else" => {
                let (word, rest) = split_word(rest);
                if word != "if" {
                    return err(format!("unsupported `else {word}`"));
                }
                cond = parse_pipeline(rest)?;
            }
            _ => return err(format!("unexpected `{stop}`")),
        }
    }
}

fn split_word(s: &str) -> (&str, &str) {
    match s.find(is_go_space) {
        Some(i) => (&s[..i], s[i..].trim_start_matches(is_go_space)),
        None => (s, ""),
    }
}

fn parse_pipeline(src: &str) -> Result<Pipeline, Error> {
    let words = split_words(src)?;
    let mut pipeline = Vec::new();
    for group in words.split(|w| w == "|") {
        let Some((first, rest)) = group.split_first() else {
            return err(format!("empty command in `{src}`"));
        };
        let (func, args) = if first.starts_with('.') || first.starts_with('"') || is_literal(first)
        {
            (String::new(), group)
        } else {
            (first.clone(), rest)
        };
        let args = args
            .iter()
            .map(|w| parse_operand(w))
            .collect::<Result<_, _>>()?;
        pipeline.push(Command { func, args });
    }
    Ok(pipeline)
}

fn is_literal(w: &str) -> bool {
    w == "true" || w == "false" || w.parse::<i64>().is_ok()
}

/// Splits on spaces, keeping double-quoted strings (with `\"` and `\\`) whole.
fn split_words(src: &str) -> Result<Vec<String>, Error> {
    let mut words = Vec::new();
    let mut chars = src.chars().peekable();
    while let Some(&c) = chars.peek() {
        if is_go_space(c) {
            chars.next();
        } else if c == '"' {
            let mut w = String::from('"');
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                w.push(c);
                if c == '\\' {
                    match chars.next() {
                        Some(n) => w.push(n),
                        None => break,
                    }
                } else if c == '"' {
                    closed = true;
                    break;
                }
            }
            if !closed {
                return err(format!("unterminated string in `{src}`"));
            }
            words.push(w);
        } else if c == '(' || c == ')' || c == '$' {
            return err(format!("`{c}` is outside the supported subset: `{src}`"));
        } else {
            let mut w = String::new();
            while let Some(&c) = chars.peek() {
                if is_go_space(c) {
                    break;
                }
                w.push(c);
                chars.next();
            }
            words.push(w);
        }
    }
    Ok(words)
}

fn parse_operand(w: &str) -> Result<Operand, Error> {
    if let Some(path) = w.strip_prefix('.') {
        if path.is_empty() {
            return Ok(Operand::Field(Vec::new()));
        }
        return Ok(Operand::Field(
            path.split('.').map(str::to_string).collect(),
        ));
    }
    if let Some(inner) = w.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
        let mut s = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some(c @ ('"' | '\\')) => s.push(c),
                    other => return err(format!("unsupported escape \\{other:?} in {w}")),
                }
            } else {
                s.push(c);
            }
        }
        return Ok(Operand::Str(s));
    }
    match w {
        "true" => return Ok(Operand::Bool(true)),
        "false" => return Ok(Operand::Bool(false)),
        _ => {}
    }
    w.parse()
        .map(Operand::Int)
        .map_err(|_| Error(format!("unsupported operand `{w}`")))
}

// ---------------------------------------------------------------- evaluation

fn exec(nodes: &[Node], ctx: &Context, out: &mut String) -> Result<(), Error> {
    for node in nodes {
        match node {
            Node::Text(t) => out.push_str(t),
            Node::Print(p) => out.push_str(&print(&eval_pipeline(p, ctx)?)?),
            Node::If {
                branches,
                otherwise,
            } => {
                let mut taken = false;
                for (cond, body) in branches {
                    if truthy(&eval_pipeline(cond, ctx)?) {
                        exec(body, ctx, out)?;
                        taken = true;
                        break;
                    }
                }
                if !taken {
                    exec(otherwise, ctx, out)?;
                }
            }
        }
    }
    Ok(())
}

fn eval_pipeline(p: &Pipeline, ctx: &Context) -> Result<Value, Error> {
    let mut piped: Option<Value> = None;
    for cmd in p {
        let mut args = cmd
            .args
            .iter()
            .map(|a| eval_operand(a, ctx))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(v) = piped.take() {
            args.push(v);
        }
        piped = Some(call(&cmd.func, args)?);
    }
    piped.ok_or_else(|| Error("empty pipeline".into()))
}

fn eval_operand(op: &Operand, ctx: &Context) -> Result<Value, Error> {
    match op {
        Operand::Str(s) => Ok(Value::String(s.clone())),
        Operand::Int(i) => Ok(Value::from(*i)),
        Operand::Bool(b) => Ok(Value::Bool(*b)),
        Operand::Field(path) => {
            let mut cur = &ctx.root;
            for (i, key) in path.iter().enumerate() {
                match cur {
                    Value::Mapping(m) => match m.get(key.as_str()) {
                        Some(v) => cur = v,
                        // A missing last key is nil (Go's zero value); deeper is an error.
                        None if i + 1 == path.len() => return Ok(Value::Null),
                        None => return err(format!("nil evaluating .{}", path[..=i].join("."))),
                    },
                    _ => {
                        return err(format!(
                            "cannot evaluate field {key} of .{}",
                            path[..i].join(".")
                        ));
                    }
                }
            }
            Ok(cur.clone())
        }
    }
}

fn call(func: &str, mut args: Vec<Value>) -> Result<Value, Error> {
    match (func, args.len()) {
        ("", 1) => Ok(args.remove(0)),
        ("", n) => err(format!("{n} operands without a function")),
        ("quote", _) => {
            let quoted: Vec<String> = args
                .iter()
                .filter(|v| !v.is_null())
                .map(|v| print(v).map(|s| go_quote(&s)))
                .collect::<Result<_, _>>()?;
            Ok(Value::String(quoted.join(" ")))
        }
        ("toYaml", 1) => Ok(Value::String(to_yaml(&args[0])?)),
        ("indent", 2) | ("nindent", 2) => {
            let Some(n) = args[0].as_u64() else {
                return err(format!("{func}: width is not a number"));
            };
            let pad = " ".repeat(n as usize);
            let text = print(&args[1])?;
            let indented = format!("{pad}{}", text.replace('\n', &format!("\n{pad}")));
            Ok(Value::String(if func == "nindent" {
                format!("\n{indented}")
            } else {
                indented
            }))
        }
        (f, n) => err(format!(
            "function `{f}` with {n} arguments is outside the supported subset"
        )),
    }
}

/// Go's `if` truth.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Sequence(s) => !s.is_empty(),
        Value::Mapping(m) => !m.is_empty(),
        Value::Tagged(t) => truthy(&t.value),
    }
}

/// How `{{ v }}` prints a scalar; maps, lists and missing values are errors.
fn print(v: &Value) -> Result<String, Error> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Null => err("printing a missing value"),
        _ => err(format!("printing a non-scalar value {v:?} (use toYaml)")),
    }
}

/// Go's `%q` for the strings charts quote (printable text).
fn go_quote(s: &str) -> String {
    let mut q = String::from('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            '\t' => q.push_str("\\t"),
            c if c.is_control() => q.push_str(&format!("\\x{:02x}", c as u32)),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

/// Helm's `toYaml`: keys sorted (it goes through JSON), no trailing newline.
pub fn to_yaml(v: &Value) -> Result<String, Error> {
    let text = yaml_serde::to_string(&sorted(v)).map_err(|e| Error(format!("toYaml: {e}")))?;
    Ok(text.trim_end_matches('\n').to_string())
}

fn sorted(v: &Value) -> Value {
    match v {
        Value::Mapping(m) => {
            let mut entries: Vec<(Value, Value)> =
                m.iter().map(|(k, v)| (k.clone(), sorted(v))).collect();
            entries.sort_by(|a, b| {
                let key = |v: &Value| yaml_serde::to_string(v).unwrap_or_default();
                key(&a.0).cmp(&key(&b.0))
            });
            Value::Mapping(entries.into_iter().collect())
        }
        Value::Sequence(s) => Value::Sequence(s.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(values: &str) -> Context {
        let values = yaml_serde::from_str(values).expect("test values parse");
        Context::new(
            "name: c\nversion: 1.2.3\nappVersion: \"4.5\"\n",
            values,
            "rel",
            "ns",
        )
        .expect("context")
    }

    fn r(t: &str, values: &str) -> String {
        render("t", t, &ctx(values)).expect("renders")
    }

    #[test]
    fn fields_and_release() {
        assert_eq!(
            r(
                "{{ .Release.Name }}/{{ .Release.Namespace }} {{ .Chart.AppVersion }} {{ .Chart.Version }} {{ .Values.a.b }}",
                "a: {b: 7}"
            ),
            "rel/ns 4.5 1.2.3 7"
        );
    }

    #[test]
    fn trim_markers_follow_go() {
        // `{{- ` eats every whitespace character before, ` -}}` every one after.
        assert_eq!(r("a \n\t {{- 1 }} b", ""), "a1 b");
        assert_eq!(r("a {{ 1 -}} \n\n b", ""), "a 1b");
        assert_eq!(r("a\n{{- /* c */ -}}\nb", ""), "ab");
        // a dash not followed by a space is not a trim marker
        assert!(render("t", "a {{-1}}", &ctx("")).is_ok_and(|s| s == "a -1"));
    }

    #[test]
    fn if_else_truthiness() {
        let t = "{{- if .Values.x }}yes{{- else if .Values.y }}y{{- else }}no{{- end }}";
        assert_eq!(r(t, "x: true"), "yes");
        assert_eq!(r(t, "x: false\ny: 1"), "y");
        assert_eq!(r(t, "x: {}\ny: \"\""), "no");
        assert_eq!(r(t, "y: []"), "no");
        assert_eq!(r(t, "x: [1]"), "yes");
    }

    #[test]
    fn pipelines_quote_toyaml_nindent() {
        assert_eq!(r("{{ .Values.s | quote }}", "s: 'a\"b'"), "\"a\\\"b\"");
        assert_eq!(r("{{ quote .Values.b }}", "b: true"), "\"true\"");
        assert_eq!(
            r(
                "k:\n  {{- toYaml .Values.m | nindent 2 }}\n",
                "m: {z: 1, a: [x, y]}"
            ),
            "k:\n  a:\n  - x\n  - y\n  z: 1\n"
        );
        assert_eq!(r("{{ \"a\\nb\" | indent 2 }}", ""), "  a\n  b");
    }

    #[test]
    fn outside_the_subset_is_an_error() {
        for t in [
            "{{ range .Values.l }}{{ end }}",
            "{{ include \"x\" . }}",
            "{{ .Values.a | default 1 }}",
            "{{ $x := 1 }}",
            "{{ if .Values.a }}",
            "{{ end }}",
            "{{ .Values.missing }}",
            "{{ .Values.missing.deeper }}",
            "{{ .Values.m }}",
            "{{ 1",
        ] {
            assert!(
                render("t", t, &ctx("m: {a: 1}")).is_err(),
                "{t} should fail"
            );
        }
    }
}
