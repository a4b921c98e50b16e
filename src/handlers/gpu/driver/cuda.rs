//! The driver API's function table and its result layer: every call goes through
//! [`Cuda::check`], which turns a `CUresult` into a [`GpuError`] naming the call and the error.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr;

use once_cell::sync::OnceCell;

use super::library::{open_first, symbol, Search};
use super::{GpuError, GpuResult};

pub(super) type CuResult = c_int;
pub(super) type CuDevice = c_int;
pub(super) type CuContext = *mut c_void;
pub(super) type CuModule = *mut c_void;
pub(super) type CuFunction = *mut c_void;
pub(super) type CuDevicePtr = u64;
pub(super) type CuStream = *mut c_void;

const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_L2_CACHE_SIZE: c_int = 38;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// The driver API entry points we use (signatures from cuda.h; `_v2` where the header maps
/// the name to one). `cuStreamGetCtx` and `cuCtxGetDevice` rather than `cuStreamGetDevice`,
/// which needs CUDA 12.8.
pub struct Cuda {
    _lib: libloading::Library,
    path: String,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    pub(super) primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    pub(super) primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_push: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_get_device: unsafe extern "C" fn(*mut CuDevice) -> CuResult,
    stream_get_ctx: unsafe extern "C" fn(CuStream, *mut CuContext) -> CuResult,
    stream_is_capturing: unsafe extern "C" fn(CuStream, *mut c_int) -> CuResult,
    pub(super) module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    pub(super) module_unload: unsafe extern "C" fn(CuModule) -> CuResult,
    pub(super) module_get_function:
        unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    pub(super) mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    pub(super) mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    #[allow(clippy::type_complexity)]
    pub(super) launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CuStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    /// `cuLaunchKernelEx` (CUDA 12.0 and later): launches in thread block clusters. None with
    /// an older driver, which then gets no cluster launches.
    pub(super) launch_kernel_ex: Option<
        unsafe extern "C" fn(
            *const LaunchConfigEx,
            CuFunction,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> CuResult,
    >,
}

/// cuda.h's `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`.
pub(super) const LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: c_int = 4;

/// cuda.h's `CUlaunchAttribute`: an id, padding to 8 bytes, a 64-byte value union (here only
/// its `clusterDim` member, three unsigned ints, is used; the union holds pointers too, hence
/// the struct's 8-byte alignment).
#[repr(C, align(8))]
pub(super) struct LaunchAttribute {
    pub id: c_int,
    pub pad: [u8; 4],
    pub value: [c_uint; 16],
}

/// cuda.h's `CUlaunchConfig`.
#[repr(C)]
pub(super) struct LaunchConfigEx {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_bytes: c_uint,
    pub stream: CuStream,
    pub attrs: *mut LaunchAttribute,
    pub num_attrs: c_uint,
}

const _: () = assert!(std::mem::size_of::<LaunchAttribute>() == 72);
const _: () = assert!(std::mem::size_of::<LaunchConfigEx>() == 56);

/// A stream's context and device, as the driver knows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamDevice {
    /// The CUDA device (`CUdevice`), which need not be XLA's device ordinal.
    pub device: i32,
    pub(super) context: CuContext,
}

// SAFETY: a context handle is valid on any thread (the driver API is thread-safe).
unsafe impl Send for StreamDevice {}
// SAFETY: as above; the handle is only passed back to the driver.
unsafe impl Sync for StreamDevice {}

/// `cuStreamIsCapturing`'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureStatus {
    None,
    Active,
    Invalidated,
}

