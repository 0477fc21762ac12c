//! Reading the host's files under a root directory (`--root`, `/` by default), and the node
//! checks that only look at files: NVML library, container toolkit, the kubelet's
//! device-plugin directory and socket, other device plugins.
//!
//! Paths in reports are host paths (without the root), so a report reads the same whether
//! doctor runs on the host or in a pod that mounts the host at `/host`.

use std::fs;
use std::path::{Path, PathBuf};

use super::report::{Check, Status};
use crate::core::wire;

/// The host filesystem as seen from doctor: every host path is read under `root`.
#[derive(Clone, Debug)]
pub struct HostRoot {
    root: PathBuf,
}

/// Directories where the NVIDIA driver installs `libnvidia-ml.so.1`.
pub(crate) const NVML_LIBRARY_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/local/nvidia/lib64",
    "/usr/lib/aarch64-linux-gnu",
];

/// Directories searched for the NVIDIA container runtime and toolkit programs.
pub(crate) const BIN_DIRS: &[&str] = &[
    "/usr/bin",
    "/usr/local/bin",
    "/usr/sbin",
    "/bin",
    "/usr/local/nvidia/toolkit",
];

/// Socket names NVIDIA's own device plugin registers with.
pub(crate) const NVIDIA_PLUGIN_SOCKETS: &[&str] = &["nvidia-gpu.sock", "nvidia.sock"];

impl HostRoot {
    /// Host files under `root`.
    pub fn new(root: impl Into<PathBuf>) -> HostRoot {
        HostRoot { root: root.into() }
    }

    /// Where host path `path` lives in this process's view.
    pub fn path(&self, path: impl AsRef<Path>) -> PathBuf {
        let p = path.as_ref();
        self.root.join(p.strip_prefix("/").unwrap_or(p))
    }

    /// The text of host file `path`, `None` when missing or unreadable.
    pub fn read(&self, path: impl AsRef<Path>) -> Option<String> {
        fs::read_to_string(self.path(path)).ok()
    }

    /// Whether host path `path` exists (a dangling symlink counts: the driver's
    /// `libnvidia-ml.so.1` is a link).
    pub fn exists(&self, path: impl AsRef<Path>) -> bool {
        fs::symlink_metadata(self.path(path)).is_ok()
    }

    /// Whether host path `path` is a directory.
    pub fn is_dir(&self, path: impl AsRef<Path>) -> bool {
        self.path(path).is_dir()
    }

    /// Entries of host directory `dir`, sorted by name, as host paths.
    pub fn list(&self, dir: impl AsRef<Path>) -> Vec<PathBuf> {
        let dir = dir.as_ref();
        let mut names: Vec<_> = fs::read_dir(self.path(dir))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| dir.join(e.file_name()))
            .collect();
        names.sort();
        names
    }

    /// The first of `names` found in [`BIN_DIRS`] (an absolute name is taken as is).
    pub(crate) fn find_program(&self, names: &[&str]) -> Option<PathBuf> {
        for name in names {
            if name.starts_with('/') {
                if self.exists(name) {
                    return Some(PathBuf::from(name));
                }
                continue;
            }
            for dir in BIN_DIRS {
                let p = Path::new(dir).join(name);
                if self.exists(&p) {
                    return Some(p);
                }
            }
        }
        None
    }

    /// Command names (`/proc/<pid>/comm`, 15 characters at most) of the running processes.
    pub(crate) fn process_names(&self) -> Vec<String> {
        self.list("/proc")
            .into_iter()
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            })
            .filter_map(|p| self.read(p.join("comm")))
            .map(|s| s.trim().to_string())
            .collect()
    }
}

