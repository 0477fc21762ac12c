//! Upstream's validation of `resource.k8s.io/v1` objects (`pkg/apis/resource/validation`,
//! with the limits its declarative tags add), rule by rule, for the sandbox API server:
//! ResourceSlices, DeviceClasses, ResourceClaims (spec on create, immutability on update, the
//! status subresource) and ResourceClaimTemplates. A write that breaks a rule is refused with
//! the 422 `Invalid` Status upstream answers, its field paths and messages; a value of the wrong
//! JSON type or a quantity that does not parse is upstream's 400 decode error.
//!
//! Version-dependent limits follow the version played (`feature_gates::Cluster`): 128 devices
//! per slice, 64 once a device has taints or consumes counters (1.35+) or has list attributes
//! (1.36+); 4 taints per device on 1.34, 16 after; counter limits of 1.34 (32 counters in all
//! sets, 32 per device) and of 1.35+ (8 sets of 32, 2 consumptions of 32 per device). The
//! fields of a disabled gate are dropped before this runs (`resource_strategy`), as upstream's
//! `PrepareForCreate` does before `Validate`.
//!
//! What it does not check: object metadata beyond the name (the store checks names; labels,
//! annotations, owner references are not validated), node selectors beyond their term count,
//! the CEL cost limit (see `crate::dra_cel`), admin access authorization (the
//! `resource.kubernetes.io/admin-access` namespace label), derived attributes and the 1.37
//! alpha fields (`skipNodeOperations`, node-allocatable mappings, partition type attribute).
//! Defaults upstream writes (`allocationMode: ExactCount`, `count: 1`, toleration operator
//! `Equal`) are assumed when validating but not written into the stored object.

use std::collections::{BTreeSet, HashSet};

use serde_json::Value;

use super::discovery::ResourceDef;
use super::feature_gates::{Cluster, FeatureGate};
use super::field_errors::{
    BadValue, FieldError, Path, c_identifier, dns1123_label, dns1123_subdomain, invalid_status,
    label_value, qualified_name,
};
use super::store::{ApiError, Part};
use crate::dra_cel;
use crate::quantity::Quantity;

/// Upstream's limits (`k8s.io/api/resource/v1` constants).
const DRIVER_NAME_MAX: usize = 63;
const POOL_NAME_MAX: usize = 253;
const DEVICE_MAX_DOMAIN: usize = 63;
const DEVICE_MAX_ID: usize = 32;
const ATTRIBUTE_VALUE_MAX: usize = 64;
const MAX_DEVICES: usize = 128;
const MAX_DEVICES_WITH_ADVANCED_FEATURES: usize = 64;
const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
const MAX_ATTRIBUTE_VALUES: usize = 48;
const MAX_COUNTER_SETS: usize = 8;
const MAX_COUNTERS_PER_SET: usize = 32;
const MAX_CONSUMPTIONS_PER_DEVICE: usize = 2;
const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;
const MAX_SHARED_COUNTERS_1_34: usize = 32;
const MAX_COUNTERS_PER_DEVICE_1_34: usize = 32;
const MAX_REQUESTS: usize = 32;
const MAX_CONSTRAINTS: usize = 32;
const MAX_CONFIGS: usize = 32;
const MAX_SELECTORS: usize = 32;
const MAX_FIRST_AVAILABLE: usize = 8;
const MAX_TOLERATIONS: usize = 16;
const MAX_RESERVED_FOR: usize = 256;
const MAX_RESULTS: usize = 32;
const MAX_VALID_VALUES: usize = 10;
const MAX_BINDING_CONDITIONS: usize = 4;
const OPAQUE_PARAMETERS_MAX: usize = 10 * 1024;
const TAINT_EFFECTS: [&str; 3] = ["NoExecute", "NoSchedule", "None"];

/// Checks a write of `def` (a `resource.k8s.io/v1` kind; others pass) about to be stored:
/// `obj` as it will be stored, `old` the stored object of an update, `part` what is written.
pub(crate) fn validate(
    def: &ResourceDef,
    obj: &Value,
    old: Option<&Value>,
    part: Part,
    cluster: &Cluster,
) -> Result<(), ApiError> {
    let mut v = Validator {
        cluster,
        errors: Vec::new(),
        decode: Vec::new(),
    };
    let spec = Path::new("spec");
    match (def.id, old, part) {
        ("resourceslices", _, _) => {
            v.slice_spec(obj.get("spec"), old.and_then(|o| o.get("spec")), &spec)
        }
        ("deviceclasses", _, _) => {
            v.class_spec(obj.get("spec"), old.and_then(|o| o.get("spec")), &spec)
        }
        ("resourceclaims", None, _) => v.claim_spec(obj.get("spec"), &spec, false),
        ("resourceclaims", Some(old), Part::Main) => {
            v.immutable(obj.get("spec"), old.get("spec"), &spec);
        }
        ("resourceclaims", Some(old), Part::Status) => v.claim_status(obj, old),
        ("resourceclaimtemplates", None, _) => {
            v.claim_spec(obj.pointer("/spec/spec"), &spec.child("spec"), false)
        }
        ("resourceclaimtemplates", Some(old), _) => {
            v.immutable(obj.get("spec"), old.get("spec"), &spec);
        }
        _ => return Ok(()),
    }
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    if let Some(first) = v.decode.first() {
        return Err(ApiError::bad_request(format!(
            "{} in version \"v1\" cannot be handled as a {}: {first}",
            def.kind, def.kind
        )));
    }
    if v.errors.is_empty() {
        Ok(())
    } else {
        Err(invalid_status(def, name, &v.errors))
    }
}

struct Validator<'c> {
    cluster: &'c Cluster,
    errors: Vec<FieldError>,
    /// Values of the wrong JSON type: upstream cannot decode the object (400).
    decode: Vec<String>,
}

/// Upstream's validateMap shortens keys longer than 96 bytes in the middle in paths.
fn truncated(key: &str) -> String {
    const MAX: usize = DEVICE_MAX_DOMAIN + 1 + DEVICE_MAX_ID;
    if key.len() <= MAX || !key.is_char_boundary((MAX - 3).div_ceil(2)) {
        return key.to_string();
    }
    let remaining = MAX - 3;
    let head = remaining.div_ceil(2);
    let tail = remaining / 2;
    match (key.get(..head), key.get(key.len() - tail..)) {
        (Some(h), Some(t)) => format!("{h}...{t}"),
        _ => key.to_string(),
    }
}

