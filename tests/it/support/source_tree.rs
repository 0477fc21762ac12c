//! Files of the source tree as the packaging tests read them: a path under the repository,
//! a file's text, and the YAML documents of a text.

use std::path::PathBuf;

/// A path in the source tree.
pub(crate) fn repo_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Text of a file in the source tree.
pub(crate) fn read(rel: &str) -> String {
    let path = repo_path(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The YAML documents of `text`, empty documents left out (as `kubectl apply` and Helm do).
pub(crate) fn yaml_documents(name: &str, text: &str) -> Vec<yaml_serde::Value> {
    use serde::Deserialize;
    yaml_serde::Deserializer::from_str(text)
        .map(|d| {
            yaml_serde::Value::deserialize(d).unwrap_or_else(|e| panic!("{name}: bad YAML: {e}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// A generated file of the source tree kept equal to `expected`: with
/// `GPUSHARE_UPDATE_GOLDEN=1` it is rewritten, else a difference fails with the command that
/// regenerates it (`regenerate`).
pub(crate) fn assert_generated(rel: &str, expected: &str, regenerate: &str) {
    let path = repo_path(rel);
    if std::env::var_os("GPUSHARE_UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&path, expected).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    if actual != expected {
        let first = actual
            .lines()
            .zip(expected.lines())
            .position(|(a, e)| a != e)
            .unwrap_or(actual.lines().count().min(expected.lines().count()));
        panic!(
            "{rel} is out of date (first difference at line {}: {:?}, expected {:?}); \
             regenerate it with `{regenerate}`",
            first + 1,
            actual.lines().nth(first).unwrap_or("<end>"),
            expected.lines().nth(first).unwrap_or("<end>"),
        );
    }
}
