//! How gpushare reaches the NVIDIA driver without a backend around it: the NVML library's
//! name as the loader finds it, and `nvidia-smi` run as a child process under a timeout
//! (killed past it, its output read on threads). Used by the `nvml` and `nvidia-smi` backends
//! and by the memory limits' two ways in (`limits`), below all of them. It parses nothing.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::backend::Error;

/// The library name the loader searches for when no path is configured.
pub(crate) const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// The outcome of one nvidia-smi run.
pub(crate) struct Run {
    pub(crate) success: bool,
    pub(crate) status: String,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    pub(crate) fn text(&self) -> String {
        format!("{}\n{}", self.stderr.trim(), self.stdout.trim())
            .trim()
            .to_string()
    }
}

/// Runs `<program> <args>` with `timeout`; the child is killed when it runs past it.
pub(crate) fn run_args(program: &str, args: &[&str], timeout: Duration) -> Result<Run, Error> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            Error::NvidiaSmi(format!(
                "cannot run `{program}`: {e} (is the NVIDIA driver installed and nvidia-smi on \
                 PATH, or [gpu] nvidia_smi set?)"
            ))
        })?;
    let readers = [
        child.stdout.take().map(|s| read_in_thread(Box::new(s))),
        child.stderr.take().map(|s| read_in_thread(Box::new(s))),
    ];
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::NvidiaSmi(format!(
                    "`{program} {}` did not finish within {}s; killed it",
                    args.join(" "),
                    timeout.as_secs()
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(Error::NvidiaSmi(format!("waiting for `{program}`: {e}"))),
        }
    };
    let [stdout, stderr] = readers.map(|r| r.and_then(|h| h.join().ok()).unwrap_or_default());
    Ok(Run {
        success: status.success(),
        status: status.to_string(),
        stdout,
        stderr,
    })
}

fn read_in_thread(mut pipe: Box<dyn Read + Send>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}
