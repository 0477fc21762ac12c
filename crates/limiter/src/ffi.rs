//! The slice of the CUDA driver API and NVML ABI the limiter touches: result codes, handle
//! types, the structures it reads, and the function-pointer types of every entry point it
//! calls. Transcribed from the public `cuda.h` and `nvml.h` (CUDA 11.3 – 13); layouts are
//! checked by size in the tests below. Nothing here is called; see `driver` and `hooks`.

use core::ffi::{c_char, c_int, c_uint, c_void};

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`: an ordinal.
pub type CuDevice = c_int;
/// `CUdeviceptr` (`_v2`: 64 bits).
pub type CuDevicePtr = u64;
/// `CUstream`.
pub type CuStream = *mut c_void;
/// `CUmemoryPool`.
pub type CuMemoryPool = *mut c_void;
/// `CUarray`.
pub type CuArray = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub type CuMemHandle = u64;
/// `nvmlReturn_t`.
pub type NvmlReturn = c_int;
/// `nvmlDevice_t`.
pub type NvmlDevice = *mut c_void;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`: what every allocation over the limit returns.
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
/// `NVML_SUCCESS`.
pub const NVML_SUCCESS: NvmlReturn = 0;

/// `CU_MEM_LOCATION_TYPE_DEVICE`: the only location whose memory counts.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: bytes a pool holds from the GPU.
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
/// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`: bytes of a pool handed out.
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: c_int = 7;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CuUuid {
    /// 16 bytes.
    pub bytes: [u8; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CuMemLocation {
    /// `CUmemLocationType`.
    pub kind: c_int,
    /// A device ordinal when `kind` is a device.
    pub id: c_int,
}

/// The first fields of `CUmemAllocationProp` and of `CUmemPoolProps`, which begin alike:
/// two enums, then the location. Only read through a pointer to the caller's whole structure.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CuMemPropHead {
    /// `type` / `allocType`.
    pub alloc_type: c_int,
    /// `requestedHandleTypes` / `handleTypes`.
    pub handle_types: c_int,
    /// `location`.
    pub location: CuMemLocation,
}

/// `CUDA_ARRAY_DESCRIPTOR` (`_v2`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaArrayDescriptor {
    /// Width in elements.
    pub width: usize,
    /// Height in elements (0 for 1D).
    pub height: usize,
    /// `CUarray_format`.
    pub format: c_uint,
    /// Channels per element.
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`_v2`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaArray3dDescriptor {
    /// Width in elements.
    pub width: usize,
    /// Height in elements.
    pub height: usize,
    /// Depth (or layers).
    pub depth: usize,
    /// `CUarray_format`.
    pub format: c_uint,
    /// Channels per element.
    pub num_channels: c_uint,
    /// `CUDA_ARRAY3D_*` flags.
    pub flags: c_uint,
}

/// `CUDA_ARRAY_MEMORY_REQUIREMENTS`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CudaArrayMemoryRequirements {
    /// Bytes the array takes.
    pub size: usize,
    /// Its alignment.
    pub alignment: usize,
    /// Reserved.
    pub reserved: [c_uint; 4],
}

/// `nvmlMemory_t`.
#[repr(C)]
pub struct NvmlMemory {
    /// Bytes on the device.
    pub total: u64,
    /// Bytes free.
    pub free: u64,
    /// Bytes used.
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct NvmlMemoryV2 {
    /// Structure version.
    pub version: c_uint,
    /// Bytes on the device.
    pub total: u64,
    /// Bytes the driver reserves.
    pub reserved: u64,
    /// Bytes free.
    pub free: u64,
    /// Bytes used.
    pub used: u64,
}

/// Bytes per channel of a `CUarray_format`; formats it does not know (block-compressed,
/// video) count 4, and the driver's own figure replaces the estimate where it can give one.
pub fn array_format_bytes(format: c_uint) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => 4,
    }
}

// Function-pointer types of the entry points, named after the symbol they are the type of.

/// `cuGetProcAddress` (CUDA 11.3+).
pub type FnGetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
/// `cuGetProcAddress_v2` (CUDA 12.0+).
pub type FnGetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;
/// `cuMemAlloc_v2`.
pub type FnMemAlloc = unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
/// `cuMemAllocPitch_v2`.
pub type FnMemAllocPitch =
    unsafe extern "C" fn(*mut CuDevicePtr, *mut usize, usize, usize, c_uint) -> CuResult;
/// `cuMemAllocManaged`.
pub type FnMemAllocManaged = unsafe extern "C" fn(*mut CuDevicePtr, usize, c_uint) -> CuResult;
/// `cuMemFree_v2`.
pub type FnMemFree = unsafe extern "C" fn(CuDevicePtr) -> CuResult;
/// `cuMemAllocAsync` and `_ptsz`.
pub type FnMemAllocAsync = unsafe extern "C" fn(*mut CuDevicePtr, usize, CuStream) -> CuResult;
/// `cuMemAllocFromPoolAsync` and `_ptsz`.
pub type FnMemAllocFromPoolAsync =
    unsafe extern "C" fn(*mut CuDevicePtr, usize, CuMemoryPool, CuStream) -> CuResult;
