//! Driver enforcement without a GPU: `gpushare cdi-hook memory-limit` run as runc runs a CDI
//! hook (the spec's program, arguments and environment, the OCI state on stdin, a bundle with
//! its config.json, a fake /proc/<pid>/cgroup) over the NVML stub's per-cgroup limits on a
//! fake cgroup v2 tree: soft = hard = the share on exactly the container's own cgroup (dmem and
//! misc), idempotent, a workload past its limit failing out of memory while its neighbour sees
//! the whole GPU, the record the node agent reads back; every failure path (no NVML, a driver
//! without the calls, Not Supported, MIG, cgroup v1, an unknown GPU, a leaf without dmem files,
//! no permission, a cgroup that is not the container's own) refused with one line naming the
//! GPU, the cgroup and the driver's error; `nvidia-smi memory-limits` for the static build.

use gpushare_sandbox::nvml_stub::{self, MemoryAccounting};
use serde_json::Value;

use crate::support::enforcement::{
    self, GIB, Host, fake_smi, gpus, hook, oci_state, run_hook_as_runtime,
};
use crate::support::{stderr, stdout};

const POD: (&str, &str, &str) = ("team-a", "trainer", "main");

fn uuid(i: usize) -> String {
    gpus()[i].uuid.clone()
}

fn record(host: &Host, id: &str) -> Value {
    serde_json::from_slice(
        &std::fs::read(host.state.join(format!("{id}.json"))).expect("the hook left a record"),
    )
    .expect("json")
}

#[test]
fn the_hook_sets_soft_and_hard_on_exactly_the_containers_cgroup_under_dmem() {
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let c1 = host.container("u1", "c1", 101, POD, true);
    let c2 = host.container("u1", "c2", 102, ("team-a", "trainer", "side"), true);
    let spec = hook(&[(&uuid(1), 4 * GIB)], &host.hook_flags());
    let out = run_hook_as_runtime(&spec, &oci_state(&c1));
    assert!(out.status.success(), "{}", stderr(&out));
    let four = (4 * GIB).to_string();
    // Hard and soft on GPU 1 of c1's own cgroup; nothing on GPU 0, nothing on c2.
    assert_eq!(
        host.dmem(&c1.path, "dmem.max", 1).as_deref(),
        Some(four.as_str())
    );
    assert_eq!(
        host.dmem(&c1.path, "dmem.min", 1).as_deref(),
        Some(four.as_str())
    );
    assert_eq!(host.dmem(&c1.path, "dmem.max", 0), None);
    assert_eq!(host.dmem(&c2.path, "dmem.max", 1), None);
    // The driver's propagation: the pod and kubepods count the leaf's soft limit.
    let pod = c1.path.parent().expect("pod").to_path_buf();
    assert_eq!(
        host.dmem(&pod, "dmem.min", 1).as_deref(),
        Some(four.as_str())
    );
    // Idempotent: the same hook again changes nothing (no double count upwards).
    let again = run_hook_as_runtime(&spec, &oci_state(&c1));
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(
        host.dmem(&c1.path, "dmem.max", 1).as_deref(),
        Some(four.as_str())
    );
    assert_eq!(
        host.dmem(&pod, "dmem.min", 1).as_deref(),
        Some(four.as_str())
    );
    // The record names the pod and container from the bundle, the cgroup and the limit.
    let rec = record(&host, "c1");
    assert_eq!(rec["namespace"], "team-a");
    assert_eq!(rec["pod"], "trainer");
    assert_eq!(rec["podUid"], "u1");
    assert_eq!(rec["container"], "main");
    assert_eq!(rec["cgroup"], c1.relative);
    assert_eq!(rec["limits"][uuid(1)], 4 * GIB);
    // A second GPU of the same container adds to its record.
    let other = hook(&[(&uuid(0), 2 * GIB)], &host.hook_flags());
    assert!(
        run_hook_as_runtime(&other, &oci_state(&c1))
            .status
            .success()
    );
    let rec = record(&host, "c1");
    assert_eq!(rec["limits"][uuid(0)], 2 * GIB);
    assert_eq!(rec["limits"][uuid(1)], 4 * GIB);
}

