//! The DRA plugin's [`Preparer`]: what a prepared claim's containers get, written as one
//! transient CDI spec per claim in the CDI directory (`--cdi-dir`), built from the node
//! agent's container contract ([`crate::node::contract`]), so a container served through DRA
//! is handed exactly what the device-plugin path hands it.
//!
//! Each share of the claim (one container request on one GPU) is one CDI device
//! `<driver>/gpu=<claim uid>-<n>` whose `containerEdits` carry `NVIDIA_VISIBLE_DEVICES` (index
//! or UUID per the device-id strategy), `ALIYUN_COM_GPU_MEM_IDX`, `_POD` (the claim's total),
//! `_CONTAINER` (the share's `consumedCapacity.memory` in memory units), `_DEV`, and under MPS
//! the pinned memory limit, the pipe directory and its mounts; the strategies of `[node]`
//! apply as on the device-plugin path (a CDI strategy adds the NVIDIA CDI device of the GPU to
//! the share's CDI ids, `pass_device_specs` adds the device nodes). The spec file is replaced
//! atomically ([`crate::gpu::cdi::write_spec`]) under a name made of the kind and the claim
//! uid; unprepare removes it by that name, recorded in the checkpoint or not (one already gone
//! is fine). Both are idempotent.
//!
//! A device of another kind the claim holds (an RDMA HCA, a generic device) is one more CDI
//! device of the same spec, `<claim uid>-<n>`, numbered after the GPU shares: the device
//! nodes and mounts of that device ([`super::kinds::hand_over`], what the device-plugin path
//! hands over), and the environment of all the claim's devices of its kind (so
//! `NCCL_IB_HCA` names every HCA of the claim whichever device's edits the runtime applies
//! last).
//!
//! Under driver enforcement ([`crate::node::enforcement`], [`CdiPreparer::with_enforcement`])
//! each GPU share's device also carries the `createRuntime` hook that sets the share as the
//! container's limit on that GPU, and NVIDIA's `NVIDIA_GPU_MEMORY_REQUEST/LIMIT` (MiB). Under
//! the CUDA memory limiter each GPU share's device carries the limiter's mounts (the preload
//! list, the library, the share's own limits file and state directory, written on the host
//! first: [`crate::node::enforcement::limiter::Limiter::dra_share`]); unprepare removes the
//! claim's files with its spec.
//!
//! What it does not do: check the claim against the served GPUs or other claims (the plugin
//! did, [`super::claims::admit`]), record anything (the checkpoint is the plugin's), or
//! express CDI annotations (a CDI spec has none; `cdi-annotations` alone adds nothing).

use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use super::checkpoint::PreparedClaim;
use super::claims::{ClaimDevices, ClaimShare, DeviceShare};
use super::plugin::{PrepareError, Prepared, Preparer};
use crate::config::{NodeConfig, VisibleDevices};
use crate::core::GpuMem;
use crate::devices::handover::HandOverError;
use crate::gpu::cdi::{
    CdiMount, ContainerEditsSpec, DeviceNodeEdit, DeviceSpecEdit, Registry, TransientSpec,
    remove_spec, remove_spec_file, transient_spec_file, transient_spec_ids, write_spec,
};
use crate::node::contract::{self, ContainerEdits, NodeTraits, Target};
use crate::node::enforcement::{Enforcer, Mechanism};
use crate::node::gpus::ServedGpu;
use crate::node::kinds::DeviceKinds;
use crate::node::paths::ServingPath;

/// The class of the CDI kind of the claims' specs (`<driver>/gpu`).
pub const CDI_CLASS: &str = "gpu";

