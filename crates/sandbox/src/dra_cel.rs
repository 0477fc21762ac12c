//! DRA's CEL, as upstream's `k8s.io/dynamic-resource-allocation/cel` gives it to DeviceClass
//! and request selectors, on the `cel` crate: one `device` variable with `driver`,
//! `allowMultipleAllocations`, `attributes["<domain>"].<name>` (a domain no attribute has
//! reads as an empty map; a name the device lacks is the runtime error `no such key: <name>`)
//! and `capacity["<domain>"].<name>` as quantities. Attribute names without a domain are in
//! the driver's. Kubernetes' library functions selectors use are here: `quantity()`,
//! `isQuantity()`, `semver()`, `isSemver()` and their methods (`compareTo`, `isGreaterThan`,
//! `isLessThan`, `asInteger`, `asApproximateFloat`, `isInteger`, `sign`, `add`, `sub`,
//! `major`, `minor`, `patch`), `cel.bind`, with the crate's strings, lists and math extensions.
//!
//! [`compile`] is what the API server checks on a write (the expression parses, names only
//! `device` and bound variables, selects only the fields `device` has, calls only known
//! functions, and does not evaluate to a non-bool); [`Selector::matches`] evaluates it on one
//! device. Not modelled: upstream's cost estimate and runtime cost limit (the crate has no
//! cost model), the full static type checker (only what is sure at parse time is refused),
//! Kubernetes' URL, IP, CIDR, regex and authz libraries, list-typed attributes' `includes()`.

use std::any::Any;
use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, OnceLock};

use cel::common::ast::{ComprehensionExpr, Expr, IdedExpr, ListExpr, LiteralValue};
use cel::common::traits::{Container, Indexer, Iterable, Iterator as CelIterator, Sizer};
use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelString, MAP_TYPE, Type,
};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::parser::Macro;
use cel::{Context, Env, ExecutionError, Program, Value};
use k8s_openapi::api::resource::v1::{DeviceAttribute, DeviceCapacity};

use crate::quantity::Quantity;

/// Upstream's `CELSelectorExpressionMaxLength`.
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;

/// Which gated parts of the environment a new expression may use (`NewExpressions`); stored
/// expressions are evaluated with everything declared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// `DRAConsumableCapacity`: `device.allowMultipleAllocations` is declared.
    pub consumable_capacity: bool,
}

impl Features {
    /// Everything declared, as for expressions already stored.
    pub const STORED: Features = Features {
        consumable_capacity: true,
    };
}

/// A selector that does not compile, with upstream's wording (`compilation failed: ...`,
/// `must evaluate to bool ...`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CompileError(pub String);

/// A selector that failed on a device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeError(pub String);

/// A compiled selector.
#[derive(Debug)]
pub struct Selector {
    program: Program,
}

/// One device as a selector sees it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceInput<'a> {
    /// The slice's driver (the default domain of attribute and capacity names).
    pub driver: &'a str,
    /// The device's `allowMultipleAllocations` (absent reads as false).
    pub allow_multiple_allocations: Option<bool>,
    /// The device's attributes by (possibly unqualified) name.
    pub attributes: Option<&'a BTreeMap<String, DeviceAttribute>>,
    /// The device's capacities by (possibly unqualified) name.
    pub capacity: Option<&'a BTreeMap<String, DeviceCapacity>>,
}

/// Compiles `expression` for the selector environment, refusing what upstream's compiler
/// would (as far as [the module docs](self) say).
pub fn compile(expression: &str, features: Features) -> Result<Selector, CompileError> {
    let program = env()
        .compile(expression)
        .map_err(|e| CompileError(format!("compilation failed: {e}")))?;
    let mut check = Check {
        features,
        scope: Vec::new(),
        errors: Vec::new(),
        program: &program,
    };
    let kind = check.expr(program.expression());
    if let Some(first) = check.errors.into_iter().next() {
        return Err(CompileError(format!("compilation failed: {first}")));
    }
    if !matches!(kind, Kind::Bool | Kind::Dyn) {
        return Err(CompileError(format!(
            "must evaluate to bool or the unknown type, not {}",
            kind.name()
        )));
    }
    Ok(Selector { program })
}

impl Selector {
    /// Evaluates the selector on `device`: `Err` for a runtime error (a missing attribute, a
    /// failed conversion, a non-bool result), which upstream's allocator reports as an
    /// allocation error, not as "device not selected".
    pub fn matches(&self, device: &DeviceInput<'_>) -> Result<bool, RuntimeError> {
        let mut ctx = Context::with_env(env());
        ctx.add_variable_as_val("device", Box::new(device_value(device)?));
        match self.program.execute(&ctx) {
            Ok(Value::Bool(b)) => Ok(b),
            Ok(other) => Err(RuntimeError(format!(
                "CEL result of type {:?} could not be converted to bool",
                other.type_of()
            ))),
            Err(e) => Err(RuntimeError(describe(&e))),
        }
    }
}

