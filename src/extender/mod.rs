//! `gpushare extender`: the HTTP scheduler extender (filter / prioritize / bind) with its
//! per-GPU ledger. Not implemented yet.

use std::process::ExitCode;

use crate::config::{Config, FlagOverrides};

/// Flags of `gpushare extender`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, _flags: &mut FlagOverrides) {}
}

/// Runs the extender.
pub async fn run(_args: Args, _config: Config) -> anyhow::Result<ExitCode> {
    crate::cli::not_implemented("extender").await
}
