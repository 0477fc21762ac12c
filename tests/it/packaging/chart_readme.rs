//! The chart's `README.md`: its values table is generated from `values.yaml` (every value, its
//! default, and the comment above it), between two markers; the rest is written by hand.
//! `make chart` rewrites the table; the test fails with that command when it is out of date.
//!
//! The generator reads `values.yaml` line by line for the comments and takes each default
//! from the parsed file; a value whose schema (`values.schema.json`) has `properties` is a
//! section and gets its own row only when it has a comment; everything under a value that
//! is not a section (lists, free-form maps such as `affinity`) is its default.

use serde_json::Value;

use crate::support::helm_chart::CHART;
use crate::support::source_tree::{assert_generated, read};

const README: &str = "packaging/helm/gpushare/README.md";
const BEGIN: &str =
    "<!-- values table: generated from values.yaml by `make chart`; do not edit -->";
const END: &str = "<!-- end of the values table -->";

/// One row: the value's dotted path, its default (compact JSON), its comment.
struct Row {
    path: String,
    default: Option<String>,
    comment: String,
}

/// The rows of `values.yaml`, in file order.
fn rows(values_yaml: &str, values: &Value, schema: &Value) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut comment: Vec<String> = Vec::new();
    // (indent, key) of the enclosing sections.
    let mut stack: Vec<(usize, String)> = Vec::new();
    // Inside a leaf's block (a list, a free-form map): lines indented deeper than this.
    let mut inside_leaf: Option<usize> = None;
    for line in values_yaml.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            comment.clear();
            continue;
        }
        if let Some(leaf) = inside_leaf {
            if indent > leaf || trimmed.starts_with("- ") && indent == leaf {
                continue;
            }
            inside_leaf = None;
        }
        if let Some(text) = trimmed.strip_prefix('#') {
            comment.push(text.trim().to_string());
            continue;
        }
        let Some((key, rest)) = trimmed.split_once(':') else {
            comment.clear();
            continue;
        };
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        let path: Vec<String> = stack
            .iter()
            .map(|(_, k)| k.clone())
            .chain(std::iter::once(key.to_string()))
            .collect();
        let value = path.iter().fold(values, |v, k| &v[k.as_str()]);
        let value_schema = path
            .iter()
            .fold(schema, |s, k| &s["properties"][k.as_str()]);
        let section = value_schema.get("properties").is_some() && key != "config";
        let text = comment.join(" ");
        comment.clear();
        if section {
            if !text.is_empty() {
                rows.push(Row {
                    path: path.join("."),
                    default: None,
                    comment: text,
                });
            }
            stack.push((indent, key.to_string()));
        } else {
            if rest.trim().is_empty() {
                inside_leaf = Some(indent);
            }
            rows.push(Row {
                path: path.join("."),
                default: Some(serde_json::to_string(value).expect("JSON")),
                comment: text,
            });
        }
    }
    rows
}

/// The generated table (markers included).
fn table() -> String {
    let text = read(&format!("{CHART}/values.yaml"));
    let values: Value = yaml_serde::from_str(&text).expect("values.yaml");
    let schema: Value =
        serde_json::from_str(&read(&format!("{CHART}/values.schema.json"))).expect("schema");
    let cell = |s: &str| s.replace('|', "\\|");
    let mut out = format!("{BEGIN}\n\n| Value | Default | Description |\n|---|---|---|\n");
    for row in rows(&text, &values, &schema) {
        let default = row
            .default
            .map(|d| format!("`{}`", cell(&d)))
            .unwrap_or_default();
        out.push_str(&format!(
            "| `{}` | {default} | {} |\n",
            row.path,
            cell(&row.comment)
        ));
    }
    out.push('\n');
    out.push_str(END);
    out
}

#[test]
fn the_chart_readme_values_table_is_generated_from_values_yaml() {
    let readme = read(README);
    let (Some(begin), Some(end)) = (readme.find(BEGIN), readme.find(END)) else {
        panic!("{README} has no `{BEGIN}` … `{END}` markers");
    };
    let expected = format!(
        "{}{}{}",
        &readme[..begin],
        table(),
        &readme[end + END.len()..]
    );
    assert_generated(README, &expected, "make chart");
}

#[test]
fn every_value_has_a_row() {
    let text = read(&format!("{CHART}/values.yaml"));
    let values: Value = yaml_serde::from_str(&text).expect("values.yaml");
    let schema: Value =
        serde_json::from_str(&read(&format!("{CHART}/values.schema.json"))).expect("schema");
    let paths: Vec<String> = rows(&text, &values, &schema)
        .into_iter()
        .filter(|r| r.default.is_some())
        .map(|r| r.path)
        .collect();
    for expected in [
        "image.tag",
        "logLevel",
        "extender.gpuPolicy",
        "extender.tls.certificates",
        "extender.networkPolicy.schedulerCIDRs",
        "devicePlugin.memoryUnit",
        "devicePlugin.kmsg",
        "scheduler.mode",
        "webhook.tls.secretName",
        "config",
    ] {
        assert!(paths.iter().any(|p| p == expected), "no row {expected}");
    }
    // A free-form value's inside is its default, not rows of its own.
    assert!(!paths.iter().any(|p| p.starts_with("extender.affinity.")));
    assert!(!paths.iter().any(|p| p.starts_with("extender.tolerations.")));
}
