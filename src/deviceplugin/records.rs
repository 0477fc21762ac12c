//! What the plugin answered kubelet, keyed by pod UID: per container the device IDs kubelet
//! passed, the GPU given and whether the pod's annotations already say so.
//!
//! A container is entered here the moment it is matched (before its PATCH), so a concurrent
//! Allocate never matches it again and a PATCH whose outcome is unknown keeps its claim; an
//! entry leaves when its pod is gone (deleted, re-created under the same name with another
//! UID, finished), when kubelet gives its device IDs to another container (kubelet hands out
//! the IDs of a running container to nobody else), or when its PATCH was definitely refused.
//!
//! Pure bookkeeping: no I/O, no clock, no locks (the plugin holds it in a mutex that is never
//! held across an await).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::core::GpuMem;

/// One container's allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ContainerGrant {
    /// Container name.
    pub container: String,
    /// Units asked for (the number of device IDs).
    pub units: GpuMem,
    /// The device IDs kubelet passed.
    pub device_ids: Vec<String>,
    /// The GPU handed out.
    pub gpu_index: u32,
    /// Whether the pod's annotations record it (the PATCH succeeded).
    pub recorded: bool,
    /// Order of the answers (higher is later).
    pub seq: u64,
}

/// The allocations of one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PodGrants {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Containers answered, in the order they were.
    pub containers: Vec<ContainerGrant>,
}

/// Identifies a pod: UID, namespace and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PodId {
    /// `metadata.uid`.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// Every allocation answered, by pod UID.
#[derive(Debug, Default)]
pub(crate) struct Records {
    pods: BTreeMap<String, PodGrants>,
    /// Device ID → (pod UID, container).
    by_id: HashMap<String, (String, String)>,
    seq: u64,
}

impl Records {
    /// The containers of pod `uid` answered so far.
    pub(crate) fn containers_of(&self, uid: &str) -> impl Iterator<Item = &ContainerGrant> {
        self.pods
            .get(uid)
            .into_iter()
            .flat_map(|p| p.containers.iter())
    }

    /// The pod `uid`'s grants.
    pub fn pod(&self, uid: &str) -> Option<&PodGrants> {
        self.pods.get(uid)
    }

    /// Every pod with grants, by UID.
    pub fn pods(&self) -> impl Iterator<Item = (&String, &PodGrants)> {
        self.pods.iter()
    }

    /// The grant answered for exactly these device IDs (kubelet asking again with the same
    /// IDs), with its pod.
    pub(crate) fn for_ids(&self, ids: &[String]) -> Option<(PodId, ContainerGrant)> {
        let first = ids.first()?;
        let (uid, container) = self.by_id.get(first)?;
        let pod = self.pods.get(uid)?;
        let grant = pod.containers.iter().find(|c| &c.container == container)?;
        let asked: BTreeSet<&String> = ids.iter().collect();
        let held: BTreeSet<&String> = grant.device_ids.iter().collect();
        (asked == held).then(|| {
            (
                PodId {
                    uid: uid.clone(),
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                },
                grant.clone(),
            )
        })
    }

    /// Enters (or replaces) the grant of `container` of `pod`. Containers whose device IDs
    /// these are now are dropped: kubelet reuses the IDs only of containers that are gone.
    pub(crate) fn claim(
        &mut self,
        pod: &PodId,
        container: &str,
        device_ids: &[String],
        gpu_index: u32,
    ) -> u64 {
        self.remove_container(&pod.uid, container);
        let previous: BTreeSet<(String, String)> = device_ids
            .iter()
            .filter_map(|id| self.by_id.get(id).cloned())
            .collect();
        for (uid, c) in previous {
            self.remove_container(&uid, &c);
        }
        self.seq += 1;
        let entry = self
            .pods
            .entry(pod.uid.clone())
            .or_insert_with(|| PodGrants {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                containers: Vec::new(),
            });
        entry.containers.push(ContainerGrant {
            container: container.to_string(),
            units: GpuMem::new(device_ids.len() as u64),
            device_ids: device_ids.to_vec(),
            gpu_index,
            recorded: false,
            seq: self.seq,
        });
        for id in device_ids {
            self.by_id
                .insert(id.clone(), (pod.uid.clone(), container.to_string()));
        }
        self.seq
    }

    /// Marks the grant of `container` of pod `uid` (answer number `seq`) as recorded in the
    /// pod's annotations.
    pub(crate) fn mark_recorded(&mut self, uid: &str, container: &str, seq: u64) {
        if let Some(g) = self.grant_mut(uid, container)
            && g.seq == seq
        {
            g.recorded = true;
        }
    }