impl Validator<'_> {
    fn push(&mut self, e: FieldError) {
        self.errors.push(e);
    }

    fn invalid_each(&mut self, path: &Path, value: &str, msgs: Vec<String>) {
        for m in msgs {
            self.push(FieldError::invalid(path, value, m));
        }
    }

    fn minor(&self) -> u32 {
        self.cluster.minor()
    }

    fn on(&self, gate: FeatureGate) -> bool {
        self.cluster.enabled(gate)
    }

    // --- JSON access -----------------------------------------------------------------------

    /// The array at `v` (empty when absent or null); a non-array is a decode error.
    fn array<'a>(&mut self, v: Option<&'a Value>, path: &Path) -> &'a [Value] {
        match v {
            None | Some(Value::Null) => &[],
            Some(Value::Array(a)) => a,
            Some(_) => {
                self.decode.push(format!("{path}: expected an array"));
                &[]
            }
        }
    }

    /// The object at `v` as (key, value) pairs in key order; a non-object is a decode error.
    fn object<'a>(&mut self, v: Option<&'a Value>, path: &Path) -> Vec<(&'a String, &'a Value)> {
        match v {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Object(o)) => o.iter().collect(),
            Some(_) => {
                self.decode.push(format!("{path}: expected an object"));
                Vec::new()
            }
        }
    }

    /// The string at `v.key`; a non-string is a decode error, absent is `None`.
    fn string<'a>(&mut self, v: &'a Value, key: &str, path: &Path) -> Option<&'a str> {
        match v.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => {
                self.decode
                    .push(format!("{}: expected a string", path.child(key)));
                None
            }
        }
    }

    fn boolean(&mut self, v: &Value, key: &str, path: &Path) -> Option<bool> {
        match v.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => {
                self.decode
                    .push(format!("{}: expected a boolean", path.child(key)));
                None
            }
        }
    }

    fn integer(&mut self, v: &Value, key: &str, path: &Path) -> Option<i64> {
        match v.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64(),
            Some(_) => {
                self.decode
                    .push(format!("{}: expected an integer", path.child(key)));
                None
            }
        }
    }

    /// The quantity at `v.key` (a string or a number, as upstream reads them).
    fn quantity(&mut self, v: &Value, key: &str, path: &Path) -> Option<Quantity> {
        let text = match v.get(key) {
            None | Some(Value::Null) => return None,
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(_) => {
                self.decode
                    .push(format!("{}: expected a quantity", path.child(key)));
                return None;
            }
        };
        match Quantity::parse(&text) {
            Ok(q) => Some(q),
            Err(e) => {
                self.decode.push(e.to_string());
                None
            }
        }
    }

    // --- names -----------------------------------------------------------------------------

    /// `validateDriverName` (ValidateCSIDriverName): required, at most 63 bytes, a DNS
    /// subdomain once lower-cased.
    fn driver_name(&mut self, name: Option<&str>, path: &Path) {
        match name {
            None | Some("") => self.push(FieldError::required(path, "")),
            Some(n) => {
                if n.len() > DRIVER_NAME_MAX {
                    self.push(FieldError::too_long(path, DRIVER_NAME_MAX));
                }
                let msgs = dns1123_subdomain(&n.to_lowercase());
                self.invalid_each(path, n, msgs);
            }
        }
    }

    fn dns_label(&mut self, name: &str, path: &Path) {
        let msgs = dns1123_label(name);
        self.invalid_each(path, name, msgs);
    }

    fn dns_subdomain(&mut self, name: &str, path: &Path) {
        let msgs = dns1123_subdomain(name);
        self.invalid_each(path, name, msgs);
    }

    fn pool_name(&mut self, name: Option<&str>, path: &Path) {
        match name {
            None | Some("") => self.push(FieldError::required(path, "")),
            Some(n) => {
                if n.len() > POOL_NAME_MAX {
                    self.push(FieldError::too_long(path, POOL_NAME_MAX));
                }
                for part in n.split('/') {
                    self.dns_subdomain(part, path);
                }
            }
        }
    }

    fn c_ident(&mut self, id: &str, path: &Path) {
        if id.len() > DEVICE_MAX_ID {
            self.push(FieldError::too_long(path, DEVICE_MAX_ID));
        }
        let msgs = c_identifier(id);
        self.invalid_each(path, id, msgs);
    }

    /// `validateQualifiedName`: an attribute or capacity name, `<C identifier>` or
    /// `<domain>/<C identifier>`; errors are reported on the map, not the key.
    fn qualified(&mut self, name: &str, path: &Path) {
        let parts: Vec<&str> = name.split('/').collect();
        match parts.as_slice() {
            [id] => self.c_ident(id, path),
            [domain, id] => {
                if domain.is_empty() {
                    self.push(FieldError::invalid(
                        path,
                        "",
                        "the domain must not be empty",
                    ));
                } else {
                    self.driver_name(Some(domain), path);
                }
                if id.is_empty() {
                    self.push(FieldError::invalid(path, "", "the name must not be empty"));
                } else {
                    self.c_ident(id, path);
                }
            }
            _ => self.push(FieldError::invalid(
                path,
                name,
                "must not contain more than one slash",
            )),
        }
    }

    /// `validateFullyQualifiedName`: a qualified name with a domain.
    fn fully_qualified(&mut self, name: &str, path: &Path) {
        self.qualified(name, path);
        if !name.contains('/') {
            self.push(FieldError::invalid(
                path,
                name,
                "a fully qualified name must be a domain and a name separated by a slash",
            ));
        }
    }

    fn label_name(&mut self, name: &str, path: &Path) {
        let msgs = qualified_name(name);
        self.invalid_each(path, name, msgs);
    }

    // --- ResourceSlice ---------------------------------------------------------------------

    fn slice_spec(&mut self, spec: Option<&Value>, old: Option<&Value>, path: &Path) {
        let empty = Value::Null;
        let spec = spec.unwrap_or(&empty);
        let driver = self.string(spec, "driver", path);
        self.driver_name(driver, &path.child("driver"));
        let pool_path = path.child("pool");
        let pool = spec.get("pool").unwrap_or(&empty);
        let pool_name = self.string(pool, "name", &pool_path);
        self.pool_name(pool_name, &pool_path.child("name"));
        let count = self
            .integer(pool, "resourceSliceCount", &pool_path)
            .unwrap_or(0);
        if count <= 0 {
            self.push(FieldError::invalid(
                &pool_path.child("resourceSliceCount"),
                count,
                "must be greater than zero",
            ));
        }
        let generation = self.integer(pool, "generation", &pool_path).unwrap_or(0);
        if generation < 0 {
            self.push(FieldError::invalid(
                &pool_path.child("generation"),
                generation,
                "must be greater than or equal to zero",
            ));
        }
        if let Some(old) = old {
            for (p, new, was) in [
                (
                    pool_path.child("name"),
                    spec.pointer("/pool/name"),
                    old.pointer("/pool/name"),
                ),
                (path.child("driver"), spec.get("driver"), old.get("driver")),
                (
                    path.child("nodeName"),
                    spec.get("nodeName"),
                    old.get("nodeName"),
                ),
            ] {
                self.immutable(new, was, &p);
            }
        }
        let mut set = Vec::new();
        match self.string(spec, "nodeName", path) {
            Some("") => self.push(FieldError::invalid(
                &path.child("nodeName"),
                "",
                "must be either unset or set to a non-empty string",
            )),
            Some(n) => {
                set.push("`nodeName`");
                self.dns_subdomain(n, &path.child("nodeName"));
            }
            None => {}
        }
        if let Some(sel) = spec.get("nodeSelector").filter(|s| !s.is_null()) {
            set.push("`nodeSelector`");
            let terms_path = path.child("nodeSelector").child("nodeSelectorTerms");
            let terms = self.array(sel.get("nodeSelectorTerms"), &terms_path);
            if terms.len() != 1 {
                self.push(FieldError::invalid(
                    &terms_path,
                    BadValue::Raw(Value::Array(terms.to_vec()).to_string()),
                    "must have exactly one node selector term",
                ));
            }
        }
        for (field, label) in [
            ("allNodes", "`allNodes`"),
            ("perDeviceNodeSelection", "`perDeviceNodeSelection`"),
        ] {
            match self.boolean(spec, field, path) {
                Some(true) => set.push(label),
                Some(false) => self.push(FieldError::invalid(
                    &path.child(field),
                    BadValue::Bool(false),
                    "must be either unset or set to true",
                )),
                None => {}
            }
        }
        match set.len() {
            0 => self.push(FieldError::required(
                path,
                "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
            )),
            1 => {}
            _ => self.push(FieldError::invalid(
                path,
                format!("{{{}}}", set.join(", ")),
                "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required, but multiple fields are set",
            )),
        }
        let devices_path = path.child("devices");
        let devices = self.array(spec.get("devices"), &devices_path);
        let counters_path = path.child("sharedCounters");
        let counter_sets = self.array(spec.get("sharedCounters"), &counters_path);
        if self.minor() >= 35
            && spec.get("sharedCounters").is_some_and(|v| !v.is_null())
            && spec.get("devices").is_some_and(|v| !v.is_null())
        {
            self.push(FieldError::invalid(
                path,
                "",
                "only one of `sharedCounters` or `devices` is allowed",
            ));
        }
        let has = |f: &dyn Fn(&Value) -> bool| devices.iter().any(f);
        let tainted = has(&|d| non_empty(d.get("taints")));
        let consumes = has(&|d| non_empty(d.get("consumesCounters")));
        let lists = has(&|d| {
            d.get("attributes")
                .and_then(Value::as_object)
                .is_some_and(|a| {
                    a.values().any(|a| {
                        ["bools", "ints", "strings", "versions"]
                            .iter()
                            .any(|l| a.get(*l).is_some())
                    })
                })
        });
        let max = match self.minor() {
            ..=34 => MAX_DEVICES,
            35 if tainted || consumes => MAX_DEVICES_WITH_ADVANCED_FEATURES,
            36.. if tainted || consumes || lists => MAX_DEVICES_WITH_ADVANCED_FEATURES,
            _ => MAX_DEVICES,
        };
        if devices.len() > max {
            self.push(FieldError::too_many(&devices_path, devices.len(), max));
        } else {
            let per_device_selection =
                spec.get("perDeviceNodeSelection") == Some(&Value::Bool(true));
            let mut names = HashSet::new();
            for (i, d) in devices.iter().enumerate() {
                let dp = devices_path.index(i);
                let name = d.get("name").and_then(Value::as_str).unwrap_or("");
                let old_device = old
                    .and_then(|o| o.get("devices"))
                    .and_then(Value::as_array)
                    .and_then(|a| {
                        a.iter()
                            .find(|o| o.get("name").and_then(Value::as_str) == Some(name))
                    });
                self.device(d, old_device, &dp, per_device_selection);
                if !names.insert(name.to_string()) {
                    self.push(FieldError::duplicate(&dp, name));
                }
            }
            if self.minor() <= 34 {
                let counters: usize = devices
                    .iter()
                    .map(|d| {
                        items(d.get("consumesCounters"))
                            .map(|c| {
                                c.get("counters")
                                    .and_then(Value::as_object)
                                    .map_or(0, |m| m.len())
                            })
                            .sum::<usize>()
                    })
                    .sum();
                const MAX_DEVICE_COUNTERS_PER_SLICE_1_34: usize = 1024;
                if counters > MAX_DEVICE_COUNTERS_PER_SLICE_1_34 {
                    self.push(FieldError::invalid(
                        &devices_path,
                        counters,
                        format!("the total number of counters must not exceed {MAX_DEVICE_COUNTERS_PER_SLICE_1_34}"),
                    ));
                }
            }
        }
        self.counter_sets(counter_sets, &counters_path);
    }

    fn counter_sets(&mut self, sets: &[Value], path: &Path) {
        if self.minor() <= 34 {
            let total: usize = sets
                .iter()
                .map(|s| {
                    s.get("counters")
                        .and_then(Value::as_object)
                        .map_or(0, |m| m.len())
                })
                .sum();
            if total > MAX_SHARED_COUNTERS_1_34 {
                self.push(FieldError::invalid(
                    path,
                    total,
                    format!("the total number of shared counters must not exceed {MAX_SHARED_COUNTERS_1_34}"),
                ));
            }
        } else if sets.len() > MAX_COUNTER_SETS {
            self.push(FieldError::too_many(path, sets.len(), MAX_COUNTER_SETS));
            return;
        }
        let mut names = HashSet::new();
        for (i, set) in sets.iter().enumerate() {
            let sp = path.index(i);
            let name = self.string(set, "name", &sp).unwrap_or("");
            if name.is_empty() {
                self.push(FieldError::required(&sp.child("name"), ""));
            } else {
                self.dns_label(name, &sp.child("name"));
            }
            let max = if self.minor() <= 34 {
                usize::MAX
            } else {
                MAX_COUNTERS_PER_SET
            };
            self.counters(set.get("counters"), &sp.child("counters"), max);
            if !names.insert(name.to_string()) {
                self.push(FieldError::duplicate(&sp, name));
            }
        }
    }

    /// A map of counters (DNS-label names, parsed values), required and bounded.
    fn counters(&mut self, counters: Option<&Value>, path: &Path, max: usize) {
        let entries = self.object(counters, path);
        if entries.is_empty() {
            self.push(FieldError::required(path, ""));
            return;
        }
        if entries.len() > max {
            self.push(FieldError::too_many(path, entries.len(), max));
            return;
        }
        for (name, counter) in entries {
            self.dns_label(name, path);
            self.quantity(counter, "value", &path.key(&truncated(name)));
        }
    }

    fn device(&mut self, d: &Value, old: Option<&Value>, path: &Path, per_device_selection: bool) {
        let name = self.string(d, "name", path).unwrap_or("");
        self.dns_label(name, &path.child("name"));
        let attributes = self.object(d.get("attributes"), &path.child("attributes"));
        let capacity = self.object(d.get("capacity"), &path.child("capacity"));
        let combined = attributes.len() + capacity.len();
        if combined > MAX_ATTRIBUTES_AND_CAPACITIES {
            self.push(FieldError::invalid(
                path,
                combined,
                format!("the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}"),
            ));
        }
        if self.minor() >= 36 {
            let values: usize = attributes
                .iter()
                .map(|(_, a)| {
                    let n: usize = ["bools", "ints", "strings", "versions"]
                        .iter()
                        .map(|l| a.get(*l).and_then(Value::as_array).map_or(0, Vec::len))
                        .sum();
                    n.max(1)
                })
                .sum();
            if values > MAX_ATTRIBUTE_VALUES {
                self.push(FieldError::invalid(
                    path,
                    values,
                    format!("the total number of attribute values must not exceed {MAX_ATTRIBUTE_VALUES}"),
                ));
            }
        }
        let attributes_path = path.child("attributes");
        for (key, a) in attributes {
            self.qualified(key, &attributes_path);
            self.attribute(a, &attributes_path.key(&truncated(key)));
        }
        let capacity_path = path.child("capacity");
        let shared = self.boolean(d, "allowMultipleAllocations", path) == Some(true);
        let capacity_unchanged = old.is_some_and(|o| o.get("capacity") == d.get("capacity"));
        for (key, c) in capacity {
            self.qualified(key, &capacity_path);
            let cp = capacity_path.key(&truncated(key));
            let value = self.quantity(c, "value", &cp);
            if capacity_unchanged {
                continue;
            }
            match c.get("requestPolicy").filter(|p| !p.is_null()) {
                Some(policy) if shared => {
                    if let Some(value) = value {
                        self.request_policy(policy, value, &cp.child("requestPolicy"));
                    }
                }
                Some(_) => self.push(FieldError::forbidden(
                    &cp.child("requestPolicy"),
                    "allowMultipleAllocations must be true",
                )),
                None => {}
            }
        }
        let taints_path = path.child("taints");
        let taints = self.array(d.get("taints"), &taints_path);
        let taints_unchanged = old.is_some_and(|o| o.get("taints") == d.get("taints"));
        let max_taints = if self.minor() <= 34 { 4 } else { 16 };
        if taints.len() > max_taints {
            self.push(FieldError::too_many(&taints_path, taints.len(), max_taints));
        } else if !taints_unchanged {
            for (i, t) in taints.iter().enumerate() {
                self.taint(t, &taints_path.index(i));
            }
        }
        let consumes_path = path.child("consumesCounters");
        let consumes = self.array(d.get("consumesCounters"), &consumes_path);
        if self.minor() >= 35 && consumes.len() > MAX_CONSUMPTIONS_PER_DEVICE {
            self.push(FieldError::too_many(
                &consumes_path,
                consumes.len(),
                MAX_CONSUMPTIONS_PER_DEVICE,
            ));
        } else {
            if self.minor() <= 34 {
                let total: usize = consumes
                    .iter()
                    .map(|c| {
                        c.get("counters")
                            .and_then(Value::as_object)
                            .map_or(0, |m| m.len())
                    })
                    .sum();
                if total > MAX_COUNTERS_PER_DEVICE_1_34 {
                    self.push(FieldError::invalid(
                        &consumes_path,
                        total,
                        format!("the total number of counters must not exceed {MAX_COUNTERS_PER_DEVICE_1_34}"),
                    ));
                }
            }
            let mut sets = HashSet::new();
            for (i, c) in consumes.iter().enumerate() {
                let cp = consumes_path.index(i);
                let set = self.string(c, "counterSet", &cp).unwrap_or("");
                if set.is_empty() {
                    self.push(FieldError::required(&cp.child("counterSet"), ""));
                } else {
                    self.dns_label(set, &cp.child("counterSet"));
                }
                let max = if self.minor() <= 34 {
                    usize::MAX
                } else {
                    MAX_COUNTERS_PER_CONSUMPTION
                };
                self.counters(c.get("counters"), &cp.child("counters"), max);
                if !sets.insert(set.to_string()) {
                    self.push(FieldError::duplicate(&cp, set));
                }
            }
        }
        let node_fields = ["nodeName", "nodeSelector", "allNodes"];
        if per_device_selection {
            let mut set = Vec::new();
            match self.string(d, "nodeName", path) {
                Some("") => self.push(FieldError::invalid(
                    &path.child("nodeName"),
                    "",
                    "must not be empty",
                )),
                Some(n) => {
                    set.push("`nodeName`");
                    self.dns_subdomain(n, &path.child("nodeName"));
                }
                None => {}
            }
            if d.get("nodeSelector").is_some_and(|s| !s.is_null()) {
                set.push("`nodeSelector`");
            }
            match self.boolean(d, "allNodes", path) {
                Some(true) => set.push("`allNodes`"),
                Some(false) => self.push(FieldError::invalid(
                    &path.child("allNodes"),
                    BadValue::Bool(false),
                    "must be either unset or set to true",
                )),
                None => {}
            }
            const ONE_OF: &str = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
            match set.len() {
                0 => self.push(FieldError::required(path, ONE_OF)),
                1 => {}
                _ => self.push(FieldError::invalid(
                    path,
                    format!("{{{}}}", set.join(", ")),
                    ONE_OF,
                )),
            }
        } else if node_fields
            .iter()
            .any(|f| d.get(*f).is_some_and(|v| !v.is_null()))
        {
            self.push(FieldError::invalid(
                path,
                BadValue::Null,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            ));
        }
        self.binding_conditions(d, path);
    }

    fn attribute(&mut self, a: &Value, path: &Path) {
        let mut fields = 0;
        if a.get("bool").is_some() {
            fields += 1;
            self.boolean(a, "bool", path);
        }
        if a.get("int").is_some() {
            fields += 1;
            self.integer(a, "int", path);
        }
        if a.get("string").is_some() {
            fields += 1;
            if let Some(s) = self.string(a, "string", path)
                && s.len() > ATTRIBUTE_VALUE_MAX
            {
                self.push(FieldError::too_long(
                    &path.child("string"),
                    ATTRIBUTE_VALUE_MAX,
                ));
            }
        }
        if a.get("version").is_some() {
            fields += 1;
            if let Some(v) = self.string(a, "version", path) {
                self.version(v, &path.child("version"));
            }
        }
        for list in ["bools", "ints", "strings", "versions"] {
            let Some(items) = a.get(list) else { continue };
            fields += 1;
            let lp = path.child(list);
            let items = self.array(Some(items), &lp);
            if items.is_empty() {
                self.push(FieldError::invalid(
                    &lp,
                    "[]",
                    "must not be empty if specified",
                ));
            }
            for (i, item) in items.iter().enumerate() {
                let ip = lp.index(i);
                match (list, item) {
                    ("strings", Value::String(s)) if s.len() > ATTRIBUTE_VALUE_MAX => {
                        self.push(FieldError::too_long(&ip, ATTRIBUTE_VALUE_MAX));
                    }
                    ("versions", Value::String(s)) => self.version(s, &ip),
                    ("bools", Value::Bool(_)) | ("strings", Value::String(_)) => {}
                    ("ints", Value::Number(n)) if n.as_i64().is_some() => {}
                    _ => self.decode.push(format!("{ip}: a value of the wrong type")),
                }
            }
        }
        match fields {
            0 => self.push(FieldError::invalid(
                path,
                "",
                "exactly one value must be specified",
            )),
            1 => {}
            _ => self.push(FieldError::invalid(
                path,
                BadValue::Raw(a.to_string()),
                "exactly one value must be specified",
            )),
        }
    }

    fn version(&mut self, v: &str, path: &Path) {
        if dra_cel::Semver::parse(v).is_none() {
            self.push(FieldError::invalid(
                path,
                v,
                "must be a string compatible with semver.org spec 2.0.0",
            ));
        }
        if v.len() > ATTRIBUTE_VALUE_MAX {
            self.push(FieldError::too_long(path, ATTRIBUTE_VALUE_MAX));
        }
    }

    /// `validateRequestPolicy` of a capacity of `value` (only for new or changed capacity).
    fn request_policy(&mut self, policy: &Value, capacity: Quantity, path: &Path) {
        let has_values = policy
            .get("validValues")
            .and_then(Value::as_array)
            .is_some_and(|v| !v.is_empty());
        let has_range = policy.get("validRange").is_some_and(|r| !r.is_null());
        if has_values && has_range {
            self.push(FieldError::forbidden(
                path,
                "exactly one policy can be specified, cannot specify \"validValues\" and \"validRange\" at the same time",
            ));
            return;
        }
        let default = self.quantity(policy, "default", path);
        if has_values {
            let Some(default) = default else {
                self.push(FieldError::required(
                    &path.child("default"),
                    "required when validValues is defined",
                ));
                return;
            };
            let vp = path.child("validValues");
            let raw = self.array(policy.get("validValues"), &vp);
            let mut values = Vec::new();
            for (i, _) in raw.iter().enumerate() {
                let text = match &raw[i] {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    _ => {
                        self.decode
                            .push(format!("{}: expected a quantity", vp.index(i)));
                        continue;
                    }
                };
                match Quantity::parse(&text) {
                    Ok(q) => values.push(q),
                    Err(e) => self.decode.push(e.to_string()),
                }
            }
            for i in 0..values.len().saturating_sub(1) {
                if values[i] > values[i + 1] {
                    self.push(FieldError::invalid(
                        &vp.index(i + 1),
                        values[i + 1].canonical(),
                        "values must be sorted in ascending order",
                    ));
                }
            }
            if values.len() > MAX_VALID_VALUES {
                self.push(FieldError::too_many(&vp, values.len(), MAX_VALID_VALUES));
            } else {
                let mut seen = BTreeSet::new();
                for (i, q) in values.iter().enumerate() {
                    if *q > capacity {
                        self.push(FieldError::invalid(
                            &vp.index(i),
                            q.canonical(),
                            format!(
                                "option is larger than capacity value: {}",
                                capacity.canonical()
                            ),
                        ));
                    }
                    let key = if self.minor() >= 37 {
                        q.milli_value()
                    } else {
                        q.value()
                    };
                    if !seen.insert(key) {
                        self.push(FieldError::duplicate(&vp.index(i), q.canonical()));
                    }
                }
            }
            if !values.contains(&default) {
                self.push(FieldError::invalid(
                    &vp,
                    default.canonical(),
                    "default value is not valid according to the requestPolicy",
                ));
            }
        } else if has_range {
            let Some(default) = default else {
                self.push(FieldError::required(
                    &path.child("default"),
                    "required when validRange is defined",
                ));
                return;
            };
            let range = policy.get("validRange").unwrap_or(&Value::Null);
            let rp = path.child("validRange");
            let Some(min) = self.quantity(range, "min", &rp) else {
                self.push(FieldError::required(
                    &rp.child("min"),
                    "required when validRange is defined",
                ));
                return;
            };
            if min > capacity {
                self.push(FieldError::invalid(
                    &rp.child("min"),
                    min.canonical(),
                    format!(
                        "min is larger than capacity value: {}",
                        capacity.canonical()
                    ),
                ));
            }
            if default < min {
                self.push(FieldError::invalid(
                    &rp.child("default"),
                    default.canonical(),
                    format!("default is less than min: {}", min.canonical()),
                ));
            }
            let max = self.quantity(range, "max", &rp);
            if let Some(max) = max {
                if min > max {
                    self.push(FieldError::invalid(
                        &rp.child("max"),
                        min.canonical(),
                        format!("min is larger than max: {}", max.canonical()),
                    ));
                }
                if max > capacity {
                    self.push(FieldError::invalid(
                        &rp.child("max"),
                        max.canonical(),
                        format!(
                            "max is larger than capacity value: {}",
                            capacity.canonical()
                        ),
                    ));
                }
                if default > max {
                    self.push(FieldError::invalid(
                        &rp.child("default"),
                        default.canonical(),
                        format!("default is more than max: {}", max.canonical()),
                    ));
                }
            }
            let Some(step) = self.quantity(range, "step", &rp) else {
                return;
            };
            let sp = rp.child("step");
            if step.sign() <= 0 {
                self.push(FieldError::invalid(
                    &sp,
                    step.canonical(),
                    "must be greater than zero",
                ));
                return;
            }
            if let Some(one_step) = min.checked_add(&step)
                && one_step > capacity
            {
                self.push(FieldError::invalid(
                    &sp,
                    step.canonical(),
                    format!(
                        "one step {} is larger than capacity value: {}",
                        one_step.canonical(),
                        capacity.canonical()
                    ),
                ));
            }
            // Milli arithmetic once anything is fractional (DRAFractionalCapacityRange, 1.37),
            // else whole units, each bound first checked to fit an int64.
            let fractional = self.minor() >= 37
                && [Some(default), Some(min), max, Some(step)]
                    .iter()
                    .flatten()
                    .any(|q| !q.is_integer());
            let read = |q: &Quantity| {
                if fractional {
                    q.milli_value()
                } else {
                    q.value()
                }
            };
            let mut unsafe_value = false;
            for (name, q) in [
                ("default", Some(default)),
                ("min", Some(min)),
                ("max", max),
                ("step", Some(step)),
            ] {
                let Some(q) = q else { continue };
                if q.sign() < 0 {
                    self.push(FieldError::invalid(
                        &rp.child(name),
                        q.canonical(),
                        "must be greater than or equal to 0",
                    ));
                    unsafe_value = true;
                } else if read(&q).is_none() {
                    self.push(FieldError::invalid(
                        &rp.child(name),
                        q.canonical(),
                        "must not be larger than 9223372036854775807",
                    ));
                    unsafe_value = true;
                }
            }
            if unsafe_value {
                return;
            }
            for value in [Some(default), max].into_iter().flatten() {
                let (v, m, s) = (read(&value), read(&min), read(&step));
                if let (Some(v), Some(m), Some(s)) = (v, m, s)
                    && s != 0
                    && (v - m) % s != 0
                {
                    self.push(FieldError::invalid(
                        &sp,
                        value.canonical(),
                        format!(
                            "value is not a multiple of a given step ({}) from ({})",
                            step.canonical(),
                            min.canonical()
                        ),
                    ));
                }
            }
        }
    }

    fn taint(&mut self, t: &Value, path: &Path) {
        let key = self.string(t, "key", path).unwrap_or("");
        self.label_name(key, &path.child("key"));
        if let Some(value) = self.string(t, "value", path).filter(|v| !v.is_empty()) {
            let msgs = label_value(value);
            self.invalid_each(&path.child("value"), value, msgs);
        }
        match self.string(t, "effect", path) {
            None | Some("") => self.push(FieldError::required(&path.child("effect"), "")),
            Some(e) if !TAINT_EFFECTS.contains(&e) => self.push(FieldError::not_supported(
                &path.child("effect"),
                e,
                &TAINT_EFFECTS,
            )),
            Some(_) => {}
        }
    }

    fn toleration(&mut self, t: &Value, path: &Path) {
        if let Some(key) = self.string(t, "key", path).filter(|k| !k.is_empty()) {
            self.label_name(key, &path.child("key"));
        }
        let value = self.string(t, "value", path).unwrap_or("");
        // Upstream defaults an empty operator to `Equal`.
        match self.string(t, "operator", path).unwrap_or("Equal") {
            "Exists" => {
                if !value.is_empty() {
                    self.push(FieldError::invalid(
                        &path.child("value"),
                        value,
                        "must be empty for operator `Exists`",
                    ));
                }
            }
            "Equal" | "" => {
                let msgs = label_value(value);
                self.invalid_each(&path.child("value"), value, msgs);
            }
            other => self.push(FieldError::not_supported(
                &path.child("operator"),
                other,
                &["Equal", "Exists"],
            )),
        }
        if let Some(e) = self.string(t, "effect", path).filter(|e| !e.is_empty())
            && !TAINT_EFFECTS.contains(&e)
        {
            self.push(FieldError::not_supported(
                &path.child("effect"),
                e,
                &TAINT_EFFECTS,
            ));
        }
    }

    fn binding_conditions(&mut self, v: &Value, path: &Path) {
        let cp = path.child("bindingConditions");
        let fp = path.child("bindingFailureConditions");
        let conditions: Vec<String> = self
            .array(v.get("bindingConditions"), &cp)
            .iter()
            .map(|c| c.as_str().unwrap_or("").to_string())
            .collect();
        let failures: Vec<String> = self
            .array(v.get("bindingFailureConditions"), &fp)
            .iter()
            .map(|c| c.as_str().unwrap_or("").to_string())
            .collect();
        for (list, p) in [(&conditions, &cp), (&failures, &fp)] {
            if list.len() > MAX_BINDING_CONDITIONS {
                self.push(FieldError::too_many(p, list.len(), MAX_BINDING_CONDITIONS));
            } else {
                for (i, c) in list.iter().enumerate() {
                    self.label_name(c, &p.index(i));
                }
            }
        }
        let mut seen = HashSet::new();
        for (i, c) in conditions.iter().enumerate() {
            if !seen.insert(c) {
                self.push(FieldError::duplicate(&cp.index(i), c.as_str()));
            }
        }
        let mut seen = HashSet::new();
        for (i, c) in failures.iter().enumerate() {
            if !seen.insert(c) {
                self.push(FieldError::duplicate(&fp.index(i), c.as_str()));
            }
            if conditions.contains(c) {
                self.push(FieldError::invalid(
                    &fp.index(i),
                    c.as_str(),
                    "bindingFailureConditions must not overlap with bindingConditions",
                ));
            }
        }
        if conditions.is_empty() && !failures.is_empty() {
            self.push(FieldError::invalid(
                &cp,
                "[]",
                "bindingConditions are required to use bindingFailureConditions",
            ));
        }
        if failures.is_empty() && !conditions.is_empty() {
            self.push(FieldError::invalid(
                &fp,
                "[]",
                "bindingFailureConditions are required to use bindingConditions",
            ));
        }
    }

    // --- DeviceClass -----------------------------------------------------------------------

    fn class_spec(&mut self, spec: Option<&Value>, old: Option<&Value>, path: &Path) {
        let empty = Value::Null;
        let spec = spec.unwrap_or(&empty);
        // Selectors exactly as before are stored expressions: not compiled again.
        let stored = old.is_some_and(|o| o.get("selectors") == spec.get("selectors"));
        self.selectors(spec.get("selectors"), &path.child("selectors"), stored);
        let config_stored = old.is_some_and(|o| o.get("config") == spec.get("config"));
        let cp = path.child("config");
        let configs = self.array(spec.get("config"), &cp);
        if configs.len() > MAX_CONFIGS {
            self.push(FieldError::too_many(&cp, configs.len(), MAX_CONFIGS));
        } else {
            for (i, c) in configs.iter().enumerate() {
                self.device_configuration(c, &cp.index(i), config_stored);
            }
        }
        if let Some(name) = self.string(spec, "extendedResourceName", path)
            && !is_extended_resource_name(name)
        {
            self.push(FieldError::invalid(
                &path.child("extendedResourceName"),
                name,
                "must be a valid extended resource name",
            ));
        }
    }

    fn selectors(&mut self, selectors: Option<&Value>, path: &Path, stored: bool) {
        let selectors = self.array(selectors, path);
        if selectors.len() > MAX_SELECTORS {
            self.push(FieldError::too_many(path, selectors.len(), MAX_SELECTORS));
            return;
        }
        for (i, s) in selectors.iter().enumerate() {
            let sp = path.index(i);
            let Some(cel) = s.get("cel").filter(|c| !c.is_null()) else {
                self.push(FieldError::required(&sp.child("cel"), ""));
                continue;
            };
            let ep = sp.child("cel").child("expression");
            let expression = self
                .string(cel, "expression", &sp.child("cel"))
                .unwrap_or("");
            if stored {
                continue;
            }
            if expression.len() > dra_cel::MAX_EXPRESSION_LENGTH {
                self.push(FieldError::too_long(&ep, dra_cel::MAX_EXPRESSION_LENGTH));
                continue;
            }
            let features = dra_cel::Features {
                consumable_capacity: self.on(FeatureGate::DRAConsumableCapacity),
            };
            if let Err(e) = dra_cel::compile(expression, features) {
                self.push(FieldError::invalid(&ep, expression, e.0));
            }
        }
    }

    fn device_configuration(&mut self, c: &Value, path: &Path, stored: bool) {
        let Some(opaque) = c.get("opaque").filter(|o| !o.is_null()) else {
            self.push(FieldError::required(&path.child("opaque"), ""));
            return;
        };
        let op = path.child("opaque");
        let driver = self.string(opaque, "driver", &op);
        self.driver_name(driver, &op.child("driver"));
        let pp = op.child("parameters");
        match opaque.get("parameters") {
            None | Some(Value::Null) => self.push(FieldError::required(&pp, "")),
            Some(p) => {
                if !stored && p.to_string().len() > OPAQUE_PARAMETERS_MAX {
                    self.push(FieldError::too_long(&pp, OPAQUE_PARAMETERS_MAX));
                } else if !p.is_object() {
                    self.push(FieldError::invalid(
                        &pp,
                        "<value omitted>",
                        "must be a valid JSON object",
                    ));
                }
            }
        }
    }

    // --- ResourceClaim (and the claim spec of a template) ----------------------------------

    fn claim_spec(&mut self, spec: Option<&Value>, path: &Path, stored: bool) {
        let empty = Value::Null;
        let devices = spec.and_then(|s| s.get("devices")).unwrap_or(&empty);
        let dp = path.child("devices");
        let rp = dp.child("requests");
        let requests = self.array(devices.get("requests"), &rp);
        let names = request_names(requests);
        if requests.len() > MAX_REQUESTS {
            self.push(FieldError::too_many(&rp, requests.len(), MAX_REQUESTS));
        } else {
            let mut seen = HashSet::new();
            for (i, r) in requests.iter().enumerate() {
                let p = rp.index(i);
                self.request(r, &p, stored);
                let name = r.get("name").and_then(Value::as_str).unwrap_or("");
                if !seen.insert(name) {
                    self.push(FieldError::duplicate(&p, name));
                }
            }
        }
        let cp = dp.child("constraints");
        let constraints = self.array(devices.get("constraints"), &cp);
        if constraints.len() > MAX_CONSTRAINTS {
            self.push(FieldError::too_many(
                &cp,
                constraints.len(),
                MAX_CONSTRAINTS,
            ));
        } else {
            for (i, c) in constraints.iter().enumerate() {
                self.constraint(c, &cp.index(i), &names);
            }
        }
        let fp = dp.child("config");
        let configs = self.array(devices.get("config"), &fp);
        if configs.len() > MAX_CONFIGS {
            self.push(FieldError::too_many(&fp, configs.len(), MAX_CONFIGS));
        } else {
            for (i, c) in configs.iter().enumerate() {
                let p = fp.index(i);
                self.request_refs(c.get("requests"), &p.child("requests"), &names);
                self.device_configuration(c, &p, stored);
            }
        }
    }

    fn request(&mut self, r: &Value, path: &Path, stored: bool) {
        let name = self.string(r, "name", path).unwrap_or("");
        self.dns_label(name, &path.child("name"));
        let exactly = r.get("exactly").filter(|e| !e.is_null());
        let first = r
            .get("firstAvailable")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty());
        match (exactly, first) {
            (None, None) => self.push(FieldError::required(
                path,
                "exactly one of `exactly` or `firstAvailable` is required",
            )),
            (Some(_), Some(_)) => self.push(FieldError::invalid(
                path,
                BadValue::Null,
                "exactly one of `exactly` or `firstAvailable` is required, but multiple fields are set",
            )),
            (Some(e), None) => self.exact_request(e, &path.child("exactly"), stored),
            (None, Some(subs)) => {
                let fp = path.child("firstAvailable");
                if subs.len() > MAX_FIRST_AVAILABLE {
                    self.push(FieldError::too_many(&fp, subs.len(), MAX_FIRST_AVAILABLE));
                    return;
                }
                let mut seen = HashSet::new();
                for (i, s) in subs.iter().enumerate() {
                    let sp = fp.index(i);
                    let sub_name = self.string(s, "name", &sp).unwrap_or("");
                    self.dns_label(sub_name, &sp.child("name"));
                    self.exact_request(s, &sp, stored);
                    if !seen.insert(sub_name) {
                        self.push(FieldError::duplicate(&sp, sub_name));
                    }
                }
            }
        }
    }

    /// An exact request or a subrequest (they share these fields).
    fn exact_request(&mut self, e: &Value, path: &Path, stored: bool) {
        match self.string(e, "deviceClassName", path) {
            None | Some("") => self.push(FieldError::required(&path.child("deviceClassName"), "")),
            Some(class) => self.dns_subdomain(class, &path.child("deviceClassName")),
        }
        self.selectors(e.get("selectors"), &path.child("selectors"), stored);
        let count = self.integer(e, "count", path);
        match self
            .string(e, "allocationMode", path)
            .unwrap_or("ExactCount")
        {
            "All" => {
                if let Some(c) = count.filter(|c| *c != 0) {
                    self.push(FieldError::invalid(
                        &path.child("count"),
                        c,
                        "must not be specified when allocationMode is 'All'",
                    ));
                }
            }
            "ExactCount" => {
                // Upstream defaults an unset count to 1.
                let c = count.unwrap_or(1);
                if c <= 0 {
                    self.push(FieldError::invalid(
                        &path.child("count"),
                        c,
                        "must be greater than zero",
                    ));
                }
            }
            other => self.push(FieldError::not_supported(
                &path.child("allocationMode"),
                other,
                &["All", "ExactCount"],
            )),
        }
        let tp = path.child("tolerations");
        let tolerations = self.array(e.get("tolerations"), &tp);
        if tolerations.len() > MAX_TOLERATIONS {
            self.push(FieldError::too_many(
                &tp,
                tolerations.len(),
                MAX_TOLERATIONS,
            ));
        } else {
            for (i, t) in tolerations.iter().enumerate() {
                self.toleration(t, &tp.index(i));
            }
        }
        let cap = e.get("capacity").and_then(|c| c.get("requests"));
        let cp = path.child("capacity").child("requests");
        for (key, _) in self.object(cap, &cp) {
            self.qualified(key, &cp);
            if let Some(c) = e.get("capacity").and_then(|c| c.get("requests")) {
                self.quantity(c, key, &cp);
            }
        }
    }

    fn constraint(&mut self, c: &Value, path: &Path, names: &RequestNames) {
        self.request_refs(c.get("requests"), &path.child("requests"), names);
        if let Some(m) = self.string(c, "matchAttribute", path) {
            self.fully_qualified(m, &path.child("matchAttribute"));
        } else if let Some(d) = self.string(c, "distinctAttribute", path) {
            self.fully_qualified(d, &path.child("distinctAttribute"));
        } else if self.on(FeatureGate::DRAConsumableCapacity) {
            self.push(FieldError::required(
                path,
                "exactly one of \"matchAttribute\" or \"distinctAttribute\" is required, but multiple fields are set",
            ));
        } else {
            self.push(FieldError::required(&path.child("matchAttribute"), ""));
        }
    }

    fn request_refs(&mut self, refs: Option<&Value>, path: &Path, names: &RequestNames) {
        let refs = self.array(refs, path);
        if refs.len() > MAX_REQUESTS {
            self.push(FieldError::too_many(path, refs.len(), MAX_REQUESTS));
            return;
        }
        let mut seen = HashSet::new();
        for (i, r) in refs.iter().enumerate() {
            let p = path.index(i);
            let name = r.as_str().unwrap_or("");
            self.request_ref(name, &p, names);
            if !seen.insert(name) {
                self.push(FieldError::duplicate(&p, name));
            }
        }
    }

    /// `validateRequestNameRef`: `<request>` or `<request>/<subrequest>` of this claim.
    fn request_ref(&mut self, name: &str, path: &Path, names: &RequestNames) {
        const MSG: &str = "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'";
        let segments: Vec<&str> = name.split('/').collect();
        if segments.len() > 2 {
            self.push(FieldError::invalid(path, name, MSG));
            return;
        }
        for s in &segments {
            self.dns_label(s, path);
        }
        if !names.has(name) {
            self.push(FieldError::invalid(path, name, MSG));
        }
    }

    /// A status update of a claim: reservations, the allocation (immutable once set).
    fn claim_status(&mut self, obj: &Value, old: &Value) {
        let sp = Path::new("status");
        let empty = Value::Null;
        let status = obj.get("status").unwrap_or(&empty);
        let names = request_names(
            obj.pointer("/spec/devices/requests")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or(&[]),
        );
        let rp = sp.child("reservedFor");
        let reserved = self.array(status.get("reservedFor"), &rp);
        if reserved.len() > MAX_RESERVED_FOR {
            self.push(FieldError::too_many(&rp, reserved.len(), MAX_RESERVED_FOR));
        } else {
            let mut uids = HashSet::new();
            for (i, r) in reserved.iter().enumerate() {
                let p = rp.index(i);
                for field in ["resource", "name", "uid"] {
                    if self.string(r, field, &p).unwrap_or("").is_empty() {
                        self.push(FieldError::required(&p.child(field), ""));
                    }
                }
                let uid = r.get("uid").and_then(Value::as_str).unwrap_or("");
                if !uids.insert(uid) {
                    self.push(FieldError::duplicate(&p, BadValue::Raw(r.to_string())));
                }
            }
        }
        let allocation = status.get("allocation").filter(|a| !a.is_null());
        if !reserved.is_empty() && allocation.is_none() {
            self.push(FieldError::forbidden(
                &rp,
                "may not be specified when `allocated` is not set",
            ));
        }
        let old_allocation = old.pointer("/status/allocation").filter(|a| !a.is_null());
        match (old_allocation, allocation) {
            (Some(was), Some(now)) => self.immutable(Some(now), Some(was), &sp.child("allocation")),
            (None, Some(now)) => self.allocation(now, &sp.child("allocation"), &names),
            _ => {}
        }
    }

    fn allocation(&mut self, a: &Value, path: &Path, names: &RequestNames) {
        let rp = path.child("devices").child("results");
        let results = self.array(a.pointer("/devices/results"), &rp);
        if results.len() > MAX_RESULTS {
            self.push(FieldError::too_many(&rp, results.len(), MAX_RESULTS));
        } else {
            for (i, r) in results.iter().enumerate() {
                let p = rp.index(i);
                let request = self.string(r, "request", &p).unwrap_or("");
                self.request_ref(request, &p.child("request"), names);
                let driver = self.string(r, "driver", &p);
                self.driver_name(driver, &p.child("driver"));
                let pool = self.string(r, "pool", &p);
                self.pool_name(pool, &p.child("pool"));
                let device = self.string(r, "device", &p).unwrap_or("");
                self.dns_label(device, &p.child("device"));
                self.binding_conditions(r, &p);
                let tp = p.child("tolerations");
                for (j, t) in self.array(r.get("tolerations"), &tp).iter().enumerate() {
                    self.toleration(t, &tp.index(j));
                }
                if let Some(id) = self.string(r, "shareID", &p)
                    && !is_uid(id)
                {
                    self.push(FieldError::invalid(
                        &p.child("shareID"),
                        id,
                        "uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters",
                    ));
                }
                let cp = p.child("consumedCapacity");
                for (key, _) in self.object(r.get("consumedCapacity"), &cp) {
                    if let Some(c) = r.get("consumedCapacity") {
                        self.quantity(c, key, &cp);
                    }
                }
            }
        }
        let cp = path.child("devices").child("config");
        let configs = self.array(a.pointer("/devices/config"), &cp);
        if configs.len() > 2 * MAX_CONFIGS {
            self.push(FieldError::too_many(&cp, configs.len(), 2 * MAX_CONFIGS));
        } else {
            for (i, c) in configs.iter().enumerate() {
                let p = cp.index(i);
                match self.string(c, "source", &p) {
                    Some("FromClass" | "FromClaim") => {}
                    None | Some("") => self.push(FieldError::required(&p.child("source"), "")),
                    Some(other) => self.push(FieldError::not_supported(
                        &p.child("source"),
                        other,
                        &["FromClaim", "FromClass"],
                    )),
                }
                self.request_refs(c.get("requests"), &p.child("requests"), names);
                self.device_configuration(c, &p, false);
            }
        }
    }

    /// `ValidateImmutableField`.
    fn immutable(&mut self, new: Option<&Value>, old: Option<&Value>, path: &Path) {
        let null = Value::Null;
        let (n, o) = (new.unwrap_or(&null), old.unwrap_or(&null));
        if n != o {
            self.push(FieldError::invalid(
                path,
                BadValue::from(n),
                "field is immutable",
            ));
        }
    }
}

