//! ValidatingAdmissionPolicies (`admissionregistration.k8s.io/v1`) as kube-apiserver's
//! `ValidatingAdmissionPolicy` plugin evaluates them, in CEL (`cel_expr`).
//!
//! For every ValidatingAdmissionPolicyBinding (in name order) whose policy exists: the policy's
//! `matchConstraints` and the binding's `matchResources` must both match the request
//! (`resourceRules` with `resourceNames`, `excludeResourceRules`, `namespaceSelector`,
//! `objectSelector`, as `admission`'s matchers decide; an empty binding `resourceRules`
//! matches every resource); `params` are looked up when the policy has a `paramKind`
//! (`paramRef` by `name` or `selector`, in `paramRef.namespace` or the request's namespace,
//! `parameterNotFoundAction`; each param is one evaluation); then `matchConditions` (any false:
//! the policy does not apply), the `variables` in order (`variables.<name>`), and each of the
//! `validations`. The CEL variables are `object`, `oldObject` (null on CREATE and DELETE as
//! upstream), `request` (`userInfo` with the token's extras included), `params`,
//! `namespaceObject` and `variables`.
//!
//! A false validation is a violation with its `message`, else its `messageExpression`'s
//! string, else `failed expression: <expression>`, and its `reason` (default `Invalid`); an
//! expression that fails to compile or evaluate is one only under `failurePolicy: Fail` (the
//! default), with the error as message. Each violation goes where the binding's
//! `validationActions` say: `Deny` refuses the request with upstream's status
//! (`<resource> "<name>" is forbidden: ValidatingAdmissionPolicy '<p>' with binding '<b>'
//! denied request: <message>`, the reason's code: 403 Forbidden, 401, 413, else 422 Invalid);
//! `Warn` adds a warning (`Validation failed for ValidatingAdmissionPolicy '<p>' with binding
//! '<b>': <message>`); `Audit` is accepted and ignored (the sandbox keeps no audit log).
//!
//! Not here: `auditAnnotations`, the `authorizer` variable, type checking at creation (the
//! policy's `status.typeChecking` is never written), `matchPolicy: Equivalent`, and the CEL
//! libraries `cel_expr` lists as missing.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::admission::{
    Attributes, match_conditions, namespace_object, namespace_selector_matches,
    object_selector_matches, request_bindings, rule_matches,
};
use super::cel_expr::{self, Bindings, Expression};
use super::discovery;
use super::selector::Selectors;
use super::store::{ApiError, Store, meta_str};

/// One outcome that is not "admit": a violation, or an evaluation or configuration error
/// that the failure policy turned into one.
struct Violation {
    message: String,
    reason: String,
}

/// Upstream's match of `NamedRuleWithOperations` lists: a rule matches and, when it names
/// resources, the request's name is one of them.
fn named_rules_match(rules: Option<&Value>, attrs: &Attributes) -> bool {
    rules.and_then(Value::as_array).is_some_and(|rules| {
        rules.iter().any(|rule| {
            rule_matches(rule, attrs)
                && rule
                    .get("resourceNames")
                    .and_then(Value::as_array)
                    .is_none_or(|names| {
                        names.is_empty() || names.iter().any(|n| n.as_str() == Some(&attrs.name))
                    })
        })
    })
}

/// Upstream's `matching.Matcher.Matches` for `MatchResources`; `required_rules`: the policy's
/// `resourceRules` must match (a binding's may be empty: everything).
fn resources_match(
    store: &Store,
    criteria: Option<&Value>,
    attrs: &Attributes,
    required_rules: bool,
) -> Result<bool, ApiError> {
    let Some(criteria) = criteria else {
        return Ok(!required_rules);
    };
    let ns = namespace_selector_matches(store, criteria.get("namespaceSelector"), attrs);
    if matches!(ns, Ok(false)) || !object_selector_matches(criteria.get("objectSelector"), attrs) {
        return Ok(false);
    }
    if named_rules_match(criteria.get("excludeResourceRules"), attrs) {
        return Ok(false);
    }
    let rules = criteria.get("resourceRules");
    let no_rules = rules.and_then(Value::as_array).is_none_or(|r| r.is_empty());
    let matched = if no_rules {
        !required_rules
    } else {
        named_rules_match(rules, attrs)
    };
    if !matched {
        return Ok(false);
    }
    ns
}

