//! RMS norm math shared by the platforms: element types, accumulation, one row of the forward
//! and backward passes, and the software-pipelined loops over many rows that the CPU runs
//! (bit-identical to row by row, and tested so).
//!
//! Forward: `rstd = 1 / sqrt(mean(x^2) + eps)`, `y = x * rstd * w`.
//! Backward, with `xhat = x * rstd` and `g = dy * w`:
//! `dx = rstd * (g - xhat * c)` with `c = mean(g * xhat) = rstd * mean(g * x)`,
//! `dw = sum over rows of dy * xhat`. The first pass sums `g * x` and `x^2` together, so a
//! backward that is not given rstd takes it from that pass, with the forward's bits.
//!
//! Elements are widened to the accumulator type (f32, or f64 for f64 input) on load and
//! narrowed on store. Sums along a row use [`LANES`] independent accumulators, so they
//! vectorize, in two levels ([`RowSum`]): each lane sums [`SUM_BLOCK`]` / LANES` elements in the
//! accumulator type (128 each, per block of 2048), then adds that block sum into a compensated
//! float64 lane. So the error does not grow with the row length (a float32 sum along 2^24
//! elements was off by thousands of eps), and the result is the same on every instruction set
//! (a fixed order, no fused multiply-add). The float64 level costs a few scalar operations per
//! block (blocks of 256 cost the forward about 30% at rows of 4096; 2048, a few percent).
//! Weight gradients accumulate over rows in [`Accum::Wide`] (float64, or a compensated float64
//! pair for float64 input), for the same reason along the other axis, two rows at a time: a
//! pair's two terms are added in the accumulator type and widened once, which halves the
//! float64 work that was a quarter of the float32 backward and adds one rounding per pair
//! (a model of 2^20 rows of 64 gave 0.42 float32 eps against 0.37 row by row).
//! Every function here is `#[inline(always)]`: it is compiled into the caller's SIMD context
//! (see `cpu::simd`).

pub mod layer;

use std::ops::{Add, Div, Mul, Sub};

use half::{bf16, f16};

use xla_ffi_bundles::ffi::NativeType;

/// Independent partial sums per reduction (a multiple of every SIMD width used).
pub const LANES: usize = 16;

/// An accumulator type: f32 or f64.
pub trait Accum:
    NativeType
    + Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NAN: Self;
    fn from_usize(n: usize) -> Self;
    /// The weight-gradient accumulator over rows.
    type Wide: WideSum;
    fn from_f32(v: f32) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn sqrt(self) -> Self;
    fn load<E: Element>(e: E) -> Self;
    fn store<E: Element>(self) -> E;
}

/// A sum over many terms, kept wider than the terms: float64 for float32 terms (their rounding
/// errors are far below float32's), a compensated pair for float64 terms.
pub trait WideSum: Copy + Default + Send + Sync + 'static {
    fn add(self, v: f64) -> Self;
    fn merge(self, other: Self) -> Self;
    fn value(self) -> f64;
    /// These sums as float64 values, when they are plain float64 (for the explicit AVX-512
    /// loops, `cpu::avx512`).
    fn typed_mut(_s: &mut [Self]) -> Option<&mut [f64]> {
        None
    }
}

impl WideSum for f64 {
    #[inline(always)]
    fn typed_mut(s: &mut [Self]) -> Option<&mut [f64]> {
        Some(s)
    }
    #[inline(always)]
    fn add(self, v: f64) -> Self {
        self + v
    }
    #[inline(always)]
    fn merge(self, other: Self) -> Self {
        self + other
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self
    }
}

/// A float64 sum with its rounding error carried alongside (Knuth's TwoSum), for float64
/// terms: the error of the sum stays near one float64 eps however many terms there are.
#[derive(Clone, Copy, Default, Debug)]
#[repr(C)]
pub struct Compensated {
    hi: f64,
    lo: f64,
}

/// `a + b` and its exact rounding error.
#[inline(always)]
fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

impl WideSum for Compensated {
    #[inline(always)]
    fn add(self, v: f64) -> Self {
        let (hi, e) = two_sum(self.hi, v);
        Compensated {
            hi,
            lo: self.lo + e,
        }
    }
    #[inline(always)]
    fn merge(self, other: Self) -> Self {
        let (hi, e) = two_sum(self.hi, other.hi);
        Compensated {
            hi,
            lo: self.lo + other.lo + e,
        }
    }
    #[inline(always)]
    fn value(self) -> f64 {
        // An infinite sum has a NaN error term (inf - inf): the sum alone is the answer.
        if self.hi.is_finite() {
            self.hi + self.lo
        } else {
            self.hi
        }
    }
}

impl Accum for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NAN: Self = f32::NAN;
    type Wide = f64;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_usize(n: usize) -> Self {
        n as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn load<E: Element>(e: E) -> Self {
        e.to_f32()
    }
    #[inline(always)]
    fn store<E: Element>(self) -> E {
        E::from_f32(self)
    }
}

impl Accum for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NAN: Self = f64::NAN;
    type Wide = Compensated;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_usize(n: usize) -> Self {
        n as f64
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as f64
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn load<E: Element>(e: E) -> Self {
        e.to_f64()
    }
    #[inline(always)]
    fn store<E: Element>(self) -> E {
        E::from_f64(self)
    }
}

/// A slice of one of the element types the explicit AVX-512 loops take (`cpu::avx512`), as its
/// concrete type; `Other` sends a call to the portable loops here.
pub enum Typed<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    Other,
}

/// [`Typed`] for an output slice.
pub enum TypedMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
    Other,
}

/// A floating-point element type of x, weight, dy and the outputs.
pub trait Element: NativeType + Default {
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn from_f32(v: f32) -> Self;
    fn from_f64(v: f64) -> Self;
    /// This slice as its concrete type, for the types the explicit AVX-512 loops cover.
    fn typed(_s: &[Self]) -> Typed<'_> {
        Typed::Other
    }
    /// [`Element::typed`] for an output slice.
    fn typed_mut(_s: &mut [Self]) -> TypedMut<'_> {
        TypedMut::Other
    }
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn typed(s: &[Self]) -> Typed<'_> {
        Typed::F32(s)
    }
    #[inline(always)]
    fn typed_mut(s: &mut [Self]) -> TypedMut<'_> {
        TypedMut::F32(s)
    }
}

impl Element for f64 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// bf16 -> f32 is exact: the bf16 bits are the top half of the f32's.
#[inline(always)]
fn bf16_to_f32(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// f32 -> bf16, rounding to nearest even, NaN kept quiet: the same results as
/// `half::bf16::from_f32`, written branch-free so that it vectorizes.
#[inline(always)]
fn f32_to_bf16(v: f32) -> bf16 {
    // The choice is made on 32-bit lanes and narrowed once: on AVX2 that is one blend and one
    // pack instead of packing both candidates and the mask.
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    let quiet_nan = bits | 0x0040_0000;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    bf16::from_bits(((if is_nan { quiet_nan } else { rounded }) >> 16) as u16)
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        bf16_to_f32(self) as f64
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f32_to_bf16(v)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline(always)]
    fn typed(s: &[Self]) -> Typed<'_> {
        Typed::Bf16(s)
    }
    #[inline(always)]
    fn typed_mut(s: &mut [Self]) -> TypedMut<'_> {
        TypedMut::Bf16(s)
    }
}