/// An execution error in cel-go's words where they differ (`no such key: x`, with upstream's
/// hint).
fn describe(e: &ExecutionError) -> String {
    match e {
        ExecutionError::NoSuchKey(key) => format!(
            "no such key: {key}. consider using CEL optional chaining (.? followed by orValue()) \
             or guarding the check with has() for optional fields"
        ),
        ExecutionError::UndeclaredReference(name) => {
            format!("no such attribute(s): {name}")
        }
        other => other.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// The environment.

fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| Arc::new(build_env())).clone()
}

fn build_env() -> Env {
    let mut env = Env::stdlib();
    // Each registration below is of a name the crate's standard library does not declare;
    // a clash would be a programming error caught by every test that compiles a selector.
    let results = [
        env.add_extension(cel::extensions::strings),
        env.add_extension(cel::extensions::lists),
        env.add_extension(cel::extensions::math),
        cel::add_overload!(env, fn quantity: (CelString) -> Result<CelQuantity>),
        cel::add_overload!(env, fn is_quantity: (CelString) -> CelBool),
        cel::add_overload!(env, fn semver: (CelString) -> Result<CelSemver>),
        cel::add_overload!(env, fn is_semver: (CelString) -> CelBool),
        cel::add_member_overload!(env, fn q_compare_to: (CelQuantity, CelQuantity) -> CelInt, name = "compareTo"),
        cel::add_member_overload!(env, fn q_is_greater_than: (CelQuantity, CelQuantity) -> CelBool, name = "isGreaterThan"),
        cel::add_member_overload!(env, fn q_is_less_than: (CelQuantity, CelQuantity) -> CelBool, name = "isLessThan"),
        cel::add_member_overload!(env, fn q_as_integer: (CelQuantity) -> Result<CelInt>, name = "asInteger"),
        cel::add_member_overload!(env, fn q_as_approximate_float: (CelQuantity) -> CelDouble, name = "asApproximateFloat"),
        cel::add_member_overload!(env, fn q_is_integer: (CelQuantity) -> CelBool, name = "isInteger"),
        cel::add_member_overload!(env, fn q_sign: (CelQuantity) -> CelInt, name = "sign"),
        cel::add_member_overload!(env, fn q_add: (CelQuantity, CelQuantity) -> Result<CelQuantity>, name = "add"),
        cel::add_member_overload!(env, fn q_add_int: (CelQuantity, CelInt) -> Result<CelQuantity>, name = "add"),
        cel::add_member_overload!(env, fn q_sub: (CelQuantity, CelQuantity) -> Result<CelQuantity>, name = "sub"),
        cel::add_member_overload!(env, fn q_sub_int: (CelQuantity, CelInt) -> Result<CelQuantity>, name = "sub"),
        cel::add_member_overload!(env, fn v_compare_to: (CelSemver, CelSemver) -> CelInt, name = "compareTo"),
        cel::add_member_overload!(env, fn v_is_greater_than: (CelSemver, CelSemver) -> CelBool, name = "isGreaterThan"),
        cel::add_member_overload!(env, fn v_is_less_than: (CelSemver, CelSemver) -> CelBool, name = "isLessThan"),
        cel::add_member_overload!(env, fn v_major: (CelSemver) -> CelInt, name = "major"),
        cel::add_member_overload!(env, fn v_minor: (CelSemver) -> CelInt, name = "minor"),
        cel::add_member_overload!(env, fn v_patch: (CelSemver) -> CelInt, name = "patch"),
        env.add_macro(Macro::receiver("bind", 3, bind_macro)),
    ];
    for r in results {
        if let Err(e) = r {
            tracing::error!(error = %e, "the sandbox's DRA CEL environment is incomplete");
        }
    }
    env
}

