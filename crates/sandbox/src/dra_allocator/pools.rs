//! The resource pools a node sees, as upstream's `GatherPools` gathers them: the slices that
//! reach the node (`nodeName`, `allNodes`, a `nodeSelector` matching the node's labels, or a
//! device of a per-device-selection slice that does), grouped by `(driver, pool)` with only the
//! newest generation kept; a pool whose slices are not all there is incomplete (or obsolete,
//! when a newer generation exists elsewhere, and then left out), a pool with a device name twice
//! or a counter set twice or a consumption of an unknown counter is invalid. Pools come sorted
//! by driver then pool name (those with binding conditions last), each pool's slices by name:
//! the order first fit walks.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement};
use k8s_openapi::api::resource::v1::ResourceSlice;

use super::Features;
use super::capacity::read;
use crate::quantity::Quantity;

/// The node an allocation is tried on.
#[derive(Clone, Debug, Default)]
pub struct NodeView {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
}

/// One pool as the node sees it.
pub(crate) struct Pool<'a> {
    pub driver: &'a str,
    pub name: &'a str,
    pub incomplete: bool,
    pub invalid: bool,
    /// Slices with devices reaching the node, by name.
    pub slices: Vec<&'a ResourceSlice>,
    /// The pool's other device slices (their allocated devices use counters too).
    pub other_slices: Vec<&'a ResourceSlice>,
    /// Counter sets by name: counter name → value.
    pub counter_sets: BTreeMap<String, BTreeMap<String, Quantity>>,
}

impl Pool<'_> {
    pub fn id(&self) -> String {
        format!("{}/{}", self.driver, self.name)
    }
}

/// Whether a node selector matches the node (upstream's `nodeaffinity`: any term, every
/// requirement of it; `matchFields` knows `metadata.name`).
pub(crate) fn selector_matches(selector: &NodeSelector, node: &NodeView) -> bool {
    selector.node_selector_terms.iter().any(|term| {
        let exprs = term.match_expressions.iter().flatten();
        let fields = term.match_fields.iter().flatten();
        let has_any = term
            .match_expressions
            .as_ref()
            .is_some_and(|e| !e.is_empty())
            || term.match_fields.as_ref().is_some_and(|f| !f.is_empty());
        has_any
            && exprs
                .clone()
                .all(|r| requirement(r, node.labels.get(&r.key).map(String::as_str)))
            && fields
                .clone()
                .all(|r| r.key == "metadata.name" && requirement(r, Some(node.name.as_str())))
    })
}

fn requirement(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|b| b.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

/// Whether a slice (or a device of a per-device-selection slice) reaches the node.
pub(crate) fn node_matches(
    node: &NodeView,
    node_name: Option<&str>,
    all_nodes: Option<bool>,
    selector: Option<&NodeSelector>,
) -> bool {
    match (node_name.filter(|n| !n.is_empty()), all_nodes, selector) {
        (Some(n), _, _) => n == node.name,
        (None, Some(true), _) => true,
        (None, _, Some(s)) => selector_matches(s, node),
        _ => false,
    }
}

fn pool_key(s: &ResourceSlice) -> (&str, &str) {
    (s.spec.driver.as_str(), s.spec.pool.name.as_str())
}

/// Upstream's `GatherPools` for `node` over every slice of the cluster.
pub(crate) fn gather<'a>(
    slices: &'a [ResourceSlice],
    node: &NodeView,
    features: &Features,
) -> Vec<Pool<'a>> {
    let mut pools: BTreeMap<(&str, &str), Vec<&ResourceSlice>> = BTreeMap::new();
    for slice in slices {
        let spec = &slice.spec;
        let partitionable = spec.per_device_node_selection.is_some()
            || spec.shared_counters.as_ref().is_some_and(|c| !c.is_empty());
        if !features.partitionable_devices && partitionable {
            continue;
        }
        let relevant = if spec.node_name.as_deref().is_some_and(|n| !n.is_empty())
            || spec.all_nodes == Some(true)
            || spec.node_selector.is_some()
        {
            node_matches(
                node,
                spec.node_name.as_deref(),
                spec.all_nodes,
                spec.node_selector.as_ref(),
            )
        } else if spec.per_device_node_selection == Some(true) {
            spec.devices.iter().flatten().any(|d| {
                node_matches(
                    node,
                    d.node_name.as_deref(),
                    d.all_nodes,
                    d.node_selector.as_ref(),
                )
            })
        } else {
            false
        };
        if !relevant {
            continue;
        }
        let entry = pools.entry(pool_key(slice)).or_default();
        match entry.first().map(|s| s.spec.pool.generation) {
            Some(g) if spec.pool.generation < g => {}
            Some(g) if spec.pool.generation > g => *entry = vec![slice],
            _ => entry.push(slice),
        }
    }
    let mut out = Vec::new();
    let mut with_binding = Vec::new();
    for ((driver, name), mut targeting) in pools {
        let generation = targeting[0].spec.pool.generation;
        let wanted = targeting[0].spec.pool.resource_slice_count;
        let mut all: Vec<&ResourceSlice> = Vec::new();
        if targeting.len() as i64 != wanted {
            // `checkSlicesInPool`: a newer generation elsewhere makes this one obsolete.
            let same_pool = || slices.iter().filter(|s| pool_key(s) == (driver, name));
            if same_pool().any(|s| s.spec.pool.generation > generation) {
                continue;
            }
            all = same_pool()
                .filter(|s| s.spec.pool.generation == generation)
                .collect();
            if all.len() as i64 != wanted {
                out.push(Pool {
                    driver,
                    name,
                    incomplete: true,
                    invalid: false,
                    slices: Vec::new(),
                    other_slices: Vec::new(),
                    counter_sets: BTreeMap::new(),
                });
                continue;
            }
        }
        targeting.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let pool = build(driver, name, targeting, &all, features);
        let binding = pool.slices.iter().any(|s| {
            s.spec
                .devices
                .iter()
                .flatten()
                .any(|d| d.binding_conditions.is_some())
        });
        if binding {
            with_binding.push(pool);
        } else {
            out.push(pool);
        }
    }
    // The BTreeMap already walks pools by (driver, pool).
    out.extend(with_binding);
    out
}

