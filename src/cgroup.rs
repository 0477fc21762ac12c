//! The cgroup v2 facts GPU memory enforcement needs, read under a `/proc` and a cgroup root
//! that are given ([`Roots`]: the host's, the host's as a container mounts them, or a fake tree
//! in the tests): the cgroup a process is in (the `0::` line of `/proc/<pid>/cgroup`, joined to
//! the root: its *leaf*), whether the root is cgroup v2 and which controllers it offers, the
//! dmem controller's capacity lines (`nvidia/<pci>/vidmem <bytes>`, one per GPU), whether a
//! cgroup has dmem files of its own, and whether it still holds a process (`cgroup.events`).
//!
//! A leaf is checked before anyone acts on it: never the root cgroup, never a path with `.` or
//! `..` components, always a directory under the root (its real path too, so a symlink cannot
//! lead out of the tree).
//!
//! [`EventsWatch`] (Linux) waits for the `cgroup.events` of a set of cgroups to change
//! (inotify), so a stopped container's cgroup is noticed while it still exists.
//!
//! It does not write anything, talk to the GPU, or know which container a cgroup belongs to.

use std::path::{Component, Path, PathBuf};

/// Where the host's `/proc` and cgroup v2 tree are read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roots {
    /// The `/proc` whose `<pid>/cgroup` names a process's cgroup.
    pub proc: PathBuf,
    /// The cgroup v2 root (`/sys/fs/cgroup`).
    pub cgroup: PathBuf,
}

/// The host's defaults: `/proc` and `/sys/fs/cgroup`.
pub const DEFAULT_PROC_ROOT: &str = "/proc";
/// See [`DEFAULT_PROC_ROOT`].
pub const DEFAULT_CGROUP_ROOT: &str = "/sys/fs/cgroup";

impl Default for Roots {
    fn default() -> Self {
        Roots {
            proc: PathBuf::from(DEFAULT_PROC_ROOT),
            cgroup: PathBuf::from(DEFAULT_CGROUP_ROOT),
        }
    }
}

/// A process's own cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// Its path in the hierarchy, as `/proc/<pid>/cgroup` shows it (`/kubepods.slice/…`).
    pub relative: String,
    /// The directory: the root joined with `relative`.
    pub path: PathBuf,
}

impl Leaf {
    /// The leaf `relative` (a hierarchy path such as `/kubepods/…/<id>`) under `root`, checked
    /// as [`leaf_of`] checks it.
    pub fn at(root: &Path, relative: &str) -> Result<Leaf, CgroupError> {
        let rel = Path::new(relative);
        let components: Vec<Component<'_>> = rel.components().collect();
        let normal = components
            .iter()
            .filter(|c| matches!(c, Component::Normal(_)))
            .count();
        if components.iter().any(|c| {
            matches!(
                c,
                Component::ParentDir | Component::CurDir | Component::Prefix(_)
            )
        }) {
            return Err(CgroupError::Unsafe {
                relative: relative.to_string(),
                why: "it holds . or .. components",
            });
        }
        if normal == 0 {
            return Err(CgroupError::Unsafe {
                relative: relative.to_string(),
                why: "it is the root cgroup, which holds every process of the host",
            });
        }
        let path = root.join(rel.strip_prefix("/").unwrap_or(rel));
        Ok(Leaf {
            relative: relative.to_string(),
            path,
        })
    }

    /// Whether the directory still exists.
    pub fn exists(&self) -> bool {
        self.path.is_dir()
    }

    /// The last component of the path (`cri-containerd-<id>.scope`).
    pub fn name(&self) -> &str {
        self.relative.rsplit('/').next().unwrap_or_default()
    }
}

