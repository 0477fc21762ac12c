//! `gpushare inspect`: the per-GPU allocation report.
//! Not implemented yet.

use std::process::ExitCode;

use crate::config::{Config, FlagOverrides};

/// Flags of `gpushare inspect`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, _flags: &mut FlagOverrides) {}
}

/// Runs inspect.
pub async fn run(_args: Args, _config: Config) -> anyhow::Result<ExitCode> {
    crate::cli::not_implemented("inspect").await
}
