//! The limit is the container's, across its processes: two share it, many racing for the
//! last bytes never pass it together, a process killed in the middle of an allocation gives
//! its memory and the lock back, and forked and exec'd processes are counted as what they
//! are. The node agent reads the same figures with the contract's reader.

use gpushare_limiter_contract::{GpuUuid, read_gpu};

use crate::support::*;

fn s(n: u64) -> String {
    n.to_string()
}

#[test]
fn two_processes_of_a_container_share_its_limit() {
    let c = Container::four_of_sixteen();
    let mut a = c.spawn(
        "dlsym-handle",
        &["ctx", "0", "alloc", &s(3 * GIB), "wait", "free", "wait"],
    );
    assert_eq!(
        a.until("waiting"),
        ["ctx 0 0".to_string(), format!("alloc {} 0", 3 * GIB)]
    );
    let b = c.probe(
        "linked",
        &["ctx", "0", "alloc", &s(2 * GIB), "alloc", &s(GIB), "info"],
    );
    assert_eq!(
        b[1..],
        [
            format!("alloc {} 2", 2 * GIB),
            format!("alloc {GIB} 0"),
            format!("info 0 0 {}", 4 * GIB)
        ]
    );
    // The node agent's view while A lives: A's 3 GiB (B is gone).
    let uuid = GpuUuid::parse(GPU0).expect("uuid");
    let usage = read_gpu(&c.state(), &uuid)
        .expect("reads")
        .expect("a ledger");
    assert_eq!(usage.used_bytes, 3 * GIB);
    assert_eq!(usage.limit_bytes, 4 * GIB);
    assert_eq!(usage.processes.len(), 1);
    assert_eq!(usage.processes[0].pid, a.child.id());
    // A frees: B's successor gets all 4 GiB.
    a.resume();
    assert_eq!(a.until("waiting"), ["resumed".to_string(), "free 0".into()]);
    let b = c.probe("linked", &["ctx", "0", "alloc", &s(4 * GIB)]);
    assert_eq!(b[1], format!("alloc {} 0", 4 * GIB));
    a.finish();
    let usage = read_gpu(&c.state(), &uuid)
        .expect("reads")
        .expect("a ledger");
    assert_eq!(usage.used_bytes, 0, "{usage:?}");
}

/// Starts `n` processes that each allocate `each` bytes at once (released together from a
/// `wait`) and then stay alive holding it; returns how many got the memory.
fn race(c: &Container, n: usize, each: u64) -> usize {
    let mut runs: Vec<Running> = (0..n)
        .map(|i| {
            let route = if i % 2 == 0 {
                "dlsym-handle"
            } else {
                "getproc2:12080"
            };
            // The driver takes 50 ms per allocation: without the container's lock the
            // processes would all be inside it, past the check, at once.
            Running::start(c.command("probe").env("FAKE_CUDA_ALLOC_MS", "50").args([
                route,
                "ctx",
                "0",
                "wait",
                "alloc",
                &s(each),
                "wait",
            ]))
        })
        .collect();
    for r in &mut runs {
        assert_eq!(r.until("waiting"), ["ctx 0 0".to_string()]);
    }
    for r in &mut runs {
        r.resume();
    }
    let mut granted = 0;
    for r in &mut runs {
        let got = r.until("waiting");
        match got.as_slice() {
            [go, alloc] if go == "resumed" && *alloc == format!("alloc {each} 0") => granted += 1,
            [go, alloc] if go == "resumed" && *alloc == format!("alloc {each} 2") => {}
            other => panic!("unexpected: {other:?}"),
        }
    }
    for r in runs {
        r.finish();
    }
    granted
}

#[test]
fn two_processes_racing_for_the_last_bytes_never_both_get_them() {
    let c = Container::four_of_sixteen();
    assert_eq!(race(&c, 2, 3 * GIB), 1);
}

#[test]
fn eight_processes_racing_get_exactly_the_limit() {
    let c = Container::four_of_sixteen();
    assert_eq!(race(&c, 8, GIB), 4);
}

#[test]
fn a_process_killed_in_the_middle_of_an_allocation_gives_everything_back() {
    let c = Container::four_of_sixteen();
    let mut victim = Running::start(
        c.command("probe")
            .env("FAKE_CUDA_BLOCK_BYTES", s(GIB))
            .args([
                "dlsym-handle",
                "ctx",
                "0",
                "alloc",
                &s(3 * GIB),
                "alloc",
                &s(GIB),
            ]),
    );
    // It holds 3 GiB and the GPU's lock, inside the driver's allocation.
    assert_eq!(
        victim.until("fake: blocked"),
        ["ctx 0 0".to_string(), format!("alloc {} 0", 3 * GIB)]
    );
    victim.child.kill().expect("SIGKILL");
    let status = victim.child.wait().expect("reaped");
    assert!(!status.success());
    let uuid = GpuUuid::parse(GPU0).expect("uuid");
    let usage = read_gpu(&c.state(), &uuid)
        .expect("reads")
        .expect("a ledger");
    assert_eq!(
        usage.used_bytes, 0,
        "a dead process holds nothing: {usage:?}"
    );
    // The lock went with it, and so did its 3 GiB.
    let out = c.probe("getproc2:12080", &["ctx", "0", "alloc", &s(4 * GIB)]);
    assert_eq!(out[1], format!("alloc {} 0", 4 * GIB));
}

#[test]
fn a_forked_child_has_its_own_share_of_the_container_s_limit() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "dlsym-handle",
        &[
            "ctx",
            "0",
            "alloc",
            &s(3 * GIB),
            "fork-child",
            "alloc",
            &s(GIB),
            "alloc",
            "1",
            ";",
            // The child's gigabyte went with it.
            "alloc",
            &s(GIB),
            "alloc",
            "1",
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("alloc {} 0", 3 * GIB),
            format!("alloc {GIB} 0"),
            "alloc 1 2".into(),
            "child-exited 0".into(),
            format!("alloc {GIB} 0"),
            "alloc 1 2".into(),
        ]
    );
}

#[test]
fn a_parent_s_memory_is_reclaimed_while_its_forked_child_lives_on() {
    let c = Container::four_of_sixteen();
    // The child inherits the parent's descriptors; it must not keep the parent's slot alive.
    let out = c.probe(
        "dlsym-handle",
        &[
            "ctx",
            "0",
            "alloc",
            &s(3 * GIB),
            "fork-parent-exits",
            "alloc",
            &s(4 * GIB),
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("alloc {} 0", 3 * GIB),
            "parent-exits".into(),
            "parent-gone".into(),
            format!("alloc {} 0", 4 * GIB),
        ]
    );
}

#[test]
fn an_exec_d_program_starts_with_nothing_held() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "dlsym-handle",
        &[
            "ctx",
            "0",
            "alloc",
            &s(3 * GIB),
            "exec",
            "ctx",
            "0",
            "alloc",
            &s(4 * GIB),
            "alloc",
            "1",
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("alloc {} 0", 3 * GIB),
            "ctx 0 0".into(),
            format!("alloc {} 0", 4 * GIB),
            "alloc 1 2".into(),
        ]
    );
}
