//! Every driver and NVML entry point the limiter knows by name: the ones it hooks (each with
//! the exported function that replaces it) and the ones it only calls. One table, so the
//! version script, the `dlsym` routing, the `cuGetProcAddress` routing and the tests agree.

use core::ffi::{CStr, c_void};

use crate::{cuda_hooks, nvml_hooks};

/// Which library an entry point lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// `libcuda.so.1`.
    Cuda,
    /// `libnvidia-ml.so.1`.
    Nvml,
}

/// An entry point: its exact (versioned) name and, when hooked, the address of its hook.
pub struct Symbol {
    /// The exact exported name, e.g. `cuMemAllocAsync_ptsz`.
    pub name: &'static CStr,
    /// Its library.
    pub library: Library,
    /// The limiter's replacement, with the same signature; `None` for entry points the
    /// limiter only calls.
    pub hook: Option<fn() -> *mut c_void>,
}

macro_rules! hooked {
    ($lib:ident, $module:ident :: $name:ident) => {
        Symbol {
            name: {
                // The C string of the hook's own name: the name and the hook cannot disagree.
                const NAME: &CStr =
                    match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                        Ok(n) => n,
                        Err(_) => panic!("a symbol name with a NUL"),
                    };
                NAME
            },
            library: Library::$lib,
            hook: Some(|| $module::$name as *mut c_void),
        }
    };
}

macro_rules! called {
    ($lib:ident, $name:literal) => {
        Symbol {
            name: $name,
            library: Library::$lib,
            hook: None,
        }
    };
}

/// Indices into [`SYMBOLS`], in its order; each variant is named after its entry point.
#[allow(non_camel_case_types, missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Sym {
    cuGetProcAddress,
    cuGetProcAddress_v2,
    cuMemAlloc_v2,
    cuMemAllocPitch_v2,
    cuMemAllocManaged,
    cuMemFree_v2,
    cuMemAllocAsync,
    cuMemAllocAsync_ptsz,
    cuMemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz,
    cuMemFreeAsync,
    cuMemFreeAsync_ptsz,
    cuMemPoolCreate,
    cuMemPoolDestroy,
    cuMemCreate,
    cuMemRelease,
    cuMemMap,
    cuMemUnmap,
    cuMemRetainAllocationHandle,
    cuArrayCreate_v2,
    cuArray3DCreate_v2,
    cuArrayDestroy,
    cuMemGetInfo_v2,
    cuDeviceTotalMem_v2,
    nvmlDeviceGetMemoryInfo,
    nvmlDeviceGetMemoryInfo_v2,
    // Called, not hooked.
    cuCtxGetDevice,
    cuDeviceGetUuid,
    cuDeviceGetUuid_v2,
    cuStreamGetDevice,
    cuStreamGetDevice_ptsz,
    cuStreamIsCapturing,
    cuStreamIsCapturing_ptsz,
    cuDeviceGetMemPool,
    cuMemPoolGetAttribute,
    cuMemPoolTrimTo,
    cuArrayGetMemoryRequirements,
    nvmlDeviceGetUUID,
}

/// The number of entries of [`SYMBOLS`].
pub const COUNT: usize = Sym::nvmlDeviceGetUUID as usize + 1;

/// Every entry point, indexed by [`Sym`].
pub static SYMBOLS: [Symbol; COUNT] = [
    hooked!(Cuda, cuda_hooks::cuGetProcAddress),
    hooked!(Cuda, cuda_hooks::cuGetProcAddress_v2),
    hooked!(Cuda, cuda_hooks::cuMemAlloc_v2),
    hooked!(Cuda, cuda_hooks::cuMemAllocPitch_v2),
    hooked!(Cuda, cuda_hooks::cuMemAllocManaged),
    hooked!(Cuda, cuda_hooks::cuMemFree_v2),
    hooked!(Cuda, cuda_hooks::cuMemAllocAsync),
    hooked!(Cuda, cuda_hooks::cuMemAllocAsync_ptsz),
    hooked!(Cuda, cuda_hooks::cuMemAllocFromPoolAsync),
    hooked!(Cuda, cuda_hooks::cuMemAllocFromPoolAsync_ptsz),
    hooked!(Cuda, cuda_hooks::cuMemFreeAsync),
    hooked!(Cuda, cuda_hooks::cuMemFreeAsync_ptsz),
    hooked!(Cuda, cuda_hooks::cuMemPoolCreate),
    hooked!(Cuda, cuda_hooks::cuMemPoolDestroy),
    hooked!(Cuda, cuda_hooks::cuMemCreate),
    hooked!(Cuda, cuda_hooks::cuMemRelease),
    hooked!(Cuda, cuda_hooks::cuMemMap),
    hooked!(Cuda, cuda_hooks::cuMemUnmap),
    hooked!(Cuda, cuda_hooks::cuMemRetainAllocationHandle),
    hooked!(Cuda, cuda_hooks::cuArrayCreate_v2),
    hooked!(Cuda, cuda_hooks::cuArray3DCreate_v2),
    hooked!(Cuda, cuda_hooks::cuArrayDestroy),
    hooked!(Cuda, cuda_hooks::cuMemGetInfo_v2),
    hooked!(Cuda, cuda_hooks::cuDeviceTotalMem_v2),
    hooked!(Nvml, nvml_hooks::nvmlDeviceGetMemoryInfo),
    hooked!(Nvml, nvml_hooks::nvmlDeviceGetMemoryInfo_v2),
    called!(Cuda, c"cuCtxGetDevice"),
    called!(Cuda, c"cuDeviceGetUuid"),
    called!(Cuda, c"cuDeviceGetUuid_v2"),
    called!(Cuda, c"cuStreamGetDevice"),
    called!(Cuda, c"cuStreamGetDevice_ptsz"),
    called!(Cuda, c"cuStreamIsCapturing"),
    called!(Cuda, c"cuStreamIsCapturing_ptsz"),
    called!(Cuda, c"cuDeviceGetMemPool"),
    called!(Cuda, c"cuMemPoolGetAttribute"),
    called!(Cuda, c"cuMemPoolTrimTo"),
    called!(Cuda, c"cuArrayGetMemoryRequirements"),
    called!(Nvml, c"nvmlDeviceGetUUID"),
];