/// `cel.bind(name, init, result)`: `result` with `name` bound to `init` (cel-go's
/// `ext.Bindings`), as a comprehension over an empty list.
fn bind_macro(
    helper: &mut cel::parser::MacroExprHelper<'_>,
    target: &mut Option<IdedExpr>,
    args: &mut Vec<IdedExpr>,
) -> Result<Option<IdedExpr>, cel::ParseError> {
    if !matches!(target.as_ref().map(|t| &t.expr), Some(Expr::Ident(ns)) if ns == "cel") {
        return Ok(None);
    }
    let name = match args.first().map(|a| (&a.expr, a.id)) {
        Some((Expr::Ident(name), _)) => name.clone(),
        Some((_, id)) => {
            return Err(
                helper.new_error(id, "cel.bind() variable names must be simple identifiers")
            );
        }
        None => return Ok(None),
    };
    let result = args.pop().unwrap_or_default();
    let init = args.pop().unwrap_or_default();
    args.clear();
    target.take();
    let empty = helper.next_expr(Expr::List(ListExpr {
        elements: Vec::new(),
        optional_indices: Vec::new(),
    }));
    let stop = helper.next_expr(Expr::Literal(LiteralValue::Boolean(false.into())));
    let step = helper.next_expr(Expr::Ident(name.clone()));
    Ok(Some(helper.next_expr(Expr::Comprehension(Box::new(
        ComprehensionExpr {
            iter_range: empty,
            iter_var: "#unused".to_string(),
            iter_var2: None,
            accu_var: name,
            accu_init: init,
            loop_cond: stop,
            loop_step: step,
            result,
        },
    )))))
}

// ---------------------------------------------------------------------------------------------
// The static check.

/// What an expression is known to evaluate to at parse time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Bool,
    Int,
    Uint,
    Double,
    String,
    Bytes,
    Null,
    List,
    Map,
    Quantity,
    Semver,
    Device,
    /// Not known before evaluation.
    Dyn,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bool => "bool",
            Kind::Int => "int",
            Kind::Uint => "uint",
            Kind::Double => "double",
            Kind::String => "string",
            Kind::Bytes => "bytes",
            Kind::Null => "null_type",
            Kind::List => "list(dyn)",
            Kind::Map => "map(string, dyn)",
            Kind::Quantity => "kubernetes.Quantity",
            Kind::Semver => "kubernetes.Semver",
            Kind::Device => "kubernetes.DRADevice",
            Kind::Dyn => "dyn",
        }
    }
}

/// Functions the environment declares, with what they return.
fn function_kind(name: &str) -> Option<Kind> {
    Some(match name {
        "quantity" => Kind::Quantity,
        "semver" => Kind::Semver,
        "isQuantity" | "isSemver" | "isGreaterThan" | "isLessThan" | "isInteger" | "contains"
        | "startsWith" | "endsWith" | "matches" | "bool" | "isSorted" | "math.isInf"
        | "math.isNaN" | "math.isFinite" => Kind::Bool,
        "compareTo" | "sign" | "asInteger" | "major" | "minor" | "patch" | "size" | "int"
        | "indexOf" | "lastIndexOf" => Kind::Int,
        "uint" => Kind::Uint,
        "asApproximateFloat" | "double" => Kind::Double,
        "string" | "lowerAscii" | "upperAscii" | "replace" | "substring" | "trim" | "join"
        | "charAt" | "format" | "reverse" | "quote" | "strings.quote" => Kind::String,
        "bytes" => Kind::Bytes,
        "split" | "slice" | "flatten" | "distinct" | "sort" | "lists.range" => Kind::List,
        "add"
        | "sub"
        | "dyn"
        | "type"
        | "sum"
        | "min"
        | "max"
        | "first"
        | "last"
        | "optional.of"
        | "optional.ofNonZeroValue"
        | "optional.none"
        | "hasValue"
        | "value"
        | "or"
        | "orValue"
        | "math.greatest"
        | "math.least"
        | "math.@max"
        | "math.@min"
        | "math.ceil"
        | "math.floor"
        | "math.round"
        | "math.trunc"
        | "math.abs"
        | "math.sign"
        | "math.sqrt"
        | "math.bitAnd"
        | "math.bitOr"
        | "math.bitXor"
        | "math.bitNot"
        | "math.bitShiftLeft"
        | "math.bitShiftRight" => Kind::Dyn,
        _ => return None,
    })
}

struct Check<'p> {
    features: Features,
    scope: Vec<String>,
    errors: Vec<String>,
    program: &'p Program,
}

