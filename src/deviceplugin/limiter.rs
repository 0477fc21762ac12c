//! Allocate under the CUDA memory limiter ([`crate::node::enforcement::limiter`]): the
//! container's limits file and state directory written on the host first, then its four
//! mounts (the preload list over `/etc/ld.so.preload`, the library, the limits file read-only,
//! the state directory) added to the answer; the device specs and CDI names are left as the
//! strategy made them. Files that cannot be written fail the call: no container starts
//! without its limit.
//!
//! The container is the matched pod's (its directory `dp-<pod uid>-<container>`: kubelet
//! asking again for it gets the same files), or on the single-GPU fallback, whose pod is not
//! known, the container of the device ids kubelet chose.

use tonic::Status;

use super::Plugin;
use super::matching::Match;
use crate::kubelet_api::deviceplugin::{ContainerAllocateResponse, Mount};
use crate::node::gpus::ServedGpu;

impl Plugin {
    /// Adds the limiter's mounts for `bytes` of `gpu` to `response` (the files written first,
    /// off the runtime).
    pub(crate) async fn limiter_mounts(
        &self,
        gpu: &ServedGpu,
        bytes: u64,
        pod: Option<&Match>,
        device_ids: &[String],
        mut response: ContainerAllocateResponse,
    ) -> Result<ContainerAllocateResponse, Status> {
        let enforcer = self.agent.enforcement().clone();
        let who = pod.map(|m| {
            (
                m.namespace.clone(),
                m.name.clone(),
                m.uid.clone(),
                m.container.clone(),
            )
        });
        let (ids, uuid) = (device_ids.to_vec(), gpu.uuid.clone());
        let written = tokio::task::spawn_blocking(move || {
            let who = who
                .as_ref()
                .map(|(ns, n, u, c)| (ns.as_str(), n.as_str(), u.as_str(), c.as_str()));
            enforcer.limiter().device_plugin(who, &ids, &uuid, bytes)
        })
        .await
        .map_err(|e| {
            Status::internal(format!("writing the limiter's files did not finish: {e}"))
        })?;
        let mounts = written.map_err(|e| {
            let msg = format!(
                "GPU {} ({}): cannot write the container's limiter files: {e}; no container \
                 starts without its limit",
                gpu.index, gpu.uuid
            );
            tracing::error!("Allocate: {msg}");
            self.metrics.allocation("limiter_files_failed");
            self.agent
                .events()
                .warn_soon("Allocate", "GpuShareLimiterFilesFailed", msg.clone());
            Status::failed_precondition(msg)
        })?;
        response.mounts.extend(mounts.into_iter().map(|m| Mount {
            container_path: m.container_path,
            host_path: m.host_path,
            read_only: m.read_only,
        }));
        Ok(response)
    }
}
