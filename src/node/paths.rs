//! Which kubelet path offers each GPU: the device plugin (`aliyun.com/gpu-mem` as fake
//! devices, placed by the extender) or a DRA kubelet plugin (a ResourceSlice, placed by the
//! DRA allocator). A GPU is offered on ONE path at a time: on both, its memory would be counted
//! twice, because the extender's ledger and the DRA allocator do not see each other.
//!
//! Pure bookkeeping inside one process: [`Assignments::offer`] refuses a GPU another path
//! holds, and [`Assignments::withdraw`] frees a path's GPUs when its role stops. Across
//! processes (the roles run as separate DaemonSets) the GPU lock files ([`super::gpu_locks`])
//! do the same, and the gate of each path ([`super::path_gate`]) checks both, and what the
//! other path's pods still hold, before a GPU is offered. It does not publish anything and
//! does not decide which path a GPU should have (the roles ask; first come, first served).

use std::collections::BTreeMap;
use std::fmt;

/// A kubelet path a GPU can be offered on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServingPath {
    /// The device plugin (`gpushare device-plugin`).
    DevicePlugin,
    /// A DRA kubelet plugin.
    Dra,
}

impl fmt::Display for ServingPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServingPath::DevicePlugin => "the device plugin",
            ServingPath::Dra => "the DRA kubelet plugin",
        })
    }
}

/// A path asked for GPUs another path already offers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{wanted} cannot offer GPU(s) {}: {} already offered by {held} (a GPU on both paths would \
     have its memory counted twice)",
    list(indices), if indices.len() == 1 { "it is" } else { "they are" }
)]
pub struct PathConflict {
    /// The path that asked.
    pub wanted: ServingPath,
    /// The path that holds them.
    pub held: ServingPath,
    /// The GPUs (indices) refused.
    pub indices: Vec<u32>,
}

fn list(indices: &[u32]) -> String {
    indices
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The path of each GPU that is offered, by GPU index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignments {
    paths: BTreeMap<u32, ServingPath>,
}

impl Assignments {
    /// Offers `indices` on `path`: all of them, or none when any is held by another path.
    /// Offering a GPU again on the path that holds it is no change.
    pub fn offer(
        &mut self,
        path: ServingPath,
        indices: impl IntoIterator<Item = u32>,
    ) -> Result<(), PathConflict> {
        let indices: Vec<u32> = indices.into_iter().collect();
        let mut conflict: Option<PathConflict> = None;
        for index in &indices {
            if let Some(held) = self.paths.get(index).copied()
                && held != path
            {
                conflict
                    .get_or_insert_with(|| PathConflict {
                        wanted: path,
                        held,
                        indices: Vec::new(),
                    })
                    .indices
                    .push(*index);
            }
        }
        if let Some(conflict) = conflict {
            return Err(conflict);
        }
        for index in indices {
            self.paths.insert(index, path);
        }
        Ok(())
    }

    /// Frees GPU `index` when `path` offers it.
    pub fn withdraw_one(&mut self, path: ServingPath, index: u32) {
        if self.paths.get(&index) == Some(&path) {
            self.paths.remove(&index);
        }
    }

    /// Frees every GPU `path` offers (its role stopped).
    pub fn withdraw(&mut self, path: ServingPath) {
        self.paths.retain(|_, p| *p != path);
    }

    /// The path that offers GPU `index`, if any.
    pub fn path_of(&self, index: u32) -> Option<ServingPath> {
        self.paths.get(&index).copied()
    }

    /// The GPUs `path` offers, in index order.
    pub fn offered_by(&self, path: ServingPath) -> Vec<u32> {
        self.paths
            .iter()
            .filter(|(_, p)| **p == path)
            .map(|(i, _)| *i)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_is_offered_on_one_path_at_a_time() {
        let mut a = Assignments::default();
        a.offer(ServingPath::DevicePlugin, [0, 1]).expect("free");
        assert_eq!(a.path_of(1), Some(ServingPath::DevicePlugin));
        // Offering again on the same path changes nothing.
        a.offer(ServingPath::DevicePlugin, [1]).expect("same path");
        // The other path is refused GPU 1, and gets none of what it asked for.
        let err = a.offer(ServingPath::Dra, [2, 1]).expect_err("held");
        assert_eq!(err.indices, [1]);
        assert_eq!(err.held, ServingPath::DevicePlugin);
        assert!(
            err.to_string()
                .contains("GPU(s) 1: it is already offered by the device plugin"),
            "{err}"
        );
        assert_eq!(a.path_of(2), None);
        a.offer(ServingPath::Dra, [2]).expect("free GPU");
        assert_eq!(a.offered_by(ServingPath::Dra), [2]);
        assert_eq!(a.offered_by(ServingPath::DevicePlugin), [0, 1]);
        // Once the device plugin withdraws, DRA may take its GPUs.
        a.withdraw(ServingPath::DevicePlugin);
        a.offer(ServingPath::Dra, [0, 1]).expect("freed");
        let err = a
            .offer(ServingPath::DevicePlugin, [0, 1, 3])
            .expect_err("held by DRA");
        assert_eq!(err.indices, [0, 1]);
        assert_eq!(a.path_of(3), None);
    }
}
