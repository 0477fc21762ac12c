//! Upstream's field errors (`k8s.io/apimachinery/pkg/util/validation/field`) and the checks
//! of names they are made from (`util/validation`: DNS-1123 labels and subdomains, qualified
//! names, label values, C identifiers), with upstream's wording, and the 422 `Invalid` Status
//! that carries them (`errors.NewInvalid`: one message of every error, one cause each).
//!
//! Paths are built as upstream prints them (`spec.devices[0].attributes[gpushare.io/uuid]`).
//! Values of a Go type other than a string, integer or bool are printed as JSON, not as Go's
//! `%#v` of the internal type.

use std::fmt;

use serde_json::{Value, json};

use super::discovery::ResourceDef;
use super::store::ApiError;

/// A field path under construction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Path(String);

impl Path {
    pub fn new(root: &str) -> Path {
        Path(root.to_string())
    }

    pub fn child(&self, name: &str) -> Path {
        if self.0.is_empty() {
            Path(name.to_string())
        } else {
            Path(format!("{}.{name}", self.0))
        }
    }

    pub fn index(&self, i: usize) -> Path {
        Path(format!("{}[{i}]", self.0))
    }

    /// A map key (long keys are shortened by the caller, see `truncated`).
    pub fn key(&self, key: &str) -> Path {
        Path(format!("{}[{key}]", self.0))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The value an error reports.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum BadValue {
    Str(String),
    Int(i64),
    Bool(bool),
    /// Printed as is (a JSON rendering of a structure).
    Raw(String),
    Null,
}

impl From<&str> for BadValue {
    fn from(s: &str) -> BadValue {
        BadValue::Str(s.to_string())
    }
}

impl From<String> for BadValue {
    fn from(s: String) -> BadValue {
        BadValue::Str(s)
    }
}

impl From<i64> for BadValue {
    fn from(n: i64) -> BadValue {
        BadValue::Int(n)
    }
}

impl From<usize> for BadValue {
    fn from(n: usize) -> BadValue {
        BadValue::Int(n as i64)
    }
}

impl From<&Value> for BadValue {
    fn from(v: &Value) -> BadValue {
        match v {
            Value::String(s) => BadValue::Str(s.clone()),
            Value::Bool(b) => BadValue::Bool(*b),
            Value::Number(n) => n
                .as_i64()
                .map(BadValue::Int)
                .unwrap_or_else(|| BadValue::Raw(n.to_string())),
            Value::Null => BadValue::Null,
            other => BadValue::Raw(other.to_string()),
        }
    }
}

/// Upstream's `field.ErrorType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorType {
    Required,
    Duplicate,
    Invalid,
    NotSupported,
    Forbidden,
    TooLong,
    TooMany,
}

impl ErrorType {
    /// The cause type of a Status (`FieldValueRequired`, ...).
    fn reason(self) -> &'static str {
        match self {
            ErrorType::Required => "FieldValueRequired",
            ErrorType::Duplicate => "FieldValueDuplicate",
            ErrorType::Invalid => "FieldValueInvalid",
            ErrorType::NotSupported => "FieldValueNotSupported",
            ErrorType::Forbidden => "FieldValueForbidden",
            ErrorType::TooLong => "FieldValueTooLong",
            ErrorType::TooMany => "FieldValueTooMany",
        }
    }

    fn text(self) -> &'static str {
        match self {
            ErrorType::Required => "Required value",
            ErrorType::Duplicate => "Duplicate value",
            ErrorType::Invalid => "Invalid value",
            ErrorType::NotSupported => "Unsupported value",
            ErrorType::Forbidden => "Forbidden",
            ErrorType::TooLong => "Too long",
            ErrorType::TooMany => "Too many",
        }
    }
}

/// One field error.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct FieldError {
    pub kind: ErrorType,
    pub field: String,
    pub value: BadValue,
    pub detail: String,
}

impl FieldError {
    fn new(kind: ErrorType, path: &Path, value: BadValue, detail: impl Into<String>) -> FieldError {
        FieldError {
            kind,
            field: path.as_str().to_string(),
            value,
            detail: detail.into(),
        }
    }

    pub fn required(path: &Path, detail: impl Into<String>) -> FieldError {
        FieldError::new(
            ErrorType::Required,
            path,
            BadValue::Str(String::new()),
            detail,
        )
    }