/// f16 -> f32, exact (NaNs quieted, as `half::f16::to_f32`), branch-free integer and exact
/// float operations so that the loops vectorize: `half`'s conversion checks the CPU for F16C at
/// every call and stays scalar (float16 rows cost about 10x bfloat16's). The same bits on every
/// instruction set, and under any flush-to-zero mode (the one float operation scales an integer
/// below 1024 by 2^-24: a normal result). The RMS norm's AVX-512 loops convert with F16C
/// instead (`cpu/avx512.rs`, `impl Lane for f16`: the same bits, about 8x faster there).
#[inline(always)]
fn f16_to_f32(v: f16) -> f32 {
    let h = u32::from(v.to_bits());
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    let normal = ((exp + 112) << 23) | (man << 13);
    let special = 0x7f80_0000 | (man << 13) | if man != 0 { 0x0040_0000 } else { 0 };
    let small = ((man as f32) * f32::from_bits(0x3380_0000)).to_bits(); // man * 2^-24
    let magnitude = if exp == 0 {
        small
    } else if exp == 0x1f {
        special
    } else {
        normal
    };
    f32::from_bits(sign | magnitude)
}

/// f32 -> f16, rounding to nearest even (overflow to infinity, NaN quieted keeping its top
/// payload bits): the same results as `half::f16::from_f32`, in integer operations only, so
/// that it vectorizes and gives the same bits everywhere.
#[inline(always)]
fn f32_to_f16(v: f32) -> f16 {
    let x = v.to_bits();
    let sign = (x >> 16) & 0x8000;
    let ax = x & 0x7fff_ffff;
    // Normal halves (|v| >= 2^-14): rebias the exponent by 112, round 13 bits away.
    let t = ax.wrapping_sub(0x3800_0000);
    let normal = t.wrapping_add(0xfff + ((t >> 13) & 1)) >> 13;
    // Subnormal halves: the significand with its implicit bit, shifted right by 126 - e
    // (14 to 31 there; clamped so that the lanes that take another branch stay in range),
    // rounded to nearest even.
    let e = ax >> 23;
    let shift = 126u32.saturating_sub(e).clamp(14, 31);
    let significand = (ax & 0x007f_ffff) | 0x0080_0000;
    let q = significand >> shift;
    let rem = significand & ((1 << shift) - 1);
    let half_ulp = 1 << (shift - 1);
    let subnormal = q + u32::from(rem > half_ulp || (rem == half_ulp && q & 1 == 1));
    let nan = 0x7e00 | ((ax & 0x007f_ffff) >> 13);
    let magnitude = if ax > 0x7f80_0000 {
        nan
    } else if ax >= 0x477f_f000 {
        0x7c00 // 65520 and above round to infinity
    } else if ax >= 0x3880_0000 {
        normal
    } else {
        subnormal
    };
    f16::from_bits((sign | magnitude) as u16)
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f16_to_f32(self) as f64
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f32_to_f16(v)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline(always)]
    fn typed(s: &[Self]) -> Typed<'_> {
        Typed::F16(s)
    }
    #[inline(always)]
    fn typed_mut(s: &mut [Self]) -> TypedMut<'_> {
        TypedMut::F16(s)
    }
}

/// Elements of a row summed in the accumulator type before they join the float64 lanes.
pub const SUM_BLOCK: usize = 2048;
/// `LANES`-wide chunks per block.
pub const BLOCK_CHUNKS: usize = SUM_BLOCK / LANES;

/// The float64 level of a sum along a row: [`LANES`] compensated float64 lanes, into which
/// the loops add a block of [`LANES`] accumulators in `A` every [`SUM_BLOCK`] elements (and
/// once more for the row's tail). Every loop that sums a row blocks it the same way (the
/// `LANES`-wide chunks in groups of [`BLOCK_CHUNKS`], then the tail), so they give the same
/// bits; the block accumulators are locals of the loops, so they stay in registers.
#[derive(Clone, Copy)]
pub struct RowSum {
    hi: [f64; LANES],
    lo: [f64; LANES],
}

impl Default for RowSum {
    #[inline(always)]
    fn default() -> Self {
        Self::new()
    }
}

impl RowSum {
    #[inline(always)]
    pub fn new() -> Self {
        RowSum {
            hi: [0.0; LANES],
            lo: [0.0; LANES],
        }
    }

    /// A sum from its float64 lanes and their error terms (as `cpu::avx512` keeps them, in
    /// vector registers).
    #[inline(always)]
    pub fn from_lanes(hi: [f64; LANES], lo: [f64; LANES]) -> Self {
        RowSum { hi, lo }
    }

    /// Adds one block of accumulators.
    #[inline(always)]
    pub fn add<A: Accum>(&mut self, block: &[A; LANES]) {
        let block = summed_lanes(*block);
        for ((hi, lo), b) in self.hi.iter_mut().zip(self.lo.iter_mut()).zip(&block) {
            let (s, e) = two_sum(*hi, b.to_f64());
            *hi = s;
            *lo += e;
        }
    }

    /// The totals of `G` sums at once, each exactly as [`RowSum::total`] takes it (the same
    /// operations in the same order per sum), the sums' chains interleaved so that they run side
    /// by side in SIMD lanes. For short rows the total is most of a row's arithmetic: 16
    /// dependent two-sums, against 4 vector steps for the squares of a row of 64; taken one row
    /// at a time, in scalar instructions, it was the most of the forward's time at rows of 64.
    #[inline(always)]
    pub fn totals<const G: usize>(sums: [RowSum; G]) -> [f64; G] {
        // Lane by lane, the G sums side by side (contiguous, so the steps vectorize).
        let hi: [[f64; G]; LANES] = std::array::from_fn(|l| std::array::from_fn(|k| sums[k].hi[l]));
        let lo: [[f64; G]; LANES] = std::array::from_fn(|l| std::array::from_fn(|k| sums[k].lo[l]));
        let (mut sum, mut err) = ([0.0f64; G], [0.0f64; G]);
        for (hi, lo) in hi.iter().zip(&lo) {
            for k in 0..G {
                let (s, e) = two_sum(sum[k], hi[k]);
                sum[k] = s;
                err[k] += e + lo[k];
            }
        }
        std::array::from_fn(|k| finish_total(sum[k], err[k]))
    }

    /// The sum, in float64: [`RowSum::totals`] of this one sum.
    #[inline(always)]
    pub fn total(self) -> f64 {
        RowSum::totals([self])[0]
    }
}

