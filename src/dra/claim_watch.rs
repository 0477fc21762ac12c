//! The ResourceClaims allocated on one node's pool for the driver, followed with a watch: the
//! memory allocated on each device ([`super::claims::allocated_per_device`]), sent when it
//! changes. It reads claims only: it prepares nothing and publishes no slice.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::runtime::watcher::Event;
use tokio::sync::watch;

use super::claims::allocated_per_device;
use crate::k8s::watch::{DefaultBackoff, ListFrom, WatchConfig};
use crate::shutdown::Shutdown;

/// The pool whose claims are followed.
pub struct Pool {
    /// The API client.
    pub client: kube::Client,
    /// The driver name.
    pub driver: String,
    /// This node (the pool's name).
    pub node: String,
    /// Each device's whole memory as the slice publishes it (a claim without a consumed
    /// amount holds it all).
    pub whole: BTreeMap<String, u64>,
}

/// Follows the claims of `pool` until `stop`: the memory allocated on each device, sent on
/// `allocated` when it changes.
pub async fn watch_allocated(
    pool: Pool,
    allocated: watch::Sender<BTreeMap<String, u64>>,
    stop: Shutdown,
) {
    let api: Api<ResourceClaim> = Api::all(pool.client.clone());
    let mut claims: BTreeMap<(String, String), ResourceClaim> = BTreeMap::new();
    let mut buffer: BTreeMap<(String, String), ResourceClaim> = BTreeMap::new();
    let key = |c: &ResourceClaim| {
        (
            c.metadata.namespace.clone().unwrap_or_default(),
            c.metadata.name.clone().unwrap_or_default(),
        )
    };
    let send = |claims: &BTreeMap<(String, String), ResourceClaim>| {
        let now = allocated_per_device(claims.values(), &pool.driver, &pool.node, |d| {
            pool.whole.get(d).copied().unwrap_or(0)
        });
        allocated.send_if_modified(|have| {
            if *have == now {
                false
            } else {
                *have = now;
                true
            }
        });
    };
    let node = pool.node.clone();
    crate::k8s::watch::drive(
        api,
        // The claims only order the slice's devices (binpack or spread): the watch cache's
        // view, possibly a little behind, is enough.
        WatchConfig::new(ListFrom::Cache),
        DefaultBackoff::default(),
        stop,
        |e| tracing::warn!(error = %e, node, "ResourceClaim watch error (retrying)"),
        |event| match event {
            Event::Init => buffer.clear(),
            Event::InitApply(c) => {
                buffer.insert(key(&c), c);
            }
            Event::InitDone => {
                claims = std::mem::take(&mut buffer);
                send(&claims);
            }
            Event::Apply(c) => {
                claims.insert(key(&c), c);
                send(&claims);
            }
            Event::Delete(c) => {
                claims.remove(&key(&c));
                send(&claims);
            }
        },
    )
    .await;
}
