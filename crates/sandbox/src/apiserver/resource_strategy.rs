//! What upstream's registry strategies for `resource.k8s.io/v1` do to an object before it is
//! validated and stored (`pkg/registry/resource/*/strategy.go` and `resourceclaimspec`):
//! the fields of a disabled feature gate are dropped (`dropDisabledFields`) unless the stored
//! object already uses them (so an unrelated update of an object written while the gate was on
//! keeps them), a new claim's status is reset, a claim's status update drops the device
//! statuses of devices no longer allocated, and slices and classes get their
//! `metadata.generation` (1 on create, one more on every spec change).
//!
//! It works on the JSON the sandbox stores and never refuses anything (refusing is
//! `validation_resource`'s job). Not modelled: the `DRAResourcePoolStatus` gate
//! (`partitionTypeAttribute` is kept as written) and the pruning of fields no schema knows.

use serde_json::{Value, json};

use super::feature_gates::{Cluster, FeatureGate};
use super::store::Part;

/// What a write is.
#[derive(Clone, Copy)]
pub(crate) enum Write<'a> {
    /// A create; `keep_status`: a test control seeding a claim as a controller left it (an
    /// API request's status is reset, as upstream's `PrepareForCreate` does).
    Create { keep_status: bool },
    /// A replace of `old` (update or patch), of the main resource or its status.
    Update { old: &'a Value, part: Part },
}

/// Applies upstream's strategy for `resource` (a resource id: `resourceslices`,
/// `deviceclasses`, `resourceclaims`, `resourceclaimtemplates`; others are left alone).
pub(crate) fn prepare(resource: &str, obj: &mut Value, write: Write<'_>, cluster: &Cluster) {
    let old = match write {
        Write::Update { old, .. } => Some(old),
        Write::Create { .. } => None,
    };
    match resource {
        "resourceslices" => {
            drop_slice_fields(obj, old, cluster);
            generation(obj, old);
        }
        "deviceclasses" => {
            if !cluster.enabled(FeatureGate::DRAExtendedResource)
                && old
                    .and_then(|o| o.pointer("/spec/extendedResourceName"))
                    .is_none()
                && let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut)
            {
                spec.remove("extendedResourceName");
            }
            generation(obj, old);
        }
        "resourceclaims" => match write {
            Write::Create { keep_status } => {
                if !keep_status && let Some(o) = obj.as_object_mut() {
                    o.remove("status");
                }
                drop_claim_spec_fields(obj.get_mut("spec"), None, cluster);
                drop_claim_status_fields(obj, None, cluster);
            }
            Write::Update {
                old,
                part: Part::Main,
            } => drop_claim_spec_fields(obj.get_mut("spec"), old.get("spec"), cluster),
            Write::Update {
                old,
                part: Part::Status,
            } => {
                drop_claim_status_fields(obj, Some(old), cluster);
                drop_deallocated_status_devices(obj, old, cluster);
            }
        },
        "resourceclaimtemplates" => drop_claim_spec_fields(
            obj.pointer_mut("/spec/spec"),
            old.and_then(|o| o.pointer("/spec/spec")),
            cluster,
        ),
        _ => {}
    }
}

/// The items of the array at `v`, mutably (none when absent or not an array).
fn items_mut(v: Option<&mut Value>) -> impl Iterator<Item = &mut Value> {
    v.and_then(Value::as_array_mut).into_iter().flatten()
}

/// The items of the array at `v`.
fn items(v: Option<&Value>) -> impl Iterator<Item = &Value> {
    v.and_then(Value::as_array).into_iter().flatten()
}

fn remove(v: &mut Value, fields: &[&str]) {
    if let Some(o) = v.as_object_mut() {
        for f in fields {
            o.remove(*f);
        }
    }
}

fn devices(slice: Option<&Value>) -> impl Iterator<Item = &Value> {
    items(slice.and_then(|s| s.pointer("/spec/devices")))
}

fn any_device(old: Option<&Value>, used: impl Fn(&Value) -> bool) -> bool {
    devices(old).any(used)
}

fn non_empty_array(v: Option<&Value>) -> bool {
    v.and_then(Value::as_array).is_some_and(|a| !a.is_empty())
}