/// `nvml-library`: is `libnvidia-ml.so.1` installed? `explicit` is `[gpu] nvml_library`.
pub fn nvml_library(host: &HostRoot, explicit: &str, fake_backend: bool) -> Check {
    const ID: &str = "nvml-library";
    const TITLE: &str = "NVML library libnvidia-ml.so.1";
    if !explicit.is_empty() {
        return if Path::new(explicit).exists() {
            Check::new(
                ID,
                TITLE,
                Status::Ok,
                format!("{explicit} (from gpu.nvml_library)"),
            )
        } else {
            Check::new(ID, TITLE, Status::Fail, format!("{explicit} (from gpu.nvml_library) does not exist"))
                .hint("point --nvml-library / gpu.nvml_library at the driver's libnvidia-ml.so.1, or leave it empty to search the usual directories")
        };
    }
    let found: Vec<String> = NVML_LIBRARY_DIRS
        .iter()
        .map(|d| Path::new(d).join("libnvidia-ml.so.1"))
        .filter(|p| host.exists(p))
        .map(|p| p.display().to_string())
        .collect();
    if !found.is_empty() {
        return Check::new(ID, TITLE, Status::Ok, found.join("\n"));
    }
    let looked = format!("not found in {}", NVML_LIBRARY_DIRS.join(", "));
    if fake_backend {
        return Check::new(
            ID,
            TITLE,
            Status::Skip,
            format!("{looked}; not needed by the fake GPU backend"),
        );
    }
    Check::new(ID, TITLE, Status::Fail, looked).hint(
        "install the NVIDIA driver's user-space libraries (e.g. libnvidia-compute / nvidia-utils);\n\
         in a container: run with the nvidia runtime and NVIDIA_DRIVER_CAPABILITIES=utility,\n\
         or mount the host root and pass --root",
    )
}

/// `nvidia-toolkit`: the NVIDIA container runtime and its hook / `nvidia-ctk`.
/// Whether the open-file limit leaves room for `http.max_connections` (the serving roles raise
/// the soft limit to the hard one at start, so the hard one is what counts).
pub(crate) fn open_files(max_connections: usize) -> Check {
    const ID: &str = "open-files";
    const TITLE: &str = "Open-file limit";
    let Some((soft, hard)) = crate::fd_limit::current() else {
        return Check::new(ID, TITLE, Status::Skip, "RLIMIT_NOFILE could not be read");
    };
    let detail =
        format!("soft {soft}, hard {hard} (the soft limit is raised to the hard one at start)");
    match crate::fd_limit::cap_warning(max_connections, hard) {
        Some(why) => Check::new(ID, TITLE, Status::Warn, format!("{detail}; {why}"))
            .hint("LimitNOFILE=65536 in the unit (the shipped units set it), or --ulimit nofile=65536 / the runtime's default ulimits"),
        None => Check::new(ID, TITLE, Status::Ok, detail),
    }
}

/// The NVIDIA container runtime's configuration.
const NVIDIA_RUNTIME_CONFIG: &str = "/etc/nvidia-container-runtime/config.toml";
/// Its key that lets unprivileged containers choose their GPUs by `NVIDIA_VISIBLE_DEVICES`
/// (true when absent).
const ACCEPT_ENVVAR: &str = "accept-nvidia-visible-devices-envvar-when-unprivileged";

/// Whether the NVIDIA runtime takes `NVIDIA_VISIBLE_DEVICES` from unprivileged containers: then
/// a pod that sets it itself (`all`) sees GPUs the device plugin never gave it. `envvar`: the
/// strategy that needs it.
pub(crate) fn nvidia_envvar(host: &HostRoot, envvar: bool) -> Check {
    const ID: &str = "nvidia-envvar";
    const TITLE: &str = "NVIDIA_VISIBLE_DEVICES from pods";
    let Some(text) = host.read(NVIDIA_RUNTIME_CONFIG) else {
        return Check::new(
            ID,
            TITLE,
            Status::Skip,
            format!("no {NVIDIA_RUNTIME_CONFIG}"),
        );
    };
    let accepts = match text.parse::<toml::Table>() {
        Ok(t) => t
            .get(ACCEPT_ENVVAR)
            .and_then(toml::Value::as_bool)
            .unwrap_or(true),
        Err(e) => {
            return Check::new(
                ID,
                TITLE,
                Status::Warn,
                format!("{NVIDIA_RUNTIME_CONFIG}: {e}"),
            );
        }
    };
    if !accepts {
        return Check::new(ID, TITLE, Status::Ok, format!("{ACCEPT_ENVVAR} = false"));
    }
    let detail = format!(
        "{NVIDIA_RUNTIME_CONFIG}: {ACCEPT_ENVVAR} is true (or unset): an unprivileged pod that \
         sets NVIDIA_VISIBLE_DEVICES=all itself sees every GPU of the node"
    );
    let hint = if envvar {
        "the envvar device-list strategy needs it: install `gpushare webhook` (it refuses gpu-mem \
         pods that set the variable) or an admission policy for all pods, or switch to \
         --device-list-strategy volume-mounts / cdi-cri and set it to false"
    } else {
        "set it to false (with accept-nvidia-visible-devices-as-volume-mounts = true for the \
         volume-mounts strategy)"
    };
    Check::new(ID, TITLE, Status::Warn, detail).hint(hint)
}

