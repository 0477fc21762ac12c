//! Fuzzes the pod-annotation codec: `PodGpuAnnotations::decode` over arbitrary values of the
//! gpushare keys, `parse_quantity` and `decode_allocation_json` over arbitrary text. Any
//! panic is a bug (the codec reads values that anyone with pod-patch rights can write).

#![no_main]

use std::collections::BTreeMap;

use gpushare::core::annotations::{PodGpuAnnotations, decode_allocation_json};
use gpushare::core::request::parse_quantity;
use gpushare::core::wire::{
    ANN_ALLOCATION_JSON, ANN_ASSIGNED, ANN_ASSUME_TIME, ANN_DEVICE_MEM, ANN_GPU_INDEX, ANN_POD_MEM,
    POD_ANN_ALLOCATED_CONTAINERS,
};
use libfuzzer_sys::fuzz_target;

const KEYS: [&str; 7] = [
    ANN_GPU_INDEX,
    ANN_POD_MEM,
    ANN_DEVICE_MEM,
    ANN_ASSIGNED,
    ANN_ASSUME_TIME,
    ANN_ALLOCATION_JSON,
    POD_ANN_ALLOCATED_CONTAINERS,
];

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = parse_quantity(&text);
    let _ = decode_allocation_json(&text);
    // Split the input on NUL into values for the known keys, in order.
    let mut annotations = BTreeMap::new();
    for (key, value) in KEYS.iter().zip(text.split('\0')) {
        annotations.insert((*key).to_string(), value.to_string());
    }
    let (decoded, _errors) = PodGpuAnnotations::decode(&annotations);
    let _ = decoded.is_awaiting_allocation();
});
