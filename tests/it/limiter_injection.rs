//! The CUDA memory limiter injected by the node roles, end to end without a GPU: over the
//! sandbox kubelet (device plugin) and the sandbox DRA kubelet and allocator (DRA plugin), a
//! 4 GiB pod on a 16 GiB fake GPU is answered the limiter's mounts (Allocate's `mounts`; the
//! claim's CDI spec `containerEdits.mounts`), its limits file says 4 GiB for its GPU's UUID,
//! and with exactly those mounts applied in a private mount namespace (as a container runtime
//! applies them) the limiter's driver-API probe on the fake driver gets
//! `CUDA_ERROR_OUT_OF_MEMORY` past 4 GiB through the lookup routes, `cuMemGetInfo`,
//! `cuDeviceTotalMem` and NVML report 4 GiB, and two processes of the container share the
//! 4 GiB. The node agent installs the library on the host at start, reads each container's
//! ledger into `/metrics` (promtool checks the page), the node annotation and `inspect -o
//! wide/json`, and removes a container's files when its pod or claim goes. `limiter` without
//! the library refuses to start; `auto` there falls back saying why; doctor says which GPU
//! gets the limiter, the library's glibc floor, and the fix when it is missing.
//!
//! The mount namespace needs root (or `sudo -n`): elsewhere the container part prints
//! `SKIPPED:` (a failure under `CI=true`) and the rest still runs.

use std::path::PathBuf;

use gpushare::config::Config;
use gpushare::config::enforcement::Enforcement;
use gpushare::dra::role;
use gpushare::gpu::fake::FakeBackend;
use gpushare::node::enforcement::Mechanism;
use gpushare::node::paths::ServingPath;
use gpushare::shutdown::Shutdown;
use gpushare_limiter_contract::{GpuUuid, Limits};
use gpushare_sandbox::apiserver::ApiServer;

use crate::support::clients;
use crate::support::deviceplugin_cluster::{self, NODE as DP_NODE};
use crate::support::dra::dra_node_api;
use crate::support::dra_node::{PreparedPod, prepared_gpu_pod};
use crate::support::enforcement::{inspect, metric, published_rows, row};
use crate::support::limiter::{
    BindMount, ContainerRoot, GIB, GPU0, Running, allocate_mounts, cdi_mounts, library,
    namespace_or_skip, probe, run_to_end, sixteen_gib,
};
use crate::support::socket_dir::short_tempdir;
use crate::support::stderr;
use crate::support::wait::{DEADLINE, poll, wait_until};

const DRA_NODE: &str = "node-a";

/// The host directories of the limiter on a test node.
struct HostDirs {
    dir: tempfile::TempDir,
}

