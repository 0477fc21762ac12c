//! The chart's high-availability pieces (issue 18): with leader election it ships a
//! PodDisruptionBudget (minAvailable 1) over the extender's pods, an ordinary rolling update
//! (never all replicas down at once), and `POD_IP` for the address the leader advertises;
//! without leader election, none of it.

use yaml_serde::Value;

use crate::support::helm_chart::{all_documents, check_typed, default_values, merged};

/// The chart rendered with `overlay`; `None` (skipped) without the Helm engine.
fn with(overlay: &str) -> Option<Vec<Value>> {
    all_documents(merged(
        &default_values(),
        &yaml_serde::from_str(overlay).expect("overlay parses"),
    ))
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn extender(docs: &[Value]) -> &Value {
    docs.iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "gpushare-schd-extender")
        .expect("the extender Deployment")
}

#[test]
fn leader_election_ships_a_pdb_over_the_extender_pods() {
    let Some(docs) = with("{}") else {
        return;
    };
    let pdbs = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(pdbs.len(), 1, "one PodDisruptionBudget");
    let pdb = pdbs[0];
    check_typed(pdb).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pdb["apiVersion"], "policy/v1");
    assert_eq!(pdb["metadata"]["name"], "gpushare-schd-extender");
    assert_eq!(pdb["metadata"]["namespace"], "kube-system");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert!(pdb["spec"]["maxUnavailable"].is_null());
    // It selects exactly the Deployment's pods.
    let dep = extender(&docs);
    assert_eq!(pdb["spec"]["selector"], dep["spec"]["selector"]);
    let pod_labels = &dep["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pdb["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("matchLabels")
    {
        assert_eq!(&pod_labels[k], v, "pod label {k:?}");
    }
    assert!(
        dep["spec"]["replicas"].as_u64().unwrap_or(0) >= 2,
        "the default is two replicas, so the budget lets one go"
    );
}

#[test]
fn the_rolling_update_never_takes_all_replicas_down() {
    let Some(docs) = with("{}") else {
        return;
    };
    let ru = &extender(&docs)["spec"]["strategy"]["rollingUpdate"];
    assert_eq!(extender(&docs)["spec"]["strategy"]["type"], "RollingUpdate");
    assert_eq!(
        (ru["maxSurge"].as_u64(), ru["maxUnavailable"].as_u64()),
        (Some(1), Some(0))
    );
    // With hostNetwork a surge replica may find no free port: one at a time instead.
    let Some(docs) = with("extender: {hostNetwork: true}") else {
        return;
    };
    let ru = &extender(&docs)["spec"]["strategy"]["rollingUpdate"];
    assert_eq!(
        (ru["maxSurge"].as_u64(), ru["maxUnavailable"].as_u64()),
        (Some(0), Some(1))
    );
}

#[test]
fn the_leader_advertises_its_pod_ip() {
    let Some(docs) = with("{}") else {
        return;
    };
    let container = &extender(&docs)["spec"]["template"]["spec"]["containers"][0];
    let env = container["env"].as_sequence().expect("env");
    let pod_ip = env
        .iter()
        .find(|e| e["name"] == "POD_IP")
        .expect("POD_IP in the extender's env");
    assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
}

#[test]
fn without_leader_election_there_is_no_pdb_and_no_pod_ip() {
    let Some(docs) = with("extender: {leaderElect: false, replicas: 1}") else {
        return;
    };
    assert!(of_kind(&docs, "PodDisruptionBudget").is_empty());
    let container = &extender(&docs)["spec"]["template"]["spec"]["containers"][0];
    assert!(container["env"].is_null());
}
