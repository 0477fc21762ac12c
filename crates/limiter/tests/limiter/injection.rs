//! The limiter injected as a container gets it: in a private mount namespace, a root file
//! system whose `/etc/ld.so.preload`, library and limits file are bind-mounted read-only
//! at the fixed paths (`gpushare_limiter_contract`), and the state directory read-write.
//! No `LD_PRELOAD`, and a hostile environment: the test variable pointing at a 16 GiB limit
//! and the preload variable emptied. A driver-API program allocating past its 4 GiB on a
//! 16 GiB GPU gets `CUDA_ERROR_OUT_OF_MEMORY` through every route, the driver API and NVML
//! show 4 GiB, and two processes share the 4 GiB.
//!
//! Needs `unshare -m` and mounting (root, or `sudo -n`); without them each test prints
//! `SKIPPED: <test>: <why>` and passes, except under `CI=true`, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpushare_limiter_contract::{
    LIBRARY_PATH, LIMITS_PATH, PRELOAD_PATH, STATE_DIR, preload_file_contents,
};

use crate::support::*;

fn runner(test: &str) -> Option<Vec<String>> {
    namespace_or_skip(&format!("injection::{test}"))
}

/// The node's side of one container: what gets mounted into it.
struct Injected {
    host: tempfile::TempDir,
    root: ContainerRoot,
}

impl Injected {
    fn new(runner: Vec<String>) -> Self {
        let host = tempfile::tempdir().expect("tempdir");
        let p = host.path();
        std::fs::create_dir(p.join("state")).expect("state");
        std::fs::write(
            p.join("limits"),
            format!("gpushare-limiter-limits 1\n{GPU0} {}\n", 4 * GIB),
        )
        .expect("limits");
        std::fs::write(p.join("ld.so.preload"), preload_file_contents()).expect("preload");
        // What a hostile pod would point the test variable at.
        std::fs::create_dir_all(p.join("escape/state")).expect("escape");
        std::fs::write(
            p.join("escape/limits"),
            format!("gpushare-limiter-limits 1\n{GPU0} {}\n", 16 * GIB),
        )
        .expect("escape limits");
        // The state directory is the container's: every user of it may write.
        set_mode(&p.join("state"), 0o1777);
        let bind = |host: PathBuf, container: &str, read_only| BindMount {
            host,
            container: container.to_string(),
            read_only,
        };
        let root = ContainerRoot::new(
            runner,
            vec![
                bind(library(), LIBRARY_PATH, true),
                bind(p.join("limits"), LIMITS_PATH, true),
                bind(p.join("state"), STATE_DIR, false),
                bind(p.join("ld.so.preload"), PRELOAD_PATH, true),
            ],
        );
        Injected { host, root }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.host.path().join(name)
    }

    /// A command running `program args` inside the container, in a hostile environment.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = self.root.command(program, args);
        cmd.env("FAKE_GPUS", format!("{GPU0}={}", 16 * GIB))
            .env("GPUSHARE_LIMITER_ROOT", self.path("escape"))
            .env("LD_PRELOAD", "");
        cmd
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn s(n: u64) -> String {
    n.to_string()
}

#[test]
fn an_injected_container_is_held_to_its_limit_through_every_route() {
    let Some(runner) = runner("an_injected_container_is_held_to_its_limit_through_every_route")
    else {
        return;
    };
    let c = Injected::new(runner);
    let four = s(4 * GIB);
    for route in [
        "linked",
        "dlsym-default",
        "dlsym-next",
        "interposer-next",
        "dlsym-handle",
        "getproc:11030",
        "getproc2:12080",
        "getproc2-ptsz:12080",
        "getproc-chain:12080",
    ] {
        let program = if route == "linked" {
            "/work/probe_linked"
        } else {
            "/work/probe"
        };
        let out = run_to_end(&mut c.command(
            program,
            &[
                route, "ctx", "0", "info", "total", "0", "nvml", "0", "alloc", &four, "alloc", "1",
                "vmm", "1", "async", "1",
            ],
        ));
        assert_eq!(
            out,
            [
                "ctx 0 0".to_string(),
                format!("info 0 {four} {four}"),
                format!("total 0 {four}"),
                format!("nvml 0 {four} {four} 0"),
                format!("alloc {four} 0"),
                "alloc 1 2".into(),
                "vmm 1 2".into(),
                "async 1 2".into(),
            ],
            "route {route}"
        );
    }
}

#[test]
fn two_processes_of_an_injected_container_share_its_limit() {
    let Some(runner) = runner("two_processes_of_an_injected_container_share_its_limit") else {
        return;
    };
    let c = Injected::new(runner);
    let mut a = Running::start(&mut c.command(
        "/work/probe",
        &["dlsym-handle", "ctx", "0", "alloc", &s(3 * GIB), "wait"],
    ));
    assert_eq!(
        a.until("waiting"),
        ["ctx 0 0".to_string(), format!("alloc {} 0", 3 * GIB)]
    );
    // Another process of the container, started by a shell with an empty environment: the
    // preload list is a file, not a variable.
    let script = format!(
        "exec env -i /work/probe_linked linked ctx 0 alloc {} alloc {} nvml 0",
        2 * GIB,
        GIB
    );
    let out = run_to_end(&mut c.command("/bin/sh", &["-c", &script]));
    assert_eq!(
        out,
        [
            "ctx 0 0".to_string(),
            format!("alloc {} 2", 2 * GIB),
            format!("alloc {GIB} 0"),
            format!("nvml 0 {} 0 {}", 4 * GIB, 4 * GIB),
        ]
    );
    a.finish();
    let usage = gpushare_limiter_contract::read_gpu(
        &c.path("state"),
        &gpushare_limiter_contract::GpuUuid::parse(GPU0).expect("uuid"),
    )
    .expect("the node agent reads it")
    .expect("a ledger");
    assert_eq!(usage.used_bytes, 0, "{usage:?}");
    assert_eq!(usage.limit_bytes, 4 * GIB);
}

#[test]
fn a_container_cannot_rewrite_its_limits_or_preload_list() {
    let Some(runner) = runner("a_container_cannot_rewrite_its_limits_or_preload_list") else {
        return;
    };
    let c = Injected::new(runner);
    for path in [LIMITS_PATH, PRELOAD_PATH] {
        let out = c
            .command("/bin/sh", &["-c", &format!("echo > {path}")])
            .output()
            .expect("runs");
        assert!(!out.status.success(), "{path} was writable");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Read-only file system"),
            "{path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The state directory is writable (the processes record their use there).
    let out = run_to_end(&mut c.command(
        "/bin/sh",
        &["-c", &format!("touch {STATE_DIR}/probe && echo ok")],
    ));
    assert_eq!(out, ["ok"]);
    assert!(
        std::fs::read_to_string(c.path("limits"))
            .expect("limits")
            .contains(&s(4 * GIB))
    );
}
