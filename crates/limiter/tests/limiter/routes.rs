//! Every way a program reaches the driver's entry points leads to the limiter's hooks, and
//! to the hook of the exact versioned entry point the driver chose; everything else is
//! answered as if the limiter were not there.

use crate::support::*;

/// Every route the tests know, with the version each asks `cuGetProcAddress` for.
const ROUTES: &[&str] = &[
    "linked",
    "dlsym-default",
    "dlsym-next",
    "interposer-next",
    "dlsym-handle",
    "getproc:11030",
    "getproc:12000",
    "getproc2:12000",
    "getproc2:12080",
    "getproc2:13000",
    "getproc2-ptsz:12080",
    "getproc-chain:11030",
    "getproc-chain:12080",
];

#[test]
fn past_the_limit_every_route_gets_out_of_memory() {
    let c = Container::four_of_sixteen();
    let four = (4 * GIB).to_string();
    for route in ROUTES {
        let out = c.probe(
            route,
            &[
                "which",
                "cuMemAlloc",
                "ctx",
                "0",
                "alloc",
                &four,
                "alloc",
                "1",
                "free",
                "alloc",
                "1",
                "free",
            ],
        );
        assert_eq!(
            out,
            vec![
                "which cuMemAlloc libgpushare_limiter.so cuMemAlloc_v2".to_string(),
                "ctx 0 0".into(),
                format!("alloc {four} 0"),
                "alloc 1 2".into(),
                "free 0".into(),
                "alloc 1 0".into(),
                "free 0".into(),
            ],
            "route {route}"
        );
    }
    // Refused allocations never reached the driver.
    let calls = c.calls();
    let allocs_of_one = calls.iter().filter(|l| *l == "cuMemAlloc_v2 1").count();
    assert_eq!(allocs_of_one, ROUTES.len(), "{calls:?}");
}

#[test]
fn each_versioned_entry_point_routes_to_its_own_hook() {
    let c = Container::four_of_sixteen();
    let cases: &[(&str, &str, &str)] = &[
        // (route, family, what it resolves to)
        (
            "getproc2:12080",
            "cuMemAllocAsync",
            "libgpushare_limiter.so cuMemAllocAsync",
        ),
        (
            "getproc2-ptsz:12080",
            "cuMemAllocAsync",
            "libgpushare_limiter.so cuMemAllocAsync_ptsz",
        ),
        (
            "getproc2-ptsz:12080",
            "cuMemFreeAsync",
            "libgpushare_limiter.so cuMemFreeAsync_ptsz",
        ),
        (
            "getproc2-ptsz:12080",
            "cuMemAllocFromPoolAsync",
            "libgpushare_limiter.so cuMemAllocFromPoolAsync_ptsz",
        ),
        (
            "dlsym-handle+ptsz",
            "cuMemAllocAsync",
            "libgpushare_limiter.so cuMemAllocAsync_ptsz",
        ),
        (
            "getproc:12000",
            "cuMemGetInfo",
            "libgpushare_limiter.so cuMemGetInfo_v2",
        ),
        (
            "getproc:12000",
            "cuArray3DCreate",
            "libgpushare_limiter.so cuArray3DCreate_v2",
        ),
        (
            "getproc2:13000",
            "cuMemCreate",
            "libgpushare_limiter.so cuMemCreate",
        ),
        (
            "getproc2:12000",
            "cuGetProcAddress",
            "libgpushare_limiter.so cuGetProcAddress_v2",
        ),
        (
            "getproc:11030",
            "cuGetProcAddress",
            "libgpushare_limiter.so cuGetProcAddress",
        ),
        (
            "dlsym-handle",
            "nvmlDeviceGetMemoryInfo",
            "libgpushare_limiter.so nvmlDeviceGetMemoryInfo",
        ),
        // Not hooked: the driver's own, whatever version it picked.
        (
            "getproc2:13000",
            "cuCtxCreate",
            "libcuda.so.1 cuCtxCreate_v4",
        ),
        (
            "getproc2:12000",
            "cuCtxCreate",
            "libcuda.so.1 cuCtxCreate_v3",
        ),
        (
            "getproc:11030",
            "cuCtxCreate",
            "libcuda.so.1 cuCtxCreate_v2",
        ),
        ("dlsym-handle", "cuInit", "libcuda.so.1 cuInit"),
        (
            "dlsym-default",
            "cuStreamCreate",
            "libcuda.so.1 cuStreamCreate",
        ),
        // CUDA 3.1's 32-bit cuMemAlloc is not hooked (documented).
        (
            "getproc:11030",
            "cuMemAlloc",
            "libgpushare_limiter.so cuMemAlloc_v2",
        ),
    ];
    for (route, family, expected) in cases {
        let out = c.probe(route, &["which", family]);
        assert_eq!(
            out,
            vec![format!("which {family} {expected}")],
            "route {route}"
        );
    }
    let old = c.probe("getproc2:3010", &["which", "cuMemAlloc"]);
    assert_eq!(
        old,
        vec!["which cuMemAlloc libcuda.so.1 cuMemAlloc".to_string()]
    );
}

#[test]
fn a_per_thread_stream_allocation_calls_the_per_thread_entry_point() {
    let c = Container::four_of_sixteen();
    let four = (4 * GIB).to_string();
    let out = c.probe(
        "getproc2-ptsz:12080",
        &["ctx", "0", "async", &four, "async", "1", "free-async"],
    );
    assert_eq!(
        out,
        vec![
            "ctx 0 0".to_string(),
            format!("async {four} 0"),
            "async 1 2".into(),
            "free-async 0".into()
        ]
    );
    let calls = c.calls();
    assert!(
        calls.contains(&format!("cuMemAllocAsync_ptsz {four}")),
        "{calls:?}"
    );
    assert!(
        calls.contains(&"cuMemFreeAsync_ptsz".to_string()),
        "{calls:?}"
    );
    assert!(
        !calls.iter().any(|l| l.starts_with("cuMemAllocAsync ")),
        "{calls:?}"
    );
}

#[test]
fn a_wrapper_looking_up_the_next_definition_of_another_name_finds_it() {
    let built = built();
    // Without the limiter: the wrapper finds libc's getppid.
    let plain = run_to_end(&mut std::process::Command::new(built.join("wrapcheck")));
    let mut with = std::process::Command::new(built.join("wrapcheck"));
    with.env("LD_PRELOAD", library());
    let out = with.output().expect("runs");
    assert_eq!(
        out.status.code(),
        Some(0),
        "42 means dlsym(RTLD_NEXT) from the wrapper found the wrapper itself: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    assert!(plain[0].starts_with("ppid "), "{plain:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        plain[0],
        "same parent, same answer"
    );
}
