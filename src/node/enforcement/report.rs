//! What the readback found for one container on one GPU ([`ContainerMemory`]: the driver's
//! limit read back, or the limiter's ledger), and its wire
//! form: the node annotation `gpushare.io/container-gpu-memory` (a JSON list), which `inspect`
//! reads to show used/allocated per pod. Pure.

use serde::{Deserialize, Serialize};

/// How a container's limit on one GPU stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LimitState {
    /// Soft and hard limit equal the share.
    Enforced,
    /// No limit: the hook never ran for the container, or the limit was cleared.
    Missing,
    /// A limit other than the share.
    Mismatch,
    /// The limit could not be read (the error is logged and counted).
    Unreadable,
}

impl LimitState {
    /// `enforced`, `missing`, `mismatch`, `unreadable`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitState::Enforced => "enforced",
            LimitState::Missing => "missing",
            LimitState::Mismatch => "mismatch",
            LimitState::Unreadable => "unreadable",
        }
    }
}

/// One container's memory on one GPU, as last read back.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerMemory {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
    /// The GPU's UUID.
    pub gpu: String,
    /// The GPU's index on the node.
    pub index: u32,
    /// The share granted, in bytes.
    pub expected: u64,
    /// The hard limit read back, in bytes (absent: none, or unreadable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// The memory the container's cgroup uses on the GPU, in bytes (absent: unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<u64>,
    /// How the limit stands.
    pub state: LimitState,
    /// Why, when not enforced.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// What holds the container to its share: `driver` (the limit read back from the
    /// driver) or `limiter` (the container's ledger); empty in rows of older node agents.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mechanism: String,
}

/// The annotation's value for `rows`.
pub fn to_annotation(rows: &[ContainerMemory]) -> String {
    serde_json::to_string(rows).unwrap_or_else(|_| "[]".to_string())
}

/// The rows of an annotation value; `None` when it does not decode.
pub fn from_annotation(text: &str) -> Option<Vec<ContainerMemory>> {
    serde_json::from_str(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_annotation_round_trips() {
        let rows = vec![ContainerMemory {
            namespace: "d".into(),
            pod: "p".into(),
            container: "c".into(),
            gpu: "GPU-1".into(),
            index: 1,
            expected: 4 << 30,
            limit: Some(4 << 30),
            used: Some(1 << 30),
            state: LimitState::Enforced,
            detail: String::new(),
            mechanism: "driver".into(),
        }];
        let text = to_annotation(&rows);
        assert!(text.contains("\"state\":\"enforced\""), "{text}");
        assert_eq!(from_annotation(&text), Some(rows));
        assert_eq!(from_annotation("nope"), None);
    }
}
