//! The CUDA memory limiter on this node (`enforcement = limiter`, or `auto` without the
//! driver's limits): the library installed on the host ([`library`]), each served container's
//! limits file and state directory ([`containers`]), and what the node agent reads back of it
//! ([`usage`]). docs/enforcement.md describes it for users; `gpushare_limiter_contract` is
//! what the node agent and the library agree on.
//!
//! How a container gets it, on both serving paths: four bind mounts — the preload list over
//! `/etc/ld.so.preload` and the library (both from `limiter_dir`), the container's own limits
//! file (read-only) and state directory — from Allocate's `mounts` on the device-plugin path
//! ([`Limiter::device_plugin`]), from the `containerEdits.mounts` of each GPU share of the
//! claim's CDI spec on the DRA path ([`Limiter::dra_share`]). The dynamic loader reads
//! `/etc/ld.so.preload` itself, so no environment variable is involved, and the files are
//! read-only: nothing a pod sets turns the limiter off or raises its limit (the webhook
//! refuses pod specs that would mount over those paths).
//!
//! What "the node allows it" means ([`probe`]): the library is installed on the host (the
//! node agent installs `limiter_library` into `limiter_dir` at start; the image carries one),
//! it is an ELF shared object of this node's architecture, the per-container directory can be
//! used, and every served GPU has a UUID the limits file can name. Whether a container's
//! programs load it (dynamically linked glibc 2.17+ programs do; static and musl programs do
//! not) is the image's side, which the node cannot see: docs/enforcement.md says so.
//!
//! It does not decide the mechanism ([`super::decide`]) or speak a kubelet protocol.

pub mod containers;
pub mod library;
pub mod usage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::NodeConfig;
use crate::gpu::Inventory;
use crate::node::contract::MountEdit;
use containers::{ContainerFiles, CreateError, Key, Owner};
use library::LibraryInfo;

/// `statfs`'s `f_type` of a tmpfs.
#[cfg(unix)]
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// What the node offers of the limiter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LimiterSupport {
    /// Why the limiter cannot be used here, each with its fix; empty: it can.
    pub problems: Vec<String>,
    /// The library containers get (installed, or the one the node agent installs at start).
    pub library: Option<LibraryInfo>,
    /// Notes that do not stop the limiter (what was installed, a state directory off tmpfs).
    pub notes: Vec<String>,
}

impl LimiterSupport {
    /// Whether the limiter can be used.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// Support refused for a reason given (the mechanism was not asked for).
    pub fn not_asked(why: String) -> LimiterSupport {
        LimiterSupport {
            problems: vec![why],
            ..LimiterSupport::default()
        }
    }
}

/// Whether `path` is on a tmpfs (`None`: it cannot be told, as everywhere but on unix).
#[cfg(not(unix))]
fn on_tmpfs(_path: &Path) -> Option<bool> {
    None
}

/// Whether `path` is on a tmpfs (`None`: it cannot be told).
#[cfg(unix)]
fn on_tmpfs(path: &Path) -> Option<bool> {
    let st = rustix::fs::statfs(path).ok()?;
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
    let kind = i64::from(st.f_type as i64);
    Some(kind == TMPFS_MAGIC)
}