/// A block's [`LANES`] accumulators as they leave the loop that summed them, through an
/// optimization barrier (`std::hint::black_box`: the same values, stored and reloaded).
///
/// Why: LLVM's SLP vectorizer, working back from what consumes the lanes (a float32 lane
/// widened to float64, a float64 vector holding fewer lanes than a float32 one; or LayerNorm's
/// pairwise tree), re-vectorized the summing loop to match: on AVX-512, LayerNorm's row sum ran
/// in 2-lane `xmm` pieces with a shuffle per load (`perf`, float32 16384x1024 through XLA: the
/// load at the head of that loop held 45% of the kernel's samples), and on AVX2 every portable
/// sum of squares ran 4 lanes wide where 8 fit (`ymm`). Behind the barrier the loop sums in
/// whole vectors of the instruction set and the consumer starts from memory.
#[inline(always)]
pub fn summed_lanes<A: Accum>(acc: [A; LANES]) -> [A; LANES] {
    std::hint::black_box(acc)
}

/// A compensated total from its sum and error term. An infinite sum has NaN error terms
/// (inf - inf): the sum alone is the answer, as a plain sum would give (NaN stays NaN either
/// way).
#[inline(always)]
fn finish_total(sum: f64, err: f64) -> f64 {
    if sum.is_finite() {
        sum + err
    } else {
        sum
    }
}

/// `acc + x^2`, lane by lane, taken and returned by value (so the accumulator stays in a
/// register: updated in place through a zip or an index, LLVM kept it in memory, a
/// load-add-store chain that bound the software-pipelined bf16 forward).
#[inline(always)]
fn add_squares<T: Element, A: Accum>(mut acc: [A; LANES], x: &[T; LANES]) -> [A; LANES] {
    for l in 0..LANES {
        let v = A::load(x[l]);
        acc[l] = acc[l] + v * v;
    }
    acc
}

/// `acc + g * x` lane by lane with `g = dy * w` (or `dy`), by value as [`add_squares`].
#[inline(always)]
fn add_dot<T: Element, W: Element, A: Accum>(
    mut acc: [A; LANES],
    x: &[T; LANES],
    dy: &[T; LANES],
    w: Option<&[W; LANES]>,
) -> [A; LANES] {
    for l in 0..LANES {
        acc[l] = acc[l] + grad_out::<T, W, A>(dy[l], w.map(|w| w[l])) * A::load(x[l]);
    }
    acc
}

/// `sum(x^2)`.
#[inline(always)]
pub fn sum_squares<T: Element, A: Accum>(x: &[T]) -> f64 {
    squares::<T, A>(x).total()
}

/// `sum(x^2)` before its total: the float64 lanes that [`RowSum::total`] (or, for many rows
/// side by side, [`RowSum::totals`]) finishes.
#[inline(always)]
fn squares<T: Element, A: Accum>(x: &[T]) -> RowSum {
    let mut sum = RowSum::new();
    let (chunks, tail) = x.as_chunks::<LANES>();
    for block in chunks.chunks(BLOCK_CHUNKS) {
        add_square_block::<T, A>(&mut sum, block);
    }
    sum.add(&tail_squares::<T, A>(tail));
    sum
}

/// One block of a row's sum of squares (at most [`BLOCK_CHUNKS`] chunks) added to `sum`, as
/// `squares` adds each (which never adds an empty one: nor does this). For rows summed a
/// piece at a time (`cpu::widen`): pieces of [`SUM_BLOCK`] elements from the row's start, the
/// row's tail ([`tail_squares`]) last, give [`sum_squares`]'s bits.
#[inline(always)]
pub fn add_square_block<T: Element, A: Accum>(sum: &mut RowSum, block: &[[T; LANES]]) {
    debug_assert!(block.len() <= BLOCK_CHUNKS);
    if block.is_empty() {
        return;
    }
    let mut acc = [A::ZERO; LANES];
    for c in block {
        acc = add_squares(acc, c);
    }
    sum.add(&acc);
}

/// Rows per batch of [`forward_narrow`]: their totals run side by side.
pub const NARROW_BATCH: usize = 8;
/// Longest rows [`forward_narrow`] takes: one block of a row's sum, and a batch of rows that
/// stays in L1 between its two passes.
pub const NARROW_MAX: usize = 256;

/// Whether rows of `n` take [`forward_narrow`].
#[inline(always)]
pub fn narrow(n: usize) -> bool {
    n > 0 && n <= NARROW_MAX
}

/// The forward over whole batches of [`NARROW_BATCH`] narrow rows of `n` (see [`narrow`]);
/// returns how many rows it did (the rest are the caller's). Each batch: the rows' sums of
/// squares ([`squares`]), their totals side by side ([`RowSum::totals`]), the rstd, then the
/// rows scaled, re-reading x from L1. The same operations per row as [`forward_row`], so the
/// same bits.
///
/// Why: a row's sum ends in a compensated total of its 16 float64 lanes, 16 dependent
/// two-sums, then a division and a square root. For a row of 64 that is more work than its
/// squares, and taken row by row it was a serial float64 chain with the lanes spilled to the
/// stack that bound the portable loops (perf, AVX2, float32 8192x64: the scalar `vaddsd`,
/// `vsubsd`, `vdivsd` of the totals were most of the samples, the `vmulps` of the row 4%).
#[inline(always)]
pub fn forward_narrow<'w, T: Element, W: Element + 'w, A: Accum>(
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [T],
    rstd: &mut [A],
) -> usize {
    let batch = NARROW_BATCH * n;
    let mut done = 0;
    for ((xb, yb), rb) in x
        .chunks_exact(batch)
        .zip(y.chunks_exact_mut(batch))
        .zip(rstd.chunks_exact_mut(NARROW_BATCH))
    {
        let mut sums = [RowSum::new(); NARROW_BATCH];
        for (sum, row) in sums.iter_mut().zip(xb.chunks_exact(n)) {
            *sum = squares::<T, A>(row);
        }
        // The batch's rstd in a loop of their own, so that their divisions and square roots
        // run side by side too (IEEE operations round the same in vector lanes).
        let totals = RowSum::totals(sums);
        for (out, &total) in rb.iter_mut().zip(&totals) {
            *out = rstd_of(total, n, eps);
        }
        for (k, ((xr, yr), &r)) in xb
            .chunks_exact(n)
            .zip(yb.chunks_exact_mut(n))
            .zip(rb.iter())
            .enumerate()
        {
            forward_scale(xr, w_of(done + k), r, yr);
        }
        done += NARROW_BATCH;
    }
    done
}

/// The last block of a row's sum of squares: its tail of fewer than [`LANES`] elements, one per
/// lane.
#[inline(always)]
pub fn tail_squares<T: Element, A: Accum>(tail: &[T]) -> [A; LANES] {
    let mut acc = [A::ZERO; LANES];
    for (a, &e) in acc.iter_mut().zip(tail) {
        let v = A::load(e);
        *a = *a + v * v;
    }
    acc
}

/// `1 / sqrt(sum_sq / n + eps)`, taken in float64 and rounded once to `A`.
#[inline(always)]
pub fn rstd_of<A: Accum>(sum_sq: f64, n: usize, eps: A) -> A {
    A::from_f64(1.0 / (sum_sq / n as f64 + eps.to_f64()).sqrt())
}

/// `1 / sqrt(mean(x^2) + eps)`; NaN for an empty row, as `jnp.mean` of nothing.
#[inline(always)]
pub fn rstd<T: Element, A: Accum>(x: &[T], eps: A) -> A {
    if x.is_empty() {
        return A::NAN;
    }
    rstd_of(sum_squares::<T, A>(x), x.len(), eps)
}

