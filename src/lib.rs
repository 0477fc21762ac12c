//! gpushare: GPU memory sharing for Kubernetes, as one binary with four roles.
//!
//! A wire-compatible successor of Aliyun's gpushare (scheduler extender, device plugin,
//! `kubectl inspect gpushare`), plus `doctor`, a preflight for nodes and control planes.
//!
//! ```text
//!                 kube-scheduler                          kubectl inspect gpushare
//!                      │ filter / prioritize / bind              │ (inspect)
//!                      ▼                                         ▼
//!   ┌────────────────────────────────┐  watch pods+nodes  ┌─────────────┐
//!   │ extender  (HTTP, per-GPU ledger)│◄──────────────────►│ API server  │
//!   └────────────────────────────────┘  patch annotations └─────────────┘
//!                                       + Binding                ▲
//!                                                                │ watch own pods, patch
//!   kubelet ──Register/ListAndWatch/Allocate (gRPC, UDS)──► device-plugin ──► GPU backend
//!                                                          (nvml | nvidia-smi | fake)
//!   doctor: checks every box above before the roles start, and on demand.
//! ```
//!
//! Layout: [`core`] is pure (units, wire names, annotation codec, ledger, placement);
//! [`k8s`] talks to the API server; [`kubelet_api`] is the generated gRPC code; [`gpu`] hides
//! the driver; each role lives in its own module; [`sandbox`] is a throwaway cluster for tests
//! and `gpushare demo`. Only [`cli`] dispatches to the roles.

pub mod admin;
pub mod cli;
pub mod config;
pub mod core;
pub mod demo;
pub mod deviceplugin;
pub mod doctor;
pub mod extender;
pub mod gpu;
pub mod inspect;
pub mod k8s;
pub mod kubelet_api;
pub mod sandbox;
pub mod shutdown;
pub mod telemetry;
