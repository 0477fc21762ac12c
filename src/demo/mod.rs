//! `gpushare demo`: the first command a newcomer runs. On any machine — no cluster, no GPU —
//! it starts the sandbox API server, a fake kubelet, the real `device-plugin` (fake GPUs,
//! gRPC over a unix socket) and the real `extender` (HTTP) in-process, then plays
//! kube-scheduler and kubelet for the two upstream demos:
//!
//! 1. binpack: three pods of half a GPU each land on GPU 0, GPU 0, GPU 1;
//! 2. a pod whose request fits the node's free memory but no single GPU stays Pending with
//!    the extender's reason.
//!
//! It prints each step and the `inspect` table after it, and exits 0 only if every
//! expectation held. `--keep-running` leaves the sandbox up with a kubeconfig so `kubectl`
//! and `kubectl inspect gpushare` can be pointed at it.
//!
//! `--managed` plays the managed-cluster install instead ([`run_managed_scenario`]): the
//! webhook's certificate bootstrap, a gpu-mem pod routed to `gpushare-scheduler`, a malformed
//! one refused.
//!
//! `--dra` plays demo 1 and demo 2 on the DRA path instead ([`run_dra_scenario`]):
//! `gpushare dra-plugin` on fake GPUs, the sandbox DRA allocator and DRA kubelet.
//!
//! The demo is a walkthrough, not a test harness: the same behaviour is asserted in
//! `tests/it/demo.rs` by running this very scenario.

#[cfg(unix)]
mod dra;
mod managed;
mod scenario;

use std::process::ExitCode;

use crate::config::Config;

#[cfg(unix)]
pub use dra::run_dra_scenario;
pub use managed::run_managed_scenario;
pub(crate) use scenario::DemoOutcome;
pub use scenario::run_scenario;

/// Flags of `gpushare demo`.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// GPUs of the demo node, e.g. 2x16GiB, 4x24GiB or 16GiB,24GiB
    #[arg(long, default_value = "2x16GiB", value_name = "SPEC", value_parser = crate::gpu::fake_gpus_flag)]
    pub fake_gpus: String,
    /// Leave the sandbox running after the demo and print a kubeconfig for kubectl
    #[arg(long)]
    pub keep_running: bool,
    /// The managed-cluster tour instead (EKS, GKE, AKS, ACK): gpushare webhook routes a
    /// gpu-mem pod to gpushare-scheduler and refuses a malformed one
    #[arg(long, conflicts_with = "keep_running")]
    pub managed: bool,
    /// Demo 1 and demo 2 on the DRA path instead: gpushare dra-plugin, the ResourceSlice,
    /// claims allocated first-fit and prepared through the DRA kubelet
    #[arg(long, conflicts_with_all = ["keep_running", "managed"])]
    pub dra: bool,
}

/// Runs the demo.
pub async fn run(args: Args, _config: Config) -> anyhow::Result<ExitCode> {
    let Args {
        fake_gpus,
        keep_running,
        managed,
        dra,
    } = args;
    let mut out = std::io::stdout();
    let outcome = if managed {
        run_managed_scenario(&mut out).await?
    } else if dra {
        #[cfg(unix)]
        {
            run_dra_scenario(&fake_gpus, &mut out).await?
        }
        #[cfg(not(unix))]
        anyhow::bail!("--dra needs unix sockets")
    } else {
        run_scenario(&fake_gpus, &mut out, keep_running).await?
    };
    if outcome.failures.is_empty() {
        println!("\nAll {} expectations held.", outcome.checks);
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "\n{} of {} expectations FAILED:",
            outcome.failures.len(),
            outcome.checks
        );
        for f in &outcome.failures {
            println!("  - {f}");
        }
        Ok(ExitCode::FAILURE)
    }
}