/// One row of the forward pass; returns the row's `rstd`.
#[inline(always)]
pub fn forward_row<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    eps: A,
    y: &mut [T],
) -> A {
    let r = rstd::<T, A>(x, eps);
    forward_scale(x, w, r, y);
    r
}

/// Forward pass over consecutive rows of `n` (`rstd.len()` rows), software-pipelined: one loop
/// writes row `i` and sums the squares of row `i + 1`, so the read of the next row overlaps
/// the write of this one. The sums are taken exactly as [`sum_squares`] takes them, so results
/// are bit-identical to calling [`forward_row`] row by row. `w_of(i)` is row `i`'s weight.
#[inline(always)]
pub fn forward_rows<'w, T: Element, W: Element + 'w, A: Accum>(
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [T],
    rstd: &mut [A],
) {
    let rows = rstd.len();
    if n == 0 {
        rstd.fill(A::NAN);
        return;
    }
    let finish = |ss: f64| rstd_of(ss, n, eps);
    let mut next = match x.get(..n) {
        Some(first) if rows > 0 => finish(sum_squares::<T, A>(first)),
        _ => return,
    };
    for i in 0..rows {
        let r = next;
        rstd[i] = r;
        let xr = &x[i * n..(i + 1) * n];
        let yr = &mut y[i * n..(i + 1) * n];
        let Some(xn) = x.get((i + 1) * n..(i + 2) * n).filter(|_| i + 1 < rows) else {
            // Last row: scale only.
            forward_scale(xr, w_of(i), r, yr);
            break;
        };
        let mut sum = RowSum::new();
        let (xb, xt) = xr.as_chunks::<LANES>();
        let (nb, nt) = xn.as_chunks::<LANES>();
        let (yb, yt) = yr.as_chunks_mut::<LANES>();
        let blocks = yb
            .chunks_mut(BLOCK_CHUNKS)
            .zip(xb.chunks(BLOCK_CHUNKS))
            .zip(nb.chunks(BLOCK_CHUNKS));
        let mut acc = [A::ZERO; LANES];
        match w_of(i) {
            Some(w) => {
                let (wb, wt) = w.as_chunks::<LANES>();
                for (((yk, xk), nk), wk) in blocks.zip(wb.chunks(BLOCK_CHUNKS)) {
                    let mut acc = [A::ZERO; LANES];
                    for (((ys, xs), ws), ns) in yk.iter_mut().zip(xk).zip(wk).zip(nk) {
                        for l in 0..LANES {
                            ys[l] = (A::load(xs[l]) * r * A::load(ws[l])).store();
                        }
                        acc = add_squares(acc, ns);
                    }
                    sum.add(&acc);
                }
                for (((o, &xi), &wi), (&ni, a)) in yt
                    .iter_mut()
                    .zip(xt)
                    .zip(wt)
                    .zip(nt.iter().zip(acc.iter_mut()))
                {
                    *o = (A::load(xi) * r * A::load(wi)).store();
                    let v = A::load(ni);
                    *a = *a + v * v;
                }
            }
            None => {
                for ((yk, xk), nk) in blocks {
                    let mut acc = [A::ZERO; LANES];
                    for ((ys, xs), ns) in yk.iter_mut().zip(xk).zip(nk) {
                        for l in 0..LANES {
                            ys[l] = (A::load(xs[l]) * r).store();
                        }
                        acc = add_squares(acc, ns);
                    }
                    sum.add(&acc);
                }
                for ((o, &xi), (&ni, a)) in yt.iter_mut().zip(xt).zip(nt.iter().zip(acc.iter_mut()))
                {
                    *o = (A::load(xi) * r).store();
                    let v = A::load(ni);
                    *a = *a + v * v;
                }
            }
        }
        sum.add(&acc);
        next = finish(sum.total());
    }
}

/// `h = x + residual`, each sum rounded to `T` (as XLA rounds `x + residual`: half precision
/// through float32, whose sum of two half-precision values is exact or, far apart in
/// magnitude, rounds below half a unit of the result).
#[inline(always)]
pub fn add_into<T: Element, A: Accum>(x: &[T], residual: &[T], h: &mut [T]) {
    for ((o, &a), &b) in h.iter_mut().zip(x).zip(residual) {
        *o = (A::load(a) + A::load(b)).store();
    }
}

/// `y = x * r * w` (or `x * r`) for one row, or any piece of one.
#[inline(always)]
pub fn forward_scale<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    r: A,
    y: &mut [T],
) {
    // In LANES-wide chunks, then the tail: element by element, the half-precision conversions
    // stayed scalar (every row of `forward_narrow`'s batches is scaled here). Each chunk is
    // built in a local array and stored whole: written lane by lane into `y`, whose slice LLVM
    // could not prove apart from x's after inlining, float32 ran 16 scalar vmulss and vmovss
    // per chunk (perf).
    let (yb, yt) = y.as_chunks_mut::<LANES>();
    let (xb, xt) = x.as_chunks::<LANES>();
    match w {
        Some(w) => {
            let (wb, wt) = w.as_chunks::<LANES>();
            for ((o, xs), ws) in yb.iter_mut().zip(xb).zip(wb) {
                let mut v = [T::default(); LANES];
                for l in 0..LANES {
                    v[l] = (A::load(xs[l]) * r * A::load(ws[l])).store();
                }
                *o = v;
            }
            for ((o, &xi), &wi) in yt.iter_mut().zip(xt).zip(wt) {
                *o = (A::load(xi) * r * A::load(wi)).store();
            }
        }
        None => {
            for (o, xs) in yb.iter_mut().zip(xb) {
                let mut v = [T::default(); LANES];
                for l in 0..LANES {
                    v[l] = (A::load(xs[l]) * r).store();
                }
                *o = v;
            }
            for (o, &xi) in yt.iter_mut().zip(xt) {
                *o = (A::load(xi) * r).store();
            }
        }
    }
}

/// `g = dy * w`, or `dy` without a weight.
#[inline(always)]
fn grad_out<T: Element, W: Element, A: Accum>(dy: T, w: Option<W>) -> A {
    match w {
        Some(w) => A::load(dy) * A::load(w),
        None => A::load(dy),
    }
}

/// Where a backward's per-row rstd come from.
#[derive(Clone, Copy, Debug)]
pub enum Rstd<'a, A> {
    /// Given (the forward's), one per row.
    Given(&'a [A]),
    /// Taken from the row's own sum of squares and this eps: the forward's bits, since the
    /// backward sums the squares in [`sum_squares`]'s order.
    FromX(A),
}

impl<'a, A: Accum> Rstd<'a, A> {
    /// Row `i`'s rstd, given the sum of squares of its `n` elements.
    #[inline(always)]
    pub fn of(self, i: usize, sum_sq: f64, n: usize) -> A {
        match self {
            Rstd::Given(r) => r[i],
            Rstd::FromX(eps) => rstd_of(sum_sq, n, eps),
        }
    }

