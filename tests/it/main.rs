//! The one integration-test binary. Each module is a topic; `support` holds the shared
//! harness (binary runner, fixtures).

mod cli;
mod deviceplugin;
mod doctor;
mod extender;
mod gpu;
mod inspect;
mod packaging;
mod sandbox_kubelet;
mod ha;
mod hostile;
mod watch_churn;
mod support;