/// What the node offers of the limiter, from `config`'s paths and `inventory`'s GPUs. With
/// `install` (the node agent at start) installs `limiter_library` into `limiter_dir` and
/// creates `limiter_run_dir`; without (doctor) only looks: a library the node agent will
/// install counts.
pub fn probe(config: &NodeConfig, inventory: &Inventory, install: bool) -> LimiterSupport {
    let mut s = LimiterSupport::default();
    let dir = &config.limiter_dir;
    let installed = library::installed_path(dir);
    let source = &config.limiter_library;
    let has_source = !source.as_os_str().is_empty() && source.is_file();
    // GPUs the limits file cannot name (fake GPUs) rule it out before anything is installed.
    for gpu in &inventory.devices {
        if let Err(e) = gpushare_limiter_contract::GpuUuid::parse(&gpu.uuid) {
            s.problems.push(format!(
                "GPU {}: the limiter names GPUs by UUID and {e}",
                gpu.index
            ));
        }
    }
    if install && has_source && s.problems.is_empty() {
        match library::install(source, dir) {
            Ok(done) => {
                if done.wrote_library {
                    s.notes.push(format!(
                        "installed {} from {}",
                        installed.display(),
                        source.display()
                    ));
                    tracing::info!(library = %installed.display(), from = %source.display(), "installed the CUDA memory limiter");
                }
            }
            Err(e) => s.problems.push(format!(
                "the limiter {} cannot be installed: {e}; fix: make {} the libgpushare_limiter.so \
                 of this node's architecture (make limiter builds it), or set \
                 --limiter-library",
                source.display(),
                source.display()
            )),
        }
    }
    let uuids_ok = s.problems.is_empty();
    if uuids_ok {
        match library::inspect(&installed) {
            Ok(info) => {
                if !install && has_source {
                    let same = std::fs::read(&installed).ok() == std::fs::read(source).ok();
                    if !same {
                        s.notes.push(format!(
                            "{} differs from {}: the node agent installs the latter at start",
                            installed.display(),
                            source.display()
                        ));
                    }
                }
                if !install && !library::preload_path(dir).is_file() && !has_source {
                    s.problems.push(format!(
                        "{} is missing: containers would get no preload list; fix: run the node \
                         agent with --limiter-library",
                        library::preload_path(dir).display()
                    ));
                }
                s.library = Some(info);
            }
            Err(library::LibraryError::Read { source: e, .. })
                if e.kind() == std::io::ErrorKind::NotFound && !install && has_source =>
            {
                match library::inspect(source) {
                    Ok(info) => {
                        s.notes.push(format!(
                            "not installed yet: the node agent installs {} into {} at start",
                            source.display(),
                            dir.display()
                        ));
                        s.library = Some(info);
                    }
                    Err(e) => s.problems.push(format!(
                        "{e}; fix: make {} the libgpushare_limiter.so of this node's architecture",
                        source.display()
                    )),
                }
            }
            Err(library::LibraryError::Read { source: e, .. })
                if e.kind() == std::io::ErrorKind::NotFound =>
            {
                let from = if source.as_os_str().is_empty() {
                    "--limiter-library is empty".to_string()
                } else {
                    format!("{} does not exist", source.display())
                };
                s.problems.push(format!(
                    "the limiter library is not installed: {} does not exist and there is \
                     nothing to install it from ({from}); fix: put libgpushare_limiter.so (make \
                     limiter builds it) at {} and run the node agent with --limiter-library \
                     pointing at it (the image carries it there)",
                    installed.display(),
                    crate::config::DEFAULT_LIMITER_LIBRARY,
                ));
            }
            Err(e) => s.problems.push(format!(
                "{e}; fix: install the libgpushare_limiter.so of this node's architecture \
                 (make limiter builds it)"
            )),
        }
    }
    check_run_dir(&config.limiter_run_dir, install, &mut s);
    s
}

/// The limiter's per-container directory `run` (created when `install`): a problem when it
/// cannot be used, a note when it is not on a tmpfs.
fn check_run_dir(run: &Path, install: bool, s: &mut LimiterSupport) {
    let run_problem = if install {
        if s.problems.is_empty() {
            std::fs::create_dir_all(run).err().map(|e| e.to_string())
        } else {
            None
        }
    } else {
        let parent_is_dir = run.parent().is_some_and(Path::is_dir);
        (!run.is_dir() && !parent_is_dir).then(|| "neither it nor its parent exists".to_string())
    };
    if let Some(why) = run_problem {
        s.problems.push(format!(
            "the limiter's per-container directory {} cannot be used ({why}); fix: mount a host \
             tmpfs directory there (/run/gpushare/limiter)",
            run.display()
        ));
    } else if let Some(false) = on_tmpfs(if run.is_dir() {
        run
    } else {
        run.parent().unwrap_or(run)
    }) {
        s.notes.push(format!(
            "{} is not on a tmpfs: the containers' ledgers are shared memory maps, best kept in \
             memory (a directory under /run)",
            run.display()
        ));
    }
}

/// The limiter of this node: where its files are, what was found, and the containers' files.
#[derive(Debug)]
pub struct Limiter {
    dir: PathBuf,
    run_dir: PathBuf,
    support: LimiterSupport,
}