impl Check<'_> {
    fn error(&mut self, id: u64, msg: String) {
        let (line, col) = self
            .program
            .source_info()
            .offset_for(id)
            .map(|(l, c)| (l as i64, c as i64))
            .unwrap_or((1, 1));
        self.errors
            .push(format!("ERROR: <input>:{line}:{col}: {msg}"));
    }

    fn expr(&mut self, e: &IdedExpr) -> Kind {
        match &e.expr {
            Expr::Unspecified => Kind::Dyn,
            Expr::Literal(l) => match l {
                LiteralValue::Boolean(_) => Kind::Bool,
                LiteralValue::Bytes(_) => Kind::Bytes,
                LiteralValue::Double(_) => Kind::Double,
                LiteralValue::Int(_) => Kind::Int,
                LiteralValue::Null => Kind::Null,
                LiteralValue::String(_) => Kind::String,
                LiteralValue::UInt(_) => Kind::Uint,
            },
            Expr::Ident(name) => {
                if self.scope.iter().any(|s| s == name) {
                    Kind::Dyn
                } else if name == "device" {
                    Kind::Device
                } else if matches!(
                    name.as_str(),
                    "bool"
                        | "int"
                        | "uint"
                        | "double"
                        | "string"
                        | "bytes"
                        | "list"
                        | "map"
                        | "null_type"
                        | "type"
                ) {
                    Kind::Dyn
                } else {
                    self.error(
                        e.id,
                        format!("undeclared reference to '{name}' (in container '')"),
                    );
                    Kind::Dyn
                }
            }
            Expr::Select(s) => {
                let operand = self.expr(&s.operand);
                if operand == Kind::Device {
                    let known = match s.field.as_str() {
                        "driver" => Some(Kind::String),
                        "attributes" | "capacity" => Some(Kind::Map),
                        "allowMultipleAllocations" if self.features.consumable_capacity => {
                            Some(Kind::Bool)
                        }
                        _ => None,
                    };
                    match known {
                        Some(k) if !s.test => return k,
                        Some(_) => return Kind::Bool,
                        None => {
                            self.error(e.id, format!("undefined field '{}'", s.field));
                            return Kind::Dyn;
                        }
                    }
                }
                if s.test { Kind::Bool } else { Kind::Dyn }
            }
            Expr::Call(c) => {
                let target = c.target.as_deref().map(|t| self.expr(t));
                let args: Vec<Kind> = c.args.iter().map(|a| self.expr(a)).collect();
                let name = c.func_name.as_str();
                match name {
                    "_==_"
                    | "_!=_"
                    | "_<_"
                    | "_<=_"
                    | "_>_"
                    | "_>=_"
                    | "_&&_"
                    | "_||_"
                    | "!_"
                    | "@in"
                    | "@not_strictly_false"
                    | "in" => Kind::Bool,
                    "_?_:_" => match (args.get(1), args.get(2)) {
                        (Some(a), Some(b)) if a == b => *a,
                        _ => Kind::Dyn,
                    },
                    "_+_" | "_-_" | "_*_" | "_/_" | "_%_" => match (args.first(), args.get(1)) {
                        (Some(a), Some(b)) if a == b => *a,
                        _ => Kind::Dyn,
                    },
                    "-_" => args.first().copied().unwrap_or(Kind::Dyn),
                    "_[_]" | "_[?_]" | "_?._" => Kind::Dyn,
                    _ => match function_kind(name) {
                        Some(k) => {
                            let _ = target;
                            k
                        }
                        None => {
                            self.error(
                                e.id,
                                format!("undeclared reference to '{name}' (in container '')"),
                            );
                            Kind::Dyn
                        }
                    },
                }
            }
            Expr::Comprehension(c) => {
                self.expr(&c.iter_range);
                self.expr(&c.accu_init);
                let bound = 2 + usize::from(c.iter_var2.is_some());
                self.scope.push(c.iter_var.clone());
                if let Some(v) = &c.iter_var2 {
                    self.scope.push(v.clone());
                }
                self.scope.push(c.accu_var.clone());
                self.expr(&c.loop_cond);
                self.expr(&c.loop_step);
                let result = self.expr(&c.result);
                let keep = self.scope.len() - bound;
                self.scope.truncate(keep);
                result
            }
            Expr::List(l) => {
                for x in &l.elements {
                    self.expr(x);
                }
                Kind::List
            }
            Expr::Map(m) => {
                for entry in &m.entries {
                    if let cel::common::ast::EntryExpr::MapEntry(me) = &entry.expr {
                        self.expr(&me.key);
                        self.expr(&me.value);
                    }
                }
                Kind::Map
            }
            Expr::Struct(_) => Kind::Dyn,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The device.

fn string_key(s: &str) -> CelMapKey<'static> {
    CelMapKey::String(CelString::from(s.to_string()))
}

/// Splits a qualified name into domain and id, the driver's domain for an unqualified one.
fn domain_and_id<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    match name.split_once('/') {
        Some((domain, id)) => (domain, id),
        None => (driver, name),
    }
}

