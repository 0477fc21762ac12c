//! With `--mps`, the CUDA MPS control daemon is the node agent's to run (one daemon per
//! node, whichever roles serve the GPUs): started with
//! `nvidia-cuda-mps-control -d` on `mps_pipe_dir` / `mps_log_dir` (or adopted when one already
//! answers there), probed with `get_server_list` every `mps_check_interval_ms`, restarted when
//! it stops answering (at once the first time, then with a doubling wait up to
//! `mps_restart_backoff_max_secs` while it keeps failing), and told its per-GPU defaults
//! (`set_default_device_pinned_mem_limit <uuid> <MiB>M`, `set_default_active_thread_percentage`)
//! each time it is (re)gained. On shutdown it is stopped (`quit`) only if this process started it.
//!
//! Why inside the node agent and not a role or container of its own: the roles' readiness
//! and their refusal to hand out a GPU both need the daemon's live state, and one process
//! owning the child needs no second channel to share it. The daemon forks away under `-d`, so it is watched
//! through its control pipe (the same question a client's CUDA runtime asks), not through a
//! child handle; a daemon someone else started on the same pipe directory is watched the same
//! way.
//!
//! What it publishes: [`MpsStatus`] (serving or not, and why, and a `watch` of [`MpsState`]:
//! the readiness hook the roles subscribe to, for their readiness and metrics); Warning Events
//! through the [`NodeEvents`] sink it is given (`GpuShareMpsDaemonRestarted`,
//! `GpuShareMpsDaemonStartFailed`). It knows no role: it does not decide a container's own
//! limit (the container contract's `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` does).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::publish::NodeEvents;
use crate::gpu::mps::{MpsControl, MpsError, default_commands};
use crate::shutdown::Shutdown;

/// How long the daemon must answer without a break before its restart backoff starts over.
const STABLE_AFTER_CHECKS: u32 = 10;
/// How often a just-started daemon is asked whether it answers yet.
const START_POLL: Duration = Duration::from_millis(50);

/// What the roles follow of the daemon: whether it serves, and how often it was restarted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpsState {
    /// The daemon answers and has its defaults.
    pub serving: bool,
    /// Restarts after it stopped answering, since start.
    pub restarts: u64,
}

/// The daemon's live state, shared with the roles (their refusal and readiness).
#[derive(Debug)]
pub struct MpsStatus {
    /// The control program and its directories.
    pub control: MpsControl,
    state: watch::Sender<MpsState>,
    why: std::sync::Mutex<String>,
}

impl MpsStatus {
    pub(crate) fn new(control: MpsControl) -> MpsStatus {
        MpsStatus {
            control,
            state: watch::Sender::new(MpsState::default()),
            why: std::sync::Mutex::new("not checked yet".to_string()),
        }
    }

    /// Whether the daemon answers and has its defaults.
    pub fn serving(&self) -> bool {
        self.state.borrow().serving
    }

    /// Why it is not serving (empty while it is).
    pub fn why(&self) -> String {
        self.why.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The state now, and every change after (the roles' readiness hook).
    pub fn subscribe(&self) -> watch::Receiver<MpsState> {
        self.state.subscribe()
    }

    /// The refusal every node role answers while the daemon does not serve (the device
    /// plugin's Allocate, the DRA plugin's prepare): a container started now would run without
    /// its memory limit, or not reach the daemon at all.
    pub fn check_serving(&self) -> Result<(), MpsNotServing> {
        if self.serving() {
            return Ok(());
        }
        Err(MpsNotServing {
            pipe_dir: self.control.pipe_dir.clone(),
            why: self.why(),
            log_dir: self.control.log_dir.clone(),
        })
    }

    fn set(&self, serving: bool, why: String) {
        *self.why.lock().unwrap_or_else(|p| p.into_inner()) = why;
        self.state.send_if_modified(|s| {
            let changed = s.serving != serving;
            s.serving = serving;
            changed
        });
    }

    fn restarted(&self) -> u64 {
        let mut n = 0;
        self.state.send_modify(|s| {
            s.restarts = s.restarts.saturating_add(1);
            n = s.restarts;
        });
        n
    }
}

/// The MPS control daemon does not serve: no GPU is handed out without its memory limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "MPS mode: the CUDA MPS control daemon on {} is not serving ({why}), so no GPU is handed \
     out without its memory limit. gpushare restarts the daemon on its own; if this persists, \
     run `gpushare doctor --mps` on the node and read the daemon's log in {}",
    pipe_dir.display(),
    log_dir.display()
)]
pub struct MpsNotServing {
    /// The daemon's pipe directory.
    pub pipe_dir: std::path::PathBuf,
    /// Why it does not serve.
    pub why: String,
    /// The daemon's log directory.
    pub log_dir: std::path::PathBuf,
}

