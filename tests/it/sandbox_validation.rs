//! The sandbox API server validates `resource.k8s.io/v1` writes as upstream's
//! `pkg/apis/resource/validation` does and drops the fields of disabled feature gates as its
//! registry strategies do, per Kubernetes version: each rule is a write that is refused (422
//! `Invalid`, upstream's field path and message) beside a neighbour that is accepted, sent
//! through kube-rs as a client would; the gates' defaults are checked per version (1.34 to
//! 1.37) and per gate.
//!
//! The last tests run what the gpushare DRA plugin publishes against these rules: a tainted
//! pool split to fit, a GPU too small for the unit left out rather than invalidating the
//! slice.

use gpushare::core::{GpuPolicy, MemoryUnit};
use gpushare::dra::slices::{SliceGpu, build_slices};
use gpushare_sandbox::apiserver::{ApiServer, FeatureGate};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const CLASSES: &str = "/apis/resource.k8s.io/v1/deviceclasses";
const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
const TEMPLATES: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates";

/// What the API server answered: the object, or the Status of a refusal.
#[derive(Debug)]
enum Answer {
    Stored(Value),
    Refused {
        code: u16,
        message: String,
        /// `(field, message)` of each cause.
        causes: Vec<(String, String)>,
    },
}

impl Answer {
    fn stored(&self) -> &Value {
        match self {
            Answer::Stored(v) => v,
            Answer::Refused { message, .. } => panic!("refused: {message}"),
        }
    }

    fn refused(self) -> (u16, String, Vec<(String, String)>) {
        match self {
            Answer::Refused {
                code,
                message,
                causes,
            } => (code, message, causes),
            Answer::Stored(v) => panic!("stored: {v}"),
        }
    }
}

async fn send(server: &ApiServer, method: http::Method, path: &str, body: &Value) -> Answer {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(body.to_string().into_bytes())
        .expect("a request");
    match server.admin_client().request::<Value>(request).await {
        Ok(v) => Answer::Stored(v),
        Err(kube::Error::Api(status)) => Answer::Refused {
            code: status.code,
            message: status.message.clone(),
            causes: status
                .details
                .iter()
                .flat_map(|d| d.causes.iter())
                .map(|c| (c.field.clone(), c.message.clone()))
                .collect(),
        },
        Err(e) => panic!("{path}: {e}"),
    }
}

async fn create(server: &ApiServer, path: &str, body: &Value) -> Answer {
    send(server, http::Method::POST, path, body).await
}

async fn dry_run(server: &ApiServer, path: &str, body: &Value) -> Answer {
    send(
        server,
        http::Method::POST,
        &format!("{path}?dryRun=All"),
        body,
    )
    .await
}

// --- objects --------------------------------------------------------------------------------

fn gpu(name: &str) -> Value {
    json!({ "name": name, "allowMultipleAllocations": true,
        "attributes": { "type": { "string": "gpu" }, "uuid": { "string": name } },
        "capacity": { "memory": { "value": "16Gi", "requestPolicy": { "default": "16Gi",
            "validRange": { "min": "1Gi", "max": "16Gi", "step": "1Gi" } } } } })
}

fn slice_of(devices: Vec<Value>) -> Value {
    json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": "node-a-gpushare.io-0" },
        "spec": { "driver": "gpushare.io", "nodeName": "node-a",
            "pool": { "name": "node-a", "generation": 1, "resourceSliceCount": 1 },
            "devices": devices } })
}

fn gpus(n: usize) -> Vec<Value> {
    (0..n).map(|i| gpu(&format!("gpu-{i}"))).collect()
}

fn tainted(mut d: Value) -> Value {
    d["taints"] =
        json!([{ "key": "gpushare.io/unhealthy", "value": "xid-79", "effect": "NoSchedule" }]);
    d
}

fn with_capacity(value: &str, policy: Value) -> Value {
    let mut d = gpu("gpu-0");
    d["capacity"]["memory"] = json!({ "value": value, "requestPolicy": policy });
    d
}

fn claim(requests: Value, constraints: Value) -> Value {
    json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": "c", "namespace": "default" },
        "spec": { "devices": { "requests": requests, "constraints": constraints } } })
}

fn request(name: &str) -> Value {
    json!({ "name": name, "exactly": { "deviceClassName": "gpu-mem.gpushare.io" } })
}

