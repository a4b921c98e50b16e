//! The CUDA driver API and NVRTC, loaded at run time through small function tables: the only
//! layer of the GPU code with `unsafe`. Generic (nothing here knows the RMS norm), in layers:
//!
//! - [`library`]: finding and opening the shared libraries;
//! - [`nvrtc`]: NVRTC (compiling CUDA C to PTX/cubin);
//! - [`cuda`]: the driver's function table and its result layer (every call checked, errors
//!   named), devices, contexts, streams and capture status;
//! - [`module`]: a module loaded into a device's primary context, and device allocations;
//! - [`launch`]: a typed launch builder, checked against the kernel's parameter list.
//!
//! Why `libloading` and not cudarc: cudarc's dynamic loader looks libraries up by name only
//! (through the dynamic linker's search path), so it cannot find the NVRTC that
//! `jax[cuda12]` / `jax[cuda13]` install under `site-packages/nvidia/...` (not on the linker's
//! path); its sys layer panics when a library is missing (we must return an error instead); and
//! its CUDA-version feature fixes one soname major, while we must work with CUDA 12 and 13. We
//! need about twenty entry points with stable C signatures, so a table of our own is smaller
//! than working around all three.
//!
//! Search order, for NVRTC (first hit wins; every attempt is listed in the error):
//! 1. `RMSNORM_FFI_NVRTC` (an absolute path), if set;
//! 2. pip layouts under every site-packages directory we know of: `RMSNORM_FFI_SITE_PACKAGES`
//!    (`:`-separated, used by the tests), then the site-packages of every shared object mapped
//!    into this process (jaxlib, the CUDA plugin, this extension; read from /proc/self/maps):
//!    `nvidia/cu13/lib/libnvrtc.so.13`, `nvidia/cuda_nvrtc/lib/libnvrtc.so.13`,
//!    `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`;
//! 3. the system: sonames `libnvrtc.so.13`, `libnvrtc.so.12`, `libnvrtc.so` through the dynamic
//!    linker, then `/usr/local/cuda/lib64`.
//!
//! For libcuda (installed with the driver): `RMSNORM_FFI_LIBCUDA`, then `libcuda.so.1`,
//! `libcuda.so`, then `/usr/lib/wsl/lib/libcuda.so.1`.
//!
//! Libraries are loaded once per process and never unloaded (function pointers into them are
//! kept for the life of the process).

mod cuda;
mod launch;
mod library;
mod module;
pub mod nvrtc;

pub use cuda::{cuda, CaptureStatus, Cuda, StreamDevice};
pub use launch::{KernelSignature, Launch, LaunchConfig, Param};
pub use library::Search;
pub use module::{DeviceAllocation, Function, Module};
pub use nvrtc::{nvrtc, Compiled, Nvrtc, LINEINFO_ENV};

/// What can go wrong below the handlers: loading, compiling, driver calls.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GpuError {
    #[error(
        "could not load {library} (tried: {}). {hint}",
        tried.join("; ")
    )]
    LibraryNotFound {
        library: &'static str,
        tried: Vec<String>,
        hint: &'static str,
    },
    #[error("{library} at {path} lacks the symbol `{symbol}` (too old?): {message}")]
    Symbol {
        library: &'static str,
        path: String,
        symbol: &'static str,
        message: String,
    },
    #[error("CUDA driver call {call} failed: {name} ({code})")]
    Driver {
        call: &'static str,
        code: i32,
        name: String,
    },
    #[error("NVRTC call {call} failed: {message} ({code})")]
    Nvrtc {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error("launch of `{kernel}` refused: {message}")]
    Launch {
        kernel: &'static str,
        message: String,
    },
    #[error("NVRTC failed to compile the RMS norm kernels for {arch}:\n{log}")]
    Compile { arch: String, log: String },
    #[error("{0}")]
    Unsupported(String),
}

impl GpuError {
    /// Whether the error is the device being out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, GpuError::Driver { code: 2, .. })
    }
}

pub type GpuResult<T> = Result<T, GpuError>;