fn attribute_value(name: &str, a: &DeviceAttribute) -> Result<Box<dyn Val>, RuntimeError> {
    let semver = |v: &str| {
        Semver::parse(v)
            .map(CelSemver)
            .ok_or_else(|| RuntimeError(format!("attribute {name}: parse semantic version: {v:?}")))
    };
    let list = |items: Vec<Box<dyn Val>>| -> Box<dyn Val> { Box::new(CelList::from(items)) };
    Ok(if let Some(v) = &a.ints {
        list(
            v.iter()
                .map(|i| Box::new(CelInt::from(*i)) as Box<dyn Val>)
                .collect(),
        )
    } else if let Some(v) = &a.bools {
        list(
            v.iter()
                .map(|b| Box::new(CelBool::from(*b)) as Box<dyn Val>)
                .collect(),
        )
    } else if let Some(v) = &a.strings {
        list(
            v.iter()
                .map(|s| Box::new(CelString::from(s.clone())) as Box<dyn Val>)
                .collect(),
        )
    } else if let Some(v) = &a.versions {
        let mut items: Vec<Box<dyn Val>> = Vec::new();
        for s in v {
            items.push(Box::new(semver(s)?));
        }
        list(items)
    } else if let Some(i) = a.int {
        Box::new(CelInt::from(i))
    } else if let Some(b) = a.bool {
        Box::new(CelBool::from(b))
    } else if let Some(s) = &a.string {
        Box::new(CelString::from(s.clone()))
    } else if let Some(v) = &a.version {
        Box::new(semver(v)?)
    } else {
        return Err(RuntimeError(format!(
            "attribute {name}: unsupported attribute value"
        )));
    })
}

fn device_value(d: &DeviceInput<'_>) -> Result<CelMap<'static>, RuntimeError> {
    let mut attributes: BTreeMap<&str, HashMap<CelMapKey<'static>, Box<dyn Val>>> = BTreeMap::new();
    for (name, a) in d.attributes.into_iter().flatten() {
        let (domain, id) = domain_and_id(name, d.driver);
        attributes
            .entry(domain)
            .or_default()
            .insert(string_key(id), attribute_value(name, a)?);
    }
    let mut capacity: BTreeMap<&str, HashMap<CelMapKey<'static>, Box<dyn Val>>> = BTreeMap::new();
    for (name, c) in d.capacity.into_iter().flatten() {
        let (domain, id) = domain_and_id(name, d.driver);
        let q = Quantity::parse(&c.value.0)
            .map_err(|e| RuntimeError(format!("capacity {name}: {e}")))?;
        capacity
            .entry(domain)
            .or_default()
            .insert(string_key(id), Box::new(CelQuantity(q)));
    }
    let nest = |m: BTreeMap<&str, HashMap<CelMapKey<'static>, Box<dyn Val>>>| {
        let outer: HashMap<CelMapKey<'static>, Box<dyn Val>> = m
            .into_iter()
            .map(|(k, v)| (string_key(k), Box::new(CelMap::from(v)) as Box<dyn Val>))
            .collect();
        DefaultingMap(CelMap::from(outer))
    };
    let mut fields: HashMap<CelMapKey<'static>, Box<dyn Val>> = HashMap::new();
    fields.insert(
        string_key("driver"),
        Box::new(CelString::from(d.driver.to_string())),
    );
    fields.insert(
        string_key("allowMultipleAllocations"),
        Box::new(CelBool::from(d.allow_multiple_allocations.unwrap_or(false))),
    );
    fields.insert(string_key("attributes"), Box::new(nest(attributes)));
    fields.insert(string_key("capacity"), Box::new(nest(capacity)));
    Ok(CelMap::from(fields))
}

