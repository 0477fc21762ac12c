//! Sandbox part: nvml_stub. Not implemented yet.
