//! Finding and opening NVRTC and libcuda (the search order is in the module docs above).
#![allow(unsafe_code)]

use std::ffi::CString;
use std::path::{Path, PathBuf};

use super::{GpuError, GpuResult};

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

    pub(super) fn nvrtc_candidates(&self) -> Vec<String> {
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

    pub(super) fn libcuda_candidates(&self) -> Vec<String> {
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
pub(super) fn open_first(
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
pub(super) fn symbol<T: Copy>(
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