fn class(selectors: Value) -> Value {
    json!({ "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": "gpu-mem.gpushare.io" }, "spec": { "selectors": selectors } })
}

fn cel(expression: &str) -> Value {
    json!([{ "cel": { "expression": expression } }])
}

// --- the rules ------------------------------------------------------------------------------

/// A rule: a write refused with `field` and `message`, and a neighbour accepted.
struct Rule {
    name: &'static str,
    path: &'static str,
    refused: Value,
    field: &'static str,
    message: &'static str,
    accepted: Value,
}

fn rules() -> Vec<Rule> {
    let attribute = |value: Value| {
        let mut d = gpu("gpu-0");
        d["attributes"]["extra"] = value;
        slice_of(vec![d])
    };
    let keyed = |key: &str| {
        let mut d = gpu("gpu-0");
        d["attributes"][key] = json!({ "int": 1 });
        slice_of(vec![d])
    };
    let many_attributes = |n: usize| {
        let mut d = gpu("gpu-0");
        for i in 0..n.saturating_sub(3) {
            d["attributes"][format!("a{i}")] = json!({ "int": i });
        }
        slice_of(vec![d])
    };
    let range = |min: &str, step: &str, default: &str| json!({ "default": default, "validRange": { "min": min, "max": "16Gi", "step": step } });
    let requests = |n: usize| Value::Array((0..n).map(|i| request(&format!("r{i}"))).collect());
    vec![
        Rule {
            name: "128 devices per slice",
            path: SLICES,
            refused: slice_of(gpus(129)),
            field: "spec.devices",
            message: "Too many: 129: must have at most 128 items",
            accepted: slice_of(gpus(128)),
        },
        Rule {
            name: "64 devices once a device has taints",
            path: SLICES,
            refused: slice_of({
                let mut d = gpus(65);
                d[0] = tainted(d[0].clone());
                d
            }),
            field: "spec.devices",
            message: "Too many: 65: must have at most 64 items",
            accepted: slice_of({
                let mut d = gpus(64);
                d[0] = tainted(d[0].clone());
                d
            }),
        },
        Rule {
            name: "32 attributes and capacities per device",
            path: SLICES,
            refused: many_attributes(33),
            field: "spec.devices[0]",
            message: "Invalid value: 33: the total number of attributes and capacities must not exceed 32",
            accepted: many_attributes(32),
        },
        Rule {
            name: "string attributes of at most 64 bytes",
            path: SLICES,
            refused: attribute(json!({ "string": "x".repeat(65) })),
            field: "spec.devices[0].attributes[extra].string",
            message: "Too long: may not be more than 64 bytes",
            accepted: attribute(json!({ "string": "x".repeat(64) })),
        },
        Rule {
            name: "exactly one value per attribute",
            path: SLICES,
            refused: attribute(json!({ "string": "a", "int": 1 })),
            field: "spec.devices[0].attributes[extra]",
            message: "exactly one value must be specified",
            accepted: attribute(json!({ "int": 1 })),
        },
        Rule {
            name: "versions are semver 2.0.0",
            path: SLICES,
            refused: attribute(json!({ "version": "535.104.05" })),
            field: "spec.devices[0].attributes[extra].version",
            message: "Invalid value: \"535.104.05\": must be a string compatible with semver.org spec 2.0.0",
            accepted: attribute(json!({ "version": "535.104.5" })),
        },
        Rule {
            name: "attribute names are C identifiers in a domain",
            path: SLICES,
            refused: keyed("memory-mib"),
            field: "spec.devices[0].attributes",
            message: "a valid C identifier must start with alphabetic character or '_'",
            accepted: keyed("memory_mib"),
        },
        Rule {
            name: "attribute names have at most one slash",
            path: SLICES,
            refused: keyed("gpushare.io/a/b"),
            field: "spec.devices[0].attributes",
            message: "must not contain more than one slash",
            accepted: keyed("gpushare.io/a"),
        },
        Rule {
            name: "device names are DNS labels",
            path: SLICES,
            refused: slice_of(vec![gpu("GPU_0")]),
            field: "spec.devices[0].name",
            message: "a lowercase RFC 1123 label must consist of",
            accepted: slice_of(vec![gpu("gpu-0")]),
        },
        Rule {
            name: "one step above min must fit the capacity (a GPU of one unit)",
            path: SLICES,
            refused: slice_of(vec![with_capacity(
                "16Gi",
                json!({ "default": "16Gi",
                "validRange": { "min": "16Gi", "max": "16Gi", "step": "16Gi" } }),
            )]),
            field: "spec.devices[0].capacity[memory].requestPolicy.validRange.step",
            message: "Invalid value: \"16Gi\": one step 32Gi is larger than capacity value: 16Gi",
            accepted: slice_of(vec![with_capacity(
                "32Gi",
                json!({ "default": "32Gi",
                "validRange": { "min": "16Gi", "max": "32Gi", "step": "16Gi" } }),
            )]),
        },
        Rule {
            name: "the default is a step from min",
            path: SLICES,
            refused: slice_of(vec![with_capacity("16Gi", range("1Gi", "2Gi", "16Gi"))]),
            field: "spec.devices[0].capacity[memory].requestPolicy.validRange.step",
            message: "value is not a multiple of a given step (2Gi) from (1Gi)",
            accepted: slice_of(vec![with_capacity("16Gi", range("2Gi", "2Gi", "16Gi"))]),
        },
        Rule {
            name: "valid values are sorted and hold the default",
            path: SLICES,
            refused: slice_of(vec![with_capacity(
                "16Gi",
                json!({ "default": "4Gi",
                "validValues": ["8Gi", "2Gi"] }),
            )]),
            field: "spec.devices[0].capacity[memory].requestPolicy.validValues",
            message: "default value is not valid according to the requestPolicy",
            accepted: slice_of(vec![with_capacity(
                "16Gi",
                json!({ "default": "4Gi",
                "validValues": ["2Gi", "4Gi", "8Gi"] }),
            )]),
        },
        Rule {
            name: "a request policy needs allowMultipleAllocations",
            path: SLICES,
            refused: {
                let mut d = gpu("gpu-0");
                d.as_object_mut()
                    .map(|o| o.remove("allowMultipleAllocations"));
                slice_of(vec![d])
            },
            field: "spec.devices[0].capacity[memory].requestPolicy",
            message: "Forbidden: allowMultipleAllocations must be true",
            accepted: slice_of(vec![gpu("gpu-0")]),
        },
        Rule {
            name: "taint effects are upstream's",
            path: SLICES,
            refused: {
                let mut d = tainted(gpu("gpu-0"));
                d["taints"][0]["effect"] = json!("PreferNoSchedule");
                slice_of(vec![d])
            },
            field: "spec.devices[0].taints[0].effect",
            message: "Unsupported value: \"PreferNoSchedule\": supported values: \"NoExecute\", \"NoSchedule\", \"None\"",
            accepted: slice_of(vec![tainted(gpu("gpu-0"))]),
        },
        Rule {
            name: "exactly one node selection",
            path: SLICES,
            refused: {
                let mut s = slice_of(gpus(1));
                s["spec"]["allNodes"] = json!(true);
                s
            },
            field: "spec",
            message: "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required, but multiple fields are set",
            accepted: slice_of(gpus(1)),
        },
        Rule {
            name: "a pool has at least one slice",
            path: SLICES,
            refused: {
                let mut s = slice_of(gpus(1));
                s["spec"]["pool"]["resourceSliceCount"] = json!(0);
                s
            },
            field: "spec.pool.resourceSliceCount",
            message: "Invalid value: 0: must be greater than zero",
            accepted: slice_of(gpus(1)),
        },
        Rule {
            name: "driver names are at most 63 bytes",
            path: SLICES,
            refused: {
                let mut s = slice_of(gpus(1));
                s["spec"]["driver"] = json!(format!("{}.io", "g".repeat(61)));
                s
            },
            field: "spec.driver",
            message: "Too long: may not be more than 63 bytes",
            accepted: slice_of(gpus(1)),
        },
        Rule {
            name: "32 requests per claim",
            path: CLAIMS,
            refused: claim(requests(33), json!([])),
            field: "spec.devices.requests",
            message: "Too many: 33: must have at most 32 items",
            accepted: claim(requests(32), json!([])),
        },
        Rule {
            name: "request names are unique",
            path: CLAIMS,
            refused: claim(json!([request("r"), request("r")]), json!([])),
            field: "spec.devices.requests[1]",
            message: "Duplicate value: \"r\"",
            accepted: claim(json!([request("r"), request("s")]), json!([])),
        },
        Rule {
            name: "32 constraints per claim",
            path: CLAIMS,
            refused: claim(
                json!([request("r")]),
                Value::Array(vec![json!({ "matchAttribute": "gpushare.io/uuid" }); 33]),
            ),
            field: "spec.devices.constraints",
            message: "Too many: 33: must have at most 32 items",
            accepted: claim(
                json!([request("r")]),
                Value::Array(vec![json!({ "matchAttribute": "gpushare.io/uuid" }); 32]),
            ),
        },
        Rule {
            name: "constraints name requests of the claim",
            path: CLAIMS,
            refused: claim(
                json!([request("r")]),
                json!([{ "requests": ["other"], "matchAttribute": "gpushare.io/uuid" }]),
            ),
            field: "spec.devices.constraints[0].requests[0]",
            message: "must be the name of a request in the claim",
            accepted: claim(
                json!([request("r")]),
                json!([{ "requests": ["r"], "matchAttribute": "gpushare.io/uuid" }]),
            ),
        },
        Rule {
            name: "matchAttribute is fully qualified",
            path: CLAIMS,
            refused: claim(json!([request("r")]), json!([{ "matchAttribute": "uuid" }])),
            field: "spec.devices.constraints[0].matchAttribute",
            message: "a fully qualified name must be a domain and a name separated by a slash",
            accepted: claim(
                json!([request("r")]),
                json!([{ "matchAttribute": "gpushare.io/uuid" }]),
            ),
        },
        Rule {
            name: "ExactCount asks for at least one device",
            path: CLAIMS,
            refused: claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c", "count": 0 } }]),
                json!([]),
            ),
            field: "spec.devices.requests[0].exactly.count",
            message: "Invalid value: 0: must be greater than zero",
            accepted: claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c", "count": 2 } }]),
                json!([]),
            ),
        },
        Rule {
            name: "exactly one of exactly and firstAvailable",
            path: CLAIMS,
            refused: claim(json!([{ "name": "r" }]), json!([])),
            field: "spec.devices.requests[0]",
            message: "Required value: exactly one of `exactly` or `firstAvailable` is required",
            accepted: claim(json!([request("r")]), json!([])),
        },
        Rule {
            name: "an Exists toleration has no value",
            path: CLAIMS,
            refused: claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c",
                "tolerations": [{ "key": "gpushare.io/unhealthy", "operator": "Exists", "value": "x" }] } }]),
                json!([]),
            ),
            field: "spec.devices.requests[0].exactly.tolerations[0].value",
            message: "must be empty for operator `Exists`",
            accepted: claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c",
                "tolerations": [{ "key": "gpushare.io/unhealthy", "operator": "Exists" }] } }]),
                json!([]),
            ),
        },
        Rule {
            name: "request selectors compile",
            path: CLAIMS,
            refused: claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c",
                "selectors": cel("device.nope == 1") } }]),
                json!([]),
            ),
            field: "spec.devices.requests[0].exactly.selectors[0].cel.expression",
            message: "undefined field 'nope'",
            accepted: claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c",
                "selectors": cel("device.driver == \"gpushare.io\"") } }]),
                json!([]),
            ),
        },
        Rule {
            name: "class selectors compile",
            path: CLASSES,
            refused: class(cel("device.driver ==")),
            field: "spec.selectors[0].cel.expression",
            message: "compilation failed: ERROR: <input>:1:",
            accepted: class(cel("device.driver == \"gpushare.io\"")),
        },
        Rule {
            name: "class selectors evaluate to bool",
            path: CLASSES,
            refused: class(cel("device.driver")),
            field: "spec.selectors[0].cel.expression",
            message: "must evaluate to bool or the unknown type, not string",
            accepted: class(cel("device.attributes[\"gpushare.io\"].type == \"gpu\"")),
        },
        Rule {
            name: "class selectors are at most 10 KiB",
            path: CLASSES,
            refused: class(cel(&format!("device.driver == \"{}\"", "x".repeat(10_224)))),
            field: "spec.selectors[0].cel.expression",
            message: "Too long: may not be more than 10240 bytes",
            accepted: class(cel(&format!("device.driver == \"{}\"", "x".repeat(10_000)))),
        },
        Rule {
            name: "32 selectors per class",
            path: CLASSES,
            refused: class(Value::Array(vec![
                json!({ "cel": { "expression": "true" } });
                33
            ])),
            field: "spec.selectors",
            message: "Too many: 33: must have at most 32 items",
            accepted: class(Value::Array(vec![
                json!({ "cel": { "expression": "true" } });
                32
            ])),
        },
        Rule {
            name: "templates are validated as claims, under spec.spec",
            path: TEMPLATES,
            refused: json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": { "name": "t", "namespace": "default" },
                "spec": { "spec": { "devices": { "requests": [request("R")] } } } }),
            field: "spec.spec.devices.requests[0].name",
            message: "a lowercase RFC 1123 label must consist of",
            accepted: json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": { "name": "t", "namespace": "default" },
                "spec": { "spec": { "devices": { "requests": [request("r")] } } } }),
        },
    ]
}

