//! Consumable capacity as upstream's allocator computes it (`consumable_capacity.go` of
//! `structured/internal/incubating`): what a request consumes of each capacity of a device
//! (no request: the policy's default, else the whole capacity; a request rounded up to the next
//! valid value, or to `min` and then `min + n × step`), whether that breaks the capacity's
//! `requestPolicy`, and whether it still fits beside what allocated and allocating claims hold.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;

use crate::quantity::Quantity;

/// Capacity held or asked for, per capacity name.
pub type Consumed = BTreeMap<String, Quantity>;

/// A quantity of the API; an unreadable one (validation refuses them) reads as zero.
pub(crate) fn read(q: &ApiQuantity) -> Quantity {
    Quantity::parse(&q.0).unwrap_or(Quantity::ZERO)
}

/// `calculateConsumedCapacity`: what `requested` (none: not asked) consumes of `capacity`.
pub(crate) fn consumed(requested: Option<&ApiQuantity>, capacity: &DeviceCapacity) -> Quantity {
    let Some(requested) = requested else {
        return match capacity
            .request_policy
            .as_ref()
            .and_then(|p| p.default.as_ref())
        {
            Some(default) => read(default),
            None => read(&capacity.value),
        };
    };
    let requested = read(requested);
    let Some(policy) = &capacity.request_policy else {
        return requested;
    };
    if let Some(range) = &policy.valid_range {
        let min = read(&range.min);
        if requested < min {
            return min;
        }
        let Some(step) = &range.step else {
            return requested;
        };
        // Upstream works in whole units (Quantity.Value(), rounded up).
        let (Some(r), Some(s), Some(m)) = (requested.value(), read(step).value(), min.value())
        else {
            return requested;
        };
        if s <= 0 {
            return requested;
        }
        let added = r - m;
        let n = added / s + i64::from(added % s != 0);
        return match n.checked_mul(s).and_then(|x| x.checked_add(m)) {
            Some(v) => Quantity::from_units(v),
            None => requested,
        };
    }
    if let Some(values) = &policy.valid_values {
        return values
            .iter()
            .map(read)
            .find(|v| requested <= *v)
            .unwrap_or(requested);
    }
    requested
}

/// `violatesPolicy`: whether consuming `value` breaks `policy`.
pub(crate) fn violates(value: Quantity, policy: Option<&CapacityRequestPolicy>) -> bool {
    let Some(policy) = policy else {
        return false;
    };
    if policy.default.as_ref().is_some_and(|d| read(d) == value) {
        return false;
    }
    if let Some(range) = &policy.valid_range {
        if range.max.as_ref().is_some_and(|m| value > read(m)) {
            return true;
        }
        if let Some(step) = &range.step {
            let (Some(v), Some(s), Some(m)) =
                (value.value(), read(step).value(), read(&range.min).value())
            else {
                return true;
            };
            return s == 0 || (v - m) % s != 0;
        }
        return false;
    }
    match &policy.valid_values {
        Some(values) if !values.is_empty() => !values.iter().any(|v| read(v) == value),
        _ => false,
    }
}

/// `CmpRequestOverCapacity`: whether `requests` fit the device's `capacity` beside `held`
/// (allocated claims) and `allocating` (this allocation so far). A request for a capacity the
/// device lacks is `None` (upstream's error, which skips the device).
pub(crate) fn fits(
    held: Option<&Consumed>,
    requests: Option<&BTreeMap<String, ApiQuantity>>,
    capacity: Option<&BTreeMap<String, DeviceCapacity>>,
    allocating: Option<&Consumed>,
) -> Option<bool> {
    let empty = BTreeMap::new();
    let capacity = capacity.unwrap_or(&empty);
    if requests.is_some_and(|r| r.keys().any(|k| !capacity.contains_key(k))) {
        return None;
    }
    for (name, cap) in capacity {
        let value = consumed(requests.and_then(|r| r.get(name)), cap);
        if violates(value, cap.request_policy.as_ref()) {
            return Some(false);
        }
        let mut total = value;
        for extra in [held, allocating].into_iter().flatten() {
            if let Some(q) = extra.get(name) {
                total = total.checked_add(q)?;
            }
        }
        if total > read(&cap.value) {
            return Some(false);
        }
    }
    Some(true)
}

/// `GetConsumedCapacityFromRequest`: what the request consumes of every capacity.
pub(crate) fn consumed_by(
    requests: Option<&BTreeMap<String, ApiQuantity>>,
    capacity: Option<&BTreeMap<String, DeviceCapacity>>,
) -> Consumed {
    capacity
        .into_iter()
        .flatten()
        .map(|(name, cap)| {
            (
                name.clone(),
                consumed(requests.and_then(|r| r.get(name)), cap),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cap(v: serde_json::Value) -> DeviceCapacity {
        serde_json::from_value(v).expect("a capacity")
    }

    fn q(s: &str) -> ApiQuantity {
        ApiQuantity(s.to_string())
    }

    fn text(x: Quantity) -> String {
        x.canonical()
    }

    #[test]
    fn requests_round_up_as_upstream() {
        let c = cap(
            json!({ "value": "16Gi", "requestPolicy": { "default": "16Gi",
            "validRange": { "min": "1Gi", "max": "16Gi", "step": "1Gi" } } }),
        );
        assert_eq!(text(consumed(None, &c)), "16Gi", "no request: the default");
        assert_eq!(text(consumed(Some(&q("1")), &c)), "1Gi", "below min: min");
        assert_eq!(text(consumed(Some(&q("1500Mi")), &c)), "2Gi");
        assert_eq!(text(consumed(Some(&q("4Gi")), &c)), "4Gi");
        assert!(violates(
            consumed(Some(&q("17Gi")), &c),
            c.request_policy.as_ref()
        ));
        let values = cap(
            json!({ "value": "16Gi", "requestPolicy": { "default": "2Gi",
            "validValues": ["2Gi", "4Gi", "8Gi"] } }),
        );
        assert_eq!(text(consumed(Some(&q("3Gi")), &values)), "4Gi");
        let beyond = consumed(Some(&q("9Gi")), &values);
        assert_eq!(text(beyond), "9Gi");
        assert!(violates(beyond, values.request_policy.as_ref()));
        let bare = cap(json!({ "value": "16Gi" }));
        assert_eq!(text(consumed(None, &bare)), "16Gi");
        assert_eq!(text(consumed(Some(&q("1536Mi")), &bare)), "1536Mi");
    }

    #[test]
    fn fitting_counts_what_is_held_and_allocating() {
        let capacity: BTreeMap<String, DeviceCapacity> = BTreeMap::from([(
            "memory".to_string(),
            cap(
                json!({ "value": "16Gi", "requestPolicy": { "default": "1Gi",
                "validRange": { "min": "1Gi", "step": "1Gi" } } }),
            ),
        )]);
        let ask = |s: &str| BTreeMap::from([("memory".to_string(), q(s))]);
        let held: Consumed =
            BTreeMap::from([("memory".to_string(), Quantity::parse("10Gi").expect("q"))]);
        assert_eq!(
            fits(Some(&held), Some(&ask("6Gi")), Some(&capacity), None),
            Some(true)
        );
        assert_eq!(
            fits(Some(&held), Some(&ask("7Gi")), Some(&capacity), None),
            Some(false)
        );
        let other = BTreeMap::from([("cores".to_string(), q("1"))]);
        assert_eq!(fits(None, Some(&other), Some(&capacity), None), None);
    }
}