    /// Marks the grants of `containers` of pod `uid` as recorded in the pod's annotations
    /// (whichever answer they are: the write was made from the records).
    pub(crate) fn mark_pod_recorded<'a>(
        &mut self,
        uid: &str,
        containers: impl IntoIterator<Item = &'a str>,
    ) {
        let containers: BTreeSet<&str> = containers.into_iter().collect();
        if let Some(pod) = self.pods.get_mut(uid) {
            for g in &mut pod.containers {
                if containers.contains(g.container.as_str()) {
                    g.recorded = true;
                }
            }
        }
    }

    /// Drops the grant of `container` of pod `uid` if it is still answer number `seq` (its
    /// PATCH was definitely refused, so the container was not handed a GPU).
    pub fn release(&mut self, uid: &str, container: &str, seq: u64) {
        if self
            .pods
            .get(uid)
            .and_then(|p| p.containers.iter().find(|c| c.container == container))
            .is_some_and(|g| g.seq == seq)
        {
            self.remove_container(uid, container);
        }
    }

    /// Moves grants to the containers kubelet really gave their devices to (swaps the
    /// reconcile found): each `(from_uid, from_container, to, to_container)` takes the grant
    /// away from the first and gives it to the second. All are taken before any is given, so
    /// two pods that swapped both keep one.
    pub(crate) fn reassign(&mut self, moves: &[(String, String, PodId, String)]) {
        let taken: Vec<(ContainerGrant, &PodId, &String)> = moves
            .iter()
            .filter_map(|(uid, c, to, to_c)| {
                let grant = self
                    .pods
                    .get(uid)?
                    .containers
                    .iter()
                    .find(|g| &g.container == c)?
                    .clone();
                Some((grant, to, to_c))
            })
            .collect();
        for (uid, c, _, _) in moves {
            self.remove_container(uid, c);
        }
        for (grant, to, to_c) in taken {
            let seq = self.claim(to, to_c, &grant.device_ids, grant.gpu_index);
            if grant.recorded {
                self.mark_recorded(&to.uid, to_c, seq);
            }
        }
    }

    /// Whether device ID `id` is in a grant.
    pub(crate) fn holds_id(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// Keeps the pods for which `keep(uid, grants)` holds; returns the UIDs dropped.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &PodGrants) -> bool) -> Vec<String> {
        let gone: Vec<String> = self
            .pods
            .iter()
            .filter(|(uid, p)| !keep(uid, p))
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in &gone {
            if let Some(p) = self.pods.remove(uid) {
                for c in p.containers {
                    for id in c.device_ids {
                        self.by_id.remove(&id);
                    }
                }
            }
        }
        gone
    }

    /// Number of container grants.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.pods.values().map(|p| p.containers.len()).sum()
    }

    /// Whether there are none.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    fn grant_mut(&mut self, uid: &str, container: &str) -> Option<&mut ContainerGrant> {
        self.pods
            .get_mut(uid)?
            .containers
            .iter_mut()
            .find(|c| c.container == container)
    }

    fn remove_container(&mut self, uid: &str, container: &str) {
        let Some(pod) = self.pods.get_mut(uid) else {
            return;
        };
        pod.containers.retain(|c| {
            if c.container != container {
                return true;
            }
            for id in &c.device_ids {
                if self
                    .by_id
                    .get(id)
                    .is_some_and(|(u, n)| u == uid && n == container)
                {
                    self.by_id.remove(id);
                }
            }
            false
        });
        if pod.containers.is_empty() {
            self.pods.remove(uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, name: &str) -> PodId {
        PodId {
            uid: uid.to_string(),
            namespace: "ns".to_string(),
            name: name.to_string(),
        }
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn reused_ids_drop_the_previous_holder_and_same_ids_find_the_grant() {
        let mut r = Records::default();
        r.claim(&pod("u1", "web-0"), "main", &ids(&["a", "b"]), 0);
        let (found, grant) = r.for_ids(&ids(&["b", "a"])).expect("same IDs");
        assert_eq!((found.uid.as_str(), grant.gpu_index), ("u1", 0));
        assert!(
            r.for_ids(&ids(&["a"])).is_none(),
            "a subset is another request"
        );
        // The pod is re-created (u2); kubelet hands the old IDs to another pod.
        r.claim(&pod("u3", "other"), "main", &ids(&["a", "c"]), 0);
        assert!(r.pod("u1").is_none(), "the holder of reused IDs is gone");
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn release_and_mark_apply_only_to_the_same_answer() {
        let mut r = Records::default();
        let first = r.claim(&pod("u1", "p"), "c", &ids(&["a"]), 1);
        let second = r.claim(&pod("u1", "p"), "c", &ids(&["b"]), 1);
        r.release("u1", "c", first);
        assert_eq!(
            r.len(),
            1,
            "an older answer's failure does not drop a newer one"
        );
        r.mark_recorded("u1", "c", second);
        assert!(r.containers_of("u1").all(|g| g.recorded));
        r.release("u1", "c", second);
        assert!(r.is_empty());
    }

    #[test]
    fn move_and_retain() {
        let mut r = Records::default();
        r.claim(&pod("m", "m"), "c1", &ids(&["a"]), 0);
        r.claim(&pod("p", "p"), "main", &ids(&["b"]), 1);
        // Swapped: kubelet gave m's answer to p and p's to m.
        r.reassign(&[
            ("m".into(), "c1".into(), pod("p", "p"), "main".into()),
            ("p".into(), "main".into(), pod("m", "m"), "c1".into()),
        ]);
        assert_eq!(r.containers_of("m").next().map(|g| g.gpu_index), Some(1));
        r.reassign(&[("m".into(), "c1".into(), pod("p", "p"), "main".into())]);
        assert!(r.pod("m").is_none());
        assert_eq!(r.containers_of("p").next().map(|g| g.gpu_index), Some(1));
        assert_eq!(
            r.for_ids(&ids(&["b"])).map(|(p, _)| p.uid),
            Some("p".to_string())
        );
        assert_eq!(r.retain(|uid, _| uid != "p"), vec!["p".to_string()]);
        assert!(r.for_ids(&ids(&["b"])).is_none());
        assert!(!r.holds_id("b"));
    }
}
