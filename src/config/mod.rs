//! Configuration: built-in defaults < TOML file < `GPUSHARE_*` environment < command-line flags.
//!
//! The file is `--config PATH`, else `/etc/gpushare/gpushare.toml` when it exists; a file whose
//! name ends in `.json` is read as JSON (what the Helm chart hands over). Environment
//! variables are `GPUSHARE_<SECTION>__<KEY>` (double underscore between section and key, e.g.
//! `GPUSHARE_EXTENDER__PORT=12345`). The upstream knobs keep working and sit just above the
//! defaults: `PORT` (extender.port), `LOG_LEVEL` (log.level), `NODE_NAME`
//! (device_plugin.node_name), `KUBECONFIG` (cluster.kubeconfig).
//!
//! [`Config`] is the validated, typed result; every section denies unknown keys so a typo is an
//! error, not a silently ignored setting. An error names the key, the source it came from and
//! what is allowed; `main` turns it into exit status 78 (EX_CONFIG).
//!
//! One file per section, each with its own `validate` ([`extender`], [`node`],
//! [`device_plugin`], [`dra`], [`webhook`], [`http`], [`devices`]; [`log`], [`cluster`],
//! [`gpu`] and [`doctor`] have nothing to check beyond their types); [`load`] reads the layers,
//! [`error`] names the source of a bad value. A role checks only the sections it runs
//! ([`Section`], [`load_for`]); the checks that span two sections are here, explicit.
//!
//! `packaging/gpushare.toml` holds every key with its default; a test keeps it in step.

use std::path::Path;

use figment::Figment;
use figment::providers::Serialized;
use serde::{Deserialize, Serialize};

pub mod cluster;
pub mod device_plugin;
pub mod devices;
pub mod doctor;
pub mod dra;
pub mod enforcement;
pub mod error;
pub mod extender;
pub mod gpu;
pub mod http;
pub mod load;
pub mod log;
pub mod node;
pub mod webhook;

pub use cluster::ClusterConfig;
pub use device_plugin::{AllocateFailure, DevicePluginConfig};
pub use doctor::DoctorConfig;
pub use dra::{
    DEFAULT_DRA_CDI_DIR, DEFAULT_DRA_PLUGINS_DIR, DEFAULT_DRA_REGISTRY_DIR, DEFAULT_DRA_STATE_DIR,
    DraConfig,
};
pub use error::{Check, Error};
pub use extender::{ExtenderConfig, HostPortError, split_host_port};
pub use gpu::{DEFAULT_KMSG, GpuBackendKind, GpuConfig};
pub use http::HttpConfig;
pub use load::{DEFAULT_CONFIG_FILE, DeprecatedKey, FlagOverrides, deprecated_keys};
pub use log::{LogConfig, LogFormat, LogLevel};
pub use node::{
    DEFAULT_CDI_ANNOTATION_PREFIX, DEFAULT_CDI_KIND, DEFAULT_CDI_SPEC_DIRS, DEFAULT_GPU_LOCK_DIR,
    DEFAULT_LIMITER_DIR, DEFAULT_LIMITER_LIBRARY, DEFAULT_LIMITER_RUN_DIR, DeviceIdStrategy,
    DeviceListStrategies, DeviceListStrategy, NODE_KEYS, NodeConfig, UnknownStrategy,
    VisibleDevices, valid_cdi_kind,
};
pub use webhook::{GpuMemPath, WebhookConfig};

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
    /// `gpushare device-plugin` (the kubelet protocol).
    pub device_plugin: DevicePluginConfig,
    /// The GPU node agent: node name, memory unit, hand-over, health, MPS.
    pub node: NodeConfig,
    /// GPU access (device plugin and doctor).
    pub gpu: GpuConfig,
    /// The preflight run before the server roles.
    pub doctor: DoctorConfig,
    /// Deadlines and caps of every HTTP server (extender, admin endpoints).
    pub http: HttpConfig,
    /// `gpushare webhook`.
    pub webhook: WebhookConfig,
    /// Device kinds beside the GPU: RDMA HCAs and generic devices (`[devices]`).
    pub devices: devices::DevicesConfig,
    /// `gpushare dra-plugin` (the DRA kubelet plugin).
    pub dra: DraConfig,
    /// Keys this configuration was given under their old names (not a key itself).
    #[serde(skip)]
    pub deprecated: Vec<DeprecatedKey>,
}

