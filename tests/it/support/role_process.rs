//! A role started as the built binary, as a container starts it: its arguments and an
//! environment of exactly the variables given (nothing inherited but `PATH`), stdout and
//! stderr into one log file (no pipe to fill), stopped (SIGKILL) when dropped. A role that
//! exits while a test waits on it fails the test with its status and its log: a container
//! that would crash-loop. [`RoleProcess::kill_and_restart`] is `kill -9` and the container's
//! restart: the same program, arguments and environment, the log continued.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

/// A running role.
pub(crate) struct RoleProcess {
    name: String,
    child: Child,
    log: PathBuf,
    /// What it was started with (a restart starts it the same way).
    command: Launch,
    _dir: tempfile::TempDir,
}

/// A role's program, arguments and environment.
struct Launch {
    bin: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Launch {
    /// Starts it, stdout and stderr appended to `log`.
    fn spawn(&self, name: &str, log: &std::path::Path) -> Child {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("the log file");
        let err = file.try_clone().expect("the log file again");
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err);
        if let Some(path) = std::env::var_os("PATH") {
            cmd.env("PATH", path);
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.spawn()
            .unwrap_or_else(|e| panic!("{name}: cannot start {}: {e}", self.bin.display()))
    }
}

impl std::fmt::Debug for RoleProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoleProcess")
            .field("name", &self.name)
            .field("pid", &self.child.id())
            .finish()
    }
}

impl RoleProcess {
    /// Starts `program` (the gpushare binary unless given) with `args` and `env`; `name` says
    /// which role it is in failures.
    pub(crate) fn start(
        name: &str,
        program: Option<&std::path::Path>,
        args: &[String],
        env: &[(String, String)],
    ) -> RoleProcess {
        let dir = tempfile::tempdir().expect("a log directory");
        let log = dir.path().join(format!("{}.log", name.replace('/', "_")));
        let command = Launch {
            bin: program.map_or_else(super::bin, std::path::Path::to_path_buf),
            args: args.to_vec(),
            env: env.to_vec(),
        };
        let child = command.spawn(name, &log);
        RoleProcess {
            name: name.to_string(),
            child,
            log,
            command,
            _dir: dir,
        }
    }

    /// Kills the role with SIGKILL (no shutdown path of its own runs: what `kill -9`, the OOM
    /// killer or a node agent's crash do) and starts it again as it was started, its log
    /// continued in the same file.
    pub(crate) fn kill_and_restart(&mut self) {
        use std::os::unix::process::ExitStatusExt as _;
        self.child.kill().expect("SIGKILL to the role");
        let status = self.child.wait().expect("the killed role's status");
        assert_eq!(
            status.signal(),
            Some(9),
            "{} exited by itself ({status}) before it was killed; its log:\n{}",
            self.name,
            self.log()
        );
        self.child = self.command.spawn(&self.name, &self.log);
    }

    /// The role's name as given.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// What it printed so far (stdout and stderr, interleaved as written).
    pub(crate) fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// Its exit status, when it has exited.
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Fails the test when the role has exited: a container that would crash-loop, with its
    /// status and log.
    pub(crate) fn assert_running(&mut self) {
        if let Some(status) = self.exited() {
            panic!(
                "{} exited ({status}) — its container would crash-loop; its log:\n{}",
                self.name,
                self.log()
            );
        }
    }

    /// Polls `cond` until it holds, failing the test when the role exits first (with its
    /// log) or after `limit` (naming `what` and the log so far).
    pub(crate) async fn wait_for(
        &mut self,
        what: &str,
        limit: Duration,
        cond: impl FnMut() -> bool,
    ) {
        self.wait_for_seen(what, limit, cond, String::new).await;
    }

    /// [`Self::wait_for`], naming in its failure also what `seen` says then (the other side's
    /// view: a kubelet's record of the plugin, say).
    pub(crate) async fn wait_for_seen(
        &mut self,
        what: &str,
        limit: Duration,
        mut cond: impl FnMut() -> bool,
        seen: impl Fn() -> String,
    ) {
        let end = tokio::time::Instant::now() + limit;
        loop {
            if cond() {
                return;
            }
            self.assert_running();
            assert!(
                tokio::time::Instant::now() < end,
                "timed out after {limit:?} waiting for {what} of {}; seen: {}; its log:\n{}",
                self.name,
                seen(),
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for RoleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
