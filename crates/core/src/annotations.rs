//! Typed encode/decode of the gpushare pod annotations (reference spec §2.2).
//!
//! Decoding tolerates garbage: every bad value becomes an [`AnnotationError`] and the field
//! reads as absent; nothing panics. Encoding produces exactly the decimal strings, Unix
//! nanosecond timestamps and `"true"`/`"false"` that upstream components read.

use std::collections::BTreeMap;

use super::memory::GpuMem;
use super::wire::{
    ANN_ALLOCATION_JSON, ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, ANN_POD_MEM,
    POD_ANN_ALLOCATED_CONTAINERS, POD_ANN_RESERVATION,
};

/// The gpushare annotations of one pod, decoded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodGpuAnnotations {
    /// `ALIYUN_COM_GPU_MEM_IDX`.
    pub gpu_index: Option<u32>,
    /// `ALIYUN_COM_GPU_MEM_POD`.
    pub pod_mem: Option<GpuMem>,
    /// `ALIYUN_COM_GPU_MEM_DEV`.
    pub device_mem: Option<GpuMem>,
    /// `ALIYUN_COM_GPU_MEM_ASSIGNED`.
    pub assigned: Option<bool>,
    /// `ALIYUN_COM_GPU_MEM_ASSUME_TIME`, Unix nanoseconds.
    pub assume_time_ns: Option<u64>,
    /// `gpushare.io/allocated-containers`: containers the device plugin already served.
    pub allocated_containers: Vec<String>,
}

/// A pod annotation that could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("pod annotation {key}={value:?} is invalid: {reason}")]
pub struct AnnotationError {
    /// The annotation key.
    pub key: &'static str,
    /// The value found (truncated to 64 bytes).
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl PodGpuAnnotations {
    /// Decodes the annotations; invalid values are reported and read as absent.
    pub fn decode(annotations: &BTreeMap<String, String>) -> (Self, Vec<AnnotationError>) {
        let mut errors = Vec::new();
        let field =
            |key: &'static str| -> Option<&str> { annotations.get(key).map(String::as_str) };
        let gpu_index =
            field(ANN_GPU_INDEX).and_then(|v| decode_u64(ANN_GPU_INDEX, v, &mut errors));
        let gpu_index = gpu_index.and_then(|i| match u32::try_from(i) {
            Ok(i) => Some(i),
            Err(_) => {
                errors.push(err(ANN_GPU_INDEX, &i.to_string(), "GPU index out of range"));
                None
            }
        });
        let pod_mem = field(ANN_POD_MEM).and_then(|v| decode_mem(ANN_POD_MEM, v, &mut errors));
        let device_mem =
            field(ANN_DEVICE_MEM).and_then(|v| decode_mem(ANN_DEVICE_MEM, v, &mut errors));
        let assigned = match field(ANN_ASSIGNED) {
            None => None,
            Some("true") => Some(true),
            Some("false") => Some(false),
            Some(other) => {
                errors.push(err(ANN_ASSIGNED, other, "expected \"true\" or \"false\""));
                None
            }
        };
        let assume_time_ns =
            field(ANN_ASSUME_TIME).and_then(|v| decode_u64(ANN_ASSUME_TIME, v, &mut errors));
        let allocated_containers = field(POD_ANN_ALLOCATED_CONTAINERS)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let decoded = PodGpuAnnotations {
            gpu_index,
            pod_mem,
            device_mem,
            assigned,
            assume_time_ns,
            allocated_containers,
        };
        (decoded, errors)
    }

    /// The annotations the extender writes at bind: IDX, POD, DEV, ASSIGNED=false, ASSUME_TIME.
    pub fn bind_patch(
        gpu_index: u32,
        pod_mem: GpuMem,
        device_mem: GpuMem,
        now_ns: u64,
    ) -> BTreeMap<String, String> {
        BTreeMap::from([
            (ANN_GPU_INDEX.to_string(), gpu_index.to_string()),
            (ANN_POD_MEM.to_string(), pod_mem.to_string()),
            (ANN_DEVICE_MEM.to_string(), device_mem.to_string()),
            (ANN_ASSIGNED.to_string(), "false".to_string()),
            (ANN_ASSUME_TIME.to_string(), now_ns.to_string()),
        ])
    }

    /// The annotations the device plugin writes after serving a container: the containers
    /// served so far, and — once `complete` — ASSIGNED=true with the allocation time.
    pub fn allocated_patch(
        containers: &[String],
        complete: bool,
        now_ns: u64,
    ) -> BTreeMap<String, String> {
        let mut patch = BTreeMap::from([(
            POD_ANN_ALLOCATED_CONTAINERS.to_string(),
            containers.join(","),
        )]);
        if complete {
            patch.insert(ANN_ASSIGNED.to_string(), "true".to_string());
            patch.insert(ANN_ASSUME_TIME.to_string(), now_ns.to_string());
        }
        patch
    }

    /// Whether the extender bound this pod and the device plugin has not finished with it.
    pub fn is_awaiting_allocation(&self) -> bool {
        self.assigned == Some(false) && self.gpu_index.is_some()
    }
}

/// `gpushare.io/reservation`: the node and GPU a bind promised the pod, and since when.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BindReservation {
    /// The node the Binding names.
    pub node: String,
    /// The GPU index on that node.
    pub gpu: u32,
    /// When the bind reserved it, Unix nanoseconds (informational: successors measure the
    /// settle window on their own clock).
    pub since: u64,
}

