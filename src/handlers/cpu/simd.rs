//! The instruction set the CPU kernels run with, chosen once per state at instantiation.
//!
//! The kernels are plain Rust loops (see `handlers::math`); [`Kernel::run`] compiles them into a
//! context with the chosen target features enabled (through `pulp`), where they vectorize. The
//! wheel stays portable: detection happens at run time, with a scalar fallback.

use std::fmt;

use half::f16;
use half::slice::HalfFloatSliceExt;

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

    /// Whether float16 rows run through float32's kernels in this context (`cpu::widen`),
    /// converted a block at a time by [`Kernel::f16_to_f32`] and [`Kernel::f32_to_f16`]: the
    /// x86 ones. The scalar context keeps the portable integer conversions, the reference the
    /// others are tested against.
    pub fn has_f16c(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Kernel::Avx2(_) | Kernel::Avx512(_) = self {
            return true;
        }
        false
    }

    /// Whether this is the AVX-512 context, where the explicit loops (`cpu::avx512`) apply.
    pub fn has_avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Kernel::Avx512(_) = self {
            return true;
        }
        false
    }

    /// `dst = src` widened (exact) by `half`'s slice conversion, which takes F16C where the CPU
    /// has it (every CPU with AVX2 does), where [`Kernel::has_f16c`]; false, having written
    /// nothing, elsewhere. `half` calls its F16C function once per 8 elements: LLVM kept the
    /// slice conversion out of line, compiled for the baseline instruction set, even called
    /// alone in a context with F16C enabled (about a fifth of a float16 forward at 1024x1024,
    /// AVX2). Inlining the instructions would take `core::arch` intrinsics in this crate's code,
    /// which keeps `unsafe` to the FFI and driver layers. On AVX-512 they are inlined, through
    /// `pulp`'s safe wrappers of AVX-512F's `vcvtph2ps` (`cpu::avx512::f16_to_f32`); `pulp` has
    /// none for F16C's 256-bit forms, which AVX2 machines would need.
    #[inline(always)]
    pub fn f16_to_f32(self, src: &[f16], dst: &mut [f32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Kernel::Avx512(v4) = self {
            super::avx512::f16_to_f32(v4, src, dst);
            return true;
        }
        if !self.has_f16c() {
            return false;
        }
        src.convert_to_f32_slice(dst);
        true
    }

    /// `dst = src` rounded to nearest even by `half`'s slice conversion (F16C where the CPU has
    /// it; `vcvtps2ph` inlined on AVX-512), where [`Kernel::has_f16c`]; false, having written
    /// nothing, elsewhere.
    #[inline(always)]
    pub fn f32_to_f16(self, src: &[f32], dst: &mut [f16]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Kernel::Avx512(v4) = self {
            super::avx512::f32_to_f16(v4, src, dst);
            return true;
        }
        if !self.has_f16c() {
            return false;
        }
        dst.convert_from_f32_slice(src);
        true
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