/// A map whose missing keys read as an empty map (upstream's
/// `newStringInterfaceMapWithDefault`): `device.attributes["other.domain"]` is `{}`.
#[derive(Clone, Debug)]
struct DefaultingMap(CelMap<'static>);

impl Val for DefaultingMap {
    fn get_type(&self) -> &Type {
        <Self as Val>::cel_type()
    }

    fn cel_type() -> &'static Type {
        &MAP_TYPE
    }

    fn as_container(&self) -> Option<&dyn Container> {
        Some(self)
    }

    fn as_indexer<'b, 'w>(&'b self) -> Option<&'b (dyn Indexer + 'w)>
    where
        Self: 'w,
    {
        Some(self)
    }

    fn as_iterable<'b, 'w>(&'b self) -> Option<&'b (dyn Iterable + 'w)>
    where
        Self: 'w,
    {
        Some(self)
    }

    fn as_sizer(&self) -> Option<&dyn Sizer> {
        Some(self)
    }

    fn equals(&self, other: &dyn Val) -> bool {
        match other.downcast_ref::<DefaultingMap>() {
            Some(o) => self.0.equals(&o.0),
            None => self.0.equals(other),
        }
    }

    fn clone_as_boxed<'w>(&self) -> Box<dyn Val + 'w>
    where
        Self: 'w,
    {
        Box::new(self.clone())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

impl StaticVal for DefaultingMap {}

impl Container for DefaultingMap {
    fn contains(&self, key: &dyn Val) -> Result<bool, ExecutionError> {
        self.0.contains(key)
    }
}

impl Indexer for DefaultingMap {
    fn get<'b, 'w>(&'b self, key: &dyn Val) -> Result<CowVal<'b, 'w>, ExecutionError>
    where
        Self: 'w,
    {
        match self.0.get(key) {
            Ok(v) => Ok(v),
            Err(ExecutionError::NoSuchKey(_)) => Ok(CowVal::owned(CelMap::default())),
            Err(e) => Err(e),
        }
    }

    fn steal<'w>(self: Box<Self>, key: &dyn Val) -> Result<Box<dyn Val + 'w>, ExecutionError>
    where
        Self: 'w,
    {
        self.get(key).map(CowVal::into_owned)
    }
}

impl Iterable for DefaultingMap {
    fn iter<'b, 'w>(&'b self) -> Box<dyn CelIterator<'b, 'w> + 'b>
    where
        Self: 'w,
    {
        self.0.iter()
    }
}

impl Sizer for DefaultingMap {
    fn size(&self) -> CelInt {
        self.0.size()
    }
}

// ---------------------------------------------------------------------------------------------
// Kubernetes' quantity and semver libraries.

static QUANTITY_TYPE: Type = Type::new_unspecified_type("kubernetes.Quantity");
static SEMVER_TYPE: Type = Type::new_unspecified_type("kubernetes.Semver");

/// A quantity as a CEL value.
#[derive(Clone, Debug)]
pub(crate) struct CelQuantity(Quantity);

impl Val for CelQuantity {
    fn get_type(&self) -> &Type {
        <Self as Val>::cel_type()
    }

    fn cel_type() -> &'static Type {
        &QUANTITY_TYPE
    }

    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<CelQuantity>()
            .is_some_and(|o| o.0 == self.0)
    }

    fn clone_as_boxed<'w>(&self) -> Box<dyn Val + 'w>
    where
        Self: 'w,
    {
        Box::new(self.clone())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

impl StaticVal for CelQuantity {}

fn quantity(s: &CelString<'_>) -> Result<CelQuantity, ExecutionError> {
    Quantity::parse(s.inner())
        .map(CelQuantity)
        .map_err(|e| ExecutionError::function_error("quantity", e))
}

fn is_quantity(s: &CelString<'_>) -> CelBool {
    Quantity::parse(s.inner()).is_ok().into()
}

fn ordering(o: Ordering) -> CelInt {
    CelInt::from(match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    })
}

fn q_compare_to(a: &CelQuantity, b: &CelQuantity) -> CelInt {
    ordering(a.0.cmp(&b.0))
}

fn q_is_greater_than(a: &CelQuantity, b: &CelQuantity) -> CelBool {
    (a.0 > b.0).into()
}

fn q_is_less_than(a: &CelQuantity, b: &CelQuantity) -> CelBool {
    (a.0 < b.0).into()
}

fn q_as_integer(a: &CelQuantity) -> Result<CelInt, ExecutionError> {
    if !a.0.is_integer() {
        return Err(ExecutionError::function_error(
            "asInteger",
            "cannot convert value to integer",
        ));
    }
    a.0.value().map(CelInt::from).ok_or_else(|| {
        ExecutionError::function_error("asInteger", "cannot convert value to integer")
    })
}

fn q_as_approximate_float(a: &CelQuantity) -> CelDouble {
    a.0.as_f64().into()
}

fn q_is_integer(a: &CelQuantity) -> CelBool {
    a.0.is_integer().into()
}

fn q_sign(a: &CelQuantity) -> CelInt {
    CelInt::from(i64::from(a.0.sign()))
}

fn overflow(f: &str) -> ExecutionError {
    ExecutionError::function_error(f, "overflow")
}

fn q_add(a: &CelQuantity, b: &CelQuantity) -> Result<CelQuantity, ExecutionError> {
    a.0.checked_add(&b.0)
        .map(CelQuantity)
        .ok_or_else(|| overflow("add"))
}

fn q_add_int(a: &CelQuantity, b: &CelInt) -> Result<CelQuantity, ExecutionError> {
    q_add(a, &CelQuantity(Quantity::from_units(*b.inner())))
}

fn q_sub(a: &CelQuantity, b: &CelQuantity) -> Result<CelQuantity, ExecutionError> {
    a.0.checked_sub(&b.0)
        .map(CelQuantity)
        .ok_or_else(|| overflow("sub"))
}

fn q_sub_int(a: &CelQuantity, b: &CelInt) -> Result<CelQuantity, ExecutionError> {
    q_sub(a, &CelQuantity(Quantity::from_units(*b.inner())))
}

/// A semantic version (semver.org 2.0.0), compared by precedence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Semver {
    major: u64,
    minor: u64,
    patch: u64,
    pre: Vec<String>,
}

impl Semver {
    /// Parses a strict semver 2.0.0 version, as upstream's `semver.Parse`.
    pub(crate) fn parse(text: &str) -> Option<Semver> {
        let (core, _build) = match text.split_once('+') {
            Some((c, b)) => {
                let ok = b.split('.').all(|p| {
                    !p.is_empty() && p.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                });
                if !ok {
                    return None;
                }
                (c, Some(b))
            }
            None => (text, None),
        };
        let (version, pre) = match core.split_once('-') {
            Some((v, p)) => (v, Some(p)),
            None => (core, None),
        };
        let numeric = |s: &str| -> Option<u64> {
            if s.is_empty()
                || (s.len() > 1 && s.starts_with('0'))
                || !s.bytes().all(|c| c.is_ascii_digit())
            {
                return None;
            }
            s.parse().ok()
        };
        let mut parts = version.split('.');
        let major = numeric(parts.next()?)?;
        let minor = numeric(parts.next()?)?;
        let patch = numeric(parts.next()?)?;
        if parts.next().is_some() {
            return None;
        }
        let pre = match pre {
            None => Vec::new(),
            Some(p) => {
                let ids: Vec<String> = p.split('.').map(str::to_string).collect();
                for id in &ids {
                    let digits = id.bytes().all(|c| c.is_ascii_digit());
                    if id.is_empty()
                        || !id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                        || (digits && id.len() > 1 && id.starts_with('0'))
                    {
                        return None;
                    }
                }
                ids
            }
        };
        Some(Semver {
            major,
            minor,
            patch,
            pre,
        })
    }

    fn precedence(&self, other: &Semver) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(other.major, other.minor, other.patch))
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&other.pre) {
                        let o = match (a.parse::<u64>(), b.parse::<u64>()) {
                            (Ok(x), Ok(y)) => x.cmp(&y),
                            (Ok(_), Err(_)) => Ordering::Less,
                            (Err(_), Ok(_)) => Ordering::Greater,
                            (Err(_), Err(_)) => a.cmp(b),
                        };
                        if o != Ordering::Equal {
                            return o;
                        }
                    }
                    self.pre.len().cmp(&other.pre.len())
                }
            })
    }
}

