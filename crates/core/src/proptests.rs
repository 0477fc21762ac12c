//! Property tests of the core: no sequence of binds, replays, removals and health changes
//! over-commits a GPU, and a ledger rebuilt from pod annotations equals the incremental one.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::annotations::PodGpuAnnotations;
use super::ledger::{GpuSpec, LedgerPod, NodeLedger, PodState};
use super::memory::GpuMem;
use super::placement::{GpuPolicy, check_fit, choose_gpu};

#[derive(Clone, Debug)]
enum Op {
    Bind { key: u8, mem: u64, spread: bool },
    Replay { key: u8 },
    Remove { key: u8 },
    Health { gpu: u8, healthy: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..40, 1u64..20, any::<bool>()).prop_map(|(key, mem, spread)| Op::Bind { key, mem, spread }),
        1 => (0u8..40).prop_map(|key| Op::Replay { key }),
        2 => (0u8..40).prop_map(|key| Op::Remove { key }),
        1 => (0u8..8, any::<bool>()).prop_map(|(gpu, healthy)| Op::Health { gpu, healthy }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_sequence_of_operations_overcommits_a_gpu(
        totals in proptest::collection::vec(1u64..32, 1..8),
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let specs: Vec<GpuSpec> =
            totals.iter().map(|t| GpuSpec { total: GpuMem::new(*t), healthy: true }).collect();
        let mut ledger: NodeLedger<u8> = NodeLedger::new(&specs);
        // What the API server would hold: annotations of the pods that are bound and alive.
        let mut annotations: BTreeMap<u8, BTreeMap<String, String>> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Bind { key, mem, spread } => {
                    if ledger.pod(&key).is_some() {
                        continue; // a bound pod is never bound again
                    }
                    let policy = if spread { GpuPolicy::Spread } else { GpuPolicy::Binpack };
                    if let Ok(gpu) = choose_gpu(&ledger, GpuMem::new(mem), policy) {
                        let total = ledger.gpus()[gpu as usize].total;
                        ledger.apply_pod(key, LedgerPod { gpu, mem: GpuMem::new(mem), state: PodState::Assumed });
                        annotations.insert(key, PodGpuAnnotations::bind_patch(gpu, GpuMem::new(mem), total, 1));
                    }
                }
                Op::Replay { key } => {
                    if let Some(p) = ledger.pod(&key).copied() {
                        ledger.apply_pod(key, p);
                    }
                }
                Op::Remove { key } => {
                    ledger.remove_pod(&key);
                    annotations.remove(&key);
                }
                Op::Health { gpu, healthy } => ledger.set_health(u32::from(gpu), healthy),
            }
            for slot in ledger.gpus() {
                prop_assert!(slot.used <= slot.total, "over-committed: {:?}", slot);
            }
            // Filter's early-exit check agrees with the full choice, whatever the request.
            for mem in [0u64, 1, 4, 16, 31] {
                let request = GpuMem::new(mem);
                prop_assert_eq!(
                    check_fit(&ledger, request),
                    choose_gpu(&ledger, request, GpuPolicy::Binpack).map(|_| ())
                );
            }
        }
        // Rebuild from annotations alone, as an extender does at start.
        let mut rebuilt: NodeLedger<u8> = NodeLedger::new(&specs);
        for (i, slot) in ledger.gpus().iter().enumerate() {
            rebuilt.set_health(i as u32, slot.healthy);
        }
        for (key, ann) in &annotations {
            let (decoded, errors) = PodGpuAnnotations::decode(ann);
            prop_assert!(errors.is_empty());
            let (Some(gpu), Some(mem)) = (decoded.gpu_index, decoded.pod_mem) else {
                return Err(TestCaseError::fail("bind annotations lost a field"));
            };
            rebuilt.apply_pod(*key, LedgerPod { gpu, mem, state: PodState::Assumed });
        }
        prop_assert_eq!(rebuilt, ledger);
    }

    #[test]
    fn annotation_decoding_never_panics(
        entries in proptest::collection::btree_map("[A-Z_a-z./-]{0,40}", ".{0,80}", 0..10),
        idx in ".{0,30}", pod in ".{0,30}",
    ) {
        let mut map = entries;
        map.insert(super::wire::ANN_GPU_INDEX.to_string(), idx);
        map.insert(super::wire::ANN_POD_MEM.to_string(), pod);
        let _ = PodGpuAnnotations::decode(&map);
    }

    #[test]
    fn quantity_parsing_never_panics(s in ".{0,40}") {
        let _ = super::request::parse_quantity(&s);
    }
}
