//! Configuration: built-in defaults < TOML file < `GPUSHARE_*` environment < command-line flags.
//!
//! The file is `--config PATH`, else `/etc/gpushare/gpushare.toml` when it exists. Environment
//! variables are `GPUSHARE_<SECTION>__<KEY>` (double underscore between section and key, e.g.
//! `GPUSHARE_EXTENDER__PORT=12345`). The upstream knobs keep working and sit just above the
//! defaults: `PORT` (extender.port), `LOG_LEVEL` (log.level), `NODE_NAME`
//! (device_plugin.node_name), `KUBECONFIG` (cluster.kubeconfig).
//!
//! [`Config`] is the validated, typed result; every section denies unknown keys so a typo is an
//! error, not a silently ignored setting. An error names the key, the source it came from and
//! what is allowed; `main` turns it into exit status 78 (EX_CONFIG).
//!
//! `packaging/gpushare.toml` holds every key with its default; a test keeps it in step.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};

use crate::core::{GpuPolicy, MemoryUnit, NodePolicy};

/// Default configuration file, read when it exists and `--config` is not given.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/gpushare/gpushare.toml";
/// Exit status for configuration errors (sysexits EX_CONFIG).
pub const EXIT_CONFIG: u8 = 78;

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Logging.
    pub log: LogConfig,
    /// How to reach the API server.
    pub cluster: ClusterConfig,
    /// `gpushare extender`.
    pub extender: ExtenderConfig,
    /// `gpushare device-plugin`.
    pub device_plugin: DevicePluginConfig,
    /// GPU access (device plugin and doctor).
    pub gpu: GpuConfig,
    /// The preflight run before the server roles.
    pub doctor: DoctorConfig,
    /// Deadlines and caps of every HTTP server (extender, admin endpoints).
    pub http: HttpConfig,
}

/// Log verbosity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Everything.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    #[default]
    Info,
    /// Problems only.
    Warn,
    /// Failures only.
    Error,
}

/// Log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[log]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// trace | debug | info | warn | error (`RUST_LOG`, when set, wins).
    pub level: LogLevel,
    /// text | json.
    pub format: LogFormat,
}

/// `[cluster]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Kubeconfig file; empty means `KUBECONFIG`, then the in-cluster service account.
    pub kubeconfig: String,
}

/// `[extender]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExtenderConfig {
    /// Address to listen on.
    pub bind_address: IpAddr,
    /// Port to listen on (upstream env `PORT`; the upstream manifests use 12345).
    pub port: u16,
    /// URL prefix of the scheduling verbs.
    pub url_prefix: String,
    /// Node scoring in prioritize: binpack | spread.
    pub node_policy: NodePolicy,
    /// GPU choice in bind: binpack (upstream) | spread.
    pub gpu_policy: GpuPolicy,
    /// PEM certificate for HTTPS; empty serves plain HTTP.
    pub tls_cert: String,
    /// PEM private key for HTTPS.
    pub tls_key: String,
    /// Largest request body accepted, in bytes (larger gets 413).
    pub max_body_bytes: u64,
    /// Time budget of one bind including retries, in milliseconds (keep it under the
    /// scheduler's `httpTimeout`).
    pub bind_timeout_ms: u64,
    /// Compete for a Lease; the leader serves the scheduling verbs, the other replicas
    /// forward them to it.
    pub leader_elect: bool,
    /// `HOST[:PORT]` where the other replicas reach this one when it leads; empty means the
    /// `POD_IP` environment variable (else the bind address, when it is not 0.0.0.0) and the
    /// serving port.
    pub advertise_address: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// Namespace of the Lease.
    pub lease_namespace: String,
    /// How long a lease is valid without renewal, in seconds.
    pub lease_duration_secs: u64,
    /// How long the leader keeps trying to renew before it stops serving, in seconds.
    pub renew_deadline_secs: u64,
    /// How often to try to acquire or renew, in seconds.
    pub retry_period_secs: u64,
}