/// `dropDisabledFields` of ResourceSlices.
fn drop_slice_fields(obj: &mut Value, old: Option<&Value>, cluster: &Cluster) {
    let off = |gate| !cluster.enabled(gate);
    let drop_taints =
        off(FeatureGate::DRADeviceTaints) && !any_device(old, |d| non_empty_array(d.get("taints")));
    let drop_partitionable = off(FeatureGate::DRAPartitionableDevices)
        && !(old.is_some_and(|o| {
            non_empty_array(o.pointer("/spec/sharedCounters"))
                || o.pointer("/spec/perDeviceNodeSelection").is_some()
        }) || any_device(old, |d| {
            non_empty_array(d.get("consumesCounters"))
                || d.get("nodeName").is_some()
                || d.get("nodeSelector").is_some()
                || d.get("allNodes").is_some()
        }));
    let binding_on = cluster.enabled(FeatureGate::DRADeviceBindingConditions)
        && cluster.enabled(FeatureGate::DRAResourceClaimDeviceStatus);
    let drop_binding = !binding_on
        && !any_device(old, |d| {
            non_empty_array(d.get("bindingConditions"))
                || non_empty_array(d.get("bindingFailureConditions"))
                || d.get("bindsToNode").is_some()
        });
    let drop_consumable = off(FeatureGate::DRAConsumableCapacity)
        && !any_device(old, |d| {
            d.get("allowMultipleAllocations").is_some()
                || d.get("capacity")
                    .and_then(Value::as_object)
                    .is_some_and(|c| c.values().any(|c| c.get("requestPolicy").is_some()))
        });
    let drop_allocatable = off(FeatureGate::DRANodeAllocatableResources)
        && !any_device(old, |d| {
            d.get("nodeAllocatableResourceMappings")
                .and_then(Value::as_object)
                .is_some_and(|m| !m.is_empty())
        });
    const LISTS: [&str; 4] = ["bools", "ints", "strings", "versions"];
    let drop_lists = off(FeatureGate::DRAListTypeAttributes)
        && !any_device(old, |d| {
            d.get("attributes")
                .and_then(Value::as_object)
                .is_some_and(|a| {
                    a.values()
                        .any(|a| LISTS.iter().any(|l| a.get(*l).is_some()))
                })
        });
    if drop_partitionable && let Some(spec) = obj.get_mut("spec") {
        remove(spec, &["sharedCounters", "perDeviceNodeSelection"]);
    }
    for d in items_mut(obj.pointer_mut("/spec/devices")) {
        if drop_taints {
            remove(d, &["taints"]);
        }
        if drop_partitionable {
            remove(
                d,
                &["consumesCounters", "nodeName", "nodeSelector", "allNodes"],
            );
        }
        if drop_binding {
            remove(
                d,
                &[
                    "bindingConditions",
                    "bindingFailureConditions",
                    "bindsToNode",
                ],
            );
        }
        if drop_consumable {
            remove(d, &["allowMultipleAllocations"]);
            if let Some(caps) = d.get_mut("capacity").and_then(Value::as_object_mut) {
                for cap in caps.values_mut() {
                    remove(cap, &["requestPolicy"]);
                }
            }
        }
        if drop_allocatable {
            remove(d, &["nodeAllocatableResourceMappings"]);
        }
        if drop_lists && let Some(attrs) = d.get_mut("attributes").and_then(Value::as_object_mut) {
            for a in attrs.values_mut() {
                remove(a, &LISTS);
            }
        }
    }
}