impl Cuda {
    /// Loads libcuda from the first location of `search` that works, and initializes it.
    pub fn load(search: &Search) -> GpuResult<Cuda> {
        const LIB: &str = "the CUDA driver (libcuda)";
        let (lib, path) = open_first(
            LIB,
            &search.libcuda_candidates(),
            "An NVIDIA driver must be installed (libcuda.so.1 comes with it), or set \
             RMSNORM_FFI_LIBCUDA to its path.",
        )?;
        macro_rules! f {
            ($name:literal) => {
                symbol(&lib, LIB, &path, $name)?
            };
        }
        let init: unsafe extern "C" fn(c_uint) -> CuResult = f!("cuInit");
        let cuda = Cuda {
            get_error_name: f!("cuGetErrorName"),
            device_get_count: f!("cuDeviceGetCount"),
            device_get: f!("cuDeviceGet"),
            device_get_attribute: f!("cuDeviceGetAttribute"),
            primary_ctx_retain: f!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: f!("cuDevicePrimaryCtxRelease_v2"),
            ctx_get_current: f!("cuCtxGetCurrent"),
            ctx_push: f!("cuCtxPushCurrent_v2"),
            ctx_pop: f!("cuCtxPopCurrent_v2"),
            ctx_get_device: f!("cuCtxGetDevice"),
            stream_get_ctx: f!("cuStreamGetCtx"),
            stream_is_capturing: f!("cuStreamIsCapturing"),
            module_load_data: f!("cuModuleLoadData"),
            module_unload: f!("cuModuleUnload"),
            module_get_function: f!("cuModuleGetFunction"),
            mem_alloc: f!("cuMemAlloc_v2"),
            mem_free: f!("cuMemFree_v2"),
            launch_kernel: f!("cuLaunchKernel"),
            launch_kernel_ex: symbol(&lib, LIB, &path, "cuLaunchKernelEx").ok(),
            path: path.clone(),
            _lib: lib,
        };
        // SAFETY: cuInit takes flags 0 and may be called any number of times.
        cuda.check("cuInit", unsafe { init(0) })?;
        Ok(cuda)
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// The result layer: `Ok` for `CUDA_SUCCESS`, else the call and the error's name.
    pub(super) fn check(&self, call: &'static str, rc: CuResult) -> GpuResult<()> {
        if rc == 0 {
            return Ok(());
        }
        let mut name: *const c_char = ptr::null();
        // SAFETY: valid out-pointer; the name is a static string.
        let known = unsafe { (self.get_error_name)(rc, &mut name) } == 0 && !name.is_null();
        let name = if known {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown CUDA error".to_string()
        };
        Err(GpuError::Driver {
            call,
            code: rc,
            name,
        })
    }

    pub fn device_count(&self) -> GpuResult<i32> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    pub(super) fn device(&self, ordinal: i32) -> GpuResult<CuDevice> {
        let mut dev = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGet", unsafe {
            (self.device_get)(&mut dev, ordinal)
        })?;
        Ok(dev)
    }

    fn attribute(&self, ordinal: i32, attr: c_int) -> GpuResult<i32> {
        let dev = self.device(ordinal)?;
        let mut v = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGetAttribute", unsafe {
            (self.device_get_attribute)(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// Compute capability as 10 * major + minor (90 for an H100/H200).
    pub fn capability(&self, ordinal: i32) -> GpuResult<i32> {
        Ok(10 * self.attribute(ordinal, ATTR_COMPUTE_CAPABILITY_MAJOR)?
            + self.attribute(ordinal, ATTR_COMPUTE_CAPABILITY_MINOR)?)
    }

    pub fn sm_count(&self, ordinal: i32) -> GpuResult<i32> {
        self.attribute(ordinal, ATTR_MULTIPROCESSOR_COUNT)
    }

    /// Whether kernels can be launched in thread block clusters on the device: compute
    /// capability 9.0 or later, and a driver with `cuLaunchKernelEx`.
    pub fn has_clusters(&self, ordinal: i32) -> GpuResult<bool> {
        Ok(self.launch_kernel_ex.is_some() && self.capability(ordinal)? >= 90)
    }

    pub fn l2_bytes(&self, ordinal: i32) -> GpuResult<i32> {
        self.attribute(ordinal, ATTR_L2_CACHE_SIZE)
    }

    /// The context and device of `stream` (XLA's stream of this call): `cuStreamGetCtx`, then
    /// `cuCtxGetDevice` with that context current.
    pub fn stream_device(&self, stream: xla_ffi_bundles::ffi::Stream) -> GpuResult<StreamDevice> {
        let mut context: CuContext = ptr::null_mut();
        // SAFETY: `stream` is a live stream handed to us by XLA; valid out-pointer.
        self.check("cuStreamGetCtx", unsafe {
            (self.stream_get_ctx)(stream.as_raw(), &mut context)
        })?;
        let _current = CurrentContext::enter(self, context)?;
        let mut device = 0;
        // SAFETY: valid out-pointer; a context is current.
        self.check("cuCtxGetDevice", unsafe {
            (self.ctx_get_device)(&mut device)
        })?;
        Ok(StreamDevice { device, context })
    }

    /// Whether `stream` is being captured into a CUDA graph (legal during capture).
    pub fn capture_status(&self, stream: xla_ffi_bundles::ffi::Stream) -> GpuResult<CaptureStatus> {
        let mut status: c_int = 0;
        // SAFETY: live stream, valid out-pointer.
        self.check("cuStreamIsCapturing", unsafe {
            (self.stream_is_capturing)(stream.as_raw(), &mut status)
        })?;
        Ok(match status {
            0 => CaptureStatus::None,
            1 => CaptureStatus::Active,
            _ => CaptureStatus::Invalidated,
        })
    }
}

static CUDA: OnceCell<Result<Cuda, GpuError>> = OnceCell::new();

/// The process's driver API, loaded on first use with [`Search::from_env`].
pub fn cuda() -> GpuResult<&'static Cuda> {
    CUDA.get_or_init(|| Cuda::load(&Search::from_env()))
        .as_ref()
        .map_err(Clone::clone)
}

/// Makes a context current for a scope, if it is not already.
pub(super) struct CurrentContext<'a> {
    cuda: &'a Cuda,
    pushed: bool,
}

impl<'a> CurrentContext<'a> {
    pub(super) fn enter(cuda: &'a Cuda, ctx: CuContext) -> GpuResult<Self> {
        let mut current: CuContext = ptr::null_mut();
        // SAFETY: valid out-pointer.
        cuda.check("cuCtxGetCurrent", unsafe {
            (cuda.ctx_get_current)(&mut current)
        })?;
        if current == ctx {
            return Ok(CurrentContext {
                cuda,
                pushed: false,
            });
        }
        // SAFETY: `ctx` is a live context (a retained primary context or a stream's).
        cuda.check("cuCtxPushCurrent", unsafe { (cuda.ctx_push)(ctx) })?;
        Ok(CurrentContext { cuda, pushed: true })
    }
}

impl Drop for CurrentContext<'_> {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: CuContext = ptr::null_mut();
            // SAFETY: pops the context `enter` pushed on this thread.
            unsafe { (self.cuda.ctx_pop)(&mut popped) };
        }
    }
}