#[test]
fn a_container_past_its_limit_runs_out_of_memory_and_its_neighbour_sees_the_whole_gpu() {
    for backend in [MemoryAccounting::Dmem, MemoryAccounting::Misc] {
        let host = Host::new(backend, "615.10.02");
        let c1 = host.container("u1", "c1", 101, POD, true);
        let c2 = host.container("u1", "c2", 102, ("team-a", "trainer", "side"), true);
        let spec = hook(&[(&uuid(0), 4 * GIB)], &host.hook_flags());
        let out = run_hook_as_runtime(&spec, &oci_state(&c1));
        assert!(out.status.success(), "{backend:?}: {}", stderr(&out));
        // Inside c1 the GPU is its limit (what nvidia-smi in the container shows); 3 GiB fit,
        // 2 GiB more do not.
        let limited = host.workload(&c1, 0, &[3 * GIB, 2 * GIB]);
        let text = stdout(&limited);
        assert!(
            text.starts_with(&format!("memory total={} used=0", 4 * GIB)),
            "{backend:?}: {text}"
        );
        assert!(text.contains(&format!("alloc {} ok", 3 * GIB)), "{text}");
        assert!(
            text.contains(&format!("alloc {} out-of-memory", 2 * GIB)),
            "{backend:?}: {text}"
        );
        assert_eq!(limited.status.code(), Some(2), "{backend:?}: {text}");
        // c2 has no limit: the whole 16 GiB, and 8 GiB fit.
        let free = host.workload(&c2, 0, &[8 * GIB]);
        let text = stdout(&free);
        assert!(
            text.starts_with(&format!("memory total={}", 16 * GIB)),
            "{text}"
        );
        assert!(free.status.success(), "{backend:?}: {text}");
    }
}

/// Runs the hook for a fresh container and returns its failure line.
fn refused(host: &Host, limits: &[(&str, u64)], flags: &[String], dmem_files: bool) -> String {
    let c = host.container("u9", "c9", 909, POD, dmem_files);
    let out = run_hook_as_runtime(&hook(limits, flags), &oci_state(&c));
    assert!(!out.status.success(), "refused: {}", stdout(&out));
    let err = stderr(&out);
    assert!(
        !host.state.join("c9.json").exists(),
        "no record for a limit not set: {err}"
    );
    err
}

fn assert_names(err: &str, parts: &[&str]) {
    for p in parts {
        assert!(err.contains(p), "{p:?} in {err}");
    }
}

#[test]
fn every_failure_is_refused_naming_the_gpu_the_cgroup_and_the_drivers_error() {
    let dmem = || Host::new(MemoryAccounting::Dmem, "615.10.02");
    let leaf = "/kubepods/podu9/cri-containerd-c9.scope";

    // Memory partitioning off: NVML's Not Supported.
    let host = Host::new(MemoryAccounting::Off, "615.10.02");
    let err = refused(&host, &[(&uuid(0), GIB)], &host.hook_flags(), true);
    assert_names(
        &err,
        &[&uuid(0), leaf, "Not Supported (NVML error 3)", "cannot set"],
    );

    // A leaf whose parent did not enable +dmem: NVML's Not Found.
    let host = dmem();
    let err = refused(&host, &[(&uuid(0), GIB)], &host.hook_flags(), false);
    assert_names(&err, &[&uuid(0), leaf, "Not Found (NVML error 6)"]);

    // Setting needs root: No Permission.
    let host = dmem();
    nvml_stub::fail_set_limits(&host.library, 4).expect("inject");
    let err = refused(&host, &[(&uuid(0), GIB)], &host.hook_flags(), true);
    assert_names(&err, &[&uuid(0), leaf, "no permission", "NVML error 4"]);

    // An unknown GPU.
    let host = dmem();
    let err = refused(&host, &[("GPU-nope", GIB)], &host.hook_flags(), true);
    assert_names(
        &err,
        &["GPU-nope", leaf, "unknown GPU", "nvmlDeviceGetHandleByUUID"],
    );

    // A GPU in MIG mode.
    let host = dmem();
    nvml_stub::enable_mig(&host.library, 1).expect("mig");
    let err = refused(&host, &[(&uuid(1), GIB)], &host.hook_flags(), true);
    assert_names(&err, &[&uuid(1), leaf, "MIG mode"]);

    // No NVML at all.
    let host = dmem();
    let mut flags = host.hook_flags();
    let at = flags
        .iter()
        .position(|f| f == "--nvml-library")
        .expect("flag")
        + 1;
    flags[at] = "/nonexistent/libnvidia-ml.so.1".into();
    let err = refused(&host, &[(&uuid(0), GIB)], &flags, true);
    assert_names(
        &err,
        &[
            "no way to set GPU memory limits",
            "/nonexistent/libnvidia-ml.so.1",
        ],
    );

    // A driver older than R615: its NVML lacks the calls.
    let host = Host::with_library(
        MemoryAccounting::Dmem,
        "550.54.15",
        nvml_stub::build_without_memory_limits,
    );
    let err = refused(&host, &[(&uuid(0), GIB)], &host.hook_flags(), true);
    assert_names(&err, &[&uuid(0), leaf, "older than R615"]);
}

