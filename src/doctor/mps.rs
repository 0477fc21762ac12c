//! The MPS checks (`--mps` / `node.mps`): the control program, the directories the
//! daemon and its clients share, the user the daemon runs as, and whether a daemon answers
//! `get_server_list` on the pipe directory. With MPS off, one `mps-daemon` check says so.
//!
//! Host paths are read under `--root`; the daemon is asked through the control program found
//! there, on the pipe directory found there. Doctor only asks: it never starts or stops the
//! daemon (the device plugin does).

use std::path::{Path, PathBuf};

use super::host::{BIN_DIRS, HostRoot};
use super::report::{Check, Status};
use crate::config::NodeConfig;
use crate::gpu::mps::{MpsControl, resolve_program};

/// The MPS checks: `mps-binary`, `mps-dirs`, `mps-user`, `mps-daemon` (only `mps-daemon`,
/// skipped, when MPS is off). In the `preflight` a daemon that does not answer yet is fine: the
/// device plugin starts it.
pub async fn checks(host: &HostRoot, dp: &NodeConfig, preflight: bool) -> Vec<Check> {
    if !dp.mps {
        return vec![Check::new(
            "mps-daemon",
            "CUDA MPS control daemon",
            Status::Skip,
            "MPS is off (node.mps = false; --mps turns it on)",
        )];
    }
    let (binary, check_binary) = binary(host, &dp.mps_control);
    vec![
        check_binary,
        dirs(host, dp),
        user(host, &dp.mps_pipe_dir),
        daemon(host, dp, binary.as_deref(), preflight).await,
    ]
}

fn start_by_hand(dp: &NodeConfig) -> String {
    format!(
        "CUDA_MPS_PIPE_DIRECTORY={} CUDA_MPS_LOG_DIRECTORY={} nvidia-cuda-mps-control -d",
        dp.mps_pipe_dir.display(),
        dp.mps_log_dir.display()
    )
}

/// `mps-binary`: the control program exists and is executable (a path under the root, or a
/// name in the usual bin directories and, on the host itself, on PATH).
fn binary(host: &HostRoot, program: &str) -> (Option<PathBuf>, Check) {
    const ID: &str = "mps-binary";
    const TITLE: &str = "nvidia-cuda-mps-control";
    let found = if program.contains('/') {
        resolve_program(&host.path(program).display().to_string(), None)
    } else {
        let mut dirs: Vec<PathBuf> = BIN_DIRS.iter().map(|d| host.path(d)).collect();
        if host.path("/") == Path::new("/")
            && let Some(path) = std::env::var_os("PATH")
        {
            dirs.extend(std::env::split_paths(&path));
        }
        std::env::join_paths(&dirs)
            .ok()
            .and_then(|p| resolve_program(program, Some(&p)))
    };
    match &found {
        Some(p) => {
            let check = Check::new(ID, TITLE, Status::Ok, format!("{program}: {}", p.display()));
            (found, check)
        }
        None => (
            None,
            Check::new(
                ID,
                TITLE,
                Status::Fail,
                format!("{program}: not found (searched {})", BIN_DIRS.join(", ")),
            )
            .hint(
                "install the driver's compute utilities (nvidia-cuda-mps-control ships with the driver, \
                 e.g. the nvidia-compute-utils package), or point node.mps_control / \
                 --mps-control at it",
            ),
        ),
    }
}

/// `mps-dirs`: the pipe, log (and shm) directories exist as writable directories.
fn dirs(host: &HostRoot, dp: &NodeConfig) -> Check {
    const ID: &str = "mps-dirs";
    const TITLE: &str = "MPS pipe, log and shm directories";
    let mut list = vec![
        ("pipe", dp.mps_pipe_dir.clone()),
        ("log", dp.mps_log_dir.clone()),
    ];
    if !dp.mps_shm_dir.as_os_str().is_empty() {
        list.push(("shm", dp.mps_shm_dir.clone()));
    }
    let mut lines = Vec::new();
    let mut worst = Status::Ok;
    for (what, dir) in list {
        let seen = host.path(&dir);
        let line = match std::fs::metadata(&seen) {
            Ok(m) if !m.is_dir() => {
                worst = Status::Fail;
                "exists but is not a directory"
            }
            Ok(m) if m.permissions().readonly() => {
                worst = Status::Fail;
                "read-only"
            }
            Ok(_) => "a writable directory",
            Err(_) => {
                if worst == Status::Ok {
                    worst = Status::Warn;
                }
                "missing (the device plugin creates the pipe and log directories when it starts the daemon)"
            }
        };
        lines.push(format!("{what} {}: {line}", dir.display()));
    }
    let check = Check::new(ID, TITLE, worst, lines.join("\n"));
    match worst {
        Status::Ok => check,
        _ => check.hint(
            "the daemon, the device plugin and every MPS client must see the same directories: \
             create them on the host (in the chart they are hostPath volumes) and keep them writable \
             by the daemon's user",
        ),
    }
}

