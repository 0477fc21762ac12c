//! The layers of the configuration and how each is read: the file (`--config`, else
//! [`DEFAULT_CONFIG_FILE`]; TOML, or JSON by its `.json` name), the upstream environment
//! knobs, `GPUSHARE_<SECTION>__<KEY>`, and the command-line flags ([`FlagOverrides`]); the old
//! `device_plugin.<key>` spellings of [`NODE_KEYS`] read as `node.<key>` in each layer
//! ([`DeprecatedKey`]). Extraction and checks are [`super::Config`]'s.

use std::path::Path;

use figment::providers::{Data, Env, Format, Json, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Serialize;

use super::error::Error;
use super::node::NODE_KEYS;

/// Default configuration file, read when it exists and `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/gpushare/gpushare.toml";

/// Values given as command-line flags, by dotted key; the top layer of the configuration.
#[derive(Clone, Debug, Default)]
pub struct FlagOverrides {
    values: Vec<(String, Value)>,
    /// Why a struct of flags could not be read (a path that is no UTF-8), reported by `data`.
    unreadable: Option<String>,
}

impl FlagOverrides {
    /// No overrides.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (dotted, e.g. `extender.port`) when `value` is `Some` (one value by hand;
    /// a role's flags go through [`FlagOverrides::args`]).
    pub fn set<T: Serialize>(&mut self, key: &str, value: Option<T>) -> &mut Self {
        if let Some(v) = value
            && let Ok(v) = Value::serialize(v)
        {
            self.values.push((key.to_string(), v));
        }
        self
    }

    /// Sets every flag of `args`, a clap struct deriving `Serialize`, where the flag names its
    /// key: a field's value goes to `<section>.<field>`, or to the dotted key its
    /// `#[serde(rename = "doctor.skip")]` names; a flag not given (`None`, an empty list, a
    /// switch left off: `skip_serializing_if = "std::ops::Not::not"`) sets nothing. Fields that
    /// are no setting are `#[serde(skip)]`.
    pub fn args<T: Serialize>(&mut self, section: &str, args: &T) -> &mut Self {
        match Value::serialize(args) {
            Ok(Value::Dict(_, fields)) => {
                for (field, value) in fields {
                    let given = match &value {
                        Value::Empty(..) => false,
                        Value::Array(_, items) => !items.is_empty(),
                        _ => true,
                    };
                    if given {
                        let key = match field.contains('.') {
                            true => field,
                            false => format!("{section}.{field}"),
                        };
                        self.values.push((key, value));
                    }
                }
            }
            Ok(_) => {}
            Err(e) => self.unreadable = Some(e.to_string()),
        }
        self
    }
}

impl Provider for FlagOverrides {
    fn metadata(&self) -> Metadata {
        Metadata::named("command-line flag")
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        if let Some(why) = &self.unreadable {
            return Err(figment::Error::from(format!(
                "a flag cannot be read: {why}"
            )));
        }
        let mut root = Dict::new();
        for (key, value) in &self.values {
            insert_dotted(&mut root, key, value.clone());
        }
        Ok(Map::from([(Profile::Global, root)]))
    }
}

fn insert_dotted(dict: &mut Dict, key: &str, value: Value) {
    match key.split_once('.') {
        None => {
            dict.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let entry = dict
                .entry(head.to_string())
                .or_insert_with(|| Value::from(Dict::new()));
            if let Value::Dict(_, inner) = entry {
                insert_dotted(inner, rest, value);
            }
        }
    }
}

/// The configuration sections, as spelled in the file and in `GPUSHARE_<SECTION>__<KEY>`.
pub(super) const SECTIONS: &[&str] = &[
    "log",
    "cluster",
    "extender",
    "device_plugin",
    "node",
    "gpu",
    "doctor",
    "http",
    "webhook",
    "devices",
    "dra",
];

/// The upstream environment knobs, mapped onto our keys.
pub(super) fn upstream_env() -> Env {
    Env::raw()
        .filter_map(|key| {
            let mapped = match key.as_str().to_ascii_uppercase().as_str() {
                "PORT" => "extender.port",
                "LOG_LEVEL" => "log.level",
                "NODE_NAME" => "node.node_name",
                "KUBECONFIG" => "cluster.kubeconfig",
                _ => return None,
            };
            Some(mapped.into())
        })
        .global()
}

/// A configuration layer whose `device_plugin.<key>` for a [`NODE_KEYS`] key is read as
/// `node.<key>`; where the same layer sets both, `node.<key>` wins. Layers keep their order
/// (a flag beats the environment beats the file, whichever name each uses).
pub(super) struct NodeAliases<P>(pub(super) P);

impl<P: Provider> Provider for NodeAliases<P> {
    fn metadata(&self) -> Metadata {
        self.0.metadata()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut data = self.0.data()?;
        for dict in data.values_mut() {
            move_node_keys(dict);
        }
        Ok(data)
    }

    fn profile(&self) -> Option<Profile> {
        self.0.profile()
    }
}

/// The [`NODE_KEYS`] this layer's `[device_plugin]` sets.
fn old_node_keys(dict: &Dict) -> Vec<&'static str> {
    match dict.get("device_plugin") {
        Some(Value::Dict(_, dp)) => NODE_KEYS
            .iter()
            .copied()
            .filter(|k| dp.contains_key(*k))
            .collect(),
        _ => Vec::new(),
    }
}

