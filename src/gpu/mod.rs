//! GPU access behind one trait. Backends: NVML, nvidia-smi, fake. Not implemented yet.