#[tokio::test]
async fn each_rule_refuses_its_write_and_accepts_the_neighbour() {
    let server = ApiServer::start()
        .await
        .expect("the sandbox API server starts");
    let mut failures = Vec::new();
    for rule in rules() {
        match dry_run(&server, rule.path, &rule.refused).await {
            Answer::Refused {
                code: 422,
                message,
                causes,
            } => {
                let hit = causes
                    .iter()
                    .any(|(f, m)| f == rule.field && m.contains(rule.message));
                if !hit || !message.contains(rule.message) {
                    failures.push(format!(
                        "{}: want {} {:?}, got {message} {causes:?}",
                        rule.name, rule.field, rule.message
                    ));
                }
            }
            other => failures.push(format!("{}: not refused with 422: {other:?}", rule.name)),
        }
        if let Answer::Refused { message, .. } = dry_run(&server, rule.path, &rule.accepted).await {
            failures.push(format!(
                "{}: the neighbour is refused: {message}",
                rule.name
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn a_refusal_is_upstreams_invalid_status_and_stores_nothing() {
    let server = ApiServer::start().await.expect("starts");
    let mut bad = slice_of(gpus(1));
    bad["spec"]["pool"]["resourceSliceCount"] = json!(0);
    bad["spec"]["driver"] = json!("");
    let (code, message, causes) = create(&server, SLICES, &bad).await.refused();
    assert_eq!(code, 422);
    assert_eq!(
        message,
        "ResourceSlice.resource.k8s.io \"node-a-gpushare.io-0\" is invalid: [spec.driver: Required value, spec.pool.resourceSliceCount: Invalid value: 0: must be greater than zero]"
    );
    assert_eq!(causes.len(), 2);
    assert!(server.list_objects("resourceslices", None).is_empty());

    // A quantity that does not parse is a decode error, as upstream's.
    let mut unparsable = slice_of(gpus(1));
    unparsable["spec"]["devices"][0]["capacity"]["memory"]["value"] = json!("16 GiB");
    let (code, message, _) = create(&server, SLICES, &unparsable).await.refused();
    assert_eq!(code, 400, "{message}");
    assert!(
        message.contains("quantities must match the regular expression"),
        "{message}"
    );

    // Through kube-rs' typed API too: a typed client sees the 422.
    let api: Api<ResourceSlice> = Api::all(server.admin_client());
    let typed: ResourceSlice = serde_json::from_value(slice_of(gpus(129))).expect("typed");
    match api.create(&PostParams::default(), &typed).await {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (422, "Invalid")),
        other => panic!("not refused: {other:?}"),
    }
}

#[tokio::test]
async fn updates_keep_what_upstream_keeps_immutable() {
    let server = ApiServer::start().await.expect("starts");
    let stored = create(&server, CLAIMS, &claim(json!([request("r")]), json!([]))).await;
    let mut changed = stored.stored().clone();
    changed["spec"]["devices"]["requests"][0]["name"] = json!("s");
    let (code, message, causes) =
        send(&server, http::Method::PUT, &format!("{CLAIMS}/c"), &changed)
            .await
            .refused();
    assert_eq!(code, 422);
    assert!(message.contains("spec: Invalid value:"), "{message}");
    assert!(
        causes
            .iter()
            .any(|(f, m)| f == "spec" && m.ends_with("field is immutable"))
    );

    // A status that reserves the claim without allocating it.
    let mut status = stored.stored().clone();
    status["status"] = json!({ "reservedFor": [{ "resource": "pods", "name": "p", "uid": "u" }] });
    let (code, _, causes) = send(
        &server,
        http::Method::PUT,
        &format!("{CLAIMS}/c/status"),
        &status,
    )
    .await
    .refused();
    assert_eq!(code, 422);
    assert_eq!(
        causes,
        [(
            "status.reservedFor".to_string(),
            "Forbidden: may not be specified when `allocated` is not set".to_string()
        )]
    );

    // A slice's driver never changes.
    let slice = create(&server, SLICES, &slice_of(gpus(1))).await;
    let mut moved = slice.stored().clone();
    moved["spec"]["driver"] = json!("other.io");
    let (code, _, causes) = send(
        &server,
        http::Method::PUT,
        &format!("{SLICES}/node-a-gpushare.io-0"),
        &moved,
    )
    .await
    .refused();
    assert_eq!(code, 422);
    assert_eq!(causes[0].0, "spec.driver");
    // A spec change is a new generation.
    let mut grown = slice.stored().clone();
    grown["spec"]["devices"] = Value::Array(gpus(2));
    let updated = send(
        &server,
        http::Method::PUT,
        &format!("{SLICES}/node-a-gpushare.io-0"),
        &grown,
    )
    .await;
    assert_eq!(slice.stored()["metadata"]["generation"], 1);
    assert_eq!(updated.stored()["metadata"]["generation"], 2);
}

// --- gates per version ----------------------------------------------------------------------

fn probe() -> Value {
    slice_of(vec![tainted(gpu("gpu-0"))])
}

#[tokio::test]
async fn each_version_drops_the_fields_its_default_gates_leave_out() {
    let server = ApiServer::start().await.expect("starts");
    assert_eq!(
        server.kubernetes_minor(),
        37,
        "the newest shipped, until set"
    );
    for (minor, kept) in [(34, false), (35, false), (36, true), (37, true)] {
        server
            .set_kubernetes_version(minor)
            .expect("a played version");
        let version: Value = server
            .admin_client()
            .request(
                http::Request::get("/version")
                    .body(Vec::new())
                    .expect("a request"),
            )
            .await
            .expect("/version");
        assert_eq!(version["minor"], minor.to_string());
        let answer = dry_run(&server, SLICES, &probe()).await;
        let device = &answer.stored()["spec"]["devices"][0];
        assert_eq!(device.get("taints").is_some(), kept, "1.{minor}: {device}");
        assert_eq!(
            device.get("allowMultipleAllocations").is_some(),
            kept,
            "1.{minor}: {device}"
        );
        assert_eq!(
            device["capacity"]["memory"].get("requestPolicy").is_some(),
            kept,
            "1.{minor}"
        );
        let claim = dry_run(
            &server,
            CLAIMS,
            &claim(
                json!([{ "name": "r", "exactly": { "deviceClassName": "c",
                    "capacity": { "requests": { "memory": "1Gi" } },
                    "tolerations": [{ "operator": "Exists" }] } }]),
                json!([]),
            ),
        )
        .await;
        let exactly = &claim.stored()["spec"]["devices"]["requests"][0]["exactly"];
        assert_eq!(
            exactly.get("capacity").is_some(),
            kept,
            "1.{minor}: {exactly}"
        );
        assert_eq!(
            exactly.get("tolerations").is_some(),
            kept,
            "1.{minor}: {exactly}"
        );
    }
    assert!(server.set_kubernetes_version(33).is_err());
    assert!(server.set_kubernetes_version(38).is_err());
}

#[tokio::test]
async fn a_gate_turned_on_keeps_its_fields_and_their_limits_apply() {
    let server = ApiServer::start().await.expect("starts");
    server.set_kubernetes_version(35).expect("1.35");
    assert!(!server.feature_gate(FeatureGate::DRADeviceTaints));
    // Off: 65 devices, one tainted, are accepted (the taint is dropped) ...
    let mut many = gpus(65);
    many[0] = tainted(many[0].clone());
    let answer = dry_run(&server, SLICES, &slice_of(many.clone())).await;
    assert!(
        answer.stored()["spec"]["devices"][0]
            .get("taints")
            .is_none()
    );
    // ... on, the taint is kept and the slice is over the limit of 64.
    server.set_feature_gate(FeatureGate::DRADeviceTaints, true);
    let (code, _, causes) = dry_run(&server, SLICES, &slice_of(many)).await.refused();
    assert_eq!(code, 422);
    assert_eq!(causes[0].1, "Too many: 65: must have at most 64 items");
    // 1.34 had no such limit (128 devices whatever the taints), and 4 taints per device.
    server.set_kubernetes_version(34).expect("1.34");
    server.set_feature_gate(FeatureGate::DRADeviceTaints, true);
    let mut many = gpus(65);
    many[0] = tainted(many[0].clone());
    assert!(matches!(
        dry_run(&server, SLICES, &slice_of(many)).await,
        Answer::Stored(_)
    ));
    let mut five = gpu("gpu-0");
    five["taints"] = Value::Array(
        (0..5)
            .map(|i| json!({ "key": format!("k{i}"), "effect": "NoSchedule" }))
            .collect(),
    );
    let (_, _, causes) = dry_run(&server, SLICES, &slice_of(vec![five]))
        .await
        .refused();
    assert_eq!(causes[0].1, "Too many: 5: must have at most 4 items");
}

#[tokio::test]
async fn a_field_stored_while_its_gate_was_on_survives_an_update_with_the_gate_off() {
    let server = ApiServer::start().await.expect("starts");
    let stored = create(&server, SLICES, &probe()).await;
    server.set_feature_gate(FeatureGate::DRADeviceTaints, false);
    server.set_consumable_capacity(false);
    let mut update = stored.stored().clone();
    update["spec"]["devices"][0]["attributes"]["index"] = json!({ "int": 0 });
    let updated = send(
        &server,
        http::Method::PUT,
        &format!("{SLICES}/node-a-gpushare.io-0"),
        &update,
    )
    .await;
    let device = &updated.stored()["spec"]["devices"][0];
    assert!(device.get("taints").is_some(), "{device}");
    assert_eq!(device["allowMultipleAllocations"], true);
    // A new slice loses them.
    let mut other = probe();
    other["metadata"]["name"] = json!("node-b-gpushare.io-0");
    let fresh = create(&server, SLICES, &other).await;
    assert!(fresh.stored()["spec"]["devices"][0].get("taints").is_none());
}

// --- what the product publishes -------------------------------------------------------------

fn slice_gpu(index: u32, gib: u64, unhealthy: bool) -> SliceGpu {
    SliceGpu {
        index,
        uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
        product_name: "NVIDIA A100".into(),
        memory_bytes: gib << 30,
        place: None,
        unhealthy: unhealthy.then(|| "xid-79".to_string()),
        allocated_bytes: 0,
    }
}

async fn publish(server: &ApiServer, slices: &[ResourceSlice]) -> Vec<Answer> {
    let mut out = Vec::new();
    for s in slices {
        out.push(create(server, SLICES, &serde_json::to_value(s).expect("JSON")).await);
    }
    out
}

/// The DRA plugin splits a pool into slices of 128 devices (`dra::slices::MAX_DEVICES_PER_SLICE`);
/// once a device is tainted (an unhealthy GPU), upstream allows 64.
#[tokio::test]
async fn a_tainted_pool_of_more_than_64_devices_is_split_to_fit() {
    let server = ApiServer::start().await.expect("starts");
    let gpus: Vec<SliceGpu> = (0..65).map(|i| slice_gpu(i, 16, i == 0)).collect();
    let slices = build_slices(
        "node-a",
        "gpushare.io",
        None,
        MemoryUnit::GIB,
        GpuPolicy::Binpack,
        &gpus,
        &[],
        1,
    );
    for answer in publish(&server, &slices).await {
        if let Answer::Refused { message, .. } = answer {
            panic!("a published slice is refused: {message}");
        }
    }
}

/// A GPU of one memory unit (or less) is published with `min + step > value`, which upstream
/// refuses for the whole slice: every GPU of the node is lost.
#[tokio::test]
async fn a_gpu_too_small_for_the_unit_does_not_invalidate_the_slice() {
    let server = ApiServer::start().await.expect("starts");
    let unit = MemoryUnit::from_mib(16 * 1024).expect("16GiB");
    let gpus = [slice_gpu(0, 16, false), slice_gpu(1, 32, false)];
    let slices = build_slices(
        "node-a",
        "gpushare.io",
        None,
        unit,
        GpuPolicy::Binpack,
        &gpus,
        &[],
        1,
    );
    for answer in publish(&server, &slices).await {
        if let Answer::Refused { message, .. } = answer {
            panic!("a published slice is refused: {message}");
        }
    }
    let stored: Vec<String> = server
        .list_objects("resourceslices", None)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| {
            d["attributes"]["index"]["int"]
                .as_i64()
                .map(|i| i.to_string())
        })
        .collect();
    assert_eq!(
        stored,
        ["1"],
        "the 32 GiB GPU serves, the 16 GiB one is left out"
    );
}