fn non_empty(v: Option<&Value>) -> bool {
    v.and_then(Value::as_array).is_some_and(|a| !a.is_empty())
}

fn items(v: Option<&Value>) -> impl Iterator<Item = &Value> {
    v.and_then(Value::as_array).into_iter().flatten()
}

/// The request names of a claim, each with its subrequest names.
struct RequestNames(Vec<(String, Vec<String>)>);

impl RequestNames {
    fn has(&self, reference: &str) -> bool {
        let segments: Vec<&str> = reference.split('/').collect();
        match segments.as_slice() {
            [request] => self.0.iter().any(|(r, _)| r == request),
            [request, sub] => self
                .0
                .iter()
                .any(|(r, subs)| r == request && subs.iter().any(|s| s == sub)),
            _ => false,
        }
    }
}

fn request_names(requests: &[Value]) -> RequestNames {
    RequestNames(
        requests
            .iter()
            .map(|r| {
                let name = r
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let subs = items(r.get("firstAvailable"))
                    .filter_map(|s| s.get("name").and_then(Value::as_str))
                    .map(str::to_string)
                    .collect();
                (name, subs)
            })
            .collect(),
    )
}

/// A lower-case RFC 4122 UUID.
fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
}

/// `IsExtendedResourceName`: a qualified name with a domain outside `kubernetes.io`, not
/// `requests.`-prefixed.
fn is_extended_resource_name(name: &str) -> bool {
    let Some((domain, _)) = name.split_once('/') else {
        return false;
    };
    let native = domain == "kubernetes.io" || domain.ends_with(".kubernetes.io");
    !native && !name.starts_with("requests.") && qualified_name(name).is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apiserver::discovery;
    use serde_json::json;

    fn def(kind: &str) -> &'static ResourceDef {
        discovery::by_kind("resource.k8s.io/v1", kind).expect("served")
    }

    fn check(kind: &str, obj: &Value, minor: u32) -> Result<(), ApiError> {
        validate(def(kind), obj, None, Part::Main, &Cluster::at(minor))
    }

    #[test]
    fn truncated_keys_keep_both_ends() {
        let long = format!("{}/{}", "d".repeat(80), "n".repeat(40));
        let t = truncated(&long);
        assert_eq!(t.len(), 96);
        assert!(t.contains("..."));
        assert_eq!(truncated("gpushare.io/uuid"), "gpushare.io/uuid");
    }

    #[test]
    fn one_error_is_a_plain_message_several_a_list() {
        let slice = json!({ "metadata": { "name": "s" }, "spec": {
            "driver": "gpushare.io", "nodeName": "n",
            "pool": { "name": "n", "generation": 1, "resourceSliceCount": 0 } } });
        let err = check("ResourceSlice", &slice, 37).expect_err("refused");
        assert_eq!(err.code, 422);
        assert_eq!(
            err.message,
            "ResourceSlice.resource.k8s.io \"s\" is invalid: spec.pool.resourceSliceCount: Invalid value: 0: must be greater than zero"
        );
        let causes = &err.details.as_ref().expect("details")["causes"];
        assert_eq!(causes[0]["field"], "spec.pool.resourceSliceCount");
        assert_eq!(causes[0]["reason"], "FieldValueInvalid");
        let mut two = slice.clone();
        two["spec"]["driver"] = json!("");
        let err = check("ResourceSlice", &two, 37).expect_err("refused");
        assert!(
            err.message
                .contains(": [spec.driver: Required value, spec.pool"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_bad_quantity_is_a_decode_error() {
        let slice = json!({ "metadata": { "name": "s" }, "spec": {
            "driver": "gpushare.io", "nodeName": "n",
            "pool": { "name": "n", "generation": 1, "resourceSliceCount": 1 },
            "devices": [{ "name": "gpu-0", "capacity": { "memory": { "value": "lots" } } }] } });
        let err = check("ResourceSlice", &slice, 37).expect_err("refused");
        assert_eq!(err.code, 400, "{err}");
        assert!(
            err.message
                .contains("quantities must match the regular expression")
        );
    }
}
