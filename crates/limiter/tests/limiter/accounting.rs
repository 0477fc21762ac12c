//! What counts against the limit, in one process: every kind of allocation, exactly at the
//! limit and one byte past it, what frees give back, and the modes (no limits file, a broken
//! one, a GPU the file does not name).

use crate::support::*;

fn s(n: u64) -> String {
    n.to_string()
}

#[test]
fn exactly_the_limit_fits_and_one_byte_more_does_not() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "dlsym-handle",
        &["ctx", "0", "alloc", &s(4 * GIB), "truth", "0"],
    );
    assert_eq!(out[1], format!("alloc {} 0", 4 * GIB));
    assert_eq!(out[2], format!("truth {}", 4 * GIB));
    let out = c.probe(
        "dlsym-handle",
        &["ctx", "0", "alloc", &s(4 * GIB + 1), "truth", "0"],
    );
    assert_eq!(out[1], format!("alloc {} 2", 4 * GIB + 1));
    assert_eq!(
        out[2], "truth 0",
        "the refused allocation never reached the driver"
    );
    // The first process's 4 GiB died with it.
    let out = c.probe(
        "dlsym-handle",
        &[
            "ctx",
            "0",
            "alloc",
            &s(GIB),
            "alloc",
            &s(3 * GIB),
            "alloc",
            "1",
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("alloc {GIB} 0"),
            format!("alloc {} 0", 3 * GIB),
            "alloc 1 2".into()
        ]
    );
}

#[test]
fn managed_memory_counts_in_full() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "dlsym-handle",
        &[
            "ctx",
            "0",
            "managed",
            &s(3 * GIB),
            "alloc",
            &s(GIB + 1),
            "free",
            "alloc",
            &s(GIB),
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("managed {} 0", 3 * GIB),
            format!("alloc {} 2", GIB + 1),
            "free 0".into(),
            format!("alloc {GIB} 0"),
        ]
    );
}

#[test]
fn a_pitched_allocation_counts_its_pitch_and_is_undone_when_the_pitch_does_not_fit() {
    // The fake pitches rows to 512 bytes.
    let c = Container::new(&[(GPU0, 16 * GIB)], &[(GPU0, 4_000_000_000)]);
    // 3000 x 1,000,000 is 3.0e9 by width and 3.072e9 by pitch: the pitch is what counts.
    let out = c.probe(
        "linked",
        &[
            "ctx",
            "0",
            "pitch",
            "3000",
            "1000000",
            "alloc",
            "950000000",
            "alloc",
            "800000000",
            "truth",
            "0",
        ],
    );
    assert_eq!(out[1], "pitch 3000 1000000 0 3072");
    // 3.072e9 + 9.5e8 > 4e9: refused, though 3e9 (by width) + 9.5e8 would fit.
    assert_eq!(out[2], "alloc 950000000 2");
    assert_eq!(out[3], "alloc 800000000 0");
    assert_eq!(out[4], "truth 3872000000");
    // 1,333,333,000 x 3 fits by width (3,999,999,000) but its pitch of 1,333,333,504 does
    // not (4,000,000,512): refused, and what the driver allocated is given back.
    let out = c.probe(
        "linked",
        &["ctx", "0", "pitch", "1333333000", "3", "truth", "0"],
    );
    assert!(out[1].starts_with("pitch 1333333000 3 2 "), "{out:?}");
    assert_eq!(out[2], "truth 0");
}

#[test]
fn arrays_count_the_size_the_driver_gives_them() {
    let c = Container::four_of_sixteen();
    // 1000 x 1000 (and 100 x 100 x 100) floats: 4,000,000 bytes, which the fake driver
    // rounds up to 4,063,232.
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "array",
            "1000",
            "1000",
            "info",
            "array3d",
            "100",
            "100",
            "100",
            "info",
            "array-destroy",
            "array-destroy",
            "info",
        ],
    );
    let limit = 4 * GIB;
    assert_eq!(out[1], "array 0");
    assert_eq!(out[2], format!("info 0 {} {limit}", limit - 4_063_232));
    assert_eq!(out[3], "array3d 0");
    assert_eq!(out[4], format!("info 0 {} {limit}", limit - 2 * 4_063_232));
    assert_eq!(out[7], format!("info 0 {limit} {limit}"));
    // An array larger than what is left is refused.
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "alloc",
            &s(4 * GIB - 1_000_000),
            "array",
            "1000",
            "1000",
        ],
    );
    assert_eq!(out[2], "array 2");
}