fn build<'a>(
    driver: &'a str,
    name: &'a str,
    targeting: Vec<&'a ResourceSlice>,
    all: &[&'a ResourceSlice],
    features: &Features,
) -> Pool<'a> {
    let mut device_slices = Vec::new();
    let mut counter_slices = Vec::new();
    let mut other_slices = Vec::new();
    let has_counters = |s: &ResourceSlice| {
        features.partitionable_devices
            && s.spec
                .shared_counters
                .as_ref()
                .is_some_and(|c| !c.is_empty())
    };
    let targeting_names: HashSet<Option<&str>> = targeting
        .iter()
        .map(|s| s.metadata.name.as_deref())
        .collect();
    for s in &targeting {
        if has_counters(s) {
            counter_slices.push(*s);
        } else {
            device_slices.push(*s);
        }
    }
    for s in all {
        if targeting_names.contains(&s.metadata.name.as_deref()) {
            continue;
        }
        if has_counters(s) {
            counter_slices.push(*s);
        } else {
            other_slices.push(*s);
        }
    }
    let invalid = |pool: Pool<'a>| Pool {
        invalid: true,
        slices: Vec::new(),
        other_slices: Vec::new(),
        ..pool
    };
    let mut pool = Pool {
        driver,
        name,
        incomplete: false,
        invalid: false,
        slices: device_slices,
        other_slices,
        counter_sets: BTreeMap::new(),
    };
    let mut names = HashSet::new();
    let duplicate = pool
        .slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .any(|d| !names.insert(d.name.clone()));
    if duplicate {
        return invalid(pool);
    }
    if !features.partitionable_devices {
        return pool;
    }
    for s in &counter_slices {
        for set in s.spec.shared_counters.iter().flatten() {
            let counters = set
                .counters
                .iter()
                .map(|(k, c)| (k.clone(), read(&c.value)))
                .collect();
            if pool
                .counter_sets
                .insert(set.name.clone(), counters)
                .is_some()
            {
                return invalid(pool);
            }
        }
    }
    let unknown = pool
        .slices
        .iter()
        .chain(pool.other_slices.iter())
        .flat_map(|s| s.spec.devices.iter().flatten())
        .flat_map(|d| d.consumes_counters.iter().flatten())
        .any(|c| match pool.counter_sets.get(&c.counter_set) {
            None => true,
            Some(set) => c.counters.keys().any(|k| !set.contains_key(k)),
        });
    if unknown {
        return invalid(pool);
    }
    pool
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn selector(v: serde_json::Value) -> NodeSelector {
        serde_json::from_value(v).expect("a node selector")
    }

    #[test]
    fn node_selectors_match_as_node_affinity_does() {
        let node = NodeView {
            name: "node-1".into(),
            labels: BTreeMap::from([("zone".into(), "a".into()), ("gpus".into(), "8".into())]),
        };
        let term = |r: serde_json::Value| selector(json!({ "nodeSelectorTerms": [r] }));
        for (requirement, want) in [
            (
                json!({ "matchExpressions": [{ "key": "zone", "operator": "In", "values": ["a", "b"] }] }),
                true,
            ),
            (
                json!({ "matchExpressions": [{ "key": "zone", "operator": "NotIn", "values": ["a"] }] }),
                false,
            ),
            (
                json!({ "matchExpressions": [{ "key": "rack", "operator": "NotIn", "values": ["a"] }] }),
                true,
            ),
            (
                json!({ "matchExpressions": [{ "key": "zone", "operator": "Exists" }] }),
                true,
            ),
            (
                json!({ "matchExpressions": [{ "key": "zone", "operator": "DoesNotExist" }] }),
                false,
            ),
            (
                json!({ "matchExpressions": [{ "key": "gpus", "operator": "Gt", "values": ["4"] }] }),
                true,
            ),
            (
                json!({ "matchExpressions": [{ "key": "gpus", "operator": "Lt", "values": ["4"] }] }),
                false,
            ),
            (
                json!({ "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["node-1"] }] }),
                true,
            ),
            (
                json!({ "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["node-2"] }] }),
                false,
            ),
            (json!({}), false),
        ] {
            assert_eq!(
                selector_matches(&term(requirement.clone()), &node),
                want,
                "{requirement}"
            );
        }
        // Terms are ORed.
        let either = selector(json!({ "nodeSelectorTerms": [
            { "matchExpressions": [{ "key": "zone", "operator": "In", "values": ["b"] }] },
            { "matchExpressions": [{ "key": "zone", "operator": "In", "values": ["a"] }] }] }));
        assert!(selector_matches(&either, &node));
    }
}