    pub fn forbidden(path: &Path, detail: impl Into<String>) -> FieldError {
        FieldError::new(
            ErrorType::Forbidden,
            path,
            BadValue::Str(String::new()),
            detail,
        )
    }

    pub fn invalid(
        path: &Path,
        value: impl Into<BadValue>,
        detail: impl Into<String>,
    ) -> FieldError {
        FieldError::new(ErrorType::Invalid, path, value.into(), detail)
    }

    pub fn duplicate(path: &Path, value: impl Into<BadValue>) -> FieldError {
        FieldError::new(ErrorType::Duplicate, path, value.into(), "")
    }

    pub fn not_supported(path: &Path, value: impl Into<BadValue>, valid: &[&str]) -> FieldError {
        let valid: Vec<String> = valid.iter().map(|v| format!("{v:?}")).collect();
        FieldError::new(
            ErrorType::NotSupported,
            path,
            value.into(),
            format!("supported values: {}", valid.join(", ")),
        )
    }

    pub fn too_long(path: &Path, max: usize) -> FieldError {
        FieldError::new(
            ErrorType::TooLong,
            path,
            BadValue::Str(String::new()),
            format!("may not be more than {max} bytes"),
        )
    }

    pub fn too_many(path: &Path, actual: usize, max: usize) -> FieldError {
        FieldError::new(
            ErrorType::TooMany,
            path,
            BadValue::Int(actual as i64),
            format!("must have at most {max} items"),
        )
    }

    /// Upstream's `ErrorBody`: the type, the value (not for Required, Forbidden and TooLong),
    /// the detail.
    pub fn body(&self) -> String {
        let mut s = match self.kind {
            ErrorType::Required | ErrorType::Forbidden | ErrorType::TooLong => {
                self.kind.text().to_string()
            }
            _ => {
                let value = match &self.value {
                    BadValue::Str(s) => format!("{s:?}"),
                    BadValue::Int(n) => n.to_string(),
                    BadValue::Bool(b) => b.to_string(),
                    BadValue::Raw(r) => r.clone(),
                    BadValue::Null => "null".to_string(),
                };
                format!("{}: {value}", self.kind.text())
            }
        };
        if !self.detail.is_empty() {
            s.push_str(": ");
            s.push_str(&self.detail);
        }
        s
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

/// The 422 `Invalid` Status for `errors` on object `name` of `def` (upstream's
/// `errors.NewInvalid`).
pub(crate) fn invalid_status(def: &ResourceDef, name: &str, errors: &[FieldError]) -> ApiError {
    invalid_status_of(def.kind, def.group, name, errors)
}

/// The 422 `Invalid` Status for `errors` on object `name` of `kind` in API group `group`
/// (empty: the core group), e.g. a list's `ListOptions.meta.k8s.io`.
pub(crate) fn invalid_status_of(
    kind: &str,
    group: &str,
    name: &str,
    errors: &[FieldError],
) -> ApiError {
    let qualified = if group.is_empty() {
        kind.to_string()
    } else {
        format!("{kind}.{group}")
    };
    let listed: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let message = match listed.as_slice() {
        [] => format!("{qualified} {name:?} is invalid"),
        [one] => format!("{qualified} {name:?} is invalid: {one}"),
        many => format!("{qualified} {name:?} is invalid: [{}]", many.join(", ")),
    };
    let causes: Vec<Value> = errors
        .iter()
        .map(|e| json!({ "reason": e.kind.reason(), "message": e.body(), "field": e.field }))
        .collect();
    let mut details = json!({ "name": name, "kind": kind, "causes": causes });
    if !group.is_empty() {
        details["group"] = json!(group);
    }
    ApiError {
        code: 422,
        reason: "Invalid".into(),
        message,
        details: Some(details),
    }
}

// ---------------------------------------------------------------------------------------------
// Names (k8s.io/apimachinery/pkg/util/validation).

const DNS1123_LABEL_MAX: usize = 63;
const DNS1123_SUBDOMAIN_MAX: usize = 253;

fn label_chars_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// `IsDNS1123Label`.
pub(crate) fn dns1123_label(value: &str) -> Vec<String> {
    let mut out = Vec::new();
    if value.len() > DNS1123_LABEL_MAX {
        out.push(format!(
            "must be no more than {DNS1123_LABEL_MAX} characters"
        ));
    }
    if !label_chars_ok(value) {
        out.push("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')".to_string());
    }
    out
}

/// `IsDNS1123Subdomain`.
pub(crate) fn dns1123_subdomain(value: &str) -> Vec<String> {
    let mut out = Vec::new();
    if value.len() > DNS1123_SUBDOMAIN_MAX {
        out.push(format!(
            "must be no more than {DNS1123_SUBDOMAIN_MAX} characters"
        ));
    }
    if !value.split('.').all(label_chars_ok) {
        out.push("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')".to_string());
    }
    out
}

/// Upstream's qualified-name characters: alphanumerics inside `-`, `_`, `.`.
fn qualified_name_part_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

const QUALIFIED_NAME_ERR: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";

/// `IsQualifiedName` (label keys, taint keys).
pub(crate) fn qualified_name(value: &str) -> Vec<String> {
    let mut out = Vec::new();
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                out.push("prefix part must be non-empty".to_string());
            } else {
                for msg in dns1123_subdomain(prefix) {
                    out.push(format!("prefix part {msg}"));
                }
            }
            *name
        }
        _ => {
            return vec![format!(
                "a qualified name {QUALIFIED_NAME_ERR} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
            )];
        }
    };
    if name.is_empty() {
        out.push("name part must be non-empty".to_string());
    } else if name.len() > 63 {
        out.push("name part must be no more than 63 characters".to_string());
    }
    if !name.is_empty() && !qualified_name_part_ok(name) {
        out.push(format!("name part {QUALIFIED_NAME_ERR}"));
    }
    out
}

