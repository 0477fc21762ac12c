//! The `container-runtime` check: is the NVIDIA container runtime the default of the runtime
//! the kubelet uses? gpushare hands GPUs to containers through `NVIDIA_VISIBLE_DEVICES`, which
//! only the NVIDIA runtime (or its OCI hook) acts on; with plain runc every container sees no
//! GPU, the most common set-up mistake (reference spec §10.1.9, anchors §3.9).
//!
//! Reads Docker's `daemon.json`, containerd's `config.toml` (version 1, 2 and 3 layouts, with
//! `imports`; the deprecated 1.x `default_runtime`; `options.BinaryName` / `options.Runtime`;
//! also the k3s / RKE2 copies and their `config.toml.tmpl`) and CRI-O's `crio.conf` plus
//! `crio.conf.d/*` and the OCI hooks in its `hooks_dir`. When the kubelet's configuration names
//! its runtime endpoint, only that runtime decides the verdict. Fixes never name commands the
//! host does not have (Bottlerocket). It does not talk to any daemon.

use std::path::{Path, PathBuf};

use super::host::HostRoot;
use super::report::{Check, Status};

const ID: &str = "container-runtime";
const TITLE: &str = "default container runtime is nvidia";

/// Which container engine a finding is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Docker (dockershim or cri-dockerd).
    Docker,
    /// containerd's CRI plugin.
    Containerd,
    /// CRI-O.
    CriO,
}

impl Engine {
    /// The engine's name for people.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Docker => "Docker",
            Engine::Containerd => "containerd",
            Engine::CriO => "CRI-O",
        }
    }

    /// The one command that makes the NVIDIA runtime the default.
    fn fix(self) -> &'static str {
        match self {
            Engine::Docker => {
                "nvidia-ctk runtime configure --runtime=docker --set-as-default && systemctl restart docker"
            }
            Engine::Containerd => {
                "nvidia-ctk runtime configure --runtime=containerd --set-as-default && systemctl restart containerd"
            }
            Engine::CriO => {
                "nvidia-ctk runtime configure --runtime=crio --set-as-default && systemctl restart crio"
            }
        }
    }
}

/// What one runtime configuration says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The engine.
    pub engine: Engine,
    /// The file(s) read, host paths.
    pub files: Vec<String>,
    /// Name of the default runtime.
    pub default_runtime: String,
    /// The program the default runtime runs, when configured.
    pub binary: Option<String>,
    /// Whether the default runtime is the NVIDIA runtime (or the NVIDIA OCI hook applies).
    pub nvidia: bool,
    /// Whether the CRI side is in use (containerd with the `cri` plugin disabled serves only
    /// Docker).
    pub serves_cri: bool,
    /// Anything worth saying (parse errors, a missing binary).
    pub notes: Vec<String>,
    /// The file is not valid JSON / TOML: the engine does not start with it.
    pub broken: bool,
}

impl Finding {
    fn describe(&self) -> String {
        let files = self.files.join(" + ");
        let binary = self
            .binary
            .as_deref()
            .map(|b| format!(" ({b})"))
            .unwrap_or_default();
        let mut line = format!(
            "{} {files}: default runtime \"{}\"{binary}{}",
            self.engine.name(),
            self.default_runtime,
            if self.nvidia { "" } else { " is not nvidia" }
        );
        if !self.serves_cri {
            line.push_str(" [CRI plugin disabled: not used by the kubelet]");
        }
        for n in &self.notes {
            line.push_str("\n  ");
            line.push_str(n);
        }
        line
    }
}

/// Whether `binary` is an NVIDIA container runtime: the toolkit's `nvidia-container-runtime`
/// (and its `.cdi` / `.legacy` modes), or Bottlerocket's `nvidia-oci` (its
/// nvidia-container-toolkit package links it to shimpei, the runc wrapper that adds the NVIDIA
/// prestart hook).
fn is_nvidia_binary(binary: &str) -> bool {
    let name = Path::new(binary)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.contains("nvidia-container-runtime") || name == "nvidia-oci"
}