#[test]
fn a_vmm_handle_counts_until_released_and_unmapped() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "vmm",
            &s(2 * GIB),
            "map",
            "release", // released but still mapped: still held
            "vmm",
            &s(3 * GIB),
            "unmap", // now the driver frees it
            "vmm",
            &s(3 * GIB),
            "truth",
            "0",
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("vmm {} 0", 2 * GIB),
            "map 0".into(),
            "release 0".into(),
            format!("vmm {} 2", 3 * GIB),
            "unmap 0".into(),
            format!("vmm {} 0", 3 * GIB),
            format!("truth {}", 3 * GIB),
        ]
    );
}

#[test]
fn a_retained_handle_counts_until_its_last_reference_goes() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "linked",
        &[
            "ctx",
            "0",
            "vmm",
            &s(3 * GIB),
            "map",
            "retain",
            "unmap",
            "release",
            "alloc",
            &s(2 * GIB), // one reference left: still held
            "release-retained",
            "alloc",
            &s(2 * GIB),
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("vmm {} 0", 3 * GIB),
            "map 0".into(),
            "retain 0".into(),
            "unmap 0".into(),
            "release 0".into(),
            format!("alloc {} 2", 2 * GIB),
            "release-retained 0".into(),
            format!("alloc {} 0", 2 * GIB),
        ]
    );
}

#[test]
fn host_and_numa_vmm_memory_does_not_count() {
    let c = Container::four_of_sixteen();
    // NCCL's host-NUMA buffers are not the GPU's.
    let out = c.probe(
        "dlsym-default",
        &["ctx", "0", "vmm", &s(8 * GIB), "host", "alloc", &s(4 * GIB)],
    );
    assert_eq!(
        out[1..],
        [format!("vmm {} 0", 8 * GIB), format!("alloc {} 0", 4 * GIB)]
    );
}

#[test]
fn stream_ordered_allocations_count_what_their_pool_holds() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "getproc2:12080",
        &["ctx", "0", "async", &s(4 * GIB), "async", "1"],
    );
    assert_eq!(
        out[1..],
        [format!("async {} 0", 4 * GIB), "async 1 2".into()]
    );

    // Freed memory stays in the pool's cache and is reused without growing it.
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "async",
            &s(3 * GIB),
            "free-async",
            "async",
            &s(3 * GIB),
            "free-async",
            "truth",
            "0",
        ],
    );
    assert_eq!(
        out[1..5],
        [
            format!("async {} 0", 3 * GIB),
            "free-async 0".into(),
            format!("async {} 0", 3 * GIB),
            "free-async 0".into()
        ]
    );
    assert_eq!(
        out[5],
        format!("truth {}", 3 * GIB),
        "the pool still holds it"
    );

    // The cache counts (it is the GPU's memory), and is trimmed before a refusal.
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "async",
            &s(3 * GIB),
            "free-async",
            "alloc",
            &s(2 * GIB),
            "truth",
            "0",
        ],
    );
    assert_eq!(out[3], format!("alloc {} 0", 2 * GIB));
    assert_eq!(out[4], format!("truth {}", 2 * GIB));
    assert!(
        c.calls().contains(&"cuMemPoolTrimTo 0".to_string()),
        "{:?}",
        c.calls()
    );

    // A pointer of a pool freed with cuMemFree gives it back too.
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "async",
            &s(3 * GIB),
            "free-async-sync",
            "alloc",
            &s(4 * GIB),
        ],
    );
    assert_eq!(
        out[1..],
        [
            format!("async {} 0", 3 * GIB),
            "free-async-sync 0".into(),
            format!("alloc {} 0", 4 * GIB)
        ]
    );
}