impl Default for ExtenderConfig {
    fn default() -> Self {
        ExtenderConfig {
            bind_address: IpAddr::from([0, 0, 0, 0]),
            port: 39999,
            url_prefix: crate::core::wire::EXTENDER_URL_PREFIX.to_string(),
            node_policy: NodePolicy::Binpack,
            gpu_policy: GpuPolicy::Binpack,
            tls_cert: String::new(),
            tls_key: String::new(),
            max_body_bytes: 32 * 1024 * 1024,
            bind_timeout_ms: 4000,
            leader_elect: false,
            advertise_address: String::new(),
            lease_name: "gpushare-schd-extender".to_string(),
            lease_namespace: "kube-system".to_string(),
            lease_duration_secs: 15,
            renew_deadline_secs: 10,
            retry_period_secs: 2,
        }
    }
}

/// Which GPU index form `NVIDIA_VISIBLE_DEVICES` carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum VisibleDevices {
    /// The NVML index (upstream since DP#50).
    #[default]
    Index,
    /// The GPU UUID.
    Uuid,
}

/// What Allocate answers when no pod matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AllocateFailure {
    /// The upstream `no-gpu-has-<N><unit>-to-run` env (container start fails in the runtime).
    #[default]
    Env,
    /// A gRPC error that explains which pods were considered.
    Error,
}

/// `[device_plugin]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginConfig {
    /// This node's name (upstream env `NODE_NAME`); required.
    pub node_name: String,
    /// kubelet's device-plugin directory.
    pub device_plugin_dir: PathBuf,
    /// kubelet's pod-resources socket (used when it exists).
    pub pod_resources_socket: PathBuf,
    /// GiB | MiB | <n>MiB: the size of one unit of aliyun.com/gpu-mem.
    pub memory_unit: MemoryUnit,
    /// index | uuid.
    pub visible_devices: VisibleDevices,
    /// env | error.
    pub allocate_failure: AllocateFailure,
    /// Watch XID errors and report unhealthy GPUs.
    pub health_check: bool,
    /// Seconds without new errors after which a GPU with a non-fatal XID is healthy again.
    pub health_recovery_secs: u64,
    /// Memory isolation through CUDA MPS.
    pub mps: bool,
    /// MPS pipe directory on the host, mounted into containers in MPS mode.
    pub mps_pipe_dir: PathBuf,
    /// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for MPS clients; 0 leaves it unset.
    pub mps_active_thread_percentage: u8,
    /// Address of /healthz, /readyz and /metrics; empty disables them.
    pub admin_address: String,
}

impl Default for DevicePluginConfig {
    fn default() -> Self {
        DevicePluginConfig {
            node_name: String::new(),
            device_plugin_dir: PathBuf::from(crate::core::wire::DEFAULT_DEVICE_PLUGIN_DIR),
            pod_resources_socket: PathBuf::from(crate::core::wire::DEFAULT_POD_RESOURCES_SOCKET),
            memory_unit: MemoryUnit::GIB,
            visible_devices: VisibleDevices::Index,
            allocate_failure: AllocateFailure::Env,
            health_check: true,
            health_recovery_secs: 300,
            mps: false,
            mps_pipe_dir: PathBuf::from("/tmp/nvidia-mps"),
            mps_active_thread_percentage: 0,
            admin_address: "0.0.0.0:9101".to_string(),
        }
    }
}

/// GPU backend selection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum GpuBackendKind {
    /// nvml where this build can load it, else nvidia-smi.
    #[default]
    Auto,
    /// NVML through libnvidia-ml.so.1 (dynamically linked builds).
    Nvml,
    /// `nvidia-smi -q -x` (the static build).
    NvidiaSmi,
    /// GPUs described by `fake_gpus` (tests, demo, GPU-less clusters).
    Fake,
}

/// `[gpu]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuConfig {
    /// auto | nvml | nvidia-smi | fake.
    pub backend: GpuBackendKind,
    /// Fake GPUs: `2x16GiB`, or a comma list `16GiB,24GiB`, or `GPU-uuid=16GiB,...`.
    pub fake_gpus: String,
    /// Path of libnvidia-ml.so.1; empty uses the loader's search path.
    pub nvml_library: String,
    /// The nvidia-smi program.
    pub nvidia_smi: String,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            backend: GpuBackendKind::Auto,
            fake_gpus: String::new(),
            nvml_library: String::new(),
            nvidia_smi: "nvidia-smi".to_string(),
        }
    }
}

/// `[doctor]`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DoctorConfig {
    /// Do not run the preflight before `extender` / `device-plugin` start.
    pub skip: bool,
}

