//! Sandbox part: kubelet. Not implemented yet.