/// Why a process's cgroup could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// `/proc/<pid>/cgroup` could not be read (the process is gone, or the root is wrong).
    #[error("cannot read {}: {source}", path.display())]
    Proc {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Only cgroup v1 lines: the host does not run the unified hierarchy.
    #[error(
        "{} has no cgroup v2 line (0::/…), only v1 controllers ({lines}): per-cgroup GPU memory \
         limits need cgroup v2 (boot with systemd.unified_cgroup_hierarchy=1)",
        path.display()
    )]
    V1 {
        /// The file read.
        path: PathBuf,
        /// Its first lines.
        lines: String,
    },
    /// The cgroup root is not a cgroup v2 mount.
    #[error(
        "{} is not a cgroup v2 root (no cgroup.controllers): per-cgroup GPU memory limits need \
         cgroup v2",
        root.display()
    )]
    NotV2 {
        /// The root.
        root: PathBuf,
    },
    /// The path may not be acted on.
    #[error("cgroup {relative:?} is refused: {why}")]
    Unsafe {
        /// The path as read.
        relative: String,
        /// Why.
        why: &'static str,
    },
    /// The directory is not there, or resolves outside the root.
    #[error("cgroup directory {} {why}", path.display())]
    Missing {
        /// The directory.
        path: PathBuf,
        /// `does not exist`, `is outside …`.
        why: String,
    },
}

/// Whether `root` is a cgroup v2 root (it has `cgroup.controllers`).
pub fn is_v2(root: &Path) -> bool {
    root.join("cgroup.controllers").is_file()
}

