//! A GPU node's host as driver enforcement sees it, without a GPU: the NVML stub with
//! per-cgroup memory limits (driver R615) over a fake cgroup v2 tree, a fake `/proc` whose
//! `<pid>/cgroup` puts a container's process in its own leaf, bundles with a `config.json`
//! carrying the CRI annotations; running a CDI hook the way runc runs it (the program and
//! arguments of the spec, the spec's environment only, the OCI state on stdin); the stub's
//! workload inside a container's cgroup; a fake `nvidia-smi memory-limits`. And the readback
//! as users see it, whatever the mechanism: the node annotation's rows, `/metrics` lines, the
//! pod's Events, `gpushare inspect`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use gpushare_sandbox::nvml_stub::{self, MemoryAccounting, StubGpu};
use serde_json::{Value, json};

use super::doctor_node;

/// The stub's GPUs: two 16 GiB GPUs.
pub fn gpus() -> Vec<StubGpu> {
    (0..2)
        .map(|i| StubGpu {
            uuid: format!("GPU-enf-{i}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 16 * 1024,
            minor: Some(i),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x1B + i),
        })
        .collect()
}

/// GiB in bytes.
pub const GIB: u64 = 1 << 30;

/// The fake host.
pub struct Host {
    dir: tempfile::TempDir,
    /// The stub `libnvidia-ml.so.1`.
    pub library: PathBuf,
    /// The fake `/proc`.
    pub proc: PathBuf,
    /// The fake cgroup v2 root.
    pub cgroup: PathBuf,
    /// The hook's state directory.
    pub state: PathBuf,
    /// How the stub keeps limits.
    pub backend: MemoryAccounting,
}

/// A container on the fake host.
#[derive(Clone, Debug)]
pub struct Container {
    /// The runtime's id.
    pub id: String,
    /// Its first process.
    pub pid: u32,
    /// Its cgroup in the hierarchy.
    pub relative: String,
    /// Its cgroup directory.
    pub path: PathBuf,
    /// Its bundle.
    pub bundle: PathBuf,
}

impl Host {
    /// A host with driver `driver`, the stub keeping limits with `backend`.
    pub fn new(backend: MemoryAccounting, driver: &str) -> Host {
        Host::with_library(backend, driver, nvml_stub::build)
    }

    /// The same with a stub built by `build` (e.g. one without the memory-limit calls).
    pub fn with_library(
        backend: MemoryAccounting,
        driver: &str,
        build: fn(&Path) -> anyhow::Result<PathBuf>,
    ) -> Host {
        let dir = tempfile::tempdir().expect("tempdir");
        let library = build(&dir.path().join("nvml")).expect("the NVML stub builds with cc");
        nvml_stub::write_config(&library, driver, &gpus()).expect("stub config");
        let cgroup = dir.path().join("cgroup");
        let proc = dir.path().join("proc");
        let state = dir.path().join("state");
        std::fs::create_dir_all(cgroup.join("kubepods")).expect("cgroup tree");
        std::fs::create_dir_all(&proc).expect("proc");
        let controllers = match backend {
            MemoryAccounting::Dmem => "cpuset cpu io memory pids dmem\n",
            _ => "cpuset cpu io memory pids misc\n",
        };
        std::fs::write(cgroup.join("cgroup.controllers"), controllers).expect("controllers");
        if backend == MemoryAccounting::Dmem {
            let capacity: String = gpus()
                .iter()
                .map(|g| {
                    format!(
                        "nvidia/{}/vidmem {}\n",
                        g.pci_bus_id.to_ascii_lowercase(),
                        g.memory_mib << 20
                    )
                })
                .collect();
            std::fs::write(cgroup.join("dmem.capacity"), capacity).expect("capacity");
            // kubepods is dmem-enabled: it counts the soft limits of the leaves below it.
            for f in ["dmem.max", "dmem.min", "dmem.current"] {
                std::fs::write(cgroup.join("kubepods").join(f), "").expect("dmem files");
            }
        }
        nvml_stub::enable_memory_limits(&library, backend, &cgroup).expect("limits on");
        Host {
            dir,
            library,
            proc,
            cgroup,
            state,
            backend,
        }
    }

