//! What a container sees of its GPU: `cuMemGetInfo_v2`, `cuDeviceTotalMem_v2` and NVML's
//! memory info (as `nvidia-smi` and pynvml read it) show the limit as the total and the
//! container's use, whichever of its processes holds it.

use crate::support::*;

fn s(n: u64) -> String {
    n.to_string()
}

#[test]
fn the_driver_api_shows_the_limit_and_what_is_left_of_it() {
    let c = Container::four_of_sixteen();
    for route in ["linked", "dlsym-handle", "getproc:11030", "getproc2:13000"] {
        let out = c.probe(
            route,
            &["ctx", "0", "info", "total", "0", "alloc", &s(GIB), "info"],
        );
        assert_eq!(
            out[1..],
            [
                format!("info 0 {} {}", 4 * GIB, 4 * GIB),
                format!("total 0 {}", 4 * GIB),
                format!("alloc {GIB} 0"),
                format!("info 0 {} {}", 3 * GIB, 4 * GIB),
            ],
            "route {route}"
        );
    }
}

#[test]
fn nvml_shows_the_container_s_use_as_nvidia_smi_reads_it() {
    let c = Container::four_of_sixteen();
    let mut holder = c.spawn("dlsym-handle", &["ctx", "0", "alloc", &s(GIB), "wait"]);
    holder.until("waiting");
    // nvidia-smi and pynvml: dlopen + dlsym; the program's own process holds nothing.
    for route in ["dlsym-handle", "linked"] {
        let out = c.probe(route, &["nvml", "0", "nvml2", "0", "ctx", "0", "info"]);
        assert_eq!(
            out,
            [
                format!("nvml 0 {} {} {GIB}", 4 * GIB, 3 * GIB),
                format!("nvml2 0 {} {} {GIB} 0", 4 * GIB, 3 * GIB),
                "ctx 0 0".into(),
                format!("info 0 {} {}", 3 * GIB, 4 * GIB),
            ],
            "route {route}"
        );
    }
    holder.finish();
    let out = c.probe("dlsym-handle", &["nvml", "0"]);
    assert_eq!(out, [format!("nvml 0 {} {} 0", 4 * GIB, 4 * GIB)]);
}

#[test]
fn a_limit_above_the_gpu_s_size_shows_the_gpu() {
    let c = Container::new(&[(GPU0, 16 * GIB)], &[(GPU0, 64 * GIB)]);
    let out = c.probe("linked", &["ctx", "0", "info", "nvml", "0"]);
    assert_eq!(
        out[1..],
        [
            format!("info 0 {} {}", 16 * GIB, 16 * GIB),
            format!("nvml 0 {} {} 0", 16 * GIB, 16 * GIB),
        ]
    );
}