/// Upstream's `resourceclaimspec.DropDisabledFields` on a claim spec (`spec` of a claim,
/// `spec.spec` of a template) against the stored one.
fn drop_claim_spec_fields(spec: Option<&mut Value>, old: Option<&Value>, cluster: &Cluster) {
    let Some(spec) = spec else { return };
    fn requests(s: Option<&Value>) -> impl Iterator<Item = &Value> {
        items(s.and_then(|s| s.pointer("/devices/requests")))
    }
    let subs = |r: &Value| items(r.get("firstAvailable")).cloned().collect::<Vec<_>>();
    let off = |gate| !cluster.enabled(gate);
    if off(FeatureGate::DRAPrioritizedList)
        && !requests(old).any(|r| non_empty_array(r.get("firstAvailable")))
    {
        for r in items_mut(spec.pointer_mut("/devices/requests")) {
            remove(r, &["firstAvailable"]);
        }
    }
    if off(FeatureGate::DRADeviceTaints)
        && !requests(old).any(|r| {
            non_empty_array(r.pointer("/exactly/tolerations"))
                || subs(r)
                    .iter()
                    .any(|s| non_empty_array(s.get("tolerations")))
        })
    {
        for r in items_mut(spec.pointer_mut("/devices/requests")) {
            if let Some(e) = r.get_mut("exactly") {
                remove(e, &["tolerations"]);
            }
            for s in items_mut(r.get_mut("firstAvailable")) {
                remove(s, &["tolerations"]);
            }
        }
    }
    if off(FeatureGate::DRAAdminAccess)
        && !requests(old).any(|r| r.pointer("/exactly/adminAccess").is_some())
    {
        for r in items_mut(spec.pointer_mut("/devices/requests")) {
            if let Some(e) = r.get_mut("exactly") {
                remove(e, &["adminAccess"]);
            }
        }
    }
    // Upstream also means to drop `distinctAttribute` here, but its loop works on a copy of
    // each constraint, so the field stays: so it does here.
    let consumable_in_use = items(old.and_then(|s| s.pointer("/devices/constraints")))
        .any(|c| c.get("distinctAttribute").is_some())
        || requests(old).any(|r| {
            r.pointer("/exactly/capacity").is_some()
                || subs(r).iter().any(|s| s.get("capacity").is_some())
        });
    if off(FeatureGate::DRAConsumableCapacity) && !consumable_in_use {
        for r in items_mut(spec.pointer_mut("/devices/requests")) {
            if let Some(e) = r.get_mut("exactly") {
                remove(e, &["capacity"]);
            }
            for s in items_mut(r.get_mut("firstAvailable")) {
                remove(s, &["capacity"]);
            }
        }
    }
}

fn results(claim: Option<&Value>) -> impl Iterator<Item = &Value> {
    items(claim.and_then(|c| c.pointer("/status/allocation/devices/results")))
}

/// `dropDisabledStatusFields` of claims (a status update, or a create keeping its status).
fn drop_claim_status_fields(obj: &mut Value, old: Option<&Value>, cluster: &Cluster) {
    let off = |gate| !cluster.enabled(gate);
    let Some(status) = obj.get_mut("status") else {
        return;
    };
    if off(FeatureGate::DRAResourceClaimDeviceStatus)
        && !old.is_some_and(|o| non_empty_array(o.pointer("/status/devices")))
    {
        remove(status, &["devices"]);
    }
    let admin_in_use = old.is_some_and(|o| {
        items(o.pointer("/spec/devices/requests"))
            .any(|r| r.pointer("/exactly/adminAccess").is_some())
    }) || results(old).any(|r| r.get("adminAccess").is_some());
    let consumable_in_use = results(old)
        .any(|r| r.get("shareID").is_some() || r.get("consumedCapacity").is_some())
        || items(old.and_then(|o| o.pointer("/status/devices")))
            .any(|d| d.get("shareID").is_some());
    let binding_in_use = results(old).any(|r| {
        r.get("bindingConditions").is_some() || r.get("bindingFailureConditions").is_some()
    });
    let drop_admin = off(FeatureGate::DRAAdminAccess) && !admin_in_use;
    let drop_consumable = off(FeatureGate::DRAConsumableCapacity) && !consumable_in_use;
    let drop_binding = off(FeatureGate::DRADeviceBindingConditions) && !binding_in_use;
    for r in items_mut(status.pointer_mut("/allocation/devices/results")) {
        if drop_admin {
            remove(r, &["adminAccess"]);
        }
        if drop_consumable {
            remove(r, &["shareID", "consumedCapacity"]);
        }
        if drop_binding {
            remove(r, &["bindingConditions", "bindingFailureConditions"]);
        }
    }
    if drop_consumable {
        for d in items_mut(status.get_mut("devices")) {
            remove(d, &["shareID"]);
        }
    }
}

/// `(driver, pool, device, shareID)` of a result or device status.
fn shared_device_id(v: &Value) -> (String, String, String, String) {
    let s = |f: &str| v.get(f).and_then(Value::as_str).unwrap_or("").to_string();
    (s("driver"), s("pool"), s("device"), s("shareID"))
}

/// `dropDeallocatedStatusDevices`: device statuses of devices the update deallocated go.
fn drop_deallocated_status_devices(obj: &mut Value, old: &Value, cluster: &Cluster) {
    if !cluster.enabled(FeatureGate::DRAResourceClaimDeviceStatus)
        && !non_empty_array(old.pointer("/status/devices"))
    {
        return;
    }
    let kept: Vec<_> = results(Some(obj)).map(shared_device_id).collect();
    let gone: Vec<_> = results(Some(old))
        .map(shared_device_id)
        .filter(|id| !kept.contains(id))
        .collect();
    let Some(status) = obj.get_mut("status").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(Value::Array(devices)) = status.get_mut("devices") {
        devices.retain(|d| !gone.contains(&shared_device_id(d)));
        if devices.is_empty() {
            status.remove("devices");
        }
    }
}

