//! What the limiter's tests share: the C fakes and programs built with the system C compiler
//! (once per source content, cached under the temp directory), the limiter library cargo
//! built, a container's files (limits and state directory), processes run with the limiter
//! preloaded, read line by line against a deadline, and a container's root in a private mount
//! namespace with the bind mounts a container would get ([`ContainerRoot`]).
//!
//! gpushare's own integration tests (`tests/it/support/limiter.rs`) include this file too:
//! they run the same fakes and probe under the mounts the node agent hands a container.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

pub const GIB: u64 = 1 << 30;
/// The fake GPU most tests use: 16 GiB.
pub const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000001";
/// A second fake GPU.
pub const GPU1: &str = "GPU-3c1b7e8a-5b2f-4d0e-9a4c-1f2e3d4c5b6a";
/// How long a test waits for a line from a program before failing.
pub const DEADLINE: Duration = Duration::from_secs(30);

const SOURCES: &[(&str, &str)] = &[
    ("fake_cuda.c", include_str!("../c/fake_cuda.c")),
    ("fake_nvml.c", include_str!("../c/fake_nvml.c")),
    ("next.c", include_str!("../c/next.c")),
    ("wrap.c", include_str!("../c/wrap.c")),
    ("wrapcheck.c", include_str!("../c/wrapcheck.c")),
    ("probe.c", include_str!("../c/probe.c")),
    ("bench.c", include_str!("../c/bench.c")),
];

/// What `cc` makes of the sources: (output, arguments after `cc`).
const BUILDS: &[(&str, &[&str])] = &[
    (
        "libcuda.so.1",
        // -Bsymbolic: the driver's own tables and calls bind to its own functions, as in a
        // real driver; -fno-ipa-icf keeps every versioned entry point a distinct function.
        &[
            "-shared",
            "-fPIC",
            "-O1",
            "-fno-ipa-icf",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
            "fake_cuda.c",
            "-lpthread",
        ],
    ),
    (
        "libnvidia-ml.so.1",
        &[
            "-shared",
            "-fPIC",
            "-O1",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libnvidia-ml.so.1",
            "fake_nvml.c",
        ],
    ),
    ("libnext.so", &["-shared", "-fPIC", "-O1", "next.c", "-ldl"]),
    ("libwrap.so", &["-shared", "-fPIC", "-O1", "wrap.c", "-ldl"]),
    (
        "wrapcheck",
        &["-O1", "wrapcheck.c", "-L.", "-lwrap", "-Wl,-rpath,$ORIGIN"],
    ),
    (
        "probe",
        &[
            "-O1",
            "probe.c",
            "-L.",
            "-lnext",
            "-ldl",
            "-Wl,-rpath,$ORIGIN",
        ],
    ),
    (
        "probe_linked",
        &[
            "-O1",
            "-DLINKED",
            "probe.c",
            "-L.",
            "-l:libcuda.so.1",
            "-l:libnvidia-ml.so.1",
            "-lnext",
            "-ldl",
            "-Wl,-rpath,$ORIGIN",
        ],
    ),
    ("bench", &["-O2", "bench.c", "-ldl", "-Wl,-rpath,$ORIGIN"]),
];

/// The directory with the built fakes and programs.
pub fn built() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| build().unwrap_or_else(|e| panic!("building the C fakes: {e}")))
}

fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn build() -> Result<PathBuf, String> {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for (name, text) in SOURCES {
        hash = fnv1a(name.as_bytes(), hash);
        hash = fnv1a(text.as_bytes(), hash);
    }
    for (out, args) in BUILDS {
        hash = fnv1a(out.as_bytes(), hash);
        hash = fnv1a(args.join(" ").as_bytes(), hash);
    }
    let dir = std::env::temp_dir().join(format!("gpushare-limiter-fakes-{hash:016x}"));
    if dir.join("done").is_file() {
        return Ok(dir);
    }
    // Built in a private directory, then renamed into place: parallel tests race harmlessly.
    let partial = std::env::temp_dir().join(
        format!(
            "gpushare-limiter-fakes-{hash:016x}.{}.{:?}",
            std::process::id(),
            std::thread::current().id()
        )
        .replace(['(', ')'], ""),
    );
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(|e| e.to_string())?;
    for (name, text) in SOURCES {
        std::fs::write(partial.join(name), text).map_err(|e| e.to_string())?;
    }
    let cc = std::env::var("CC")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "cc".into());
    for (out, args) in BUILDS {
        let output = Command::new(&cc)
            .current_dir(&partial)
            .args(["-Wall", "-o", out])
            .args(*args)
            .output()
            .map_err(|e| format!("running `{cc}` (set CC to another compiler): {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "`{cc} -o {out} {}` failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    std::fs::write(partial.join("done"), b"").map_err(|e| e.to_string())?;
    match std::fs::rename(&partial, &dir) {
        Ok(()) => Ok(dir),
        Err(_) if dir.join("done").is_file() => {
            let _ = std::fs::remove_dir_all(&partial);
            Ok(dir)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The limiter library cargo built for this test run: `deps/` beside the test binary (cargo
/// rebuilds that copy for the tests; the one in `target/<profile>/` only for `cargo build`),
/// or the one `GPUSHARE_LIMITER_LIB` names (`make limiter` runs the tests against the
/// release build it made).
pub fn library() -> PathBuf {
    if let Some(lib) = std::env::var_os("GPUSHARE_LIMITER_LIB").filter(|l| !l.is_empty()) {
        let lib = PathBuf::from(lib);
        return std::fs::canonicalize(&lib)
            .unwrap_or_else(|e| panic!("GPUSHARE_LIMITER_LIB={}: {e}", lib.display()));
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let lib = deps.join("libgpushare_limiter.so");
    assert!(
        lib.is_file(),
        "{} is missing: cargo builds it with the tests (cargo test -p gpushare-limiter)",
        lib.display()
    );
    lib
}

/// A container's limiter files: `limits` and `state/` under one root (the test root the
/// library reads where the fixed path does not exist).
pub struct Container {
    pub root: tempfile::TempDir,
    /// The fake GPUs, `uuid=bytes,...`.
    pub gpus: String,
}

impl Container {
    /// A container limited to `limits` on the GPUs `gpus` (uuid, bytes).
    pub fn new(gpus: &[(&str, u64)], limits: &[(&str, u64)]) -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(root.path().join("state")).expect("state dir");
        let mut text = String::from("gpushare-limiter-limits 1\n");
        for (uuid, bytes) in limits {
            text.push_str(&format!("{uuid} {bytes}\n"));
        }
        std::fs::write(root.path().join("limits"), text).expect("limits file");
        let gpus = gpus
            .iter()
            .map(|(u, b)| format!("{u}={b}"))
            .collect::<Vec<_>>()
            .join(",");
        Container { root, gpus }
    }

    /// One 16 GiB GPU, 4 GiB for the container.
    pub fn four_of_sixteen() -> Self {
        Container::new(&[(GPU0, 16 * GIB)], &[(GPU0, 4 * GIB)])
    }

    pub fn state(&self) -> PathBuf {
        self.root.path().join("state")
    }

    pub fn calls_log(&self) -> PathBuf {
        self.root.path().join("calls.log")
    }

    /// The entry points the fake driver saw, one line each.
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.calls_log())
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `program` (a name in `built()`) with the limiter preloaded and this container's files.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(built().join(program));
        cmd.env("LD_PRELOAD", library())
            .env("GPUSHARE_LIMITER_ROOT", self.root.path())
            .env("FAKE_GPUS", &self.gpus)
            .env("FAKE_CUDA_LOG", self.calls_log())
            .env_remove("LD_LIBRARY_PATH");
        cmd
    }

    /// Runs the probe to the end; its output lines.
    pub fn probe(&self, route: &str, ops: &[&str]) -> Vec<String> {
        let program = if route == "linked" {
            "probe_linked"
        } else {
            "probe"
        };
        run_to_end(self.command(program).arg(route).args(ops))
    }

    /// Starts the probe; read its lines and feed its `wait`s through the returned handle.
    pub fn spawn(&self, route: &str, ops: &[&str]) -> Running {
        let program = if route == "linked" {
            "probe_linked"
        } else {
            "probe"
        };
        Running::start(self.command(program).arg(route).args(ops))
    }
}

/// Runs `cmd`, failing the test unless it exits with status 0; its stdout lines.
pub fn run_to_end(cmd: &mut Command) -> Vec<String> {
    let out = cmd.output().expect("the program runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} exited with {}:\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout.lines().map(str::to_string).collect()
}

/// A program running, its stdout read line by line by a thread.
pub struct Running {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    pub fn start(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the program starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Running {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next line, within the deadline.
    pub fn line(&mut self) -> String {
        match self.lines.recv_timeout(DEADLINE) {
            Ok(l) => {
                self.seen.push(l.clone());
                l
            }
            Err(RecvTimeoutError::Timeout) => {
                panic!("no line within {DEADLINE:?}; seen so far: {:?}", self.seen)
            }
            Err(RecvTimeoutError::Disconnected) => {
                panic!("the program ended; seen: {:?}", self.seen)
            }
        }
    }

    /// Reads lines until one equals `expected` (within the deadline); the lines before it.
    pub fn until(&mut self, expected: &str) -> Vec<String> {
        let start = Instant::now();
        let mut before = Vec::new();
        loop {
            assert!(
                start.elapsed() < DEADLINE,
                "{expected:?} not seen: {before:?}"
            );
            let l = self.line();
            if l == expected {
                return before;
            }
            before.push(l);
        }
    }

    /// Lets one `wait` op go on.
    pub fn resume(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(b"go\n").expect("write");
        stdin.flush().expect("flush");
    }

    /// Closes stdin: every `wait` from now on goes on at once.
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Every remaining line, after the program exits with status 0.
    pub fn finish(mut self) -> Vec<String> {
        self.close_stdin();
        let mut rest = Vec::new();
        loop {
            match self.lines.recv_timeout(DEADLINE) {
                Ok(l) => rest.push(l),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => panic!("the program did not end: {rest:?}"),
            }
        }
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "exit {status}: {:?} {rest:?}", self.seen);
        rest
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A failed test must not leave its program behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sets up a container's root in the private namespace: a tmpfs with the host's `/usr` (its
/// `/usr/local` a tmpfs of its own) and library directories, then each bind mount given as
/// `<host path> <container path> ro|rw` triples up to `--` (the mount point made as a file
/// or directory like its source), the built fakes read-only at `/work`, `/dev` and `/proc`;
/// then runs the rest of the arguments in it (chroot).
const SETUP: &str = r#"
set -eu
root=$1 work=$2
shift 2
mount -t tmpfs tmpfs "$root"
mkdir -p "$root/usr" "$root/etc" "$root/proc" "$root/tmp" "$root/work" "$root/dev"
mount --rbind /usr "$root/usr"
for d in bin sbin lib lib64 lib32 libx32; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$root/$d"
  elif [ -d "/$d" ]; then mkdir "$root/$d"; mount --rbind "/$d" "$root/$d"; fi
done
mount -t tmpfs tmpfs "$root/usr/local"
bind() {
  dest=$root$2
  mkdir -p "$(dirname "$dest")"
  if [ -d "$1" ]; then mkdir -p "$dest"; elif [ ! -e "$dest" ]; then : > "$dest"; fi
  mount --bind "$1" "$dest"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$dest"; fi
}
while [ "$1" != "--" ]; do
  bind "$1" "$2" "$3"
  shift 3
done
shift
bind "$work" /work ro
mount --rbind /dev "$root/dev"
mount -t proc proc "$root/proc"
exec chroot "$root" "$@"
"#;

/// How to get a private mount namespace here: the command prefix, or why there is none.
pub fn namespace_runner() -> &'static Result<Vec<String>, String> {
    static RUNNER: OnceLock<Result<Vec<String>, String>> = OnceLock::new();
    RUNNER.get_or_init(|| {
        let works = |prefix: &[&str]| {
            let (program, args) = prefix.split_first().expect("a program");
            Command::new(program)
                .args(args)
                .args([
                    "unshare",
                    "-m",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    "mount -t tmpfs tmpfs /tmp",
                ])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if works(&["env"]) {
            Ok(vec![])
        } else if works(&["sudo", "-n", "--preserve-env"]) {
            Ok(vec!["sudo".into(), "-n".into(), "--preserve-env".into()])
        } else {
            Err("`unshare -m` with mounts needs root (or `sudo -n`)".into())
        }
    })
}

/// The namespace runner, or `None` after printing `SKIPPED: <test>: <why>` (under `CI=true` a
/// skip fails the test).
pub fn namespace_or_skip(test: &str) -> Option<Vec<String>> {
    match namespace_runner() {
        Ok(r) => Some(r.clone()),
        Err(why) => {
            assert!(
                std::env::var("CI").ok().as_deref() != Some("true"),
                "{test}: {why} (CI=true: a skip is a failure)"
            );
            eprintln!("SKIPPED: {test}: {why}");
            None
        }
    }
}

/// One bind mount into a container: host path, container path, read-only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindMount {
    pub host: PathBuf,
    pub container: String,
    pub read_only: bool,
}

/// A container's root, built afresh in a private mount namespace for each command: the host's
/// programs and libraries, the built fakes at `/work`, and `mounts` applied in their order,
/// as a container runtime applies a container's mounts.
pub struct ContainerRoot {
    dir: tempfile::TempDir,
    runner: Vec<String>,
    mounts: Vec<BindMount>,
}

impl ContainerRoot {
    /// A root with `mounts`, run through `runner` ([`namespace_or_skip`]).
    pub fn new(runner: Vec<String>, mounts: Vec<BindMount>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        ContainerRoot {
            dir,
            runner,
            mounts,
        }
    }

    /// A command running `program args` inside the container (with the fake GPUs of the
    /// caller's `FAKE_GPUS`, which the caller sets).
    pub fn command(&self, program: &str, args: &[&str]) -> Command {
        let (first, rest) = match self.runner.split_first() {
            Some((f, r)) => (f.as_str(), r),
            None => ("unshare", &[][..]),
        };
        let mut cmd = Command::new(first);
        cmd.args(rest);
        if !self.runner.is_empty() {
            cmd.arg("unshare");
        }
        cmd.args(["-m", "--propagation", "private", "sh", "-c", SETUP, "setup"])
            .arg(self.dir.path())
            .arg(built());
        for m in &self.mounts {
            cmd.arg(&m.host)
                .arg(&m.container)
                .arg(if m.read_only { "ro" } else { "rw" });
        }
        cmd.arg("--").arg(program).args(args);
        cmd.env_remove("LD_LIBRARY_PATH");
        cmd
    }
}
