//! Test-only: rmsnorm_ffi's CUDA kernels on a CPU emulator behind a fake libcuda.
//!
//! `build.rs` compiles `rmsnorm.cu` as host C++ (see `cpp/cuda_shim.h` for what is emulated and
//! what is not) into `libemu_kernels.so`, and the fake driver into `libcuda_fake.so`, which the
//! product loads like the real one when `RMSNORM_FFI_LIBCUDA` names it. This crate gives the
//! tests their paths, the fake's test entry points (guarded buffers, streams, capture, counters,
//! other kernel builds), and a way to build the kernels again from an edited source.
//!
//! The `unsafe` here is the FFI to the fake's C entry points; each call says why it is sound.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod build_info {
    include!(concat!(env!("OUT_DIR"), "/build_info.rs"));
}

mod kernel_table;

/// The fake libcuda.
pub fn fake_libcuda() -> PathBuf {
    Path::new(build_info::OUT_DIR).join("libcuda_fake.so")
}

/// The emulated kernels built from the real `rmsnorm.cu`.
pub fn emulated_kernels() -> PathBuf {
    Path::new(build_info::OUT_DIR).join("libemu_kernels.so")
}

/// Builds the emulated kernels from `source` (an edited copy of `rmsnorm.cu`) into
/// `dir/libemu_kernels.so`, with the same compiler and flags as the real build (less the debug
/// information). `pairs`: rmsnorm.cu's `EMU_PAIRS`, the STAMP and FINALIZE_ENTRY lines to
/// compile instead of all of them (a build for a few cases compiles in a third of the time);
/// the kernel table is the build's own. Only the kernels it has can be launched while it is in
/// use ([`Fake::use_kernels`]; the module the product loaded keeps every name).
pub fn build_kernels_from(
    source: &str,
    pairs: Option<&str>,
    dir: &Path,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let cu = dir.join("rmsnorm.cu");
    std::fs::write(&cu, source).map_err(|e| e.to_string())?;
    let object = dir.join("kernels.o");
    let library = dir.join("libemu_kernels.so");
    let table = dir.join("kernel_table.inc");
    let placeholder = format!("\"{}\"", cu.display());
    let pairs = pairs.map(|p| format!("-DEMU_PAIRS={p}"));
    // Without debug information: these builds only have to run (a third faster to compile).
    let args = || {
        build_info::COMPILE_ARGS
            .iter()
            .filter(|a| **a != "-g" && !a.starts_with("-gdwarf") && **a != "-c")
            .map(|a| {
                if a.starts_with("-DEMU_KERNEL_TABLE=") {
                    format!("-DEMU_KERNEL_TABLE=\"{}\"", table.display())
                } else {
                    a.replace("\"EMU_SOURCE_PLACEHOLDER\"", &placeholder)
                }
            })
            .chain(pairs.clone())
    };
    // The kernel table: the entry points this build stamps, from its preprocessed source.
    let mut expand = Command::new(build_info::COMPILER);
    expand
        .args(args())
        .args(["-DEMU_EXPAND", "-E", "-x", "c++"])
        .arg(&cu);
    let out = expand.output().map_err(|e| format!("{expand:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{expand:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let entries = kernel_table::kernel_table(&String::from_utf8_lossy(&out.stdout));
    if entries.is_empty() {
        return Err(format!("no kernels in {}", cu.display()));
    }
    std::fs::write(&table, entries.join("\n") + "\n").map_err(|e| e.to_string())?;
    let mut compile = Command::new(build_info::COMPILER);
    compile.args(args()).arg("-c");
    compile.arg(build_info::KERNELS_CPP).arg("-o").arg(&object);
    run(compile)?;
    let mut link = Command::new(build_info::COMPILER);
    link.arg("-shared")
        .arg("-o")
        .arg(&library)
        .arg(&object)
        .args(build_info::FIBER_OBJECTS);
    run(link)?;
    Ok(library)
}

fn run(mut cmd: Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// Counters of the fake driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub launches: i64,
    pub module_loads: i64,
    pub guard_failures: i64,
    /// Bytes held now in cuMemAlloc allocations.
    pub driver_bytes: i64,
    pub driver_allocations: i64,
    /// Test buffers and driver allocations not yet freed.
    pub outstanding: i64,
    /// Primary-context retains not yet released.
    pub context_retains: i64,
    /// Launches in clusters of more than one block (cuLaunchKernelEx).
    pub cluster_launches: i64,
}

type AllocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type StreamFn = unsafe extern "C" fn(c_int) -> *mut c_void;
type CaptureFn = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type UseKernelsFn = unsafe extern "C" fn(*const c_char) -> c_int;
type CountersFn = unsafe extern "C" fn(*mut i64, c_int);
type LastErrorFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;
type InitFn = unsafe extern "C" fn(u32) -> c_int;

/// The fake driver's test entry points. Opening the same path as the product's library search
/// gives the same library (the dynamic loader keeps one copy), so both see the same state.
pub struct Fake {
    _lib: libloading::Library,
    alloc: AllocFn,
    free: FreeFn,
    stream: StreamFn,
    capture: CaptureFn,
    use_kernels: UseKernelsFn,
    counters: CountersFn,
    last_error: LastErrorFn,
}

impl Fake {
    /// The fake at `path` (normally [`fake_libcuda`]), initialized.
    pub fn open(path: &Path) -> &'static Fake {
        static FAKE: OnceLock<Fake> = OnceLock::new();
        FAKE.get_or_init(|| {
            // SAFETY: loading the fake runs no initializers with preconditions.
            let lib = unsafe { libloading::Library::new(path) }
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            // SAFETY: each name is a function of the fake with the signature given (see
            // cpp/fake_cuda.cpp).
            unsafe {
                let init: InitFn = *lib.get(b"cuInit\0").unwrap();
                assert_eq!(init(0), 0, "the fake's cuInit failed");
                Fake {
                    alloc: *lib.get(b"emu_alloc\0").unwrap(),
                    free: *lib.get(b"emu_free\0").unwrap(),
                    stream: *lib.get(b"emu_stream_create\0").unwrap(),
                    capture: *lib.get(b"emu_stream_set_capture\0").unwrap(),
                    use_kernels: *lib.get(b"emu_use_kernels\0").unwrap(),
                    counters: *lib.get(b"emu_counters\0").unwrap(),
                    last_error: *lib.get(b"emu_last_error\0").unwrap(),
                    _lib: lib,
                }
            }
        })
    }

    /// A guarded buffer holding `bytes`, its data `misalign` bytes past a 256-byte boundary,
    /// filled with 0xff (NaN in every float type).
    pub fn buffer(&'static self, bytes: usize, misalign: usize) -> DeviceBuffer {
        // SAFETY: plain call; the fake returns null or `bytes` writable bytes.
        let ptr = unsafe { (self.alloc)(bytes, misalign) };
        assert!(!ptr.is_null(), "emu_alloc({bytes}) failed");
        DeviceBuffer {
            fake: self,
            ptr,
            bytes,
        }
    }

    /// A stream of device `device`'s primary context, as a raw handle.
    pub fn stream(&self, device: i32) -> usize {
        // SAFETY: plain call.
        let s = unsafe { (self.stream)(device) };
        assert!(!s.is_null(), "no device {device}");
        s as usize
    }

    /// Sets a stream's capture status: 0 none, 1 capturing (global mode), 2 invalidated.
    pub fn set_capture(&self, stream: usize, status: i32) {
        // SAFETY: `stream` came from `stream`; the fake checks it.
        assert_eq!(unsafe { (self.capture)(stream as *mut c_void, status) }, 0);
    }

    /// Runs every later launch on the kernels of `library` (see [`build_kernels_from`]).
    pub fn use_kernels(&self, library: &Path) -> Result<(), String> {
        let path = CString::new(library.display().to_string()).unwrap();
        // SAFETY: a valid C string for the call.
        if unsafe { (self.use_kernels)(path.as_ptr()) } != 0 {
            return Err(self.last_error());
        }
        Ok(())
    }

    pub fn counters(&self) -> Counters {
        let mut v = [0i64; 8];
        // SAFETY: room for the 8 counters asked for.
        unsafe { (self.counters)(v.as_mut_ptr(), 8) };
        Counters {
            launches: v[0],
            module_loads: v[1],
            guard_failures: v[2],
            driver_bytes: v[3],
            driver_allocations: v[4],
            outstanding: v[5],
            context_retains: v[6],
            cluster_launches: v[7],
        }
    }

    /// The last error the fake reported (also printed on stderr when it happened).
    pub fn last_error(&self) -> String {
        let mut buf = vec![0u8; 2048];
        // SAFETY: `buf` has the capacity passed.
        unsafe { (self.last_error)(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }
}

/// A guarded buffer of the fake's "device" memory (host memory), freed on drop; freeing checks
/// its guard zones, and so does every launch.
pub struct DeviceBuffer {
    fake: &'static Fake,
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: the buffer is plain memory owned by this value.
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared references only read the memory or its address; writing takes `&mut`.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// The "device" address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn write(&mut self, data: &[u8]) {
        assert!(data.len() <= self.bytes);
        // SAFETY: the buffer has `bytes` writable bytes; no launch runs while we hold `&mut`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.cast::<u8>(), data.len()) };
    }

    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes];
        // SAFETY: the buffer has `bytes` readable bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.cast::<u8>(), out.as_mut_ptr(), self.bytes)
        };
        out
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by emu_alloc, freed once.
        let bad = unsafe { (self.fake.free)(self.ptr) };
        if bad != 0 && !std::thread::panicking() {
            panic!(
                "a guard zone of a {}-byte buffer was overwritten: {}",
                self.bytes,
                self.fake.last_error()
            );
        }
    }
}

/// The kernel source's host half conversions (`Elem<f16_t>::load/store` as the emulator
/// compiles them).
pub struct HalfConversions {
    _lib: libloading::Library,
    pub to_f32: unsafe extern "C" fn(u16) -> f32,
    pub from_f32: unsafe extern "C" fn(f32) -> u16,
}

impl HalfConversions {
    pub fn load() -> HalfConversions {
        // SAFETY: loading the kernels library runs no initializers with preconditions.
        let lib = unsafe { libloading::Library::new(emulated_kernels()) }.unwrap();
        // SAFETY: the two functions have these signatures (cpp/kernels.cpp).
        unsafe {
            HalfConversions {
                to_f32: *lib.get(b"emu_f16_to_f32\0").unwrap(),
                from_f32: *lib.get(b"emu_f32_to_f16\0").unwrap(),
                _lib: lib,
            }
        }
    }

    pub fn to_f32(&self, bits: u16) -> f32 {
        // SAFETY: a pure function.
        unsafe { (self.to_f32)(bits) }
    }

    pub fn from_f32(&self, value: f32) -> u16 {
        // SAFETY: a pure function.
        unsafe { (self.from_f32)(value) }
    }
}
