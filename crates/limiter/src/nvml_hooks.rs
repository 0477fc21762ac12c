//! The hooks of NVML: the memory a device shows to `nvidia-smi`, pynvml and the frameworks
//! that size their caches from NVML (vLLM) is the container's, as `cuMemGetInfo_v2` shows it,
//! so the two views agree.
//!
//! | hook | shows |
//! | --- | --- |
//! | `nvmlDeviceGetMemoryInfo` | total: the limit (or the GPU's size if smaller); used: what the container's processes hold; free: the rest (or the GPU's free memory, if less) |
//! | `nvmlDeviceGetMemoryInfo_v2` | the same, with nothing reserved |

use core::ffi::c_char;

use gpushare_limiter_contract::GpuUuid;

use crate::account;
use crate::boundary;
use crate::config::Mode;
use crate::driver::{self, real_fn};
use crate::ffi::*;
use crate::symbols::Sym;

/// NVML's own error for "not initialised" (`NVML_ERROR_UNINITIALIZED`).
const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;

/// The container's (limit, used) on `device`; `None` to show NVML's figures unchanged.
fn container_view(device: NvmlDevice) -> Option<(u64, u64)> {
    let nvml = driver::nvml()?;
    let p = account::process();
    match &p.mode {
        Mode::Off => None,
        Mode::Closed(_) => Some((0, 0)),
        Mode::Active { .. } => {
            // SAFETY: the type of the symbol.
            let get = unsafe { real_fn::<FnNvmlDeviceGetUuid>(nvml, Sym::nvmlDeviceGetUUID) }?;
            let mut buf = [0 as c_char; 96];
            // SAFETY: the caller's device and a live buffer of the size given.
            if unsafe { get(device, buf.as_mut_ptr(), buf.len() as u32) } != NVML_SUCCESS {
                return None;
            }
            let text: Vec<u8> = buf
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            let uuid = GpuUuid::parse(std::str::from_utf8(&text).ok()?).ok()?;
            let gpu = p.gpu_by_uuid(uuid)?;
            Some((gpu.limit, gpu.used().unwrap_or(gpu.limit)))
        }
    }
}

/// (total, free, used) as shown.
fn shown(real_total: u64, real_free: u64, limit: u64, used: u64) -> (u64, u64, u64) {
    let total = real_total.min(limit);
    let free = real_free.min(total.saturating_sub(used));
    (total, free, total - free)
}

/// Calls the real NVML function `sym` of type `F`, or answers "uninitialised".
///
/// # Safety
///
/// `F` is the type of `sym`.
unsafe fn forward<F: Copy>(sym: Sym, call: impl FnOnce(F) -> NvmlReturn) -> NvmlReturn {
    let Some(nvml) = driver::nvml() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    // SAFETY: forwarded.
    match unsafe { real_fn::<F>(nvml, sym) } {
        Some(f) => call(f),
        None => NVML_ERROR_UNINITIALIZED,
    }
}

/// `nvmlDeviceGetMemoryInfo`.
///
/// # Safety
///
/// NVML's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnNvmlMemoryInfo| unsafe { f(device, memory) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::nvmlDeviceGetMemoryInfo, call) },
        NVML_ERROR_UNINITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::nvmlDeviceGetMemoryInfo, call) };
            if r != NVML_SUCCESS || memory.is_null() {
                return r;
            }
            if let Some((limit, used)) = container_view(device) {
                // SAFETY: NVML filled the caller's structure on success.
                let m = unsafe { &mut *memory };
                (m.total, m.free, m.used) = shown(m.total, m.free, limit, used);
            }
            r
        },
    )
}

/// `nvmlDeviceGetMemoryInfo_v2`.
///
/// # Safety
///
/// NVML's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    // SAFETY: the caller's arguments to the real function of the same type.
    let call = |f: FnNvmlMemoryInfoV2| unsafe { f(device, memory) };
    boundary::hook(
        // SAFETY: the type of the symbol.
        || unsafe { forward(Sym::nvmlDeviceGetMemoryInfo_v2, call) },
        NVML_ERROR_UNINITIALIZED,
        || {
            // SAFETY: the type of the symbol.
            let r = unsafe { forward(Sym::nvmlDeviceGetMemoryInfo_v2, call) };
            if r != NVML_SUCCESS || memory.is_null() {
                return r;
            }
            if let Some((limit, used)) = container_view(device) {
                // SAFETY: NVML filled the caller's structure on success.
                let m = unsafe { &mut *memory };
                (m.total, m.free, m.used) = shown(m.total, m.free, limit, used);
                m.reserved = 0;
            }
            r
        },
    )
}

#[cfg(test)]
#[allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]
mod tests {
    use super::shown;

    #[test]
    fn the_view_is_the_container_s_share() {
        let gib = 1u64 << 30;
        // 16 GiB GPU, 12 free, 4 GiB limit, 1 GiB used by the container.
        assert_eq!(
            shown(16 * gib, 12 * gib, 4 * gib, gib),
            (4 * gib, 3 * gib, gib)
        );
        // The GPU has less free than the limit leaves: free is what the GPU has.
        assert_eq!(
            shown(16 * gib, 2 * gib, 4 * gib, gib),
            (4 * gib, 2 * gib, 2 * gib)
        );
        // Over the limit (dead processes not yet reclaimed): nothing free, never negative.
        assert_eq!(
            shown(16 * gib, 12 * gib, 4 * gib, 5 * gib),
            (4 * gib, 0, 4 * gib)
        );
        // A limit above the GPU's size shows the GPU.
        assert_eq!(
            shown(16 * gib, 16 * gib, 64 * gib, 0),
            (16 * gib, 16 * gib, 0)
        );
    }
}
