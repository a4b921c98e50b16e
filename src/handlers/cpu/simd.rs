//! The instruction set the CPU kernels run with, chosen once per state at instantiation.
//!
//! The kernels are plain Rust loops (see `handlers::math`); [`Kernel::run`] compiles them into a
//! context with the chosen target features enabled (through `pulp`), where they vectorize. The
//! wheel stays portable: detection happens at run time, with a scalar fallback.

use std::fmt;

/// An instruction set available on this CPU.
#[derive(Clone, Copy)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(pulp::x86::V3),
    #[cfg(target_arch = "x86_64")]
    Avx512(pulp::x86::V4),
    #[cfg(target_arch = "aarch64")]
    Neon(pulp::aarch64::Neon),
}

impl Kernel {
    /// The best instruction set this CPU has, or the one `RMSNORM_FFI_ISA` names (`scalar`,
    /// `avx2`, `avx512`, `neon`) if this CPU has it: for benchmarks, and for ruling the SIMD
    /// paths in or out when chasing a numerical question.
    pub fn detect() -> Kernel {
        let available = Kernel::available();
        if let Ok(wanted) = std::env::var("RMSNORM_FFI_ISA") {
            if let Some(k) = available.iter().find(|k| k.name() == wanted.trim()) {
                return *k;
            }
        }
        available.into_iter().last().unwrap_or(Kernel::Scalar)
    }

    /// Every instruction set this CPU can run, scalar first (for tests and benchmarks).
    pub fn available() -> Vec<Kernel> {
        let mut kernels = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(v3) = pulp::x86::V3::try_new() {
                kernels.push(Kernel::Avx2(v3));
            }
            if let Some(v4) = pulp::x86::V4::try_new() {
                kernels.push(Kernel::Avx512(v4));
            }
        }
        #[cfg(target_arch = "aarch64")]
        if let Some(neon) = pulp::aarch64::Neon::try_new() {
            kernels.push(Kernel::Neon(neon));
        }
        kernels
    }

    /// Runs `f` compiled for this instruction set.
    #[inline(always)]
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        use pulp::Simd;
        match self {
            Kernel::Scalar => pulp::Scalar::new().vectorize(f),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2(simd) => simd.vectorize(f),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512(simd) => simd.vectorize(f),
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon(simd) => simd.vectorize(f),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2(_) => "avx2",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512(_) => "avx512",
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon(_) => "neon",
        }
    }
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