    /// The same, for rows `first..` (a range of the rows these were for).
    #[inline(always)]
    pub fn from_row(self, first: usize) -> Rstd<'a, A> {
        match self {
            Rstd::Given(r) => Rstd::Given(&r[first..]),
            from_x => from_x,
        }
    }
}

/// A row's first backward pass: `(sum(g * x), sum(x^2))` with `g = dy * w` (or `dy`), both
/// blocked as [`sum_squares`] blocks (so the second is its bits).
#[inline(always)]
pub fn row_sums<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    dy: &[T],
) -> (f64, f64) {
    let (dot, sq) = row_sum_lanes::<T, W, A>(x, w, dy);
    (dot.total(), sq.total())
}

/// [`row_sums`] before their totals.
#[inline(always)]
fn row_sum_lanes<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    dy: &[T],
) -> (RowSum, RowSum) {
    let mut sums = (RowSum::new(), RowSum::new());
    add_row_sums::<T, W, A>(&mut sums, x, w, dy, true);
    sums
}

/// Adds a piece of a row to its first-pass sums `(dot, sq)` ([`row_sums`]): the piece's blocks,
/// and where `last`, the row's tail after its last whole chunk (which only the last piece has).
/// Pieces of [`SUM_BLOCK`] elements from the row's start, in order, give [`row_sums`]'s bits:
/// float16 rows widened a piece at a time (`cpu::widen`).
#[inline(always)]
pub fn add_row_sums<T: Element, W: Element, A: Accum>(
    (dot, sq): &mut (RowSum, RowSum),
    x: &[T],
    w: Option<&[W]>,
    dy: &[T],
    last: bool,
) {
    let (xb, xt) = x.as_chunks::<LANES>();
    let (db, dt) = dy.as_chunks::<LANES>();
    let blocks = xb.chunks(BLOCK_CHUNKS).zip(db.chunks(BLOCK_CHUNKS));
    let mut acc = [A::ZERO; LANES];
    match w {
        Some(w) => {
            let (wb, wt) = w.as_chunks::<LANES>();
            for ((xk, dk), wk) in blocks.zip(wb.chunks(BLOCK_CHUNKS)) {
                let (mut acc, mut q) = ([A::ZERO; LANES], [A::ZERO; LANES]);
                for ((xs, ds), ws) in xk.iter().zip(dk).zip(wk) {
                    acc = add_dot(acc, xs, ds, Some(ws));
                    q = add_squares(q, xs);
                }
                dot.add(&acc);
                sq.add(&q);
            }
            acc = tail_dot(xt, dt, wt);
        }
        None => {
            for (xk, dk) in blocks {
                let (mut acc, mut q) = ([A::ZERO; LANES], [A::ZERO; LANES]);
                for (xs, ds) in xk.iter().zip(dk) {
                    acc = add_dot::<T, W, A>(acc, xs, ds, None);
                    q = add_squares(q, xs);
                }
                dot.add(&acc);
                sq.add(&q);
            }
            for ((a, &xi), &di) in acc.iter_mut().zip(xt).zip(dt) {
                *a = *a + A::load(di) * A::load(xi);
            }
        }
    }
    if last {
        dot.add(&acc);
        sq.add(&tail_squares::<T, A>(xt));
    }
}

/// The last block of a row's `sum(g * x)` with a weight: its tail of fewer than [`LANES`]
/// elements, one per lane.
#[inline(always)]
pub fn tail_dot<T: Element, W: Element, A: Accum>(x: &[T], dy: &[T], w: &[W]) -> [A; LANES] {
    let mut acc = [A::ZERO; LANES];
    for (((a, &xi), &di), &wi) in acc.iter_mut().zip(x).zip(dy).zip(w) {
        *a = *a + grad_out::<T, W, A>(di, Some(wi)) * A::load(xi);
    }
    acc
}

/// `c = mean(g * xhat) = r * sum(g * x) / n` of a row of `n`, taken in float64 and rounded
/// once to `A`.
#[inline(always)]
pub fn coefficient<A: Accum>(dot: f64, n: usize, r: A) -> A {
    A::from_f64(dot / n as f64 * r.to_f64())
}

/// Row `i`'s `(rstd, c)` from its first pass's sums.
#[inline(always)]
pub fn row_factors<A: Accum>(
    rstd: Rstd<'_, A>,
    i: usize,
    (dot, sq): (f64, f64),
    n: usize,
) -> (A, A) {
    let r = rstd.of(i, sq, n);
    (r, coefficient(dot, n, r))
}

/// One row of the backward pass (row 0 of `rstd`): writes `dx` and, when `dw_acc` is given,
/// adds this row's `dy * xhat` to it.
#[inline(always)]
pub fn backward_row<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    rstd: Rstd<'_, A>,
    dy: &[T],
    dx: &mut [T],
    dw_acc: Option<&mut [A::Wide]>,
) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let (r, c) = row_factors(rstd, 0, row_sums::<T, W, A>(x, w, dy), n);
    backward_second_pass(x, w, r, c, dy, dx, dw_acc);
}

/// The second pass of a backward row, given `c = mean(g * xhat)`: writes `dx` and, with
/// `dw_acc`, adds `dy * xhat` to it. x and dy are read once more, from cache.
#[inline(always)]
pub fn backward_second_pass<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    r: A,
    c: A,
    dy: &[T],
    dx: &mut [T],
    dw_acc: Option<&mut [A::Wide]>,
) {
    match (w, dw_acc) {
        (Some(w), Some(acc)) => {
            for ((((o, a), &xi), &di), &wi) in
                dx.iter_mut().zip(acc.iter_mut()).zip(x).zip(dy).zip(w)
            {
                let xhat = A::load(xi) * r;
                let d = A::load(di);
                *o = (r * (d * A::load(wi) - xhat * c)).store();
                *a = a.add((d * xhat).to_f64());
            }
        }
        (Some(w), None) => {
            for (((o, &xi), &di), &wi) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                let xhat = A::load(xi) * r;
                *o = (r * (A::load(di) * A::load(wi) - xhat * c)).store();
            }
        }
        (None, acc) => {
            for ((o, &xi), &di) in dx.iter_mut().zip(x).zip(dy) {
                let xhat = A::load(xi) * r;
                *o = (r * (A::load(di) - xhat * c)).store();
            }
            if let Some(acc) = acc {
                for ((a, &xi), &di) in acc.iter_mut().zip(x).zip(dy) {
                    *a = a.add((A::load(di) * (A::load(xi) * r)).to_f64());
                }
            }
        }
    }
}