impl Limiter {
    /// The limiter as `support` found it, with `config`'s paths.
    pub fn new(config: &NodeConfig, support: LimiterSupport) -> Limiter {
        Limiter {
            dir: config.limiter_dir.clone(),
            run_dir: config.limiter_run_dir.clone(),
            support,
        }
    }

    /// What the node offers of it.
    pub fn support(&self) -> &LimiterSupport {
        &self.support
    }

    /// Where the per-container directories are.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    fn inject(&self, key: &Key, owner: &Owner) -> Result<Vec<MountEdit>, CreateError> {
        let files: ContainerFiles = containers::create(&self.run_dir, key, owner)?;
        Ok(containers::mounts(&self.dir, &files))
    }

    /// The mounts of a device-plugin container: `bytes` of GPU `uuid` for container
    /// `container` of pod (`namespace`, `pod`, `pod_uid`), or — the single-GPU fallback, the
    /// pod unknown — for the container of `device_ids`. Writes its files first. Blocking.
    pub fn device_plugin(
        &self,
        pod: Option<(&str, &str, &str, &str)>,
        device_ids: &[String],
        uuid: &str,
        bytes: u64,
    ) -> Result<Vec<MountEdit>, CreateError> {
        let limits = BTreeMap::from([(uuid.to_string(), bytes)]);
        let (key, owner) = match pod {
            Some((namespace, name, uid, container)) => (
                Key::device_plugin(uid, container).map_err(|e| CreateError::Io {
                    path: self.run_dir.clone(),
                    source: std::io::Error::other(e),
                })?,
                Owner {
                    path: containers::PATH_DEVICE_PLUGIN.into(),
                    namespace: namespace.into(),
                    pod: name.into(),
                    pod_uid: uid.into(),
                    container: container.into(),
                    limits,
                    ..Owner::default()
                },
            ),
            None => (
                Key::device_plugin_unmatched(device_ids),
                Owner {
                    path: containers::PATH_DEVICE_PLUGIN.into(),
                    device_ids: device_ids.to_vec(),
                    limits,
                    ..Owner::default()
                },
            ),
        };
        self.inject(&key, &owner)
    }

    /// The mounts of share `share` (serving `request`) of DRA claim `claim_uid`: `bytes` of
    /// GPU `uuid`. Writes its files first. Blocking.
    pub fn dra_share(
        &self,
        claim_uid: &str,
        share: usize,
        request: &str,
        uuid: &str,
        bytes: u64,
    ) -> Result<Vec<MountEdit>, CreateError> {
        let key = Key::dra(claim_uid, share).map_err(|e| CreateError::Io {
            path: self.run_dir.clone(),
            source: std::io::Error::other(e),
        })?;
        let mut owner = Owner {
            path: containers::PATH_DRA.into(),
            claim_uid: claim_uid.into(),
            request: request.into(),
            limits: BTreeMap::from([(uuid.to_string(), bytes)]),
            ..Owner::default()
        };
        // A claim prepared again keeps the pod found for it.
        if let Some((_, old)) = containers::list_one(&self.run_dir, &key) {
            owner.namespace = old.namespace;
            owner.pod = old.pod;
            owner.pod_uid = old.pod_uid;
            owner.container = old.container;
        }
        self.inject(&key, &owner)
    }

    /// Removes the files of every DRA share whose claim is not in `prepared` (the DRA plugin's
    /// checkpoint at start, before it serves: claims unprepared while it was down, or whose
    /// unprepare it lost). Returns how many directories went. Blocking.
    pub fn release_claims_except(
        &self,
        prepared: &std::collections::BTreeSet<String>,
    ) -> std::io::Result<usize> {
        let (entries, _) = containers::list(&self.run_dir);
        let mut n = 0;
        for (key, owner) in entries {
            if owner.path == containers::PATH_DRA && !prepared.contains(&owner.claim_uid) {
                containers::remove(&self.run_dir, &key)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Removes every share's files of DRA claim `claim_uid` (unprepare). Blocking.
    pub fn release_claim(&self, claim_uid: &str) -> std::io::Result<usize> {
        let prefix = Key::dra_prefix(claim_uid);
        let Ok(entries) = std::fs::read_dir(&self.run_dir) else {
            return Ok(0);
        };
        let mut n = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if let Ok(key) = Key::parse(&name) {
                containers::remove(&self.run_dir, &key)?;
                n += 1;
            }
        }
        Ok(n)
    }
}
