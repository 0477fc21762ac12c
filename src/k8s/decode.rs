//! Decoding Kubernetes objects from JSON through the one reader kube's client decodes with
//! (`serde_json::from_str`), so that each object type's decoder is in the binary once.
//!
//! Why it matters: a serde decoder is generic over its reader, and every reader an object is
//! decoded from (`from_slice`, `from_str`, `from_value`, ...) compiles the object's whole
//! decoder once more. A Pod's (spec, volumes, status, all inlined) is 0.6–0.8 MB of machine
//! code; kube's client already holds the `from_str` one for every type it gets, lists, patches
//! or watches, so decoding through it here adds nothing. [`from_bytes`] checks UTF-8 first
//! (which the byte reader would have done while parsing) and costs no more than `from_slice`;
//! [`from_value`] writes the value out and reads it back, for cold paths only (an admission
//! review, the demo), never per object of a list or watch.
//!
//! What it does not do: decide what a decode error means (the caller's), or decode anything
//! that is not JSON.

use serde::de::{DeserializeOwned, Error as _};

/// `T` from JSON bytes (a list's item, a body): as `serde_json::from_slice`, read as text.
/// Bytes that are not UTF-8 are a decode error, as the byte reader would report them.
pub fn from_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    let text = std::str::from_utf8(bytes).map_err(serde_json::Error::custom)?;
    serde_json::from_str(text)
}

/// `T` from a JSON value: as `serde_json::from_value`, through the value's text. For cold
/// paths (see the module documentation).
pub fn from_value<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, serde_json::Error> {
    serde_json::from_str(&value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn pod_json() -> serde_json::Value {
        json!({
            "metadata": { "name": "p", "namespace": "ns", "uid": "u-1",
                          "annotations": { "ALIYUN_COM_GPU_MEM_IDX": "0" } },
            "spec": { "nodeName": "n1", "containers": [{ "name": "main",
                "resources": { "limits": { "aliyun.com/gpu-mem": "4" } } }] },
            "status": { "phase": "Running" },
        })
    }

    #[test]
    fn decodes_as_the_serde_json_readers_do() {
        let value = pod_json();
        let want: Pod = serde_json::from_value(value.clone()).expect("a pod");
        let text = value.to_string();
        assert_eq!(
            from_bytes::<Pod>(text.as_bytes()).expect("from bytes"),
            want
        );
        assert_eq!(from_value::<Pod>(&value).expect("from a value"), want);
    }

    #[test]
    fn refuses_what_the_serde_json_readers_refuse() {
        // Not UTF-8 (a lone continuation byte inside a string), not JSON, not a Pod.
        assert!(from_bytes::<Pod>(b"{\"metadata\":{\"name\":\"\x80\"}}").is_err());
        assert!(serde_json::from_slice::<Pod>(b"{\"metadata\":{\"name\":\"\x80\"}}").is_err());
        assert!(from_bytes::<Pod>(b"{\"metadata\":").is_err());
        assert!(from_value::<Pod>(&json!({ "spec": { "containers": 3 } })).is_err());
        assert!(from_value::<Pod>(&json!([1, 2])).is_err());
    }
}
