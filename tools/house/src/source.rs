//! The files the rules read: a map from a path relative to the repository root to the file's
//! text, read from disk (`SourceTree::read`) or given whole (`SourceTree::from_files`, the
//! tests' fixture trees). It knows no Rust: `crate_tree` and `reader` do.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// Text files by their path relative to the repository root (`src/extender/bind.rs`).
#[derive(Clone, Debug, Default)]
pub struct SourceTree {
    files: BTreeMap<PathBuf, String>,
}

impl SourceTree {
    /// The `.rs` files under each of `dirs` (recursively) and the other files named in `files`,
    /// all relative to `root`. A directory that does not exist is no error (a fixture tree
    /// may lack `tests/it`); a file named in `files` that does not exist is skipped too.
    pub fn read(root: &Path, dirs: &[&str], files: &[&str]) -> io::Result<SourceTree> {
        let mut tree = SourceTree::default();
        for dir in dirs {
            let dir = root.join(dir);
            if dir.is_dir() {
                tree.read_dir(root, &dir)?;
            }
        }
        for file in files {
            let path = root.join(file);
            if path.is_file() {
                tree.files
                    .insert(PathBuf::from(file), std::fs::read_to_string(&path)?);
            }
        }
        Ok(tree)
    }

    fn read_dir(&mut self, root: &Path, dir: &Path) -> io::Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.path()))
            .collect::<io::Result<_>>()?;
        entries.sort();
        for path in entries {
            // Symbolic links are not followed: the recorded sysfs trees link back to their
            // ancestors, and no source file is a link.
            let kind = std::fs::symlink_metadata(&path)?.file_type();
            if kind.is_dir() {
                self.read_dir(root, &path)?;
            } else if kind.is_file() && path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)?;
                let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
                self.files.insert(rel, text);
            }
        }
        Ok(())
    }

    /// A tree of the given `(path, text)` pairs.
    pub fn from_files<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> SourceTree {
        SourceTree {
            files: files
                .into_iter()
                .map(|(p, t)| (PathBuf::from(p), t.to_string()))
                .collect(),
        }
    }

    /// The text of `path`, if the tree holds it.
    pub fn get(&self, path: &Path) -> Option<&str> {
        self.files.get(path).map(String::as_str)
    }

    /// Whether the tree holds `path`.
    pub fn contains(&self, path: &Path) -> bool {
        self.files.contains_key(path)
    }

    /// The `.rs` files under `dir`, in path order.
    pub fn rust_files_under<'a>(&'a self, dir: &'a Path) -> impl Iterator<Item = &'a Path> + 'a {
        self.files
            .keys()
            .filter(move |p| p.starts_with(dir) && p.extension().is_some_and(|e| e == "rs"))
            .map(PathBuf::as_path)
    }
}
