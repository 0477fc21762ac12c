//! The patch types the sandbox API server accepts: JSON merge patch (RFC 7396) and JSON
//! patch (RFC 6902: add, remove, replace, test, move, copy), both applied by the `json-patch`
//! crate; strategic merge patch (merge semantics, lists of containers/conditions/... merged by
//! their key, other lists replaced, `$` directives dropped) and server-side apply (a merge of
//! the given fields; no field ownership, no conflicts), which that crate does not know, are
//! ours.

use serde_json::{Map, Value};

use super::store::ApiError;

/// A PATCH content type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PatchKind {
    Merge,
    Strategic,
    Json,
    Apply,
}

impl PatchKind {
    /// From the media type of a `Content-Type` header (parameters ignored).
    pub fn from_content_type(content_type: &str) -> Option<PatchKind> {
        let media = content_type.split(';').next().unwrap_or("").trim();
        match media {
            "application/merge-patch+json" => Some(PatchKind::Merge),
            "application/strategic-merge-patch+json" => Some(PatchKind::Strategic),
            "application/json-patch+json" => Some(PatchKind::Json),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => {
                Some(PatchKind::Apply)
            }
            _ => None,
        }
    }
}

/// Parses a server-side apply body (YAML or JSON) into an object.
pub(crate) fn parse_apply_body(body: &[u8]) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("the apply patch is not UTF-8"))?;
    let value: Value = yaml_serde::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML apply patch: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the apply patch is not an object"));
    }
    Ok(value)
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))
}

/// Applies a patch of `kind` to `current`, returning the patched object.
pub(crate) fn apply(kind: PatchKind, current: &Value, body: &[u8]) -> Result<Value, ApiError> {
    let mut doc = current.clone();
    match kind {
        PatchKind::Merge => {
            let patch: Value = parse_json(body)?;
            if !patch.is_object() {
                return Err(ApiError::bad_request("a merge patch must be a JSON object"));
            }
            json_patch::merge(&mut doc, &patch);
        }
        PatchKind::Strategic => {
            let patch: Value = parse_json(body)?;
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "a strategic merge patch must be a JSON object",
                ));
            }
            strategic_merge(&mut doc, &patch);
        }
        PatchKind::Apply => {
            let patch = parse_apply_body(body)?;
            strategic_merge(&mut doc, &patch);
        }
        PatchKind::Json => {
            let ops: json_patch::Patch = parse_json(body)?;
            // On a copy: a failed operation leaves `current` as it was (no undo needed).
            json_patch::patch_unsafe(&mut doc, &ops)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
        }
    }
    Ok(doc)
}

/// The merge key of well-known lists in a strategic merge patch.
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "conditions" | "addresses" => Some("type"),
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "volumeMounts"
        | "containerStatuses"
        | "initContainerStatuses"
        | "imagePullSecrets" => Some("name"),
        _ => None,
    }
}

fn strategic_merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else {
        return;
    };
    for (k, v) in patch {
        if k.starts_with('$') {
            continue;
        }
        match v {
            Value::Null => {
                target.remove(k);
            }
            Value::Array(items) => match (merge_key(k), target.get_mut(k)) {
                (Some(key), Some(Value::Array(existing))) => {
                    for item in items {
                        let id = item.get(key);
                        match existing
                            .iter_mut()
                            .find(|e| id.is_some() && e.get(key) == id)
                        {
                            Some(slot) => strategic_merge(slot, item),
                            None => {
                                let mut fresh = Value::Object(Map::new());
                                strategic_merge(&mut fresh, item);
                                existing.push(fresh);
                            }
                        }
                    }
                }
                _ => {
                    target.insert(k.clone(), strip_directives(v));
                }
            },
            _ => strategic_merge(target.entry(k.clone()).or_insert(Value::Null), v),
        }
    }
}

fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(strip_directives).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_sets_and_removes() {
        let doc = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        let patch = json!({"a": {"b": null, "d": 3}, "l": [3]});
        let doc = apply(PatchKind::Merge, &doc, patch.to_string().as_bytes()).expect("applies");
        assert_eq!(doc, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }

    #[test]
    fn strategic_merges_conditions_by_type() {
        let doc = json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}});
        let patch = br#"{"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "True"}]}, "$setElementOrder/x": []}"#;
        let out = apply(PatchKind::Strategic, &doc, patch).expect("applies");
        assert_eq!(
            out,
            json!({"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "True"}]}})
        );
    }

    #[test]
    fn json_patch_ops() {
        let doc = json!({"metadata": {"labels": {"a/b": "1"}}, "l": [1, 2, 3]});
        let ops = json!([
            {"op": "test", "path": "/metadata/labels/a~1b", "value": "1"},
            {"op": "replace", "path": "/metadata/labels/a~1b", "value": "2"},
            {"op": "add", "path": "/l/-", "value": 4},
            {"op": "remove", "path": "/l/0"},
            {"op": "copy", "from": "/l/0", "path": "/first"},
            {"op": "move", "from": "/first", "path": "/moved"},
        ]);
        let out = apply(PatchKind::Json, &doc, ops.to_string().as_bytes()).expect("applies");
        assert_eq!(
            out,
            json!({"metadata": {"labels": {"a/b": "2"}}, "l": [2, 3, 4], "moved": 2})
        );
    }

    /// What each operation does, as the former hand-written RFC 6902 code answered it (the
    /// same table passed there, but the whole-document replace): pointers with escapes, array
    /// ends and indices, moves and copies across arrays and objects.
    #[test]
    fn json_patch_results_are_the_same_as_before() {
        let doc = json!({
            "metadata": {"name": "p", "annotations": {"a/b": "1", "c~d": "2"}},
            "spec": {"containers": [{"name": "x"}, {"name": "y"}]},
            "l": [1, 2, 3],
        });
        let cases = [
            (
                json!([{"op": "add", "path": "/l/1", "value": 9}]),
                json!([1, 9, 2, 3]),
                "/l",
            ),
            (
                json!([{"op": "add", "path": "/l/-", "value": 4}]),
                json!([1, 2, 3, 4]),
                "/l",
            ),
            (
                json!([{"op": "add", "path": "/l/3", "value": 4}]),
                json!([1, 2, 3, 4]),
                "/l",
            ),
            (
                json!([{"op": "replace", "path": "/l/2", "value": 0}]),
                json!([1, 2, 0]),
                "/l",
            ),
            (
                json!([{"op": "remove", "path": "/metadata/annotations/c~0d"}]),
                json!({"a/b": "1"}),
                "/metadata/annotations",
            ),
            (
                json!([{"op": "add", "path": "/metadata/annotations/a~1b", "value": "3"}]),
                json!({"a/b": "3", "c~d": "2"}),
                "/metadata/annotations",
            ),
            (
                json!([
                    {"op": "move", "from": "/spec/containers/1", "path": "/spec/containers/0"}
                ]),
                json!([{"name": "y"}, {"name": "x"}]),
                "/spec/containers",
            ),
            (
                json!([{"op": "copy", "from": "/metadata/name", "path": "/spec/containers/-"}]),
                json!([{"name": "x"}, {"name": "y"}, "p"]),
                "/spec/containers",
            ),
            (
                json!([
                    {"op": "test", "path": "/spec/containers/0", "value": {"name": "x"}},
                    {"op": "add", "path": "/spec/containers/0/env", "value": []},
                    {"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "E"}},
                ]),
                json!([{"name": "x", "env": [{"name": "E"}]}, {"name": "y"}]),
                "/spec/containers",
            ),
            (
                json!([{"op": "add", "path": "", "value": [1]}]),
                json!([1]),
                "",
            ),
        ];
        for (ops, want, at) in cases {
            let out = apply(PatchKind::Json, &doc, ops.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{ops}: {}", e.message));
            let got = out.pointer(at).expect("the path is there");
            assert_eq!(got.to_string(), want.to_string(), "{ops}");
        }
        // RFC 6902 allows replacing the whole document, which the former code refused
        // ("cannot remove the whole document"): the one difference.
        let ops = json!([{"op": "replace", "path": "", "value": {"whole": true}}]);
        let out = apply(PatchKind::Json, &doc, ops.to_string().as_bytes()).expect("applies");
        assert_eq!(out, json!({"whole": true}));
        // Failures are errors.
        for ops in [
            json!([{"op": "add", "path": "/l/5", "value": 1}]),
            json!([{"op": "remove", "path": "/l/3"}]),
            json!([{"op": "remove", "path": ""}]),
            json!([{"op": "move", "from": "/missing", "path": "/x"}]),
            json!([{"op": "add", "path": "/x", "value": 1}, {"op": "test", "path": "/x", "value": 2}]),
            json!([{"op": "add", "path": "no-slash", "value": 1}]),
        ] {
            assert!(
                apply(PatchKind::Json, &doc, ops.to_string().as_bytes()).is_err(),
                "{ops}"
            );
        }
    }

    #[test]
    fn json_patch_failures_are_errors() {
        let doc = json!({"a": 1});
        for ops in [
            json!([{"op": "test", "path": "/a", "value": 2}]),
            json!([{"op": "remove", "path": "/missing"}]),
            json!([{"op": "replace", "path": "/missing", "value": 1}]),
            json!([{"op": "frobnicate", "path": "/a"}]),
            json!({"op": "add"}),
            json!([{"op": "add", "path": "/x/y", "value": 1}]),
        ] {
            assert!(apply(PatchKind::Json, &doc, ops.to_string().as_bytes()).is_err());
        }
        assert!(apply(PatchKind::Merge, &doc, b"not json").is_err());
        assert!(apply(PatchKind::Apply, &doc, b"- a\n- b").is_err());
    }

    #[test]
    fn content_types() {
        assert_eq!(
            PatchKind::from_content_type("application/merge-patch+json; charset=utf-8"),
            Some(PatchKind::Merge)
        );
        assert_eq!(PatchKind::from_content_type("text/plain"), None);
    }
}