/// The controllers `root` offers (`cgroup.controllers`); empty when unreadable.
pub fn controllers(root: &Path) -> Vec<String> {
    std::fs::read_to_string(root.join("cgroup.controllers"))
        .map(|t| t.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The dmem controller's regions (`dmem.capacity` of the root): `(name, bytes)`, e.g.
/// `("nvidia/00000000:02:00.0/vidmem", 102641958912)`. Empty without the controller.
pub fn dmem_capacity(root: &Path) -> Vec<(String, u64)> {
    std::fs::read_to_string(root.join("dmem.capacity"))
        .map(|t| {
            t.lines()
                .filter_map(|l| {
                    let mut words = l.split_whitespace();
                    let name = words.next()?;
                    let bytes = words.next()?.parse().ok()?;
                    Some((name.to_string(), bytes))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The dmem region of the GPU at PCI bus id `pci` (`00000000:3B:00.0`): `nvidia/<pci>/vidmem`,
/// lower case, as the driver registers it.
pub fn dmem_region(pci: &str) -> String {
    format!("nvidia/{}/vidmem", pci.to_ascii_lowercase())
}

/// Whether cgroup directory `path` has dmem files of its own (its parent enabled `+dmem`).
pub fn has_dmem_files(path: &Path) -> bool {
    path.join("dmem.max").is_file()
}

/// Whether cgroup directory `path` still holds a process (`populated 1` in `cgroup.events`);
/// `None` when the file cannot be read (the cgroup is gone).
pub fn populated(path: &Path) -> Option<bool> {
    let text = std::fs::read_to_string(path.join("cgroup.events")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("populated "))
        .map(|v| v.trim() == "1")
}

/// The cgroup of process `pid` under `roots`: the `0::` line of `<proc>/<pid>/cgroup`, checked
/// ([`Leaf::at`]) and found to be a directory under the cgroup root.
pub fn leaf_of(roots: &Roots, pid: u32) -> Result<Leaf, CgroupError> {
    let file = roots.proc.join(pid.to_string()).join("cgroup");
    let text = std::fs::read_to_string(&file).map_err(|source| CgroupError::Proc {
        path: file.clone(),
        source,
    })?;
    let Some(relative) = text.lines().find_map(|l| l.strip_prefix("0::")) else {
        let lines: Vec<&str> = text.lines().take(3).collect();
        return Err(CgroupError::V1 {
            path: file,
            lines: lines.join(", "),
        });
    };
    if !is_v2(&roots.cgroup) {
        return Err(CgroupError::NotV2 {
            root: roots.cgroup.clone(),
        });
    }
    let leaf = Leaf::at(&roots.cgroup, relative.trim())?;
    check_inside(&roots.cgroup, &leaf.path)?;
    Ok(leaf)
}

/// `path` is a directory whose real path lies under `root`'s.
pub fn check_inside(root: &Path, path: &Path) -> Result<(), CgroupError> {
    let missing = |why: String| CgroupError::Missing {
        path: path.to_path_buf(),
        why,
    };
    let real = std::fs::canonicalize(path).map_err(|e| missing(format!("does not exist ({e})")))?;
    let real_root = std::fs::canonicalize(root)
        .map_err(|e| missing(format!("has no readable root {} ({e})", root.display())))?;
    if !real.starts_with(&real_root) || real == real_root {
        return Err(missing(format!(
            "resolves to {}, not below {}",
            real.display(),
            real_root.display()
        )));
    }
    if !real.is_dir() {
        return Err(missing("is not a directory".to_string()));
    }
    Ok(())
}

/// Waits for the `cgroup.events` file of watched cgroups to change (the kernel notifies a
/// modification when `populated` or `frozen` flips): inotify, Linux only.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct EventsWatch {
    fd: rustix::fd::OwnedFd,
    watched: std::collections::BTreeMap<PathBuf, i32>,
}

#[cfg(target_os = "linux")]
impl EventsWatch {
    /// A watch of nothing yet.
    pub fn new() -> std::io::Result<EventsWatch> {
        use rustix::fs::inotify::{CreateFlags, init};
        Ok(EventsWatch {
            fd: init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?,
            watched: std::collections::BTreeMap::new(),
        })
    }

    /// Watches the `cgroup.events` of each of `cgroups` (directories), and no other; returns
    /// those newly watched (a change before now is not reported: look at them once).
    pub fn set(&mut self, cgroups: &[PathBuf]) -> Vec<PathBuf> {
        use rustix::fs::inotify::{WatchFlags, add_watch, remove_watch};
        let gone: Vec<PathBuf> = self
            .watched
            .keys()
            .filter(|p| !cgroups.contains(p))
            .cloned()
            .collect();
        for p in gone {
            if let Some(wd) = self.watched.remove(&p) {
                let _ = remove_watch(&self.fd, wd);
            }
        }
        let mut added = Vec::new();
        for p in cgroups {
            if self.watched.contains_key(p) {
                continue;
            }
            if let Ok(wd) = add_watch(&self.fd, p.join("cgroup.events"), WatchFlags::MODIFY) {
                self.watched.insert(p.clone(), wd);
                added.push(p.clone());
            }
        }
        added
    }

    /// Waits up to `timeout` for changes; the cgroups whose `cgroup.events` changed.
    pub fn wait(&mut self, timeout: std::time::Duration) -> Vec<PathBuf> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        use rustix::fs::inotify::{ReadFlags, Reader};
        let limit = Timespec {
            tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        if !matches!(poll(&mut fds, Some(&limit)), Ok(n) if n > 0) {
            return Vec::new();
        }
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = Reader::new(&self.fd, &mut buf);
        let mut changed = Vec::new();
        let mut dropped = Vec::new();
        while let Ok(event) = reader.next() {
            let wd = event.wd();
            if let Some((p, _)) = self.watched.iter().find(|(_, w)| **w == wd) {
                if event.events().contains(ReadFlags::IGNORED) {
                    dropped.push(p.clone());
                } else if !changed.contains(p) {
                    changed.push(p.clone());
                }
            }
        }
        for p in dropped {
            self.watched.remove(&p);
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> (tempfile::TempDir, Roots) {
        let dir = tempfile::tempdir().expect("dir");
        let roots = Roots {
            proc: dir.path().join("proc"),
            cgroup: dir.path().join("cgroup"),
        };
        std::fs::create_dir_all(roots.cgroup.join("kubepods/pod1/c1")).expect("tree");
        std::fs::write(roots.cgroup.join("cgroup.controllers"), "cpu memory dmem\n")
            .expect("controllers");
        (dir, roots)
    }

    fn process(roots: &Roots, pid: u32, text: &str) {
        let dir = roots.proc.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("proc");
        std::fs::write(dir.join("cgroup"), text).expect("cgroup");
    }

    #[test]
    fn the_leaf_is_the_v2_line_under_the_root() {
        let (_d, roots) = tree();
        process(&roots, 42, "0::/kubepods/pod1/c1\n");
        let leaf = leaf_of(&roots, 42).expect("leaf");
        assert_eq!(leaf.relative, "/kubepods/pod1/c1");
        assert_eq!(leaf.path, roots.cgroup.join("kubepods/pod1/c1"));
        assert_eq!(leaf.name(), "c1");
        assert_eq!(controllers(&roots.cgroup), ["cpu", "memory", "dmem"]);
    }

    #[test]
    fn v1_root_escapes_and_missing_directories_are_refused() {
        let (_d, roots) = tree();
        process(
            &roots,
            1,
            "12:memory:/kubepods/pod1/c1\n1:name=systemd:/x\n",
        );
        assert!(matches!(leaf_of(&roots, 1), Err(CgroupError::V1 { .. })));
        process(&roots, 2, "0::/\n");
        let err = leaf_of(&roots, 2).expect_err("root");
        assert!(err.to_string().contains("root cgroup"), "{err}");
        process(&roots, 3, "0::/kubepods/../kubepods/pod1/c1\n");
        assert!(matches!(
            leaf_of(&roots, 3),
            Err(CgroupError::Unsafe { .. })
        ));
        process(&roots, 4, "0::/kubepods/pod1/gone\n");
        assert!(matches!(
            leaf_of(&roots, 4),
            Err(CgroupError::Missing { .. })
        ));
        assert!(matches!(leaf_of(&roots, 5), Err(CgroupError::Proc { .. })));
        #[cfg(unix)]
        {
            let outside = tempfile::tempdir().expect("outside");
            std::os::unix::fs::symlink(outside.path(), roots.cgroup.join("kubepods/link"))
                .expect("link");
            process(&roots, 6, "0::/kubepods/link\n");
            let err = leaf_of(&roots, 6).expect_err("escapes");
            assert!(err.to_string().contains("not below"), "{err}");
        }
        std::fs::remove_file(roots.cgroup.join("cgroup.controllers")).expect("rm");
        process(&roots, 7, "0::/kubepods/pod1/c1\n");
        assert!(matches!(leaf_of(&roots, 7), Err(CgroupError::NotV2 { .. })));
    }

    #[test]
    fn dmem_capacity_events_and_regions() {
        let (_d, roots) = tree();
        std::fs::write(
            roots.cgroup.join("dmem.capacity"),
            "nvidia/00000000:02:00.0/vidmem 102641958912\nbad line\n",
        )
        .expect("capacity");
        assert_eq!(
            dmem_capacity(&roots.cgroup),
            [("nvidia/00000000:02:00.0/vidmem".to_string(), 102641958912)]
        );
        assert_eq!(
            dmem_region("00000000:3B:00.0"),
            "nvidia/00000000:3b:00.0/vidmem"
        );
        let leaf = roots.cgroup.join("kubepods/pod1/c1");
        assert_eq!(populated(&leaf), None);
        std::fs::write(leaf.join("cgroup.events"), "populated 1\nfrozen 0\n").expect("events");
        assert_eq!(populated(&leaf), Some(true));
        std::fs::write(leaf.join("cgroup.events"), "populated 0\nfrozen 0\n").expect("events");
        assert_eq!(populated(&leaf), Some(false));
        assert!(!has_dmem_files(&leaf));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_watch_sees_cgroup_events_change() {
        let (_d, roots) = tree();
        let leaf = roots.cgroup.join("kubepods/pod1/c1");
        std::fs::write(leaf.join("cgroup.events"), "populated 1\n").expect("events");
        let mut watch = EventsWatch::new().expect("inotify");
        assert_eq!(watch.set(std::slice::from_ref(&leaf)), vec![leaf.clone()]);
        assert!(
            watch.set(std::slice::from_ref(&leaf)).is_empty(),
            "watched already"
        );
        assert!(watch.wait(std::time::Duration::from_millis(1)).is_empty());
        std::fs::write(leaf.join("cgroup.events"), "populated 0\n").expect("events");
        assert_eq!(
            watch.wait(std::time::Duration::from_secs(5)),
            vec![leaf.clone()]
        );
        watch.set(&[]);
        std::fs::write(leaf.join("cgroup.events"), "populated 1\n").expect("events");
        assert!(watch.wait(std::time::Duration::from_millis(50)).is_empty());
    }
}
