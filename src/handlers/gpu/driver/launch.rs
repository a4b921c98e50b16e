//! A typed launch builder: arguments are added by name and type, each checked against the
//! kernel's declared parameter list, then packed into the one parameter buffer that
//! `cuLaunchKernel` takes through `extra` (each value at its natural alignment). The driver
//! checks that buffer's size against the kernel's real parameters, so a list that disagrees
//! with the compiled kernel fails the launch instead of passing garbage.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ptr;

use super::cuda::{
    CurrentContext, LaunchAttribute, LaunchConfigEx, LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
};
use super::module::{Function, Module};
use super::{GpuError, GpuResult};

/// The type of one kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (`const T*`, `T*`; null for an absent operand).
    Ptr,
    I32,
    I64,
    F32,
}

impl Param {
    pub fn size(self) -> usize {
        match self {
            Param::Ptr | Param::I64 => 8,
            Param::I32 | Param::F32 => 4,
        }
    }

    /// How the parameter appears in PTX (`.param .u64 name_param_0`).
    pub fn ptx_type(self) -> &'static str {
        match self {
            Param::Ptr | Param::I64 => ".u64",
            Param::I32 => ".u32",
            Param::F32 => ".f32",
        }
    }
}

/// A kernel family's parameter list, in order.
#[derive(Debug)]
pub struct KernelSignature {
    pub family: &'static str,
    pub params: &'static [(&'static str, Param)],
}

impl KernelSignature {
    /// Bytes of the packed parameter buffer.
    pub fn packed_bytes(&self) -> usize {
        self.params.iter().fold(0, |offset, (_, p)| {
            offset.next_multiple_of(p.size()) + p.size()
        })
    }
}

/// Grid, block and dynamic shared memory of a launch, and its thread block clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: u32,
    pub block: (u32, u32),
    pub shared_bytes: u32,
    /// Blocks per cluster along x (1: no clusters, `cuLaunchKernel`; more: `cuLaunchKernelEx`
    /// with a cluster dimension, which `grid` must be a multiple of).
    pub cluster: u32,
}

const MAX_PARAM_BYTES: usize = 256;

/// One launch being put together; see [`Module::launch`].
pub struct Launch<'m> {
    module: &'m Module,
    function: &'m Function,
    config: LaunchConfig,
    buffer: [u8; MAX_PARAM_BYTES],
    offset: usize,
    next: usize,
    error: Option<String>,
}

impl<'m> Launch<'m> {
    pub(super) fn new(module: &'m Module, function: &'m Function, config: LaunchConfig) -> Self {
        Launch {
            module,
            function,
            config,
            buffer: [0; MAX_PARAM_BYTES],
            offset: 0,
            next: 0,
            error: None,
        }
    }

    fn push(mut self, name: &str, kind: Param, bytes: &[u8]) -> Self {
        if self.error.is_some() {
            return self;
        }
        let params = self.function.signature.params;
        match params.get(self.next) {
            Some(&(want, want_kind)) if want == name && want_kind == kind => {
                let at = self.offset.next_multiple_of(kind.size());
                if at + bytes.len() > MAX_PARAM_BYTES {
                    self.error = Some("too many parameter bytes".into());
                    return self;
                }
                self.buffer[at..at + bytes.len()].copy_from_slice(bytes);
                self.offset = at + bytes.len();
                self.next += 1;
            }
            Some(&(want, want_kind)) => {
                self.error = Some(format!(
                    "argument {} is `{name}: {kind:?}` but the kernel's parameter is \
                     `{want}: {want_kind:?}`",
                    self.next
                ))
            }
            None => {
                self.error = Some(format!(
                    "argument `{name}` is one more than the kernel's {} parameters",
                    params.len()
                ))
            }
        }
        self
    }

    pub fn ptr(self, name: &str, value: u64) -> Self {
        self.push(name, Param::Ptr, &value.to_ne_bytes())
    }
    pub fn i64(self, name: &str, value: i64) -> Self {
        self.push(name, Param::I64, &value.to_ne_bytes())
    }
    pub fn i32(self, name: &str, value: i32) -> Self {
        self.push(name, Param::I32, &value.to_ne_bytes())
    }
    pub fn f32(self, name: &str, value: f32) -> Self {
        self.push(name, Param::F32, &value.to_ne_bytes())
    }

    /// Enqueues the kernel on `stream` (XLA's `CUstream`, which must belong to the module's
    /// context). Only enqueues: no synchronization, no allocation, so it may be captured into a
    /// CUDA graph.
    pub fn enqueue(self, stream: xla_ffi_bundles::ffi::Stream) -> GpuResult<()> {
        let name = self.function.name;
        let params = self.function.signature.params;
        let error = self.error.or_else(|| {
            (self.next != params.len()).then(|| {
                format!(
                    "{} of the kernel's {} parameters given (next: `{}`)",
                    self.next,
                    params.len(),
                    params[self.next].0
                )
            })
        });
        if let Some(message) = error {
            return Err(GpuError::Launch {
                kernel: name,
                message,
            });
        }
        let cuda = self.module.cuda;
        let _current = CurrentContext::enter(cuda, self.module.ctx)?;
        let mut buffer = self.buffer;
        let mut size = self.function.signature.packed_bytes();
        // CU_LAUNCH_PARAM_BUFFER_POINTER ((void*)1), CU_LAUNCH_PARAM_BUFFER_SIZE ((void*)2),
        // CU_LAUNCH_PARAM_END (null): markers, not addresses.
        let mut extra: [*mut c_void; 5] = [
            ptr::without_provenance_mut(1),
            buffer.as_mut_ptr().cast(),
            ptr::without_provenance_mut(2),
            (&mut size as *mut usize).cast(),
            ptr::null_mut(),
        ];
        let c = self.config;
        if c.cluster > 1 {
            let Some(launch_ex) = cuda.launch_kernel_ex else {
                return Err(GpuError::Launch {
                    kernel: name,
                    message: "a cluster launch, but the driver has no cuLaunchKernelEx".into(),
                });
            };
            let mut value = [0; 16];
            value[..3].copy_from_slice(&[c.cluster, 1, 1]);
            let mut attribute = LaunchAttribute {
                id: LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: [0; 4],
                value,
            };
            let config = LaunchConfigEx {
                grid: [c.grid, 1, 1],
                block: [c.block.0, c.block.1, 1],
                shared_bytes: c.shared_bytes,
                stream: stream.as_raw(),
                attrs: &mut attribute,
                num_attrs: 1,
            };
            // SAFETY: as for cuLaunchKernel below; `config` and its one attribute (the cluster
            // dimension, laid out as cuda.h's CUlaunchAttribute) live until the call returns.
            let rc = unsafe {
                launch_ex(
                    &config,
                    self.function.handle,
                    ptr::null_mut(),
                    extra.as_mut_ptr(),
                )
            };
            return cuda.check("cuLaunchKernelEx", rc);
        }
        // SAFETY: `handle` is a live kernel of this module; `extra` describes a buffer of
        // `size` bytes laid out as the kernel's parameter list (checked above, and by the driver
        // against the kernel itself), alive until cuLaunchKernel returns (it copies it); the
        // module's context is current; `stream` is XLA's stream of that context.
        let rc = unsafe {
            (cuda.launch_kernel)(
                self.function.handle,
                c.grid,
                1,
                1,
                c.block.0,
                c.block.1,
                1,
                c.shared_bytes,
                stream.as_raw(),
                ptr::null_mut(),
                extra.as_mut_ptr(),
            )
        };
        cuda.check("cuLaunchKernel", rc)
    }
}
