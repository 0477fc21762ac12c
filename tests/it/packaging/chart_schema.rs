//! The chart's `values.schema.json`: Helm checks the user's values against it before it
//! renders anything, so a value that cannot work is refused at `helm install` / `helm
//! template` time with its path (`at '/devicePlugin': additional properties 'mpss' not
//! allowed`). Tested with the real Helm engine (helm-python-sdk).
//!
//! The schema is written by hand except its `config` part (the keys of gpushare.toml), which
//! is generated from the binary's own configuration type: [`config_sections`] reads the
//! section and key names serde's derive gives `gpushare::config::Config` (the very names
//! `deny_unknown_fields` accepts), so the chart cannot drift from the binary. `make chart`
//! regenerates it (and the chart's README); the test fails with that command when they differ.

use std::cell::RefCell;
use std::collections::BTreeMap;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};
use serde_json::{Value, json};

use crate::support::helm_chart::{CHART, user_renders};
use crate::support::source_tree::{assert_generated, read};

const SCHEMA: &str = "packaging/helm/gpushare/values.schema.json";
const REGENERATE: &str = "make chart";

/// Section name -> key names, as the derive of `T` declares them.
type Sections = BTreeMap<String, Vec<String>>;

/// A deserializer that answers nothing but records the field names serde's derive hands to
/// `deserialize_struct`: at the top level the sections (each then traced in turn), inside a
/// section its keys (the section is then built from an empty map: its defaults).
struct Tracer<'a> {
    seen: &'a RefCell<Sections>,
    section: Option<&'static str>,
}

impl<'de> de::Deserializer<'de> for Tracer<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom(
            "the configuration is traced through its structs only",
        ))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.section {
            None => visitor.visit_map(SectionMap {
                seen: self.seen,
                fields,
                next: 0,
            }),
            Some(section) => {
                self.seen.borrow_mut().insert(
                    section.to_string(),
                    fields.iter().map(|f| f.to_string()).collect(),
                );
                visitor.visit_map(de::value::MapDeserializer::<_, Self::Error>::new(
                    std::iter::empty::<(String, String)>(),
                ))
            }
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The top-level map: every section name, each with a [`Tracer`] for its value.
struct SectionMap<'a> {
    seen: &'a RefCell<Sections>,
    fields: &'static [&'static str],
    next: usize,
}

impl<'de> MapAccess<'de> for SectionMap<'_> {
    type Error = de::value::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some(field) = self.fields.get(self.next) else {
            return Ok(None);
        };
        seed.deserialize((*field).into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let section = self.fields[self.next];
        self.next += 1;
        seed.deserialize(Tracer {
            seen: self.seen,
            section: Some(section),
        })
    }
}

/// The sections and keys of gpushare.toml, from the binary's `Config` type.
fn config_sections() -> Sections {
    let seen = RefCell::new(Sections::new());
    let _: gpushare::config::Config = serde::Deserialize::deserialize(Tracer {
        seen: &seen,
        section: None,
    })
    .expect("the configuration type traces");
    seen.into_inner()
}

/// The `config` part of the schema: every section and key of gpushare.toml, nothing else,
/// each key with its built-in default where it has one.
fn config_schema() -> Value {
    let defaults = serde_json::to_value(gpushare::config::Config::default()).expect("defaults");
    let sections: serde_json::Map<String, Value> = config_sections()
        .into_iter()
        .map(|(section, keys)| {
            let mut keys: serde_json::Map<String, Value> = keys
                .into_iter()
                .map(|key| {
                    let schema = match defaults[&section].get(&key) {
                        Some(d) => json!({ "default": d }),
                        None => json!({}),
                    };
                    (key, schema)
                })
                .collect();
            // The old spellings of the node keys still work (the binary reads them as
            // `node.<key>` and doctor names them): the chart accepts them too.
            if section == "device_plugin" {
                for key in gpushare::config::NODE_KEYS {
                    keys.insert(
                        (*key).to_string(),
                        json!({ "deprecated": true, "description": format!("old spelling of node.{key}") }),
                    );
                }
            }
            let schema = json!({
                "type": "object",
                "additionalProperties": false,
                "description": format!("[{section}] of gpushare.toml (packaging/gpushare.toml)"),
                "properties": keys,
            });
            (section, schema)
        })
        .collect();
    json!({
        "type": "object",
        "additionalProperties": false,
        "description": "gpushare.toml by section and key; generated from the binary's configuration (make chart)",
        "properties": sections,
    })
}

#[test]
fn the_schema_config_part_is_the_binary_configuration() {
    let sections = config_sections();
    // The tracer sees what the binary reads: a few well-known keys, and nothing odd.
    assert!(sections["extender"].contains(&"bind_timeout_ms".to_string()));
    assert!(sections["node"].contains(&"memory_unit".to_string()));
    assert!(sections["http"].contains(&"max_connections".to_string()));
    let mut schema: Value = serde_json::from_str(&read(SCHEMA)).expect("the schema is JSON");
    schema["properties"]["config"] = config_schema();
    let text = serde_json::to_string_pretty(&schema).expect("JSON") + "\n";
    assert_generated(SCHEMA, &text, REGENERATE);
}