impl HostDirs {
    fn new() -> HostDirs {
        HostDirs {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    fn lib(&self) -> PathBuf {
        self.dir.path().join("lib")
    }

    fn run(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// `[node]` for the limiter with these directories, read back every second.
    fn configure(&self, c: &mut Config, enforcement: Enforcement) {
        c.node.enforcement = enforcement;
        c.node.limiter_library = library();
        c.node.limiter_dir = self.lib();
        c.node.limiter_run_dir = self.run();
        c.node.enforcement_check_secs = 1;
    }

    /// The per-container directories now.
    fn containers(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.run())
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

/// The one fake GPU of the tests: the limiter's fake driver's GPU, 16 GiB.
fn backend() -> FakeBackend {
    FakeBackend::from_spec(&format!("{GPU0}=16GiB")).expect("fake GPU")
}

/// The mount at `container_path` among `mounts`.
fn mount_at<'a>(mounts: &'a [BindMount], container_path: &str) -> &'a BindMount {
    mounts
        .iter()
        .find(|m| m.container == container_path)
        .unwrap_or_else(|| panic!("no mount at {container_path}: {mounts:?}"))
}

/// The limiter's four mounts, each at the contract's path, from the host directories; the
/// limits file says `bytes` for the fake GPU.
fn check_mounts(mounts: &[BindMount], host: &HostDirs, bytes: u64) {
    use gpushare_limiter_contract as c;
    let lib = mount_at(mounts, c::LIBRARY_PATH);
    assert_eq!(lib.host, host.lib().join(c::LIBRARY_FILE_NAME));
    assert!(lib.read_only);
    assert_eq!(
        std::fs::read(&lib.host).expect("installed on the host"),
        std::fs::read(library()).expect("the build"),
        "the node agent installed the library it was given"
    );
    let preload = mount_at(mounts, c::PRELOAD_PATH);
    assert!(preload.read_only);
    assert_eq!(
        std::fs::read_to_string(&preload.host).expect("the preload list"),
        c::preload_file_contents()
    );
    let limits = mount_at(mounts, c::LIMITS_PATH);
    assert!(limits.read_only);
    assert!(limits.host.starts_with(host.run()), "{limits:?}");
    let parsed =
        Limits::parse(&std::fs::read_to_string(&limits.host).expect("limits")).expect("parses");
    assert_eq!(
        parsed.iter().collect::<Vec<_>>(),
        [(&GpuUuid::parse(GPU0).expect("uuid"), bytes)],
        "the limits file names exactly its GPU"
    );
    let state = mount_at(mounts, c::STATE_DIR);
    assert!(!state.read_only);
    assert!(state.host.is_dir() && state.host.starts_with(host.run()));
    assert_eq!(mounts.len(), 4, "{mounts:?}");
}

/// In a container with `mounts`: past 4 GiB out of memory through several lookup routes, 4 GiB
/// in the driver API's and NVML's views.
fn held_to_four_gib(root: &ContainerRoot) {
    let four = (4 * GIB).to_string();
    for route in [
        "linked",
        "dlsym-default",
        "dlsym-next",
        "dlsym-handle",
        "getproc:11030",
        "getproc2:12080",
        "getproc2-ptsz:12080",
    ] {
        let out = probe(
            root,
            route,
            &[
                "ctx", "0", "info", "total", "0", "nvml", "0", "alloc", &four, "alloc", "1",
            ],
        );
        assert_eq!(
            out,
            [
                "ctx 0 0".to_string(),
                format!("info 0 {four} {four}"),
                format!("total 0 {four}"),
                format!("nvml 0 {four} {four} 0"),
                format!("alloc {four} 0"),
                "alloc 1 2".into(),
            ],
            "route {route}: 2 is CUDA_ERROR_OUT_OF_MEMORY"
        );
    }
}

/// glibc's loader maps `LD_PRELOAD` before `/etc/ld.so.preload`: a library the pod preloads
/// comes first in the search order, cannot remove the limiter, and its `dlsym(RTLD_NEXT, …)`
/// still reaches the limiter's hooks. `CUDA_DISABLE_CONTROL` means nothing here.
fn a_preloaded_library_of_the_pod_still_meets_the_limiter(root: &ContainerRoot) {
    let four = (4 * GIB).to_string();
    let mut cmd = root.command(
        "/work/probe",
        &["interposer-next", "ctx", "0", "alloc", &four, "alloc", "1"],
    );
    cmd.env("FAKE_GPUS", sixteen_gib())
        .env("LD_PRELOAD", "/work/libnext.so")
        .env("CUDA_DISABLE_CONTROL", "true");
    assert_eq!(
        run_to_end(&mut cmd),
        [
            "ctx 0 0".to_string(),
            format!("alloc {four} 0"),
            "alloc 1 2".into()
        ]
    );
}

/// A process of the container holding `bytes` until it is let go.
fn holding(root: &ContainerRoot, bytes: u64) -> Running {
    let mut cmd = root.command(
        "/work/probe",
        &[
            "dlsym-handle",
            "ctx",
            "0",
            "alloc",
            &bytes.to_string(),
            "wait",
        ],
    );
    cmd.env("FAKE_GPUS", sixteen_gib()).env("LD_PRELOAD", "");
    let mut a = Running::start(&mut cmd);
    assert_eq!(
        a.until("waiting"),
        ["ctx 0 0".to_string(), format!("alloc {bytes} 0")]
    );
    a
}

/// A second process of the container, started by a shell with an empty environment, shares
/// what is left: 2 GiB refused, 1 GiB granted, NVML shows the container's 4 GiB used.
fn second_process_shares(root: &ContainerRoot) {
    let script = format!(
        "exec env -i /work/probe_linked linked ctx 0 alloc {} alloc {} nvml 0",
        2 * GIB,
        GIB
    );
    let mut cmd = root.command("/bin/sh", &["-c", &script]);
    cmd.env("FAKE_GPUS", sixteen_gib());
    assert_eq!(
        run_to_end(&mut cmd),
        [
            "ctx 0 0".to_string(),
            format!("alloc {} 2", 2 * GIB),
            format!("alloc {GIB} 0"),
            format!("nvml 0 {} 0 {}", 4 * GIB, 4 * GIB),
        ]
    );
}

/// The device plugin's node with its 16 GiB GPU allocatable (what `inspect` reads).
fn dp_node() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {DP_NODE}\n  labels:\n    gpushare: \"true\"\n\
         status:\n  capacity: {{cpu: \"8\", aliyun.com/gpu-mem: \"16\", aliyun.com/gpu-count: \"1\"}}\n  \
         allocatable: {{cpu: \"8\", aliyun.com/gpu-mem: \"16\", aliyun.com/gpu-count: \"1\"}}\n"
    )
}

