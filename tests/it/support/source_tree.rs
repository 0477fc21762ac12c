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
