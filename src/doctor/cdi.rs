//! The CDI checks, run when `node.device_list_strategy` names a CDI strategy
//! (`cdi-annotations`, `cdi-cri`):
//!
//! - `cdi-specs`: the CDI spec directories hold a spec of the configured kind that names every
//!   GPU the backend sees, by index or UUID as `--device-id-strategy` says; a spec naming a UUID
//!   this node does not have, or an index whose device node is not that GPU's
//!   `/dev/nvidia<minor>`, is stale (the GPUs changed since `nvidia-ctk cdi generate` ran).
//! - `cdi-runtime`: the runtime the kubelet uses hands CDI devices over: containerd's
//!   `enable_cdi` (on by default only in containerd 2.x, config version 3) and its
//!   `cdi_spec_dirs`, CRI-O's `cdi_spec_dirs` (CRI-O always has CDI); Docker through
//!   cri-dockerd does not pass CDI devices from the kubelet.
//!
//! With only CDI strategies the `container-runtime` check (nvidia as the default runtime) is
//! not run: CDI does not need it. Reads files only, like every doctor check.

use std::path::PathBuf;

use super::host::HostRoot;
use super::report::{Check, Status};
use super::runtime::{self, Engine};
use crate::config::{NodeConfig, VisibleDevices};
use crate::gpu::GpuDevice;
use crate::gpu::cdi::Registry;

const SPECS_ID: &str = "cdi-specs";
const SPECS_TITLE: &str = "CDI specs name every GPU";
const RUNTIME_ID: &str = "cdi-runtime";
const RUNTIME_TITLE: &str = "container runtime hands CDI devices over";

fn generate_hint(dp: &NodeConfig) -> String {
    let strategy = match dp.visible_devices {
        VisibleDevices::Index => "index",
        VisibleDevices::Uuid => "uuid",
    };
    format!(
        "generate the spec on this node (again after a GPU change):\n\
         nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml --device-name-strategy={strategy}\n\
         (the GPU Operator does this with cdi.enabled=true); the kind must be {} (--cdi-kind)",
        dp.cdi_kind
    )
}

/// `cdi-specs`. `devices` is what the backend sees (`None`: it could not be asked).
/// In the preflight a missing device only warns: specs may be written after the plugin starts,
/// and Allocate refuses a GPU without one anyway.
pub fn specs(
    host: &HostRoot,
    dp: &NodeConfig,
    devices: Option<&[GpuDevice]>,
    preflight: bool,
) -> Check {
    let registry = Registry::read(&host.path("/"), &dp.cdi_spec_dirs);
    let mut lines: Vec<String> = Vec::new();
    let kinds = registry.kinds();
    if kinds.is_empty() {
        lines.push(format!("no CDI spec in {}", registry.dirs_text()));
    }
    for (kind, files) in &kinds {
        let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
        lines.push(format!("{kind}: {}", files.join(", ")));
    }
    lines.extend(registry.errors.iter().map(|e| e.to_string()));
    let Some(devices) = devices else {
        return Check::new(
            SPECS_ID,
            SPECS_TITLE,
            Status::Skip,
            format!("{}\nthe GPUs could not be listed", lines.join("\n")),
        );
    };
    let kind = dp.cdi_kind.as_str();
    let mut missing: Vec<String> = Vec::new();
    let mut stale: Vec<String> = Vec::new();
    for gpu in devices {
        let name = match dp.visible_devices {
            VisibleDevices::Index => gpu.index.to_string(),
            VisibleDevices::Uuid => gpu.uuid.clone(),
        };
        match registry.device(kind, &name) {
            None => missing.push(format!("{kind}={name} (GPU {} {})", gpu.index, gpu.uuid)),
            Some((spec, dev)) => {
                let node = format!("/dev/nvidia{}", gpu.minor.unwrap_or(gpu.index));
                if !dev.device_nodes.is_empty() && !dev.device_nodes.contains(&node) {
                    stale.push(format!(
                        "{kind}={name} in {} has device nodes {} but GPU {} is {node}",
                        spec.path.display(),
                        dev.device_nodes.join(", "),
                        gpu.index
                    ));
                }
            }
        }
    }
    let names = registry.names_of_kind(kind);
    for name in &names {
        let unknown_uuid = name.starts_with("GPU-") && !devices.iter().any(|g| g.uuid == *name);
        if unknown_uuid {
            stale.push(format!(
                "{kind}={name} is not a GPU of this node (a stale spec)"
            ));
        }
    }
    if missing.is_empty() && stale.is_empty() {
        lines.push(format!(
            "{} GPU(s) named as {kind}=<{}>",
            devices.len(),
            match dp.visible_devices {
                VisibleDevices::Index => "index",
                VisibleDevices::Uuid => "uuid",
            }
        ));
        let status = if registry.errors.is_empty() {
            Status::Ok
        } else {
            Status::Warn
        };
        return Check::new(SPECS_ID, SPECS_TITLE, status, lines.join("\n"));
    }
    if !missing.is_empty() {
        lines.push(format!("missing: {}", missing.join(", ")));
        if !names.is_empty() {
            lines.push(format!("the specs of {kind} have: {}", names.join(", ")));
        }
    }
    if !stale.is_empty() {
        lines.push(format!("stale: {}", stale.join("; ")));
    }
    let status = if missing.is_empty() || preflight {
        Status::Warn
    } else {
        Status::Fail
    };
    Check::new(SPECS_ID, SPECS_TITLE, status, lines.join("\n")).hint(generate_hint(dp))
}

