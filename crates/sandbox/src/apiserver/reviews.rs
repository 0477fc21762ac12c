//! The self reviews, answered for the requesting identity from the same authorizer as every
//! request (`rbac`): `SelfSubjectAccessReview` (what `kubectl auth can-i` asks),
//! `SelfSubjectRulesReview` (`kubectl auth can-i --list`) and `SelfSubjectReview`
//! (`kubectl auth whoami`). Nothing is stored. Not here: `SubjectAccessReview` and
//! `LocalSubjectAccessReview` (reviews of another user), selector attributes.

use serde_json::{Value, json};

use super::identity::Identity;
use super::rbac;
use super::request_info::RequestInfo;
use super::store::{ApiError, Store};

fn invalid(kind: &str, group: &str, field: &str, why: &str) -> ApiError {
    ApiError::with_code(
        422,
        "Invalid",
        &format!("{kind}.{group} \"\" is invalid: {field}: {why}"),
    )
}

fn text<'a>(value: Option<&'a Value>, field: &str) -> &'a str {
    value
        .and_then(|v| v.get(field))
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// A SelfSubjectAccessReview: `status.allowed` (and the authorizer's reason) for the
/// resource or non-resource attributes of its spec.
pub(crate) fn access_review(
    store: &Store,
    user: &Identity,
    mut review: Value,
) -> Result<(u16, Value), ApiError> {
    if !review.is_object() {
        return Err(ApiError::bad_request("the review is not a JSON object"));
    }
    let resource = review
        .pointer("/spec/resourceAttributes")
        .filter(|v| v.is_object());
    let non_resource = review
        .pointer("/spec/nonResourceAttributes")
        .filter(|v| v.is_object());
    let attributes = match (resource, non_resource) {
        (Some(r), None) => {
            let subresource = text(Some(r), "subresource").to_string();
            RequestInfo {
                resource_request: true,
                path: String::new(),
                verb: text(Some(r), "verb").to_string(),
                api_group: text(Some(r), "group").to_string(),
                api_version: text(Some(r), "version").to_string(),
                namespace: text(Some(r), "namespace").to_string(),
                resource: text(Some(r), "resource").to_string(),
                subresource,
                name: text(Some(r), "name").to_string(),
            }
        }
        (None, Some(n)) => RequestInfo {
            resource_request: false,
            path: text(Some(n), "path").to_string(),
            verb: text(Some(n), "verb").to_string(),
            ..RequestInfo::default()
        },
        _ => {
            return Err(invalid(
                "SelfSubjectAccessReview",
                "authorization.k8s.io",
                "spec.resourceAttributes",
                "Invalid value: \"null\": exactly one of nonResourceAttributes or resourceAttributes must be specified",
            ));
        }
    };
    let decision = rbac::authorize(store, user, &attributes);
    let mut status = json!({ "allowed": decision.allowed });
    if !decision.reason.is_empty() {
        status["reason"] = json!(decision.reason);
    }
    review["apiVersion"] = json!("authorization.k8s.io/v1");
    review["kind"] = json!("SelfSubjectAccessReview");
    if review.get("metadata").is_none_or(|m| !m.is_object()) {
        review["metadata"] = json!({});
    }
    review["status"] = status;
    Ok((201, review))
}

/// A SelfSubjectRulesReview: every rule that applies to the user in `spec.namespace`.
pub(crate) fn rules_review(
    store: &Store,
    user: &Identity,
    mut review: Value,
) -> Result<(u16, Value), ApiError> {
    if !review.is_object() {
        return Err(ApiError::bad_request("the review is not a JSON object"));
    }
    let namespace = text(review.get("spec"), "namespace").to_string();
    let (resource_rules, non_resource_rules, errors) = rbac::rules_for(store, user, &namespace);
    let mut status = json!({
        "resourceRules": resource_rules,
        "nonResourceRules": non_resource_rules,
        "incomplete": false,
    });
    if !errors.is_empty() {
        status["evaluationError"] = json!(errors.join(", "));
    }
    review["apiVersion"] = json!("authorization.k8s.io/v1");
    review["kind"] = json!("SelfSubjectRulesReview");
    if review.get("metadata").is_none_or(|m| !m.is_object()) {
        review["metadata"] = json!({});
    }
    review["status"] = status;
    Ok((201, review))
}

/// A SelfSubjectReview: who the user is.
pub(crate) fn subject_review(user: &Identity, api_version: &str) -> (u16, Value) {
    (
        201,
        json!({
            "apiVersion": api_version, "kind": "SelfSubjectReview",
            "metadata": { "creationTimestamp": null },
            "status": { "userInfo": user.user_info() },
        }),
    )
}