/// `IsValidLabelValue`.
pub(crate) fn label_value(value: &str) -> Vec<String> {
    let mut out = Vec::new();
    if value.len() > 63 {
        out.push("must be no more than 63 characters".to_string());
    }
    if !value.is_empty() && !qualified_name_part_ok(value) {
        out.push("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')".to_string());
    }
    out
}

/// `IsCIdentifier`.
pub(crate) fn c_identifier(value: &str) -> Vec<String> {
    let b = value.as_bytes();
    let ok = !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
    if ok {
        Vec::new()
    } else {
        vec!["a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')".to_string()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_upstreams() {
        let p = Path::new("spec").child("devices");
        assert_eq!(
            FieldError::too_many(&p, 65, 64).to_string(),
            "spec.devices: Too many: 65: must have at most 64 items"
        );
        assert_eq!(
            FieldError::too_long(&p.index(0).child("string"), 64).to_string(),
            "spec.devices[0].string: Too long: may not be more than 64 bytes"
        );
        assert_eq!(
            FieldError::required(&p, "").to_string(),
            "spec.devices: Required value"
        );
        assert_eq!(
            FieldError::duplicate(&p.index(1), "gpu-0").to_string(),
            "spec.devices[1]: Duplicate value: \"gpu-0\""
        );
        assert_eq!(
            FieldError::not_supported(&p, "Bad", &["NoSchedule", "None"]).to_string(),
            "spec.devices: Unsupported value: \"Bad\": supported values: \"NoSchedule\", \"None\""
        );
        assert_eq!(
            FieldError::invalid(&p.key("a/b"), 33usize, "too big").to_string(),
            "spec.devices[a/b]: Invalid value: 33: too big"
        );
    }

    #[test]
    fn names_follow_upstreams_rules() {
        assert!(dns1123_label("gpu-0").is_empty());
        assert_eq!(dns1123_label("GPU_0").len(), 1);
        assert_eq!(dns1123_label(&"a".repeat(64)).len(), 1);
        assert!(dns1123_subdomain("gpushare.io").is_empty());
        assert_eq!(dns1123_subdomain("gpushare..io").len(), 1);
        assert!(qualified_name("gpushare.io/unhealthy").is_empty());
        assert_eq!(qualified_name("a/b/c").len(), 1);
        assert_eq!(qualified_name("/x"), ["prefix part must be non-empty"]);
        assert!(label_value("").is_empty());
        assert_eq!(label_value("-x").len(), 1);
        assert!(c_identifier("pcieRoot").is_empty());
        assert_eq!(c_identifier("1x").len(), 1);
        assert_eq!(c_identifier("memory-mib").len(), 1);
    }
}