/// The params of one binding (upstream's `CollectParams`): `[None]` without a `paramKind`.
fn params(
    store: &Store,
    policy: &Value,
    binding: &Value,
    attrs: &Attributes,
) -> Result<Vec<Option<Value>>, String> {
    let Some(kind) = policy.pointer("/spec/paramKind") else {
        return Ok(vec![None]);
    };
    let api_version = kind.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let kind_name = kind.get("kind").and_then(Value::as_str).unwrap_or("");
    let def = discovery::by_kind(api_version, kind_name).ok_or_else(|| {
        format!(
            "failed to find resource referenced by paramKind: '{api_version}, Kind={kind_name}'"
        )
    })?;
    let Some(reference) = binding.pointer("/spec/paramRef") else {
        return Err("paramKind non-nil but paramRef is nil".to_string());
    };
    let field = |k: &str| reference.get(k).and_then(Value::as_str).unwrap_or("");
    let namespace = if def.namespaced {
        match (field("namespace"), attrs.namespace.as_str()) {
            ("", "") => {
                return Err(
                    "cannot use namespaced paramRef in policy binding that matches cluster-scoped resources"
                        .to_string(),
                );
            }
            ("", ns) | (ns, _) => Some(ns.to_string()),
        }
    } else {
        None
    };
    let found: Vec<Value> = if !field("name").is_empty() {
        store
            .get_by_id(def.id, namespace.as_deref(), field("name"))
            .into_iter()
            .collect()
    } else {
        let selector = reference
            .get("selector")
            .cloned()
            .unwrap_or_else(|| json!({}));
        let labels = selector_text(&selector);
        let selectors = Selectors::parse(Some(&labels), None).map_err(|e| e.to_string())?;
        store
            .list_by_id(def.id, namespace.as_deref())
            .into_iter()
            .filter(|o| selectors.matches(o))
            .collect()
    };
    if found.is_empty() {
        return if field("parameterNotFoundAction") == "Allow" {
            Ok(Vec::new())
        } else {
            Err(
                "no params found for policy binding with `Deny` parameterNotFoundAction"
                    .to_string(),
            )
        };
    }
    Ok(found.into_iter().map(Some).collect())
}