#[test]
fn an_explicit_pool_counts_until_trimmed_or_destroyed() {
    let c = Container::four_of_sixteen();
    let out = c.probe(
        "dlsym-handle",
        &[
            "ctx",
            "0",
            "stream",
            "pool-create",
            "0",
            "pool-alloc",
            &s(3 * GIB),
            "alloc",
            &s(2 * GIB), // the pool holds 3 GiB in use: refused
            "free-async",
            "pool-destroy",
            "alloc",
            &s(4 * GIB),
        ],
    );
    assert_eq!(
        out[1..],
        [
            "stream 0".to_string(),
            "pool-create 0".into(),
            format!("pool-alloc {} 0", 3 * GIB),
            format!("alloc {} 2", 2 * GIB),
            "free-async 0".into(),
            "pool-destroy 0".into(),
            format!("alloc {} 0", 4 * GIB),
        ]
    );
}

#[test]
fn allocations_captured_into_a_graph_are_not_counted_at_capture() {
    let c = Container::four_of_sixteen();
    // Two 3 GiB allocations captured: graph memory nodes, not memory yet.
    let out = c.probe(
        "getproc2:12080",
        &[
            "ctx",
            "0",
            "stream",
            "capture-begin",
            "async",
            &s(3 * GIB),
            "async",
            &s(3 * GIB),
            "capture-end",
            "alloc",
            &s(4 * GIB),
        ],
    );
    assert_eq!(
        out[1..],
        [
            "stream 0".to_string(),
            "capture-begin 0".into(),
            format!("async {} 0", 3 * GIB),
            format!("async {} 0", 3 * GIB),
            "capture-end 0".into(),
            format!("alloc {} 0", 4 * GIB),
        ]
    );
}

#[test]
fn each_gpu_has_its_own_limit() {
    let c = Container::new(
        &[(GPU0, 16 * GIB), (GPU1, 16 * GIB)],
        &[(GPU0, 4 * GIB), (GPU1, 8 * GIB)],
    );
    let out = c.probe(
        "linked",
        &[
            "ctx",
            "1",
            "alloc",
            &s(8 * GIB),
            "alloc",
            "1",
            "ctx",
            "0",
            "alloc",
            &s(4 * GIB),
            "alloc",
            "1",
        ],
    );
    assert_eq!(
        out,
        [
            "ctx 1 0".to_string(),
            format!("alloc {} 0", 8 * GIB),
            "alloc 1 2".into(),
            "ctx 0 0".into(),
            format!("alloc {} 0", 4 * GIB),
            "alloc 1 2".into(),
        ]
    );
}

#[test]
fn a_gpu_the_limits_file_does_not_name_gets_no_memory() {
    let c = Container::new(&[(GPU0, 16 * GIB), (GPU1, 16 * GIB)], &[(GPU0, 4 * GIB)]);
    let mut cmd = c.command("probe");
    cmd.args(["dlsym-handle", "ctx", "1", "alloc", "1", "info"]);
    let out = cmd.output().expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout, "ctx 1 0\nalloc 1 2\ninfo 0 0 0\n");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("{GPU1} is not in the limits file")),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_broken_limits_file_refuses_every_allocation() {
    let c = Container::four_of_sixteen();
    std::fs::write(
        c.root.path().join("limits"),
        "gpushare-limiter-limits 1\nGPU-nonsense 12\n",
    )
    .expect("write");
    let out = c
        .command("probe")
        .args([
            "dlsym-handle",
            "ctx",
            "0",
            "alloc",
            "1",
            "vmm",
            "1",
            "async",
            "1",
            "info",
        ])
        .output()
        .expect("runs");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ctx 0 0\nalloc 1 2\nvmm 1 2\nasync 1 2\ninfo 0 0 0\n"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("is not valid") && stderr.contains("refused"),
        "{stderr}"
    );
}

#[test]
fn without_a_limits_file_nothing_is_limited() {
    let c = Container::four_of_sixteen();
    let out = run_to_end(
        c.command("probe")
            .env_remove("GPUSHARE_LIMITER_ROOT")
            .args(["dlsym-handle", "ctx", "0", "alloc", &s(16 * GIB), "info"]),
    );
    assert_eq!(
        out,
        [
            "ctx 0 0".to_string(),
            format!("alloc {} 0", 16 * GIB),
            format!("info 0 0 {}", 16 * GIB)
        ]
    );
    assert_eq!(
        std::fs::read_dir(c.state()).expect("state").count(),
        0,
        "nothing written"
    );
}
