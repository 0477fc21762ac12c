//! `gpushare doctor`: the node and control-plane preflight. Not implemented yet.

use std::process::ExitCode;

use crate::config::{Config, FlagOverrides};

/// Flags of `gpushare doctor`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, _flags: &mut FlagOverrides) {}
}

/// Which checks to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// GPU node checks (driver, runtime, kubelet, device plugin).
    Node,
    /// Control-plane checks (API, RBAC, scheduler configuration, extender).
    ControlPlane,
    /// Both.
    #[default]
    All,
}

/// The preflight `extender` (ControlPlane) and `device-plugin` (Node) run before they start:
/// prints the report and fails when a check failed. Callers skip it when `config.doctor.skip`.
pub async fn preflight(role: Role, config: &Config) -> anyhow::Result<()> {
    let _ = (role, config);
    Ok(())
}

/// Runs doctor.
pub async fn run(_args: Args, _config: Config) -> anyhow::Result<ExitCode> {
    crate::cli::not_implemented("doctor").await
}