#[test]
fn cgroups_that_are_not_the_containers_own_are_never_touched() {
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let spec = hook(&[(&uuid(0), GIB)], &host.hook_flags());
    // cgroup v1 only.
    let c = host.container("u1", "v1", 201, POD, true);
    host.process(
        201,
        "12:memory:/kubepods/podu1/v1\n1:name=systemd:/kubepods/podu1/v1\n",
    );
    let out = run_hook_as_runtime(&spec, &oci_state(&c));
    assert!(!out.status.success());
    assert_names(&stderr(&out), &["container v1", "cgroup v2"]);
    // The process sits in the root cgroup.
    let c = host.container("u1", "r1", 202, POD, true);
    host.process(202, "0::/\n");
    let out = run_hook_as_runtime(&spec, &oci_state(&c));
    assert_names(&stderr(&out), &["container r1", "root cgroup"]);
    // The process sits in another container's cgroup.
    let other = host.container("u1", "victim", 203, POD, true);
    let c = host.container("u1", "intruder", 204, POD, true);
    host.process(204, &format!("0::{}\n", other.relative));
    let out = run_hook_as_runtime(&spec, &oci_state(&c));
    assert_names(
        &stderr(&out),
        &["container intruder", "not the container's own"],
    );
    assert_eq!(host.dmem(&other.path, "dmem.max", 0), None, "untouched");
    // A symlink out of the tree.
    let outside = host.root().join("outside");
    std::fs::create_dir_all(&outside).expect("dir");
    #[cfg(unix)]
    std::os::unix::fs::symlink(
        &outside,
        host.cgroup.join("kubepods/cri-containerd-esc.scope"),
    )
    .expect("link");
    let c = host.container("u1", "esc", 205, POD, true);
    host.process(205, "0::/kubepods/cri-containerd-esc.scope\n");
    let out = run_hook_as_runtime(&spec, &oci_state(&c));
    assert_names(&stderr(&out), &["container esc", "not below"]);
    // Stdin that is no OCI state, and a state without a pid.
    let out = run_hook_as_runtime(&spec, &Value::String("garbage".into()));
    assert_names(&stderr(&out), &["OCI state"]);
    let out = run_hook_as_runtime(&spec, &serde_json::json!({"id": "x", "bundle": "/"}));
    assert_names(&stderr(&out), &["no pid", "createRuntime"]);
    assert!(!host.state.exists() || std::fs::read_dir(&host.state).expect("dir").count() == 0);
}

#[test]
fn the_static_build_sets_and_reads_back_through_nvidia_smi() {
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let dir = tempfile::tempdir().expect("dir");
    let smi = fake_smi(
        dir.path(),
        "namespace: x\nsoft limit: 4096 MiB\nhard limit: 4096 MiB\ncurrent used: 512 MiB\n",
        None,
    );
    let c = host.container("u1", "c1", 101, POD, true);
    let flags: Vec<String> = [
        "--gpu-backend",
        "nvidia-smi",
        "--nvidia-smi",
        &smi.display().to_string(),
        "--cgroup-root",
        &host.cgroup.display().to_string(),
        "--proc-root",
        &host.proc.display().to_string(),
        "--state-dir",
        &host.state.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    let out = run_hook_as_runtime(&hook(&[(&uuid(0), 4 * GIB)], &flags), &oci_state(&c));
    assert!(out.status.success(), "{}", stderr(&out));
    let calls = std::fs::read_to_string(dir.path().join("calls")).expect("called");
    let path = c.path.display().to_string();
    assert_eq!(
        calls.lines().collect::<Vec<_>>(),
        [
            format!(
                "memory-limits --set -n {path} --soft-limit 4096 --hard-limit 4096 -i {}",
                uuid(0)
            ),
            format!("memory-limits --get -n {path} -i {}", uuid(0)),
        ]
    );
    // A driver whose nvidia-smi has no memory-limits command.
    let old = tempfile::tempdir().expect("dir");
    let smi = fake_smi(
        old.path(),
        "",
        Some("Option memory-limits is not recognized"),
    );
    let mut flags = flags;
    flags[3] = smi.display().to_string();
    let c = host.container("u1", "c2", 102, POD, true);
    let out = run_hook_as_runtime(&hook(&[(&uuid(0), 4 * GIB)], &flags), &oci_state(&c));
    assert!(!out.status.success());
    assert_names(
        &stderr(&out),
        &[&uuid(0), "older than R615", "not recognized"],
    );
    // The readback is checked: a limit that reads back otherwise fails.
    let wrong = tempfile::tempdir().expect("dir");
    let smi = fake_smi(wrong.path(), "soft limit: 0 MiB\nhard limit: max\n", None);
    flags[3] = smi.display().to_string();
    let c = host.container("u1", "c3", 103, POD, true);
    let out = run_hook_as_runtime(&hook(&[(&uuid(0), 4 * GIB)], &flags), &oci_state(&c));
    assert_names(&stderr(&out), &["reads back as soft 0"]);
    let _ = enforcement::GIB;
}

/// `gpushare doctor --role node` on the fake host with `toml` as its configuration: the
/// `enforcement` check as `status | detail | hint` (the other checks read this machine).
fn doctor(host: &Host, extra: &[&str], node_toml: &str) -> String {
    let config = host.root().join("gpushare.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\ncgroup_root = \"{}\"\nenforcement_hook = \"{}\"\nenforcement_state_dir = \"{}\"\n{node_toml}",
            host.cgroup.display(),
            crate::support::bin().display(),
            host.root().display(),
        ),
    )
    .expect("config");
    crate::support::enforcement::doctor_enforcement(&config, &host.library, extra)
}

