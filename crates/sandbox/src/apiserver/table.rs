//! Server-side printing: `meta.k8s.io/v1` `Table` answers for clients that ask for them
//! (`Accept: application/json;as=Table;...`, as `kubectl get` does). Pods and nodes get
//! kubectl's usual columns (wide ones at priority 1); other kinds get Name and Age.

use serde_json::{Value, json};

use super::discovery::ResourceDef;
use super::store::{parse_rfc3339, unix_now};

/// What each row carries as `object` (`includeObject`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum IncludeObject {
    None,
    Metadata,
    Object,
}

impl IncludeObject {
    pub fn from_query(value: Option<&str>) -> IncludeObject {
        match value {
            Some("None") => IncludeObject::None,
            Some("Object") => IncludeObject::Object,
            _ => IncludeObject::Metadata,
        }
    }
}

/// Whether the `Accept` header asks for a Table.
pub(crate) fn wants_table(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("as=Table"))
}

fn column(name: &str, kind: &str, format: &str, priority: u8) -> Value {
    json!({ "name": name, "type": kind, "format": format, "description": "", "priority": priority })
}

fn columns(def: &ResourceDef) -> Vec<Value> {
    match def.id {
        "pods" => vec![
            column("Name", "string", "name", 0),
            column("Ready", "string", "", 0),
            column("Status", "string", "", 0),
            column("Restarts", "string", "", 0),
            column("Age", "string", "", 0),
            column("IP", "string", "", 1),
            column("Node", "string", "", 1),
            column("Nominated Node", "string", "", 1),
            column("Readiness Gates", "string", "", 1),
        ],
        "nodes" => vec![
            column("Name", "string", "name", 0),
            column("Status", "string", "", 0),
            column("Roles", "string", "", 0),
            column("Age", "string", "", 0),
            column("Version", "string", "", 0),
            column("Internal-IP", "string", "", 1),
            column("External-IP", "string", "", 1),
            column("OS-Image", "string", "", 1),
            column("Kernel-Version", "string", "", 1),
            column("Container-Runtime", "string", "", 1),
        ],
        "configmaps" => vec![
            column("Name", "string", "name", 0),
            column("Data", "integer", "", 0),
            column("Age", "string", "", 0),
        ],
        _ => vec![
            column("Name", "string", "name", 0),
            column("Age", "string", "", 0),
        ],
    }
}

fn text<'a>(obj: &'a Value, pointer: &str) -> &'a str {
    obj.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn or_none(s: &str) -> String {
    if s.is_empty() {
        "<none>".into()
    } else {
        s.into()
    }
}

/// kubectl's short age (`5s`, `3m`, `2h`, `4d`).
fn age(obj: &Value) -> String {
    let Some(created) = parse_rfc3339(text(obj, "/metadata/creationTimestamp")) else {
        return "<unknown>".into();
    };
    let secs = (unix_now() - created).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn cells(def: &ResourceDef, obj: &Value) -> Vec<Value> {
    let name = text(obj, "/metadata/name");
    match def.id {
        "pods" => {
            let statuses = obj
                .pointer("/status/containerStatuses")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let total = obj
                .pointer("/spec/containers")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            let ready = statuses
                .iter()
                .filter(|s| s.get("ready").and_then(Value::as_bool) == Some(true))
                .count();
            let restarts: i64 = statuses
                .iter()
                .filter_map(|s| s.get("restartCount").and_then(Value::as_i64))
                .sum();
            let status = match text(obj, "/status/reason") {
                "" => text(obj, "/status/phase"),
                reason => reason,
            };
            let status = if obj.pointer("/metadata/deletionTimestamp").is_some() {
                "Terminating"
            } else {
                status
            };
            vec![
                json!(name),
                json!(format!("{ready}/{total}")),
                json!(status),
                json!(restarts),
                json!(age(obj)),
                json!(or_none(text(obj, "/status/podIP"))),
                json!(or_none(text(obj, "/spec/nodeName"))),
                json!(or_none(text(obj, "/status/nominatedNodeName"))),
                json!("<none>"),
            ]
        }
        "nodes" => {
            let ready = obj
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .and_then(|cs| {
                    cs.iter()
                        .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
                })
                .and_then(|c| c.get("status").and_then(Value::as_str));
            let mut status = match ready {
                Some("True") => "Ready".to_string(),
                Some("False") => "NotReady".to_string(),
                _ => "Unknown".to_string(),
            };
            if obj.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true) {
                status.push_str(",SchedulingDisabled");
            }
            let roles: Vec<&str> = obj
                .pointer("/metadata/labels")
                .and_then(Value::as_object)
                .map(|labels| {
                    labels
                        .keys()
                        .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/"))
                        .collect()
                })
                .unwrap_or_default();
            let address = |kind: &str| {
                obj.pointer("/status/addresses")
                    .and_then(Value::as_array)
                    .and_then(|a| {
                        a.iter()
                            .find(|x| x.get("type").and_then(Value::as_str) == Some(kind))
                    })
                    .and_then(|x| x.get("address").and_then(Value::as_str))
                    .unwrap_or("")
                    .to_string()
            };
            vec![
                json!(name),
                json!(status),
                json!(or_none(&roles.join(","))),
                json!(age(obj)),
                json!(text(obj, "/status/nodeInfo/kubeletVersion")),
                json!(or_none(&address("InternalIP"))),
                json!(or_none(&address("ExternalIP"))),
                json!(or_none(text(obj, "/status/nodeInfo/osImage"))),
                json!(or_none(text(obj, "/status/nodeInfo/kernelVersion"))),
                json!(or_none(text(
                    obj,
                    "/status/nodeInfo/containerRuntimeVersion"
                ))),
            ]
        }
        "configmaps" => {
            let data = obj
                .get("data")
                .and_then(Value::as_object)
                .map_or(0, |d| d.len())
                + obj
                    .get("binaryData")
                    .and_then(Value::as_object)
                    .map_or(0, |d| d.len());
            vec![json!(name), json!(data), json!(age(obj))]
        }
        _ => vec![json!(name), json!(age(obj))],
    }
}

fn row(def: &ResourceDef, obj: &Value, include: IncludeObject) -> Value {
    let mut row = json!({ "cells": cells(def, obj) });
    match include {
        IncludeObject::None => {}
        IncludeObject::Object => row["object"] = obj.clone(),
        IncludeObject::Metadata => {
            row["object"] = json!({
                "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                "metadata": obj.get("metadata").cloned().unwrap_or_else(|| json!({})),
            })
        }
    }
    row
}

/// A Table of `objects`; `with_columns` false leaves out the column definitions (later
/// watch events).
pub(crate) fn table(
    def: &ResourceDef,
    objects: &[Value],
    include: IncludeObject,
    metadata: Value,
    with_columns: bool,
) -> Value {
    let rows: Vec<Value> = objects.iter().map(|o| row(def, o, include)).collect();
    let mut t = json!({ "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata, "rows": rows });
    t["columnDefinitions"] = if with_columns {
        json!(columns(def))
    } else {
        json!([])
    };
    t
}
