//! The sandbox DRA allocator (`gpushare_sandbox::dra_allocator::structured`) against a table of
//! cases re-expressed from upstream's allocator tests
//! (`k8s.io/dynamic-resource-allocation/structured/internal/allocatortesting`): the same
//! inputs (slices, classes, claims, what is allocated already, the allocator's features) and the
//! outcome upstream expects — the devices of each claim, no allocation on this node, or an
//! error (a CEL runtime error is an error, not a device that is not selected). Names follow
//! upstream's (`driver-a`, `pool-1`, `device-1`, `req-0`, `claim-0`).

use std::collections::BTreeMap;

use gpushare_sandbox::dra_allocator::structured::{self, Stats};
use gpushare_sandbox::dra_allocator::{Features, NodeView, Unallocatable, Usage};
use gpushare_sandbox::quantity::Quantity;
use k8s_openapi::api::resource::v1::{AllocationResult, DeviceClass, ResourceClaim, ResourceSlice};
use serde_json::{Value, json};

const DRIVER_A: &str = "driver-a";
const DRIVER_B: &str = "driver-b";
const CLASS_A: &str = "class-a";
const CLASS_B: &str = "class-b";
const NODE_1: &str = "node-1";
const NODE_2: &str = "node-2";
const SHARE: &str = "aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa";

// --- objects --------------------------------------------------------------------------------

fn class(name: &str, driver: &str) -> Value {
    class_selecting(name, &format!("device.driver == \"{driver}\""))
}

fn class_selecting(name: &str, expression: &str) -> Value {
    json!({ "metadata": { "name": name },
            "spec": { "selectors": [{ "cel": { "expression": expression } }] } })
}

/// A class that also selects on `allowMultipleAllocations`.
fn class_multi(name: &str, driver: &str, multi: bool) -> Value {
    class_selecting(
        name,
        &format!("device.driver == \"{driver}\" && device.allowMultipleAllocations == {multi}"),
    )
}

/// Where a slice's devices are.
enum On<'a> {
    Node(&'a str),
    All,
    Label(&'a str, &'a str),
}

fn slice(
    name: &str,
    on: On<'_>,
    pool: (&str, i64, i64),
    driver: &str,
    devices: Vec<Value>,
) -> Value {
    let mut spec = json!({ "driver": driver,
        "pool": { "name": pool.0, "resourceSliceCount": pool.1, "generation": pool.2 },
        "devices": devices });
    match on {
        On::Node(n) => spec["nodeName"] = json!(n),
        On::All => spec["allNodes"] = json!(true),
        On::Label(k, v) => {
            spec["nodeSelector"] = json!({ "nodeSelectorTerms": [{ "matchExpressions": [
                { "key": k, "operator": "In", "values": [v] }] }] })
        }
    }
    json!({ "metadata": { "name": name }, "spec": spec })
}

/// A slice of one pool of one slice, generation 1.
fn slice1(name: &str, on: On<'_>, pool: &str, driver: &str, devices: Vec<Value>) -> Value {
    slice(name, on, (pool, 1, 1), driver, devices)
}

fn dev(name: &str) -> Value {
    json!({ "name": name })
}

fn with(mut d: Value, field: &str, value: Value) -> Value {
    d[field] = value;
    d
}

fn attrs(d: Value, attrs: Value) -> Value {
    with(d, "attributes", attrs)
}

fn memory(d: Value, q: &str) -> Value {
    with(d, "capacity", json!({ "memory": { "value": q } }))
}

fn shared(d: Value) -> Value {
    with(d, "allowMultipleAllocations", json!(true))
}

/// Capacity `capacity-0` of `value` with upstream's range policy: default 2, min 2, step 2,
/// max 4.
fn range_policy(d: Value, value: &str) -> Value {
    with(
        d,
        "capacity",
        json!({ "capacity-0": { "value": value, "requestPolicy": { "default": "2",
            "validRange": { "min": "2", "step": "2", "max": "4" } } } }),
    )
}

/// Capacity `capacity-0` of `value` with valid values `default` and `more`.
fn values_policy(d: Value, default: &str, value: &str, more: &[&str]) -> Value {
    let mut values = vec![default];
    values.extend_from_slice(more);
    with(
        d,
        "capacity",
        json!({ "capacity-0": { "value": value,
            "requestPolicy": { "default": default, "validValues": values } } }),
    )
}

fn taint(key: &str, value: &str, effect: &str) -> Value {
    json!({ "key": key, "value": value, "effect": effect })
}

fn req(name: &str, class: &str, count: i64) -> Value {
    json!({ "name": name, "exactly": { "deviceClassName": class,
        "allocationMode": "ExactCount", "count": count } })
}

fn req_all(name: &str, class: &str) -> Value {
    json!({ "name": name, "exactly": { "deviceClassName": class, "allocationMode": "All" } })
}

fn selecting(mut r: Value, expression: &str) -> Value {
    let target = if r.get("exactly").is_some() {
        &mut r["exactly"]
    } else {
        &mut r
    };
    target["selectors"] = json!([{ "cel": { "expression": expression } }]);
    r
}

fn capacity_request(mut r: Value, q: &str) -> Value {
    let target = if r.get("exactly").is_some() {
        &mut r["exactly"]
    } else {
        &mut r
    };
    target["capacity"] = json!({ "requests": { "capacity-0": q } });
    r
}

fn tolerating(mut r: Value, tolerations: Value) -> Value {
    let target = if r.get("exactly").is_some() {
        &mut r["exactly"]
    } else {
        &mut r
    };
    target["tolerations"] = tolerations;
    r
}

fn sub(name: &str, class: &str, count: i64) -> Value {
    json!({ "name": name, "deviceClassName": class, "allocationMode": "ExactCount", "count": count })
}

fn first_available(name: &str, subs: Vec<Value>) -> Value {
    json!({ "name": name, "firstAvailable": subs })
}

fn claim(name: &str, requests: Vec<Value>, constraints: Vec<Value>) -> Value {
    json!({ "metadata": { "name": name },
            "spec": { "devices": { "requests": requests, "constraints": constraints } } })
}

fn memory_at_least(q: &str) -> String {
    format!("device.capacity[\"{DRIVER_A}\"].memory.compareTo(quantity(\"{q}\")) >= 0")
}

// --- the table ------------------------------------------------------------------------------

/// One claim's device as upstream's results list it: request, driver, pool, device.
type Got = (String, String, String, String);