    /// The temp directory everything lives in.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A container `id` (process `pid`) of pod `pod_uid`, in a leaf of its own with dmem files
    /// when the backend is dmem (`dmem_files`), a process in it, and a bundle naming
    /// `namespace/pod` and `container`.
    pub fn container(
        &self,
        pod_uid: &str,
        id: &str,
        pid: u32,
        (namespace, pod, container): (&str, &str, &str),
        dmem_files: bool,
    ) -> Container {
        let pod_dir = self.cgroup.join("kubepods").join(format!("pod{pod_uid}"));
        std::fs::create_dir_all(&pod_dir).expect("pod cgroup");
        if self.backend == MemoryAccounting::Dmem {
            for f in ["dmem.max", "dmem.min", "dmem.current"] {
                let p = pod_dir.join(f);
                if !p.exists() {
                    std::fs::write(p, "").expect("dmem files");
                }
            }
        }
        let relative = format!("/kubepods/pod{pod_uid}/cri-containerd-{id}.scope");
        let path = self.cgroup.join(relative.trim_start_matches('/'));
        std::fs::create_dir_all(&path).expect("leaf");
        if dmem_files {
            for f in ["dmem.max", "dmem.min", "dmem.current"] {
                std::fs::write(path.join(f), "").expect("dmem files");
            }
        }
        std::fs::write(path.join("cgroup.events"), "populated 1\nfrozen 0\n").expect("events");
        self.process(pid, &format!("0::{relative}\n"));
        let bundle = self.root().join("bundles").join(id);
        std::fs::create_dir_all(&bundle).expect("bundle");
        std::fs::write(
            bundle.join("config.json"),
            json!({
                "ociVersion": "1.2.0",
                "process": { "args": ["sleep", "infinity"] },
                "annotations": {
                    "io.kubernetes.cri.sandbox-namespace": namespace,
                    "io.kubernetes.cri.sandbox-name": pod,
                    "io.kubernetes.cri.sandbox-uid": pod_uid,
                    "io.kubernetes.cri.container-name": container,
                },
            })
            .to_string(),
        )
        .expect("config.json");
        Container {
            id: id.to_string(),
            pid,
            relative,
            path,
            bundle,
        }
    }

    /// Writes `<proc>/<pid>/cgroup`.
    pub fn process(&self, pid: u32, cgroup_file: &str) {
        let dir = self.proc.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("proc dir");
        std::fs::write(dir.join("cgroup"), cgroup_file).expect("cgroup file");
    }

    /// The container stopped: its cgroup holds no process any more.
    pub fn stop(&self, c: &Container) {
        std::fs::write(c.path.join("cgroup.events"), "populated 0\nfrozen 0\n").expect("events");
    }

