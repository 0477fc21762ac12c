//! `gpushare doctor`: the node and control-plane preflight.
//! Not implemented yet.

use std::process::ExitCode;

use crate::config::{Config, FlagOverrides};

/// Flags of `gpushare doctor`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, _flags: &mut FlagOverrides) {}
}

/// Runs doctor.
pub async fn run(_args: Args, _config: Config) -> anyhow::Result<ExitCode> {
    crate::cli::not_implemented("doctor").await
}
