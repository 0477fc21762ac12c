//! One shutdown story: the first SIGTERM/SIGINT starts a graceful drain that every server and
//! long-lived stream observes through a [`Shutdown`] handle; a second signal exits at once.

use tokio_util::sync::CancellationToken;

/// A cloneable handle that resolves when shutdown has begun.
#[derive(Clone, Debug)]
pub struct Shutdown {
    token: CancellationToken,
}

/// The sending side: trigger a shutdown by hand (tests, demo) or from signals. Dropping it
/// triggers too, so a component whose owner is gone stops.
#[derive(Debug)]
pub struct Trigger {
    token: CancellationToken,
}

/// A new trigger/handle pair.
pub fn channel() -> (Trigger, Shutdown) {
    let token = CancellationToken::new();
    (
        Trigger {
            token: token.clone(),
        },
        Shutdown { token },
    )
}

impl Trigger {
    /// Begins the shutdown.
    pub fn trigger(&self) {
        self.token.cancel();
    }

    /// Another handle for this trigger.
    pub fn handle(&self) -> Shutdown {
        Shutdown {
            token: self.token.clone(),
        }
    }
}

impl Drop for Trigger {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

impl Shutdown {
    /// A handle that never fires (for tests that stop by dropping).
    pub fn never() -> Shutdown {
        Shutdown {
            token: CancellationToken::new(),
        }
    }

    /// A child pair: its handle fires when this one does or when its own trigger does, and
    /// triggering the child leaves this one alone (one component stopping on its own).
    pub fn child(&self) -> (Trigger, Shutdown) {
        let token = self.token.child_token();
        (
            Trigger {
                token: token.clone(),
            },
            Shutdown { token },
        )
    }

    /// Whether shutdown has begun.
    // Only the unix server roles ask (the Windows kubectl plugin builds without them).
    #[cfg_attr(not(unix), allow(dead_code))]
    pub(crate) fn is_triggered(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once shutdown has begun (at once if it already has).
    pub async fn wait(self) {
        self.token.cancelled_owned().await;
    }
}

/// Installs SIGTERM/SIGINT handlers: the first signal triggers `trigger`, the second exits the
/// process with status 130 at once.
pub(crate) fn on_signals(trigger: Trigger) -> Shutdown {
    let handle = trigger.handle();
    let first = listen_for_signal();
    tokio::spawn(async move {
        first.await;
        tracing::info!("signal received, shutting down (send another to exit at once)");
        trigger.trigger();
        wait_for_signal().await;
        tracing::warn!("second signal received, exiting now");
        std::process::exit(130);
    });
    handle
}

/// Waits for SIGTERM or SIGINT (Ctrl-C), listening from the first poll on.
async fn wait_for_signal() {
    listen_for_signal().await
}

/// Listens for SIGTERM and SIGINT from now on, before the returned future is first polled, so
/// that a signal sent right after something was announced is not lost to the default action;
/// the future ends at the first of them. Off unix there is no SIGTERM: Ctrl-C (console
/// control events) alone.
#[cfg(not(unix))]
pub(crate) async fn listen_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

/// Listens for SIGTERM and SIGINT from now on, before the returned future is first polled, so
/// that a signal sent right after something was announced is not lost to the default action;
/// the future ends at the first of them. Needs the tokio runtime.
#[cfg(unix)]
pub(crate) fn listen_for_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        match (term, int) {
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

    #[tokio::test]
    async fn a_child_fires_with_its_parent_but_not_the_other_way() {
        let (parent, parent_handle) = channel();
        let (child, child_handle) = parent_handle.child();
        child.trigger();
        child_handle.clone().wait().await;
        assert!(
            !parent_handle.is_triggered(),
            "the child's own stop leaves the parent"
        );
        let (_keep, second) = parent_handle.child();
        parent.trigger();
        second.wait().await;
        assert!(parent_handle.is_triggered());
    }

    #[tokio::test]
    async fn dropping_the_trigger_fires_the_handles() {
        let (trigger, handle) = channel();
        drop(trigger);
        handle.wait().await;
    }
}