    /// The line of GPU `index` in `file` (`dmem.max`, `dmem.min`, `dmem.current`) of cgroup
    /// directory `dir`: its value.
    pub fn dmem(&self, dir: &Path, file: &str, index: usize) -> Option<String> {
        let key = format!(
            "nvidia/{}/vidmem",
            gpus()[index].pci_bus_id.to_ascii_lowercase()
        );
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key} ")).map(str::to_string))
    }

    /// The `--cgroup-root`, `--proc-root`, `--state-dir` and NVML flags of a hook run here.
    pub fn hook_flags(&self) -> Vec<String> {
        vec![
            "--gpu-backend".into(),
            "nvml".into(),
            "--nvml-library".into(),
            self.library.display().to_string(),
            "--cgroup-root".into(),
            self.cgroup.display().to_string(),
            "--proc-root".into(),
            self.proc.display().to_string(),
            "--state-dir".into(),
            self.state.display().to_string(),
        ]
    }

    /// `[node]` and `[gpu]` for driver enforcement on this host: the NVML stub, the hook (this
    /// test build of gpushare), the state directory, the fake roots for the agent and the
    /// hook, a readback every second.
    pub fn driver_config(&self, config: &mut gpushare::config::Config) {
        config.gpu.backend = gpushare::config::GpuBackendKind::Nvml;
        config.gpu.nvml_library = self.library.display().to_string();
        let n = &mut config.node;
        n.enforcement = gpushare::config::enforcement::Enforcement::Driver;
        n.enforcement_hook = super::bin();
        n.enforcement_state_dir = self.state.clone();
        n.enforcement_cdi_dir = self.root().join("limit-cdi");
        n.enforcement_check_secs = 1;
        n.cgroup_root = self.cgroup.clone();
        n.runtime_cgroup_root = self.cgroup.clone();
        n.runtime_proc_root = self.proc.clone();
    }

    /// The NVML backend over the stub.
    pub fn backend(&self) -> std::sync::Arc<dyn gpushare::gpu::GpuBackend> {
        std::sync::Arc::new(
            gpushare::gpu::nvml::NvmlBackend::open(&self.library.display().to_string())
                .expect("the stub loads"),
        )
    }

    /// NVIDIA's CDI spec for the stub's GPUs (devices `0`, `1` and their UUIDs), in a
    /// directory of its own; returns the directory.
    pub fn nvidia_cdi_spec(&self) -> PathBuf {
        let dir = self.root().join("nvidia-cdi");
        std::fs::create_dir_all(&dir).expect("dir");
        let mut devices = Vec::new();
        for (i, g) in gpus().iter().enumerate() {
            for name in [i.to_string(), g.uuid.clone()] {
                devices.push(json!({
                    "name": name,
                    "containerEdits": { "deviceNodes": [{ "path": format!("/dev/nvidia{i}") }] },
                }));
            }
        }
        std::fs::write(
            dir.join("nvidia.json"),
            json!({ "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices })
                .to_string(),
        )
        .expect("spec");
        dir
    }

    /// Runs the stub's workload in container `c`'s cgroup: what it sees of GPU `index`, then
    /// each allocation.
    pub fn workload(&self, c: &Container, index: usize, allocs: &[u64]) -> Output {
        let program = nvml_stub::build_workload(&self.root().join("workload")).expect("builds");
        Command::new(program)
            .arg(&self.library)
            .arg(&gpus()[index].uuid)
            .args(allocs.iter().map(u64::to_string))
            .env(nvml_stub::CGROUP_ENV, &c.path)
            .output()
            .expect("the workload runs")
    }
}

/// The OCI state a runtime hands a hook for container `c`.
pub fn oci_state(c: &Container) -> Value {
    json!({
        "ociVersion": "1.2.0",
        "id": c.id,
        "status": "created",
        "pid": c.pid,
        "bundle": c.bundle.display().to_string(),
        "annotations": {},
    })
}

/// Runs a CDI hook (`hook`: the spec's `{path, args, env}`) as runc does: `path` with
/// `args[1..]`, `args[0]` as argv[0], only the hook's `env`, the OCI `state` on stdin.
pub fn run_hook_as_runtime(hook: &Value, state: &Value) -> Output {
    let path = hook["path"].as_str().expect("a hook path");
    let args: Vec<String> = hook["args"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let env: Vec<(String, String)> = hook["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            e.as_str()?
                .split_once('=')
                .map(|(k, v)| (k.into(), v.into()))
        })
        .collect();
    let mut cmd = Command::new(path);
    #[cfg(unix)]
    if let Some(argv0) = args.first() {
        std::os::unix::process::CommandExt::arg0(&mut cmd, argv0);
    }
    cmd.args(args.iter().skip(1))
        .env_clear()
        .envs(env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("the hook starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(state.to_string().as_bytes())
        .expect("state written");
    child.wait_with_output().expect("the hook ends")
}

/// A hook spec for `gpushare cdi-hook memory-limit` with `limits` and `flags`.
pub fn hook(limits: &[(&str, u64)], flags: &[String]) -> Value {
    let mut args = vec![
        "gpushare".to_string(),
        "cdi-hook".into(),
        "memory-limit".into(),
    ];
    for (uuid, bytes) in limits {
        args.push("--limit".into());
        args.push(format!("{uuid}={bytes}"));
    }
    args.extend(flags.iter().cloned());
    json!({
        "hookName": "createRuntime",
        "path": super::bin().display().to_string(),
        "args": args,
        "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
    })
}

/// A fake `nvidia-smi` in `dir` that appends its arguments to `dir/calls` and answers
/// `memory-limits --get` with `get_output`; `fail` makes every call print it and exit 1.
pub fn fake_smi(dir: &Path, get_output: &str, fail: Option<&str>) -> PathBuf {
    let path = dir.join("nvidia-smi");
    let calls = dir.join("calls");
    let body = match fail {
        Some(text) => format!("echo \"{text}\" >&2\nexit 1\n"),
        None => format!(
            "case \"$*\" in\n  *--get*) printf '{}' ;;\nesac\nexit 0\n",
            get_output.replace('\n', "\\n")
        ),
    };
    std::fs::write(
        &path,
        format!("#!/bin/sh\necho \"$*\" >> '{}'\n{body}", calls.display()),
    )
    .expect("script");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    path
}

/// The node annotation's rows (`gpushare.io/container-gpu-memory`), once published.
pub fn published_rows(api: &gpushare_sandbox::apiserver::ApiServer, node: &str) -> Vec<Value> {
    api.get_object("nodes", None, node)
        .and_then(|n| {
            n["metadata"]["annotations"][gpushare::core::wire::NODE_ANN_CONTAINER_GPU_MEMORY]
                .as_str()
                .map(str::to_string)
        })
        .and_then(|t| serde_json::from_str::<Vec<Value>>(&t).ok())
        .unwrap_or_default()
}

/// The row of `pod`'s `container` among `rows`.
pub fn row<'a>(rows: &'a [Value], pod: &str, container: &str) -> Option<&'a Value> {
    rows.iter()
        .find(|r| r["pod"] == pod && r["container"] == container)
}

/// The Events of `default/<pod>` with `reason`.
pub fn pod_events(
    api: &gpushare_sandbox::apiserver::ApiServer,
    pod: &str,
    reason: &str,
) -> Vec<Value> {
    api.list_objects("events.events.k8s.io", Some("default"))
        .into_iter()
        .filter(|e| e["reason"] == reason && e["regarding"]["name"] == pod)
        .collect()
}

/// The value of the metric line `name{…labels…} value` whose labels hold all of `labels`.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> Option<String> {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next().map(str::to_string))
}

