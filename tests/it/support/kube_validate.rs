//! Every object gpushare creates or renders against the OpenAPI schema of each Kubernetes
//! version from 1.34 (the first with `resource.k8s.io/v1`) to the newest kubernetes-validate
//! (PyPI) knows, strictly: an unknown field, a wrong type or a missing required field fails,
//! naming the object, the version and the field. A kind the package has no schema for (a CRD)
//! is named as such, not passed silently.

use serde_json::{Value, json};

use super::clients;

/// The oldest Kubernetes version the DRA path and the chart support.
pub(crate) const OLDEST: &str = "1.34";

/// One object to check: a label saying where it comes from, and the object.
pub(crate) struct Checked<'a> {
    /// `templates/dra-plugin.yaml DaemonSet gpushare-dra-plugin`, `the webhook's template`...
    pub label: String,
    /// The object.
    pub object: &'a Value,
}

/// Fails the test with every finding: an object invalid at a version, or of a kind without a
/// schema. `None` when kubernetes-validate is missing (skipped; CI fails); the versions
/// checked otherwise.
pub(crate) fn assert_valid_at_every_version(objects: &[Checked<'_>]) -> Option<Vec<String>> {
    let request = json!({
        "objects": objects
            .iter()
            .map(|c| json!({ "name": c.label, "object": c.object }))
            .collect::<Vec<_>>(),
        "from": OLDEST,
        "strict": true,
    });
    let answer = clients::kube_validate(&request)?;
    let versions: Vec<String> = answer["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    assert!(
        versions.first().is_some_and(|v| v.starts_with(OLDEST)),
        "kubernetes-validate knows no {OLDEST}: {versions:?}"
    );
    let findings: Vec<String> = answer["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| !r["error"].is_null())
        .map(|r| {
            format!(
                "{} at Kubernetes {}: {}{}",
                r["name"].as_str().unwrap_or_default(),
                r["version"].as_str().unwrap_or_default(),
                if r["missing_schema"] == true {
                    "no schema for its kind: "
                } else {
                    ""
                },
                r["error"].as_str().unwrap_or_default()
            )
        })
        .collect();
    assert!(
        findings.is_empty(),
        "kubernetes-validate --strict refuses {} of {} checks:\n{}",
        findings.len(),
        objects.len() * versions.len(),
        findings.join("\n")
    );
    Some(versions)
}
