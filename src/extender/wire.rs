//! The scheduler-extender API v1 on the wire: `ExtenderArgs`, `ExtenderFilterResult`,
//! `HostPriorityList`, `ExtenderBindingArgs`, `ExtenderBindingResult`.
//!
//! Input keys are matched case-insensitively, as Go's decoder does (kube-scheduler ≤ 1.15 sent
//! `pod`, `nodes`, `nodenames`; newer ones send `Pod`, `Nodes`, `NodeNames`). Only the keys of
//! the extender structs themselves are folded; the embedded Pod and Node objects are ordinary
//! Kubernetes JSON. Output is PascalCase exactly as Go's untagged structs encode it, with
//! `null` where Go emits a nil slice or map.
//!
//! The Pod is decoded as a [`WatchedPod`] (only the fields a request is computed from; the
//! rest, `managedFields` above all, is skipped unallocated) and `NodeNames` into one
//! [`NameList`] buffer, not a `String` per name: both are most of a filter's work otherwise.
//!
//! This module decodes and encodes; it decides nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::k8s::WatchedPod;

/// A request body that cannot be used, with a message naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

/// Node names, in order, kept in one buffer: decoding or building a list of 500 names is
/// two allocations, not 500. Encodes and decodes as a JSON array of strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameList {
    text: String,
    /// Where each name ends in `text`.
    ends: Vec<usize>,
}

impl NameList {
    /// Appends `name`.
    pub fn push(&mut self, name: &str) {
        self.text.push_str(name);
        self.ends.push(self.text.len());
    }

    /// The `i`th name.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.text.get(start..end)
    }

    /// How many names.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// No names.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The names, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let name = &self.text[start..end];
            start = end;
            name
        })
    }
}

impl<'a> FromIterator<&'a str> for NameList {
    fn from_iter<I: IntoIterator<Item = &'a str>>(names: I) -> Self {
        let mut list = NameList::default();
        for name in names {
            list.push(name);
        }
        list
    }
}

impl Serialize for NameList {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for NameList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Appends one JSON string to the list without allocating a `String` for it.
        struct Append<'l>(&'l mut NameList);
        impl<'de> DeserializeSeed<'de> for Append<'_> {
            type Value = ();
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_str(self)
            }
        }
        impl Visitor<'_> for Append<'_> {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name")
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<(), E> {
                self.0.push(name);
                Ok(())
            }
        }
        struct Names;
        impl<'de> Visitor<'de> for Names {
            type Value = NameList;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of node names")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NameList, A::Error> {
                let mut list = NameList::default();
                if let Some(n) = seq.size_hint() {
                    list.ends.reserve(n);
                }
                while seq.next_element_seed(Append(&mut list))?.is_some() {}
                Ok(list)
            }
        }
        deserializer.deserialize_seq(Names)
    }
}

/// Where the filter and prioritize candidates came from.
#[derive(Debug, Clone)]
pub enum Candidates {
    /// `NodeNames` (kube-scheduler with `nodeCacheCapable: true`).
    Names(NameList),
    /// `Nodes.items`: the node objects, kept as given, with their names.
    Nodes(Vec<(String, Value)>),
}

impl Candidates {
    /// The candidate node names, in order.
    pub fn names(&self) -> Vec<&str> {
        match self {
            Candidates::Names(n) => n.iter().collect(),
            Candidates::Nodes(n) => n.iter().map(|(name, _)| name.as_str()).collect(),
        }
    }
}

/// `ExtenderArgs`, decoded.
#[derive(Debug, Clone)]
pub struct ExtenderArgs {
    /// The pod being scheduled, as a [`WatchedPod`] reads it (the fields its request is
    /// computed from).
    pub pod: Pod,
    /// The candidate nodes.
    pub candidates: Candidates,
}

/// `ExtenderBindingArgs`, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingArgs {
    /// `PodName`.
    pub pod_name: String,
    /// `PodNamespace`.
    pub pod_namespace: String,
    /// `PodUID`.
    pub pod_uid: String,
    /// `Node`.
    pub node: String,
}

/// Parses a body as a JSON object whose keys are folded to lowercase (values untouched).
fn folded_object(body: &[u8], what: &str) -> Result<Map<String, Value>, DecodeError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| DecodeError(format!("{what}: body is not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(DecodeError(format!(
            "{what}: body must be a JSON object, got {}",
            kind(&value)
        )));
    };
    let mut out = Map::with_capacity(map.len());
    for (k, v) in map {
        // Go keeps the last of duplicate keys; so do we.
        out.insert(k.to_ascii_lowercase(), v);
    }
    Ok(out)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The top-level members of a JSON object, keys folded to lowercase, values as their raw
