//! The CUDA MPS control program, `nvidia-cuda-mps-control`, driven the way NVIDIA documents
//! it: `-d` starts the control daemon (it forks away and the program returns), and the program
//! run without arguments is the client of the daemon's control pipe: it reads commands on
//! stdin, sends them to the daemon found through `CUDA_MPS_PIPE_DIRECTORY` and prints the
//! answers. [`MpsControl`] wraps both with a deadline on every call and a child that is killed
//! when the call is dropped, so nothing here can hang a caller.
//!
//! Used by the device plugin's supervisor and by doctor. It does not supervise (the device
//! plugin does), choose limits, or keep any state: every call asks the daemon afresh.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

/// The daemon's pid file in the pipe directory (written by the real daemon).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// How long one control call may take by default.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a control call did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    /// The program is neither a path that exists nor a name found on PATH.
    #[error(
        "{binary}: not found (is the NVIDIA driver's nvidia-cuda-mps-control installed and on PATH?)"
    )]
    NotFound {
        /// The name or path asked for.
        binary: String,
    },
    /// The program could not be started.
    #[error("cannot run {binary}: {source}")]
    Spawn {
        /// The program.
        binary: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// No answer within the deadline (the child was killed).
    #[error("{what}: no answer within {timeout:?}")]
    Timeout {
        /// What was asked.
        what: String,
        /// The deadline.
        timeout: Duration,
    },
    /// The client ran but the daemon did not answer (no daemon on this pipe directory, or it
    /// refused the command).
    #[error("{what}: the control daemon did not answer on {pipe_dir} ({status}): {output}")]
    NotAnswering {
        /// What was asked.
        what: String,
        /// The pipe directory used.
        pipe_dir: String,
        /// The client's exit status.
        status: String,
        /// What it printed (stdout and stderr, trimmed).
        output: String,
    },
    /// A directory the daemon needs could not be created.
    #[error("cannot create {path}: {source}")]
    Directory {
        /// The directory.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// One `nvidia-cuda-mps-control` on one pipe directory.
#[derive(Clone, Debug)]
pub struct MpsControl {
    /// The program: a path, or a name looked up on PATH.
    pub binary: String,
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: PathBuf,
    /// Deadline of each call.
    pub timeout: Duration,
    /// `CUDA_VISIBLE_DEVICES` of the daemon it starts (GPU UUIDs); empty: not set, every GPU.
    pub visible_devices: Vec<String>,
}

impl MpsControl {
    /// The control program `binary` on `pipe_dir`, logging to `log_dir`.
    pub fn new(binary: &str, pipe_dir: &Path, log_dir: &Path) -> MpsControl {
        MpsControl {
            binary: binary.to_string(),
            pipe_dir: pipe_dir.to_path_buf(),
            log_dir: log_dir.to_path_buf(),
            timeout: CALL_TIMEOUT,
            visible_devices: Vec::new(),
        }
    }

    /// The program's path: `binary` itself when it names a path, else the first match on
    /// PATH. `None` when not found.
    pub fn resolve(&self) -> Option<PathBuf> {
        resolve_program(&self.binary, std::env::var_os("PATH").as_deref())
    }

    /// Where the real daemon writes its pid.
    pub fn pid_file(&self) -> PathBuf {
        self.pipe_dir.join(PID_FILE)
    }

    /// The command, with the program resolved off the async runtime (a PATH lookup stats
    /// files, and a PATH entry may be a slow mount).
    async fn command(&self) -> Result<tokio::process::Command, MpsError> {
        let this = self.clone();
        let program = tokio::task::spawn_blocking(move || this.resolve())
            .await
            .ok()
            .flatten()
            .ok_or_else(|| MpsError::NotFound {
                binary: self.binary.clone(),
            })?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// Sends `commands` (one per line) through the control pipe and returns what the client
    /// printed. Fails when the daemon does not answer.
    pub async fn send(&self, commands: &[String]) -> Result<String, MpsError> {
        let what = commands.join("; ");
        let mut cmd = self.command().await?;
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| MpsError::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        let input = commands.iter().fold(String::new(), |mut s, c| {
            s.push_str(c);
            s.push('\n');
            s
        });
        let exchange = async {
            if let Some(mut stdin) = child.stdin.take() {
                // A client that exits early closes its stdin; its status says why.
                let _ = stdin.write_all(input.as_bytes()).await;
                let _ = stdin.shutdown().await;
            }
            child.wait_with_output().await
        };
        let output = match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(o)) => o,
            Ok(Err(source)) => {
                return Err(MpsError::Spawn {
                    binary: self.binary.clone(),
                    source,
                });
            }
            Err(_) => {
                return Err(MpsError::Timeout {
                    what,
                    timeout: self.timeout,
                });
            }
        };
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let stderr = String::from_utf8_lossy(&output.stderr);
        let printed = format!("{stdout}{stderr}").trim().to_string();
        if !output.status.success() || no_daemon(&printed) {
            return Err(MpsError::NotAnswering {
                what,
                pipe_dir: self.pipe_dir.display().to_string(),
                status: output.status.to_string(),
                output: printed,
            });
        }
        Ok(stdout)
    }

    /// `get_server_list`: the PIDs of the MPS servers (none until a client connects). Succeeds
    /// only when the daemon answers: the health probe.
    pub async fn server_list(&self) -> Result<Vec<u32>, MpsError> {
        let out = self.send(&["get_server_list".to_string()]).await?;
        Ok(out
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect())
    }

    /// Starts the control daemon (`-d`, on [`visible_devices`](Self::visible_devices) when
    /// set) after creating the pipe and log directories; returns
    /// once the program has daemonized. Whether the daemon then answers is for the caller to
    /// ask ([`server_list`](Self::server_list)).
    pub async fn start_daemon(&self) -> Result<(), MpsError> {
        for dir in [&self.pipe_dir, &self.log_dir] {
            let path = dir.clone();
            tokio::task::spawn_blocking(move || std::fs::create_dir_all(&path))
                .await
                .map_err(|e| MpsError::Directory {
                    path: dir.display().to_string(),
                    source: std::io::Error::other(e),
                })?
                .map_err(|source| MpsError::Directory {
                    path: dir.display().to_string(),
                    source,
                })?;
        }
        let mut cmd = self.command().await?;
        if !self.visible_devices.is_empty() {
            // Only these GPUs: an MPS server does not start while an incompatible one (a MIG
            // GPU, say) is visible.
            cmd.env("CUDA_VISIBLE_DEVICES", self.visible_devices.join(","));
        }
        // The daemon inherits these: nothing of ours may stay open in it.
        cmd.arg("-d")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().map_err(|source| MpsError::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        let what = "nvidia-cuda-mps-control -d".to_string();
        match tokio::time::timeout(self.timeout, child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(MpsError::NotAnswering {
                what,
                pipe_dir: self.pipe_dir.display().to_string(),
                status: status.to_string(),
                output: format!("see the daemon's log in {}", self.log_dir.display()),
            }),
            Ok(Err(source)) => Err(MpsError::Spawn {
                binary: self.binary.clone(),
                source,
            }),
            Err(_) => Err(MpsError::Timeout {
                what,
                timeout: self.timeout,
            }),
        }
    }

    /// `quit`: stops the daemon (its servers stop once their clients are gone).
    pub async fn quit(&self) -> Result<(), MpsError> {
        self.send(&["quit".to_string()]).await.map(|_| ())
    }
}

/// The commands that set the daemon's defaults: the active thread percentage when not 0, and
/// each GPU's pinned memory limit (`(uuid, MiB)`). GPUs are named by UUID: the daemon sees
/// every GPU of the node, and CUDA's ordinals need not follow NVML's indices.
pub fn default_commands(active_thread_percentage: u8, limits: &[(String, u64)]) -> Vec<String> {
    let mut out = Vec::new();
    if active_thread_percentage > 0 {
        out.push(format!(
            "set_default_active_thread_percentage {active_thread_percentage}"
        ));
    }
    for (uuid, mib) in limits {
        out.push(format!("set_default_device_pinned_mem_limit {uuid} {mib}M"));
    }
    out
}

/// Whether the client's output says it found no daemon (it may say so and still exit 0).
fn no_daemon(printed: &str) -> bool {
    let lower = printed.to_ascii_lowercase();
    lower.contains("cannot find mps control daemon") || lower.contains("cannot connect")
}

/// `name` when it contains a `/` (a path), else the first executable `dir/name` on `path`.
pub fn resolve_program(name: &str, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return is_executable(&p).then_some(p);
    }
    std::env::split_paths(path?)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(path) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        meta.is_file() && meta.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        meta.is_file()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_name_each_gpu_by_uuid_and_skip_an_unset_percentage() {
        let limits = vec![("GPU-a".to_string(), 16384), ("GPU-b".to_string(), 4096)];
        assert_eq!(
            default_commands(0, &limits),
            [
                "set_default_device_pinned_mem_limit GPU-a 16384M",
                "set_default_device_pinned_mem_limit GPU-b 4096M"
            ]
        );
        assert_eq!(
            default_commands(40, &[])[0],
            "set_default_active_thread_percentage 40"
        );
    }

    #[test]
    fn programs_resolve_as_paths_or_on_path() {
        let dir = tempfile::tempdir().unwrap();
        let prog = dir.path().join("nvidia-cuda-mps-control");
        std::fs::write(&prog, "#!/bin/sh\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let path = std::env::join_paths([Path::new("/nonexistent"), dir.path()]).unwrap();
        assert_eq!(
            resolve_program("nvidia-cuda-mps-control", Some(&path)),
            Some(prog.clone())
        );
        assert_eq!(resolve_program("nope", Some(&path)), None);
        assert_eq!(
            resolve_program(&prog.display().to_string(), None),
            Some(prog)
        );
        assert!(no_daemon("Cannot find MPS control daemon process"));
        assert!(!no_daemon("1234"));
    }
}
