//! `gpushare demo`: the self-contained demo.
//! Not implemented yet.

use std::process::ExitCode;

use crate::config::{Config, FlagOverrides};

/// Flags of `gpushare demo`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Args {}

impl Args {
    /// The flags as configuration overrides.
    pub fn overrides(&self, _flags: &mut FlagOverrides) {}
}

/// Runs demo.
pub async fn run(_args: Args, _config: Config) -> anyhow::Result<ExitCode> {
    crate::cli::not_implemented("demo").await
}
