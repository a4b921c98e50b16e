//! The CUDA driver API and NVRTC, loaded at run time through small function tables.
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
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr;

use once_cell::sync::OnceCell;

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

// ---------------------------------------------------------------------------------------------
// Library search
// ---------------------------------------------------------------------------------------------

/// Where to look for NVRTC and libcuda (see the module docs for the default order).
#[derive(Debug, Clone, Default)]
pub struct Search {
    /// An explicit NVRTC path, tried first.
    pub nvrtc: Option<PathBuf>,
    /// An explicit libcuda path, tried first.
    pub libcuda: Option<PathBuf>,
    /// site-packages directories holding pip's `nvidia/...` packages.
    pub site_packages: Vec<PathBuf>,
    /// Whether to try the system (dynamic linker, /usr/local/cuda) after the above.
    pub system: bool,
}

impl Search {
    /// The default search: environment overrides, the site-packages of the objects mapped into
    /// this process, then the system.
    pub fn from_env() -> Search {
        let mut site_packages: Vec<PathBuf> = std::env::var_os("RMSNORM_FFI_SITE_PACKAGES")
            .map(|v| std::env::split_paths(&v).collect())
            .unwrap_or_default();
        for dir in mapped_site_packages() {
            if !site_packages.contains(&dir) {
                site_packages.push(dir);
            }
        }
        Search {
            nvrtc: std::env::var_os("RMSNORM_FFI_NVRTC").map(PathBuf::from),
            libcuda: std::env::var_os("RMSNORM_FFI_LIBCUDA").map(PathBuf::from),
            site_packages,
            system: true,
        }
    }

    fn nvrtc_candidates(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(p) = &self.nvrtc {
            out.push(p.display().to_string());
        }
        for sp in &self.site_packages {
            for rel in [
                "nvidia/cu13/lib/libnvrtc.so.13",
                "nvidia/cuda_nvrtc/lib/libnvrtc.so.13",
                "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
            ] {
                out.push(sp.join(rel).display().to_string());
            }
        }
        if self.system {
            out.extend(
                [
                    "libnvrtc.so.13",
                    "libnvrtc.so.12",
                    "libnvrtc.so",
                    "/usr/local/cuda/lib64/libnvrtc.so",
                ]
                .map(String::from),
            );
        }
        out
    }

    fn libcuda_candidates(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(p) = &self.libcuda {
            out.push(p.display().to_string());
        }
        if self.system {
            out.extend(
                [
                    "libcuda.so.1",
                    "libcuda.so",
                    "/usr/lib/wsl/lib/libcuda.so.1",
                ]
                .map(String::from),
            );
        }
        out
    }
}

/// The site-packages (or dist-packages) directories of the shared objects mapped into this
/// process: where pip put jaxlib and the CUDA plugin, and so the `nvidia/*` packages.
fn mapped_site_packages() -> Vec<PathBuf> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        for marker in ["/site-packages/", "/dist-packages/"] {
            if let Some(i) = path.find(marker) {
                let dir = PathBuf::from(&path[..i + marker.len() - 1]);
                if !out.contains(&dir) {
                    out.push(dir);
                }
            }
        }
    }
    out
}

/// Opens the first candidate that loads; a path candidate that does not exist is skipped
/// quietly (it is still listed in the error).
fn open_first(
    library: &'static str,
    candidates: &[String],
    hint: &'static str,
) -> GpuResult<(libloading::Library, String)> {
    let mut tried = Vec::new();
    for candidate in candidates {
        if candidate.contains('/') && !Path::new(candidate).exists() {
            tried.push(format!("{candidate} (absent)"));
            continue;
        }
        // SAFETY: loading NVRTC / libcuda runs their initializers, which have no preconditions
        // on our side; we never unload them (the `Library` is kept for the process's life).
        match unsafe { libloading::Library::new(candidate) } {
            Ok(lib) => return Ok((lib, candidate.clone())),
            Err(e) => tried.push(format!("{candidate} ({e})")),
        }
    }
    Err(GpuError::LibraryNotFound {
        library,
        tried,
        hint,
    })
}