/// JSON text (not parsed); the last of duplicate keys wins, as in Go. `None` when the body is
/// not a JSON object.
fn folded_raw_members(body: &[u8]) -> Option<Vec<(String, &RawValue)>> {
    struct Members;
    impl<'de> serde::de::Visitor<'de> for Members {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out: Vec<(String, &'de RawValue)> = Vec::new();
            while let Some((key, value)) =
                map.next_entry::<std::borrow::Cow<'de, str>, &'de RawValue>()?
            {
                let key = key.to_ascii_lowercase();
                out.retain(|(k, _)| *k != key);
                out.push((key, value));
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let members = serde::Deserializer::deserialize_map(&mut de, Members).ok()?;
    de.end().ok()?;
    Some(members)
}

/// The common, well-formed `ExtenderArgs` (a Pod and `NodeNames`), decoded in one pass: the
/// Pod straight into its type and the names into strings, with no intermediate JSON tree.
/// `None` for anything else (`Nodes`, a missing Pod, a wrong type, …): the caller then takes
/// the tree path, which names the field at fault.
fn decode_extender_args_direct(body: &[u8]) -> Option<ExtenderArgs> {
    let members = folded_raw_members(body)?;
    let member = |key: &str| members.iter().find(|(k, _)| k == key).map(|(_, v)| v.get());
    let pod: WatchedPod =
        serde_json::from_str(member("pod").filter(|raw| raw.starts_with('{'))?).ok()?;
    let names: NameList = serde_json::from_str(member("nodenames")?).ok()?;
    Some(ExtenderArgs {
        pod: pod.0,
        candidates: Candidates::Names(names),
    })
}

/// Decodes `ExtenderArgs` (filter and prioritize).
pub fn decode_extender_args(body: &[u8]) -> Result<ExtenderArgs, DecodeError> {
    if let Some(args) = decode_extender_args_direct(body) {
        return Ok(args);
    }
    let mut map = folded_object(body, "ExtenderArgs")?;
    let pod = match map.remove("pod") {
        None | Some(Value::Null) => {
            return Err(DecodeError("ExtenderArgs.Pod: missing".to_string()));
        }
        Some(v @ Value::Object(_)) => match serde_json::from_value::<WatchedPod>(v.clone()) {
            Ok(pod) => pod.0,
            Err(e) => {
                let decodes = |v: Value| serde_json::from_value::<WatchedPod>(v).is_ok();
                let at = if body.len() <= FAULT_PATH_MAX_BODY {
                    fault_path(&v, &decodes)
                } else {
                    String::new()
                };
                return Err(DecodeError(format!("ExtenderArgs.Pod{at}: {e}")));
            }
        },
        Some(other) => {
            return Err(DecodeError(format!(
                "ExtenderArgs.Pod: expected an object, got {}",
                kind(&other)
            )));
        }
    };
    let candidates = match map.remove("nodenames") {
        Some(Value::Array(items)) => {
            let mut names = NameList::default();
            for (i, item) in items.into_iter().enumerate() {
                match item {
                    Value::String(s) => names.push(&s),
                    other => {
                        return Err(DecodeError(format!(
                            "ExtenderArgs.NodeNames[{i}]: expected a string, got {}",
                            kind(&other)
                        )));
                    }
                }
            }
            Some(Candidates::Names(names))
        }
        None | Some(Value::Null) => None,
        Some(other) => {
            return Err(DecodeError(format!(
                "ExtenderArgs.NodeNames: expected an array of strings, got {}",
                kind(&other)
            )));
        }
    };
    let candidates = match candidates {
        Some(c) => c,
        None => match map.remove("nodes") {
            Some(Value::Object(list)) => Candidates::Nodes(decode_node_list(list)?),
            None | Some(Value::Null) => {
                return Err(DecodeError(
                    "ExtenderArgs: neither NodeNames nor Nodes given (cannot get node names)"
                        .to_string(),
                ));
            }
            Some(other) => {
                return Err(DecodeError(format!(
                    "ExtenderArgs.Nodes: expected a NodeList object, got {}",
                    kind(&other)
                )));
            }
        },
    };
    Ok(ExtenderArgs { pod, candidates })
}

/// Bodies up to this size get the member path of a decoding fault ([`fault_path`] re-decodes
/// a copy per member it tries); larger ones get the decoder's message alone.
const FAULT_PATH_MAX_BODY: usize = 1 << 20;
/// At most this many re-decodes per refused body: hostile input cannot make the error path
/// expensive (the path found so far is reported).
const FAULT_PATH_MAX_PROBES: usize = 64;

/// Where in `value` (which `decodes` refuses) the fault is, as `.spec.containers[0].name`:
/// the member whose removal makes it decode, followed down; empty when no single member is at
/// fault. Only on the error path (it re-decodes a copy once per member tried, at most
/// [`FAULT_PATH_MAX_PROBES`] times).
fn fault_path(value: &Value, decodes: &dyn Fn(Value) -> bool) -> String {
    let mut path = String::new();
    let mut pointer = String::new();
    let probes = std::cell::Cell::new(0usize);
    loop {
        let Some(here) = value.pointer(&pointer) else {
            return path;
        };
        let without = |step: &str| {
            if probes.get() >= FAULT_PATH_MAX_PROBES {
                return false;
            }
            probes.set(probes.get() + 1);
            let mut probe = value.clone();
            let target = probe.pointer_mut(&pointer);
            match (target, step.parse::<usize>()) {
                (Some(Value::Array(items)), Ok(i)) if i < items.len() => {
                    items.remove(i);
                }
                (Some(Value::Object(map)), _) => {
                    map.remove(step);
                }
                _ => return false,
            }
            decodes(probe)
        };
        let steps: Vec<(String, String)> = match here {
            Value::Object(map) => map.keys().map(|k| (k.clone(), format!(".{k}"))).collect(),
            Value::Array(items) => (0..items.len())
                .map(|i| (i.to_string(), format!("[{i}]")))
                .collect(),
            _ => return path,
        };
        let Some((step, shown)) = steps.into_iter().find(|(step, _)| without(step)) else {
            return path;
        };
        pointer.push('/');
        pointer.push_str(&step.replace('~', "~0").replace('/', "~1"));
        path.push_str(&shown);
    }
}

fn decode_node_list(list: Map<String, Value>) -> Result<Vec<(String, Value)>, DecodeError> {
    let items = list
        .into_iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("items"))
        .map(|(_, v)| v);
    let items = match items {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(DecodeError(format!(
                "ExtenderArgs.Nodes.items: expected an array, got {}",
                kind(&other)
            )));
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, node) in items.into_iter().enumerate() {
        let name = node
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .map(str::to_string);
        match name {
            Some(name) if !name.is_empty() => out.push((name, node)),
            _ => {
                return Err(DecodeError(format!(
                    "ExtenderArgs.Nodes.items[{i}].metadata.name: missing or not a string"
                )));
            }
        }
    }
    Ok(out)
}

/// Decodes `ExtenderBindingArgs`.
pub fn decode_binding_args(body: &[u8]) -> Result<BindingArgs, DecodeError> {
    let mut map = folded_object(body, "ExtenderBindingArgs")?;
    let mut field = |key: &str, shown: &str, required: bool| -> Result<String, DecodeError> {
        match map.remove(key) {
            Some(Value::String(s)) if !(required && s.is_empty()) => Ok(s),
            Some(Value::String(_)) | None | Some(Value::Null) if !required => Ok(String::new()),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                Err(DecodeError(format!("ExtenderBindingArgs.{shown}: missing")))
            }
            Some(other) => Err(DecodeError(format!(
                "ExtenderBindingArgs.{shown}: expected a string, got {}",
                kind(&other)
            ))),
        }
    };
    let pod_name = field("podname", "PodName", true)?;
    let pod_namespace = field("podnamespace", "PodNamespace", false)?;
    let pod_uid = field("poduid", "PodUID", false)?;
    let node = field("node", "Node", true)?;
    let pod_namespace = if pod_namespace.is_empty() {
        "default".to_string()
    } else {
        pod_namespace
    };
    Ok(BindingArgs {
        pod_name,
        pod_namespace,
        pod_uid,
        node,
    })
}

/// `ExtenderFilterResult`, encoded as Go encodes the untagged struct.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct FilterResult {
    /// `Nodes`: a NodeList of the passing nodes, or `null`.
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeList>,
    /// `NodeNames`: the passing node names, or `null`.
    #[serde(rename = "NodeNames")]
    pub node_names: Option<NameList>,
    /// `FailedNodes`: node → reason (preemption may help).
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: BTreeMap<String, String>,
    /// `FailedAndUnresolvableNodes`: node → reason (preemption cannot help); `null` when empty.
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable: Option<BTreeMap<String, String>>,
    /// `Error`: empty on success.
    #[serde(rename = "Error")]
    pub error: String,
}