#[tokio::test]
async fn device_plugin_a_4gib_pod_gets_the_limiter_mounts_and_is_held_to_4gib() {
    let host = HostDirs::new();
    let cluster = deviceplugin_cluster::cluster_on(
        backend(),
        &dp_node(),
        |_| {},
        |c| host.configure(c, Enforcement::Limiter),
    )
    .await
    .expect("the device plugin starts with the limiter");
    let agent = cluster.plugin().agent().clone();
    assert_eq!(
        agent.enforcement().mechanism(ServingPath::DevicePlugin),
        Mechanism::Limiter
    );
    cluster.bound_pod("p", &[("main", 4)], Some(0), 1);
    let (_, resp) = cluster.allocate("p", "main", 4).await.expect("allocated");
    // The GPU is handed over as the strategy says; the limiter adds mounts only.
    assert_eq!(resp.envs["ALIYUN_COM_GPU_MEM_IDX"], "0");
    assert_eq!(resp.envs["ALIYUN_COM_GPU_MEM_CONTAINER"], "4");
    assert!(
        resp.devices.is_empty() && resp.cdi_devices.is_empty(),
        "{resp:?}"
    );
    assert!(
        !resp
            .envs
            .keys()
            .any(|k| k.contains("LD_PRELOAD") || k.contains("GPUSHARE")),
        "no variable carries the limiter: {:?}",
        resp.envs
    );
    let mounts = allocate_mounts(&resp);
    check_mounts(&mounts, &host, 4 * GIB);
    let uid = crate::support::objects::pod_uid(&cluster.api, "p");
    assert_eq!(host.containers(), [format!("dp-{uid}-main")]);

    let kc = cluster.api.admin_kubeconfig_path().display().to_string();
    if let Some(runner) =
        namespace_or_skip("limiter_injection::device_plugin_a_4gib_pod_gets_the_limiter_mounts")
    {
        let root = ContainerRoot::new(runner, mounts.clone());
        held_to_four_gib(&root);
        a_preloaded_library_of_the_pod_still_meets_the_limiter(&root);
        let a = holding(&root, 3 * GIB);
        second_process_shares(&root);

        // The readback: what the container's processes hold, from its ledger.
        wait_until("the ledger is read back", || {
            row(&published_rows(&cluster.api, DP_NODE), "p", "main").is_some_and(|r| {
                r["state"] == "enforced"
                    && r["mechanism"] == "limiter"
                    && r["used"] == 3 * GIB
                    && r["limit"] == 4 * GIB
            })
        })
        .await;
        let text = cluster.plugin().render_metrics();
        let labels = ["pod=\"p\"", "container=\"main\"", GPU0];
        assert_eq!(
            metric(&text, "gpushare_container_gpu_memory_used_bytes", &labels),
            Some((3 * GIB).to_string()),
            "{text}"
        );
        assert_eq!(
            metric(&text, "gpushare_container_gpu_memory_limit_bytes", &labels),
            Some((4 * GIB).to_string())
        );
        assert_eq!(
            metric(
                &text,
                "gpushare_enforcement_containers",
                &["state=\"enforced\""]
            ),
            Some("1".to_string())
        );
        if let Some((ok, said)) = clients::promtool_check(&text) {
            assert!(ok, "promtool check metrics:\n{said}\n---\n{text}");
        }
        let share = crate::support::enforcement::assert_inspect_share(
            &kc,
            0,
            "default/p=3.0/4",
            3 * GIB,
            4 * GIB,
        )
        .await;
        assert_eq!(share["gpuMemory"]["containers"][0]["mechanism"], "limiter");
        a.finish();
    }

    // The pod goes: its container's files go with it.
    cluster
        .api
        .delete_object("pods", Some("default"), "p")
        .expect("deleted");
    wait_until("the gone pod's limiter files are removed", || {
        host.containers().is_empty()
    })
    .await;
    cluster.stop().await;
}