/// Looks a function up; `T` must be the function's C signature (the tables below are the only
/// callers, each with the signature from the CUDA headers).
fn symbol<T: Copy>(
    lib: &libloading::Library,
    library: &'static str,
    path: &str,
    name: &'static str,
) -> GpuResult<T> {
    let cname = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: each caller names a function whose C signature is `T`.
    unsafe { lib.get::<T>(cname.as_bytes_with_nul()) }
        .map(|s| *s)
        .map_err(|e| GpuError::Symbol {
            library,
            path: path.to_string(),
            symbol: name,
            message: e.to_string(),
        })
}

// ---------------------------------------------------------------------------------------------
// NVRTC
// ---------------------------------------------------------------------------------------------

type NvrtcProgram = *mut c_void;

/// NVRTC's entry points (signatures from nvrtc.h, stable since CUDA 11.2).
pub struct Nvrtc {
    _lib: libloading::Library,
    path: String,
    version: (i32, i32),
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    create_program: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile_program: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int,
    get_program_log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    get_program_log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    get_ptx_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    get_ptx: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    get_cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    get_cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    get_num_supported_archs: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_supported_archs: unsafe extern "C" fn(*mut c_int) -> c_int,
    destroy_program: unsafe extern "C" fn(*mut NvrtcProgram) -> c_int,
}

/// What one compilation produced.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// `compute_XY` (PTX only) or `sm_XY` (PTX and a cubin).
    pub arch: String,
    pub ptx: String,
    pub cubin: Option<Vec<u8>>,
    pub log: String,
}

impl Compiled {
    /// The image for `cuModuleLoadData`: the cubin when there is one, else the NUL-terminated
    /// PTX (JIT-compiled by the driver).
    pub fn image(&self) -> Vec<u8> {
        match &self.cubin {
            Some(c) => c.clone(),
            None => {
                let mut v = self.ptx.as_bytes().to_vec();
                v.push(0);
                v
            }
        }
    }
}

/// Frees an NVRTC program however compilation ends.
struct ProgramGuard<'a>(&'a Nvrtc, NvrtcProgram);
impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by this NVRTC and is destroyed once.
        unsafe { (self.0.destroy_program)(&mut self.1) };
    }
}

impl Nvrtc {
    /// Loads NVRTC from the first location of `search` that works.
    pub fn load(search: &Search) -> GpuResult<Nvrtc> {
        const LIB: &str = "NVRTC (libnvrtc)";
        let (lib, path) = open_first(
            LIB,
            &search.nvrtc_candidates(),
            "Install jax[cuda12] or jax[cuda13] (they bring the nvidia-cuda-nvrtc package), or \
             set RMSNORM_FFI_NVRTC to libnvrtc.so's path.",
        )?;
        macro_rules! f {
            ($name:literal) => {
                symbol(&lib, LIB, &path, $name)?
            };
        }
        let mut nvrtc = Nvrtc {
            get_error_string: f!("nvrtcGetErrorString"),
            create_program: f!("nvrtcCreateProgram"),
            compile_program: f!("nvrtcCompileProgram"),
            get_program_log_size: f!("nvrtcGetProgramLogSize"),
            get_program_log: f!("nvrtcGetProgramLog"),
            get_ptx_size: f!("nvrtcGetPTXSize"),
            get_ptx: f!("nvrtcGetPTX"),
            get_cubin_size: f!("nvrtcGetCUBINSize"),
            get_cubin: f!("nvrtcGetCUBIN"),
            get_num_supported_archs: f!("nvrtcGetNumSupportedArchs"),
            get_supported_archs: f!("nvrtcGetSupportedArchs"),
            destroy_program: f!("nvrtcDestroyProgram"),
            version: (0, 0),
            path: path.clone(),
            _lib: lib,
        };
        let version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
            symbol(&nvrtc._lib, LIB, &path, "nvrtcVersion")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both out-pointers are valid.
        let rc = unsafe { version(&mut major, &mut minor) };
        nvrtc.check("nvrtcVersion", rc)?;
        nvrtc.version = (major, minor);
        Ok(nvrtc)
    }

