//! A module loaded into a device's primary context, its functions, and device allocations.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::ptr;
use std::sync::Arc;

use super::cuda::{cuda, CuContext, CuDevice, CuDevicePtr, CuFunction, CuModule, CurrentContext};
use super::launch::{KernelSignature, Launch, LaunchConfig};
use super::{Cuda, GpuError, GpuResult, StreamDevice};

/// One kernel of a [`Module`], with the parameter list it was declared with.
pub struct Function {
    pub name: &'static str,
    pub signature: &'static KernelSignature,
    pub(super) handle: CuFunction,
}

/// Kernels loaded into one device's primary context. Dropping it unloads the module and
/// releases the context.
pub struct Module {
    pub(super) cuda: &'static Cuda,
    device: CuDevice,
    pub(super) ctx: CuContext,
    module: CuModule,
    functions: Vec<Function>,
    image_bytes: usize,
}

// SAFETY: the handles are plain driver handles, valid from any thread (the driver API is
// thread-safe); the struct is never mutated after construction.
unsafe impl Send for Module {}
// SAFETY: as above; shared use only launches kernels and reads the handles.
unsafe impl Sync for Module {}

impl Module {
    /// Loads `image` (a cubin or NUL-terminated PTX) into CUDA device `device`'s primary context
    /// and looks up `kernels` (name and parameter list, in the order [`Module::function`] takes).
    pub fn load(
        device: i32,
        image: &[u8],
        kernels: &[(&'static str, &'static KernelSignature)],
    ) -> GpuResult<Module> {
        let cuda = cuda()?;
        let dev = cuda.device(device)?;
        let mut ctx: CuContext = ptr::null_mut();
        // SAFETY: valid out-pointer; the retain is released in Drop (or below on failure).
        cuda.check("cuDevicePrimaryCtxRetain", unsafe {
            (cuda.primary_ctx_retain)(&mut ctx, dev)
        })?;
        // From here on, Drop cleans up whatever was acquired.
        let mut this = Module {
            cuda,
            device: dev,
            ctx,
            module: ptr::null_mut(),
            functions: Vec::with_capacity(kernels.len()),
            image_bytes: image.len(),
        };
        let _current = CurrentContext::enter(cuda, ctx)?;
        // SAFETY: `image` is a cubin or a NUL-terminated PTX string, alive for the call.
        cuda.check("cuModuleLoadData", unsafe {
            (cuda.module_load_data)(&mut this.module, image.as_ptr().cast())
        })?;
        for &(name, signature) in kernels {
            let cname = CString::new(name).expect("kernel names have no NUL");
            let mut f: CuFunction = ptr::null_mut();
            // SAFETY: live module, valid name and out-pointer.
            cuda.check("cuModuleGetFunction", unsafe {
                (cuda.module_get_function)(&mut f, this.module, cname.as_ptr())
            })?;
            this.functions.push(Function {
                name,
                signature,
                handle: f,
            });
        }
        Ok(this)
    }

    /// The CUDA device the module lives on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Bytes of the image loaded.
    pub fn image_bytes(&self) -> usize {
        self.image_bytes
    }

    /// Whether work for `stream` (its context, as [`Cuda::stream_device`] found it) may use this
    /// module: the stream must belong to the module's context.
    pub fn serves(&self, stream: &StreamDevice) -> bool {
        stream.context == self.ctx
    }

    /// Kernel `index` (in the order given to [`Module::load`]).
    pub fn function(&self, index: usize) -> GpuResult<&Function> {
        self.functions
            .get(index)
            .ok_or_else(|| GpuError::Unsupported(format!("no kernel #{index} in the module")))
    }

    /// Starts a launch of kernel `index`: add its arguments in order, then enqueue.
    pub fn launch(&self, index: usize, config: LaunchConfig) -> GpuResult<Launch<'_>> {
        Ok(Launch::new(self, self.function(index)?, config))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if let Ok(_current) = CurrentContext::enter(self.cuda, self.ctx) {
            if !self.module.is_null() {
                // SAFETY: loaded in `load`, unloaded once.
                unsafe { (self.cuda.module_unload)(self.module) };
            }
        }
        // SAFETY: balances the retain in `load`.
        unsafe { (self.cuda.primary_ctx_release)(self.device) };
    }
}

/// Device memory allocated with `cuMemAlloc` in a module's context, freed on drop. Its address
/// is fixed for its life (what CUDA graphs that captured a kernel using it need).
pub struct DeviceAllocation {
    module: Arc<Module>,
    ptr: CuDevicePtr,
    bytes: usize,
}

impl DeviceAllocation {
    /// `bytes` (> 0) of device memory in `module`'s context. Not legal during stream capture
    /// (the caller checks before).
    pub fn new(module: &Arc<Module>, bytes: usize) -> GpuResult<DeviceAllocation> {
        let cuda = module.cuda;
        let _current = CurrentContext::enter(cuda, module.ctx)?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: valid out-pointer; freed once in Drop.
        cuda.check("cuMemAlloc", unsafe { (cuda.mem_alloc)(&mut ptr, bytes) })?;
        Ok(DeviceAllocation {
            module: Arc::clone(module),
            ptr,
            bytes,
        })
    }

    pub fn addr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        let cuda = self.module.cuda;
        if let Ok(_current) = CurrentContext::enter(cuda, self.module.ctx) {
            // SAFETY: allocated by cuMemAlloc in `new`, freed once. Work that used it was
            // enqueued by executables XLA has finished with before deleting the state.
            unsafe { (cuda.mem_free)(self.ptr) };
        }
    }
}
