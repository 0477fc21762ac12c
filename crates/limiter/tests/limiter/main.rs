//! The limiter preloaded into C programs that call a fake driver (`tests/c/`): every route
//! to the entry points, the accounting of every kind of allocation, processes racing,
//! dying, forking and exec'ing, the views, the library's own shape, and the injection as a
//! container gets it (`/etc/ld.so.preload` in a private mount namespace).
//!
//! They need a C compiler (`cc`, or `$CC`) and nothing else; no GPU, no driver.

// Tests fail by panicking.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

mod accounting;
mod injection;
mod library;
mod processes;
mod routes;
mod support;
mod view;