/// `[http]`: deadlines and caps of every HTTP server gpushare runs (see `http_server`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Request headers must arrive within this (from connect, or from the previous request).
    pub header_read_timeout_ms: u64,
    /// A request body must arrive within this; a slower client gets 408.
    pub body_read_timeout_ms: u64,
    /// A whole request must finish within this; past it the client gets 503. Must exceed
    /// `extender.bind_timeout_ms`.
    pub request_timeout_ms: u64,
    /// Open connections per server at most; more are closed at once (and counted).
    pub max_connections: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            max_connections: 4096,
        }
    }
}

/// A configuration problem: which key, from where, and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file named by `--config` does not exist or cannot be read.
    #[error("configuration file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// A key has a value that is not allowed.
    #[error("invalid configuration: {key} (from {source_name}): {message}")]
    Invalid {
        /// Dotted key, e.g. `extender.port`.
        key: String,
        /// Where the value came from (file path, env var, flag).
        source_name: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

/// Values given as command-line flags, by dotted key; the top layer of the configuration.
#[derive(Clone, Debug, Default)]
pub struct FlagOverrides {
    values: Vec<(String, Value)>,
}

impl FlagOverrides {
    /// No overrides.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (dotted, e.g. `extender.port`) when `value` is `Some`.
    pub fn set<T: Serialize>(&mut self, key: &str, value: Option<T>) -> &mut Self {
        if let Some(v) = value
            && let Ok(v) = Value::serialize(v)
        {
            self.values.push((key.to_string(), v));
        }
        self
    }

    /// Sets `key` to `true` when `flag` is set (for boolean switches).
    pub fn set_flag(&mut self, key: &str, flag: bool) -> &mut Self {
        if flag {
            self.set(key, Some(true));
        }
        self
    }
}

impl Provider for FlagOverrides {
    fn metadata(&self) -> Metadata {
        Metadata::named("command-line flag")
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
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
const SECTIONS: &[&str] = &[
    "log",
    "cluster",
    "extender",
    "device_plugin",
    "gpu",
    "doctor",
];

/// The upstream environment knobs, mapped onto our keys.
fn upstream_env() -> Env {
    Env::raw()
        .filter_map(|key| {
            let mapped = match key.as_str().to_ascii_uppercase().as_str() {
                "PORT" => "extender.port",
                "LOG_LEVEL" => "log.level",
                "NODE_NAME" => "device_plugin.node_name",
                "KUBECONFIG" => "cluster.kubeconfig",
                _ => return None,
            };
            Some(mapped.into())
        })
        .global()
}

/// The layered figment: defaults, file, upstream env, `GPUSHARE_*` env, flags.
///
/// `config_file` is the `--config` value; `None` reads [`DEFAULT_CONFIG_FILE`] if it exists.
pub fn figment(config_file: Option<&Path>, flags: FlagOverrides) -> Result<Figment, Error> {
    let mut fig = Figment::from(Serialized::defaults(Config::default()));
    match config_file {
        Some(path) => {
            if !path.is_file() {
                return Err(Error::File {
                    path: path.to_path_buf(),
                    reason: "no such file".to_string(),
                });
            }
            fig = fig.merge(Toml::file_exact(path));
        }
        None => {
            if Path::new(DEFAULT_CONFIG_FILE).is_file() {
                fig = fig.merge(Toml::file_exact(DEFAULT_CONFIG_FILE));
            }
        }
    }
    Ok(fig
        .merge(upstream_env())
        .merge(
            // Only our sections: other GPUSHARE_* variables (a test harness's, an image's
            // GPUSHARE_VERSION) are not configuration. Unknown keys inside a section still fail.
            Env::prefixed("GPUSHARE_")
                .filter(|key| {
                    let key = key.as_str().to_ascii_lowercase();
                    SECTIONS.iter().any(|s| key.starts_with(&format!("{s}__")))
                })
                .split("__")
                .global(),
        )
        .merge(flags))
}

/// Loads the configuration from the process environment, the file and `flags`.
pub fn load(config_file: Option<&Path>, flags: FlagOverrides) -> Result<Config, Error> {
    Config::from_figment(&figment(config_file, flags)?)
}

impl Config {
    /// Extracts and validates the configuration from any figment (tests pass their own).
    pub fn from_figment(fig: &Figment) -> Result<Config, Error> {
        let config: Config = fig.extract().map_err(|e| describe(fig, e))?;
        config.validate(fig)?;
        Ok(config)
    }

    /// The defaults as TOML (what `packaging/gpushare.toml` must hold).
    pub fn defaults_toml() -> String {
        toml::to_string(&Config::default()).unwrap_or_default()
    }

    fn validate(&self, fig: &Figment) -> Result<(), Error> {
        let invalid = |key: &str, message: String| Error::Invalid {
            key: key.to_string(),
            source_name: source_of(fig, key),
            message,
        };
        let e = &self.extender;
        if !e.url_prefix.starts_with('/') || e.url_prefix.ends_with('/') && e.url_prefix.len() > 1 {
            return Err(invalid(
                "extender.url_prefix",
                format!(
                    "{:?}: must start with '/' and not end with '/'",
                    e.url_prefix
                ),
            ));
        }
        if e.tls_cert.is_empty() != e.tls_key.is_empty() {
            return Err(invalid(
                "extender.tls_cert",
                "tls_cert and tls_key must be given together".to_string(),
            ));
        }
        let h = &self.http;
        for (key, ms) in [
            ("http.header_read_timeout_ms", h.header_read_timeout_ms),
            ("http.body_read_timeout_ms", h.body_read_timeout_ms),
            ("http.request_timeout_ms", h.request_timeout_ms),
        ] {
            if ms == 0 {
                return Err(invalid(key, "must be > 0".to_string()));
            }
        }
        if h.max_connections == 0 {
            return Err(invalid("http.max_connections", "must be > 0".to_string()));
        }
        if h.request_timeout_ms <= e.bind_timeout_ms {
            return Err(invalid(
                "http.request_timeout_ms",
                format!(
                    "{} ms: must exceed extender.bind_timeout_ms ({} ms), or binds would be cut off",
                    h.request_timeout_ms, e.bind_timeout_ms
                ),
            ));
        }
        if e.max_body_bytes < 1024 {
            return Err(invalid(
                "extender.max_body_bytes",
                "must be at least 1024".to_string(),
            ));
        }
        if e.bind_timeout_ms == 0 {
            return Err(invalid(
                "extender.bind_timeout_ms",
                "must be above 0".to_string(),
            ));
        }
        if e.retry_period_secs == 0
            || e.renew_deadline_secs <= e.retry_period_secs
            || e.lease_duration_secs <= e.renew_deadline_secs
        {
            return Err(invalid(
                "extender.lease_duration_secs",
                format!(
                    "need lease_duration_secs ({}) > renew_deadline_secs ({}) > retry_period_secs ({}) > 0",
                    e.lease_duration_secs, e.renew_deadline_secs, e.retry_period_secs
                ),
            ));
        }
        if e.leader_elect {
            let margin_ms = (e.lease_duration_secs - e.renew_deadline_secs).saturating_mul(1000);
            if e.bind_timeout_ms >= margin_ms {
                return Err(invalid(
                    "extender.bind_timeout_ms",
                    format!(
                        "{} ms does not fit inside extender.lease_duration_secs ({}) -                          extender.renew_deadline_secs ({}) = {margin_ms} ms: with leader election a                          bind of a deposed leader could still write after the next leader took over;                          lower bind_timeout_ms or widen the gap between the two",
                        e.bind_timeout_ms, e.lease_duration_secs, e.renew_deadline_secs
                    ),
                ));
            }
        }
        if !e.advertise_address.is_empty()
            && let Err(why) = split_host_port(&e.advertise_address)
        {
            return Err(invalid(
                "extender.advertise_address",
                format!("{:?}: {why}", e.advertise_address),
            ));
        }
        let d = &self.device_plugin;
        if d.mps_active_thread_percentage > 100 {
            return Err(invalid(
                "device_plugin.mps_active_thread_percentage",
                "must be 0 (unset) to 100".to_string(),
            ));
        }
        if !d.admin_address.is_empty() && d.admin_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "device_plugin.admin_address",
                format!("{:?}: expected HOST:PORT or empty", d.admin_address),
            ));
        }
        Ok(())
    }
}

