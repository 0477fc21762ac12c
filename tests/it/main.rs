//! The one integration-test binary. Each module is a topic; `support` holds the shared
//! harness (binary runner, fixtures).

mod cli;
mod inspect;
mod sandbox_kubelet;
mod gpu;
mod support;
