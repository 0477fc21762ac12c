//! NVML's per-cgroup GPU memory limits, added in driver R615 (CUDA 13.4) and not bound by
//! nvml-wrapper: `nvmlDeviceSetMemoryLimits_v1` (soft and hard limit of one GPU for one cgroup,
//! root only) and `nvmlDeviceGetMemoryLimits_v1` (the limits and the memory used, for anyone),
//! reached through symbols resolved from `libnvidia-ml.so.1` at run time ([`Nvml::open`]).
//!
//! The structures are NVML's (CUDA 13.4 `nvml.h`): `nvmlSetMemoryLimits_v1_t` is
//! `{const char *nameSpace; unsigned long long softLimit, hardLimit}` (24 bytes on 64-bit) and
//! `nvmlGetMemoryLimits_v1_t` adds `unsigned long long currentUsed` (32 bytes); `nameSpace` is
//! the full path of the cgroup directory. No limit is soft 0 and hard [`MEMORY_LIMIT_MAX`].
//!
//! This is the workspace's one crate that writes `unsafe`: calling a C function through a
//! resolved symbol cannot be written without it. Each `unsafe` block is one symbol lookup or one
//! call, with the reason it is sound. It knows nothing of cgroups, containers or gpushare; it
//! answers NVML's return codes ([`CallError`]) for its caller to explain.
//!
//! A library without the two symbols (a driver older than R615) still opens: [`Nvml::has_limits`]
//! is false and the limit calls answer [`Error::NoMemoryLimits`].

use std::ffi::{CStr, CString, OsStr, c_char, c_int, c_uint, c_ulonglong, c_void};

/// NVML's "no hard limit" (`NVML_DEVICE_MEMORY_LIMIT_MAX`): what clears a hard limit.
pub const MEMORY_LIMIT_MAX: u64 = u64::MAX;

/// NVML return codes this crate's callers tell apart (`nvmlReturn_t`).
pub mod code {
    /// `NVML_ERROR_INVALID_ARGUMENT`.
    pub const INVALID_ARGUMENT: u32 = 2;
    /// `NVML_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: u32 = 3;
    /// `NVML_ERROR_NO_PERMISSION`.
    pub const NO_PERMISSION: u32 = 4;
    /// `NVML_ERROR_NOT_FOUND`.
    pub const NOT_FOUND: u32 = 6;
    /// `NVML_ERROR_DRIVER_NOT_LOADED`.
    pub const DRIVER_NOT_LOADED: u32 = 9;
    /// `NVML_ERROR_FUNCTION_NOT_FOUND`.
    pub const FUNCTION_NOT_FOUND: u32 = 13;
    /// `NVML_ERROR_MEMORY` (insufficient memory).
    pub const MEMORY: u32 = 20;
}

type NvmlReturn = c_int;
type Device = *mut c_void;

/// `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
}

/// `nvmlGetMemoryLimits_v1_t`.
#[repr(C)]
struct GetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
    current_used: c_ulonglong,
}

type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type ErrorStringFn = unsafe extern "C" fn(NvmlReturn) -> *const c_char;
type HandleByUuidFn = unsafe extern "C" fn(*const c_char, *mut Device) -> NvmlReturn;
type MigModeFn = unsafe extern "C" fn(Device, *mut c_uint, *mut c_uint) -> NvmlReturn;
type SetLimitsFn = unsafe extern "C" fn(Device, *mut SetMemoryLimitsV1) -> NvmlReturn;
type GetLimitsFn = unsafe extern "C" fn(Device, *mut GetMemoryLimitsV1) -> NvmlReturn;

/// One cgroup's limits on one GPU, as NVML reads them back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimits {
    /// Soft limit (the guaranteed share) in bytes; 0 is none.
    pub soft: u64,
    /// Hard limit in bytes; [`MEMORY_LIMIT_MAX`] is none.
    pub hard: u64,
    /// Device memory the cgroup uses now, in bytes.
    pub used: u64,
}

/// An NVML call that answered an error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {text} (NVML error {code})")]
pub struct CallError {
    /// The NVML function.
    pub call: &'static str,
    /// Its `nvmlReturn_t`.
    pub code: u32,
    /// `nvmlErrorString` of it.
    pub text: String,
}

/// Why NVML could not be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The library could not be loaded (no driver, a static build that cannot dlopen).
    #[error("cannot load {library}: {reason}")]
    Load {
        /// The library asked for.
        library: String,
        /// The loader's answer.
        reason: String,
    },
    /// The library lacks a function every NVML has (not NVML).
    #[error("{library} has no {symbol}: not an NVML library")]
    Symbol {
        /// The library.
        library: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// The library has no per-cgroup memory limits (a driver older than R615).
    #[error(
        "this NVML has no nvmlDeviceSetMemoryLimits_v1/nvmlDeviceGetMemoryLimits_v1: the driver \
         is older than R615 (CUDA 13.4)"
    )]
    NoMemoryLimits,
    /// A string argument holds a NUL byte.
    #[error("{what} holds a NUL byte")]
    Nul {
        /// Which argument.
        what: &'static str,
    },
    /// An NVML call answered an error.
    #[error(transparent)]
    Call(#[from] CallError),
}