/// The second pass of two rows that add to one accumulator: their dx (each with its own
/// weight), and per column `acc += dy0 * xhat0 + dy1 * xhat1`, the pair's sum taken in `A`
/// and widened once (see [`backward_rows_paired`]). The two-rows loops' last pair, and the
/// reference they are tested against. One pass over the rows when both have a weight (every
/// call that has a weight gradient), else their dx first and the gradient after.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_pair_second_pass<T: Element, W: Element, A: Accum>(
    (x0, x1): (&[T], &[T]),
    (w0, w1): (Option<&[W]>, Option<&[W]>),
    (r0, r1): (A, A),
    (c0, c1): (A, A),
    (d0, d1): (&[T], &[T]),
    (o0, o1): (&mut [T], &mut [T]),
    acc: &mut [A::Wide],
) {
    if let (Some(w0), Some(w1)) = (w0, w1) {
        // In LANES-wide chunks, then the tail: element by element, the half-precision
        // conversions stayed scalar (every pair of `backward_narrow`'s batches goes through here).
        // Each column in a function, not a let-bound closure: the closure stayed out of line,
        // compiled for the baseline instruction set (perf: half of a float16 backward's time).
        let n = x0.len();
        let (o0b, o0t) = o0.as_chunks_mut::<LANES>();
        let (o1b, o1t) = o1.as_chunks_mut::<LANES>();
        let (ab, at) = acc[..n].as_chunks_mut::<LANES>();
        let (x0b, x0t) = x0.as_chunks::<LANES>();
        let (x1b, x1t) = x1.as_chunks::<LANES>();
        let (d0b, d0t) = d0.as_chunks::<LANES>();
        let (d1b, d1t) = d1.as_chunks::<LANES>();
        let (w0b, w0t) = w0.as_chunks::<LANES>();
        let (w1b, w1t) = w1.as_chunks::<LANES>();
        let outs = o0b.iter_mut().zip(o1b.iter_mut()).zip(ab.iter_mut());
        let ins = (x0b.iter().zip(x1b)).zip(d0b.iter().zip(d1b));
        for (((o0, o1), a), (((x0, x1), (d0, d1)), (w0, w1))) in
            outs.zip(ins.zip(w0b.iter().zip(w1b)))
        {
            // Built in local arrays and stored whole, as `forward_scale` does.
            let (mut v0, mut v1, mut acc) = ([T::default(); LANES], [T::default(); LANES], *a);
            for l in 0..LANES {
                pair_column::<T, W, A>(
                    (&mut v0[l], &mut v1[l]),
                    &mut acc[l],
                    [x0[l], x1[l], d0[l], d1[l]],
                    (w0[l], w1[l]),
                    (r0, r1),
                    (c0, c1),
                );
            }
            (*o0, *o1, *a) = (v0, v1, acc);
        }
        let outs = o0t.iter_mut().zip(o1t.iter_mut()).zip(at.iter_mut());
        let ins = (x0t.iter().zip(x1t)).zip(d0t.iter().zip(d1t));
        for (((o0, o1), a), (((&x0, &x1), (&d0, &d1)), (&w0, &w1))) in
            outs.zip(ins.zip(w0t.iter().zip(w1t)))
        {
            pair_column::<T, W, A>((o0, o1), a, [x0, x1, d0, d1], (w0, w1), (r0, r1), (c0, c1));
        }
        return;
    }
    backward_second_pass(x0, w0, r0, c0, d0, o0, None);
    backward_second_pass(x1, w1, r1, c1, d1, o1, None);
    for ((((a, &xi0), &di0), &xi1), &di1) in acc.iter_mut().zip(x0).zip(d0).zip(x1).zip(d1) {
        let p0 = A::load(di0) * (A::load(xi0) * r0);
        let p1 = A::load(di1) * (A::load(xi1) * r1);
        *a = a.add((p0 + p1).to_f64());
    }
}

/// One column of a pair of rows' second pass with a weight: both rows' dx and the pair's
/// weight-gradient term, added to `a` once (see [`backward_rows_paired`]). `i` is x0, x1, dy0,
/// dy1.
#[inline(always)]
fn pair_column<T: Element, W: Element, A: Accum>(
    (o0, o1): (&mut T, &mut T),
    a: &mut A::Wide,
    [xi0, xi1, di0, di1]: [T; 4],
    (wi0, wi1): (W, W),
    (r0, r1): (A, A),
    (c0, c1): (A, A),
) {
    let (h0, g0) = (A::load(xi0) * r0, A::load(di0));
    let (h1, g1) = (A::load(xi1) * r1, A::load(di1));
    *o0 = (r0 * (g0 * A::load(wi0) - h0 * c0)).store();
    *o1 = (r1 * (g1 * A::load(wi1) - h1 * c1)).store();
    *a = a.add((g0 * h0 + g1 * h1).to_f64());
}