/// Docker's `/etc/docker/daemon.json`.
pub fn docker(host: &HostRoot) -> Option<Finding> {
    let file = PathBuf::from("/etc/docker/daemon.json");
    let text = host.read(&file)?;
    let mut f = Finding {
        engine: Engine::Docker,
        files: vec![file.display().to_string()],
        default_runtime: "runc".to_string(),
        binary: None,
        nvidia: false,
        serves_cri: true,
        notes: Vec::new(),
        broken: false,
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            f.notes.push(format!("not valid JSON: {e}"));
            f.broken = true;
            return Some(f);
        }
    };
    if let Some(name) = json.get("default-runtime").and_then(|v| v.as_str()) {
        f.default_runtime = name.to_string();
    }
    let path = json
        .get("runtimes")
        .and_then(|r| r.get(&f.default_runtime))
        .and_then(|r| r.get("path"))
        .and_then(|p| p.as_str());
    if let Some(path) = path {
        f.binary = Some(path.to_string());
        f.nvidia = is_nvidia_binary(path);
        note_missing_binary(host, &mut f, path);
    } else if f.default_runtime != "runc" {
        f.notes.push(format!(
            "runtimes.{}.path is not set in daemon.json",
            f.default_runtime
        ));
    }
    Some(f)
}

fn note_missing_binary(host: &HostRoot, f: &mut Finding, binary: &str) {
    if f.nvidia && host.find_program(&[binary]).is_none() {
        f.notes.push(format!("{binary} is not installed"));
        f.nvidia = false;
    }
}

/// containerd's configuration files, with `imports` merged (later files win).
pub fn containerd(host: &HostRoot) -> Vec<Finding> {
    CONTAINERD_CONFIGS
        .iter()
        .filter_map(|main| containerd_config(host, Path::new(main)))
        .map(|cfg| containerd_file(host, cfg))
        .collect()
}

/// The paths of containerd's configuration files (stock, k3s, RKE2).
pub(crate) const CONTAINERD_CONFIGS: &[&str] = &[
    "/etc/containerd/config.toml",
    "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
    "/var/lib/rancher/rke2/agent/etc/containerd/config.toml",
];

/// One containerd configuration file with its `imports` merged (later files win).
#[derive(Clone, Debug)]
pub(crate) struct ContainerdConfig {
    /// The file read: `config.toml`, or its k3s/RKE2 `config.toml.tmpl`.
    pub main: std::path::PathBuf,
    /// The main file and the imported ones that were read, host paths.
    pub files: Vec<String>,
    /// The merged table; `None` when the main file is not valid TOML.
    pub table: Option<toml::Table>,
    /// Parse errors and how the file was read.
    pub notes: Vec<String>,
    /// Read from a k3s/RKE2 template without its `{{…}}` lines.
    pub template: bool,
}

impl ContainerdConfig {
    /// The `version` key (a k3s/RKE2 template's base declares 2; else 1 when absent).
    pub fn version(&self) -> i64 {
        self.table
            .as_ref()
            .and_then(|t| t.get("version"))
            .and_then(|v| v.as_integer())
            .unwrap_or(if self.template { 2 } else { 1 })
    }

    /// The CRI plugin's table name for this version.
    pub(crate) fn cri_plugin(&self) -> &'static str {
        match self.version() {
            3 => "io.containerd.cri.v1.runtime",
            2 => "io.containerd.grpc.v1.cri",
            _ => "cri",
        }
    }

    /// `plugins.<cri plugin>`, when present.
    pub(crate) fn cri_section(&self) -> Option<&toml::Value> {
        lookup(self.table.as_ref()?, &["plugins", self.cri_plugin()])
    }
}

