//! Why the node agent did not start ([`AgentError`]): a type of its own below the agent's
//! parts, so that `publish` and `unit_change` name it without importing the agent that uses
//! them. It holds no behaviour.

use crate::core::MemoryUnit;

use super::api::ApiCallError;

/// Why the node agent did not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No node name configured.
    #[error("the node name is required (--node-name or NODE_NAME)")]
    NoNodeName,
    /// The GPU backend did not list the GPUs.
    #[error("reading the GPUs: {0}")]
    Gpus(crate::gpu::Error),
    /// The backend found GPUs, but none can be shared (or none at all).
    #[error("the {backend} backend found no GPU to share on this node{excluded}")]
    NoGpu {
        /// The backend.
        backend: &'static str,
        /// `; GPU <i> <uuid>: <reason>` for each GPU left out.
        excluded: String,
    },
    /// The Node object could not be read.
    #[error("cannot read node {node:?} (is --node-name right?): {error}")]
    ReadNode {
        /// The node.
        node: String,
        /// The API's answer (or its absence).
        error: ApiCallError,
    },
    /// The unit changes, and the pods that would block it could not be listed.
    #[error(
        "the node's GPU memory is published in {recorded} and --memory-unit asks for \
         {configured}: cannot list the node's pods to check that none was placed under \
         {recorded}: {error}"
    )]
    UnitCheck {
        /// The unit the node published.
        recorded: MemoryUnit,
        /// The unit configured.
        configured: MemoryUnit,
        /// The API's answer (or its absence).
        error: ApiCallError,
    },
    /// The gpu-count status patch failed.
    #[error("cannot patch aliyun.com/gpu-count on node {node}: {error}")]
    PublishGpuCount {
        /// The node.
        node: String,
        /// The API's answer (or its absence).
        error: ApiCallError,
    },
    /// An annotation patch failed.
    #[error("cannot patch the device annotations of node {node}: {error}")]
    PublishDevices {
        /// The node.
        node: String,
        /// The API's answer (or its absence).
        error: ApiCallError,
    },
}