/// What one runtime configuration says about CDI.
struct CdiFinding {
    engine: Engine,
    files: String,
    /// `Some(true)`: enabled; `Some(false)`: disabled; `None`: not set, default depends on the
    /// version of the daemon.
    enabled: Option<bool>,
    /// The directories it reads specs from.
    dirs: Vec<PathBuf>,
    notes: Vec<String>,
}

fn string_list(v: Option<&toml::Value>) -> Option<Vec<PathBuf>> {
    v?.as_array().map(|a| {
        a.iter()
            .filter_map(|s| s.as_str().map(PathBuf::from))
            .collect()
    })
}

fn default_dirs() -> Vec<PathBuf> {
    crate::config::DEFAULT_CDI_SPEC_DIRS
        .iter()
        .map(PathBuf::from)
        .collect()
}

fn containerd_findings(host: &HostRoot) -> Vec<CdiFinding> {
    let mut out = Vec::new();
    for main in runtime::CONTAINERD_CONFIGS {
        let Some(cfg) = runtime::containerd_config(host, std::path::Path::new(main)) else {
            continue;
        };
        let section = cfg.cri_section();
        let explicit = section
            .and_then(|s| s.get("enable_cdi"))
            .and_then(|v| v.as_bool());
        let version = cfg.version();
        let mut notes = cfg.notes.clone();
        let enabled = match (explicit, version) {
            (Some(b), _) => Some(b),
            (None, 3) => Some(true),
            (None, _) => {
                notes.push(
                    "enable_cdi is not set: on by default in containerd 2.x, off in 1.7"
                        .to_string(),
                );
                None
            }
        };
        out.push(CdiFinding {
            engine: Engine::Containerd,
            files: format!("{} (version {version})", cfg.files.join(" + ")),
            enabled,
            dirs: string_list(section.and_then(|s| s.get("cdi_spec_dirs")))
                .unwrap_or_else(default_dirs),
            notes,
        });
    }
    out
}

fn crio_finding(host: &HostRoot) -> Option<CdiFinding> {
    let (files, table, notes) = runtime::crio_config(host)?;
    let dirs = string_list(runtime::lookup(
        &table,
        &["crio", "runtime", "cdi_spec_dirs"],
    ))
    .unwrap_or_else(default_dirs);
    Some(CdiFinding {
        engine: Engine::CriO,
        files: files.join(" + "),
        enabled: Some(true),
        dirs,
        notes,
    })
}

/// Who hands CDI devices to the runtime, for the texts of a runtime check.
pub(crate) struct CdiReader<'a> {
    /// The check's id.
    pub id: &'static str,
    /// The check's title.
    pub title: &'static str,
    /// The directories it writes or reads specs in.
    pub dirs: &'a [PathBuf],
    /// Its name in the texts ("the device plugin").
    pub who: &'a str,
    /// The fix when the kubelet uses Docker (cri-dockerd passes no CDI devices).
    pub docker_fix: &'a str,
    /// The flag or key that sets `dirs`.
    pub dirs_flag: &'a str,
}

