//! With `--mps`, the CUDA MPS control daemon is the device plugin's to run: started with
//! `nvidia-cuda-mps-control -d` on `mps_pipe_dir` / `mps_log_dir` (or adopted when one already
//! answers there), probed with `get_server_list` every `mps_check_interval_ms`, restarted when
//! it stops answering (at once the first time, then with a doubling wait up to
//! `mps_restart_backoff_max_secs` while it keeps failing), and told its per-GPU defaults
//! (`set_default_device_pinned_mem_limit <uuid> <MiB>M`, `set_default_active_thread_percentage`)
//! each time it is (re)gained. On shutdown it is stopped (`quit`) only if this plugin started it.
//!
//! Why inside the device plugin and not a role or container of its own: the plugin's readiness
//! and Allocate's refusal both need the daemon's live state, and one process owning the child
//! needs no second channel to share it. The daemon forks away under `-d`, so it is watched
//! through its control pipe (the same question a client's CUDA runtime asks), not through a
//! child handle; a daemon someone else started on the same pipe directory is watched the same
//! way.
//!
//! What it publishes: [`MpsStatus`] (serving or not, and why), read by Allocate and by the
//! readiness; the metrics `gpushare_device_plugin_mps_daemon_up` and
//! `gpushare_device_plugin_mps_daemon_restarts`; Warning Events on the node
//! (`GpuShareMpsDaemonRestarted`, `GpuShareMpsDaemonStartFailed`). It does not decide a
//! container's own limit (Allocate's `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` does).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Plugin, node};
use crate::gpu::mps::{MpsControl, MpsError, default_commands};
use crate::shutdown::Shutdown;

/// How long the daemon must answer without a break before its restart backoff starts over.
const STABLE_AFTER_CHECKS: u32 = 10;
/// How often a just-started daemon is asked whether it answers yet.
const START_POLL: Duration = Duration::from_millis(50);

/// The daemon's live state, shared with Allocate and the readiness.
#[derive(Debug)]
pub(crate) struct MpsStatus {
    pub(crate) control: MpsControl,
    serving: AtomicBool,
    why: std::sync::Mutex<String>,
}

impl MpsStatus {
    pub(crate) fn new(control: MpsControl) -> MpsStatus {
        MpsStatus {
            control,
            serving: AtomicBool::new(false),
            why: std::sync::Mutex::new("not checked yet".to_string()),
        }
    }

    /// Whether the daemon answers and has its defaults.
    pub(crate) fn serving(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }

    /// Why it is not serving (empty while it is).
    pub(crate) fn why(&self) -> String {
        self.why.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, serving: bool, why: String) {
        *self.why.lock().unwrap_or_else(|p| p.into_inner()) = why;
        self.serving.store(serving, Ordering::SeqCst);
    }
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

/// The supervisor of one daemon; [`Supervisor::first_contact`] runs before the plugin
/// registers, [`Supervisor::run`] until shutdown.
pub(crate) struct Supervisor {
    plugin: Arc<Plugin>,
    status: Arc<MpsStatus>,
    /// Started by us (stopped on shutdown), as opposed to adopted.
    owned: bool,
    /// Restart attempts since the daemon last stayed up.
    attempts: u32,
    /// Checks answered in a row.
    answered: u32,
}

impl Supervisor {
    pub(crate) fn new(plugin: Arc<Plugin>, status: Arc<MpsStatus>) -> Supervisor {
        Supervisor {
            plugin,
            status,
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
        let interval = Duration::from_millis(self.plugin.config.mps_check_interval_ms);
        let max = Duration::from_secs(self.plugin.config.mps_restart_backoff_max_secs);
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
            Ok(()) => tracing::info!("stopped the MPS control daemon this plugin started"),
            Err(e) => tracing::warn!(error = %e, "could not stop the MPS control daemon"),
        }
    }

    /// Starts the daemon and waits (one call deadline) until it answers.
    async fn start(&mut self, restart: bool) {
        let started = self.start_and_wait().await;
        match started {
            Ok(()) => {
                if restart {
                    self.plugin.metrics.mps_daemon_restarts.inc();
                    let n = self.plugin.metrics.mps_daemon_restarts.get();
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
            self.plugin.config.mps_active_thread_percentage,
            &self.limits(),
        );
        match self.control().send(&commands).await {
            Ok(_) => {
                tracing::info!(defaults = ?commands, "MPS control daemon serving");
                self.status.set(true, String::new());
                self.plugin.metrics.mps_daemon_up.set(1);
                self.plugin.update_ready();
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot set the MPS daemon's defaults; retrying");
                self.down(format!("setting the daemon's defaults: {e}"));
            }
        }
    }

    /// Not serving, because `why`: Allocate refuses and the plugin is not ready.
    fn down(&self, why: String) {
        self.status.set(false, why);
        self.plugin.metrics.mps_daemon_up.set(0);
        self.plugin.update_ready();
    }

    /// Each served GPU's default pinned memory limit in MiB: the configured ceiling, never
    /// more than the GPU has.
    fn limits(&self) -> Vec<(String, u64)> {
        let unit = self.plugin.config.memory_unit;
        let ceiling = self.plugin.config.mps_pinned_mem_limit_mib;
        self.plugin
            .gpus
            .iter()
            .map(|g| {
                let whole = unit.to_mib(g.units);
                let mib = if ceiling == 0 {
                    whole
                } else {
                    ceiling.min(whole)
                };
                (g.uuid.clone(), mib)
            })
            .collect()
    }

    async fn event(&self, reason: &str, msg: &str) {
        node::warn_event(
            &self.plugin.events,
            &self.plugin.node,
            &self.plugin.node_uid,
            "MpsDaemon",
            reason,
            msg,
        )
        .await;
    }
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