/// How the supervisor runs the daemon (from `[node]`).
#[derive(Clone, Debug)]
pub(crate) struct MpsSettings {
    /// How often the daemon is probed.
    pub interval: Duration,
    /// The longest wait between restarts.
    pub backoff_max: Duration,
    /// The daemon's default active thread percentage (0: unset).
    pub active_thread_percentage: u8,
    /// The daemon's default pinned memory limit per GPU in MiB, by UUID.
    pub limits: Vec<(String, u64)>,
}

/// The wait before restart attempt `attempt` (0: at once): the check interval doubled per
/// attempt, capped at `max`.
pub(crate) fn backoff(attempt: u32, interval: Duration, max: Duration) -> Duration {
    if attempt == 0 {
        return Duration::ZERO;
    }
    interval
        .saturating_mul(2u32.saturating_pow(attempt.min(20)))
        .min(max)
}

/// The supervisor of one daemon; [`Supervisor::first_contact`] runs before the agent is
/// handed to a role, [`Supervisor::run`] until shutdown.
pub(crate) struct Supervisor {
    status: Arc<MpsStatus>,
    settings: MpsSettings,
    events: NodeEvents,
    /// Started by us (stopped on shutdown), as opposed to adopted.
    owned: bool,
    /// Restart attempts since the daemon last stayed up.
    attempts: u32,
    /// Checks answered in a row.
    answered: u32,
}

impl Supervisor {
    pub(crate) fn new(
        status: Arc<MpsStatus>,
        settings: MpsSettings,
        events: NodeEvents,
    ) -> Supervisor {
        Supervisor {
            status,
            settings,
            events,
            owned: false,
            attempts: 0,
            answered: 0,
        }
    }

    fn control(&self) -> &MpsControl {
        &self.status.control
    }

    /// Adopts a daemon that answers on the pipe directory, else starts one.
    pub(crate) async fn first_contact(&mut self) {
        match self.control().server_list().await {
            Ok(servers) => {
                tracing::info!(
                    pipe_dir = %self.control().pipe_dir.display(),
                    servers = ?servers,
                    "an MPS control daemon already answers on the pipe directory: adopting it \
                     (it is left running on shutdown)"
                );
                self.gained().await;
            }
            Err(e) => {
                tracing::info!(
                    pipe_dir = %self.control().pipe_dir.display(),
                    why = %e,
                    "no MPS control daemon answers: starting one"
                );
                self.start(false).await;
            }
        }
    }