/// The effective uid in a `/proc/<pid>/status` text.
fn euid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|euid| euid.parse().ok())
}

#[cfg(unix)]
fn owner(path: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.uid())
}

#[cfg(not(unix))]
fn owner(_path: &Path) -> Option<u32> {
    None
}

/// `mps-user`: who the daemon runs as (the running daemon's, from its pid file and `/proc`
/// under the root; else this process's, which in the preflight is the device plugin that
/// will start it). Root serves clients of any user (one user's server at a time); any other
/// user serves only its own uid.
fn user(host: &HostRoot, pipe_dir: &Path) -> Check {
    const ID: &str = "mps-user";
    const TITLE: &str = "user of the MPS control daemon";
    let running = host
        .read(pipe_dir.join(crate::gpu::mps::PID_FILE))
        .and_then(|p| p.trim().parse::<u32>().ok())
        .and_then(|pid| {
            let uid = euid(&host.read(format!("/proc/{pid}/status"))?)?;
            Some((pid, uid))
        });
    let (uid, who) = match running {
        Some((pid, uid)) => (
            uid,
            format!("the running daemon (pid {pid}) runs as uid {uid}"),
        ),
        None => match std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| euid(&s))
        {
            Some(uid) => (
                uid,
                format!(
                    "no running daemon seen; this process runs as uid {uid} (a daemon the device                      plugin starts runs as the plugin's user)"
                ),
            ),
            None => {
                return Check::new(ID, TITLE, Status::Skip, "cannot tell the daemon's uid");
            }
        },
    };
    let dir_owner = owner(&host.path(pipe_dir));
    let owner_text = dir_owner.map_or("missing".to_string(), |o| format!("owned by uid {o}"));
    let detail = format!("{who}; pipe directory {}: {owner_text}", pipe_dir.display());
    if uid == 0 {
        return Check::new(
            ID,
            TITLE,
            Status::Ok,
            format!(
                "{detail}\nas root the daemon starts an MPS server for each client user, one user at a time"
            ),
        );
    }
    Check::new(ID, TITLE, Status::Warn, detail).hint(format!(
        "a daemon running as uid {uid} serves only clients running as uid {uid}: run the device \
         plugin as root (the chart does), or run every GPU pod as uid {uid}"
    ))
}

/// `mps-daemon`: a daemon answers `get_server_list` on the pipe directory.
async fn daemon(host: &HostRoot, dp: &NodeConfig, binary: Option<&Path>, preflight: bool) -> Check {
    const ID: &str = "mps-daemon";
    const TITLE: &str = "CUDA MPS control daemon";
    let Some(binary) = binary else {
        return Check::new(
            ID,
            TITLE,
            Status::Fail,
            "not asked: nvidia-cuda-mps-control was not found (see mps-binary)",
        )
        .hint(format!(
            "install it; the device plugin then starts the daemon, or by hand: {}",
            start_by_hand(dp)
        ));
    };
    let control = MpsControl::new(
        &binary.display().to_string(),
        &host.path(&dp.mps_pipe_dir),
        &host.path(&dp.mps_log_dir),
    );
    let pid = host
        .read(dp.mps_pipe_dir.join(crate::gpu::mps::PID_FILE))
        .map(|p| format!(" (pid file: {})", p.trim()))
        .unwrap_or_default();
    match control.server_list().await {
        Ok(servers) => Check::new(
            ID,
            TITLE,
            Status::Ok,
            format!(
                "answers get_server_list on {}{pid}; MPS servers running: {}",
                dp.mps_pipe_dir.display(),
                if servers.is_empty() {
                    "none (one starts with the first client)".to_string()
                } else {
                    servers
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        ),
        Err(e) if preflight => Check::new(
            ID,
            TITLE,
            Status::Skip,
            format!("no daemon answers yet ({e}); the device plugin starts one"),
        ),
        Err(e) => Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!("no daemon answers on {}: {e}", dp.mps_pipe_dir.display()),
        )
        .hint(format!(
            "the device plugin started with --mps runs and restarts the daemon: is it running, \
             with this pipe directory? (its log and the node's GpuShareMpsDaemon* Events say why \
             the daemon stops); by hand: {}",
            start_by_hand(dp)
        )),
    }
}