/// Reads containerd's `main` configuration (or the k3s/RKE2 template it is rendered from)
/// and merges its imports; `None` when neither file exists.
pub(crate) fn containerd_config(host: &HostRoot, main: &Path) -> Option<ContainerdConfig> {
    let (main, text, template) = match host.read(main) {
        Some(text) => (main.to_path_buf(), text, false),
        None => {
            // k3s / RKE2 render config.toml from config.toml.tmpl when they start.
            let template = main.with_extension("toml.tmpl");
            let text = host.read(&template)?;
            let kept: Vec<&str> = text.lines().filter(|l| !l.contains("{{")).collect();
            (template, kept.join("\n"), true)
        }
    };
    let mut cfg = ContainerdConfig {
        files: vec![main.display().to_string()],
        main,
        table: None,
        notes: Vec::new(),
        template,
    };
    let mut merged: toml::Table = match toml::from_str(&text) {
        Ok(t) => t,
        Err(e) => {
            cfg.notes
                .push(format!("not valid TOML: {}", e.message().trim()));
            if text.contains("{{") {
                cfg.notes.push(
                    "it is an unrendered template ({{…}} placeholders): the real configuration is rendered from it"
                        .to_string(),
                );
            }
            return Some(cfg);
        }
    };
    let imports: Vec<String> = merged
        .get("imports")
        .and_then(|v| v.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    for pattern in imports {
        let base = cfg.main.parent().unwrap_or(Path::new("/")).to_path_buf();
        for file in expand_glob(host, &base.join(&pattern)) {
            match host.read(&file).map(|t| toml::from_str::<toml::Table>(&t)) {
                Some(Ok(t)) => {
                    merge_tables(&mut merged, t);
                    cfg.files.push(file.display().to_string());
                }
                Some(Err(e)) => cfg.notes.push(format!(
                    "{}: not valid TOML: {}",
                    file.display(),
                    e.message()
                )),
                None => {}
            }
        }
    }
    cfg.table = Some(merged);
    Some(cfg)
}

fn containerd_file(host: &HostRoot, cfg: ContainerdConfig) -> Finding {
    let mut f = Finding {
        engine: Engine::Containerd,
        files: cfg.files.clone(),
        default_runtime: "runc".to_string(),
        binary: None,
        nvidia: false,
        serves_cri: true,
        notes: cfg.notes.clone(),
        broken: cfg.table.is_none(),
    };
    let version = cfg.version();
    let template = cfg.template;
    let main = cfg.main.clone();
    let Some(merged) = cfg.table else {
        return f;
    };
    if template {
        f.notes.push(
            "k3s/RKE2 template (no rendered config.toml yet): read without its {{…}} lines; the base it includes adds runc only"
                .to_string(),
        );
    }
    let disabled = merged
        .get("disabled_plugins")
        .and_then(|v| v.as_array())
        .is_some_and(|a| {
            a.iter().any(|p| {
                matches!(
                    p.as_str(),
                    Some("cri" | "io.containerd.grpc.v1.cri" | "io.containerd.cri.v1.runtime")
                )
            })
        });
    f.serves_cri = !disabled;
    let plugin = match version {
        3 => "io.containerd.cri.v1.runtime",
        2 => "io.containerd.grpc.v1.cri",
        _ => "cri",
    };
    let section = lookup(&merged, &["plugins", plugin, "containerd"]);
    if let Some(name) = section
        .and_then(|s| s.get("default_runtime_name"))
        .and_then(|v| v.as_str())
    {
        f.default_runtime = name.to_string();
    }
    // containerd 1.x: a `default_runtime` with a runtime_type replaces default_runtime_name
    // (the deprecated path of the CRI plugin's ValidatePluginConfig); 2.x dropped it.
    let deprecated_default = section
        .and_then(|s| s.get("default_runtime"))
        .filter(|r| version < 3 && !runtime_type(r).is_empty());
    let runtime = match deprecated_default {
        Some(r) => {
            f.notes.push(format!(
                "the deprecated default_runtime (runtime_type {}) is the default: it replaces default_runtime_name \"{}\"",
                runtime_type(r),
                f.default_runtime
            ));
            f.default_runtime = "default_runtime".to_string();
            Some(r)
        }
        None => section
            .and_then(|s| s.get("runtimes"))
            .and_then(|r| r.get(&f.default_runtime)),
    };
    match runtime.and_then(|r| runtime_program(&merged, r)) {
        Some(b) => {
            f.binary = Some(b.clone());
            f.nvidia = is_nvidia_binary(&b);
            note_missing_binary(host, &mut f, &b);
        }
        None if f.default_runtime != "runc" => {
            let entry = if deprecated_default.is_some() {
                "default_runtime".to_string()
            } else {
                format!("runtimes.{}", f.default_runtime)
            };
            f.notes.push(format!(
                "plugins.\"{plugin}\".containerd.{entry} names no program (options.BinaryName / options.Runtime): it runs runc"
            ));
        }
        None => {}
    }
    f.files[0] = format!("{} (version {version})", main.display());
    f
}

fn runtime_type(runtime: &toml::Value) -> &str {
    runtime
        .get("runtime_type")
        .and_then(|t| t.as_str())
        .unwrap_or("")
}

/// The program a containerd runtime entry runs: `options.BinaryName` (runc shims v1/v2),
/// else `options.Runtime` (runctypes.RuncOptions of `io.containerd.runtime.v1.linux`, what the
/// GPU Operator writes), else for `io.containerd.runtime.v1.linux` the `plugins.linux` runtime
/// (default runc). `None`: runc.
fn runtime_program(merged: &toml::Table, runtime: &toml::Value) -> Option<String> {
    let option = |key: &str| {
        runtime
            .get("options")
            .and_then(|o| o.get(key))
            .and_then(|b| b.as_str())
            .filter(|b| !b.is_empty())
            .map(str::to_string)
    };
    option("BinaryName")
        .or_else(|| option("Runtime"))
        .or_else(|| {
            (runtime_type(runtime) == "io.containerd.runtime.v1.linux")
                .then(|| {
                    lookup(merged, &["plugins", "linux", "runtime"])
                        .and_then(|r| r.as_str())
                        .filter(|r| !r.is_empty() && *r != "runc")
                        .map(str::to_string)
                })
                .flatten()
        })
}

/// CRI-O's `crio.conf` and drop-ins (`crio.conf.d/*`, later files win), merged: the files
/// read, the table and the parse errors; `None` when CRI-O has no configuration here.
pub(crate) fn crio_config(host: &HostRoot) -> Option<(Vec<String>, toml::Table, Vec<String>)> {
    let main = PathBuf::from("/etc/crio/crio.conf");
    let mut files: Vec<PathBuf> = Vec::new();
    if host.exists(&main) {
        files.push(main);
    }
    files.extend(host.list("/etc/crio/crio.conf.d"));
    if files.is_empty() {
        return None;
    }
    let (mut read, mut notes) = (Vec::new(), Vec::new());
    let mut merged = toml::Table::new();
    for file in files {
        match host.read(&file).map(|t| toml::from_str::<toml::Table>(&t)) {
            Some(Ok(t)) => merge_tables(&mut merged, t),
            Some(Err(e)) => notes.push(format!(
                "{}: not valid TOML: {}",
                file.display(),
                e.message()
            )),
            None => continue,
        }
        read.push(file.display().to_string());
    }
    Some((read, merged, notes))
}

/// CRI-O's `crio.conf` and drop-ins (`crio.conf.d/*`, later files win), and the NVIDIA OCI hook.
pub fn crio(host: &HostRoot) -> Option<Finding> {
    let (files, merged, notes) = crio_config(host)?;
    let mut f = Finding {
        engine: Engine::CriO,
        files,
        default_runtime: "(built-in default: runc or crun)".to_string(),
        binary: None,
        nvidia: false,
        serves_cri: true,
        notes,
        broken: false,
    };
    let runtime = lookup(&merged, &["crio", "runtime"]);
    if let Some(name) = runtime
        .and_then(|r| r.get("default_runtime"))
        .and_then(|v| v.as_str())
    {
        f.default_runtime = name.to_string();
    }
    let path = runtime
        .and_then(|r| r.get("runtimes"))
        .and_then(|r| r.get(&f.default_runtime))
        .and_then(|r| r.get("runtime_path"))
        .and_then(|p| p.as_str())
        .filter(|p| !p.is_empty());
    if let Some(path) = path {
        f.binary = Some(path.to_string());
        f.nvidia = is_nvidia_binary(path);
        note_missing_binary(host, &mut f, path);
    }
    if !f.nvidia {
        let hooks_dirs: Vec<String> = runtime
            .and_then(|r| r.get("hooks_dir"))
            .and_then(|d| d.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_else(|| vec![CRIO_DEFAULT_HOOKS_DIR.to_string()]);
        crio_hooks(host, &hooks_dirs, &mut f);
    }
    Some(f)
}

/// CRI-O's default `hooks_dir` (cri-o pkg/config: `HooksDir = []string{hooks.DefaultDir}`).
pub(crate) const CRIO_DEFAULT_HOOKS_DIR: &str = "/usr/share/containers/oci/hooks.d";

/// Directories where OCI hooks are commonly installed; a hook there is only used when
/// CRI-O's `hooks_dir` lists the directory.
const KNOWN_HOOKS_DIRS: [&str; 2] = [CRIO_DEFAULT_HOOKS_DIR, "/etc/containers/oci/hooks.d"];

/// Looks for the NVIDIA OCI hook in the directories CRI-O reads (`hooks_dirs`); a hook that
/// applies (`when.always` or a `commands` pattern) and whose program exists makes the runtime
/// nvidia. One in a directory CRI-O does not read is reported, not counted.
fn crio_hooks(host: &HostRoot, hooks_dirs: &[String], f: &mut Finding) {
    let nvidia_hooks = |dir: &str| -> Vec<PathBuf> {
        host.list(dir)
            .into_iter()
            .filter(|p| p.to_string_lossy().contains("nvidia"))
            .collect()
    };
    for dir in hooks_dirs {
        for hook in nvidia_hooks(dir) {
            let Some(text) = host.read(&hook) else {
                continue;
            };
            let json: serde_json::Value = match serde_json::from_str(&text) {
                Ok(v) => v,
                Err(e) => {
                    f.notes.push(format!(
                        "the OCI hook {} is not valid JSON: {e}",
                        hook.display()
                    ));
                    continue;
                }
            };
            let program = json
                .get("hook")
                .and_then(|h| h.get("path"))
                .and_then(|p| p.as_str())
                .unwrap_or("");
            let when = json.get("when");
            let applies = when.and_then(|w| w.get("always")).and_then(|a| a.as_bool())
                == Some(true)
                || when
                    .and_then(|w| w.get("commands"))
                    .and_then(|c| c.as_array())
                    .is_some_and(|c| !c.is_empty());
            if program.is_empty() || !host.exists(program) {
                f.notes.push(format!(
                    "the OCI hook {} runs {program:?}, which is not installed",
                    hook.display()
                ));
            } else if !applies {
                f.notes.push(format!(
                    "the OCI hook {} has no when.always / when.commands: it applies to no container",
                    hook.display()
                ));
            } else {
                f.nvidia = true;
                f.binary = Some(program.to_string());
                f.notes.push(format!(
                    "the NVIDIA OCI hook {} ({program}) applies to every container",
                    hook.display()
                ));
                return;
            }
        }
    }
    for dir in KNOWN_HOOKS_DIRS {
        if hooks_dirs.iter().any(|d| d.trim_end_matches('/') == dir) {
            continue;
        }
        for hook in nvidia_hooks(dir) {
            f.notes.push(format!(
                "the NVIDIA OCI hook {} is in {dir}, which CRI-O does not read (hooks_dir = {hooks_dirs:?}): it never runs",
                hook.display()
            ));
        }
    }
}

/// Which engine the kubelet's configured runtime endpoint points at, when it says.
pub(crate) fn kubelet_engine(host: &HostRoot) -> Option<(Engine, String)> {
    let mut endpoint = None;
    if let Some(text) = host.read("/var/lib/kubelet/config.yaml")
        && let Ok(v) = yaml_serde::from_str::<yaml_serde::Value>(&text)
        && let Some(e) = v.get("containerRuntimeEndpoint").and_then(|e| e.as_str())
    {
        endpoint = Some(e.to_string());
    }
    for file in [
        "/var/lib/kubelet/kubeadm-flags.env",
        "/etc/default/kubelet",
        "/etc/sysconfig/kubelet",
    ] {
        if endpoint.is_some() {
            break;
        }
        let Some(text) = host.read(file) else {
            continue;
        };
        endpoint = text
            .split(|c: char| c.is_whitespace() || c == '"' || c == '\'')
            .find_map(|tok| tok.strip_prefix("--container-runtime-endpoint="))
            .map(str::to_string);
    }
    let endpoint = endpoint?;
    let engine = if endpoint.contains("containerd") {
        Engine::Containerd
    } else if endpoint.contains("crio") {
        Engine::CriO
    } else if endpoint.contains("dockershim") || endpoint.contains("cri-dockerd") {
        Engine::Docker
    } else {
        return None;
    };
    Some((engine, endpoint))
}

/// The `container-runtime` check.
pub fn check(host: &HostRoot) -> Check {
    let mut findings: Vec<Finding> = Vec::new();
    findings.extend(docker(host));
    findings.extend(containerd(host));
    findings.extend(crio(host));
    if findings.is_empty() {
        return Check::new(
            ID,
            TITLE,
            Status::Fail,
            "no container runtime configuration found (looked for /etc/docker/daemon.json, \
             /etc/containerd/config.toml, /etc/crio/crio.conf[.d])",
        )
        .hint(
            "install the NVIDIA Container Toolkit, then make it the default of your runtime:\n\
             nvidia-ctk runtime configure --runtime=containerd --set-as-default  (or docker, crio)\n\
             and restart the runtime",
        );
    }
    let kubelet = kubelet_engine(host);
    let mut lines: Vec<String> = findings.iter().map(Finding::describe).collect();
    let deciding: Vec<&Finding> = match &kubelet {
        Some((engine, endpoint)) => {
            lines.push(format!("the kubelet uses {} ({endpoint})", engine.name()));
            findings.iter().filter(|f| f.engine == *engine).collect()
        }
        None => findings.iter().filter(|f| f.serves_cri).collect(),
    };
    let detail = lines.join("\n");
    if deciding.is_empty() {
        let what = kubelet
            .as_ref()
            .map_or("a runtime serving the CRI".to_string(), |(e, _)| {
                format!("a {} configuration", e.name())
            });
        return Check::new(ID, TITLE, Status::Fail, format!("{detail}\nfound no {what}"))
            .hint("configure the runtime the kubelet uses: nvidia-ctk runtime configure --runtime=<containerd|docker|crio> --set-as-default");
    }
    let bad: Vec<&&Finding> = deciding.iter().filter(|f| !f.nvidia).collect();
    let bottlerocket = is_bottlerocket(host);
    let mut fixes: Vec<String> = bad
        .iter()
        .map(|f| {
            if f.broken {
                format!(
                    "repair {} (see the error above): {} does not start with it",
                    f.files.join(" + "),
                    f.engine.name()
                )
            } else if bottlerocket {
                BOTTLEROCKET_FIX.to_string()
            } else {
                f.engine.fix().to_string()
            }
        })
        .collect();
    if bottlerocket && bad.iter().any(|f| f.broken) {
        fixes.push(BOTTLEROCKET_FIX.to_string());
    }
    fixes.dedup();
    let hint = fixes.join("\n");
    if bad.is_empty() {
        Check::new(ID, TITLE, Status::Ok, detail)
    } else if bad.len() < deciding.len() {
        Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!("{detail}\nnot every runtime on this node defaults to nvidia; the kubelet must use one that does"),
        )
        .hint(hint)
    } else {
        Check::new(ID, TITLE, Status::Fail, detail).hint(hint)
    }
}

/// The fix on Bottlerocket, which has neither nvidia-ctk nor a shell with systemctl: its
/// configuration is rendered from settings.
const BOTTLEROCKET_FIX: &str = "Bottlerocket renders its container runtime configuration from its settings (no toolkit \
     command or service manager to run by hand): use an aws-k8s-*-nvidia variant, whose containerd defaults to \
     its nvidia runtime (nvidia-oci), and change settings with apiclient";

/// Whether the host is Bottlerocket: `/etc/os-release` says so, or the containerd
/// configuration is Bottlerocket's settings template.
fn is_bottlerocket(host: &HostRoot) -> bool {
    let os = host
        .read("/etc/os-release")
        .or_else(|| host.read("/usr/lib/os-release"))
        .unwrap_or_default();
    os.lines()
        .any(|l| l.trim() == "ID=bottlerocket" || l.trim() == "ID=\"bottlerocket\"")
        || host
            .read("/etc/containerd/config.toml")
            .is_some_and(|t| t.contains("{{settings."))
}

/// Host files matching `pattern` (a `*` is allowed in the last component only).
fn expand_glob(host: &HostRoot, pattern: &Path) -> Vec<PathBuf> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some((prefix, suffix)) = name.split_once('*') else {
        return if host.exists(pattern) {
            vec![pattern.to_path_buf()]
        } else {
            Vec::new()
        };
    };
    let dir = pattern.parent().unwrap_or(Path::new("/"));
    host.list(dir)
        .into_iter()
        .filter(|p| {
            p.file_name().map(|n| n.to_string_lossy()).is_some_and(|n| {
                n.starts_with(prefix)
                    && n.ends_with(suffix)
                    && n.len() >= prefix.len() + suffix.len()
            })
        })
        .collect()
}