/// `gpushare inspect -o <format>` against the sandbox (off the test's runtime, which serves it).
pub async fn inspect(kubeconfig: &str, format: &str) -> Output {
    let args = ["inspect", "-o", format, "--kubeconfig", kubeconfig].map(String::from);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        super::run(&args)
    })
    .await
    .expect("inspect ran")
}

/// `inspect` over `kubeconfig` shows pod `default/p`'s share: the `wide` view names it as
/// `wide_share` (`default/p=1.0/4`), and in the JSON report the first pod on GPU `gpu` uses
/// `used` bytes with its first container's limit `limit`. That share, as JSON.
pub async fn assert_inspect_share(
    kubeconfig: &str,
    gpu: usize,
    wide_share: &str,
    used: u64,
    limit: u64,
) -> Value {
    let wide = inspect(kubeconfig, "wide").await;
    let text = super::stdout(&wide);
    assert!(wide.status.success(), "{}", super::stderr(&wide));
    assert!(text.contains(wide_share), "{wide_share} not in:\n{text}");
    let json = inspect(kubeconfig, "json").await;
    let report: Value = serde_json::from_str(&super::stdout(&json)).expect("json");
    let share = &report["nodes"][0]["gpus"][gpu]["pods"][0];
    assert_eq!(share["gpuMemory"]["usedBytes"], used, "{share}");
    assert_eq!(
        share["gpuMemory"]["containers"][0]["limit"], limit,
        "{share}"
    );
    share.clone()
}

/// `gpushare doctor --role node --no-cluster` with `config` (a gpushare.toml) and the NVML
/// library `nvml` (the stub), plus `extra` flags: its `enforcement` check as
/// `status | detail | hint` (the other checks read this machine).
pub fn doctor_enforcement(config: &Path, nvml: &Path, extra: &[&str]) -> String {
    let (nvml, config) = (nvml.display().to_string(), config.display().to_string());
    let nvml = ["--gpu-backend", "nvml", "--nvml-library", &nvml];
    let args = [&["--config", &config, "-o", "json"], &nvml[..], extra].concat();
    let report = doctor_node::report_of(&doctor_node::doctor_no_cluster("node", &args));
    let check = doctor_node::check_of(&report, "enforcement");
    format!(
        "{} | {} | {}",
        check["status"], check["detail"], check["hint"]
    )
}