fn move_node_keys(dict: &mut Dict) {
    let mut moved = Vec::new();
    if let Some(Value::Dict(_, dp)) = dict.get_mut("device_plugin") {
        for key in NODE_KEYS {
            if let Some(v) = dp.remove(*key) {
                moved.push((*key, v));
            }
        }
    }
    if moved.is_empty() {
        return;
    }
    let node = dict
        .entry("node".to_string())
        .or_insert_with(|| Value::from(Dict::new()));
    if let Value::Dict(_, node) = node {
        for (key, value) in moved {
            node.entry(key.to_string()).or_insert(value);
        }
    }
}

/// A key spelled the old way (`device_plugin.<key>` of a [`NODE_KEYS`] key): still applied,
/// named by `gpushare doctor` with its new name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeprecatedKey {
    /// The old spelling as written (`device_plugin.mps`, `GPUSHARE_DEVICE_PLUGIN__MPS`).
    pub old: String,
    /// The new spelling (`node.mps`, `GPUSHARE_NODE__MPS`).
    pub new: String,
    /// Where it was written (`file /etc/gpushare/gpushare.toml`, `the environment`).
    pub source: String,
}

impl std::fmt::Display for DeprecatedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}) is deprecated: use {}",
            self.old, self.source, self.new
        )
    }
}

/// The configuration file as a layer: TOML, or JSON when its name ends in `.json` (what the
/// Helm chart writes: `toJson` of its `config` value).
pub(super) enum FileLayer {
    /// A TOML file (any name but `*.json`).
    Toml(Data<Toml>),
    /// A `*.json` file.
    Json(Data<Json>),
}

impl FileLayer {
    fn of(path: &Path) -> FileLayer {
        let json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        if json {
            FileLayer::Json(Json::file_exact(path))
        } else {
            FileLayer::Toml(Toml::file_exact(path))
        }
    }
}

impl Provider for FileLayer {
    fn metadata(&self) -> Metadata {
        match self {
            FileLayer::Toml(p) => p.metadata(),
            FileLayer::Json(p) => p.metadata(),
        }
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        match self {
            FileLayer::Toml(p) => p.data(),
            FileLayer::Json(p) => p.data(),
        }
    }

    fn profile(&self) -> Option<Profile> {
        match self {
            FileLayer::Toml(p) => p.profile(),
            FileLayer::Json(p) => p.profile(),
        }
    }
}

/// The configuration file read: `--config`, else [`DEFAULT_CONFIG_FILE`] if it exists.
pub(super) fn file_layer(config_file: Option<&Path>) -> Result<Option<FileLayer>, Error> {
    match config_file {
        Some(path) => {
            if !path.is_file() {
                return Err(Error::File {
                    path: path.to_path_buf(),
                    reason: "no such file".to_string(),
                });
            }
            Ok(Some(FileLayer::of(path)))
        }
        None if Path::new(DEFAULT_CONFIG_FILE).is_file() => {
            Ok(Some(FileLayer::of(Path::new(DEFAULT_CONFIG_FILE))))
        }
        None => Ok(None),
    }
}

/// The `GPUSHARE_<SECTION>__<KEY>` layer.
pub(super) fn gpushare_env() -> Env {
    // Only our sections: other GPUSHARE_* variables (a test harness's, an image's
    // GPUSHARE_VERSION) are not configuration. Unknown keys inside a section still fail.
    Env::prefixed("GPUSHARE_")
        .filter(|key| {
            let key = key.as_str().to_ascii_lowercase();
            SECTIONS.iter().any(|s| key.starts_with(&format!("{s}__")))
        })
        .split("__")
        .global()
}

/// The old spellings of [`NODE_KEYS`] in the configuration file and the `GPUSHARE_*`
/// environment (flags keep their names, so they have none).
pub fn deprecated_keys(config_file: Option<&Path>) -> Vec<DeprecatedKey> {
    let mut out = Vec::new();
    let dicts = |data: Result<Map<Profile, Dict>, figment::Error>| -> Vec<Dict> {
        data.map(|m| m.into_values().collect()).unwrap_or_default()
    };
    if let Ok(Some(file)) = file_layer(config_file) {
        let source = match file.metadata().source {
            Some(figment::Source::File(p)) => format!("file {}", p.display()),
            _ => "the configuration file".to_string(),
        };
        for dict in dicts(file.data()) {
            for key in old_node_keys(&dict) {
                out.push(DeprecatedKey {
                    old: format!("device_plugin.{key}"),
                    new: format!("node.{key}"),
                    source: source.clone(),
                });
            }
        }
    }
    for dict in dicts(gpushare_env().data()) {
        for key in old_node_keys(&dict) {
            let upper = key.to_ascii_uppercase();
            out.push(DeprecatedKey {
                old: format!("GPUSHARE_DEVICE_PLUGIN__{upper}"),
                new: format!("GPUSHARE_NODE__{upper}"),
                source: "the environment".to_string(),
            });
        }
    }
    out
}

/// The layers above `defaults`: file, upstream env, `GPUSHARE_*` env, flags.
///
/// `config_file` is the `--config` value; `None` reads [`DEFAULT_CONFIG_FILE`] if it exists.
pub fn layered(
    defaults: Figment,
    config_file: Option<&Path>,
    flags: FlagOverrides,
) -> Result<Figment, Error> {
    let mut fig = defaults;
    if let Some(file) = file_layer(config_file)? {
        fig = fig.merge(NodeAliases(file));
    }
    Ok(fig
        .merge(upstream_env())
        .merge(NodeAliases(gpushare_env()))
        .merge(NodeAliases(flags)))
}