/// The DRA role with `config` over `api` and the fake GPUs.
async fn start_dra_plugin(config: &Config, api: &ApiServer) -> role::DraPluginHandle {
    role::start(
        config,
        api.admin_client(),
        std::sync::Arc::new(backend()),
        Shutdown::never(),
    )
    .await
    .expect("the DRA plugin starts")
}

#[tokio::test]
async fn dra_a_4gib_claim_gets_the_limiter_in_its_cdi_spec_and_is_held_to_4gib() {
    let host = HostDirs::new();
    let api = dra_node_api(DRA_NODE).await;
    let dir = short_tempdir();
    let config = crate::support::dra_node::config_in(dir.path(), |config| {
        config.dra.admin_address = "127.0.0.1:0".into();
        host.configure(config, Enforcement::Auto);
    });
    let plugin = start_dra_plugin(&config, &api).await;
    let decision = plugin
        .agent()
        .enforcement()
        .admit(ServingPath::Dra)
        .expect("auto decides");
    assert_eq!(decision.mechanism, Mechanism::Limiter, "{}", decision.why);
    assert!(decision.why.contains("not driver"), "{}", decision.why);
    let PreparedPod {
        kubelet,
        claim_uid,
        spec,
        pod_uid: uid,
    } = prepared_gpu_pod(&config, &api, "p", 4).await;
    let edits = &spec["devices"][0]["containerEdits"];
    assert!(
        edits["hooks"].as_array().is_none_or(Vec::is_empty),
        "{edits}"
    );
    let mounts = cdi_mounts(edits);
    check_mounts(&mounts, &host, 4 * GIB);
    assert_eq!(host.containers(), [format!("dra-{claim_uid}-0")]);

    if let Some(runner) =
        namespace_or_skip("limiter_injection::dra_a_4gib_claim_gets_the_limiter_in_its_cdi_spec")
    {
        let root = ContainerRoot::new(runner, mounts.clone());
        held_to_four_gib(&root);
        let a = holding(&root, 3 * GIB);
        second_process_shares(&root);
        // The share's pod and container are found for the readback.
        wait_until("the share's ledger is read back under its pod", || {
            row(&published_rows(&api, DRA_NODE), "p", "main").is_some_and(|r| {
                r["state"] == "enforced" && r["used"] == 3 * GIB && r["mechanism"] == "limiter"
            })
        })
        .await;
        let kc = api.admin_kubeconfig_path().display().to_string();
        let wide = inspect(&kc, "wide").await;
        assert!(wide.status.success(), "{}", stderr(&wide));
        a.finish();
    }

    // The pod finishes: kubelet unprepares the claim, and its files go with its spec.
    api.set_pod_phase("default", "p", "Succeeded")
        .expect("finished");
    assert_eq!(kubelet.sync().await.expect("sync").unprepared, [uid]);
    assert!(host.containers().is_empty(), "{:?}", host.containers());
    plugin.stop().await;
    api.shutdown().await;
}

/// The device-plugin path with `enforcement` over `host` and the limiter library at `library`.
async fn cluster_with_library(
    host: &HostDirs,
    enforcement: Enforcement,
    library: &std::path::Path,
) -> anyhow::Result<deviceplugin_cluster::Cluster> {
    deviceplugin_cluster::cluster_on(
        backend(),
        &deviceplugin_cluster::node_yaml(""),
        |_| {},
        |c| {
            host.configure(c, enforcement);
            c.node.limiter_library = library.to_path_buf();
        },
    )
    .await
}