/// `cdi-runtime`: CDI is enabled in the runtime the kubelet uses, and it reads the directories
/// the plugin reads.
pub fn runtime(host: &HostRoot, dp: &NodeConfig) -> Check {
    runtime_for(
        host,
        &CdiReader {
            id: RUNTIME_ID,
            title: RUNTIME_TITLE,
            dirs: &dp.cdi_spec_dirs,
            who: "the device plugin",
            docker_fix: "use --device-list-strategy envvar with nvidia as Docker's default runtime, or move \
                         the node to containerd 1.7+ / CRI-O",
            dirs_flag: "cdi_spec_dirs / --cdi-spec-dirs",
        },
    )
}

/// A runtime check for `reader`: CDI enabled in the runtime the kubelet uses (containerd's
/// `enable_cdi`, on by default in 2.x; CRI-O always; not through cri-dockerd), and the runtime
/// reads the directories `reader` uses.
pub(crate) fn runtime_for(host: &HostRoot, reader: &CdiReader<'_>) -> Check {
    let mut findings = containerd_findings(host);
    findings.extend(crio_finding(host));
    let kubelet = runtime::kubelet_engine(host);
    let mut lines: Vec<String> = Vec::new();
    let uses_docker = matches!(kubelet, Some((Engine::Docker, _)));
    if let Some((engine, endpoint)) = &kubelet {
        lines.push(format!("the kubelet uses {} ({endpoint})", engine.name()));
        findings.retain(|f| f.engine == *engine);
    }
    if uses_docker {
        return Check::new(
            reader.id,
            reader.title,
            Status::Fail,
            format!(
                "{}\ncri-dockerd does not pass CDI devices from the kubelet",
                lines.join("\n")
            ),
        )
        .hint(reader.docker_fix);
    }
    if findings.is_empty() {
        lines.push(
            "no containerd or CRI-O configuration found (looked for /etc/containerd/config.toml, \
             the k3s / RKE2 copies, /etc/crio/crio.conf[.d])"
                .to_string(),
        );
        return Check::new(reader.id, reader.title, Status::Warn, lines.join("\n")).hint(
            "CDI needs containerd 1.7+ (enable_cdi = true) or CRI-O 1.23+; \
             nvidia-ctk runtime configure --runtime=containerd --cdi.enabled writes it",
        );
    }
    let mut status = Status::Ok;
    let mut hints: Vec<String> = Vec::new();
    let plugin_dirs = reader.dirs;
    for f in &findings {
        let state = match f.enabled {
            Some(true) => "CDI enabled",
            Some(false) => "CDI DISABLED (enable_cdi = false)",
            None => "CDI not configured",
        };
        let dirs: Vec<String> = f.dirs.iter().map(|d| d.display().to_string()).collect();
        lines.push(format!(
            "{} {}: {state}, spec dirs {}",
            f.engine.name(),
            f.files,
            dirs.join(", ")
        ));
        for n in &f.notes {
            lines.push(format!("  {n}"));
        }
        match f.enabled {
            Some(false) => {
                status = Status::Fail;
                hints.push(format!(
                    "set enable_cdi = true under [plugins.\"{}\"] in {} and restart containerd \
                     (nvidia-ctk runtime configure --runtime=containerd --cdi.enabled)",
                    if f.files.contains("version 3") {
                        "io.containerd.cri.v1.runtime"
                    } else {
                        "io.containerd.grpc.v1.cri"
                    },
                    f.files
                ));
            }
            None => {
                if status == Status::Ok {
                    status = Status::Warn;
                }
                hints.push(
                    "set enable_cdi = true in containerd's CRI plugin section (needed on 1.7) \
                     and restart containerd"
                        .to_string(),
                );
            }
            Some(true) => {}
        }
        if !plugin_dirs.iter().any(|d| f.dirs.contains(d)) {
            if status == Status::Ok {
                status = Status::Warn;
            }
            let mine: Vec<String> = plugin_dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect();
            hints.push(format!(
                "the runtime reads CDI specs from {} but {} from {}: use the same \
                 directories ({})",
                dirs.join(", "),
                reader.who,
                mine.join(", "),
                reader.dirs_flag
            ));
        }
    }
    hints.dedup();
    let check = Check::new(reader.id, reader.title, status, lines.join("\n"));
    if hints.is_empty() {
        check
    } else {
        check.hint(hints.join("\n"))
    }
}