/// Splits `HOST[:PORT]` (an IPv6 host bare or in brackets: `fe80::1`, `[fe80::1]:8080`).
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), String> {
    let bad_port = |p: &str| format!("port {p:?} is not a number from 1 to 65535");
    let port = |p: &str| match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(bad_port(p)),
        Ok(n) => Ok(Some(n)),
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest
            .split_once(']')
            .ok_or_else(|| "an opening '[' without ']'".to_string())?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("{host:?} in brackets is not an IPv6 address"));
        }
        return match tail {
            "" => Ok((host.to_string(), None)),
            t => match t.strip_prefix(':') {
                Some(p) => Ok((host.to_string(), port(p)?)),
                None => Err(format!("unexpected {t:?} after ']'")),
            },
        };
    }
    if s.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok((s.to_string(), None));
    }
    let (host, p) = match s.rsplit_once(':') {
        Some((h, p)) => (h, port(p)?),
        None => (s, None),
    };
    if host.is_empty() || host.contains(['/', ' ', '[', ']', ':', '@']) {
        return Err("expected HOST[:PORT]".to_string());
    }
    Ok((host.to_string(), p))
}

/// Where the value of `key` came from, for error messages.
fn source_of(fig: &Figment, key: &str) -> String {
    match fig.find_metadata(key) {
        Some(md) => describe_metadata(md, key),
        None => "built-in default".to_string(),
    }
}