impl BindReservation {
    /// The annotation value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The reservation the annotations carry: `Ok(None)` when there is none, `Err` when the
    /// value is unreadable (read as absent by callers).
    pub fn decode(
        annotations: &BTreeMap<String, String>,
    ) -> Result<Option<BindReservation>, AnnotationError> {
        let Some(value) = annotations.get(POD_ANN_RESERVATION) else {
            return Ok(None);
        };
        match serde_json::from_str::<BindReservation>(value) {
            Ok(r) if !r.node.is_empty() => Ok(Some(r)),
            _ => Err(err(
                POD_ANN_RESERVATION,
                value,
                "expected {\"node\":\"<name>\",\"gpu\":<index>,\"since\":<unix ns>}",
            )),
        }
    }
}

/// Decodes `scheduler.framework.gpushare.allocation`:
/// `{"<containerIndex>":{"<gpuIndex>":<mem>,…},…}` into per-GPU totals.
pub fn decode_allocation_json(value: &str) -> Result<BTreeMap<u32, GpuMem>, AnnotationError> {
    let bad = |reason| err(ANN_ALLOCATION_JSON, value, reason);
    let parsed: BTreeMap<String, BTreeMap<String, serde_json::Value>> =
        serde_json::from_str(value).map_err(|_| bad("not a {container:{gpu:mem}} JSON object"))?;
    let mut per_gpu: BTreeMap<u32, GpuMem> = BTreeMap::new();
    for gpus in parsed.values() {
        for (gpu, mem) in gpus {
            let gpu: u32 = gpu.parse().map_err(|_| bad("GPU index is not a number"))?;
            let mem = mem
                .as_u64()
                .filter(|m| *m <= GpuMem::MAX_REQUEST.units())
                .ok_or_else(|| bad("memory is not a non-negative integer"))?;
            let slot = per_gpu.entry(gpu).or_default();
            *slot = slot.saturating_add(GpuMem::new(mem));
        }
    }
    Ok(per_gpu)
}

/// A memory amount, bounded like every other quantity (at most 2^40 units): another tool's
/// `18446744073709551615` is an error, not a GPU's worth of memory.
fn decode_mem(key: &'static str, value: &str, errors: &mut Vec<AnnotationError>) -> Option<GpuMem> {
    let units = decode_u64(key, value, errors)?;
    if units > GpuMem::MAX_REQUEST.units() {
        errors.push(err(key, value, "absurdly large (more than 2^40 units)"));
        return None;
    }
    Some(GpuMem::new(units))
}

fn decode_u64(key: &'static str, value: &str, errors: &mut Vec<AnnotationError>) -> Option<u64> {
    match value.trim().parse::<u64>() {
        Ok(v) => Some(v),
        Err(_) => {
            errors.push(err(key, value, "expected a non-negative decimal integer"));
            None
        }
    }
}

