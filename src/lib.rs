//! gpushare: GPU memory sharing for Kubernetes, as one binary whose subcommands are its roles:
//! `extender`, `device-plugin`, `dra-plugin`, `webhook`, `inspect` and `doctor` (and
//! `cdi-hook`, which the container runtime runs).
//!
//! A wire-compatible successor of Aliyun's gpushare (scheduler extender, device plugin,
//! `kubectl inspect gpushare`), plus `doctor`, a preflight for nodes and control planes, the
//! admission webhook of managed clusters and the DRA path (`dra-plugin`, with the webhook's
//! rewrite of gpu-mem pods into ResourceClaims).
//!
//! ```text
//!                 kube-scheduler                          kubectl inspect gpushare
//!                      │ filter / prioritize / bind              │ (inspect)
//!                      ▼                                         ▼
//!   ┌────────────────────────────────┐  watch pods+nodes  ┌─────────────┐  admission
//!   │ extender  (HTTP, per-GPU ledger)│◄──────────────────►│ API server  │◄──────── webhook
//!   └────────────────────────────────┘  patch annotations └─────────────┘  (managed clusters)
//!                                       + Binding            ▲        ▲
//!                                                            │        │ ResourceSlices,
//!                                       watch own pods, patch│        │ claims
//!   kubelet ──Register/ListAndWatch/Allocate (gRPC, UDS)──► device-plugin ─┐
//!   kubelet ──NodePrepareResources (DRA gRPC, UDS)────────► dra-plugin ────┤
//!                                                                          ▼
//!                      node agent (GPUs, unit, health, MPS, contract, enforcement)
//!                                                          ──► GPU backend (nvml | nvidia-smi | fake)
//!   container runtime ──createRuntime──► cdi-hook (GPU memory limit on the container's cgroup)
//!   doctor: checks every box above before the roles start, and on demand.
//!
//!   DRA path: webhook ──gpu-mem pod → ResourceClaim──► API server ◄── kube-scheduler (DRA)
//! ```
//!
//! Layout (docs/development.md has the map and the rules, and `make layers` — the
//! `gpushare-house` crate in `tools/house` — enforces them):
//! - crates of their own: [`core`] (`gpushare-core`, pure: units, wire names, annotation
//!   codec, what a pod holds, ledger, placement), [`kubelet_api`] (`gpushare-kubelet-api`,
//!   generated gRPC code) and `gpushare-sandbox` (a throwaway cluster for tests and
//!   `gpushare demo`, linked only with the `demo` feature);
//! - infrastructure every role may use: [`buildinfo`], [`shutdown`], [`fd_limit`] (the
//!   open-file limit), [`config`], [`telemetry`], [`exposition`], [`tls`] (certificates from
//!   files, re-read on change), [`failure`] (exit statuses, error text), [`outbound`] (the one
//!   HTTP client), [`http_server`], [`admin`], [`k8s`], [`cgroup`] (a process's cgroup v2 leaf
//!   and what the tree offers), [`gpu`], the device kinds beside the GPU: [`pcie`]
//!   (topology), [`rdma`] (HCAs), [`devices`] (configuration, generic devices, the hand-over
//!   to a container), and [`node`] (the GPU node agent the node roles share);
//! - the roles, one subcommand each, which never import each other: [`extender`]
//!   (`extender`), [`deviceplugin`] (`device-plugin`), [`dra`] (`dra-plugin`, and the DRA
//!   path's pure pieces), [`inspect`] (`inspect`), [`doctor`] (`doctor`), [`webhook`]
//!   (`webhook`, the admission webhook of managed clusters and the DRA rewrite), [`cdi_hook`] (`cdi-hook`, the CDI
//!   hook the container runtime runs to set a container's GPU memory limit);
//! - the composers: [`cli`] (the only dispatch to the roles, and the preflight) and `demo`.

pub use gpushare_core as core;
pub use gpushare_kubelet_api as kubelet_api;

pub mod admin;
pub mod buildinfo;
pub mod cdi_hook;
pub mod cgroup;
pub mod cli;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod deviceplugin;
pub mod devices;
pub mod doctor;
pub mod dra;
pub mod exposition;
pub mod extender;
pub mod failure;
pub mod fd_limit;
pub mod gpu;
pub mod http_server;
pub mod inspect;
pub mod k8s;
pub mod node;
pub mod outbound;
pub mod pcie;
pub mod rdma;
pub mod shutdown;
pub mod telemetry;
pub mod tls;
pub mod webhook;