enum Expect {
    /// Every claim allocated, with these devices (in any order within a claim).
    Devices(Vec<Vec<(&'static str, &'static str, &'static str, &'static str)>>),
    /// Nothing fits on this node.
    Nothing,
    /// An allocation error whose message holds this.
    Error(&'static str),
}

struct Case {
    name: &'static str,
    features: Features,
    claims: Vec<Value>,
    classes: Vec<Value>,
    slices: Vec<Value>,
    node: NodeView,
    /// Devices allocated whole by earlier claims.
    allocated: Vec<(&'static str, &'static str, &'static str)>,
    /// Capacity `capacity-0` consumed on shared devices by earlier claims.
    consumed: Vec<((&'static str, &'static str, &'static str), &'static str)>,
    expect: Expect,
    /// A further check of the results.
    check: Option<fn(&[AllocationResult])>,
    /// upstream's `expectNumAllocateOneInvocations` for the incubating allocator.
    steps: Option<u64>,
}

fn node(name: &str, region: &str) -> NodeView {
    NodeView {
        name: name.to_string(),
        labels: BTreeMap::from([
            ("region".to_string(), region.to_string()),
            ("planet".to_string(), "earth".to_string()),
        ]),
    }
}

fn base(name: &'static str) -> Case {
    Case {
        name,
        features: Features::NONE,
        claims: Vec::new(),
        classes: vec![class(CLASS_A, DRIVER_A)],
        slices: Vec::new(),
        node: node(NODE_1, "region-1"),
        allocated: Vec::new(),
        consumed: Vec::new(),
        expect: Expect::Nothing,
        check: None,
        steps: None,
    }
}

fn typed<T: serde::de::DeserializeOwned>(values: &[Value]) -> Vec<T> {
    values
        .iter()
        .map(|v| serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{v}: {e}")))
        .collect()
}

fn run(case: &Case) -> (Result<Option<Vec<AllocationResult>>, Unallocatable>, Stats) {
    let claims: Vec<ResourceClaim> = typed(&case.claims);
    let classes: Vec<DeviceClass> = typed(&case.classes);
    let slices: Vec<ResourceSlice> = typed(&case.slices);
    let mut usage = Usage::default();
    for (d, p, n) in &case.allocated {
        usage
            .allocated
            .insert((d.to_string(), p.to_string(), n.to_string()));
    }
    for ((d, p, n), q) in &case.consumed {
        usage
            .consumed
            .entry((d.to_string(), p.to_string(), n.to_string()))
            .or_default()
            .insert(
                "capacity-0".to_string(),
                Quantity::parse(q).expect("a quantity"),
            );
    }
    let mut stats = Stats::default();
    let result = structured::allocate_counted(
        &claims,
        &classes,
        &slices,
        &usage,
        &case.node,
        &case.features,
        &mut || SHARE.to_string(),
        &mut stats,
    );
    (result, stats)
}

fn devices(results: &[AllocationResult]) -> Vec<Vec<Got>> {
    results
        .iter()
        .map(|a| {
            let mut got: Vec<Got> = a
                .devices
                .as_ref()
                .and_then(|d| d.results.as_ref())
                .into_iter()
                .flatten()
                .map(|r| {
                    (
                        r.request.clone(),
                        r.driver.clone(),
                        r.pool.clone(),
                        r.device.clone(),
                    )
                })
                .collect();
            got.sort();
            got
        })
        .collect()
}

fn node_selector(a: &AllocationResult) -> Value {
    serde_json::to_value(&a.node_selector).expect("JSON")
}

fn local(node: &str) -> Value {
    json!({ "nodeSelectorTerms": [{ "matchFields": [
        { "key": "metadata.name", "operator": "In", "values": [node] }] }] })
}

fn consumed(a: &AllocationResult) -> Vec<(Option<String>, Option<String>)> {
    a.devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r.share_id.clone(),
                r.consumed_capacity
                    .as_ref()
                    .and_then(|c| c.get("capacity-0"))
                    .map(|q| q.0.clone()),
            )
        })
        .collect()
}

fn cases() -> Vec<Case> {
    let only = |f: fn(&mut Features)| {
        let mut x = Features::NONE;
        f(&mut x);
        x
    };
    let one_device = |name: &str, node: &str, pool: &str, driver: &str| {
        slice1(name, On::Node(node), pool, driver, vec![dev("device-1")])
    };
    let versioned = |v: &str, numa: i64, s: &str, b: bool| {
        json!({ "driverVersion": { "version": v }, "numa": { "int": numa },
                "stringAttribute": { "string": s }, "boolAttribute": { "bool": b } })
    };
    let taint_no_schedule = taint("taint-key", "taint-value", "NoSchedule");
    let taint_no_execute = taint("taint-key", "taint-value-2", "NoExecute");
    let toleration_no_execute = json!({ "operator": "Equal", "key": "taint-key",
        "value": "taint-value-2", "effect": "NoExecute" });
    let toleration_no_schedule =
        json!({ "operator": "Exists", "key": "taint-key", "effect": "NoSchedule" });
    vec![
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            check: Some(|r| assert_eq!(node_selector(&r[0]), local(NODE_1))),
            ..base("simple")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![
                one_device("slice-1", NODE_1, "pool-1", DRIVER_B),
                one_device("slice-2", NODE_2, "pool-2", DRIVER_A),
            ],
            node: node(NODE_2, "region-2"),
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-2", "device-1")]]),
            check: Some(|r| assert_eq!(node_selector(&r[0]), local(NODE_2))),
            ..base("other-node")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![
                    selecting(req("req-0", CLASS_A, 1), &memory_at_least("1Gi")),
                    selecting(req("req-1", CLASS_A, 1), &memory_at_least("2Gi")),
                ],
                vec![],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    memory(dev("device-1"), "1Gi"),
                    memory(dev("device-2"), "2Gi"),
                ],
            )],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-1", DRIVER_A, "pool-1", "device-2"),
            ]]),
            ..base("small-and-large")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![
                    selecting(req("req-0", CLASS_A, 1), &memory_at_least("1Gi")),
                    selecting(req("req-1", CLASS_A, 1), &memory_at_least("2Gi")),
                ],
                vec![],
            )],
            // The large device first: the small request takes it, then gives it back.
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    memory(dev("device-2"), "2Gi"),
                    memory(dev("device-1"), "1Gi"),
                ],
            )],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-1", DRIVER_A, "pool-1", "device-2"),
            ]]),
            ..base("small-and-large-backtrack-requests")
        },
        Case {
            claims: vec![
                claim(
                    "claim-0",
                    vec![selecting(req("req-0", CLASS_A, 1), &memory_at_least("1Gi"))],
                    vec![],
                ),
                claim(
                    "claim-1",
                    vec![selecting(req("req-1", CLASS_A, 1), &memory_at_least("2Gi"))],
                    vec![],
                ),
            ],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    memory(dev("device-2"), "2Gi"),
                    memory(dev("device-1"), "1Gi"),
                ],
            )],
            expect: Expect::Devices(vec![
                vec![("req-0", DRIVER_A, "pool-1", "device-1")],
                vec![("req-1", DRIVER_A, "pool-1", "device-2")],
            ]),
            ..base("small-and-large-backtrack-claims")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 2)], vec![])],
            slices: vec![
                one_device("slice-1", NODE_1, "pool-1", DRIVER_A),
                one_device("slice-2", NODE_1, "pool-2", DRIVER_A),
            ],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-0", DRIVER_A, "pool-2", "device-1"),
            ]]),
            ..base("devices-split-across-different-slices")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![
                slice(
                    "slice-1-obsolete",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-1-obsolete",
                    On::Node(NODE_1),
                    ("pool-1", 2, 2),
                    DRIVER_A,
                    vec![dev("device-2")],
                ),
            ],
            expect: Expect::Nothing,
            ..base("obsolete-slice")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-1-2",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
            ],
            expect: Expect::Error("invalid resource pools were encountered"),
            ..base("duplicate-slice")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            expect: Expect::Nothing,
            ..base("no-slices")
        },
        Case {
            claims: vec![
                claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![]),
                claim("claim-0", vec![req("req-1", CLASS_A, 1)], vec![]),
            ],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Nothing,
            ..base("not-enough-suitable-devices")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            classes: vec![],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("could not retrieve device class class-a"),
            ..base("no-classes")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", "", 1)], vec![])],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error(
                "claim claim-0, request req-0: missing device class name (unsupported request type?)",
            ),
            ..base("empty-class")
        },
        Case {
            claims: vec![claim("claim-0", vec![req_all("req-0", CLASS_A)], vec![])],
            slices: vec![
                one_device("slice-1", NODE_1, "pool-1", DRIVER_A),
                one_device("slice-1", NODE_1, "pool-2", DRIVER_A),
            ],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-0", DRIVER_A, "pool-2", "device-1"),
            ]]),
            ..base("all-devices-many")
        },
        Case {
            claims: vec![claim("claim-0", vec![req_all("req-0", CLASS_A)], vec![])],
            slices: vec![slice(
                "slice-1",
                On::Node(NODE_1),
                ("pool-1", 2, 1),
                DRIVER_A,
                vec![dev("device-1")],
            )],
            expect: Expect::Error(
                "claim claim-0, request req-0: asks for all devices, but resource pool driver-a/pool-1 is currently being updated",
            ),
            ..base("all-devices-of-the-incomplete-pool")
        },
        Case {
            claims: vec![
                claim("claim-1", vec![req("req-0", CLASS_A, 1)], vec![]),
                claim("claim-0", vec![req_all("req-0", CLASS_A)], vec![]),
            ],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Nothing,
            ..base("all-devices-no-solution")
        },
        Case {
            claims: vec![claim("claim-0", vec![req_all("req-0", CLASS_A)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![dev("device-1"), dev("device-2")],
            )],
            allocated: vec![(DRIVER_A, "pool-1", "device-1")],
            expect: Expect::Nothing,
            ..base("all-devices-some-allocated")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Label("region", "region-1"),
                "pool-1",
                DRIVER_A,
                vec![dev("device-1")],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            check: Some(|r| {
                assert_eq!(
                    node_selector(&r[0]),
                    json!({ "nodeSelectorTerms": [{ "matchExpressions": [
                        { "key": "region", "operator": "In", "values": ["region-1"] }] }] })
                )
            }),
            ..base("network-attached-device")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Label("region", "region-1"),
                "pool-1",
                DRIVER_A,
                vec![dev("device-1")],
            )],
            node: node(NODE_2, "region-2"),
            expect: Expect::Nothing,
            ..base("unsuccessful-allocation-network-attached-device")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 2)], vec![])],
            slices: vec![
                slice1(
                    "slice-1",
                    On::Label("region", "region-1"),
                    "pool-1",
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice1(
                    "slice-1",
                    On::Node(NODE_1),
                    "pool-2",
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
            ],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-0", DRIVER_A, "pool-2", "device-1"),
            ]]),
            // Once a device is node-local, the selector is that node.
            check: Some(|r| assert_eq!(node_selector(&r[0]), local(NODE_1))),
            ..base("local-and-network-attached-devices")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 3)], vec![])],
            slices: vec![
                slice1(
                    "slice-1",
                    On::Label("region", "region-1"),
                    "pool-1",
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice1(
                    "slice-1",
                    On::All,
                    "pool-2",
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice1(
                    "slice-1",
                    On::Label("planet", "earth"),
                    "pool-3",
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
            ],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-0", DRIVER_A, "pool-2", "device-1"),
                ("req-0", DRIVER_A, "pool-3", "device-1"),
            ]]),
            // A union of the slices' selectors.
            check: Some(|r| {
                assert_eq!(
                    node_selector(&r[0]),
                    json!({ "nodeSelectorTerms": [{ "matchExpressions": [
                        { "key": "region", "operator": "In", "values": ["region-1"] },
                        { "key": "planet", "operator": "In", "values": ["earth"] }] }] })
                )
            }),
            ..base("many-network-attached-devices")
        },
        Case {
            claims: vec![
                claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![]),
                claim("claim-0", vec![req("req-0", CLASS_B, 1)], vec![]),
            ],
            classes: vec![class(CLASS_A, DRIVER_A), class(CLASS_B, DRIVER_B)],
            slices: vec![
                slice1(
                    "slice-1",
                    On::Node(NODE_1),
                    "pool-1",
                    DRIVER_A,
                    vec![dev("device-1"), dev("device-2")],
                ),
                one_device("slice-1", NODE_1, "pool-1", DRIVER_B),
            ],
            expect: Expect::Devices(vec![
                vec![("req-0", DRIVER_A, "pool-1", "device-1")],
                vec![("req-0", DRIVER_B, "pool-1", "device-1")],
            ]),
            ..base("several-different-drivers")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            allocated: vec![
                (DRIVER_A, "pool-1", "device-1"),
                (DRIVER_A, "pool-1", "device-2"),
            ],
            expect: Expect::Nothing,
            ..base("already-allocated-devices")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![with(
                    req("req-0", CLASS_A, 1),
                    "exactly",
                    json!({
                "deviceClassName": CLASS_A, "allocationMode": "ExactCount", "count": 1, "adminAccess": true }),
                )],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error(
                "claim claim-0, request req-0: admin access is requested, but the feature is disabled",
            ),
            ..base("admin-access-disabled")
        },
        Case {
            features: only(|f| f.admin_access = true),
            claims: vec![claim(
                "claim-0",
                vec![with(
                    req("req-0", CLASS_A, 1),
                    "exactly",
                    json!({
                "deviceClassName": CLASS_A, "allocationMode": "ExactCount", "count": 1, "adminAccess": true }),
                )],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            allocated: vec![
                (DRIVER_A, "pool-1", "device-1"),
                (DRIVER_A, "pool-1", "device-2"),
            ],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            check: Some(|r| {
                let result = &r[0]
                    .devices
                    .as_ref()
                    .and_then(|d| d.results.clone())
                    .unwrap_or_default()[0];
                assert_eq!(result.admin_access, Some(true));
            }),
            ..base("admin-access-enabled")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 1), req("req-1", CLASS_A, 1)],
                vec![
                    json!({ "matchAttribute": "driver-a/numa" }),
                    json!({ "matchAttribute": "driver-a/driverVersion" }),
                    json!({ "matchAttribute": "driver-a/stringAttribute" }),
                    json!({ "matchAttribute": "driver-a/boolAttribute" }),
                ],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(
                        dev("device-1"),
                        versioned("1.0.0", 1, "stringAttributeValue", true),
                    ),
                    attrs(
                        dev("device-2"),
                        versioned("1.0.0", 1, "stringAttributeValue", true),
                    ),
                ],
            )],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-1", DRIVER_A, "pool-1", "device-2"),
            ]]),
            ..base("with-constraint")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 1)],
                vec![json!({ "matchAttribute": "driver-a/NonExistentAttribute" })],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Nothing,
            ..base("with-constraint-non-existent-attribute")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 2)],
                vec![json!({ "matchAttribute": "driver-a/numa" })],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(dev("device-1"), json!({ "numa": { "int": 1 } })),
                    attrs(dev("device-2"), json!({ "numa": { "int": 2 } })),
                ],
            )],
            expect: Expect::Nothing,
            ..base("with-constraint-not-matching-int-attribute")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req_all("req-0", CLASS_A)],
                vec![json!({ "matchAttribute": "driver-a/numa" })],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(dev("device-1"), json!({ "numa": { "int": 1 } })),
                    attrs(dev("device-2"), json!({ "numa": { "int": 2 } })),
                ],
            )],
            expect: Expect::Error(
                "claim claim-0, request req-0: cannot add device driver-a/pool-1/device-2 because a claim constraint would not be satisfied",
            ),
            ..base("with-constraint-not-matching-int-attribute-all-devices")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 2)],
                vec![json!({ "matchAttribute": "driver-a/driverVersion" })],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(
                        dev("device-1"),
                        json!({ "driverVersion": { "version": "1.0.0" } }),
                    ),
                    attrs(
                        dev("device-2"),
                        json!({ "driverVersion": { "version": "2.0.0" } }),
                    ),
                ],
            )],
            expect: Expect::Nothing,
            ..base("with-constraint-not-matching-version-attribute")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 1), req("req-1", CLASS_A, 1)],
                vec![
                    json!({ "requests": ["req-0"], "matchAttribute": "driver-a/driverVersion" }),
                    json!({ "matchAttribute": "driver-a/stringAttribute" }),
                ],
            )],
            // device-1 breaks the second constraint with either other device: backtrack.
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(
                        dev("device-1"),
                        json!({ "driverVersion": { "version": "1.0.0" }, "stringAttribute": { "string": "a" } }),
                    ),
                    attrs(
                        dev("device-2"),
                        json!({ "driverVersion": { "version": "2.0.0" }, "stringAttribute": { "string": "b" } }),
                    ),
                    attrs(
                        dev("device-3"),
                        json!({ "driverVersion": { "version": "3.0.0" }, "stringAttribute": { "string": "b" } }),
                    ),
                ],
            )],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-2"),
                ("req-1", DRIVER_A, "pool-1", "device-3"),
            ]]),
            ..base("with-constraint-for-request-retry")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![json!({ "name": "req-0", "exactly": {
                "deviceClassName": CLASS_A, "allocationMode": "ExactCount", "count": 1, "selectors": [{}] } })],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("CEL expression empty (unsupported selector type?)"),
            ..base("unknown-selector")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![json!({ "name": "req-0", "exactly": {
                "deviceClassName": CLASS_A, "allocationMode": "future-mode" } })],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("unsupported count mode future-mode"),
            ..base("unknown-allocation-mode")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 1)],
                vec![json!({})],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("empty constraint (unsupported constraint type?)"),
            ..base("unknown-constraint")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![selecting(req("req-0", CLASS_A, 1), "noSuchVar")],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("undeclared reference"),
            ..base("invalid-CEL-one-device")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            classes: vec![class_selecting(CLASS_A, "noSuchVar")],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("undeclared reference"),
            ..base("invalid-CEL-one-device-class")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![selecting(req_all("req-0", CLASS_A), "noSuchVar")],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error("undeclared reference"),
            ..base("invalid-CEL-all-devices")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 500)], vec![])],
            expect: Expect::Error("exceeds the claim limit"),
            ..base("too-many-devices-single-request")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 32), req("req-1", CLASS_A, 1)],
                vec![],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                (0..33).map(|i| dev(&format!("device-{i}"))).collect(),
            )],
            expect: Expect::Error("exceeds the claim limit"),
            ..base("too-many-devices-total")
        },
        Case {
            features: only(|f| f.prioritized_list = true),
            claims: vec![claim(
                "claim-0",
                vec![first_available(
                    "req-0",
                    vec![sub("subReq-0", CLASS_B, 1), sub("subReq-1", CLASS_A, 1)],
                )],
                vec![],
            )],
            classes: vec![class(CLASS_A, DRIVER_A), class(CLASS_B, DRIVER_B)],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Devices(vec![vec![(
                "req-0/subReq-1",
                DRIVER_A,
                "pool-1",
                "device-1",
            )]]),
            ..base("prioritized-list-first-unavailable")
        },
        Case {
            features: only(|f| f.prioritized_list = true),
            claims: vec![claim(
                "claim-0",
                vec![first_available(
                    "req-0",
                    vec![sub("subReq-0", CLASS_B, 2), sub("subReq-1", CLASS_A, 2)],
                )],
                vec![],
            )],
            classes: vec![class(CLASS_A, DRIVER_A), class(CLASS_B, DRIVER_B)],
            slices: vec![
                one_device("slice-1", NODE_1, "pool-1", DRIVER_A),
                one_device("slice-2", NODE_1, "pool-2", DRIVER_B),
            ],
            expect: Expect::Nothing,
            ..base("prioritized-list-non-available")
        },
        Case {
            features: only(|f| f.prioritized_list = true),
            claims: vec![claim(
                "claim-0",
                vec![
                    first_available(
                        "req-0",
                        vec![
                            selecting(sub("subReq-0", CLASS_A, 1), &memory_at_least("8Gi")),
                            selecting(sub("subReq-1", CLASS_A, 1), &memory_at_least("4Gi")),
                        ],
                    ),
                    selecting(req("req-1", CLASS_A, 1), &memory_at_least("8Gi")),
                ],
                vec![],
            )],
            slices: vec![
                slice1(
                    "slice-1",
                    On::Node(NODE_1),
                    "pool-1",
                    DRIVER_A,
                    vec![memory(dev("device-1"), "8Gi")],
                ),
                slice1(
                    "slice-2",
                    On::Node(NODE_1),
                    "pool-2",
                    DRIVER_A,
                    vec![memory(dev("device-2"), "4Gi")],
                ),
            ],
            expect: Expect::Devices(vec![vec![
                ("req-0/subReq-1", DRIVER_A, "pool-2", "device-2"),
                ("req-1", DRIVER_A, "pool-1", "device-1"),
            ]]),
            ..base("prioritized-list-with-backtracking")
        },
        Case {
            features: only(|f| f.prioritized_list = true),
            claims: vec![claim(
                "claim-0",
                vec![first_available(
                    "req-0",
                    vec![sub("subReq-0", CLASS_B, 500), sub("subReq-1", CLASS_A, 1)],
                )],
                vec![],
            )],
            classes: vec![class(CLASS_A, DRIVER_A), class(CLASS_B, DRIVER_B)],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Devices(vec![vec![(
                "req-0/subReq-1",
                DRIVER_A,
                "pool-1",
                "device-1",
            )]]),
            ..base("prioritized-list-too-many-in-first-subrequest")
        },
        Case {
            features: only(|f| f.device_taints = true),
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    with(
                        dev("device-1"),
                        "taints",
                        json!([taint_no_schedule.clone()]),
                    ),
                    with(dev("device-2"), "taints", json!([taint_no_execute.clone()])),
                ],
            )],
            expect: Expect::Nothing,
            ..base("tainted-two-devices")
        },
        Case {
            features: only(|f| f.device_taints = true),
            claims: vec![claim(
                "claim-0",
                vec![tolerating(
                    req("req-0", CLASS_A, 1),
                    json!([toleration_no_execute.clone()]),
                )],
                vec![],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    with(
                        dev("device-1"),
                        "taints",
                        json!([taint_no_schedule.clone()]),
                    ),
                    with(dev("device-2"), "taints", json!([taint_no_execute.clone()])),
                ],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-2")]]),
            check: Some(|r| {
                let result = &r[0]
                    .devices
                    .as_ref()
                    .and_then(|d| d.results.clone())
                    .unwrap_or_default()[0];
                assert_eq!(
                    result.tolerations.as_ref().map(Vec::len),
                    Some(1),
                    "the toleration is in the result"
                );
            }),
            ..base("tainted-two-devices-tolerated")
        },
        Case {
            features: only(|f| f.device_taints = true),
            claims: vec![claim(
                "claim-0",
                vec![tolerating(
                    req("req-0", CLASS_A, 1),
                    json!([
                        toleration_no_schedule.clone(),
                        toleration_no_execute.clone()
                    ]),
                )],
                vec![],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![with(
                    dev("device-1"),
                    "taints",
                    json!([taint_no_schedule.clone(), taint_no_execute.clone()]),
                )],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            ..base("tainted-one-device-two-taints-both-tolerated")
        },
        Case {
            features: only(|f| f.device_taints = true),
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![with(
                    dev("device-1"),
                    "taints",
                    json!([taint("taint-key", "taint-value", "None")]),
                )],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            ..base("tainted-no-effect")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![with(
                    dev("device-1"),
                    "taints",
                    json!([taint_no_schedule.clone(), taint_no_execute.clone()]),
                )],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            ..base("tainted-disabled")
        },
        Case {
            features: only(|f| f.partitionable_devices = true),
            claims: vec![claim("claim-0", vec![req_all("req-0", CLASS_A)], vec![])],
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![with(
                        dev("device-1"),
                        "consumesCounters",
                        json!([{ "counterSet": "counter-set-1", "counters": { "memory": { "value": "4Gi" } } }]),
                    )],
                ),
                json!({ "metadata": { "name": "slice-2" }, "spec": { "driver": DRIVER_A, "nodeName": NODE_1,
                    "pool": { "name": "pool-1", "resourceSliceCount": 2, "generation": 1 },
                    "sharedCounters": [{ "name": "counter-set-1", "counters": { "memory": { "value": "8Gi" } } }] } }),
            ],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            ..base("all-devices-with-consumed-counters")
        },
        Case {
            features: only(|f| f.partitionable_devices = true),
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 2)], vec![])],
            // Two partitions of 6Gi from a counter set of 8Gi: only one fits.
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![
                        with(
                            dev("device-1"),
                            "consumesCounters",
                            json!([{ "counterSet": "counter-set-1", "counters": { "memory": { "value": "6Gi" } } }]),
                        ),
                        with(
                            dev("device-2"),
                            "consumesCounters",
                            json!([{ "counterSet": "counter-set-1", "counters": { "memory": { "value": "6Gi" } } }]),
                        ),
                    ],
                ),
                json!({ "metadata": { "name": "slice-2" }, "spec": { "driver": DRIVER_A, "nodeName": NODE_1,
                    "pool": { "name": "pool-1", "resourceSliceCount": 2, "generation": 1 },
                    "sharedCounters": [{ "name": "counter-set-1", "counters": { "memory": { "value": "8Gi" } } }] } }),
            ],
            expect: Expect::Nothing,
            ..base("partitionable-devices-no-capacity-available")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                vec![],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(with(
                    dev("device-1"),
                    "capacity",
                    json!({ "capacity-1": { "value": "1" } }),
                ))],
            )],
            expect: Expect::Nothing,
            ..base("consumable-capacity-multi-allocatable-device-with-missing-capacity-request")
        },
        Case {
            features: only(|f| f.device_binding_and_status = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                vec![],
            )],
            slices: vec![one_device("slice-1", NODE_1, "pool-1", DRIVER_A)],
            expect: Expect::Error(
                "claim claim-0, request req-0: has capacity requests, but the DRAConsumableCapacity feature is disabled",
            ),
            ..base("consumable-capacity-disabled-feature")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![
                claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![]),
                claim("claim-1", vec![req("req-0", CLASS_A, 1)], vec![]),
            ],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(values_policy(dev("device-1"), "0", "1", &[]))],
            )],
            expect: Expect::Devices(vec![
                vec![("req-0", DRIVER_A, "pool-1", "device-1")],
                vec![("req-0", DRIVER_A, "pool-1", "device-1")],
            ]),
            check: Some(|r| {
                for a in r {
                    assert_eq!(
                        consumed(a),
                        [(Some(SHARE.to_string()), Some("0".to_string()))]
                    );
                }
            }),
            ..base("consumable-capacity-multi-allocatable-device-with-zero-request-policy")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(values_policy(dev("device-1"), "0", "1", &[]))],
            )],
            expect: Expect::Nothing,
            ..base("consumable-capacity-multi-allocatable-device-violates-zero-request-policy")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![
                claim(
                    "claim-0",
                    vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                    vec![],
                ),
                claim(
                    "claim-1",
                    vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                    vec![],
                ),
            ],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(range_policy(dev("device-1"), "4"))],
            )],
            // Both on the one device, each rounded up to the minimum, 2.
            expect: Expect::Devices(vec![
                vec![("req-0", DRIVER_A, "pool-1", "device-1")],
                vec![("req-0", DRIVER_A, "pool-1", "device-1")],
            ]),
            check: Some(|r| {
                for a in r {
                    assert_eq!(
                        consumed(a),
                        [(Some(SHARE.to_string()), Some("2".to_string()))]
                    );
                }
            }),
            ..base(
                "consumable-capacity-multi-allocatable-device-with-range-policy-with-capacity-request",
            )
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "3")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(range_policy(dev("device-1"), "4"))],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            // 3 rounds up to 2 + 2.
            check: Some(|r| {
                assert_eq!(
                    consumed(&r[0]),
                    [(Some(SHARE.to_string()), Some("4".to_string()))]
                )
            }),
            ..base("consumable-capacity-multi-allocatable-device-with-range-policy-step")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "2")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(values_policy(dev("device-1"), "1", "3", &["3"]))],
            )],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            check: Some(|r| {
                assert_eq!(
                    consumed(&r[0]),
                    [(Some(SHARE.to_string()), Some("3".to_string()))]
                )
            }),
            ..base("consumable-capacity-multi-allocatable-device-with-valid-values-policy-round-up")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![
                claim(
                    "claim-0",
                    vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                    vec![],
                ),
                claim(
                    "claim-1",
                    vec![capacity_request(req("req-0", CLASS_A, 1), "2")],
                    vec![],
                ),
            ],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(range_policy(dev("device-1"), "2"))],
            )],
            expect: Expect::Nothing,
            ..base(
                "consumable-capacity-multi-allocatable-device-with-exceeded-consumable-capacity-request",
            )
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "6")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(range_policy(dev("device-1"), "10"))],
            )],
            // The policy's max is 4: not allocated although 6 < 10.
            expect: Expect::Nothing,
            ..base(
                "consumable-capacity-multi-allocatable-device-with-request-over-max-sharing-policy",
            )
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "2")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    shared(range_policy(dev("device-1"), "2")),
                    shared(range_policy(dev("device-2"), "2")),
                ],
            )],
            consumed: vec![((DRIVER_A, "pool-1", "device-1"), "2")],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-2")]]),
            ..base(
                "consumable-capacity-multi-allocatable-device-with-allocated-capacity-next-device",
            )
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![
                claim(
                    "claim-0",
                    vec![
                        capacity_request(req("req-0", CLASS_A, 1), "2"),
                        capacity_request(req("req-1", CLASS_A, 1), "2"),
                    ],
                    vec![json!({ "matchAttribute": "driver-a/stringAttribute" })],
                ),
                claim(
                    "claim-1",
                    vec![capacity_request(req("req-0", CLASS_A, 1), "2")],
                    vec![],
                ),
            ],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(
                        shared(range_policy(dev("device-2"), "2")),
                        json!({ "stringAttribute": { "string": "stringAttributeValue1" } }),
                    ),
                    attrs(
                        shared(range_policy(dev("device-1"), "4")),
                        json!({ "stringAttribute": { "string": "stringAttributeValue2" } }),
                    ),
                ],
            )],
            expect: Expect::Devices(vec![
                vec![
                    ("req-0", DRIVER_A, "pool-1", "device-1"),
                    ("req-1", DRIVER_A, "pool-1", "device-1"),
                ],
                vec![("req-0", DRIVER_A, "pool-1", "device-2")],
            ]),
            ..base("consumable-capacity-with-multi-allocatable-device-backtrack")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, false)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![with(
                    dev("device-1"),
                    "capacity",
                    json!({ "capacity-0": { "value": "1" } }),
                )],
            )],
            // A dedicated device: no share, no consumed capacity.
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-1")]]),
            check: Some(|r| assert_eq!(consumed(&r[0]), [(None, None)])),
            ..base("consumable-capacity-dedicated-device-with-consumable-capacity-request")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![capacity_request(req("req-0", CLASS_A, 1), "1")],
                vec![],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![shared(range_policy(dev("device-1"), "2"))],
            )],
            allocated: vec![(DRIVER_A, "pool-1", "device-1")],
            expect: Expect::Nothing,
            ..base(
                "allow-multiple-allocations-not-allocate-multi-allocatable-device-which-already-dedicated",
            )
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![
                    req("req-0", CLASS_A, 1),
                    req("req-1", CLASS_A, 1),
                    req("req-2", CLASS_A, 1),
                    req("req-3", CLASS_A, 1),
                ],
                vec![
                    json!({ "distinctAttribute": "driver-a/boolAttribute", "requests": ["req-0", "req-1"] }),
                    json!({ "distinctAttribute": "driver-a/driverVersion", "requests": ["req-0", "req-1", "req-2"] }),
                    json!({ "distinctAttribute": "driver-a/numa", "requests": ["req-0", "req-1", "req-2", "req-3"] }),
                ],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(
                        shared(dev("device-1")),
                        json!({ "driverVersion": { "version": "1.0.0" }, "numa": { "int": 0 }, "boolAttribute": { "bool": true } }),
                    ),
                    attrs(
                        shared(dev("device-2")),
                        json!({ "driverVersion": { "version": "1.0.1" }, "numa": { "int": 1 }, "boolAttribute": { "bool": false } }),
                    ),
                    attrs(
                        shared(dev("device-3")),
                        json!({ "driverVersion": { "version": "1.0.2" }, "numa": { "int": 2 }, "boolAttribute": { "bool": true } }),
                    ),
                    attrs(
                        shared(dev("device-4")),
                        json!({ "driverVersion": { "version": "1.0.0" }, "numa": { "int": 3 }, "boolAttribute": { "bool": true } }),
                    ),
                ],
            )],
            expect: Expect::Devices(vec![vec![
                ("req-0", DRIVER_A, "pool-1", "device-1"),
                ("req-1", DRIVER_A, "pool-1", "device-2"),
                ("req-2", DRIVER_A, "pool-1", "device-3"),
                ("req-3", DRIVER_A, "pool-1", "device-4"),
            ]]),
            // Shared devices without capacity: a share each, nothing consumed.
            check: Some(|r| {
                assert!(
                    consumed(&r[0])
                        .iter()
                        .all(|c| *c == (Some(SHARE.to_string()), None))
                )
            }),
            ..base("with-distinct-constraints")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![req("req-0", CLASS_A, 1)],
                vec![
                    json!({ "distinctAttribute": "driver-a/boolAttribute", "requests": ["req-0"] }),
                ],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![attrs(
                    shared(dev("device-1")),
                    json!({ "boolAttribute": {} }),
                )],
            )],
            expect: Expect::Error("unsupported attribute value"),
            ..base("with-distinct-constraints-unknown-type-attribute")
        },
        Case {
            features: only(|f| f.consumable_capacity = true),
            claims: vec![claim(
                "claim-0",
                vec![
                    capacity_request(req("req-0", CLASS_A, 1), "1"),
                    capacity_request(req("req-1", CLASS_A, 1), "1"),
                ],
                vec![json!({ "distinctAttribute": "driver-a/stringAttribute" })],
            )],
            classes: vec![class_multi(CLASS_A, DRIVER_A, true)],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![attrs(
                    shared(range_policy(dev("device-1"), "2")),
                    json!({ "stringAttribute": { "string": "v" } }),
                )],
            )],
            expect: Expect::Nothing,
            ..base("distinct-constraint-one-multi-allocatable-device-with-distinct-constraint")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_2),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-2",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-2")],
                ),
            ],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-1", "device-2")]]),
            ..base("different-resourceslices-in-pool-can-target-different-nodes")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-2",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-3",
                    On::Node(NODE_1),
                    ("pool-2", 1, 1),
                    DRIVER_A,
                    vec![dev("device-2")],
                ),
            ],
            expect: Expect::Devices(vec![vec![("req-0", DRIVER_A, "pool-2", "device-2")]]),
            ..base("invalid-pool-is-ok-if-devices-can-be-allocated-from-other")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-2",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-3",
                    On::Node(NODE_1),
                    ("pool-2", 1, 1),
                    DRIVER_A,
                    vec![dev("device-2")],
                ),
            ],
            allocated: vec![(DRIVER_A, "pool-2", "device-2")],
            expect: Expect::Error("invalid resource pools were encountered"),
            ..base("invalid-pool-is-error-if-no-other-device-can-be-allocated")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 1)], vec![])],
            slices: vec![slice(
                "slice-1",
                On::Node(NODE_1),
                ("pool-1", 2, 1),
                DRIVER_A,
                vec![dev("device-1")],
            )],
            expect: Expect::Nothing,
            ..base("no-allocation-from-incomplete-pools")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 5)], vec![])],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                (1..=4).map(|i| dev(&format!("device-{i}"))).collect(),
            )],
            expect: Expect::Nothing,
            // Combinations, not permutations: 16 steps, not hundreds.
            steps: Some(16),
            ..base("check-combinations-within-single-request-single-pool-single-slice")
        },
        Case {
            claims: vec![claim("claim-0", vec![req("req-0", CLASS_A, 5)], vec![])],
            slices: vec![
                slice(
                    "slice-1",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-1")],
                ),
                slice(
                    "slice-2",
                    On::Node(NODE_1),
                    ("pool-1", 2, 1),
                    DRIVER_A,
                    vec![dev("device-2")],
                ),
                slice1(
                    "slice-3",
                    On::Node(NODE_1),
                    "pool-2",
                    DRIVER_A,
                    vec![dev("device-3"), dev("device-4")],
                ),
            ],
            expect: Expect::Nothing,
            steps: Some(16),
            ..base("check-combinations-within-single-request-multiple-pools-multiple-slices")
        },
        Case {
            claims: vec![claim(
                "claim-0",
                vec![
                    req("req-1", CLASS_A, 2),
                    selecting(
                        req("req-2", CLASS_A, 1),
                        "device.attributes[\"driver-a\"].type == \"X\"",
                    ),
                ],
                vec![],
            )],
            slices: vec![slice1(
                "slice-1",
                On::Node(NODE_1),
                "pool-1",
                DRIVER_A,
                vec![
                    attrs(dev("device-1"), json!({ "type": { "string": "X" } })),
                    attrs(dev("device-2"), json!({ "type": { "string": "Y" } })),
                    attrs(dev("device-3"), json!({ "type": { "string": "Y" } })),
                ],
            )],
            expect: Expect::Devices(vec![vec![
                ("req-1", DRIVER_A, "pool-1", "device-2"),
                ("req-1", DRIVER_A, "pool-1", "device-3"),
                ("req-2", DRIVER_A, "pool-1", "device-1"),
            ]]),
            steps: Some(12),
            ..base("check-combinations-with-backtracking")
        },
    ]
}