/// Why a claim's spec was not written.
#[derive(Debug, thiserror::Error)]
pub enum CdiPrepareError {
    /// The share names a GPU this node does not serve on the DRA path.
    #[error("GPU {uuid} is not served on the DRA path of this node")]
    UnknownGpu {
        /// The UUID.
        uuid: String,
    },
    /// The contract's hand-over refused (a CDI strategy without the GPU's CDI device).
    #[error(transparent)]
    Handover(#[from] contract::HandoverError),
    /// A device of another kind cannot be handed over (not offered, its node gone).
    #[error(transparent)]
    Device(#[from] HandOverError),
    /// The spec could not be written or removed.
    #[error(transparent)]
    Write(#[from] crate::gpu::cdi::WriteError),
    /// The limiter's files of a share could not be written.
    #[error("GPU {uuid}: cannot write the share's limiter files: {source}")]
    Limiter {
        /// The GPU.
        uuid: String,
        /// Why.
        #[source]
        source: crate::node::enforcement::limiter::containers::CreateError,
    },
    /// The limiter's files of the claim could not be removed.
    #[error("cannot remove the claim's limiter files: {0}")]
    LimiterCleanup(#[source] std::io::Error),
}

/// A claim's CDI spec and the CDI ids of what it holds.
#[derive(Clone, Debug)]
pub struct ClaimSpec {
    /// The spec.
    pub spec: TransientSpec,
    /// The CDI ids of each GPU share.
    pub gpu_ids: Vec<Vec<String>>,
    /// The CDI ids of each device of another kind.
    pub device_ids: Vec<Vec<String>>,
}

/// Writes one transient CDI spec per claim (see the module docs).
#[derive(Clone, Debug)]
pub struct CdiPreparer {
    node: NodeConfig,
    traits: NodeTraits,
    gpus: Vec<ServedGpu>,
    cdi_dir: PathBuf,
    kind: String,
    kinds: DeviceKinds,
    enforcement: Option<std::sync::Arc<Enforcer>>,
}

impl CdiPreparer {
    /// A preparer for `gpus` (those offered on the DRA path) with `[node]` as served, writing
    /// specs of kind `<driver>/gpu` into `cdi_dir`.
    pub fn new(
        node: NodeConfig,
        traits: NodeTraits,
        gpus: Vec<ServedGpu>,
        driver: &str,
        cdi_dir: &Path,
    ) -> CdiPreparer {
        CdiPreparer {
            node,
            traits,
            gpus,
            cdi_dir: cdi_dir.to_path_buf(),
            kind: cdi_kind(driver),
            kinds: DeviceKinds::default(),
            enforcement: None,
        }
    }

    /// The same, carrying the memory-limit hook in each GPU share when the DRA path's
    /// mechanism is the driver's limits.
    pub fn with_enforcement(mut self, enforcement: std::sync::Arc<Enforcer>) -> CdiPreparer {
        self.enforcement = Some(enforcement);
        self
    }

    /// The same, handing over the devices of `kinds` (RDMA HCAs, generic devices) too.
    pub fn with_kinds(mut self, kinds: DeviceKinds) -> CdiPreparer {
        self.kinds = kinds;
        self
    }

    /// The CDI kind of the specs written.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The spec of claim `claim_uid` and the CDI ids of each GPU share and of each device of
    /// another kind. Under the limiter, writes each share's limiter files on the host.
    pub fn spec(
        &self,
        claim_uid: &str,
        claim: &ClaimDevices,
    ) -> Result<ClaimSpec, CdiPrepareError> {
        let shares: &[ClaimShare] = &claim.gpus;
        let total: GpuMem = shares.iter().map(|s| s.units).sum();
        let registry = self
            .node
            .device_list_strategy
            .any_cdi()
            .then(|| Registry::read(Path::new("/"), &self.node.cdi_spec_dirs));
        let mut spec = TransientSpec::new(&self.kind);
        let mut ids = Vec::with_capacity(shares.len());
        for (i, share) in shares.iter().enumerate() {
            let gpu = self
                .gpus
                .iter()
                .find(|g| g.uuid == share.uuid)
                .ok_or_else(|| CdiPrepareError::UnknownGpu {
                    uuid: share.uuid.clone(),
                })?;
            let base = contract::grant(
                &self.node,
                self.traits,
                gpu,
                self.node.visible_devices == VisibleDevices::Uuid,
                total,
                share.units,
            );
            let mut edits =
                contract::hand_over(&self.node, registry.as_ref(), Target::Gpu(gpu), base)?;
            let name = format!("{claim_uid}-{i}");
            let mut share_ids = vec![format!("{}={name}", self.kind)];
            share_ids.extend(edits.cdi_devices.iter().cloned());
            let hook = self
                .enforcement
                .as_ref()
                .filter(|e| e.mechanism(ServingPath::Dra) == Mechanism::Driver)
                .map(|e| {
                    edits
                        .envs
                        .extend(crate::node::enforcement::limit_envs(share.memory_bytes));
                    e.hook_edit(&gpu.uuid, share.memory_bytes)
                });
            if let Some(e) = self
                .enforcement
                .as_ref()
                .filter(|e| e.mechanism(ServingPath::Dra) == Mechanism::Limiter)
            {
                let mounts = e
                    .limiter()
                    .dra_share(claim_uid, i, &share.request, &gpu.uuid, share.memory_bytes)
                    .map_err(|source| CdiPrepareError::Limiter {
                        uuid: gpu.uuid.clone(),
                        source,
                    })?;
                edits.mounts.extend(mounts);
            }
            let mut container_edits = container_edits(&edits);
            container_edits.hooks.extend(hook);
            spec.devices.push(DeviceSpecEdit {
                name,
                container_edits,
            });
            ids.push(share_ids);
        }
        let device_ids = self.devices(claim_uid, &claim.devices, shares.len(), &mut spec)?;
        Ok(ClaimSpec {
            spec,
            gpu_ids: ids,
            device_ids,
        })
    }

    /// Adds one CDI device per device of another kind to `spec`, numbered from `first`;
    /// their CDI ids.
    fn devices(
        &self,
        claim_uid: &str,
        devices: &[DeviceShare],
        first: usize,
        spec: &mut TransientSpec,
    ) -> Result<Vec<Vec<String>>, CdiPrepareError> {
        let mut by_resource: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for d in devices {
            by_resource
                .entry(d.resource.as_str())
                .or_default()
                .push(d.id.as_str());
        }
        let mut envs = BTreeMap::new();
        for (resource, ids) in &by_resource {
            let all = super::kinds::hand_over(&self.kinds, resource, ids)?;
            envs.insert(*resource, all.to_cdi_container_edits().env);
        }
        let mut out = Vec::with_capacity(devices.len());
        for (i, d) in devices.iter().enumerate() {
            let own = super::kinds::hand_over(&self.kinds, &d.resource, &[d.id.as_str()])?;
            let mut edits = own.to_cdi_container_edits();
            edits.env = envs.get(d.resource.as_str()).cloned().unwrap_or_default();
            let name = format!("{claim_uid}-{}", first + i);
            out.push(vec![format!("{}={name}", self.kind)]);
            spec.devices.push(DeviceSpecEdit {
                name,
                container_edits: edits,
            });
        }
        Ok(out)
    }
}

/// `<driver>/gpu`.
pub fn cdi_kind(driver: &str) -> String {
    format!("{driver}/{CDI_CLASS}")
}

fn container_edits(edits: &ContainerEdits) -> ContainerEditsSpec {
    let mut env: Vec<String> = edits.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.sort();
    ContainerEditsSpec {
        env,
        device_nodes: edits
            .device_nodes
            .iter()
            .map(|p| DeviceNodeEdit {
                path: p.clone(),
                ..DeviceNodeEdit::default()
            })
            .collect(),
        mounts: edits
            .mounts
            .iter()
            .map(|m| CdiMount {
                host_path: m.host_path.clone(),
                container_path: m.container_path.clone(),
                options: if m.read_only {
                    vec!["bind".into(), "ro".into()]
                } else {
                    vec!["bind".into()]
                },
            })
            .collect(),
        hooks: Vec::new(),
    }
}

impl Preparer for CdiPreparer {
    fn prepare(&self, claim_uid: &str, claim: &ClaimDevices) -> Result<Prepared, PrepareError> {
        let built = self.spec(claim_uid, claim)?;
        let path =
            write_spec(&self.cdi_dir, claim_uid, &built.spec).map_err(CdiPrepareError::from)?;
        Ok(Prepared {
            cdi_device_ids: built.gpu_ids,
            device_cdi_ids: built.device_ids,
            cdi_spec: Some(path),
        })
    }

    /// Removes the claim's spec where the record says it was written (another CDI directory
    /// when `--cdi-dir` changed since) and by its deterministic name here, recorded or not (a
    /// lost checkpoint leaks nothing).
    fn unprepare(
        &self,
        claim_uid: &str,
        claim: Option<&PreparedClaim>,
    ) -> Result<(), PrepareError> {
        if let Some(old) = claim.and_then(|c| c.cdi_spec.as_ref()) {
            remove_spec_file(old).map_err(CdiPrepareError::from)?;
        }
        remove_spec(&self.cdi_dir, &self.kind, claim_uid).map_err(CdiPrepareError::from)?;
        if let Some(e) = &self.enforcement {
            // Whatever the mechanism now: files of an earlier start go too.
            e.limiter()
                .release_claim(claim_uid)
                .map_err(CdiPrepareError::LimiterCleanup)?;
        }
        Ok(())
    }

    /// The record's spec is the one this preparer writes (in the CDI directory served now)
    /// and it exists.
    fn is_current(&self, claim_uid: &str, claim: &PreparedClaim) -> bool {
        let Some(recorded) = &claim.cdi_spec else {
            return true;
        };
        let here = transient_spec_file(&self.kind, claim_uid)
            .map(|name| self.cdi_dir.join(name))
            .ok();
        here.as_ref() == Some(recorded) && recorded.exists()
    }

    /// The claims whose spec is in the CDI directory.
    fn written(&self) -> Vec<String> {
        transient_spec_ids(&self.cdi_dir, &self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::MemoryUnit;

    fn gpus() -> Vec<ServedGpu> {
        (0..2)
            .map(|i| ServedGpu {
                index: i,
                uuid: format!("GPU-{i}"),
                units: GpuMem::new(16),
                minor: Some(i),
            })
            .collect()
    }

    fn share(request: &str, uuid: &str, index: u32, units: u64) -> ClaimShare {
        ClaimShare {
            request: request.into(),
            device: format!("gpu-{index}"),
            uuid: uuid.into(),
            index,
            share_id: Some("s".into()),
            memory_bytes: units << 30,
            units: GpuMem::new(units),
        }
    }

    #[test]
    fn each_share_carries_the_device_plugin_envs_and_unprepare_removes_the_spec() {
        let dir = tempfile::tempdir().expect("dir");
        let node = NodeConfig {
            memory_unit: MemoryUnit::GIB,
            mps: true,
            ..NodeConfig::default()
        };
        let p = CdiPreparer::new(
            node,
            NodeTraits::default(),
            gpus(),
            "gpushare.io",
            dir.path(),
        );
        let shares = [share("main", "GPU-1", 1, 6), share("side", "GPU-1", 1, 2)];
        let out = p
            .prepare(
                "uid-1",
                &ClaimDevices {
                    gpus: shares.to_vec(),
                    devices: Vec::new(),
                },
            )
            .expect("prepared");
        assert_eq!(
            out.cdi_device_ids,
            [
                vec!["gpushare.io/gpu=uid-1-0".to_string()],
                vec!["gpushare.io/gpu=uid-1-1".to_string()]
            ]
        );
        let path = out.cdi_spec.expect("a spec");
        let spec: TransientSpec =
            serde_json::from_slice(&std::fs::read(&path).expect("written")).expect("json");
        let env = &spec.devices[0].container_edits.env;
        for want in [
            "NVIDIA_VISIBLE_DEVICES=1",
            "ALIYUN_COM_GPU_MEM_IDX=1",
            "ALIYUN_COM_GPU_MEM_CONTAINER=6",
            "ALIYUN_COM_GPU_MEM_POD=8",
            "ALIYUN_COM_GPU_MEM_DEV=16",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=6144M",
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        ] {
            assert!(env.iter().any(|e| e == want), "{want} in {env:?}");
        }
        assert_eq!(
            spec.devices[0].container_edits.mounts[0].container_path,
            "/tmp/nvidia-mps"
        );
        assert!(
            spec.devices[1]
                .container_edits
                .env
                .iter()
                .any(|e| e == "ALIYUN_COM_GPU_MEM_CONTAINER=2")
        );
        p.unprepare(
            "uid-1",
            Some(&PreparedClaim {
                namespace: "d".into(),
                name: "c".into(),
                shares: vec![],
                devices: vec![],
                cdi_spec: Some(path.clone()),
            }),
        )
        .expect("unprepared");
        assert!(!path.exists());
        // Without a record (the checkpoint was lost) the spec is found by the claim's uid.
        let again = p
            .prepare(
                "uid-1",
                &ClaimDevices {
                    gpus: shares.to_vec(),
                    devices: Vec::new(),
                },
            )
            .expect("prepared");
        p.unprepare("uid-1", None).expect("unprepared");
        assert!(again.cdi_spec.is_some_and(|f| !f.exists()));
        let unknown = p.prepare(
            "uid-2",
            &ClaimDevices {
                gpus: vec![share("main", "GPU-9", 9, 1)],
                devices: Vec::new(),
            },
        );
        assert!(unknown.is_err());
    }
}