/// Deep merge: values of `over` replace those of `base`, tables merge.
fn merge_tables(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge_tables(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

pub(crate) fn lookup<'a>(table: &'a toml::Table, path: &[&str]) -> Option<&'a toml::Value> {
    let (first, rest) = path.split_first()?;
    let mut v = table.get(*first)?;
    for key in rest {
        v = v.get(*key)?;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn host_with(files: &[(&str, &str)]) -> (tempfile::TempDir, HostRoot) {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path.trim_start_matches('/'));
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
        let host = HostRoot::new(dir.path());
        (dir, host)
    }

    const NVIDIA_BIN: (&str, &str) = ("/usr/bin/nvidia-container-runtime", "");

    #[test]
    fn docker_default_runtime_nvidia() {
        let (_d, host) = host_with(&[
            (
                "/etc/docker/daemon.json",
                r#"{"default-runtime":"nvidia","runtimes":{"nvidia":{"path":"nvidia-container-runtime","runtimeArgs":[]}}}"#,
            ),
            NVIDIA_BIN,
        ]);
        let c = check(&host);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        let (_d, host) = host_with(&[(
            "/etc/docker/daemon.json",
            r#"{"runtimes":{"nvidia":{"path":"nvidia-container-runtime"}}}"#,
        )]);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(
            c.hint.contains("--runtime=docker --set-as-default"),
            "{c:?}"
        );
        let (_d, host) = host_with(&[("/etc/docker/daemon.json", "{not json")]);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("not valid JSON"), "{c:?}");
    }

    #[test]
    fn docker_nvidia_default_without_the_binary_fails() {
        let (_d, host) = host_with(&[(
            "/etc/docker/daemon.json",
            r#"{"default-runtime":"nvidia","runtimes":{"nvidia":{"path":"/usr/bin/nvidia-container-runtime"}}}"#,
        )]);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("is not installed"), "{c:?}");
    }

    const CONTAINERD_V2: &str = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
      BinaryName = "/usr/bin/nvidia-container-runtime"