#[test]
fn every_value_of_values_yaml_is_in_the_schema() {
    let values: Value =
        yaml_serde::from_str(&read(&format!("{CHART}/values.yaml"))).expect("values.yaml");
    let schema: Value = serde_json::from_str(&read(SCHEMA)).expect("the schema is JSON");
    fn walk(values: &Value, schema: &Value, path: &str, missing: &mut Vec<String>) {
        let Some(map) = values.as_object() else {
            return;
        };
        // Free-form maps (annotations, resources, affinity...) have no properties of their own.
        let Some(props) = schema.get("properties") else {
            return;
        };
        for (k, v) in map {
            match props.get(k) {
                Some(s) => walk(v, s, &format!("{path}.{k}"), missing),
                None => missing.push(format!("{path}.{k}")),
            }
        }
    }
    let mut missing = Vec::new();
    walk(&values, &schema, "", &mut missing);
    assert!(missing.is_empty(), "values without a schema: {missing:?}");
}

/// Renders each of `values` with the real Helm engine: `Err(message)` where Helm refuses.
fn renders(values: &[Value]) -> Option<Vec<Result<(), String>>> {
    let renders = user_renders(values, false)?;
    Some(renders.into_iter().map(|r| r.map(|_| ())).collect())
}

#[test]
fn the_schema_refuses_what_cannot_work_and_names_the_value() {
    let cases: Vec<(Value, &[&str])> = vec![
        (
            json!({"devicePlugin": {"mpss": true}}),
            &["at '/devicePlugin'", "'mpss' not allowed"],
        ),
        (
            json!({"extender": {"gpuPolicy": "random"}}),
            &["at '/extender/gpuPolicy'", "'binpack', 'spread'"],
        ),
        (
            json!({"devicePlugin": {"memoryUnit": "KiB"}}),
            &["at '/devicePlugin/memoryUnit'", "'KiB'"],
        ),
        (
            json!({"logLevel": "verbose"}),
            &[
                "at '/logLevel'",
                "'trace', 'debug', 'info', 'warn', 'error'",
            ],
        ),
        (
            json!({"scheduler": {"mode": "sideways"}}),
            &["at '/scheduler/mode'", "'extender', 'dedicated'"],
        ),
        (
            json!({"extender": {"replicas": 0}}),
            &["at '/extender/replicas'", "minimum"],
        ),
        (
            json!({"config": {"extender": {"bind_timeout": 3000}}}),
            &["at '/config/extender'", "'bind_timeout' not allowed"],
        ),
        (
            json!({"config": {"extendr": {"bind_timeout_ms": 3000}}}),
            &["at '/config'", "'extendr' not allowed"],
        ),
        (
            json!({"extender": {"tls": {"certificate": "helm"}}}),
            &["at '/extender/tls'", "'certificate' not allowed"],
        ),
        (
            json!({"webhook": {"failurePolicy": "fail"}}),
            &["at '/webhook/failurePolicy'"],
        ),
        (
            json!({"devicePlugin": {"deviceListStrategy": "envvar,cdi"}}),
            &["at '/devicePlugin/deviceListStrategy'"],
        ),
        (
            json!({"imagePulSecrets": []}),
            &["'imagePulSecrets' not allowed"],
        ),
    ];
    // And what must still pass: the defaults, the earlier forms, the documented examples.
    let good = [
        json!({}),
        json!({"devicePlugin": {"memoryUnit": "256MiB", "deviceListStrategy": "envvar,cdi-cri"}}),
        json!({"devicePlugin": {"deviceListStrategy": ["cdi-cri", "envvar"], "admissionPolicy": {"enabled": true}}}),
        json!({"config": {"extender": {"bind_timeout_ms": 3000}, "http": {"max_connections": 1024}}}),
        json!({"scheduler": {"mode": "dedicated"}, "extender": {"replicas": 1, "leaderElect": false}}),
        json!({"global": {"imageRegistry": "example.com"}}),
    ];
    let mut all: Vec<Value> = cases.iter().map(|(v, _)| v.clone()).collect();
    all.extend(good.iter().cloned());
    let Some(results) = renders(&all) else {
        return;
    };
    for ((values, expect), result) in cases.iter().zip(&results) {
        let err = result
            .as_ref()
            .expect_err(&format!("{values} must be refused"));
        for e in *expect {
            assert!(err.contains(e), "{values}: {e:?} not in {err}");
        }
    }
    for (values, result) in good.iter().zip(&results[cases.len()..]) {
        assert!(result.is_ok(), "{values} must render: {result:?}");
    }
}
