//! The one integration-test binary. Each module is a topic; `support` holds the shared
//! harness (binary runner, fixtures).

mod cli;
mod client_auth;
mod clients;
mod cluster;
mod demo;
mod deviceplugin;
mod deviceplugin_settle;
mod doctor;
mod doctor_cdi;
mod doctor_managed;
mod doctor_migration;
mod extender;
mod gpu;
mod ha;
mod ha_replicas;
mod handover;
mod hostile;
mod inspect;
mod mps;
mod packaging;
mod realdata;
mod sandbox_apiserver;
mod sandbox_kubelet;
mod settle;
mod soak;
mod startup;
mod support;
mod verb_errors;
mod watch_churn;
mod webhook;
