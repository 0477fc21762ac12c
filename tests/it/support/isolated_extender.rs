//! A whole extender in a runtime and thread of its own, so that a test can kill it (drop the
//! runtime without any of its shutdown: the Lease is not released, as after `kill -9`) or
//! pause it (block its only thread: every task of it stops, as under SIGSTOP, while time goes
//! on). What the HA tests and the HA soak drive.

use std::net::SocketAddr;
use std::sync::Arc;

use gpushare::config::Config;
use gpushare::extender::leader::Clock;
use gpushare::extender::{ExtenderState, StartOptions};
use gpushare::shutdown::Shutdown;
use gpushare_sandbox::apiserver::ApiServer;
use tokio::sync::{mpsc, oneshot};

enum Control {
    Pause {
        paused: oneshot::Sender<()>,
        resume: std::sync::mpsc::Receiver<()>,
    },
    Kill,
    /// Stop as on SIGTERM: drain, then release the lease.
    Stop(oneshot::Sender<()>),
}

/// An extender in a runtime and thread of its own, so that it can be killed or paused.
pub(crate) struct Isolated {
    /// Where it serves.
    pub(crate) addr: SocketAddr,
    /// Its state.
    pub(crate) state: Arc<ExtenderState>,
    control: mpsc::UnboundedSender<Control>,
}

/// Resumes a paused [`Isolated`] replica.
pub(crate) struct Paused(std::sync::mpsc::Sender<()>);

impl Paused {
    /// Lets it run again.
    pub(crate) fn resume(self) {
        let _ = self.0.send(());
    }
}

impl Isolated {
    /// Starts an extender of `config` as replica `identity` (with `clock`, when given).
    pub(crate) async fn start(
        api: &ApiServer,
        config: &Config,
        identity: &str,
        clock: Option<Arc<dyn Clock>>,
    ) -> Isolated {
        let (started_tx, started) = oneshot::channel();
        let (control, mut commands) = mpsc::unbounded_channel();
        let (api, config) = (api.clone(), config.clone());
        let options = StartOptions {
            clock,
            identity: Some(identity.to_string()),
            ..Default::default()
        };
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                // The client too lives in this runtime: its connections stop with it.
                let handle = gpushare::extender::start_with(
                    &config,
                    api.admin_client(),
                    Shutdown::never(),
                    options,
                )
                .await
                .expect("extender starts");
                let _ = started_tx.send((handle.addr, handle.state()));
                while let Some(command) = commands.recv().await {
                    match command {
                        Control::Pause { paused, resume } => {
                            let _ = paused.send(());
                            // Blocks the runtime's only thread: nothing of this replica runs.
                            let _ = resume.recv();
                        }
                        Control::Kill => break,
                        Control::Stop(stopped) => {
                            handle.stop().await;
                            let _ = stopped.send(());
                            return;
                        }
                    }
                }
                // Killed: no stop, no drain, no lease release.
                std::mem::forget(handle);
            });
            rt.shutdown_background();
        });
        let (addr, state) = started.await.expect("the isolated extender started");
        Isolated {
            addr,
            state,
            control,
        }
    }

    /// Blocks its only thread (as SIGSTOP); resolves once it is paused.
    pub(crate) async fn pause(&self) -> Paused {
        let (paused, is_paused) = oneshot::channel();
        let (resume_tx, resume) = std::sync::mpsc::channel();
        let _ = self.control.send(Control::Pause { paused, resume });
        is_paused.await.expect("the replica paused");
        Paused(resume_tx)
    }

    /// Drops its runtime without any shutdown (as SIGKILL: the Lease is not released).
    pub(crate) fn kill(&self) {
        let _ = self.control.send(Control::Kill);
    }

    /// Stops the replica as SIGTERM does (drain, lease released); resolves once it stopped.
    pub(crate) async fn stop(&self) {
        let (stopped, done) = oneshot::channel();
        let _ = self.control.send(Control::Stop(stopped));
        let _ = done.await;
    }
}