#[tokio::test]
async fn limiter_without_the_library_refuses_to_start_and_auto_falls_back_saying_why() {
    let host = HostDirs::new();
    let missing = host.dir.path().join("no-such.so");
    let Err(refused) = cluster_with_library(&host, Enforcement::Limiter, &missing).await else {
        panic!("limiter without the library refuses to start");
    };
    let msg = format!("{refused:#}");
    assert!(msg.contains("enforcement = limiter cannot work"), "{msg}");
    assert!(
        msg.contains("the limiter library is not installed"),
        "{msg}"
    );
    assert!(msg.contains("--limiter-library"), "{msg}");

    // A file that is not a library is refused, not installed.
    let junk = host.dir.path().join("junk.so");
    std::fs::write(&junk, "#!/bin/sh\n").expect("junk");
    let cluster = cluster_with_library(&host, Enforcement::Auto, &junk)
        .await
        .expect("auto starts");
    let decision = cluster.enforcement_decision();
    assert_eq!(decision.mechanism, Mechanism::None);
    assert!(
        decision.why.contains("not limiter") && decision.why.contains("not a 64-bit ELF"),
        "{}",
        decision.why
    );
    assert!(!host.lib().join("libgpushare_limiter.so").exists());
    cluster.bound_pod("p", &[("main", 4)], Some(0), 1);
    let (_, resp) = cluster.allocate("p", "main", 4).await.expect("allocated");
    assert!(resp.mounts.is_empty(), "no limiter: {resp:?}");
    cluster.stop().await;
}

#[tokio::test]
async fn a_restarted_node_agent_removes_the_files_of_pods_gone_while_it_was_down_but_not_in_use() {
    use gpushare::node::enforcement::limiter::containers::{self, Key, Owner};
    let host = HostDirs::new();
    // What an earlier run left: the files of three device-plugin containers. Pod `stays` still
    // runs; pods `gone` and `busy` were deleted while no agent ran, but a process of `busy`
    // still holds memory.
    let owner = |pod: &str, uid: &str| Owner {
        path: containers::PATH_DEVICE_PLUGIN.into(),
        namespace: "default".into(),
        pod: pod.into(),
        pod_uid: uid.into(),
        container: "main".into(),
        limits: [(GPU0.to_string(), 2 * GIB)].into(),
        ..Owner::default()
    };
    for (pod, uid) in [
        ("gone", "00000000-0000-0000-0000-00000000bbbb"),
        ("busy", "00000000-0000-0000-0000-00000000cccc"),
    ] {
        let key = Key::device_plugin(uid, "main").expect("key");
        containers::create(&host.run(), &key, &owner(pod, uid)).expect("written");
    }
    let busy = host
        .run()
        .join("dp-00000000-0000-0000-0000-00000000cccc-main");
    let mut holder = std::process::Command::new(crate::support::limiter::built().join("probe"));
    holder
        .args([
            "dlsym-handle",
            "ctx",
            "0",
            "alloc",
            &GIB.to_string(),
            "wait",
        ])
        .env("LD_PRELOAD", library())
        .env("GPUSHARE_LIMITER_ROOT", &busy)
        .env("FAKE_GPUS", sixteen_gib())
        .env_remove("LD_LIBRARY_PATH");
    let mut holder = Running::start(&mut holder);
    assert_eq!(
        holder.until("waiting"),
        ["ctx 0 0".to_string(), format!("alloc {GIB} 0")]
    );

    let stays_key = std::sync::Mutex::new(String::new());
    let cluster = deviceplugin_cluster::cluster_on(
        backend(),
        &deviceplugin_cluster::node_yaml(""),
        |api| {
            let pod = deviceplugin_cluster::pod_json("stays", &[], &[("main", 2)], Some(0), 1);
            let created = api.create_object(pod).expect("the pod that stays");
            let uid = created["metadata"]["uid"]
                .as_str()
                .expect("uid")
                .to_string();
            let key = Key::device_plugin(&uid, "main").expect("key");
            containers::create(&host.run(), &key, &owner("stays", &uid)).expect("written");
            *stays_key.lock().expect("lock") = key.to_string();
        },
        |c| host.configure(c, Enforcement::Limiter),
    )
    .await
    .expect("starts");
    let stays_key = stays_key.into_inner().expect("lock");
    let busy_key = busy
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let mut want = vec![stays_key.clone(), busy_key.clone()];
    want.sort();
    poll(
        "the first cycle removed the gone pod's files",
        DEADLINE,
        || {
            let now = host.containers();
            let held = now == want;
            async move { if held { Ok(()) } else { Err(now) } }
        },
    )
    .await;
    // The last process of `busy` exits: its files go at the next cycle.
    holder.finish();
    wait_until(
        "the busy one's files go once no process holds memory",
        || host.containers() == [stays_key.clone()],
    )
    .await;
    cluster.stop().await;
}