/// The hooked entry point named exactly `name`, if any.
pub fn hooked_by_name(name: &[u8]) -> Option<usize> {
    // Cheap refusal first: dlsym sees every symbol lookup of the process.
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return None;
    }
    SYMBOLS
        .iter()
        .position(|s| s.hook.is_some() && s.name.to_bytes() == name)
}

/// The family of a CUDA entry point's name: without a `_ptsz`/`_ptds` suffix and without a
/// `_v<N>` version (`cuMemAllocAsync_ptsz` → `cuMemAllocAsync`, `cuMemAlloc_v2` →
/// `cuMemAlloc`). `cuGetProcAddress` is asked for a family and picks the member.
pub fn family(name: &[u8]) -> &[u8] {
    let name = name
        .strip_suffix(b"_ptsz")
        .or_else(|| name.strip_suffix(b"_ptds"))
        .unwrap_or(name);
    let digits = name.iter().rev().take_while(|b| b.is_ascii_digit()).count();
    if digits > 0
        && let Some(base) = name
            .get(..name.len() - digits)
            .and_then(|head| head.strip_suffix(b"_v"))
    {
        return base;
    }
    name
}

#[cfg(test)]
#[allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;

    #[test]
    fn the_index_enum_follows_the_table() {
        assert_eq!(
            SYMBOLS[Sym::cuMemAllocAsync_ptsz as usize].name,
            c"cuMemAllocAsync_ptsz"
        );
        assert_eq!(
            SYMBOLS[Sym::nvmlDeviceGetMemoryInfo_v2 as usize].name,
            c"nvmlDeviceGetMemoryInfo_v2"
        );
        assert_eq!(
            SYMBOLS[Sym::cuCtxGetDevice as usize].name,
            c"cuCtxGetDevice"
        );
        assert_eq!(SYMBOLS[COUNT - 1].name, c"nvmlDeviceGetUUID");
        assert!(
            SYMBOLS[..Sym::cuCtxGetDevice as usize]
                .iter()
                .all(|s| s.hook.is_some())
        );
        assert!(
            SYMBOLS[Sym::cuCtxGetDevice as usize..]
                .iter()
                .all(|s| s.hook.is_none())
        );
    }

    #[test]
    fn families_drop_versions_and_stream_suffixes() {
        for (name, fam) in [
            (&b"cuMemAlloc_v2"[..], &b"cuMemAlloc"[..]),
            (b"cuMemAlloc", b"cuMemAlloc"),
            (b"cuMemAllocAsync_ptsz", b"cuMemAllocAsync"),
            (b"cuCtxCreate_v4", b"cuCtxCreate"),
            (b"cuLaunchKernel_v2_ptsz", b"cuLaunchKernel"),
            (b"cuArray3DCreate_v2", b"cuArray3DCreate"),
            (b"cuMemcpy3D", b"cuMemcpy3D"),
            (b"cuGetProcAddress_v2", b"cuGetProcAddress"),
        ] {
            assert_eq!(family(name), fam, "{}", String::from_utf8_lossy(name));
        }
    }

    #[test]
    fn only_hooked_names_are_found() {
        assert_eq!(
            hooked_by_name(b"cuMemAlloc_v2"),
            Some(Sym::cuMemAlloc_v2 as usize)
        );
        assert_eq!(hooked_by_name(b"cuMemAlloc"), None);
        assert_eq!(hooked_by_name(b"cuCtxGetDevice"), None);
        assert_eq!(hooked_by_name(b"malloc"), None);
    }
}