impl Error {
    /// The NVML return code, when an NVML call answered one.
    pub fn code(&self) -> Option<u32> {
        match self {
            Error::Call(c) => Some(c.code),
            _ => None,
        }
    }
}

/// An initialised NVML library; shut down on drop.
pub struct Nvml {
    // Declared before `library` so the function pointers never outlive it in any reading; they
    // are plain pointers and need no drop of their own.
    shutdown: InitFn,
    error_string: ErrorStringFn,
    handle_by_uuid: HandleByUuidFn,
    mig_mode: Option<MigModeFn>,
    set_limits: Option<SetLimitsFn>,
    get_limits: Option<GetLimitsFn>,
    // Kept loaded while the function pointers above are in use; dropped last.
    _library: libloading::Library,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvml")
            .field("has_limits", &self.has_limits())
            .finish_non_exhaustive()
    }
}

/// Resolves `name` (NUL-terminated) in `library` as a function of type `T`, `None` when absent.
///
/// # Safety
/// `T` must be the C signature NVML declares for `name`.
unsafe fn lookup<T: Copy>(library: &libloading::Library, name: &[u8]) -> Option<T> {
    // SAFETY: the caller guarantees `T` is the symbol's C signature; the copied function pointer
    // is used only while `library` stays loaded (both live in one `Nvml`).
    let symbol = unsafe { library.get::<T>(name) }.ok()?;
    Some(*symbol)
}

fn required<T: Copy>(found: Option<T>, library: &str, symbol: &'static str) -> Result<T, Error> {
    found.ok_or_else(|| Error::Symbol {
        library: library.to_string(),
        symbol,
    })
}