/// A section of the configuration, as a role runs it: a role checks only its sections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// `[extender]`
    Extender,
    /// `[http]`
    Http,
    /// `[devices]`
    Devices,
    /// `[webhook]`
    Webhook,
    /// `[node]`
    Node,
    /// `[device_plugin]`
    DevicePlugin,
    /// `[dra]`
    Dra,
}

impl Section {
    /// Every section with checks, in the order they are checked.
    pub const ALL: &[Section] = &[
        Section::Extender,
        Section::Http,
        Section::Devices,
        Section::Webhook,
        Section::Node,
        Section::DevicePlugin,
        Section::Dra,
    ];
}

/// The layered figment: defaults, file, upstream env, `GPUSHARE_*` env, flags.
///
/// `config_file` is the `--config` value; `None` reads [`DEFAULT_CONFIG_FILE`] if it exists.
pub fn figment(config_file: Option<&Path>, flags: FlagOverrides) -> Result<Figment, Error> {
    load::layered(
        Figment::from(Serialized::defaults(Config::default())),
        config_file,
        flags,
    )
}

/// Loads the configuration from the process environment, the file and `flags`, checking
/// every section.
pub fn load(config_file: Option<&Path>, flags: FlagOverrides) -> Result<Config, Error> {
    load_for(config_file, flags, Section::ALL)
}

/// As [`load`], checking only `sections` (those of the role that runs): a section a role does
/// not run cannot stop it.
pub fn load_for(
    config_file: Option<&Path>,
    flags: FlagOverrides,
    sections: &[Section],
) -> Result<Config, Error> {
    let mut config = Config::from_figment_for(&figment(config_file, flags)?, sections)?;
    config.deprecated = deprecated_keys(config_file);
    Ok(config)
}

impl Config {
    /// Extracts and validates the configuration from any figment (tests pass their own).
    pub fn from_figment(fig: &Figment) -> Result<Config, Error> {
        Config::from_figment_for(fig, Section::ALL)
    }

    /// As [`Config::from_figment`], checking only `sections`.
    pub fn from_figment_for(fig: &Figment, sections: &[Section]) -> Result<Config, Error> {
        let mut config: Config = fig.extract().map_err(|e| error::describe(fig, e))?;
        if let Some(id) = config.node.device_id_strategy {
            config.node.visible_devices = id;
        }
        config.validate(&Check(fig), sections)?;
        Ok(config)
    }

    /// The defaults as TOML (what `packaging/gpushare.toml` must hold).
    pub fn defaults_toml() -> String {
        toml::to_string(&Config::default()).unwrap_or_default()
    }

    /// Checks `sections`, each by its own `validate`, then the checks across sections whose
    /// sections are all among them.
    fn validate(&self, check: &Check<'_>, sections: &[Section]) -> Result<(), Error> {
        for section in sections {
            match section {
                Section::Extender => self.extender.validate(check)?,
                Section::Http => self.http.validate(check)?,
                Section::Devices => self.devices.validate()?,
                Section::Webhook => self.webhook.validate(check)?,
                Section::Node => self.node.validate(check)?,
                Section::DevicePlugin => self.device_plugin.validate(check)?,
                Section::Dra => self.dra.validate(check)?,
            }
        }
        if sections.contains(&Section::Extender) && sections.contains(&Section::Http) {
            self.binds_fit_the_request_timeout(check)?;
        }
        Ok(())
    }