#[test]
fn upstreams_allocator_cases_hold() {
    let mut failures = Vec::new();
    let cases = cases();
    for case in &cases {
        let (result, stats) = run(case);
        let outcome = match (&case.expect, &result) {
            (Expect::Devices(want), Ok(Some(got))) => {
                let mut want: Vec<Vec<Got>> = want
                    .iter()
                    .map(|claim| {
                        let mut c: Vec<Got> = claim
                            .iter()
                            .map(|(r, d, p, n)| {
                                (r.to_string(), d.to_string(), p.to_string(), n.to_string())
                            })
                            .collect();
                        c.sort();
                        c
                    })
                    .collect();
                want.iter_mut().for_each(|c| c.sort());
                let got_devices = devices(got);
                if got_devices == want {
                    if let Some(check) = case.check {
                        check(got);
                    }
                    Ok(())
                } else {
                    Err(format!("want {want:?}, got {got_devices:?}"))
                }
            }
            (Expect::Nothing, Ok(None)) => Ok(()),
            (Expect::Error(text), Err(e)) if e.to_string().contains(text) => Ok(()),
            (_, other) => Err(format!("unexpected outcome: {other:?}")),
        };
        if let Err(why) = outcome {
            failures.push(format!("{}: {why}", case.name));
        }
        if let Some(steps) = case.steps
            && stats.allocate_one_invocations != steps
        {
            failures.push(format!(
                "{}: {} search steps, upstream takes {steps}",
                case.name, stats.allocate_one_invocations
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from upstream:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The product's DeviceClasses (`core::wire`'s selectors, which the chart renders the same)
/// over a node as the DRA plugin publishes it (`dra::slices::build_slices`: the GPUs, then an
/// HCA): a claim asking GPU memory and the HCA must be allocated.
#[test]
fn the_kind_classes_select_without_an_error_on_gpu_devices() {
    use gpushare::core::wire::{
        DRA_DEVICE_CLASS, DRA_DRIVER_NAME, dra_gpu_class_selector, dra_kind_class_name,
        dra_kind_class_selector,
    };
    use gpushare::core::{GpuPolicy, MemoryUnit};
    use gpushare::dra::slices::{SliceGpu, build_slices};
    use k8s_openapi::api::resource::v1::Device;

    let rdma = "gpushare.io/rdma";
    let rdma_class = dra_kind_class_name(rdma).expect("a class name");
    let hca: Device = serde_json::from_value(json!({ "name": "rdma-mlx5-0",
        "attributes": { "type": { "string": "rdma" }, "resource": { "string": rdma } } }))
    .expect("a device");
    let gpu = SliceGpu {
        index: 0,
        uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
        product_name: "NVIDIA H100".into(),
        memory_bytes: 80 << 30,
        place: None,
        unhealthy: None,
        allocated_bytes: 0,
    };
    let slices = build_slices(
        NODE_1,
        DRA_DRIVER_NAME,
        None,
        MemoryUnit::GIB,
        GpuPolicy::Binpack,
        &[gpu],
        &[hca],
        1,
    );
    let classes: Vec<DeviceClass> = typed(&[
        class_selecting(DRA_DEVICE_CLASS, &dra_gpu_class_selector(DRA_DRIVER_NAME)),
        class_selecting(&rdma_class, &dra_kind_class_selector(DRA_DRIVER_NAME, rdma)),
    ]);
    let claims: Vec<ResourceClaim> = typed(&[claim(
        "job",
        vec![
            json!({ "name": "gpu", "exactly": { "deviceClassName": DRA_DEVICE_CLASS,
                "capacity": { "requests": { "memory": "10Gi" } } } }),
            json!({ "name": "nic", "exactly": { "deviceClassName": rdma_class } }),
        ],
        vec![],
    )]);
    let result = structured::allocate(
        &claims,
        &classes,
        &slices,
        &Usage::default(),
        &node(NODE_1, "region-1"),
        &Features::default(),
        &mut || SHARE.to_string(),
    );
    match result {
        Ok(Some(allocation)) => assert_eq!(
            devices(&allocation)[0].len(),
            2,
            "the GPU share and the HCA"
        ),
        other => panic!("the claim is not allocated: {other:?}"),
    }
}

/// One request of two devices never takes one shared device twice, however much capacity it
/// has: the request goes on after the device it took (the sandbox once gave it the same GPU
/// twice).
#[test]
fn a_request_of_two_devices_takes_two_devices_even_from_shared_ones() {
    let gpu = |name: &str| {
        shared(with(
            dev(name),
            "capacity",
            json!({ "memory": { "value": "16Gi", "requestPolicy": { "default": "16Gi",
                "validRange": { "min": "1Gi", "max": "16Gi", "step": "1Gi" } } } }),
        ))
    };
    let two = json!({ "name": "req-0", "exactly": { "deviceClassName": CLASS_A, "count": 2,
        "capacity": { "requests": { "memory": "1Gi" } } } });
    let mut case = Case {
        features: Features::default(),
        claims: vec![claim("claim-0", vec![two], vec![])],
        slices: vec![slice1(
            "slice-1",
            On::Node(NODE_1),
            "pool-1",
            DRIVER_A,
            vec![gpu("gpu-0")],
        )],
        ..base("count-two-on-one-shared-device")
    };
    let (result, _) = run(&case);
    assert!(matches!(result, Ok(None)), "{result:?}");
    case.slices = vec![slice1(
        "slice-1",
        On::Node(NODE_1),
        "pool-1",
        DRIVER_A,
        vec![gpu("gpu-0"), gpu("gpu-1")],
    )];
    let (result, _) = run(&case);
    let allocation = result.expect("no error").expect("allocated");
    assert_eq!(
        devices(&allocation),
        [vec![
            (
                "req-0".into(),
                DRIVER_A.into(),
                "pool-1".into(),
                "gpu-0".into()
            ),
            (
                "req-0".into(),
                DRIVER_A.into(),
                "pool-1".into(),
                "gpu-1".into()
            ),
        ]]
    );
    // Two requests of one claim may share one device: each is a share of its own.
    let case = Case {
        features: Features::default(),
        claims: vec![claim(
            "claim-0",
            vec![
                capacity_request(req("req-0", CLASS_A, 1), "1Gi"),
                capacity_request(req("req-1", CLASS_A, 1), "1Gi"),
            ],
            vec![],
        )],
        slices: vec![slice1(
            "slice-1",
            On::Node(NODE_1),
            "pool-1",
            DRIVER_A,
            vec![with(
                gpu("gpu-0"),
                "capacity",
                json!({ "capacity-0": { "value": "16Gi" } }),
            )],
        )],
        ..base("two-requests-one-shared-device")
    };
    let (result, _) = run(&case);
    let allocation = result.expect("no error").expect("allocated");
    assert_eq!(devices(&allocation)[0].len(), 2);
    assert!(devices(&allocation)[0].iter().all(|d| d.3 == "gpu-0"));
}