/// Backward pass with a weight and an accumulator, two rows per loop: one loop writes rows
/// `i` and `i + 1` (their dx and their gradient contributions, added to each other in `A` and
/// then once to the accumulator, so it is loaded, widened into and stored once per two rows)
/// and takes the first-pass sums of rows `i + 2` and `i + 3`. Rows pair from the first; a
/// last odd row adds alone. Bit-identical to [`backward_rows`].
#[inline(always)]
pub fn backward_rows_paired<'w, T: Element, W: Element + 'w, A: Accum>(
    x: &[T],
    dy: &[T],
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [T],
    acc: &mut [A::Wide],
) {
    if n == 0 || dx.len() < n {
        return;
    }
    let rows = dx.len() / n;
    let row = |i: usize| i * n..(i + 1) * n;
    let factors = |i: usize| {
        row_factors(
            rstd,
            i,
            row_sums::<T, W, A>(&x[row(i)], Some(w), &dy[row(i)]),
            n,
        )
    };
    let mut rc = [
        factors(0),
        if rows > 1 {
            factors(1)
        } else {
            (A::ZERO, A::ZERO)
        },
    ];
    let mut i = 0;
    while i + 1 < rows {
        let [(r0, c0), (r1, c1)] = rc;
        let (x0, x1) = (&x[row(i)], &x[row(i + 1)]);
        let (d0, d1) = (&dy[row(i)], &dy[row(i + 1)]);
        let (o0, o1) = dx[i * n..(i + 2) * n].split_at_mut(n);
        if i + 3 < rows {
            let (x2, x3) = (&x[row(i + 2)], &x[row(i + 3)]);
            let (d2, d3) = (&dy[row(i + 2)], &dy[row(i + 3)]);
            let (mut s2, mut s3) = (RowSum::new(), RowSum::new());
            let (mut t2, mut t3) = (RowSum::new(), RowSum::new());
            let (wb, wt) = w.as_chunks::<LANES>();
            let (ab, at) = acc.as_chunks_mut::<LANES>();
            let (x0b, x0t) = x0.as_chunks::<LANES>();
            let (x1b, x1t) = x1.as_chunks::<LANES>();
            let (x2b, x2t) = x2.as_chunks::<LANES>();
            let (x3b, x3t) = x3.as_chunks::<LANES>();
            let (d0b, d0t) = d0.as_chunks::<LANES>();
            let (d1b, d1t) = d1.as_chunks::<LANES>();
            let (d2b, d2t) = d2.as_chunks::<LANES>();
            let (d3b, d3t) = d3.as_chunks::<LANES>();
            let (o0b, o0t) = o0.as_chunks_mut::<LANES>();
            let (o1b, o1t) = o1.as_chunks_mut::<LANES>();
            let chunks = wb.len();
            for start in (0..chunks).step_by(BLOCK_CHUNKS) {
                let k = start..(start + BLOCK_CHUNKS).min(chunks);
                let blocks = wb[k.clone()]
                    .iter()
                    .zip(ab[k.clone()].iter_mut())
                    .zip(x0b[k.clone()].iter().zip(&x1b[k.clone()]))
                    .zip(d0b[k.clone()].iter().zip(&d1b[k.clone()]));
                let outs = o0b[k.clone()].iter_mut().zip(o1b[k.clone()].iter_mut());
                let ahead = x2b[k.clone()]
                    .iter()
                    .zip(&x3b[k.clone()])
                    .zip(d2b[k.clone()].iter().zip(&d3b[k]));
                let (mut a2, mut a3) = ([A::ZERO; LANES], [A::ZERO; LANES]);
                let (mut q2, mut q3) = ([A::ZERO; LANES], [A::ZERO; LANES]);
                for (
                    (((ws, accs), (xs0, xs1)), (ds0, ds1)),
                    ((os0, os1), ((xs2, xs3), (ds2, ds3))),
                ) in blocks.zip(outs.zip(ahead))
                {
                    for l in 0..LANES {
                        let wl = A::load(ws[l]);
                        let h0 = A::load(xs0[l]) * r0;
                        let g0 = A::load(ds0[l]);
                        os0[l] = (r0 * (g0 * wl - h0 * c0)).store();
                        let h1 = A::load(xs1[l]) * r1;
                        let g1 = A::load(ds1[l]);
                        os1[l] = (r1 * (g1 * wl - h1 * c1)).store();
                        accs[l] = accs[l].add((g0 * h0 + g1 * h1).to_f64());
                    }
                    a2 = add_dot(a2, xs2, ds2, Some(ws));
                    a3 = add_dot(a3, xs3, ds3, Some(ws));
                    q2 = add_squares(q2, xs2);
                    q3 = add_squares(q3, xs3);
                }
                s2.add(&a2);
                s3.add(&a3);
                t2.add(&q2);
                t3.add(&q3);
            }
            let (mut a2, mut a3) = ([A::ZERO; LANES], [A::ZERO; LANES]);
            for l in 0..wt.len() {
                let wl = A::load(wt[l]);
                let h0 = A::load(x0t[l]) * r0;
                let g0 = A::load(d0t[l]);
                o0t[l] = (r0 * (g0 * wl - h0 * c0)).store();
                let h1 = A::load(x1t[l]) * r1;
                let g1 = A::load(d1t[l]);
                o1t[l] = (r1 * (g1 * wl - h1 * c1)).store();
                at[l] = at[l].add((g0 * h0 + g1 * h1).to_f64());
                a2[l] = a2[l] + A::load(d2t[l]) * wl * A::load(x2t[l]);
                a3[l] = a3[l] + A::load(d3t[l]) * wl * A::load(x3t[l]);
            }
            s2.add(&a2);
            s3.add(&a3);
            t2.add(&tail_squares::<T, A>(x2t));
            t3.add(&tail_squares::<T, A>(x3t));
            rc = [
                row_factors(rstd, i + 2, (s2.total(), t2.total()), n),
                row_factors(rstd, i + 3, (s3.total(), t3.total()), n),
            ];
        } else {
            backward_pair_second_pass(
                (x0, x1),
                (Some(w), Some(w)),
                (r0, r1),
                (c0, c1),
                (d0, d1),
                (o0, o1),
                acc,
            );
            if i + 2 < rows {
                rc = [factors(i + 2), (A::ZERO, A::ZERO)];
            }
        }
        i += 2;
    }
    if i < rows {
        backward_second_pass(
            &x[row(i)],
            Some(w),
            rc[0].0,
            rc[0].1,
            &dy[row(i)],
            &mut dx[row(i)],
            Some(acc),
        );
    }
}

/// The backward with a weight and an accumulator over whole batches of [`NARROW_BATCH`] narrow
/// rows of `n` (see [`narrow`]), as [`forward_narrow`] takes the forward; returns how many rows
/// it did (the rest are [`backward_rows_paired`]'s). Each batch: the rows' first-pass sums, their
/// totals side by side, the rows' rstd and coefficients, then the second pass in pairs of rows
/// as [`backward_rows_paired`] pairs them (from the first row; a batch has an even number), so
/// the same bits.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_narrow<T: Element, W: Element, A: Accum>(
    x: &[T],
    dy: &[T],
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [T],
    acc: &mut [A::Wide],
) -> usize {
    const { assert!(NARROW_BATCH.is_multiple_of(2)) };
    let batch = NARROW_BATCH * n;
    let mut done = 0;
    for ((xb, db), ob) in x
        .chunks_exact(batch)
        .zip(dy.chunks_exact(batch))
        .zip(dx.chunks_exact_mut(batch))
    {
        let mut dots = [RowSum::new(); NARROW_BATCH];
        let mut squares = [RowSum::new(); NARROW_BATCH];
        for (k, (xr, dr)) in xb.chunks_exact(n).zip(db.chunks_exact(n)).enumerate() {
            (dots[k], squares[k]) = row_sum_lanes::<T, W, A>(xr, Some(w), dr);
        }
        let (dot, sq) = (RowSum::totals(dots), RowSum::totals(squares));
        // Each factor in a loop of its own, so the batch's divisions run side by side.
        let mut r = [A::ZERO; NARROW_BATCH];
        for (k, (r, &sq)) in r.iter_mut().zip(&sq).enumerate() {
            *r = rstd.of(done + k, sq, n);
        }
        let mut c = [A::ZERO; NARROW_BATCH];
        for ((c, &dot), &r) in c.iter_mut().zip(&dot).zip(&r) {
            *c = coefficient(dot, n, r);
        }
        for (k, ((xp, dp), op)) in xb
            .chunks_exact(2 * n)
            .zip(db.chunks_exact(2 * n))
            .zip(ob.chunks_exact_mut(2 * n))
            .enumerate()
        {
            let (o0, o1) = op.split_at_mut(n);
            backward_pair_second_pass(
                xp.split_at(n),
                (Some(w), Some(w)),
                (r[2 * k], r[2 * k + 1]),
                (c[2 * k], c[2 * k + 1]),
                dp.split_at(n),
                (o0, o1),
                acc,
            );
        }
        done += NARROW_BATCH;
    }
    done
}

/// `offset + w` for each weight element, taken in `A` (zero-centred gamma: Gemma's `1 + w`): the
/// weight the kernels then apply, once per call for the call's weight rows. Rounded once to the
/// accumulation dtype, as a kernel that added the offset element by element would round it.
#[inline(always)]
pub fn offset_weights<W: Element, A: Accum>(w: &[W], offset: A, out: &mut [A]) {
    for (o, &wi) in out.iter_mut().zip(w) {
        *o = offset + A::load(wi);
    }
}

/// One row of the fused residual add's backward: dx is the norm's backward plus `dh` (the
/// gradient that reached `h = x + residual` from later layers), added in `A` before dx is
/// rounded once, where adding the two rounded gradients would round twice. The norm's part is
/// [`backward_second_pass`]'s expression, operation for operation. With `dw_acc`, adds this
/// row's `dy * xhat` to it (widened term by term).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_row_adding<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    rstd: Rstd<'_, A>,
    dy: &[T],
    dh: &[T],
    dx: &mut [T],
    dw_acc: Option<&mut [A::Wide]>,
) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let (r, c) = row_factors(rstd, 0, row_sums::<T, W, A>(x, w, dy), n);
    adding_second_pass(x, w, r, c, dy, dh, dx, dw_acc);
}

