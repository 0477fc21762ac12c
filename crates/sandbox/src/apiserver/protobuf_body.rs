//! The few protobuf request bodies the sandbox reads: kubectl (client-go) sends the self
//! reviews (`kubectl auth can-i`, `auth can-i --list`, `auth whoami`) as
//! `application/vnd.kubernetes.protobuf`. The body is upstream's envelope (the magic `k8s\0`,
//! then a `runtime.Unknown` with the type meta and the raw object), decoded here into the JSON
//! object the handlers read. Field numbers are those of `k8s.io/api/authorization/v1`'s
//! `generated.proto`.
//!
//! Any other kind in protobuf is refused (415: the sandbox speaks JSON; answers are JSON, which
//! every client's `Accept` allows).

use serde_json::{Value, json};

/// The content type of a protobuf body.
pub(crate) const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// One field of a message: a varint (skipped: no decoded field is one) or its number and
/// bytes (length-delimited).
enum Field<'a> {
    Varint,
    Bytes(u32, &'a [u8]),
}

fn varint(data: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *data.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// The fields of a message, or `None` when it is not well-formed (or uses fixed-width types,
/// which none of the decoded messages has).
fn fields(data: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < data.len() {
        let key = varint(data, &mut at)?;
        let number = u32::try_from(key >> 3).ok()?;
        match key & 7 {
            0 => {
                varint(data, &mut at)?;
                out.push(Field::Varint);
            }
            2 => {
                let len = usize::try_from(varint(data, &mut at)?).ok()?;
                let bytes = data.get(at..at.checked_add(len)?)?;
                at += len;
                out.push(Field::Bytes(number, bytes));
            }
            _ => return None,
        }
    }
    Some(out)
}

fn message(data: &[u8], number: u32) -> Option<&[u8]> {
    fields(data)?.into_iter().find_map(|f| match f {
        Field::Bytes(n, b) if n == number => Some(b),
        _ => None,
    })
}

/// The string fields of a message, by number, as a JSON object of `names[number - 1]`.
fn strings(data: &[u8], names: &[&str]) -> Option<Value> {
    let mut object = json!({});
    for field in fields(data)? {
        if let Field::Bytes(n, b) = field
            && let Some(name) = names.get((n as usize).wrapping_sub(1))
            && !name.is_empty()
        {
            object[*name] = json!(String::from_utf8_lossy(b));
        }
    }
    Some(object)
}

/// Decodes a protobuf review body into its JSON form; `Err` with the reason otherwise.
pub(crate) fn decode(body: &[u8]) -> Result<Value, String> {
    let unknown = body
        .strip_prefix(b"k8s\0")
        .ok_or("the protobuf body lacks the k8s envelope")?;
    let type_meta = message(unknown, 1).ok_or("the envelope has no type meta")?;
    let type_meta = strings(type_meta, &["apiVersion", "kind"]).ok_or("bad type meta")?;
    let raw = message(unknown, 2).unwrap_or_default();
    let kind = type_meta["kind"].as_str().unwrap_or("");
    let api_version = type_meta["apiVersion"].clone();
    let spec = match kind {
        "SelfSubjectAccessReview" => {
            let spec = message(raw, 2).unwrap_or_default();
            let mut out = json!({});
            if let Some(r) = message(spec, 1) {
                out["resourceAttributes"] = strings(
                    r,
                    &[
                        "namespace",
                        "verb",
                        "group",
                        "version",
                        "resource",
                        "subresource",
                        "name",
                    ],
                )
                .ok_or("bad resourceAttributes")?;
            }
            if let Some(n) = message(spec, 2) {
                out["nonResourceAttributes"] =
                    strings(n, &["path", "verb"]).ok_or("bad nonResourceAttributes")?;
            }
            out
        }
        "SelfSubjectRulesReview" => strings(message(raw, 2).unwrap_or_default(), &["namespace"])
            .ok_or("bad SelfSubjectRulesReview spec")?,
        "SelfSubjectReview" => json!({}),
        other => {
            return Err(format!(
                "the sandbox API server reads {kind:?} only as JSON, not protobuf{}",
                if other.is_empty() { " (no kind)" } else { "" }
            ));
        }
    };
    Ok(json!({ "apiVersion": api_version, "kind": kind, "metadata": {}, "spec": spec }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubectls_access_review_decodes() {
        // `kubectl auth can-i list pods -n ml`, as kubectl 1.32 sent it.
        let body = b"k8s\0\n2\n\x17authorization.k8s.io/v1\x12\x17SelfSubjectAccessReview\x128\n\x10\n\0\x12\0\x1a\0\"\0*\x002\x008\0B\0\x12\x1a\n\x18\n\x02ml\x12\x04list\x1a\0\"\0*\x04pods2\0:\0\x1a\x08\x08\0\x12\0\x1a\0 \0\x1a\0\"\0";
        let review = decode(body).expect("decodes");
        assert_eq!(review["kind"], "SelfSubjectAccessReview");
        assert_eq!(
            review["spec"]["resourceAttributes"],
            json!({ "namespace": "ml", "verb": "list", "group": "", "version": "",
                    "resource": "pods", "subresource": "", "name": "" })
        );
        assert!(decode(b"k8s\0\n\x05").is_err(), "truncated");
        assert!(decode(b"{}").is_err(), "not an envelope");
    }
}
