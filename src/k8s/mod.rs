//! Kubernetes access: building a client, projecting Pods and Nodes into the core's plain
//! types, the few writes gpushare makes (annotation patches, Bindings, node status,
//! Events), the one retry loop for API calls, the one watch driver (and the watch stream it
//! reads), the one JSON reader of objects, the start-up wait for an API server that is not
//! reachable yet, and what a failed call means in words.
//!
//! This module does not decide anything: placement lives in `core`, policy in the roles.

pub mod client;
pub mod decode;
pub mod error_text;
pub mod events;
pub mod list_body;
pub mod project;
pub mod reachable;
pub mod retry;
pub mod watch;
pub(crate) mod watch_stream;
pub(crate) mod watched_pod;
pub mod write;

pub(crate) use client::ClientOptions;
pub use client::client;
pub use error_text::describe;
pub use project::{NodeGpus, node_address, node_gpus};
pub(crate) use project::{pod_annotations, pod_gpu_request, pod_is_terminal};
pub use watched_pod::WatchedPod;