impl Nvml {
    /// Loads `library` (a path, or a name the loader searches) and calls `nvmlInit_v2`.
    pub fn open(library: &OsStr) -> Result<Nvml, Error> {
        let shown = library.to_string_lossy().into_owned();
        // SAFETY: loading NVML runs its initialisers, which are the driver's own and have no
        // preconditions on the caller; this is what nvml-wrapper does for the same library.
        let lib = unsafe { libloading::Library::new(library) }.map_err(|e| Error::Load {
            library: shown.clone(),
            reason: e.to_string(),
        })?;
        // SAFETY: each type below is the signature nvml.h (CUDA 13.4) declares for its name.
        let init: InitFn = required(
            unsafe { lookup(&lib, b"nvmlInit_v2\0") },
            &shown,
            "nvmlInit_v2",
        )?;
        // SAFETY: as above.
        let shutdown: InitFn = required(
            unsafe { lookup(&lib, b"nvmlShutdown\0") },
            &shown,
            "nvmlShutdown",
        )?;
        // SAFETY: as above.
        let error_string: ErrorStringFn = required(
            unsafe { lookup(&lib, b"nvmlErrorString\0") },
            &shown,
            "nvmlErrorString",
        )?;
        // SAFETY: as above.
        let handle_by_uuid: HandleByUuidFn = required(
            unsafe { lookup(&lib, b"nvmlDeviceGetHandleByUUID\0") },
            &shown,
            "nvmlDeviceGetHandleByUUID",
        )?;
        // SAFETY: as above.
        let mig_mode: Option<MigModeFn> = unsafe { lookup(&lib, b"nvmlDeviceGetMigMode\0") };
        // SAFETY: as above.
        let set_limits: Option<SetLimitsFn> =
            unsafe { lookup(&lib, b"nvmlDeviceSetMemoryLimits_v1\0") };
        // SAFETY: as above.
        let get_limits: Option<GetLimitsFn> =
            unsafe { lookup(&lib, b"nvmlDeviceGetMemoryLimits_v1\0") };
        // SAFETY: nvmlInit_v2 takes no arguments and may be called any number of times (NVML
        // counts them; each success is paired with the nvmlShutdown of `Drop`).
        let ret = unsafe { init() };
        if ret != 0 {
            // SAFETY: nvmlErrorString accepts any code and returns a static string or NULL.
            let p = unsafe { error_string(ret) };
            let text = if p.is_null() {
                format!("NVML error {ret}")
            } else {
                // SAFETY: a non-NULL answer of nvmlErrorString is a static NUL-terminated
                // string.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            };
            return Err(CallError {
                call: "nvmlInit_v2",
                code: ret as u32,
                text,
            }
            .into());
        }
        Ok(Nvml {
            shutdown,
            error_string,
            handle_by_uuid,
            mig_mode,
            set_limits,
            get_limits,
            _library: lib,
        })
    }

    /// Whether this NVML has the per-cgroup memory limit calls (driver R615 or newer).
    pub fn has_limits(&self) -> bool {
        self.set_limits.is_some() && self.get_limits.is_some()
    }

    fn text(&self, ret: NvmlReturn) -> String {
        // SAFETY: nvmlErrorString accepts any code and returns a static string or NULL.
        let p = unsafe { (self.error_string)(ret) };
        if p.is_null() {
            return format!("NVML error {ret}");
        }
        // SAFETY: a non-NULL answer of nvmlErrorString is a static NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, call: &'static str, ret: NvmlReturn) -> Result<(), CallError> {
        if ret == 0 {
            return Ok(());
        }
        Err(CallError {
            call,
            code: ret as u32,
            text: self.text(ret),
        })
    }

    fn device(&self, uuid: &str) -> Result<Device, Error> {
        let uuid = CString::new(uuid).map_err(|_| Error::Nul { what: "GPU UUID" })?;
        let mut device: Device = std::ptr::null_mut();
        // SAFETY: `uuid` is a NUL-terminated string and `device` a valid out-pointer, both
        // alive for the call.
        let ret = unsafe { (self.handle_by_uuid)(uuid.as_ptr(), &mut device) };
        self.check("nvmlDeviceGetHandleByUUID", ret)?;
        Ok(device)
    }

    /// Whether GPU `uuid` is in MIG mode (`None`: this NVML or GPU cannot say).
    pub fn mig_enabled(&self, uuid: &str) -> Result<Option<bool>, Error> {
        let device = self.device(uuid)?;
        let Some(mig_mode) = self.mig_mode else {
            return Ok(None);
        };
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: `device` is a handle NVML returned; both out-pointers are valid for the call.
        let ret = unsafe { mig_mode(device, &mut current, &mut pending) };
        match self.check("nvmlDeviceGetMigMode", ret) {
            Ok(()) => Ok(Some(current == 1)),
            Err(e) if e.code == code::NOT_SUPPORTED => Ok(Some(false)),
            Err(e) => Err(e.into()),
        }
    }

    /// Sets the soft and hard limit (bytes) of GPU `uuid` for the cgroup directory `cgroup`
    /// (its full path). Needs root.
    pub fn set_limits(&self, uuid: &str, cgroup: &str, soft: u64, hard: u64) -> Result<(), Error> {
        let set = self.set_limits.ok_or(Error::NoMemoryLimits)?;
        let device = self.device(uuid)?;
        let path = CString::new(cgroup).map_err(|_| Error::Nul {
            what: "cgroup path",
        })?;
        let mut limits = SetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: soft,
            hard_limit: hard,
        };
        // SAFETY: `device` is a handle NVML returned; `limits` is the v1 structure with a
        // NUL-terminated path that outlives the call.
        let ret = unsafe { set(device, &mut limits) };
        self.check("nvmlDeviceSetMemoryLimits_v1", ret)?;
        Ok(())
    }

    /// The limits and the memory used of GPU `uuid` for the cgroup directory `cgroup`.
    pub fn get_limits(&self, uuid: &str, cgroup: &str) -> Result<MemoryLimits, Error> {
        let get = self.get_limits.ok_or(Error::NoMemoryLimits)?;
        let device = self.device(uuid)?;
        let path = CString::new(cgroup).map_err(|_| Error::Nul {
            what: "cgroup path",
        })?;
        let mut limits = GetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: 0,
            hard_limit: 0,
            current_used: 0,
        };
        // SAFETY: `device` is a handle NVML returned; `limits` is the v1 structure with a
        // NUL-terminated path that outlives the call, the rest NVML writes.
        let ret = unsafe { get(device, &mut limits) };
        self.check("nvmlDeviceGetMemoryLimits_v1", ret)?;
        Ok(MemoryLimits {
            soft: limits.soft_limit,
            hard: limits.hard_limit,
            used: limits.current_used,
        })
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: pairs the successful nvmlInit_v2 of `open`; the library is still loaded
        // (`library` is dropped after this body).
        let _ = unsafe { (self.shutdown)() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn the_structures_have_nvmls_layout() {
        assert_eq!(std::mem::size_of::<SetMemoryLimitsV1>(), 8 + 8 + 8);
        assert_eq!(std::mem::size_of::<GetMemoryLimitsV1>(), 8 + 8 + 8 + 8);
        assert_eq!(std::mem::offset_of!(GetMemoryLimitsV1, current_used), 24);
    }

    #[test]
    fn a_missing_library_names_itself() {
        let err = Nvml::open(OsStr::new("/nonexistent/libnvidia-ml.so.1")).expect_err("absent");
        assert!(
            err.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
            "{err}"
        );
    }
}
