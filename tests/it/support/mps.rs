//! A fake `nvidia-cuda-mps-control` (`tests/fixtures/mps/`, Python) on a pipe directory of its
//! own, behind a wrapper that can be told to refuse starts: what the tests of MPS mode run
//! instead of NVIDIA's program. The fake daemon records every command it gets in
//! `<pipe>/fake-mps-commands.log`; dropping a [`FakeMps`] kills a daemon still running.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use gpushare::config::Config;

/// One fake MPS set-up: the program, its pipe, log and shm directories.
pub struct FakeMps {
    dir: tempfile::TempDir,
    /// The wrapper to pass as `node.mps_control`.
    pub program: PathBuf,
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: PathBuf,
    /// The daemon's /dev/shm on the "host".
    pub shm_dir: PathBuf,
}

impl FakeMps {
    /// A new set-up in a short temp directory under /tmp (unix socket paths are short).
    pub fn new() -> FakeMps {
        let dir = tempfile::Builder::new()
            .prefix("mps")
            .tempdir_in("/tmp")
            .expect("a temp dir under /tmp");
        let fake = super::fixture("mps/nvidia-cuda-mps-control");
        let program = dir.path().join("nvidia-cuda-mps-control");
        let refuse = dir.path().join("refuse-start");
        std::fs::write(
            &program,
            format!(
                "#!/bin/sh\nif [ \"$1\" = \"-d\" ] && [ -e '{}' ]; then echo 'fake: start refused' >&2; exit 1; fi\nexec '{}' \"$@\"\n",
                refuse.display(),
                fake.display()
            ),
        )
        .expect("wrapper written");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))
            .expect("wrapper executable");
        let pipe_dir = dir.path().join("pipe");
        let log_dir = dir.path().join("log");
        let shm_dir = dir.path().join("shm");
        FakeMps {
            program,
            pipe_dir,
            log_dir,
            shm_dir,
            dir,
        }
    }

    /// MPS on with this set-up, checked every 100 ms, restarts backing off to at most 1 s.
    pub fn configure(&self, cfg: &mut Config) {
        let dp = &mut cfg.node;
        dp.mps = true;
        dp.mps_control = self.program.display().to_string();
        dp.mps_pipe_dir = self.pipe_dir.clone();
        dp.mps_log_dir = self.log_dir.clone();
        dp.mps_check_interval_ms = 100;
        dp.mps_restart_backoff_max_secs = 1;
    }

    /// Every line the daemons on this pipe directory recorded (`start <pid>`, commands).
    pub fn commands(&self) -> Vec<String> {
        std::fs::read_to_string(self.pipe_dir.join("fake-mps-commands.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// How many daemons were started.
    pub fn starts(&self) -> usize {
        self.commands()
            .iter()
            .filter(|l| l.starts_with("start "))
            .count()
    }

    /// The commands starting with `prefix`.
    pub fn sent(&self, prefix: &str) -> Vec<String> {
        self.commands()
            .into_iter()
            .filter(|l| l.starts_with(prefix))
            .collect()
    }

    /// The pid in the daemon's pid file.
    pub fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.pipe_dir.join("nvidia-cuda-mps-control.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn client(&self, input: &str) -> bool {
        let mut child = Command::new(&self.program)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the fake client runs (python3 on PATH)");
        if let Some(mut stdin) = child.stdin.take() {
            use std::io::Write;
            let _ = stdin.write_all(input.as_bytes());
        }
        child.wait().is_ok_and(|s| s.success())
    }

    /// Whether a daemon answers `get_server_list`.
    pub fn answers(&self) -> bool {
        self.client("get_server_list\n")
    }

    /// Starts a daemon as an operator would (`-d`), outside gpushare.
    pub fn start_by_hand(&self) {
        std::fs::create_dir_all(&self.pipe_dir).expect("pipe dir");
        let status = Command::new(&self.program)
            .arg("-d")
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("the fake daemon starts");
        assert!(status.success(), "fake -d: {status}");
    }

    /// Stops the daemon through its control pipe.
    pub fn quit(&self) -> bool {
        self.client("quit\n")
    }

    /// Kills the daemon (SIGKILL): a crash.
    pub fn kill(&self) {
        let pid = self.pid().expect("a daemon pid");
        let status = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -9 {pid}");
    }

    /// Makes `-d` fail (or work again).
    pub fn refuse_starts(&self, refuse: bool) {
        let flag = self.dir.path().join("refuse-start");
        if refuse {
            std::fs::write(flag, "").expect("flag written");
        } else {
            let _ = std::fs::remove_file(flag);
        }
    }
}

impl Drop for FakeMps {
    fn drop(&mut self) {
        // Only a daemon that still answers: a stale pid file may name a reused pid.
        if let Some(pid) = self.pid().filter(|_| self.answers()) {
            let _ = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}
