//! NVRTC: compiles the CUDA C source to PTX (and a cubin when it knows the architecture).
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;

use once_cell::sync::OnceCell;

use super::library::{open_first, symbol, Search};
use super::{GpuError, GpuResult};

/// Set to 1 to compile with `-lineinfo` (source lines in the PTX/cubin, for compute-sanitizer
/// and profilers to name); read once, when the kernels are compiled.
pub const LINEINFO_ENV: &str = "RMSNORM_FFI_NVRTC_LINEINFO";

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
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "-std=c++17".to_string(),
            "-default-device".to_string(),
        ];
        if lineinfo_requested() {
            options.push("-lineinfo".to_string());
        }
        let options: Vec<CString> = options
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

/// Whether [`LINEINFO_ENV`] asks for `-lineinfo`.
pub fn lineinfo_requested() -> bool {
    std::env::var(LINEINFO_ENV).is_ok_and(|v| v == "1")
}