/// [`backward_row_adding`]'s second pass, given the row's `(r, c)` ([`row_factors`]): element
/// by element, so a row may be handed over a piece at a time (`cpu::widen`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn adding_second_pass<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    r: A,
    c: A,
    dy: &[T],
    dh: &[T],
    dx: &mut [T],
    dw_acc: Option<&mut [A::Wide]>,
) {
    // One loop per case, each without branches, so that they vectorize as
    // `backward_second_pass`'s do.
    let out = |xi: T, g: A, hi: T| (r * (g - A::load(xi) * r * c) + A::load(hi)).store::<T>();
    match w {
        Some(w) => {
            for ((((o, &xi), &di), &wi), &hi) in dx.iter_mut().zip(x).zip(dy).zip(w).zip(dh) {
                *o = out(xi, A::load(di) * A::load(wi), hi);
            }
        }
        None => {
            for (((o, &xi), &di), &hi) in dx.iter_mut().zip(x).zip(dy).zip(dh) {
                *o = out(xi, A::load(di), hi);
            }
        }
    }
    if let Some(acc) = dw_acc {
        for ((a, &xi), &di) in acc.iter_mut().zip(x).zip(dy) {
            *a = a.add((A::load(di) * (A::load(xi) * r)).to_f64());
        }
    }
}

/// Backward pass over consecutive rows of `n` (as many as `dx` holds), row by row: the rows
/// without a weight, any rows [`backward_rows_paired`] does not cover, and the reference the
/// multi-row loops are tested against. With an accumulator, rows add to it in pairs, as
/// [`backward_rows_paired`] adds them.
#[inline(always)]
pub fn backward_rows<'w, T: Element, W: Element + 'w, A: Accum>(
    x: &[T],
    dy: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    rstd: Rstd<'_, A>,
    dx: &mut [T],
    mut acc: Option<&mut [A::Wide]>,
) {
    if n == 0 {
        return;
    }
    let rows = dx.len() / n;
    let row = |i: usize| i * n..(i + 1) * n;
    let factors = |i: usize| {
        row_factors(
            rstd,
            i,
            row_sums::<T, W, A>(&x[row(i)], w_of(i), &dy[row(i)]),
            n,
        )
    };
    let mut i = 0;
    while i < rows {
        match acc.as_deref_mut() {
            Some(acc) if i + 1 < rows => {
                let (o0, o1) = dx[i * n..(i + 2) * n].split_at_mut(n);
                let ((r0, c0), (r1, c1)) = (factors(i), factors(i + 1));
                backward_pair_second_pass(
                    (&x[row(i)], &x[row(i + 1)]),
                    (w_of(i), w_of(i + 1)),
                    (r0, r1),
                    (c0, c1),
                    (&dy[row(i)], &dy[row(i + 1)]),
                    (o0, o1),
                    acc,
                );
                i += 2;
            }
            acc => {
                let (xr, dr) = (&x[row(i)], &dy[row(i)]);
                backward_row(xr, w_of(i), rstd.from_row(i), dr, &mut dx[row(i)], acc);
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        let mut values = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::from_bits(0x3f80_8000), // 1 + 2^-8: a tie, rounds to even
            f32::from_bits(0x3f81_8000), // a tie that rounds up
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
        ];
        values.extend([f32::INFINITY, f32::NEG_INFINITY, 3.4e38, -2.5e-3]);
        for i in 0..100_000u32 {
            values.push(f32::from_bits(i.wrapping_mul(2_654_435_761)));
        }
        for v in values {
            let ours = f32_to_bf16(v);
            let theirs = bf16::from_f32(v);
            if v.is_nan() {
                assert!(ours.is_nan());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{v:e}");
            }
            assert_eq!(bf16_to_f32(theirs).to_bits(), theirs.to_f32().to_bits());
        }
    }

    #[test]
    fn f16_conversions_match_half() {
        // Every half, both ways.
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let (ours, theirs) = (f16_to_f32(h), h.to_f32());
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            // Back: exact for every half but the signalling NaNs, which come back quieted.
            let back = f32_to_f16(theirs).to_bits();
            assert_eq!(
                back,
                f16::from_f32(theirs).to_bits(),
                "back from {bits:#06x}"
            );
            assert!(back == bits || h.is_nan(), "round trip of {bits:#06x}");
        }
        // Floats: every boundary of the half range and its ties, and a spread of 2^22 more.
        let mut values = Vec::new();
        for bits in 0..=u16::MAX {
            let f = f16::from_bits(bits).to_f32().to_bits();
            for d in [-0x1001i64, -0x1000, -0xfff, -1, 1, 0xfff, 0x1000, 0x1001] {
                values.push(((f as i64) + d) as u32);
            }
        }
        values.extend((0..1u32 << 22).map(|i| i.wrapping_mul(0x9e37_79b9)));
        values.extend([
            0x477f_efff,
            0x477f_f000,
            0x3880_0000,
            0x387f_ffff,
            0x3300_0000,
            0x3300_0001,
        ]);
        for bits in values {
            let v = f32::from_bits(bits);
            assert_eq!(
                f32_to_f16(v).to_bits(),
                f16::from_f32(v).to_bits(),
                "{bits:#010x} ({v:e})"
            );
        }
    }

    #[test]
    fn row_math_matches_a_float64_reference() {
        let n = 37;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0).collect();
        let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 5) as f32 / 4.0).collect();
        let dy: Vec<f32> = (0..n).map(|i| ((i * 3 % 13) as f32 - 6.0) / 7.0).collect();
        let eps = 1e-5;
        let mut y = vec![0.0f32; n];
        let r = forward_row::<f32, f32, f32>(&x, Some(&w), eps, &mut y);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
        let r64 = 1.0 / (ms + eps as f64).sqrt();
        assert!((r as f64 - r64).abs() < 1e-6 * r64);
        for j in 0..n {
            let want = x[j] as f64 * r64 * w[j] as f64;
            assert!((y[j] as f64 - want).abs() < 1e-5, "{j}");
        }
        let mut dx = vec![0.0f32; n];
        let mut dw = vec![0.0f64; n];
        backward_row::<f32, f32, f32>(&x, Some(&w), Rstd::Given(&[r]), &dy, &mut dx, Some(&mut dw));
        let c: f64 = (0..n)
            .map(|j| dy[j] as f64 * w[j] as f64 * x[j] as f64 * r64)
            .sum::<f64>()
            / n as f64;
        for j in 0..n {
            let xhat = x[j] as f64 * r64;
            let want_dx = r64 * (dy[j] as f64 * w[j] as f64 - xhat * c);
            assert!((dx[j] as f64 - want_dx).abs() < 1e-5, "dx {j}");
            assert!((dw[j] as f64 - dy[j] as f64 * xhat).abs() < 1e-5, "dw {j}");
        }
    }

    #[test]
    fn empty_row_has_nan_rstd() {
        assert!(rstd::<f32, f32>(&[], 1e-5).is_nan());
    }
}
