//! [`WatchedPod`]: a Pod as the extender's watch reads it — only the fields the ledger uses
//! (name, namespace, UID, resourceVersion, annotations, deletion time; node, the containers'
//! and init containers' names, resources and restart policies; phase). Everything else in the JSON, above all
//! `managedFields`, env, volumes and the status's container states, is skipped while parsing
//! and never allocated, so a full list of a large cluster costs a fraction of decoding whole
//! Pods. Inside is an ordinary `k8s_openapi` Pod with only those fields set, so the same
//! projections (`pod_gpu_request`, `pod_annotations`, …) serve both.
//!
//! `null` is read as empty wherever Go may send it (nil slices, maps and structs of a Go
//! client's Pod, e.g. kube-scheduler's `"containers": null`).
//!
//! It is for reading only: never write it back (a PUT would drop every field it skipped).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Deserializer};

/// A Pod holding only what the ledger reads (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WatchedPod(pub Pod);

impl k8s_openapi::Resource for WatchedPod {
    const API_VERSION: &'static str = <Pod as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Pod as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Pod as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Pod as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    annotations: Option<BTreeMap<String, String>>,
    deletion_timestamp: Option<Time>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireContainer {
    #[serde(deserialize_with = "null_as_default")]
    name: String,
    resources: Option<ResourceRequirements>,
    restart_policy: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireSpec {
    node_name: Option<String>,
    #[serde(deserialize_with = "null_as_default")]
    containers: Vec<WireContainer>,
    init_containers: Option<Vec<WireContainer>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireStatus {
    phase: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WirePod {
    #[serde(deserialize_with = "null_as_default")]
    metadata: WireMeta,
    spec: Option<WireSpec>,
    status: Option<WireStatus>,
}

/// `null` as the type's default: Go serialises nil slices, maps and pointers as `null` and
/// decodes `null` into an empty value, so a Go client (kube-scheduler's ExtenderArgs) sends it
/// where Kubernetes' own API server would omit the field.
fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    deserializer: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

fn container(c: WireContainer) -> Container {
    Container {
        name: c.name,
        resources: c.resources,
        restart_policy: c.restart_policy,
        ..Container::default()
    }
}

impl<'de> Deserialize<'de> for WatchedPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = WirePod::deserialize(deserializer)?;
        Ok(WatchedPod(Pod {
            metadata: ObjectMeta {
                name: wire.metadata.name,
                namespace: wire.metadata.namespace,
                uid: wire.metadata.uid,
                resource_version: wire.metadata.resource_version,
                annotations: wire.metadata.annotations,
                deletion_timestamp: wire.metadata.deletion_timestamp,
                ..ObjectMeta::default()
            },
            spec: wire.spec.map(|s| PodSpec {
                node_name: s.node_name,
                containers: s.containers.into_iter().map(container).collect(),
                init_containers: s
                    .init_containers
                    .map(|cs| cs.into_iter().map(container).collect()),
                ..PodSpec::default()
            }),
            status: wire.status.map(|s| PodStatus {
                phase: s.phase,
                ..PodStatus::default()
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::{pod_annotations, pod_gpu_request, pod_is_terminal};

    /// A Pod as the API server sends it, with much the ledger never reads.
    const FULL: &str = r#"{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "job-1", "namespace": "ml", "uid": "u-1", "resourceVersion": "42",
            "deletionTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "train"},
            "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "4",
                            "kubectl.kubernetes.io/last-applied-configuration": "{\"big\": true}"},
            "managedFields": [{"manager": "kubectl", "operation": "Update",
                               "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}}}],
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "o"}]
        },
        "spec": {
            "nodeName": "gpu-node-1",
            "initContainers": [{"name": "init", "image": "busybox",
                "resources": {"limits": {"aliyun.com/gpu-mem": "2"}}},
                {"name": "sidecar-init", "image": "envoy", "restartPolicy": "Always",
                "resources": {"limits": {"aliyun.com/gpu-mem": "1"}}}],
            "containers": [
                {"name": "main", "image": "train:1", "env": [{"name": "A", "value": "b"}],
                 "resources": {"limits": {"aliyun.com/gpu-mem": "4", "cpu": "2"}},
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                {"name": "sidecar", "image": "log:1"}
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
            "tolerations": [{"operator": "Exists"}]
        },
        "status": {
            "phase": "Running", "podIP": "10.0.0.1",
            "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0,
                "image": "train:1", "imageID": "sha256:x", "state": {"running": {}}}]
        }
    }"#;

    #[test]
    fn reads_what_the_ledger_uses_as_a_whole_pod_does() {
        let whole: Pod = serde_json::from_str(FULL).expect("a Pod");
        let slim: WatchedPod = serde_json::from_str(FULL).expect("a WatchedPod");
        let slim = slim.0;
        assert_eq!(slim.metadata.name, whole.metadata.name);
        assert_eq!(slim.metadata.namespace, whole.metadata.namespace);
        assert_eq!(slim.metadata.uid, whole.metadata.uid);
        assert_eq!(
            slim.metadata.resource_version,
            whole.metadata.resource_version
        );
        assert_eq!(
            slim.metadata.deletion_timestamp,
            whole.metadata.deletion_timestamp
        );
        assert_eq!(pod_annotations(&slim), pod_annotations(&whole));
        assert_eq!(pod_gpu_request(&slim), pod_gpu_request(&whole));
        assert_eq!(pod_is_terminal(&slim), pod_is_terminal(&whole));
        let spec = slim.spec.as_ref().expect("a spec");
        assert_eq!(spec.node_name.as_deref(), Some("gpu-node-1"));
        assert_eq!(spec.containers.len(), 2);
        assert_eq!(spec.init_containers.as_ref().map(Vec::len), Some(2));
        assert_eq!(
            pod_gpu_request(&slim).map(|r| r.total().units()),
            Ok(5),
            "app 4 + sidecar 1"
        );
        // What it skipped is not there.
        assert!(slim.metadata.managed_fields.is_none());
        assert!(slim.metadata.labels.is_none());
        assert!(spec.volumes.is_none());
        assert!(spec.containers[0].env.is_none());
        assert!(
            slim.status
                .as_ref()
                .is_some_and(|s| s.container_statuses.is_none())
        );
    }

    #[test]
    fn sparse_and_odd_pods_decode() {
        let empty: WatchedPod = serde_json::from_str("{}").expect("an empty object");
        assert_eq!(empty, WatchedPod::default());
        let bare: WatchedPod = serde_json::from_str(
            r#"{"metadata":{"name":"p"},"spec":{"containers":[]},"status":null}"#,
        )
        .expect("a bare pod");
        assert_eq!(bare.0.metadata.name.as_deref(), Some("p"));
        assert!(bare.0.status.is_none());
        // Go serialises nil slices and maps as null; Go decodes null as empty, so do we.
        let go_nils: WatchedPod = serde_json::from_str(
            r#"{"metadata":{"name":"podname","annotations":null,"labels":null},
                "spec":{"containers":null,"initContainers":null,"nodeName":null},"status":{}}"#,
        )
        .expect("Go's nil slices");
        let spec = go_nils.0.spec.as_ref().expect("a spec");
        assert!(spec.containers.is_empty());
        assert!(spec.init_containers.is_none());
        let nil_fields: WatchedPod = serde_json::from_str(
            r#"{"metadata":null,"spec":{"containers":[{"name":null,"resources":null}]}}"#,
        )
        .expect("null metadata and container fields");
        assert_eq!(nil_fields.0.spec.expect("spec").containers[0].name, "");
        // Wrong types are errors, as for a whole Pod, not panics.
        assert!(serde_json::from_str::<WatchedPod>(r#"{"metadata":{"name":1}}"#).is_err());
        assert!(serde_json::from_str::<WatchedPod>(r#"{"spec":{"containers":{}}}"#).is_err());
    }
}