/// Driver enforcement with a CDI device-list strategy, which can hand the hook over.
const DRIVER_CDI: &[&str] = &[
    "--enforcement",
    "driver",
    "--device-list-strategy",
    "cdi-cri",
];

#[test]
fn doctor_shows_the_mechanism_each_gpu_gets_and_the_fix() {
    let host = Host::new(MemoryAccounting::Dmem, "615.10.02");
    let text = doctor(&host, DRIVER_CDI, "");
    assert_names(
        &text,
        &[
            "\"ok\"",
            "GPU 0 (GPU-enf-0) on the device plugin: driver (dmem backend)",
        ],
    );
    assert_names(&text, &["GPU 1 (GPU-enf-1) on the device plugin: driver"]);
    // The envvar strategy cannot hand the hook over: driver fails, auto warns with the fix.
    let text = doctor(&host, &["--enforcement", "driver"], "");
    assert_names(
        &text,
        &[
            "\"fail\"",
            "enforcement needs a CDI strategy",
            "cdi-cri",
            "refuses to start",
        ],
    );
    let text = doctor(&host, &[], "");
    assert_names(
        &text,
        &["\"warn\"", "on the device plugin: none", "add cdi-cri"],
    );
    // A driver older than R615: the reason and its fix; auto says what it falls back to.
    let old = Host::new(MemoryAccounting::Dmem, "550.54.15");
    let text = doctor(&old, DRIVER_CDI, "");
    assert_names(
        &text,
        &[
            "\"fail\"",
            "driver 550.54.15 is older than R615",
            "upgrade the driver",
        ],
    );
    let text = doctor(&old, &["--device-list-strategy", "cdi-cri"], "");
    assert_names(
        &text,
        &[
            "\"ok\"",
            "on the device plugin: none",
            "why: MPS is off; not driver: driver 550.54.15",
        ],
    );
    // cgroup v1 (no cgroup.controllers at the root) and no hook.
    let v1 = Host::new(MemoryAccounting::Misc, "615.10.02");
    std::fs::remove_file(v1.cgroup.join("cgroup.controllers")).expect("v1");
    let text = doctor(&v1, DRIVER_CDI, "");
    assert_names(&text, &["is not a cgroup v2 root"]);
    let text = doctor(&host, DRIVER_CDI, "");
    assert!(!text.contains("is not there"), "{text}");
}

// ---- real hardware (`make test-gpu`) ----

#[test]
#[ignore = "needs an NVIDIA GPU with driver R615+, cgroup v2 and root"]
fn gpu_two_containers_on_one_gpu_one_past_its_limit_runs_out_of_memory() {
    let out = std::process::Command::new("sh")
        .arg(crate::support::source_tree::repo_path(
            "tests/gpu/enforcement.sh",
        ))
        .env("GPUSHARE", crate::support::bin())
        .output()
        .expect("sh runs");
    println!("{}\n{}", stdout(&out), stderr(&out));
    if out.status.code() == Some(77) {
        crate::support::clients::skip(stderr(&out).trim());
        return;
    }
    assert!(out.status.success(), "{}", stderr(&out));
}