    /// `[http]` against `[extender]`: a request must outlive the bind it carries.
    fn binds_fit_the_request_timeout(&self, check: &Check<'_>) -> Result<(), Error> {
        let (h, e) = (&self.http, &self.extender);
        if h.request_timeout_ms <= e.bind_timeout_ms {
            return Err(check.invalid(
                "http.request_timeout_ms",
                format!(
                    "{} ms: must exceed extender.bind_timeout_ms ({} ms), or binds would be cut off",
                    h.request_timeout_ms, e.bind_timeout_ms
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)]
mod tests {
    use figment::providers::{Format, Toml};

    use std::path::PathBuf;

    use super::load::{NodeAliases, SECTIONS};
    use super::*;
    use crate::core::MemoryUnit;

    #[test]
    fn every_section_can_be_set_from_the_environment() {
        let config = serde_json::to_value(Config::default()).expect("serializes");
        let mut sections: Vec<&str> = config
            .as_object()
            .expect("a table")
            .keys()
            .map(String::as_str)
            .collect();
        sections.sort_unstable();
        let mut listed = SECTIONS.to_vec();
        listed.sort_unstable();
        assert_eq!(
            sections, listed,
            "SECTIONS must name every [section] of Config"
        );
        figment::Jail::expect_with(|jail| {
            jail.set_env("GPUSHARE_HTTP__MAX_CONNECTIONS", "77");
            let cfg = load(None, FlagOverrides::new()).unwrap();
            assert_eq!(cfg.http.max_connections, 77);
            Ok(())
        });
    }

    fn from_toml(toml: &str) -> Result<Config, Error> {
        Config::from_figment(
            &Figment::from(Serialized::defaults(Config::default()))
                .merge(NodeAliases(Toml::string(toml))),
        )
    }

    #[test]
    fn defaults_validate() {
        assert_eq!(from_toml("").unwrap(), Config::default());
    }

    #[test]
    fn the_packaged_example_holds_every_key_with_its_default() {
        let text = include_str!("../../packaging/gpushare.toml");
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
            err.contains("node.memory_unit") && err.contains("GiB"),
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
    fn a_client_ca_needs_https() {
        let err = from_toml("[extender]\ntls_client_ca = \"/ca.crt\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("extender.tls_client_ca"), "{err}");
        assert!(
            from_toml(
                "[extender]\ntls_cert = \"/t.crt\"\ntls_key = \"/t.key\"\ntls_client_ca = \"/ca.crt\"\n"
            )
            .is_ok()
        );
        let c = from_toml("[cluster]\napi_wait_secs = 0\n").expect("0 is allowed");
        assert_eq!(c.cluster.api_wait_secs, 0);
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
            assert_eq!(cfg.node.node_name, "gpu-node-1");
            assert_eq!(cfg.cluster.kubeconfig, "/etc/kubernetes/kubelet.conf");
            Ok(())
        });
    }

    #[test]
    fn device_list_strategies_from_env_file_and_flags() {
        figment::Jail::expect_with(|jail| {
            jail.set_env(
                "GPUSHARE_DEVICE_PLUGIN__DEVICE_LIST_STRATEGY",
                "cdi-cri, envvar,cdi-cri",
            );
            jail.set_env("GPUSHARE_DEVICE_PLUGIN__CDI_SPEC_DIRS", "/run/cdi");
            let cfg = load(None, FlagOverrides::new()).unwrap();
            let d = &cfg.node;
            assert_eq!(d.device_list_strategy.to_string(), "envvar,cdi-cri");
            assert!(d.device_list_strategy.any_cdi() && !d.device_list_strategy.only_cdi());
            assert_eq!(d.cdi_spec_dirs, [PathBuf::from("/run/cdi")]);
            Ok(())
        });
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "g.toml",
                "[device_plugin]\ndevice_list_strategy = [\"cdi-annotations\"]\ndevice_id_strategy = \"uuid\"\n",
            )?;
            let cfg = load(Some(Path::new("g.toml")), FlagOverrides::new()).unwrap();
            assert!(cfg.node.device_list_strategy.only_cdi());
            assert_eq!(cfg.node.visible_devices, VisibleDevices::Uuid);
            for (key, value, what) in [
                ("device_list_strategy", "cdi", "expected envvar"),
                ("device_list_strategy", "", "at least one"),
                ("cdi_kind", "nvidia", "<vendor>/<class>"),
                ("cdi_annotation_prefix", "cdi.k8s.io", "ending with '/'"),
            ] {
                let mut flags = FlagOverrides::new();
                flags.set(&format!("device_plugin.{key}"), Some(value));
                let err = load(None, flags).expect_err(key).to_string();
                assert!(err.contains(what), "{key}={value:?}: {err}");
            }
            Ok(())
        });
    }

    #[test]
    fn old_device_plugin_keys_are_aliases_of_node_keys_by_layer() {
        figment::Jail::expect_with(|jail| {
            // The old name alone, in the file: applied, and named as deprecated.
            jail.create_file(
                "old.toml",
                "[device_plugin]\nmemory_unit = \"MiB\"\nmps = true\nadmin_address = \"\"\n",
            )?;
            let cfg = load(Some(Path::new("old.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit, MemoryUnit::MIB);
            assert!(cfg.node.mps);
            assert_eq!(cfg.device_plugin.admin_address, "");
            let old: Vec<&str> = cfg.deprecated.iter().map(|d| d.old.as_str()).collect();
            assert_eq!(old, ["device_plugin.memory_unit", "device_plugin.mps"]);
            assert_eq!(cfg.deprecated[0].new, "node.memory_unit");
            assert!(
                cfg.deprecated[0].source.contains("old.toml"),
                "{:?}",
                cfg.deprecated
            );
            // Both names in one layer: the new one wins.
            jail.create_file(
                "both.toml",
                "[device_plugin]\nmemory_unit = \"MiB\"\n[node]\nmemory_unit = \"256MiB\"\n",
            )?;
            let cfg = load(Some(Path::new("both.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit.mib(), 256);
            // A higher layer wins whatever name it uses: the old env name over the new file key.
            jail.create_file("new.toml", "[node]\nmemory_unit = \"256MiB\"\n")?;
            jail.set_env("GPUSHARE_DEVICE_PLUGIN__MEMORY_UNIT", "512MiB");
            let cfg = load(Some(Path::new("new.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit.mib(), 512);
            assert_eq!(cfg.deprecated.len(), 1);
            assert_eq!(cfg.deprecated[0].new, "GPUSHARE_NODE__MEMORY_UNIT");
            // ... and the new env name beats the old one in the same layer.
            jail.set_env("GPUSHARE_NODE__MEMORY_UNIT", "2GiB");
            let cfg = load(Some(Path::new("new.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(cfg.node.memory_unit.mib(), 2048);
            // A flag, under either name, beats both.
            let mut flags = FlagOverrides::new();
            flags.set("device_plugin.memory_unit", Some("GiB"));
            let cfg = load(Some(Path::new("new.toml")), flags).unwrap();
            assert_eq!(cfg.node.memory_unit, MemoryUnit::GIB);
            // The new names name no deprecation; NODE_NAME still sets the node's name.
            jail.clear_env();
            jail.set_env("NODE_NAME", "n1");
            let cfg = load(Some(Path::new("new.toml")), FlagOverrides::new()).unwrap();
            assert!(cfg.deprecated.is_empty(), "{:?}", cfg.deprecated);
            assert_eq!(cfg.node.node_name, "n1");
            // An invalid value under the old name is reported under the new key.
            jail.create_file("bad.toml", "[device_plugin]\ncdi_kind = \"nvidia\"\n")?;
            let err = load(Some(Path::new("bad.toml")), FlagOverrides::new())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("node.cdi_kind") && err.contains("bad.toml"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn a_json_file_is_read_as_json_with_the_keys_of_the_toml_file() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "gpushare.json",
                r#"{"extender": {"port": 4242, "bind_timeout_ms": 3000}, "http": {}}"#,
            )?;
            jail.create_file(
                "gpushare.toml",
                "[extender]\nport = 4242\nbind_timeout_ms = 3000\n",
            )?;
            let json = load(Some(Path::new("gpushare.json")), FlagOverrides::new()).unwrap();
            let toml = load(Some(Path::new("gpushare.toml")), FlagOverrides::new()).unwrap();
            assert_eq!(json.extender.port, 4242);
            assert_eq!(json, toml);
            jail.create_file("bad.json", r#"{"extender": {"bind_timeout_ms": 0}}"#)?;
            let err = load(Some(Path::new("bad.json")), FlagOverrides::new())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("extender.bind_timeout_ms") && err.contains("bad.json"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn a_role_is_checked_only_for_the_sections_it_runs() {
        let fig = Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(
            "[webhook]\nmax_gpu_mem = 0\n[http]\nrequest_timeout_ms = 1\n",
        ));
        // Every section (doctor): the first refusal, the webhook's.
        let err = Config::from_figment(&fig).unwrap_err().to_string();
        assert!(err.contains("webhook.max_gpu_mem"), "{err}");
        let err = Config::from_figment_for(&fig, &[Section::Webhook])
            .unwrap_err()
            .to_string();
        assert!(err.contains("webhook.max_gpu_mem"), "{err}");
        // The extender with its HTTP servers: the cross-section check, not the webhook's.
        let err = Config::from_figment_for(&fig, &[Section::Extender, Section::Http])
            .unwrap_err()
            .to_string();
        assert!(err.contains("http.request_timeout_ms"), "{err}");
        // Neither the extender nor the webhook: nothing of theirs stops the role.
        let cfg = Config::from_figment_for(&fig, &[Section::Node, Section::Dra]).unwrap();
        assert_eq!(cfg.webhook.max_gpu_mem, 0);
        assert_eq!(cfg.http.request_timeout_ms, 1);
    }

    #[test]
    fn flags_name_their_keys_by_field_and_set_only_what_was_given() {
        #[derive(serde::Serialize)]
        struct Args {
            bind_address: Option<std::net::IpAddr>,
            port: Option<u16>,
            url_prefix: Option<String>,
            leader_elect: Option<bool>,
            #[serde(rename = "node.cdi_spec_dirs")]
            dirs: Vec<PathBuf>,
            #[serde(rename = "doctor.skip", skip_serializing_if = "std::ops::Not::not")]
            skip_doctor: bool,
            #[serde(rename = "node.device_list_strategy")]
            strategies: Vec<DeviceListStrategy>,
            #[serde(skip)]
            _not_a_setting: bool,
        }
        let given = Args {
            bind_address: Some("127.0.0.1".parse().unwrap()),
            port: None,
            url_prefix: Some("/x".to_string()),
            leader_elect: Some(false),
            dirs: vec![PathBuf::from("/run/cdi")],
            skip_doctor: true,
            strategies: vec![DeviceListStrategy::CdiCri, DeviceListStrategy::Envvar],
            _not_a_setting: true,
        };
        let mut flags = FlagOverrides::new();
        flags.args("extender", &given);
        let cfg = Config::from_figment(
            &Figment::from(Serialized::defaults(Config::default())).merge(flags),
        )
        .unwrap();
        assert_eq!(cfg.extender.bind_address.to_string(), "127.0.0.1");
        assert_eq!(cfg.extender.port, Config::default().extender.port);
        assert_eq!(cfg.extender.url_prefix, "/x");
        assert!(!cfg.extender.leader_elect);
        assert_eq!(cfg.node.cdi_spec_dirs, [PathBuf::from("/run/cdi")]);
        assert!(cfg.doctor.skip);
        assert_eq!(cfg.node.device_list_strategy.to_string(), "envvar,cdi-cri");
        // Left off: nothing set, the layers below show through.
        let mut flags = FlagOverrides::new();
        flags.args(
            "extender",
            &Args {
                bind_address: None,
                port: None,
                url_prefix: None,
                leader_elect: None,
                dirs: Vec::new(),
                skip_doctor: false,
                strategies: Vec::new(),
                _not_a_setting: false,
            },
        );
        let cfg = Config::from_figment(
            &Figment::from(Serialized::defaults(Config::default())).merge(flags),
        )
        .unwrap();
        assert_eq!(cfg, Config::default());
    }
}