    /// Where NVRTC was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    fn check(&self, call: &'static str, rc: c_int) -> GpuResult<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let msg = unsafe { (self.get_error_string)(rc) };
        let message = if msg.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        Err(GpuError::Nvrtc {
            call,
            code: rc,
            message,
        })
    }

    /// The real architectures (`sm_XY` as XY) this NVRTC can build cubins for.
    pub fn supported_archs(&self) -> GpuResult<Vec<i32>> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        self.check("nvrtcGetNumSupportedArchs", unsafe {
            (self.get_num_supported_archs)(&mut n)
        })?;
        let mut archs = vec![0 as c_int; n.max(0) as usize];
        // SAFETY: `archs` has room for the `n` entries NVRTC writes.
        self.check("nvrtcGetSupportedArchs", unsafe {
            (self.get_supported_archs)(archs.as_mut_ptr())
        })?;
        Ok(archs)
    }

    /// Compiles `source` for `arch` (`compute_XY`: PTX only; `sm_XY`: PTX and cubin).
    pub fn compile(&self, source: &str, name: &str, arch: &str) -> GpuResult<Compiled> {
        let src = CString::new(source)
            .map_err(|_| GpuError::Unsupported("kernel source contains a NUL byte".into()))?;
        let cname = CString::new(name)
            .map_err(|_| GpuError::Unsupported("program name contains a NUL byte".into()))?;
        let mut prog: NvrtcProgram = ptr::null_mut();
        // SAFETY: valid source and name strings, no headers.
        let rc = unsafe {
            (self.create_program)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                ptr::null(),
                ptr::null(),
            )
        };
        self.check("nvrtcCreateProgram", rc)?;
        let guard = ProgramGuard(self, prog);
        let options: Vec<CString> = [
            format!("--gpu-architecture={arch}"),
            "-std=c++17".to_string(),
            "-default-device".to_string(),
        ]
        .into_iter()
        .map(|o| CString::new(o).expect("options have no NUL"))
        .collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: `option_ptrs` holds valid C strings that outlive the call.
        let rc = unsafe {
            (self.compile_program)(guard.1, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        let log = self.read(guard.1, self.get_program_log_size, self.get_program_log)?;
        let log = String::from_utf8_lossy(log.split(|&b| b == 0).next().unwrap_or(&[])).into();
        if rc != 0 {
            return Err(GpuError::Compile {
                arch: arch.to_string(),
                log,
            });
        }
        let ptx = self.read(guard.1, self.get_ptx_size, self.get_ptx)?;
        let ptx = String::from_utf8_lossy(ptx.split(|&b| b == 0).next().unwrap_or(&[])).into();
        let cubin = if arch.starts_with("sm_") {
            Some(self.read(guard.1, self.get_cubin_size, self.get_cubin)?)
        } else {
            None
        };
        Ok(Compiled {
            arch: arch.to_string(),
            ptx,
            cubin,
            log,
        })
    }

    fn read(
        &self,
        prog: NvrtcProgram,
        size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
        get: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    ) -> GpuResult<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: `prog` is a live program; valid out-pointer.
        self.check("nvrtcGet*Size", unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` has the `n` bytes NVRTC writes.
        self.check("nvrtcGet*", unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
        buf.truncate(n);
        Ok(buf)
    }
}

static NVRTC: OnceCell<Result<Nvrtc, GpuError>> = OnceCell::new();

/// The process's NVRTC, loaded on first use with [`Search::from_env`].
pub fn nvrtc() -> GpuResult<&'static Nvrtc> {
    NVRTC
        .get_or_init(|| Nvrtc::load(&Search::from_env()))
        .as_ref()
        .map_err(Clone::clone)
}

// ---------------------------------------------------------------------------------------------
// The driver API
// ---------------------------------------------------------------------------------------------

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuModule = *mut c_void;
type CuFunction = *mut c_void;
type CuDevicePtr = u64;

const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// The driver API entry points we use (signatures from cuda.h; `_v2` where the header maps
/// the name to one).
pub struct Cuda {
    _lib: libloading::Library,
    path: String,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_push: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    module_unload: unsafe extern "C" fn(CuModule) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    occupancy: unsafe extern "C" fn(*mut c_int, CuFunction, c_int, usize) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
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
            module_load_data: f!("cuModuleLoadData"),
            module_unload: f!("cuModuleUnload"),
            module_get_function: f!("cuModuleGetFunction"),
            mem_alloc: f!("cuMemAlloc_v2"),
            mem_free: f!("cuMemFree_v2"),
            occupancy: f!("cuOccupancyMaxActiveBlocksPerMultiprocessor"),
            launch_kernel: f!("cuLaunchKernel"),
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

    fn check(&self, call: &'static str, rc: CuResult) -> GpuResult<()> {
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

    fn device(&self, ordinal: i32) -> GpuResult<CuDevice> {
        let mut dev = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGet", unsafe {
            (self.device_get)(&mut dev, ordinal)
        })?;
        Ok(dev)
    }

    fn attribute(&self, dev: CuDevice, attr: c_int) -> GpuResult<i32> {
        let mut v = 0;
        // SAFETY: valid out-pointer.
        self.check("cuDeviceGetAttribute", unsafe {
            (self.device_get_attribute)(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// Compute capability as 10 * major + minor (90 for an H100/H200).
    pub fn capability(&self, ordinal: i32) -> GpuResult<i32> {
        let dev = self.device(ordinal)?;
        Ok(10 * self.attribute(dev, ATTR_COMPUTE_CAPABILITY_MAJOR)?
            + self.attribute(dev, ATTR_COMPUTE_CAPABILITY_MINOR)?)
    }

    pub fn sm_count(&self, ordinal: i32) -> GpuResult<i32> {
        let dev = self.device(ordinal)?;
        self.attribute(dev, ATTR_MULTIPROCESSOR_COUNT)
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
struct CurrentContext<'a> {
    cuda: &'a Cuda,
    pushed: bool,
}

impl<'a> CurrentContext<'a> {
    fn enter(cuda: &'a Cuda, ctx: CuContext) -> GpuResult<Self> {
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
        // SAFETY: `ctx` is a retained primary context.
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

/// The kernel families, each with its own parameter list (see rmsnorm.cu).
#[derive(Debug, Clone, Copy)]
pub enum KernelArgs {
    Forward {
        x: u64,
        w: u64,
        y: u64,
        rstd: u64,
        rows: i64,
        n: i32,
        team: i32,
        eps: f32,
        rows_per_group: i64,
    },
    Backward {
        x: u64,
        w: u64,
        rstd: u64,
        dy: u64,
        dx: u64,
        partial: u64,
        rows: i64,
        n: i32,
        team: i32,
        chunk: i64,
    },
    Finalize {
        partial: u64,
        blocks: i32,
        n: i32,
        dw: u64,
    },
}

impl KernelArgs {
    /// Whether a kernel of this name takes these arguments (names tell the family).
    fn fits(&self, name: &str) -> bool {
        match self {
            KernelArgs::Forward { .. } => name.starts_with("rmsnorm_fwd_"),
            KernelArgs::Backward { .. } => {
                name.starts_with("rmsnorm_bwd_") && !name.starts_with("rmsnorm_bwd_finalize_")
            }
            KernelArgs::Finalize { .. } => name.starts_with("rmsnorm_bwd_finalize_"),
        }
    }
}

/// Grid, block and dynamic shared memory of a launch (1-D).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32),
    pub block: (u32, u32),
    pub shared_bytes: u32,
}

/// The kernels loaded into one device's primary context, and that device's scratch memory.
/// Dropping it frees the scratch, unloads the module and releases the context.
pub struct DeviceModule {
    cuda: &'static Cuda,
    ordinal: i32,
    device: CuDevice,
    ctx: CuContext,
    module: CuModule,
    functions: Vec<(&'static str, CuFunction)>,
    scratch: CuDevicePtr,
    scratch_bytes: usize,
}

// SAFETY: the handles are plain driver handles, valid from any thread (the driver API is
// thread-safe); the struct is never mutated after construction.
unsafe impl Send for DeviceModule {}
// SAFETY: as above; shared use only launches kernels and reads the handles.
unsafe impl Sync for DeviceModule {}

impl DeviceModule {
    /// Loads `image` (a cubin or NUL-terminated PTX) into device `ordinal`'s primary context,
    /// looks up `names`, and allocates `scratch_bytes` of device memory (none when 0).
    pub fn load(
        ordinal: i32,
        image: &[u8],
        names: &[&'static str],
        scratch_bytes: usize,
    ) -> GpuResult<DeviceModule> {
        let cuda = cuda()?;
        let device = cuda.device(ordinal)?;
        let mut ctx: CuContext = ptr::null_mut();
        // SAFETY: valid out-pointer; the retain is released in Drop (or below on failure).
        cuda.check("cuDevicePrimaryCtxRetain", unsafe {
            (cuda.primary_ctx_retain)(&mut ctx, device)
        })?;
        // From here on, Drop cleans up whatever was acquired.
        let mut this = DeviceModule {
            cuda,
            ordinal,
            device,
            ctx,
            module: ptr::null_mut(),
            functions: Vec::with_capacity(names.len()),
            scratch: 0,
            scratch_bytes: 0,
        };
        let _current = CurrentContext::enter(cuda, ctx)?;
        // SAFETY: `image` is a cubin or a NUL-terminated PTX string, alive for the call.
        cuda.check("cuModuleLoadData", unsafe {
            (cuda.module_load_data)(&mut this.module, image.as_ptr().cast())
        })?;
        for &name in names {
            let cname = CString::new(name).expect("kernel names have no NUL");
            let mut f: CuFunction = ptr::null_mut();
            // SAFETY: live module, valid name and out-pointer.
            cuda.check("cuModuleGetFunction", unsafe {
                (cuda.module_get_function)(&mut f, this.module, cname.as_ptr())
            })?;
            this.functions.push((name, f));
        }
        if scratch_bytes > 0 {
            // SAFETY: valid out-pointer; freed once in Drop.
            cuda.check("cuMemAlloc", unsafe {
                (cuda.mem_alloc)(&mut this.scratch, scratch_bytes)
            })?;
            this.scratch_bytes = scratch_bytes;
        }
        Ok(this)
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The scratch allocation (address, bytes); fixed for the life of the module.
    pub fn scratch(&self) -> (u64, usize) {
        (self.scratch, self.scratch_bytes)
    }

    /// Resident blocks per SM of kernel `index` for a block size and dynamic shared memory.
    pub fn occupancy(&self, index: usize, block: u32, shared_bytes: u32) -> GpuResult<i32> {
        let (_, f) = self.function(index)?;
        let _current = CurrentContext::enter(self.cuda, self.ctx)?;
        let mut blocks = 0;
        // SAFETY: live function, valid out-pointer.
        self.cuda
            .check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
                (self.cuda.occupancy)(&mut blocks, f, block as c_int, shared_bytes as usize)
            })?;
        Ok(blocks)
    }

    fn function(&self, index: usize) -> GpuResult<(&'static str, CuFunction)> {
        self.functions
            .get(index)
            .copied()
            .ok_or_else(|| GpuError::Unsupported(format!("no kernel #{index} in the module")))
    }

    /// Enqueues kernel `index` on `stream` (XLA's `CUstream`). Only enqueues: no
    /// synchronization, no allocation, so it may be captured into a CUDA graph.
    pub fn launch(
        &self,
        index: usize,
        config: LaunchConfig,
        stream: crate::ffi::Stream,
        args: KernelArgs,
    ) -> GpuResult<()> {
        let (name, f) = self.function(index)?;
        if !args.fits(name) {
            return Err(GpuError::Unsupported(format!(
                "kernel `{name}` does not take {args:?}"
            )));
        }
        let _current = CurrentContext::enter(self.cuda, self.ctx)?;
        // The parameter values live in these locals until cuLaunchKernel returns (it copies
        // them); `params` points at each, in the kernel's parameter order.
        let mut storage = [0u64; 10];
        let mut count = 0;
        let mut push = |bytes: &[u8]| {
            let mut word = [0u8; 8];
            word[..bytes.len()].copy_from_slice(bytes);
            storage[count] = u64::from_ne_bytes(word);
            count += 1;
        };
        match args {
            KernelArgs::Forward {
                x,
                w,
                y,
                rstd,
                rows,
                n,
                team,
                eps,
                rows_per_group,
            } => {
                for p in [x, w, y, rstd] {
                    push(&p.to_ne_bytes());
                }
                push(&rows.to_ne_bytes());
                push(&n.to_ne_bytes());
                push(&team.to_ne_bytes());
                push(&eps.to_ne_bytes());
                push(&rows_per_group.to_ne_bytes());
            }
            KernelArgs::Backward {
                x,
                w,
                rstd,
                dy,
                dx,
                partial,
                rows,
                n,
                team,
                chunk,
            } => {
                for p in [x, w, rstd, dy, dx, partial] {
                    push(&p.to_ne_bytes());
                }
                push(&rows.to_ne_bytes());
                push(&n.to_ne_bytes());
                push(&team.to_ne_bytes());
                push(&chunk.to_ne_bytes());
            }
            KernelArgs::Finalize {
                partial,
                blocks,
                n,
                dw,
            } => {
                push(&partial.to_ne_bytes());
                push(&blocks.to_ne_bytes());
                push(&n.to_ne_bytes());
                push(&dw.to_ne_bytes());
            }
        }
        // Each value's bytes sit at the start of its own 8-byte word.
        let mut params: [*mut c_void; 10] = [ptr::null_mut(); 10];
        for (i, p) in params.iter_mut().enumerate().take(count) {
            *p = (&mut storage[i] as *mut u64).cast();
        }
        // SAFETY: `f` is a live kernel whose parameters are exactly the family `args` belongs
        // to (checked by name above; the order matches rmsnorm.cu); `params` points to `count`
        // values of the right sizes that outlive the call; `stream` is XLA's stream of this
        // context's device.
        let rc = unsafe {
            (self.cuda.launch_kernel)(
                f,
                config.grid.0,
                config.grid.1,
                1,
                config.block.0,
                config.block.1,
                1,
                config.shared_bytes,
                stream.as_raw(),
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        self.cuda.check("cuLaunchKernel", rc)
    }
}

impl Drop for DeviceModule {
    fn drop(&mut self) {
        if let Ok(_current) = CurrentContext::enter(self.cuda, self.ctx) {
            if self.scratch != 0 {
                // SAFETY: allocated by cuMemAlloc in `load`, freed once. Work that used it was
                // enqueued by executables XLA has finished with before deleting the state.
                unsafe { (self.cuda.mem_free)(self.scratch) };
            }
            if !self.module.is_null() {
                // SAFETY: loaded in `load`, unloaded once.
                unsafe { (self.cuda.module_unload)(self.module) };
            }
        }
        // SAFETY: balances the retain in `load`.
        unsafe { (self.cuda.primary_ctx_release)(self.device) };
    }
}