"#;

    const CONTAINERD_V3: &str = r#"
version = 3
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "nvidia"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/bin/nvidia-container-runtime"
"#;

    #[test]
    fn containerd_layouts() {
        for text in [CONTAINERD_V2, CONTAINERD_V3] {
            let (_d, host) = host_with(&[("/etc/containerd/config.toml", text), NVIDIA_BIN]);
            let c = check(&host);
            assert_eq!(c.status, Status::Ok, "{c:?}");
        }
        // The v2 layout under version = 3 is not read: default stays runc.
        let wrong = CONTAINERD_V2.replace("version = 2", "version = 3");
        let (_d, host) = host_with(&[("/etc/containerd/config.toml", &wrong), NVIDIA_BIN]);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.hint.contains("--runtime=containerd"), "{c:?}");
    }

    #[test]
    fn containerd_imports_and_disabled_cri() {
        let main = "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
        let (_d, host) = host_with(&[
            ("/etc/containerd/config.toml", main),
            ("/etc/containerd/conf.d/99-nvidia.toml", CONTAINERD_V2),
            NVIDIA_BIN,
        ]);
        let c = check(&host);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(c.detail.contains("99-nvidia.toml"), "{c:?}");
        // Docker's own containerd (cri disabled) does not count; Docker's config decides.
        let (_d, host) = host_with(&[
            (
                "/etc/containerd/config.toml",
                "disabled_plugins = [\"cri\"]\n",
            ),
            (
                "/etc/docker/daemon.json",
                r#"{"default-runtime":"nvidia","runtimes":{"nvidia":{"path":"nvidia-container-runtime"}}}"#,
            ),
            NVIDIA_BIN,
        ]);
        let c = check(&host);
        assert_eq!(c.status, Status::Ok, "{c:?}");
    }

    #[test]
    fn crio_drop_ins_win_and_the_kubelet_endpoint_decides() {
        let (_d, host) = host_with(&[
            (
                "/etc/crio/crio.conf",
                "[crio.runtime]\ndefault_runtime = \"runc\"\n",
            ),
            (
                "/etc/crio/crio.conf.d/99-nvidia.conf",
                "[crio.runtime]\ndefault_runtime = \"nvidia\"\n[crio.runtime.runtimes.nvidia]\nruntime_path = \"/usr/bin/nvidia-container-runtime\"\n",
            ),
            NVIDIA_BIN,
        ]);
        assert_eq!(check(&host).status, Status::Ok);
        // containerd not nvidia, CRI-O nvidia: warn; the kubelet on CRI-O: ok.
        fs::create_dir_all(host.path("/etc/containerd")).unwrap();
        fs::write(host.path("/etc/containerd/config.toml"), "version = 2\n").unwrap();
        assert_eq!(check(&host).status, Status::Warn);
        fs::create_dir_all(host.path("/var/lib/kubelet")).unwrap();
        fs::write(
            host.path("/var/lib/kubelet/config.yaml"),
            "kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///var/run/crio/crio.sock\n",
        )
        .unwrap();
        let c = check(&host);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(c.detail.contains("the kubelet uses CRI-O"), "{c:?}");
    }

    #[test]
    fn crio_reads_hooks_only_from_its_hooks_dir() {
        let hook = r#"{"version":"1.0.0","hook":{"path":"/usr/bin/nvidia-container-runtime-hook","args":["prestart"]},"when":{"always":true},"stages":["prestart"]}"#;
        let conf = "[crio.runtime]\ndefault_runtime = \"crun\"\n";
        let files = |conf: &'static str| {
            host_with(&[
                ("/etc/crio/crio.conf", conf),
                ("/etc/containers/oci/hooks.d/oci-nvidia-hook.json", hook),
                ("/usr/bin/nvidia-container-runtime-hook", ""),
            ])
        };
        // Default hooks_dir is /usr/share/containers/oci/hooks.d: the hook never runs.
        let (_d, host) = files(conf);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail, "{c:?}");
        assert!(c.detail.contains("which CRI-O does not read"), "{c:?}");
        // hooks_dir naming /etc/containers/oci/hooks.d: it runs.
        let (_d, host) = files(
            "[crio.runtime]\ndefault_runtime = \"crun\"\nhooks_dir = [\"/etc/containers/oci/hooks.d\"]\n",
        );
        let c = check(&host);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(c.detail.contains("applies to every container"), "{c:?}");
    }

    #[test]
    fn containerd_deprecated_default_runtime_wins_in_1x_layouts_only() {
        let v2 = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.default_runtime]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.default_runtime.options]
      BinaryName = "/usr/bin/nvidia-container-runtime"
"#;
        let (_d, host) = host_with(&[("/etc/containerd/config.toml", v2), NVIDIA_BIN]);
        let c = check(&host);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(c.detail.contains("deprecated default_runtime"), "{c:?}");
        // containerd 2.x (version 3) ignores it.
        let v3 = v2
            .replace("version = 2", "version = 3")
            .replace("io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime");
        let (_d, host) = host_with(&[("/etc/containerd/config.toml", &v3), NVIDIA_BIN]);
        assert_eq!(check(&host).status, Status::Fail);
        // An empty runtime_type (the stock v2 file) leaves default_runtime_name in charge.
        let empty = v2.replace("io.containerd.runc.v2", "");
        let (_d, host) = host_with(&[("/etc/containerd/config.toml", &empty), NVIDIA_BIN]);
        assert_eq!(check(&host).status, Status::Fail);
    }

    #[test]
    fn nothing_configured_fails_with_the_fix() {
        let (_d, host) = host_with(&[]);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail);
        assert!(c.hint.contains("nvidia-ctk runtime configure"));
    }
}
