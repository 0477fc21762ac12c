//! One shutdown story: the first SIGTERM/SIGINT starts a graceful drain that every server and
//! long-lived stream observes through a [`Shutdown`] handle; a second signal exits at once.

use tokio::sync::watch;

/// A cloneable handle that resolves when shutdown has begun.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// The sending side: trigger a shutdown by hand (tests, demo) or from signals.
#[derive(Debug)]
pub struct Trigger {
    tx: watch::Sender<bool>,
}

/// A new trigger/handle pair.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger { tx }, Shutdown { rx })
}

impl Trigger {
    /// Begins the shutdown.
    pub fn trigger(&self) {
        let _ = self.tx.send(true);
    }

    /// Another handle for this trigger.
    pub fn handle(&self) -> Shutdown {
        Shutdown {
            rx: self.tx.subscribe(),
        }
    }
}

impl Shutdown {
    /// A handle that never fires (for tests that stop by dropping).
    pub fn never() -> Shutdown {
        let (tx, rx) = watch::channel(false);
        std::mem::forget(tx);
        Shutdown { rx }
    }

    /// Whether shutdown has begun.
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once shutdown has begun (at once if it already has).
    pub async fn wait(mut self) {
        // An error means the trigger was dropped: treat it as a shutdown.
        let _ = self.rx.wait_for(|v| *v).await;
    }
}

/// Installs SIGTERM/SIGINT handlers: the first signal triggers `trigger`, the second exits the
/// process with status 130 at once.
pub fn on_signals(trigger: Trigger) -> Shutdown {
    let handle = trigger.handle();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("signal received, shutting down (send another to exit at once)");
        trigger.trigger();
        wait_for_signal().await;
        tracing::warn!("second signal received, exiting now");
        std::process::exit(130);
    });
    handle
}

/// Off unix there is no SIGTERM: Ctrl-C (console control events) alone.
#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn handles_see_the_trigger() {
        let (trigger, handle) = channel();
        let other = trigger.handle();
        assert!(!handle.is_triggered());
        trigger.trigger();
        handle.clone().wait().await;
        assert!(other.is_triggered());
    }
}