pub(crate) fn nvidia_toolkit(host: &HostRoot) -> Check {
    const ID: &str = "nvidia-toolkit";
    const TITLE: &str = "NVIDIA container toolkit";
    let runtime = host.find_program(&["nvidia-container-runtime"]);
    let toolkit = host.find_program(&[
        "nvidia-ctk",
        "nvidia-container-toolkit",
        "nvidia-container-runtime-hook",
    ]);
    let cli = host.find_program(&["nvidia-container-cli"]);
    let show = |p: &Option<PathBuf>| {
        p.as_ref()
            .map_or("missing".to_string(), |p| p.display().to_string())
    };
    let detail = format!(
        "nvidia-container-runtime: {}\nnvidia-ctk / nvidia-container-toolkit: {}\nnvidia-container-cli: {}",
        show(&runtime),
        show(&toolkit),
        show(&cli)
    );
    let install = "install the NVIDIA Container Toolkit (package nvidia-container-toolkit):\n\
                   https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html";
    match (runtime.is_some(), toolkit.is_some()) {
        (true, true) => Check::new(ID, TITLE, Status::Ok, detail),
        (true, false) => Check::new(ID, TITLE, Status::Warn, detail).hint(install),
        (false, _) => Check::new(ID, TITLE, Status::Fail, detail).hint(install),
    }
}

/// `device-plugin-dir`: the kubelet's device-plugin directory exists.
pub fn device_plugin_dir(host: &HostRoot, dir: &Path) -> Check {
    const ID: &str = "device-plugin-dir";
    const TITLE: &str = "kubelet device-plugin directory";
    if host.is_dir(dir) {
        Check::new(ID, TITLE, Status::Ok, format!("{} exists", dir.display()))
    } else {
        Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!("{} is not a directory", dir.display()),
        )
        .hint(format!(
            "is the kubelet installed and running on this node? In a pod, mount the host's {} \
             (hostPath); otherwise set device_plugin.device_plugin_dir",
            dir.display()
        ))
    }
}

/// Whether `ft` is a unix socket (never, where the platform has none).
fn is_socket(ft: &fs::FileType) -> bool {
    #[cfg(unix)]
    return std::os::unix::fs::FileTypeExt::is_socket(ft);
    #[cfg(not(unix))]
    return {
        let _ = ft;
        false
    };
}

/// `kubelet-socket`: `kubelet.sock` in the device-plugin directory is a unix socket.
/// `missing_is_fail`: a missing socket fails (doctor) or only warns (preflight: the device
/// plugin waits for the kubelet).
pub(crate) fn kubelet_socket(host: &HostRoot, dir: &Path, missing_is_fail: bool) -> Check {
    const ID: &str = "kubelet-socket";
    const TITLE: &str = "kubelet registration socket";
    let sock = dir.join(wire::KUBELET_SOCKET);
    match fs::metadata(host.path(&sock)) {
        Ok(md) if is_socket(&md.file_type()) => Check::new(
            ID,
            TITLE,
            Status::Ok,
            format!("{} is a socket", sock.display()),
        ),
        Ok(_) => Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!("{} exists but is not a socket", sock.display()),
        )
        .hint("remove the file and restart the kubelet; it creates the socket at start"),
        Err(_) => Check::new(
            ID,
            TITLE,
            if missing_is_fail {
                Status::Fail
            } else {
                Status::Warn
            },
            format!("{} does not exist", sock.display()),
        )
        .hint("start the kubelet (systemctl status kubelet); it creates the socket at start"),
    }
}

