//! Label and field selectors as the API server parses them from `labelSelector` and
//! `fieldSelector`. Label selectors support `=`, `==`, `!=`, `in`, `notin`, existence and
//! `!` non-existence; field selectors support `=`, `==`, `!=` on any dotted field path (a
//! missing field reads as the empty string). No set-based `>`/`<`.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

#[derive(Debug, Clone, PartialEq)]
struct FieldRequirement {
    path: String,
    equals: bool,
    value: String,
}

/// A parsed `labelSelector` plus `fieldSelector`; empty matches everything.
#[derive(Debug, Clone, Default)]
pub(crate) struct Selectors {
    labels: Vec<LabelRequirement>,
    fields: Vec<FieldRequirement>,
}

impl Selectors {
    /// Parses both selectors; `Err` carries a message for a 400 answer.
    pub fn parse(label: Option<&str>, field: Option<&str>) -> Result<Selectors, String> {
        let mut selectors = Selectors::default();
        if let Some(label) = label {
            for part in split_top_level(label) {
                let part = part.trim();
                if !part.is_empty() {
                    selectors.labels.push(parse_label(part)?);
                }
            }
        }
        if let Some(field) = field {
            for part in field.split(',') {
                let part = part.trim();
                if !part.is_empty() {
                    selectors.fields.push(parse_field(part)?);
                }
            }
        }
        Ok(selectors)
    }

    /// Whether there is no requirement at all (everything matches).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    /// Whether `obj` matches every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.get("metadata").and_then(|m| m.get("labels"));
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|req| match req {
            LabelRequirement::Equals(k, v) => label(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelRequirement::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelRequirement::Exists(k) => label(k).is_some(),
            LabelRequirement::NotExists(k) => label(k).is_none(),
        });
        labels_ok
            && self
                .fields
                .iter()
                .all(|req| (field_value(obj, &req.path) == req.value) == req.equals)
    }
}

/// Splits at commas outside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_label(part: &str) -> Result<LabelRequirement, String> {
    let bad = || format!("unable to parse requirement: {part:?}");
    if let Some(key) = part.strip_prefix('!') {
        let key = key.trim();
        return if valid_key(key) {
            Ok(LabelRequirement::NotExists(key.to_string()))
        } else {
            Err(bad())
        };
    }
    if let Some(open) = part.find('(') {
        let head: Vec<&str> = part[..open].split_whitespace().collect();
        let inner = part[open + 1..].strip_suffix(')').ok_or_else(bad)?;
        let values: Vec<String> = inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect();
        if head.len() != 2 || !valid_key(head[0]) || !values.iter().all(|v| valid_value(v)) {
            return Err(bad());
        }
        let key = head[0].to_string();
        return match head[1] {
            "in" => Ok(LabelRequirement::In(key, values)),
            "notin" => Ok(LabelRequirement::NotIn(key, values)),
            _ => Err(bad()),
        };
    }
    let (key, value, equals) = if let Some((k, v)) = part.split_once("!=") {
        (k, v, false)
    } else if let Some((k, v)) = part.split_once("==") {
        (k, v, true)
    } else if let Some((k, v)) = part.split_once('=') {
        (k, v, true)
    } else {
        return if valid_key(part) {
            Ok(LabelRequirement::Exists(part.to_string()))
        } else {
            Err(bad())
        };
    };
    let (key, value) = (key.trim(), value.trim());
    if !valid_key(key) || !valid_value(value) {
        return Err(bad());
    }
    Ok(if equals {
        LabelRequirement::Equals(key.to_string(), value.to_string())
    } else {
        LabelRequirement::NotEquals(key.to_string(), value.to_string())
    })
}

fn parse_field(part: &str) -> Result<FieldRequirement, String> {
    let (path, value, equals) = if let Some((k, v)) = part.split_once("!=") {
        (k, v, false)
    } else if let Some((k, v)) = part.split_once("==") {
        (k, v, true)
    } else if let Some((k, v)) = part.split_once('=') {
        (k, v, true)
    } else {
        return Err(format!("invalid selector: {part:?}; can't understand it"));
    };
    let path = path.trim();
    if path.is_empty() || path.split('.').any(str::is_empty) {
        return Err(format!("invalid field selector path in {part:?}"));
    }
    Ok(FieldRequirement {
        path: path.to_string(),
        equals,
        value: value.trim().to_string(),
    })
}

/// The string value at a dotted path (`""` when missing or null).
fn field_value(obj: &Value, path: &str) -> String {
    let mut cur = obj;
    for step in path.split('.') {
        match cur.get(step) {
            Some(next) => cur = next,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value, node: Option<&str>, phase: &str) -> Value {
        json!({ "metadata": { "name": "p", "namespace": "ns", "labels": labels },
                "spec": { "nodeName": node }, "status": { "phase": phase } })
    }

    fn sel(label: &str, field: &str) -> Selectors {
        Selectors::parse(Some(label), Some(field)).expect("parses")
    }

    #[test]
    fn label_operators() {
        let p = pod(json!({"app": "a", "tier": "web"}), None, "Running");
        assert!(sel("app=a", "").matches(&p));
        assert!(sel("app==a,tier", "").matches(&p));
        assert!(!sel("app!=a", "").matches(&p));
        assert!(sel("missing!=x", "").matches(&p));
        assert!(sel("!missing", "").matches(&p));
        assert!(!sel("!app", "").matches(&p));
        assert!(sel("app in (b, a),tier notin (db)", "").matches(&p));
        assert!(!sel("app in (b,c)", "").matches(&p));
        assert!(sel("missing notin (x)", "").matches(&p));
    }

    #[test]
    fn field_operators() {
        let unbound = pod(json!({}), None, "Pending");
        let bound = pod(json!({}), Some("n1"), "Succeeded");
        assert!(sel("", "spec.nodeName=").matches(&unbound));
        assert!(!sel("", "spec.nodeName=").matches(&bound));
        assert!(sel("", "spec.nodeName=n1,status.phase!=Failed").matches(&bound));
        assert!(!sel("", "status.phase!=Succeeded").matches(&bound));
        assert!(sel("", "metadata.name=p,metadata.namespace==ns").matches(&bound));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in ["app in (a", "a b c", "=x", "app=(", "!", "k notin"] {
            assert!(Selectors::parse(Some(bad), None).is_err(), "{bad}");
        }
        for bad in ["nofield", "=x", "a..b=c"] {
            assert!(Selectors::parse(None, Some(bad)).is_err(), "{bad}");
        }
    }
}