/// A `v1.NodeList` holding node objects as they were given.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct NodeList {
    /// Always `{}`.
    pub metadata: Map<String, Value>,
    /// The nodes.
    pub items: Vec<Value>,
}

/// One `HostPriority`, naming a host of the request it answers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct HostPriority<'a> {
    /// `Host`.
    #[serde(rename = "Host")]
    pub host: &'a str,
    /// `Score` (0–10).
    #[serde(rename = "Score")]
    pub score: i64,
}

/// `ExtenderBindingResult` and the error body of every verb: `{"Error": "..."}`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct ErrorBody {
    /// `Error`: empty on success.
    #[serde(rename = "Error")]
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = r#"{"metadata":{"name":"p","namespace":"ns","uid":"u1"},
        "spec":{"containers":[{"name":"c","resources":{"limits":{"aliyun.com/gpu-mem":"4"}}}]}}"#;

    #[test]
    fn keys_are_case_insensitive() {
        for (pod_key, names_key) in [
            ("Pod", "NodeNames"),
            ("pod", "nodenames"),
            ("POD", "nodeNames"),
        ] {
            let body = format!(r#"{{"{pod_key}":{POD},"{names_key}":["a","b"]}}"#);
            let args = decode_extender_args(body.as_bytes()).unwrap();
            assert_eq!(args.pod.metadata.name.as_deref(), Some("p"));
            assert_eq!(args.candidates.names(), ["a", "b"]);
        }
        for key in ["PodName", "podName", "podname"] {
            let body = format!(r#"{{"{key}":"p","PodNamespace":"ns","poduid":"u","NODE":"n1"}}"#);
            let args = decode_binding_args(body.as_bytes()).unwrap();
            assert_eq!(args.pod_name, "p");
            assert_eq!(args.pod_uid, "u");
            assert_eq!(args.node, "n1");
        }
    }

    #[test]
    fn the_direct_path_agrees_with_the_tree_path() {
        let bodies = [
            format!(r#"{{"Pod":{POD},"NodeNames":["a","b"]}}"#),
            format!(r#"{{"pod":{POD},"NODENAMES":[],"Nodes":null}}"#),
            // The last of duplicate keys wins, whatever their case.
            format!(
                r#"{{"Pod":{{"metadata":{{"name":"first"}}}},"pod":{POD},"NodeNames":["x"],"nodenames":["y"]}}"#
            ),
            format!(r#"{{"Pod":{POD},"NodeNames":["\u0061\n"]}}"#),
        ];
        for body in &bodies {
            let direct = decode_extender_args_direct(body.as_bytes()).expect("the direct path");
            let mut map = folded_object(body.as_bytes(), "ExtenderArgs").unwrap();
            let pod: WatchedPod = serde_json::from_value(map.remove("pod").unwrap()).unwrap();
            let names: Vec<String> =
                serde_json::from_value(map.remove("nodenames").unwrap()).unwrap();
            assert_eq!(direct.pod, pod.0, "{body}");
            assert_eq!(direct.candidates.names(), names, "{body}");
        }
        // What the direct path leaves to the tree path, which explains the fault.
        for body in [
            format!(r#"{{"Pod":{POD},"Nodes":{{"items":[]}}}}"#),
            format!(r#"{{"Pod":{POD},"NodeNames":null}}"#),
            format!(r#"{{"Pod":{POD},"NodeNames":["a",1]}}"#),
            r#"{"Pod":null,"NodeNames":["a"]}"#.to_string(),
            r#"{"Pod":"p","NodeNames":["a"]}"#.to_string(),
            format!(r#"{{"Pod":{POD},"NodeNames":["a"]}} trailing"#),
            "[1]".to_string(),
        ] {
            assert!(
                decode_extender_args_direct(body.as_bytes()).is_none(),
                "{body}"
            );
        }
        let err =
            decode_extender_args(format!(r#"{{"Pod":{POD},"NodeNames":["a",1]}}"#).as_bytes())
                .unwrap_err();
        assert_eq!(
            err.0,
            "ExtenderArgs.NodeNames[1]: expected a string, got a number"
        );
    }

    #[test]
    fn name_lists_hold_each_name_and_round_trip() {
        let json = r#"["gpu-1","","caf\u00e9","a\"b","gpu-1"]"#;
        let list: NameList = serde_json::from_str(json).unwrap();
        let want = ["gpu-1", "", "café", "a\"b", "gpu-1"];
        assert_eq!(list.len(), want.len());
        assert_eq!(list.iter().collect::<Vec<_>>(), want);
        for (i, name) in want.iter().enumerate() {
            assert_eq!(list.get(i), Some(*name), "{i}");
        }
        assert_eq!(list.get(want.len()), None);
        assert_eq!(NameList::from_iter(want), list);
        let again: NameList = serde_json::from_str(&serde_json::to_string(&list).unwrap()).unwrap();
        assert_eq!(again, list);
        assert!(serde_json::from_str::<NameList>("[]").unwrap().is_empty());
        for bad in [r#"["a",1]"#, r#""a""#, "[null]", r#"[["a"]]"#] {
            assert!(serde_json::from_str::<NameList>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn node_lists_keep_the_objects() {
        let body = format!(
            r#"{{"Pod":{POD},"Nodes":{{"metadata":{{}},"items":[{{"metadata":{{"name":"n1"}},"x":1}}]}}}}"#
        );
        let args = decode_extender_args(body.as_bytes()).unwrap();
        match args.candidates {
            Candidates::Nodes(n) => {
                assert_eq!(n[0].0, "n1");
                assert_eq!(n[0].1["x"], 1);
            }
            Candidates::Names(_) => panic!("expected nodes"),
        }
        // NodeNames wins when both are given, as kube-scheduler's nodeCacheCapable does.
        let body = format!(r#"{{"Pod":{POD},"Nodes":{{"items":[]}},"NodeNames":["z"]}}"#);
        assert_eq!(
            decode_extender_args(body.as_bytes())
                .unwrap()
                .candidates
                .names(),
            ["z"]
        );
    }

    #[test]
    fn bad_input_names_the_field() {
        let e = |b: &str| decode_extender_args(b.as_bytes()).unwrap_err().0;
        assert!(e("{").contains("not valid JSON"));
        assert!(e("[]").contains("must be a JSON object"));
        assert!(e(r#"{"NodeNames":["a"]}"#).contains("Pod: missing"));
        assert!(e(r#"{"Pod":7,"NodeNames":["a"]}"#).contains("Pod: expected an object"));
        assert!(e(&format!(r#"{{"Pod":{POD}}}"#)).contains("neither NodeNames nor Nodes"));
        assert!(e(&format!(r#"{{"Pod":{POD},"NodeNames":[1]}}"#)).contains("NodeNames[0]"));
        assert!(e(&format!(r#"{{"Pod":{POD},"NodeNames":"a"}}"#)).contains("NodeNames"));
        assert!(
            e(r#"{"Pod":{"spec":{"containers":"x"}},"NodeNames":[]}"#)
                .starts_with("ExtenderArgs.Pod.spec.containers:")
        );
        let deep = e(
            r#"{"Pod":{"metadata":{"name":"p"},"spec":{"containers":[{"name":"a"},{"name":7}]}},"NodeNames":[]}"#,
        );
        assert!(
            deep.starts_with("ExtenderArgs.Pod.spec.containers[1].name:"),
            "{deep}"
        );
        assert!(
            e(r#"{"Pod":{"metadata":{"annotations":{"k":1}}},"NodeNames":[]}"#)
                .starts_with("ExtenderArgs.Pod.metadata.annotations.k:")
        );
        // Many members: the search is bounded and still names the part it narrowed to.
        let many: String = (0..1000).map(|i| format!(r#""k{i:05}":"v","#)).collect();
        let wide = e(&format!(
            r#"{{"Pod":{{"metadata":{{"annotations":{{{many}"zz":1}}}}}},"NodeNames":[]}}"#
        ));
        assert!(
            wide.starts_with("ExtenderArgs.Pod.metadata.annotations:"),
            "{wide}"
        );
        assert!(
            e(&format!(r#"{{"Pod":{POD},"Nodes":{{"items":[{{}}]}}}}"#))
                .contains("items[0].metadata.name")
        );
        let b = |b: &str| decode_binding_args(b.as_bytes()).unwrap_err().0;
        assert!(b(r#"{"PodName":"p"}"#).contains("Node: missing"));
        assert!(b(r#"{"PodName":5,"Node":"n"}"#).contains("PodName: expected a string"));
    }

    #[test]
    fn results_encode_like_go() {
        let r = FilterResult {
            node_names: Some(NameList::from_iter(["a"])),
            failed_nodes: BTreeMap::from([("b".into(), "why".into())]),
            ..FilterResult::default()
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"Nodes":null,"NodeNames":["a"],"FailedNodes":{"b":"why"},"FailedAndUnresolvableNodes":null,"Error":""}"#
        );
        let p = vec![HostPriority {
            host: "a",
            score: 7,
        }];
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"[{"Host":"a","Score":7}]"#
        );
        assert_eq!(
            serde_json::to_string(&ErrorBody {
                error: String::new()
            })
            .unwrap(),
            r#"{"Error":""}"#
        );
    }
}
