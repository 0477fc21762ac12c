//! The `container-runtime` check: is the NVIDIA container runtime the default of the runtime
//! the kubelet uses? gpushare hands GPUs to containers through `NVIDIA_VISIBLE_DEVICES`, which
//! only the NVIDIA runtime (or its OCI hook) acts on; with plain runc every container sees no
//! GPU, the most common set-up mistake (reference spec §10.1.9, anchors §3.9).
//!
//! Reads Docker's `daemon.json`, containerd's `config.toml` (version 1, 2 and 3 layouts, with
//! `imports`; also the k3s / RKE2 copies) and CRI-O's `crio.conf` plus `crio.conf.d/*`. When the
//! kubelet's configuration names its runtime endpoint, only that runtime decides the verdict.
//! It does not talk to any daemon.

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

fn is_nvidia_binary(binary: &str) -> bool {
    binary.contains("nvidia-container-runtime")
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
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            f.notes.push(format!("not valid JSON: {e}"));
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
        .filter_map(|main| containerd_file(host, Path::new(main)))
        .collect()
}

/// One containerd configuration file with its `imports` merged (later files win).
#[derive(Clone, Debug)]
pub struct ContainerdConfig {
    /// The main file and the imported ones that were read, host paths.
    pub files: Vec<String>,
    /// The merged table; `None` when the main file is not valid TOML.
    pub table: Option<toml::Table>,
    /// Parse errors.
    pub notes: Vec<String>,
}

impl ContainerdConfig {
    /// The `version` key (1 when absent).
    pub fn version(&self) -> i64 {
        self.table
            .as_ref()
            .and_then(|t| t.get("version"))
            .and_then(|v| v.as_integer())
            .unwrap_or(1)
    }

    /// The CRI plugin's table name for this version.
    pub fn cri_plugin(&self) -> &'static str {
        match self.version() {
            3 => "io.containerd.cri.v1.runtime",
            2 => "io.containerd.grpc.v1.cri",
            _ => "cri",
        }
    }

    /// `plugins.<cri plugin>`, when present.
    pub fn cri_section(&self) -> Option<&toml::Value> {
        lookup(self.table.as_ref()?, &["plugins", self.cri_plugin()])
    }
}

/// Reads containerd's `main` configuration and its imports.
pub fn containerd_config(host: &HostRoot, main: &Path) -> Option<ContainerdConfig> {
    let text = host.read(main)?;
    let mut cfg = ContainerdConfig {
        files: vec![main.display().to_string()],
        table: None,
        notes: Vec::new(),
    };
    let mut merged: toml::Table = match toml::from_str(&text) {
        Ok(t) => t,
        Err(e) => {
            cfg.notes.push(format!("not valid TOML: {}", e.message()));
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
        let base = main.parent().unwrap_or(Path::new("/"));
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

/// The paths of containerd's configuration files (stock, k3s, RKE2).
pub const CONTAINERD_CONFIGS: &[&str] = &[
    "/etc/containerd/config.toml",
    "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
    "/var/lib/rancher/rke2/agent/etc/containerd/config.toml",
];

fn containerd_file(host: &HostRoot, main: &Path) -> Option<Finding> {
    let cfg = containerd_config(host, main)?;
    let mut f = Finding {
        engine: Engine::Containerd,
        files: cfg.files.clone(),
        default_runtime: "runc".to_string(),
        binary: None,
        nvidia: false,
        serves_cri: true,
        notes: cfg.notes.clone(),
    };
    let Some(merged) = cfg.table.as_ref() else {
        return Some(f);
    };
    let version = merged
        .get("version")
        .and_then(|v| v.as_integer())
        .unwrap_or(1);
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
    let section = lookup(merged, &["plugins", plugin, "containerd"]);
    if let Some(name) = section
        .and_then(|s| s.get("default_runtime_name"))
        .and_then(|v| v.as_str())
    {
        f.default_runtime = name.to_string();
    }
    let runtime = section
        .and_then(|s| s.get("runtimes"))
        .and_then(|r| r.get(&f.default_runtime))
        .or_else(|| section.and_then(|s| s.get("default_runtime")));
    let binary = runtime
        .and_then(|r| r.get("options"))
        .and_then(|o| o.get("BinaryName"))
        .and_then(|b| b.as_str())
        .filter(|b| !b.is_empty());
    match binary {
        Some(b) => {
            f.binary = Some(b.to_string());
            f.nvidia = is_nvidia_binary(b);
            note_missing_binary(host, &mut f, b);
        }
        None if f.default_runtime != "runc" => f.notes.push(format!(
            "plugins.\"{plugin}\".containerd.runtimes.{}.options.BinaryName is not set: it runs runc",
            f.default_runtime
        )),
        None => {}
    }
    f.files[0] = format!("{} (version {version})", main.display());
    Some(f)
}

/// CRI-O's `crio.conf` and drop-ins merged (later files win): files read, table, parse errors.
pub fn crio_config(host: &HostRoot) -> Option<(Vec<String>, toml::Table, Vec<String>)> {
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
        let hook = [
            "/usr/share/containers/oci/hooks.d",
            "/etc/containers/oci/hooks.d",
        ]
        .iter()
        .flat_map(|d| host.list(d))
        .find(|p| p.to_string_lossy().contains("nvidia"));
        if let Some(hook) = hook {
            f.nvidia = true;
            f.notes.push(format!(
                "the NVIDIA OCI hook {} applies to every container",
                hook.display()
            ));
        }
    }
    Some(f)
}

/// Which engine the kubelet's configured runtime endpoint points at, when it says.
pub fn kubelet_engine(host: &HostRoot) -> Option<(Engine, String)> {
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
    let mut fixes: Vec<&str> = bad.iter().map(|f| f.engine.fix()).collect();
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

/// The value at `path` (keys) in `table`.
pub fn lookup<'a>(table: &'a toml::Table, path: &[&str]) -> Option<&'a toml::Value> {
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
    fn nothing_configured_fails_with_the_fix() {
        let (_d, host) = host_with(&[]);
        let c = check(&host);
        assert_eq!(c.status, Status::Fail);
        assert!(c.hint.contains("nvidia-ctk runtime configure"));
    }
}
