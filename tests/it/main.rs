//! The one integration-test binary. Each module is a topic; `support` holds the shared
//! harness (binary runner, fixtures).

mod cli;
mod demo;
mod deviceplugin;
mod doctor;
mod extender;
mod gpu;
mod ha;
mod ha_replicas;
mod hostile;
mod inspect;
mod packaging;
mod sandbox_apiserver;
mod sandbox_kubelet;
mod support;
mod watch_churn;
