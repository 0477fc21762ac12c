//! The CUDA memory limiter as a container gets it, for the node roles' tests: the limiter's
//! own test support (`crates/limiter/tests/limiter/support.rs`, included here: its C fakes of
//! the driver and NVML, the driver-API probe program, a container's root in a private mount
//! namespace with bind mounts), the library cargo built (built here when this test run did not
//! build it), and the mounts a role answered — Allocate's `mounts`, a CDI spec's
//! `containerEdits.mounts` — as the bind mounts a container runtime applies.

use std::path::PathBuf;
use std::sync::OnceLock;

use gpushare::kubelet_api::deviceplugin::ContainerAllocateResponse;
use serde_json::Value;

#[path = "../../../crates/limiter/tests/limiter/support.rs"]
#[allow(dead_code, unused_imports)]
mod fakes;

pub use fakes::{
    BindMount, ContainerRoot, GIB, GPU0, Running, built, namespace_or_skip, run_to_end,
};

/// The limiter library of this test run: `GPUSHARE_LIMITER_LIB`, or the one cargo built beside
/// the test binaries (`cargo test --workspace` builds it; a narrower run builds it here once).
pub fn library() -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        if std::env::var_os("GPUSHARE_LIMITER_LIB").is_some_and(|l| !l.is_empty()) {
            return;
        }
        let exe = std::env::current_exe().expect("the test binary's path");
        let deps = exe.parent().expect("target/<profile>/deps");
        if deps.join("libgpushare_limiter.so").is_file() {
            return;
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = std::process::Command::new(&cargo)
            .args(["build", "-p", "gpushare-limiter", "--lib"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("cargo runs");
        assert!(
            out.status.success(),
            "cargo build -p gpushare-limiter --lib: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
    fakes::library()
}

/// The fake driver's GPUs, `uuid=bytes`: [`GPU0`] with 16 GiB.
pub fn sixteen_gib() -> String {
    format!("{GPU0}={}", 16 * GIB)
}

/// Allocate's mounts, in its order.
pub fn allocate_mounts(resp: &ContainerAllocateResponse) -> Vec<BindMount> {
    resp.mounts
        .iter()
        .map(|m| BindMount {
            host: PathBuf::from(&m.host_path),
            container: m.container_path.clone(),
            read_only: m.read_only,
        })
        .collect()
}

/// A CDI device's `containerEdits.mounts`, in its order (`ro` among the options: read-only).
pub fn cdi_mounts(container_edits: &Value) -> Vec<BindMount> {
    container_edits["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| BindMount {
            host: PathBuf::from(m["hostPath"].as_str().expect("hostPath")),
            container: m["containerPath"]
                .as_str()
                .expect("containerPath")
                .to_string(),
            read_only: m["options"]
                .as_array()
                .is_some_and(|o| o.iter().any(|x| x == "ro")),
        })
        .collect()
}

/// The probe (a driver-API program built from the limiter's tests) inside `root`: `route`
/// then `ops` (see `crates/limiter/tests/c/probe.c`), with the fake 16 GiB GPU; its lines.
pub fn probe(root: &ContainerRoot, route: &str, ops: &[&str]) -> Vec<String> {
    let program = if route == "linked" {
        "/work/probe_linked"
    } else {
        "/work/probe"
    };
    let mut args = vec![route];
    args.extend_from_slice(ops);
    let mut cmd = root.command(program, &args);
    cmd.env("FAKE_GPUS", sixteen_gib()).env("LD_PRELOAD", "");
    run_to_end(&mut cmd)
}