/// What the node's files say about other device plugins (the API side is added by the
/// caller): `(conflicts, notes)`.
pub(crate) fn plugin_conflicts(
    host: &HostRoot,
    dir: &Path,
    preflight: bool,
) -> (Vec<String>, Vec<String>) {
    let mut conflicts = Vec::new();
    let mut notes = Vec::new();
    for name in NVIDIA_PLUGIN_SOCKETS {
        let sock = dir.join(name);
        if host.exists(&sock) {
            conflicts.push(format!(
                "{} exists: NVIDIA's device plugin serves nvidia.com/gpu on this node",
                sock.display()
            ));
        }
    }
    let procs = host.process_names();
    // comm is cut at 15 characters: Aliyun's `gpushare-device-plugin-v2` reads `gpushare-device`,
    // NVIDIA's `nvidia-device-plugin` reads `nvidia-device-p`.
    if procs.iter().any(|p| p.starts_with("gpushare-device")) {
        conflicts.push(
            "process gpushare-device-plugin (Aliyun's Go device plugin) is running: it serves aliyun.com/gpu-mem too"
                .to_string(),
        );
    }
    if procs.iter().any(|p| p.starts_with("nvidia-device-p")) {
        conflicts
            .push("process nvidia-device-plugin (NVIDIA's device plugin) is running".to_string());
    }
    let ours = dir.join(wire::PLUGIN_SOCKET);
    if !preflight && host.exists(&ours) {
        notes.push(format!(
            "{} exists: a device plugin serves {} here (fine when it is this gpushare device plugin)",
            ours.display(),
            wire::RESOURCE_GPU_MEM
        ));
    }
    (conflicts, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_that_takes_the_envvar_from_pods_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path());
        assert_eq!(nvidia_envvar(&host, true).status, Status::Skip);
        let cfg = dir.path().join("etc/nvidia-container-runtime");
        fs::create_dir_all(&cfg).unwrap();
        fs::write(
            cfg.join("config.toml"),
            "[nvidia-container-cli]\nldconfig = \"@/sbin/ldconfig\"\n",
        )
        .unwrap();
        let unset = nvidia_envvar(&host, false);
        assert_eq!(unset.status, Status::Warn);
        assert!(unset.hint.contains("false"), "{unset:?}");
        fs::write(
            cfg.join("config.toml"),
            format!("{ACCEPT_ENVVAR} = false\n"),
        )
        .unwrap();
        assert_eq!(nvidia_envvar(&host, true).status, Status::Ok);
        fs::write(cfg.join("config.toml"), format!("{ACCEPT_ENVVAR} = true\n")).unwrap();
        let envvar = nvidia_envvar(&host, true);
        assert_eq!(envvar.status, Status::Warn);
        assert!(envvar.hint.contains("webhook"), "{envvar:?}");
    }

    #[test]
    fn host_paths_are_read_under_the_root() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("etc/docker")).unwrap();
        fs::write(dir.path().join("etc/docker/daemon.json"), "{}").unwrap();
        let host = HostRoot::new(dir.path());
        assert_eq!(host.read("/etc/docker/daemon.json").as_deref(), Some("{}"));
        assert!(host.read("/etc/missing").is_none());
        assert_eq!(host.list("/etc"), vec![PathBuf::from("/etc/docker")]);
    }

    #[test]
    fn processes_come_from_proc_comm() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, comm) in [
            ("1", "systemd\n"),
            ("42", "nvidia-cuda-mps\n"),
            ("self", "x\n"),
        ] {
            fs::create_dir_all(dir.path().join("proc").join(pid)).unwrap();
            fs::write(dir.path().join("proc").join(pid).join("comm"), comm).unwrap();
        }
        let host = HostRoot::new(dir.path());
        assert_eq!(host.process_names(), vec!["systemd", "nvidia-cuda-mps"]);
    }

    #[test]
    fn a_socket_is_told_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let plugins = dir.path().join("var/lib/kubelet/device-plugins");
        fs::create_dir_all(&plugins).unwrap();
        let host = HostRoot::new(dir.path());
        let kdir = Path::new(wire::DEFAULT_DEVICE_PLUGIN_DIR);
        assert_eq!(kubelet_socket(&host, kdir, true).status, Status::Fail);
        assert_eq!(kubelet_socket(&host, kdir, false).status, Status::Warn);
        fs::write(plugins.join("kubelet.sock"), "").unwrap();
        assert_eq!(kubelet_socket(&host, kdir, true).status, Status::Fail);
        fs::remove_file(plugins.join("kubelet.sock")).unwrap();
        let _listener =
            std::os::unix::net::UnixListener::bind(plugins.join("kubelet.sock")).unwrap();
        assert_eq!(kubelet_socket(&host, kdir, true).status, Status::Ok);
        assert_eq!(device_plugin_dir(&host, kdir).status, Status::Ok);
    }
}