/// A LabelSelector as the text of a `labelSelector` query.
fn selector_text(selector: &Value) -> String {
    let mut parts: Vec<String> = selector
        .get("matchLabels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    for e in selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let key = e.get("key").and_then(Value::as_str).unwrap_or("");
        let values: Vec<&str> = e
            .get("values")
            .and_then(Value::as_array)
            .map(|v| v.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        parts.push(match e.get("operator").and_then(Value::as_str) {
            Some("In") => format!("{key} in ({})", values.join(",")),
            Some("NotIn") => format!("{key} notin ({})", values.join(",")),
            Some("DoesNotExist") => format!("!{key}"),
            _ => key.to_string(),
        });
    }
    parts.join(",")
}

/// Upstream's `CreateNamespaceObject`: what `namespaceObject` shows of a Namespace.
fn namespace_view(namespace: &Value) -> Value {
    let meta = namespace
        .get("metadata")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let mut view_meta = json!({});
    for key in [
        "name",
        "generateName",
        "uid",
        "resourceVersion",
        "labels",
        "annotations",
        "creationTimestamp",
    ] {
        if let Some(v) = meta.get(key) {
            view_meta[key] = v.clone();
        }
    }
    json!({
        "metadata": view_meta,
        "spec": namespace.get("spec").cloned().unwrap_or_else(|| json!({})),
        "status": namespace.get("status").cloned().unwrap_or_else(|| json!({})),
    })
}

/// Evaluates one policy for one param: the violations (empty: admitted).
fn evaluate(policy: &Value, bindings: &mut Bindings, fail: bool) -> Vec<Violation> {
    let spec = policy.get("spec").cloned().unwrap_or_else(|| json!({}));
    let error = |message: String| -> Vec<Violation> {
        if fail {
            vec![Violation {
                message,
                reason: "Invalid".to_string(),
            }]
        } else {
            Vec::new()
        }
    };
    match match_conditions(spec.get("matchConditions"), bindings) {
        Ok(true) => {}
        Ok(false) => return Vec::new(),
        Err(why) => return error(why),
    }
    let mut variables: HashMap<String, cel::Value> = HashMap::new();
    bindings.set_variables(&variables);
    for variable in spec
        .get("variables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = variable.get("name").and_then(Value::as_str).unwrap_or("");
        let source = variable
            .get("expression")
            .and_then(Value::as_str)
            .unwrap_or("");
        // A variable that fails is left out: an expression that reads it fails in turn, as
        // upstream's lazily evaluated variables do.
        if let Ok(value) = Expression::compile(source).evaluate(bindings) {
            variables.insert(name.to_string(), value);
            bindings.set_variables(&variables);
        }
    }
    let mut violations = Vec::new();
    for validation in spec
        .get("validations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let text = |k: &str| validation.get(k).and_then(Value::as_str).unwrap_or("");
        match Expression::compile(text("expression")).truth(bindings) {
            Ok(true) => {}
            Ok(false) => {
                let from_expression = (!text("messageExpression").is_empty())
                    .then(|| Expression::compile(text("messageExpression")).evaluate(bindings))
                    .and_then(Result::ok)
                    .and_then(|v| cel_expr::as_string(&v))
                    .map(|m| m.trim().to_string())
                    .filter(|m| !m.is_empty() && !m.contains('\n'));
                let message = from_expression
                    .or_else(|| Some(text("message").trim().to_string()).filter(|m| !m.is_empty()))
                    .unwrap_or_else(|| format!("failed expression: {}", text("expression").trim()));
                violations.push(Violation {
                    message,
                    reason: match text("reason") {
                        "" => "Invalid".to_string(),
                        r => r.to_string(),
                    },
                });
            }
            Err(why) => violations.extend(error(why)),
        }
    }
    violations
}

fn reason_code(reason: &str) -> (u16, &'static str) {
    match reason {
        "Forbidden" => (403, "Forbidden"),
        "Unauthorized" => (401, "Unauthorized"),
        "RequestEntityTooLarge" => (413, "RequestEntityTooLarge"),
        _ => (422, "Invalid"),
    }
}

/// Evaluates every bound policy on `attrs`: the warnings, or the first denial.
pub(crate) fn validate(store: &Store, attrs: &Attributes) -> Result<Vec<String>, ApiError> {
    let mut warnings = Vec::new();
    let mut denied: Option<(String, Violation)> = None;
    for binding in store.list_by_id("validatingadmissionpolicybindings", None) {
        let binding_name = meta_str(&binding, "name").unwrap_or("").to_string();
        let policy_name = binding
            .pointer("/spec/policyName")
            .and_then(Value::as_str)
            .unwrap_or("");
        let Some(policy) = store.get_by_id("validatingadmissionpolicies", None, policy_name) else {
            continue;
        };
        let fail = policy
            .pointer("/spec/failurePolicy")
            .and_then(Value::as_str)
            != Some("Ignore");
        // A definition whose match fails to evaluate does not apply (upstream drops the error).
        if !resources_match(store, policy.pointer("/spec/matchConstraints"), attrs, true)
            .unwrap_or(false)
        {
            continue;
        }
        let actions: Vec<&str> = binding
            .pointer("/spec/validationActions")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut violations = Vec::new();
        match resources_match(store, binding.pointer("/spec/matchResources"), attrs, false) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) if fail => violations.push(Violation {
                message: format!("failed to configure binding: {}", e.message),
                reason: "Invalid".to_string(),
            }),
            Err(_) => continue,
        }
        if violations.is_empty() {
            let params = match params(store, &policy, &binding, attrs) {
                Ok(p) => p,
                Err(e) => {
                    if fail {
                        violations.push(Violation {
                            message: format!("failed to configure binding: {e}"),
                            reason: "Invalid".to_string(),
                        });
                    }
                    Vec::new()
                }
            };
            let namespace = if attrs.namespace.is_empty() || attrs.kind.2 == "Namespace" {
                Value::Null
            } else {
                namespace_view(&namespace_object(store, &attrs.namespace)?)
            };
            for param in params {
                let mut bindings = request_bindings(attrs);
                bindings.set_json("params", param.as_ref().unwrap_or(&Value::Null));
                bindings.set_json("namespaceObject", &namespace);
                violations.extend(evaluate(&policy, &mut bindings, fail));
            }
        }
        for violation in violations {
            for action in &actions {
                match *action {
                    "Deny" if denied.is_none() => {
                        denied = Some((
                            format!(
                                "ValidatingAdmissionPolicy '{policy_name}' with binding '{binding_name}' denied request: {}",
                                violation.message
                            ),
                            Violation {
                                message: violation.message.clone(),
                                reason: violation.reason.clone(),
                            },
                        ));
                    }
                    "Warn" => warnings.push(format!(
                        "Validation failed for ValidatingAdmissionPolicy '{policy_name}' with binding '{binding_name}': {}",
                        violation.message
                    )),
                    _ => {}
                }
            }
        }
    }
    match denied {
        None => Ok(warnings),
        Some((message, violation)) => {
            let (code, reason) = reason_code(&violation.reason);
            let resource = attrs.def.plural;
            let group = attrs.def.group;
            let qualified = if group.is_empty() {
                resource.to_string()
            } else {
                format!("{resource}.{group}")
            };
            let name = attrs.name_for_errors();
            let mut details = json!({ "name": name, "kind": resource,
                                      "causes": [{ "message": message }] });
            if !group.is_empty() {
                details["group"] = json!(group);
            }
            Err(ApiError::new(
                code,
                reason,
                format!("{qualified} {name:?} is forbidden: {message}"),
                Some(details),
            ))
        }
    }
}