/// `cuMemFreeAsync` and `_ptsz`.
pub type FnMemFreeAsync = unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult;
/// `cuMemPoolCreate`.
pub type FnMemPoolCreate =
    unsafe extern "C" fn(*mut CuMemoryPool, *const CuMemPropHead) -> CuResult;
/// `cuMemPoolDestroy`.
pub type FnMemPoolDestroy = unsafe extern "C" fn(CuMemoryPool) -> CuResult;
/// `cuMemCreate`.
pub type FnMemCreate =
    unsafe extern "C" fn(*mut CuMemHandle, usize, *const CuMemPropHead, u64) -> CuResult;
/// `cuMemRelease`.
pub type FnMemRelease = unsafe extern "C" fn(CuMemHandle) -> CuResult;
/// `cuMemMap`.
pub type FnMemMap = unsafe extern "C" fn(CuDevicePtr, usize, usize, CuMemHandle, u64) -> CuResult;
/// `cuMemUnmap`.
pub type FnMemUnmap = unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult;
/// `cuMemRetainAllocationHandle`.
pub type FnMemRetainAllocationHandle =
    unsafe extern "C" fn(*mut CuMemHandle, *mut c_void) -> CuResult;
/// `cuArrayCreate_v2`.
pub type FnArrayCreate = unsafe extern "C" fn(*mut CuArray, *const CudaArrayDescriptor) -> CuResult;
/// `cuArray3DCreate_v2`.
pub type FnArray3dCreate =
    unsafe extern "C" fn(*mut CuArray, *const CudaArray3dDescriptor) -> CuResult;
/// `cuArrayDestroy`.
pub type FnArrayDestroy = unsafe extern "C" fn(CuArray) -> CuResult;
/// `cuMemGetInfo_v2`.
pub type FnMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
/// `cuDeviceTotalMem_v2`.
pub type FnDeviceTotalMem = unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult;
/// `cuCtxGetDevice`.
pub type FnCtxGetDevice = unsafe extern "C" fn(*mut CuDevice) -> CuResult;
/// `cuDeviceGetUuid` and `_v2`.
pub type FnDeviceGetUuid = unsafe extern "C" fn(*mut CuUuid, CuDevice) -> CuResult;
/// `cuStreamGetDevice` (CUDA 12.8+) and `_ptsz`.
pub type FnStreamGetDevice = unsafe extern "C" fn(CuStream, *mut CuDevice) -> CuResult;
/// `cuStreamIsCapturing` and `_ptsz`.
pub type FnStreamIsCapturing = unsafe extern "C" fn(CuStream, *mut c_int) -> CuResult;
/// `cuDeviceGetMemPool`.
pub type FnDeviceGetMemPool = unsafe extern "C" fn(*mut CuMemoryPool, CuDevice) -> CuResult;
/// `cuMemPoolGetAttribute`.
pub type FnMemPoolGetAttribute = unsafe extern "C" fn(CuMemoryPool, c_int, *mut c_void) -> CuResult;
/// `cuMemPoolTrimTo`.
pub type FnMemPoolTrimTo = unsafe extern "C" fn(CuMemoryPool, usize) -> CuResult;
/// `cuArrayGetMemoryRequirements` (CUDA 11.6+).
pub type FnArrayGetMemoryRequirements =
    unsafe extern "C" fn(*mut CudaArrayMemoryRequirements, CuArray, CuDevice) -> CuResult;
/// `nvmlDeviceGetMemoryInfo`.
pub type FnNvmlMemoryInfo = unsafe extern "C" fn(NvmlDevice, *mut NvmlMemory) -> NvmlReturn;
/// `nvmlDeviceGetMemoryInfo_v2`.
pub type FnNvmlMemoryInfoV2 = unsafe extern "C" fn(NvmlDevice, *mut NvmlMemoryV2) -> NvmlReturn;
/// `nvmlDeviceGetUUID`.
pub type FnNvmlDeviceGetUuid = unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> NvmlReturn;

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
    fn layouts_match_the_headers() {
        assert_eq!(size_of::<CuUuid>(), 16);
        assert_eq!(size_of::<CuMemPropHead>(), 16);
        assert_eq!(core::mem::offset_of!(CuMemPropHead, location), 8);
        assert_eq!(size_of::<CudaArrayDescriptor>(), 24);
        assert_eq!(size_of::<CudaArray3dDescriptor>(), 40);
        assert_eq!(size_of::<CudaArrayMemoryRequirements>(), 32);
        assert_eq!(size_of::<NvmlMemory>(), 24);
        assert_eq!(size_of::<NvmlMemoryV2>(), 40);
        assert_eq!(core::mem::offset_of!(NvmlMemoryV2, total), 8);
    }
}
