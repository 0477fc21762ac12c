//! The patch types the sandbox API server accepts: JSON merge patch (RFC 7386), strategic
//! merge patch (merge semantics, lists of containers/conditions/... merged by their key,
//! other lists replaced, `$` directives dropped), JSON patch (RFC 6902: add, remove,
//! replace, test, move, copy) and server-side apply (a merge of the given fields; no field
//! ownership, no conflicts).

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

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))
}

/// Applies a patch of `kind` to `current`, returning the patched object.
pub(crate) fn apply(kind: PatchKind, current: &Value, body: &[u8]) -> Result<Value, ApiError> {
    let mut doc = current.clone();
    match kind {
        PatchKind::Merge => {
            let patch = parse_json(body)?;
            if !patch.is_object() {
                return Err(ApiError::bad_request("a merge patch must be a JSON object"));
            }
            merge(&mut doc, &patch);
        }
        PatchKind::Strategic => {
            let patch = parse_json(body)?;
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
            let ops = parse_json(body)?;
            json_patch(&mut doc, &ops).map_err(ApiError::bad_request)?;
        }
    }
    Ok(doc)
}

/// RFC 7386 merge.
pub(crate) fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(target) = target {
        for (k, v) in patch {
            if v.is_null() {
                target.remove(k);
            } else {
                merge(target.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
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

/// The reference tokens of a JSON pointer.
fn pointer_tokens(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let rest = pointer
        .strip_prefix('/')
        .ok_or_else(|| format!("invalid JSON pointer {pointer:?}"))?;
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn array_index(token: &str, len: usize, allow_end: bool) -> Result<usize, String> {
    if allow_end && token == "-" {
        return Ok(len);
    }
    let index: usize = token
        .parse()
        .map_err(|_| format!("invalid array index {token:?}"))?;
    let max = if allow_end {
        len
    } else {
        len.saturating_sub(1)
    };
    if index > max || (!allow_end && len == 0) {
        return Err(format!("array index {index} out of bounds"));
    }
    Ok(index)
}

fn parent<'a>(doc: &'a mut Value, tokens: &[String], path: &str) -> Result<&'a mut Value, String> {
    let mut cur = doc;
    for token in tokens {
        cur = match cur {
            Value::Object(o) => o
                .get_mut(token)
                .ok_or_else(|| format!("path {path:?} does not exist"))?,
            Value::Array(a) => {
                let i = array_index(token, a.len(), false)?;
                &mut a[i]
            }
            _ => return Err(format!("path {path:?} does not exist")),
        };
    }
    Ok(cur)
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let tokens = pointer_tokens(path)?;
    let Some((last, init)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    match parent(doc, init, path)? {
        Value::Object(o) => {
            o.insert(last.clone(), value);
        }
        Value::Array(a) => {
            let i = array_index(last, a.len(), true)?;
            a.insert(i, value);
        }
        _ => return Err(format!("path {path:?} does not exist")),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let tokens = pointer_tokens(path)?;
    let Some((last, init)) = tokens.split_last() else {
        return Err("cannot remove the whole document".into());
    };
    match parent(doc, init, path)? {
        Value::Object(o) => o
            .remove(last)
            .ok_or_else(|| format!("path {path:?} does not exist")),
        Value::Array(a) => {
            let i = array_index(last, a.len(), false)?;
            Ok(a.remove(i))
        }
        _ => Err(format!("path {path:?} does not exist")),
    }
}

fn get(doc: &Value, path: &str) -> Result<Value, String> {
    let tokens = pointer_tokens(path)?;
    let mut cur = doc;
    for token in &tokens {
        cur = match cur {
            Value::Object(o) => o.get(token),
            Value::Array(a) => array_index(token, a.len(), false)
                .ok()
                .and_then(|i| a.get(i)),
            _ => None,
        }
        .ok_or_else(|| format!("path {path:?} does not exist"))?;
    }
    Ok(cur.clone())
}

/// RFC 6902 JSON patch, applied atomically by the caller (on a copy).
pub(crate) fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops
        .as_array()
        .ok_or("a JSON patch must be an array of operations")?;
    for op in ops {
        let name = op
            .get("op")
            .and_then(Value::as_str)
            .ok_or("a JSON patch operation needs \"op\"")?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or("a JSON patch operation needs \"path\"")?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| format!("operation {name:?} needs \"value\""))
        };
        let from = || {
            op.get("from")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("operation {name:?} needs \"from\""))
        };
        match name {
            "add" => add(doc, path, value()?)?,
            "remove" => {
                remove(doc, path)?;
            }
            "replace" => {
                remove(doc, path)?;
                add(doc, path, value()?)?;
            }
            "test" => {
                if get(doc, path)? != value()? {
                    return Err(format!("test operation failed at {path:?}"));
                }
            }
            "move" => {
                let moved = remove(doc, from()?)?;
                add(doc, path, moved)?;
            }
            "copy" => {
                let copied = get(doc, from()?)?;
                add(doc, path, copied)?;
            }
            other => return Err(format!("unknown JSON patch operation {other:?}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_sets_and_removes() {
        let mut doc = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge(&mut doc, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
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