/// `gpushare doctor --role node` with the NVML stub's one GPU (the fake driver's UUID) and
/// `[node]` naming these limiter directories and `library`: the `enforcement` check as
/// `status | detail | hint`.
fn doctor(host: &HostDirs, library: &std::path::Path, extra: &[&str]) -> String {
    use gpushare_sandbox::nvml_stub::{self, StubGpu};
    let stub = nvml_stub::build(&host.dir.path().join("nvml")).expect("the NVML stub builds");
    nvml_stub::write_config(
        &stub,
        "550.54.15",
        &[StubGpu {
            uuid: GPU0.into(),
            name: "NVIDIA A10".into(),
            memory_mib: 16 * 1024,
            minor: Some(0),
            pci_bus_id: "00000000:1B:00.0".into(),
        }],
    )
    .expect("stub config");
    let config = host.dir.path().join("gpushare.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nlimiter_library = \"{}\"\nlimiter_dir = \"{}\"\nlimiter_run_dir = \"{}\"\n",
            library.display(),
            host.lib().display(),
            host.run().display()
        ),
    )
    .expect("config");
    crate::support::enforcement::doctor_enforcement(&config, &stub, extra)
}

#[test]
fn doctor_says_which_gpus_get_the_limiter_what_it_needs_and_the_fix() {
    let host = HostDirs::new();
    let lib = library();
    // Not installed yet: the node agent installs it at start; its glibc floor is named.
    let text = doctor(&host, &lib, &["--enforcement", "limiter"]);
    for want in [
        "\"ok\"",
        &format!("GPU 0 ({GPU0}) on the device plugin: limiter"),
        "needs glibc 2.",
        "statically linked and musl programs are not limited",
        "not installed yet: the node agent installs",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }
    assert!(!host.lib().exists(), "doctor only looks");
    // auto on a driver older than R615 takes the limiter, saying why not the driver.
    let text = doctor(&host, &lib, &[]);
    assert!(
        text.contains("on the device plugin: limiter") && text.contains("not driver: driver 550"),
        "{text}"
    );
    // No library anywhere: limiter fails with the fix, auto falls back saying why.
    let missing = host.dir.path().join("missing.so");
    let text = doctor(&host, &missing, &["--enforcement", "limiter"]);
    for want in [
        "\"fail\"",
        "the limiter library is not installed",
        "--limiter-library",
        "refuses to start with enforcement = limiter",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }
    let text = doctor(&host, &missing, &[]);
    assert!(
        text.contains("on the device plugin: none") && text.contains("not limiter: the limiter"),
        "{text}"
    );
}

#[tokio::test]
async fn a_restarted_dra_plugin_removes_the_limiter_files_of_claims_it_no_longer_holds() {
    use gpushare::node::enforcement::limiter::containers::{self, Key, Owner};
    let host = HostDirs::new();
    // A share of a claim unprepared while no plugin ran: the checkpoint holds nothing. (The
    // readback never removes a DRA share's files: only this reconcile and unprepare do.)
    let dra = Key::dra("0000-gone-claim", 0).expect("key");
    containers::create(
        &host.run(),
        &dra,
        &Owner {
            path: containers::PATH_DRA.into(),
            claim_uid: "0000-gone-claim".into(),
            request: "main".into(),
            limits: [(GPU0.to_string(), GIB)].into(),
            ..Owner::default()
        },
    )
    .expect("written");
    assert_eq!(host.containers(), [dra.to_string()]);
    let api = dra_node_api(DRA_NODE).await;
    let dir = short_tempdir();
    let config = crate::support::dra_node::config_in(dir.path(), |config| {
        host.configure(config, Enforcement::Limiter);
    });
    std::fs::create_dir_all(&config.dra.registry_dir).expect("registry");
    let plugin = start_dra_plugin(&config, &api).await;
    assert!(
        host.containers().is_empty(),
        "the gone claim's files went before the plugin served: {:?}",
        host.containers()
    );
    plugin.stop().await;
    api.shutdown().await;
}
