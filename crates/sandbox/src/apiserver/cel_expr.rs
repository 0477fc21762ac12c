//! CEL expressions of admission (ValidatingAdmissionPolicies, webhook `matchConditions`),
//! compiled and evaluated with the `cel` crate (cel-rust), a maintained CEL implementation.
//!
//! The environment is the CEL standard library (macros `has`, `all`, `exists`, `exists_one`,
//! `map`, `filter`; `size`, `in`, `matches` with the `regex` feature, conversions, optionals)
//! and the strings extension library (`split`, `join`, `lowerAscii`, `replace`, `indexOf`,
//! `substring`, `trim`, ... as cel-go's `ext.Strings`), which Kubernetes also offers. Objects
//! are given to CEL as JSON data: objects are maps (`has(object.spec)` is a key test), integers
//! are `int`.
//!
//! Not here, so an expression that uses one fails to evaluate (and the policy's
//! `failurePolicy` decides): Kubernetes' own CEL libraries (`quantity`, `ip`, `cidr`, `url`,
//! `semver`, `format`, the `lists` and `regex` extensions `isSorted`/`sum`/`find`/`findAll`,
//! `authorizer`), cel-go's `sets` extension, `timestamp`/`duration` (the crate's `chrono`
//! feature is off), type checking against OpenAPI schemas (errors show at evaluation, not at
//! creation), and cost budgets.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cel::{Context, Env, Program, Value as Cel};
use serde_json::Value;

/// The shared environment: the standard library and the strings extension.
fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Env::stdlib();
        // The strings extension declares no overload the standard library has, so this cannot
        // fail; an environment without it still evaluates every standard expression.
        let _ = env.add_extension(cel::extensions::strings);
        Arc::new(env)
    })
    .clone()
}

/// A compiled expression with its source.
pub(crate) struct Expression {
    pub source: String,
    program: Result<Program, String>,
}

impl Expression {
    /// Compiles `source`; a parse error is kept and reported at evaluation.
    pub fn compile(source: &str) -> Expression {
        Expression {
            source: source.to_string(),
            program: env()
                .compile(source)
                .map_err(|e| format!("compilation failed: {e}")),
        }
    }

    /// Evaluates in `bindings`; `Err` says why, as upstream words it.
    pub fn evaluate(&self, bindings: &Bindings) -> Result<Cel, String> {
        let program = self
            .program
            .as_ref()
            .map_err(|e| format!("expression '{}' resulted in error: {e}", self.source.trim()))?;
        let mut context = Context::with_env(env());
        for (name, value) in &bindings.values {
            context.add_variable_from_value(name.clone(), value.clone());
        }
        program
            .execute(&context)
            .map_err(|e| format!("expression '{}' resulted in error: {e}", self.source.trim()))
    }

    /// Evaluates to a boolean; anything else is an error.
    pub fn truth(&self, bindings: &Bindings) -> Result<bool, String> {
        match self.evaluate(bindings)? {
            Cel::Bool(b) => Ok(b),
            other => Err(format!(
                "expression '{}' resulted in error: it evaluated to {:?}, not a bool",
                self.source.trim(),
                other.type_of()
            )),
        }
    }
}

/// The variables an expression sees (`object`, `oldObject`, `request`, `params`,
/// `namespaceObject`, `variables`).
#[derive(Clone, Default)]
pub(crate) struct Bindings {
    values: Vec<(String, Cel)>,
}

impl Bindings {
    /// Binds `name` to the JSON `value` (replacing an earlier binding).
    pub fn set_json(&mut self, name: &str, value: &Value) {
        self.set(name, to_cel(value));
    }

    /// Binds `name` to a CEL value (replacing an earlier binding).
    pub fn set(&mut self, name: &str, value: Cel) {
        self.values.retain(|(n, _)| n != name);
        self.values.push((name.to_string(), value));
    }

    /// Binds `variables` to the evaluated composition variables.
    pub fn set_variables(&mut self, variables: &HashMap<String, Cel>) {
        self.set("variables", Cel::from(variables.clone()));
    }
}

/// JSON as CEL data: objects are maps with string keys, integers `int` (`uint` past
/// `i64::MAX`), other numbers `double`.
pub(crate) fn to_cel(value: &Value) -> Cel {
    match value {
        Value::Null => Cel::Null,
        Value::Bool(b) => Cel::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Cel::Int(i),
            (None, Some(u), _) => Cel::UInt(u),
            (_, _, Some(f)) => Cel::Float(f),
            _ => Cel::Null,
        },
        Value::String(s) => Cel::String(Arc::new(s.clone())),
        Value::Array(items) => Cel::List(Arc::new(items.iter().map(to_cel).collect())),
        Value::Object(map) => {
            let map: HashMap<String, Cel> =
                map.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            Cel::from(map)
        }
    }
}

/// A CEL value as the text of a message (`messageExpression`): strings only.
pub(crate) fn as_string(value: &Cel) -> Option<String> {
    match value {
        Cel::String(s) => Some(s.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn eval(source: &str, object: Value) -> Result<Cel, String> {
        let mut b = Bindings::default();
        b.set_json("object", &object);
        Expression::compile(source).evaluate(&b)
    }

    #[test]
    fn json_objects_evaluate_as_kubernetes_cel_sees_them() {
        let pod = json!({ "metadata": { "name": "p", "labels": { "app": "x" } },
                          "spec": { "replicas": 3, "nodeName": "n1" } });
        assert_eq!(
            eval("object.spec.replicas == 3", pod.clone()),
            Ok(Cel::Bool(true))
        );
        assert_eq!(
            eval("has(object.spec.nodeName)", pod.clone()),
            Ok(Cel::Bool(true))
        );
        assert_eq!(
            eval("has(object.status)", pod.clone()),
            Ok(Cel::Bool(false))
        );
        assert_eq!(
            eval("object.metadata.labels.all(k, k == 'app')", pod.clone()),
            Ok(Cel::Bool(true))
        );
        assert_eq!(
            eval("'a/b/c'.split('/').size() == 3", pod.clone()),
            Ok(Cel::Bool(true)),
            "the strings extension"
        );
        assert_eq!(
            eval("object.metadata.name.matches('^p$')", pod.clone()),
            Ok(Cel::Bool(true)),
            "regular expressions"
        );
        let err = eval("object.spec.missing == 1", pod.clone()).expect_err("no such key");
        assert!(
            err.starts_with("expression 'object.spec.missing == 1' resulted in error:"),
            "{err}"
        );
        let err = Expression::compile("object.(").truth(&Bindings::default());
        assert!(err.is_err_and(|e| e.contains("compilation failed")));
        let err = Expression::compile("1 + 1").truth(&Bindings::default());
        assert!(err.is_err_and(|e| e.contains("not a bool")));
    }
}