fn err(key: &'static str, value: &str, reason: &'static str) -> AnnotationError {
    let mut value = value.to_string();
    if value.len() > 64 {
        let mut cut = 64;
        while !value.is_char_boundary(cut) {
            cut -= 1;
        }
        value.truncate(cut);
    }
    AnnotationError { key, value, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn bind_patch_decodes_back() {
        let patch = PodGpuAnnotations::bind_patch(1, GpuMem::new(8138), GpuMem::new(16276), 42);
        assert_eq!(patch[ANN_GPU_INDEX], "1");
        assert_eq!(patch[ANN_ASSIGNED], "false");
        let (decoded, errors) = PodGpuAnnotations::decode(&patch);
        assert!(errors.is_empty());
        assert_eq!(decoded.gpu_index, Some(1));
        assert_eq!(decoded.pod_mem, Some(GpuMem::new(8138)));
        assert_eq!(decoded.device_mem, Some(GpuMem::new(16276)));
        assert_eq!(decoded.assume_time_ns, Some(42));
        assert!(decoded.is_awaiting_allocation());
    }

    #[test]
    fn reservations_round_trip_and_garbage_is_an_error() {
        let r = BindReservation {
            node: "n1".into(),
            gpu: 2,
            since: 42,
        };
        let ann = map(&[(POD_ANN_RESERVATION, &r.encode())]);
        assert_eq!(BindReservation::decode(&ann), Ok(Some(r)));
        assert_eq!(BindReservation::decode(&map(&[])), Ok(None));
        for bad in [
            "",
            "n1/0",
            r#"{"node":"","gpu":0,"since":1}"#,
            r#"{"node":"a","gpu":-1,"since":1}"#,
        ] {
            let e = BindReservation::decode(&map(&[(POD_ANN_RESERVATION, bad)]));
            assert!(e.is_err(), "{bad}");
        }
    }

    #[test]
    fn garbage_values_are_errors_not_panics() {
        let (decoded, errors) = PodGpuAnnotations::decode(&map(&[
            (ANN_GPU_INDEX, "-1"),
            (ANN_POD_MEM, "lots"),
            (ANN_ASSIGNED, "yes"),
            (ANN_ASSUME_TIME, "99999999999999999999999"),
            (ANN_DEVICE_MEM, "ü".repeat(100).as_str()),
        ]));
        assert_eq!(decoded, PodGpuAnnotations::default());
        assert_eq!(errors.len(), 5);
        assert!(errors.iter().all(|e| e.value.len() <= 64));
        let (decoded, errors) = PodGpuAnnotations::decode(&map(&[(ANN_GPU_INDEX, "4294967296")]));
        assert_eq!(decoded.gpu_index, None);
        assert_eq!(errors[0].reason, "GPU index out of range");
    }

    #[test]
    fn absurd_memory_values_are_bounded() {
        let (decoded, errors) = PodGpuAnnotations::decode(&map(&[
            (ANN_POD_MEM, "18446744073709551615"),
            (ANN_DEVICE_MEM, "1099511627777"),
        ]));
        assert_eq!((decoded.pod_mem, decoded.device_mem), (None, None));
        assert_eq!(errors.len(), 2);
        assert!(errors.iter().all(|e| e.reason.contains("absurdly large")));
        let (decoded, errors) = PodGpuAnnotations::decode(&map(&[(ANN_POD_MEM, "1099511627776")]));
        assert_eq!(decoded.pod_mem, Some(GpuMem::MAX_REQUEST));
        assert!(errors.is_empty());
    }

    #[test]
    fn allocated_patch_sets_assigned_only_when_complete() {
        let names = vec!["a".to_string(), "b".to_string()];
        let partial = PodGpuAnnotations::allocated_patch(&names[..1], false, 7);
        assert_eq!(partial.get(ANN_ASSIGNED), None);
        let full = PodGpuAnnotations::allocated_patch(&names, true, 7);
        assert_eq!(full[ANN_ASSIGNED], "true");
        assert_eq!(full[POD_ANN_ALLOCATED_CONTAINERS], "a,b");
        let (decoded, _) = PodGpuAnnotations::decode(&full);
        assert_eq!(decoded.allocated_containers, names);
    }

    #[test]
    fn allocation_json_sums_per_gpu() {
        let per_gpu = decode_allocation_json(r#"{"0":{"0":2,"1":3},"1":{"1":4}}"#).unwrap();
        assert_eq!(per_gpu[&0], GpuMem::new(2));
        assert_eq!(per_gpu[&1], GpuMem::new(7));
        assert!(decode_allocation_json("{").is_err());
        assert!(decode_allocation_json(r#"{"0":{"x":1}}"#).is_err());
        assert!(decode_allocation_json(r#"{"0":{"0":-1}}"#).is_err());
    }
}