impl fmt::Display for Semver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        if !self.pre.is_empty() {
            write!(f, "-{}", self.pre.join("."))?;
        }
        Ok(())
    }
}

/// A semantic version as a CEL value.
#[derive(Clone, Debug)]
pub(crate) struct CelSemver(Semver);

impl Val for CelSemver {
    fn get_type(&self) -> &Type {
        <Self as Val>::cel_type()
    }

    fn cel_type() -> &'static Type {
        &SEMVER_TYPE
    }

    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<CelSemver>()
            .is_some_and(|o| o.0.precedence(&self.0) == Ordering::Equal)
    }

    fn clone_as_boxed<'w>(&self) -> Box<dyn Val + 'w>
    where
        Self: 'w,
    {
        Box::new(self.clone())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

impl StaticVal for CelSemver {}

fn semver(s: &CelString<'_>) -> Result<CelSemver, ExecutionError> {
    Semver::parse(s.inner())
        .map(CelSemver)
        .ok_or_else(|| ExecutionError::function_error("semver", "invalid semver"))
}

fn is_semver(s: &CelString<'_>) -> CelBool {
    Semver::parse(s.inner()).is_some().into()
}

fn v_compare_to(a: &CelSemver, b: &CelSemver) -> CelInt {
    ordering(a.0.precedence(&b.0))
}

fn v_is_greater_than(a: &CelSemver, b: &CelSemver) -> CelBool {
    (a.0.precedence(&b.0) == Ordering::Greater).into()
}

fn v_is_less_than(a: &CelSemver, b: &CelSemver) -> CelBool {
    (a.0.precedence(&b.0) == Ordering::Less).into()
}

fn v_major(a: &CelSemver) -> CelInt {
    CelInt::from(a.0.major as i64)
}

fn v_minor(a: &CelSemver) -> CelInt {
    CelInt::from(a.0.minor as i64)
}

fn v_patch(a: &CelSemver) -> CelInt {
    CelInt::from(a.0.patch as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn device(json: serde_json::Value) -> k8s_openapi::api::resource::v1::Device {
        serde_json::from_value(json).expect("a device")
    }

    fn eval(expression: &str, d: &k8s_openapi::api::resource::v1::Device) -> Result<bool, String> {
        let selector = compile(expression, Features::STORED).map_err(|e| e.0)?;
        selector
            .matches(&DeviceInput {
                driver: "gpushare.io",
                allow_multiple_allocations: d.allow_multiple_allocations,
                attributes: d.attributes.as_ref(),
                capacity: d.capacity.as_ref(),
            })
            .map_err(|e| e.0)
    }

    fn gpu() -> k8s_openapi::api::resource::v1::Device {
        device(json!({ "name": "gpu-0", "allowMultipleAllocations": true,
            "attributes": { "type": { "string": "gpu" }, "uuid": { "string": "GPU-0" },
                "index": { "int": 0 }, "healthy": { "bool": true },
                "driverVersion": { "version": "550.54.15" },
                "resource.kubernetes.io/pcieRoot": { "string": "pci0000:00" } },
            "capacity": { "memory": { "value": "16Gi" } } }))
    }

    #[test]
    fn upstreams_environment_reads_the_device() {
        let d = gpu();
        for (expr, want) in [
            ("device.driver == \"gpushare.io\"", true),
            ("device.allowMultipleAllocations", true),
            ("device.attributes[\"gpushare.io\"].type == \"gpu\"", true),
            (
                "device.attributes[\"gpushare.io\"].index == 0 && device.attributes[\"gpushare.io\"].healthy",
                true,
            ),
            (
                "device.attributes[\"resource.kubernetes.io\"].pcieRoot == \"pci0000:00\"",
                true,
            ),
            (
                "device.capacity[\"gpushare.io\"].memory.compareTo(quantity(\"16Gi\")) == 0",
                true,
            ),
            (
                "device.capacity[\"gpushare.io\"].memory.isGreaterThan(quantity(\"8Gi\"))",
                true,
            ),
            (
                "device.capacity[\"gpushare.io\"].memory == quantity(\"16384Mi\")",
                true,
            ),
            (
                "device.attributes[\"gpushare.io\"].driverVersion.isGreaterThan(semver(\"535.0.0\"))",
                true,
            ),
            ("\"type\" in device.attributes[\"gpushare.io\"]", true),
            ("has(device.attributes[\"gpushare.io\"].resource)", false),
            ("device.attributes[\"other.io\"].size() == 0", true),
            (
                "cel.bind(g, device.attributes[\"gpushare.io\"], g.type == \"gpu\" && g.index == 0)",
                true,
            ),
            (
                "device.attributes[\"gpushare.io\"].?resource.orValue(\"none\") == \"none\"",
                true,
            ),
        ] {
            assert_eq!(eval(expr, &d), Ok(want), "{expr}");
        }
    }

    #[test]
    fn a_missing_attribute_is_a_runtime_error_not_a_mismatch() {
        let err = eval(
            "device.attributes[\"gpushare.io\"].resource == \"rdma\"",
            &gpu(),
        )
        .expect_err("no such key");
        assert!(err.starts_with("no such key: resource"), "{err}");
        assert!(
            err.contains("consider using CEL optional chaining"),
            "{err}"
        );
    }

    #[test]
    fn compile_refuses_what_upstreams_compiler_refuses() {
        for (expr, want) in [
            ("device.driver ==", "compilation failed: ERROR: <input>:1:"),
            ("foo == 1", "undeclared reference to 'foo'"),
            ("device.nope == 1", "undefined field 'nope'"),
            (
                "device.driver",
                "must evaluate to bool or the unknown type, not string",
            ),
            (
                "1 + 2",
                "must evaluate to bool or the unknown type, not int",
            ),
            (
                "frobnicate(device.driver)",
                "undeclared reference to 'frobnicate'",
            ),
        ] {
            let err = compile(expr, Features::STORED).expect_err(expr).0;
            assert!(err.contains(want), "{expr}: {err}");
        }
        let gated = Features {
            consumable_capacity: false,
        };
        assert!(compile("device.allowMultipleAllocations", gated).is_err());
        assert!(compile("device.attributes[\"a.b\"].x.all(v, v > 1)", gated).is_ok());
    }

    #[test]
    fn semver_precedence_is_semver_orgs() {
        let v = |s| Semver::parse(s).expect(s);
        assert_eq!(v("1.0.0-alpha").precedence(&v("1.0.0")), Ordering::Less);
        assert_eq!(
            v("1.0.0-alpha.1").precedence(&v("1.0.0-alpha.beta")),
            Ordering::Less
        );
        assert_eq!(v("1.0.0+build").precedence(&v("1.0.0")), Ordering::Equal);
        for bad in ["1.0", "01.0.0", "1.0.0-", "1.0.0-01", "v1.0.0", "1.0.0+"] {
            assert!(Semver::parse(bad).is_none(), "{bad}");
        }
    }
}
