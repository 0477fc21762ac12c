//! Packaging: the Helm chart and the plain manifests rendered from it, the scheduler
//! configuration, the kubeadm install script, the systemd units, the image and the krew
//! manifest. Nothing here needs a cluster, Docker or a running systemd; the chart is rendered
//! by the real Helm engine as a library (helm-python-sdk, see `support::clients`).
//! Their shared readers and renderers live in `support::source_tree` and `support::helm_chart`.

mod admission_policy;
mod auth_chart;
mod chart;
mod chart_dedicated;
mod chart_enforcement;
mod chart_mps;
mod chart_operator;
mod chart_production;
mod chart_readme;
mod chart_schema;
mod checkov;
mod dra_chart;
mod fresh_clone;
mod ha_chart;
mod image;
mod kubeadm;
mod systemd;
mod systemd_security;
