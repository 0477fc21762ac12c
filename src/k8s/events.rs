//! Kubernetes Events, the standard way: `events.k8s.io/v1` through kube-runtime's
//! [`Recorder`], which sets the reporting controller and instance and folds repeats of the same
//! event into a series (a count and a last-seen time) instead of a new object each time.
//!
//! Publishing is best effort: a failed publish is logged and never fails the caller. This
//! module does not decide when to raise an Event; the roles do.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// How long one publish may take: an Event is never worth a stuck task.
const PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The most a note may hold (the API's limit is 1 kB).
const NOTE_LIMIT: usize = 1024;

/// One component's Event publisher; clones share the aggregation cache.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Events")
    }
}

/// How serious an Event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// Something happened as it should.
    Normal,
    /// Something needs a look.
    Warning,
}

impl Events {
    /// A publisher for `component` (the reporting controller, e.g. `gpushare-device-plugin`)
    /// running as `instance` (the node name, or the pod name).
    pub fn new(client: kube::Client, component: &str, instance: &str) -> Events {
        let reporter = Reporter {
            controller: component.to_string(),
            instance: (!instance.is_empty()).then(|| instance.to_string()),
        };
        Events {
            recorder: Recorder::new(client, reporter),
        }
    }

    /// Publishes an Event about `regarding`; `action` is what was being done (`Bind`,
    /// `Allocate`, ...), `reason` why this Event is raised (`PascalCase`).
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        severity: Severity,
        action: &str,
        reason: &str,
        note: &str,
    ) {
        let event = Event {
            type_: match severity {
                Severity::Normal => EventType::Normal,
                Severity::Warning => EventType::Warning,
            },
            reason: reason.to_string(),
            note: Some(note.chars().take(NOTE_LIMIT).collect()),
            action: action.to_string(),
            secondary: None,
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, self.recorder.publish(&event, regarding)).await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %super::describe(&e), reason, "could not publish an Event")
            }
            Err(_) => tracing::warn!(reason, "publishing an Event timed out"),
        }
    }
}

/// A reference to the Node `name` (its `uid` when known).
pub(crate) fn node_reference(name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Node".to_string()),
        name: Some(name.to_string()),
        uid: (!uid.is_empty()).then(|| uid.to_string()),
        ..ObjectReference::default()
    }
}

/// A reference to the pod `namespace/name` with `uid`.
pub(crate) fn pod_reference(namespace: &str, name: &str, uid: Option<&str>) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Pod".to_string()),
        namespace: Some(namespace.to_string()),
        name: Some(name.to_string()),
        uid: uid.map(str::to_string),
        ..ObjectReference::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_sandbox::apiserver::ApiServer;

    #[tokio::test]
    async fn a_repeated_event_becomes_one_object_with_a_series() {
        let api = ApiServer::start().await.expect("sandbox");
        let events = Events::new(api.admin_client(), "gpushare-device-plugin", "node-1");
        let node = node_reference("node-1", "uid-1");
        for _ in 0..3 {
            events
                .publish(
                    &node,
                    Severity::Warning,
                    "Allocate",
                    "GpuShareAllocateFailed",
                    "no GPU fits",
                )
                .await;
        }
        let stored = api.list_objects("events.events.k8s.io", Some("default"));
        assert_eq!(stored.len(), 1, "{stored:#?}");
        let e = &stored[0];
        assert_eq!(e["series"]["count"], 3);
        assert_eq!(e["reason"], "GpuShareAllocateFailed");
        assert_eq!(e["action"], "Allocate");
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["note"], "no GPU fits");
        assert_eq!(e["regarding"]["kind"], "Node");
        assert_eq!(e["regarding"]["uid"], "uid-1");
        assert_eq!(e["reportingController"], "gpushare-device-plugin");
        assert_eq!(e["reportingInstance"], "node-1");
    }

    #[tokio::test]
    async fn a_long_note_is_cut_to_the_api_limit() {
        let api = ApiServer::start().await.expect("sandbox");
        let events = Events::new(api.admin_client(), "gpushare-schd-extender", "");
        let pod = pod_reference("ml", "trainer", Some("u"));
        events
            .publish(
                &pod,
                Severity::Normal,
                "Bind",
                "GpuShareBound",
                &"x".repeat(5000),
            )
            .await;
        let stored = api.list_objects("events.events.k8s.io", Some("ml"));
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0]["note"].as_str().map(str::len), Some(NOTE_LIMIT));
        assert_eq!(stored[0]["reportingInstance"], "gpushare-schd-extender");
    }
}
