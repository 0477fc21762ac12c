//! What the extender's ledger must equal: the holdings the API server's pods carry in their
//! annotations (bound, not finished), read back from `/inspect` and compared, with a readable
//! difference when they do not converge; and the over-commit check on the annotations.

use std::collections::BTreeMap;

use gpushare::core::wire::{ANN_GPU_INDEX, ANN_POD_MEM};
use gpushare_sandbox::apiserver::ApiServer;
use serde_json::Value;

use super::extender_http::http;
use super::wait::{DEADLINE, poll};

/// Per (node, GPU index): pod UID → memory units held.
pub(crate) type Holdings = BTreeMap<(String, u32), BTreeMap<String, u64>>;

/// What the API server's pods say is held: bound, not finished, with a GPU index.
pub(crate) fn truth(api: &ApiServer) -> Holdings {
    let mut out = Holdings::new();
    for pod in api.list_objects("pods", None) {
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        let phase = pod["status"]["phase"].as_str().unwrap_or_default();
        let ann = &pod["metadata"]["annotations"];
        let gpu = ann[ANN_GPU_INDEX]
            .as_str()
            .and_then(|v| v.parse::<u32>().ok());
        let mem = ann[ANN_POD_MEM]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok());
        let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
        if node.is_empty() || matches!(phase, "Succeeded" | "Failed") {
            continue;
        }
        if let (Some(gpu), Some(mem)) = (gpu, mem) {
            out.entry((node.to_string(), gpu))
                .or_default()
                .insert(uid.to_string(), mem);
        }
    }
    out
}

/// The extender's ledger from `GET {prefix}/inspect` (pods on GPUs and pending ones).
pub(crate) async fn ledger(addr: std::net::SocketAddr) -> Option<Holdings> {
    let url = format!("http://{addr}/gpushare-scheduler/inspect");
    let (status, body) = http(http::Method::GET, &url, None).await?;
    if status != 200 {
        return None;
    }
    let v: Value = serde_json::from_slice(&body).ok()?;
    let mut out = Holdings::new();
    for node in v["nodes"].as_array()? {
        let name = node["name"].as_str()?.to_string();
        for dev in node["devs"].as_array()? {
            let id = u32::try_from(dev["id"].as_u64()?).ok()?;
            for pod in dev["pods"].as_array()? {
                out.entry((name.clone(), id))
                    .or_default()
                    .insert(pod["uid"].as_str()?.to_string(), pod["usedGPU"].as_u64()?);
            }
        }
        if !node["pending"].as_array()?.is_empty() {
            out.entry((name, u32::MAX)).or_default();
        }
    }
    Some(out)
}

/// Polls `/inspect` until the ledger equals the API's truth (or fails with both).
pub(crate) async fn converge(api: &ApiServer, addr: std::net::SocketAddr) {
    poll(
        "the ledger to converge with the API's pods",
        DEADLINE,
        || async {
            let want = truth(api);
            let got = ledger(addr).await;
            if got.as_ref() == Some(&want) {
                Ok(())
            } else {
                Err(Difference(describe_difference(api, got.as_ref(), &want)))
            }
        },
    )
    .await;
}

/// A difference, shown as the text it is (not escaped) when a wait fails.
struct Difference(String);

impl std::fmt::Debug for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "\n{}", self.0)
    }
}

/// The pods counted differently by the ledger and the API, with what the API says of them.
fn describe_difference(api: &ApiServer, got: Option<&Holdings>, want: &Holdings) -> String {
    let Some(got) = got else {
        return "the extender's /inspect did not answer".to_string();
    };
    let flatten = |h: &Holdings| -> BTreeMap<String, (String, u32, u64)> {
        h.iter()
            .flat_map(|((n, g), pods)| {
                pods.iter()
                    .map(move |(u, m)| (u.clone(), (n.clone(), *g, *m)))
            })
            .collect()
    };
    let (got, want) = (flatten(got), flatten(want));
    let pods = api.list_objects("pods", None);
    let describe = |uid: &str| -> String {
        pods.iter()
            .find(|p| p["metadata"]["uid"].as_str() == Some(uid))
            .map(|p| {
                format!(
                    "{} phase={} node={} annotations={}",
                    p["metadata"]["name"],
                    p["status"]["phase"],
                    p["spec"]["nodeName"],
                    p["metadata"]["annotations"]
                )
            })
            .unwrap_or_else(|| "no such pod in the API (deleted)".to_string())
    };
    let mut out = String::new();
    for (uid, place) in &got {
        if want.get(uid) != Some(place) {
            out.push_str(&format!(
                "ledger counts {uid} at {place:?}, API has {:?}: {}\n",
                want.get(uid),
                describe(uid)
            ));
        }
    }
    for (uid, place) in &want {
        if !got.contains_key(uid) {
            out.push_str(&format!(
                "ledger misses {uid} at {place:?}: {}\n",
                describe(uid)
            ));
        }
    }
    out
}

/// Fails if any GPU holds more than `units` according to the API's pods.
pub(crate) fn assert_not_overcommitted(api: &ApiServer, units: u64) {
    for ((node, gpu), pods) in truth(api) {
        let used: u64 = pods.values().sum();
        assert!(
            used <= units,
            "GPU {gpu} of {node} is over-committed: {used} > {units} units ({pods:?})"
        );
    }
}