    /// Probes every check interval and restarts the daemon when it stops answering, until
    /// `stop`; then stops it if it is ours.
    pub(crate) async fn run(mut self, stop: Shutdown) {
        let interval = self.settings.interval;
        let max = self.settings.backoff_max;
        loop {
            tokio::select! {
                _ = stop.clone().wait() => break,
                _ = tokio::time::sleep(interval) => {}
            }
            match self.control().server_list().await {
                Ok(_) if self.status.serving() => {
                    self.answered = self.answered.saturating_add(1);
                    if self.answered >= STABLE_AFTER_CHECKS {
                        self.attempts = 0;
                    }
                }
                // Answers, but its defaults are not set yet (a start that answered late, a
                // failed set-up, or someone else's daemon after ours failed to start).
                Ok(_) => {
                    self.gained().await;
                }
                Err(e) => {
                    self.answered = 0;
                    if self.status.serving() {
                        tracing::error!(
                            error = %e,
                            "the MPS control daemon stopped answering: Allocate refuses and the \
                             plugin is not ready until it is back"
                        );
                    }
                    self.down(e.to_string());
                    let wait = backoff(self.attempts, interval, max);
                    if !wait.is_zero() {
                        tracing::info!(
                            ?wait,
                            attempt = self.attempts + 1,
                            "restarting the MPS control daemon after a backoff"
                        );
                        tokio::select! {
                            _ = stop.clone().wait() => break,
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                    self.attempts = self.attempts.saturating_add(1);
                    self.start(true).await;
                }
            }
        }
        self.shut_down().await;
    }

    async fn shut_down(&self) {
        if !self.owned {
            tracing::info!("leaving the adopted MPS control daemon running");
            return;
        }
        match self.control().quit().await {
            Ok(()) => tracing::info!("stopped the MPS control daemon this process started"),
            Err(e) => tracing::warn!(error = %e, "could not stop the MPS control daemon"),
        }
    }

    /// Starts the daemon and waits (one call deadline) until it answers.
    async fn start(&mut self, restart: bool) {
        let started = self.start_and_wait().await;
        match started {
            Ok(()) => {
                if restart {
                    let n = self.status.restarted();
                    let msg = format!(
                        "the CUDA MPS control daemon on {} stopped answering ({}); restarted it \
                         (restart {n})",
                        self.control().pipe_dir.display(),
                        self.status.why()
                    );
                    tracing::warn!("{msg}");
                    self.event("GpuShareMpsDaemonRestarted", &msg).await;
                }
                self.gained().await;
            }
            Err(e) => {
                let msg = format!(
                    "cannot start the CUDA MPS control daemon on {}: {e} (retrying; \
                     `gpushare doctor --mps` checks the set-up)",
                    self.control().pipe_dir.display()
                );
                tracing::error!("{msg}");
                self.down(e.to_string());
                self.event("GpuShareMpsDaemonStartFailed", &msg).await;
            }
        }
    }

    async fn start_and_wait(&mut self) -> Result<(), MpsError> {
        self.control().start_daemon().await?;
        // The program has daemonized: a daemon process exists that is ours to stop.
        self.owned = true;
        let deadline = Instant::now() + self.control().timeout;
        loop {
            match self.control().server_list().await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(START_POLL).await,
            }
        }
    }

    /// The daemon answers: set its defaults; serving once they are set.
    async fn gained(&mut self) {
        let commands = default_commands(
            self.settings.active_thread_percentage,
            &self.settings.limits,
        );
        match self.control().send(&commands).await {
            Ok(_) => {
                tracing::info!(defaults = ?commands, "MPS control daemon serving");
                self.status.set(true, String::new());
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot set the MPS daemon's defaults; retrying");
                self.down(format!("setting the daemon's defaults: {e}"));
            }
        }
    }

    /// Not serving, because `why`: the roles refuse GPUs and are not ready.
    fn down(&self, why: String) {
        self.status.set(false, why);
    }

    async fn event(&self, reason: &str, msg: &str) {
        self.events.warn("MpsDaemon", reason, msg).await;
    }
}

/// Each served GPU's default pinned memory limit in MiB: the configured ceiling, never more
/// than the GPU has; 0 (unconfigured): the smallest safe value, one memory unit, so a client
/// that drops its own limit gets one unit, never the whole GPU.
pub(crate) fn default_limits(
    gpus: &[super::gpus::ServedGpu],
    unit: crate::core::MemoryUnit,
    ceiling: u64,
) -> Vec<(String, u64)> {
    gpus.iter()
        .map(|g| {
            let whole = unit.to_mib(g.units);
            let ceiling = if ceiling == 0 {
                u64::from(unit.mib())
            } else {
                ceiling
            };
            let mib = ceiling.min(whole);
            (g.uuid.clone(), mib)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_back_off_by_doubling_up_to_the_ceiling() {
        let s = Duration::from_secs;
        assert_eq!(backoff(0, s(5), s(60)), Duration::ZERO);
        assert_eq!(backoff(1, s(5), s(60)), s(10));
        assert_eq!(backoff(2, s(5), s(60)), s(20));
        assert_eq!(backoff(3, s(5), s(60)), s(40));
        assert_eq!(backoff(4, s(5), s(60)), s(60));
        assert_eq!(backoff(u32::MAX, s(5), s(60)), s(60));
    }
}
