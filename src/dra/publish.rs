//! Publishing a node's ResourceSlices: one reconciling pass that makes the API hold exactly
//! the desired slices of this node and driver.
//!
//! [`sync_slices`] lists the slices of `(node, driver)` (field selectors `spec.nodeName` and
//! `spec.driver`, checked again on what comes back), creates the missing ones, replaces those
//! whose content differs (with the listed `resourceVersion`, so a concurrent writer means a
//! 409, not a lost update) and deletes the rest. It is idempotent: a pass whose answer was lost
//! is settled by the next pass, which lists what actually landed; nothing is rolled back. A
//! pass is retried on transient errors (the one retry loop, `k8s::retry`); every request has the
//! node side's request timeout. What it does not
//! do: build the slices ([`super::slices`]), decide when to publish, or touch slices of other
//! nodes or drivers.

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};

use crate::k8s::retry::retry_attempts;
use crate::node::api::{ApiCallError, bounded};

/// How many times a failing pass is tried.
const ATTEMPTS: u32 = 4;

/// What one pass wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Slices created.
    pub created: usize,
    /// Slices replaced.
    pub updated: usize,
    /// Slices deleted.
    pub deleted: usize,
}

/// Makes the API hold exactly `desired` for `(node, driver)` (see the module docs).
pub async fn sync_slices(
    client: &Client,
    node: &str,
    driver: &str,
    desired: &[ResourceSlice],
) -> Result<Published, ApiCallError> {
    retry_attempts(ATTEMPTS, || pass(client, node, driver, desired)).await
}

async fn pass(
    client: &Client,
    node: &str,
    driver: &str,
    desired: &[ResourceSlice],
) -> Result<Published, ApiCallError> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let fields = format!("spec.nodeName={node},spec.driver={driver}");
    let listed: Vec<ResourceSlice> = bounded(api.list(&ListParams::default().fields(&fields)))
        .await?
        .items
        .into_iter()
        .filter(|s| s.spec.driver == driver && s.spec.node_name.as_deref() == Some(node))
        .collect();
    let mut out = Published::default();
    for want in desired {
        let name = want.metadata.name.clone().unwrap_or_default();
        match listed
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(&name))
        {
            None => match bounded(api.create(&PostParams::default(), want)).await {
                Ok(_) => out.created += 1,
                // A 409 (made by a pass whose answer was lost) is transient: the pass is tried
                // again and its list sees the slice.
                Err(e) => return Err(e),
            },
            Some(have) if have.spec == want.spec => {}
            Some(have) => {
                let mut next = want.clone();
                next.metadata.resource_version = have.metadata.resource_version.clone();
                bounded(api.replace(&name, &PostParams::default(), &next)).await?;
                out.updated += 1;
            }
        }
    }
    for have in &listed {
        let name = have.metadata.name.clone().unwrap_or_default();
        if desired
            .iter()
            .any(|w| w.metadata.name.as_deref() == Some(&name))
        {
            continue;
        }
        match bounded(api.delete(&name, &DeleteParams::default())).await {
            Ok(_) => out.deleted += 1,
            Err(ApiCallError::Kube(kube::Error::Api(e))) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}