fn describe_metadata(md: &Metadata, key: &str) -> String {
    let path: Vec<&str> = key.split('.').collect();
    if md.name.contains("GPUSHARE_") {
        return format!(
            "environment variable GPUSHARE_{}",
            path.join("__").to_ascii_uppercase()
        );
    }
    if md.name.contains("environment") {
        let var = match key {
            "extender.port" => "PORT",
            "log.level" => "LOG_LEVEL",
            "device_plugin.node_name" => "NODE_NAME",
            "cluster.kubeconfig" => "KUBECONFIG",
            other => other,
        };
        return format!("environment variable {var}");
    }
    match &md.source {
        Some(figment::Source::File(p)) => format!("file {}", p.display()),
        _ if md.name.contains("flag") => {
            format!("flag --{}", path.last().unwrap_or(&key).replace('_', "-"))
        }
        _ => md.name.to_string(),
    }
}

fn describe(fig: &Figment, err: figment::Error) -> Error {
    let key = err
        .path
        .iter()
        .filter(|p| p.as_str() != "default" && p.as_str() != "global")
        .cloned()
        .collect::<Vec<_>>()
        .join(".");
    let source_name = match &err.metadata {
        Some(md) => describe_metadata(md, &key),
        None => source_of(fig, &key),
    };
    let message = err.kind.to_string();
    Error::Invalid {
        key: if key.is_empty() {
            "(file)".to_string()
        } else {
            key
        },
        source_name,
        message,
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;

    fn from_toml(toml: &str) -> Result<Config, Error> {
        Config::from_figment(
            &Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml)),
        )
    }

    #[test]
    fn defaults_validate() {
        assert_eq!(from_toml("").unwrap(), Config::default());
    }

    #[test]
    fn the_packaged_example_holds_every_key_with_its_default() {
        let text = include_str!("../packaging/gpushare.toml");
        let from_file: Config = Figment::from(Toml::string(text)).extract().unwrap();
        assert_eq!(from_file, Config::default());
        // Every key of the defaults appears in the file (not merely defaulted by serde).
        let file: toml::Value = toml::from_str(text).unwrap();
        let defaults: toml::Value = toml::from_str(&Config::defaults_toml()).unwrap();
        let (toml::Value::Table(file), toml::Value::Table(defaults)) = (file, defaults) else {
            panic!("not tables")
        };
        for (section, keys) in defaults {
            let toml::Value::Table(keys) = keys else {
                continue;
            };
            for key in keys.keys() {
                let present = file
                    .get(&section)
                    .and_then(|s| s.as_table())
                    .is_some_and(|s| s.contains_key(key));
                assert!(present, "packaging/gpushare.toml lacks {section}.{key}");
            }
        }
    }

    #[test]
    fn errors_name_key_source_and_what_is_allowed() {
        let err = from_toml("[extender]\ngpu_policy = \"random\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.gpu_policy"), "{err}");
        assert!(err.contains("binpack") && err.contains("spread"), "{err}");
        let err = from_toml("[extender]\nport = 70000\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.port"), "{err}");
        let err = from_toml("[extender]\nprot = 1\n").unwrap_err().to_string();
        assert!(err.contains("prot"), "{err}");
        let err = from_toml("[device_plugin]\nmemory_unit = \"KiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device_plugin.memory_unit") && err.contains("GiB"),
            "{err}"
        );
        let err = from_toml("[extender]\nurl_prefix = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.url_prefix"), "{err}");
    }

    #[test]
    fn a_bind_timeout_outside_the_lease_margin_is_an_error_naming_the_keys() {
        let err = from_toml("[extender]\nleader_elect = true\nbind_timeout_ms = 5000\n")
            .unwrap_err()
            .to_string();
        for key in [
            "extender.bind_timeout_ms",
            "extender.lease_duration_secs",
            "extender.renew_deadline_secs",
        ] {
            assert!(err.contains(key), "{err}");
        }
        assert!(from_toml("[extender]\nleader_elect = true\nbind_timeout_ms = 4999\n").is_ok());
        // Without an election there is no lease to fit into.
        assert!(from_toml("[extender]\nbind_timeout_ms = 9000\n").is_ok());
    }

    #[test]
    fn advertise_addresses_are_host_and_optional_port() {
        let ok = |s: &str| split_host_port(s).unwrap();
        assert_eq!(ok("10.0.0.7"), ("10.0.0.7".into(), None));
        assert_eq!(ok("10.0.0.7:12345"), ("10.0.0.7".into(), Some(12345)));
        assert_eq!(ok("cp-1.example"), ("cp-1.example".into(), None));
        assert_eq!(ok("fe80::1"), ("fe80::1".into(), None));
        assert_eq!(ok("[fe80::1]:80"), ("fe80::1".into(), Some(80)));
        for bad in [
            "", ":80", "h:0", "h:x", "[x]:1", "[fe80::1", "http://h", "h:99999",
        ] {
            assert!(split_host_port(bad).is_err(), "{bad}");
        }
        let err = from_toml("[extender]\nadvertise_address = \"a b\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.advertise_address"), "{err}");
    }

    #[test]
    fn layers_apply_in_order_and_sources_are_named() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "gpushare.toml",
                "[extender]\nport = 1000\n[log]\nlevel = \"warn\"\n",
            )?;
            jail.set_env("PORT", "2000");
            jail.set_env("LOG_LEVEL", "debug");
            // The file is lower than the upstream env knobs.
            let cfg = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.extender.port, 2000);
            assert_eq!(cfg.log.level, LogLevel::Debug);
            jail.set_env("GPUSHARE_EXTENDER__PORT", "3000");
            let cfg = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.extender.port, 3000);
            let mut flags = FlagOverrides::new();
            flags.set("extender.port", Some(4000u16));
            let cfg = load(Some(Path::new("gpushare.toml")), flags).unwrap();
            assert_eq!(cfg.extender.port, 4000);
            // Variables outside our sections are not configuration; typos inside one are.
            jail.set_env("GPUSHARE_UPDATE_GOLDEN", "1");
            load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            jail.set_env("GPUSHARE_EXTENDER__PROT", "1");
            let err = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap_err();
            assert!(err.to_string().contains("prot"), "{err}");
            jail.clear_env();
            jail.set_env("GPUSHARE_EXTENDER__PORT", "lots");
            let err = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("GPUSHARE_EXTENDER__PORT"), "{text}");
            jail.set_env("GPUSHARE_EXTENDER__PORT", "3000");
            let mut flags = FlagOverrides::new();
            flags.set("extender.url_prefix", Some("nope"));
            let err = load(Some(Path::new("gpushare.toml")), flags)
                .unwrap_err()
                .to_string();
            assert!(err.contains("flag --url-prefix"), "{err}");
            assert!(matches!(
                load(Some(Path::new("missing.toml")), FlagOverrides::new()),
                Err(Error::File { .. })
            ));
            Ok(())
        });
    }

    #[test]
    fn upstream_knobs_map_onto_our_keys() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("NODE_NAME", "gpu-node-1");
            jail.set_env("KUBECONFIG", "/etc/kubernetes/kubelet.conf");
            let cfg = load(None, FlagOverrides::new()).unwrap();
            assert_eq!(cfg.device_plugin.node_name, "gpu-node-1");
            assert_eq!(cfg.cluster.kubeconfig, "/etc/kubernetes/kubelet.conf");
            Ok(())
        });
    }
}