/// `metadata.generation`: 1 on create, one more when the spec changes.
fn generation(obj: &mut Value, old: Option<&Value>) {
    let next = match old {
        None => 1,
        Some(old) => {
            let before = old
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            if old.get("spec") == obj.get("spec") {
                before
            } else {
                before + 1
            }
        }
    };
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("generation".into(), json!(next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice() -> Value {
        json!({ "metadata": { "name": "s" }, "spec": { "driver": "d", "allNodes": true,
            "pool": { "name": "p", "generation": 1, "resourceSliceCount": 1 },
            "devices": [{ "name": "gpu-0", "allowMultipleAllocations": true,
                "taints": [{ "key": "k", "effect": "NoSchedule" }],
                "capacity": { "memory": { "value": "16Gi", "requestPolicy": { "default": "16Gi" } } } }] } })
    }

    #[test]
    fn a_gate_off_drops_its_fields_unless_the_stored_object_uses_them() {
        let mut at_135 = Cluster::at(35);
        let mut new = slice();
        prepare(
            "resourceslices",
            &mut new,
            Write::Create { keep_status: false },
            &at_135,
        );
        let device = &new["spec"]["devices"][0];
        assert!(device.get("taints").is_none(), "{device}");
        assert!(device.get("allowMultipleAllocations").is_none());
        assert_eq!(device["capacity"]["memory"], json!({ "value": "16Gi" }));
        assert_eq!(new["metadata"]["generation"], 1);

        // Stored while the gates were on: an update keeps the fields.
        let mut old = slice();
        old["metadata"]["generation"] = json!(3);
        let mut update = slice();
        update["spec"]["devices"][0]["name"] = json!("gpu-1");
        prepare(
            "resourceslices",
            &mut update,
            Write::Update {
                old: &old,
                part: Part::Main,
            },
            &at_135,
        );
        assert!(update["spec"]["devices"][0].get("taints").is_some());
        assert_eq!(update["metadata"]["generation"], 4, "the spec changed");

        at_135.set(FeatureGate::DRADeviceTaints, true);
        let mut new = slice();
        prepare(
            "resourceslices",
            &mut new,
            Write::Create { keep_status: false },
            &at_135,
        );
        assert!(new["spec"]["devices"][0].get("taints").is_some());
        assert!(
            new["spec"]["devices"][0]
                .get("allowMultipleAllocations")
                .is_none()
        );
    }

    #[test]
    fn claims_lose_their_status_on_create_and_gated_request_fields() {
        let claim = json!({ "metadata": { "name": "c" },
            "spec": { "devices": { "requests": [{ "name": "r", "exactly": {
                "deviceClassName": "c", "capacity": { "requests": { "memory": "1Gi" } },
                "tolerations": [{ "operator": "Exists" }] } }] } },
            "status": { "reservedFor": [] } });
        let mut new = claim.clone();
        prepare(
            "resourceclaims",
            &mut new,
            Write::Create { keep_status: false },
            &Cluster::at(34),
        );
        assert!(new.get("status").is_none());
        let exactly = &new["spec"]["devices"]["requests"][0]["exactly"];
        assert!(exactly.get("capacity").is_none() && exactly.get("tolerations").is_none());
        let mut new = claim;
        prepare(
            "resourceclaims",
            &mut new,
            Write::Create { keep_status: true },
            &Cluster::at(37),
        );
        assert!(new.get("status").is_some());
        assert!(new["spec"]["devices"]["requests"][0]["exactly"]["capacity"].is_object());
    }

    #[test]
    fn a_status_update_drops_statuses_of_deallocated_devices() {
        let result = json!({ "request": "r", "driver": "d", "pool": "p", "device": "gpu-0" });
        let old = json!({ "status": { "allocation": { "devices": { "results": [result] } },
            "devices": [{ "driver": "d", "pool": "p", "device": "gpu-0" }] } });
        let mut new =
            json!({ "status": { "devices": [{ "driver": "d", "pool": "p", "device": "gpu-0" }] } });
        prepare(
            "resourceclaims",
            &mut new,
            Write::Update {
                old: &old,
                part: Part::Status,
            },
            &Cluster::default(),
        );
        assert!(new["status"].get("devices").is_none(), "{new}");
    }
}
