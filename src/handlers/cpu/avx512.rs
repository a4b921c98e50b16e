//! The forward pass, and the backward pass with a weight, of float32 and bfloat16 rows in
//! explicit AVX-512, for the instruction set most of this library's CPU time runs on. The
//! portable loops in `handlers::math` leave the vectorizing to LLVM, which in these loops split
//! accumulators into pieces and re-read the weight from L2 for every row. These loops take the
//! same operations in the same order per lane, so their results are bit-identical to the
//! portable ones (tested on every instruction set), in a different order over memory:
//!
//! 1. forward: rows in groups of four (two where two groups of four would pass 512 KiB; a
//!    chunk's last rows in twos and ones): each group scaled (`y = x * rstd * w`) 32 columns of
//!    every row at a time, the weight loaded once for the group, while the next group's sums of
//!    squares run beside it, one independent add chain per row, so the loop is bound by loads
//!    rather than by the latency of one chain (see `rows`);
//! 2. backward: the dot products and the sums of squares of two rows at a time;
//! 3. backward: the second pass (dx and the weight gradient) in column tiles over a group of
//!    rows, so a tile of the weight and of the float64 gradient row stays in L1 while every row
//!    uses it, and the group's x and dy are re-read from L2;
//! 4. narrow rows (whole vectors, up to 256 elements), in the forward and the backward's first
//!    pass: batches of 8 rows whose sums' totals run side by side, one row per float64 lane
//!    (see `narrow`); and LayerNorm's statistics of such rows the same way;
//! 5. LayerNorm's forward, each row of one block written while the next is summed
//!    (`layer_forward_rows`).
//!
//! Everything here is `#[inline(always)]` and runs inside the caller's `Kernel::run`, whose
//! AVX-512 context it is compiled into. A second `V4::vectorize` nested in that context kept
//! LLVM from inlining the bfloat16 backward's body, whose intrinsics then ran as calls (20x
//! slower).
//!
//! bfloat16 rows are scaled 32 elements at a time in even and odd lanes: one load widens
//! them, and one ternary-logic instruction puts the two rounded halves back together, where
//! 16 lanes at a time needed a lane-crossing widen and narrow per 16 elements (the scaling
//! pass was bound by those, not by memory).
//!
//! Measured through XLA on two threads (best of 1500 calls, AMD EPYC Zen 4), against `x * c`:
//!
//! | case | portable loops | these | `x * c` |
//! |---|---|---|---|
//! | f32 256x4096 | 97 us | 87 us | 82 us |
//! | f32 64x16384 | 110 us | 87 us | 85 us |
//! | bf16 256x4096 | 128 us | 97 us | 104 us |
//! | bf16 64x16384 | 125 us | 95 us | 100 us |
//!
//! What is left in float32 is mostly moving lines into L1: the floor moves x and y, the norm
//! also the second read of x (from L2) and the weight.
//!
//! The forward's groups replaced pairs of rows, each pair scaled while the next pair was summed
//! (which had replaced a second pass in column tiles, whose stores started a new 4 KiB page of y
//! every 4 KiB). Timed alone (Rust loops, two threads, interleaved rounds, x and y cold as in `make
//! bench`, where every variant reads and writes buffers of its own), the pairs took 1.5-1.6x the
//! time of a plain `x * c` loop at 256x4096 and 64x16384 float32, and a plain loop that multiplies
//! by a weight row re-read for every row 1.5x: re-loading the weight cost about as much as the rest
//! of the scaling. Groups that load it once took 1.1-1.2x (eight rows, sums then scaling), and
//! 1.0-1.2x with each group scaled while the next is summed (four rows). Through XLA, in `make
//! bench`'s shuffled rounds, with this build and the pairs' in one process (9 runs of 150 rounds at
//! both shapes): float32 forward 0.81-1.04x the pairs' time (median 0.89x), bfloat16 0.91-1.05x
//! (unchanged: conversions bound it more than memory), large shapes 0.91-1.00x. Eight rows summed
//! then scaled, in the same process, took 0.98-1.21x this build's time.
//!
//! In the scaling loop every row's loads come before any row's stores: x and y often sit at the
//! same offset in their 4 KiB pages, and a load that follows a store whose address has the same
//! low 12 bits waits on it (at that offset the interleaved loop took 1.36x `x * c`, this one
//! 1.16x, one thread).

use core::any::TypeId;
use core::arch::x86_64::{
    __m256, __m256i, __m512, __m512d, __m512i, _CMP_EQ_OQ, _CMP_LT_OQ, _CMP_UNORD_Q,
};

use half::{bf16, f16};
use pulp::x86::V4;

use crate::handlers::math::layer;
use crate::handlers::math::{
    row_factors, rstd_of, tail_dot, tail_squares, Accum, Element, RowSum, Rstd, Typed, TypedMut,
    WideSum, BLOCK_CHUNKS, LANES,
};

/// Columns per tile of the backward's second pass: 4 KiB of a float32 weight.
const TILE: usize = 1024;

const _: () = assert!(LANES == 16 && TILE.is_multiple_of(LANES));

/// An element type with 16-lane loads and stores in float32.
trait Lane: Element + Copy {
    /// The slice, if `Typed` holds this type.
    fn of(t: Typed<'_>) -> Option<&[Self]>;
    fn load(s: V4, v: &[Self; LANES]) -> __m512;
    fn store(s: V4, v: __m512) -> [Self; LANES];
    /// 32 elements widened to float32: the even-indexed ones, then the odd-indexed ones.
    fn load_even_odd(s: V4, v: &[Self; 2 * LANES]) -> (__m512, __m512);

    /// 32 elements of x widened to float32, in the lanes this type is scaled in: two halves of
    /// 16 (float32), or the even-indexed and the odd-indexed ones (bfloat16).
    #[inline(always)]
    fn load32(s: V4, x: &[Self; 2 * LANES]) -> [__m512; 2] {
        let (xs, _) = x.as_chunks::<LANES>();
        [Self::load(s, &xs[0]), Self::load(s, &xs[1])]
    }

    /// [`Lane::load32`]'s inverse: 32 float32 values, in this type's lanes, rounded to it.
    #[inline(always)]
    fn store32(s: V4, v: [__m512; 2]) -> [Self; 2 * LANES] {
        let mut out = [Self::default(); 2 * LANES];
        for (o, v) in out.as_chunks_mut::<LANES>().0.iter_mut().zip(v) {
            *o = Self::store(s, v);
        }
        out
    }

    /// 32 weights widened to float32, in the lanes [`Lane::load32`] puts this type's x in
    /// (loaded once for every row of a group that shares them).
    #[inline(always)]
    fn weight32<W: Lane>(s: V4, w: &[W; 2 * LANES]) -> [__m512; 2] {
        let (ws, _) = w.as_chunks::<LANES>();
        [W::load(s, &ws[0]), W::load(s, &ws[1])]
    }

    /// `y = (x * r) * w` (or `x * r`) for 32 elements of x as [`Lane::load32`] gave them, `w`
    /// from [`Lane::weight32`]: each element's product as the portable loops take it.
    #[inline(always)]
    fn scale32(s: V4, x: [__m512; 2], w: Option<[__m512; 2]>, r: __m512) -> [Self; 2 * LANES] {
        // No closures here (`array::map`): one that LLVM does not inline runs its intrinsics as
        // calls, outside the AVX-512 context.
        let f = s.avx512f;
        let xr = [f._mm512_mul_ps(x[0], r), f._mm512_mul_ps(x[1], r)];
        Self::store32(
            s,
            match w {
                Some([w0, w1]) => [f._mm512_mul_ps(xr[0], w0), f._mm512_mul_ps(xr[1], w1)],
                None => xr,
            },
        )
    }
}

impl Lane for f32 {
    #[inline(always)]
    fn of(t: Typed<'_>) -> Option<&[f32]> {
        match t {
            Typed::F32(s) => Some(s),
            _ => None,
        }
    }
    #[inline(always)]
    fn load(_: V4, v: &[f32; LANES]) -> __m512 {
        pulp::cast(*v)
    }
    #[inline(always)]
    fn store(_: V4, v: __m512) -> [f32; LANES] {
        pulp::cast(v)
    }
    #[inline(always)]
    fn load_even_odd(s: V4, v: &[f32; 2 * LANES]) -> (__m512, __m512) {
        let f = s.avx512f;
        let [lo, hi]: [__m512; 2] = pulp::cast(*v);
        let even = f._mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        let odd = f._mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        (
            f._mm512_permutex2var_ps(lo, even, hi),
            f._mm512_permutex2var_ps(lo, odd, hi),
        )
    }
}

/// bfloat16 rounding of 16 float32 lanes (to nearest even, NaN kept quiet: the bits of
/// `math`'s scalar conversion and of `half`'s), each result in its lane's high 16 bits.
#[inline(always)]
fn round_bf16_high(s: V4, v: __m512) -> __m512i {
    let f = s.avx512f;
    let bits = f._mm512_castps_si512(v);
    let lsb = f._mm512_and_si512(f._mm512_srli_epi32::<16>(bits), f._mm512_set1_epi32(1));
    let rounded = f._mm512_add_epi32(f._mm512_add_epi32(bits, f._mm512_set1_epi32(0x7fff)), lsb);
    let is_nan = f._mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    f._mm512_mask_or_epi32(rounded, is_nan, bits, f._mm512_set1_epi32(0x0040_0000))
}

impl Lane for bf16 {
    #[inline(always)]
    fn of(t: Typed<'_>) -> Option<&[bf16]> {
        match t {
            Typed::Bf16(s) => Some(s),
            _ => None,
        }
    }
    /// Widening is exact: the bfloat16 bits are the top half of the float32's.
    #[inline(always)]
    fn load(s: V4, v: &[bf16; LANES]) -> __m512 {
        let f = s.avx512f;
        let bits: __m256i = pulp::cast(*v);
        f._mm512_castsi512_ps(f._mm512_slli_epi32::<16>(f._mm512_cvtepu16_epi32(bits)))
    }
    #[inline(always)]
    fn store(s: V4, v: __m512) -> [bf16; LANES] {
        let f = s.avx512f;
        let high = f._mm512_srli_epi32::<16>(round_bf16_high(s, v));
        pulp::cast(f._mm512_cvtepi32_epi16(high))
    }
    /// One load: an even element is the low half of a 32-bit lane, an odd one the high half.
    #[inline(always)]
    fn load_even_odd(s: V4, v: &[bf16; 2 * LANES]) -> (__m512, __m512) {
        let f = s.avx512f;
        let bits: __m512i = pulp::cast(*v);
        let odd = f._mm512_and_si512(bits, f._mm512_set1_epi32(-0x1_0000));
        (
            f._mm512_castsi512_ps(f._mm512_slli_epi32::<16>(bits)),
            f._mm512_castsi512_ps(odd),
        )
    }
    /// In even and odd lanes, so the loads and the narrowing are one 32-bit lane per two
    /// elements and no lane crosses.
    #[inline(always)]
    fn load32(s: V4, x: &[bf16; 2 * LANES]) -> [__m512; 2] {
        let (even, odd) = Self::load_even_odd(s, x);
        [even, odd]
    }
    #[inline(always)]
    fn weight32<W: Lane>(s: V4, w: &[W; 2 * LANES]) -> [__m512; 2] {
        let (even, odd) = W::load_even_odd(s, w);
        [even, odd]
    }
    #[inline(always)]
    fn store32(s: V4, [ye, yo]: [__m512; 2]) -> [bf16; 2 * LANES] {
        let f = s.avx512f;
        let (he, ho) = (round_bf16_high(s, ye), round_bf16_high(s, yo));
        // (odd & 0xffff0000) | (even >> 16), in one instruction.
        let both = f._mm512_ternarylogic_epi32::<0xEC>(
            ho,
            f._mm512_srli_epi32::<16>(he),
            f._mm512_set1_epi32(-0x1_0000),
        );
        pulp::cast(both)
    }
}

/// float16 through the F16C conversions of AVX-512F (`vcvtph2ps`, `vcvtps2ph`), one
/// instruction per 16 elements each way, where the portable loops' integer conversion took
/// about ten. Both are exact or correctly rounded to nearest even, as `math`'s scalar
/// conversions (the rounding is named in the instruction, not read from MXCSR); a NaN keeps its
/// top payload bits and comes out quiet. `conversions_match_the_scalar_ones` checks every
/// float16 and a sample of float32 against them.
impl Lane for f16 {
    #[inline(always)]
    fn of(t: Typed<'_>) -> Option<&[f16]> {
        match t {
            Typed::F16(s) => Some(s),
            _ => None,
        }
    }
    #[inline(always)]
    fn load(s: V4, v: &[f16; LANES]) -> __m512 {
        s.avx512f._mm512_cvtph_ps(pulp::cast(*v))
    }
    #[inline(always)]
    fn store(s: V4, v: __m512) -> [f16; LANES] {
        pulp::cast(s.avx512f._mm512_cvtps_ph::<TO_NEAREST_EVEN>(v))
    }
    /// One load: the low halves of its 32-bit lanes, then the high halves, each narrowed to
    /// 16 packed elements and widened.
    #[inline(always)]
    fn load_even_odd(s: V4, v: &[f16; 2 * LANES]) -> (__m512, __m512) {
        let f = s.avx512f;
        let bits: __m512i = pulp::cast(*v);
        let even = f._mm512_cvtepi32_epi16(bits);
        let odd = f._mm512_cvtepi32_epi16(f._mm512_srli_epi32::<16>(bits));
        (f._mm512_cvtph_ps(even), f._mm512_cvtph_ps(odd))
    }
}

/// `vcvtps2ph`'s rounding immediate: to nearest even, exceptions suppressed.
const TO_NEAREST_EVEN: i32 = 0x08;

/// `dst = src` widened, 16 elements per `vcvtph2ps` (the tail of fewer than 16 by `half`):
/// `Kernel::f16_to_f32` on AVX-512, for the float16 rows `cpu::widen` runs through float32's
/// kernels. Inlined into the caller's `Kernel::run`; `half`'s slice conversion there stayed out
/// of line, one call per 8 elements (LayerNorm's float16 forward at 256x4096 took 0.73 ms
/// against bfloat16's 0.34 ms, Zen 4).
#[inline(always)]
pub fn f16_to_f32(s: V4, src: &[f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let (sb, st) = src.as_chunks::<LANES>();
    let (db, dt) = dst[..src.len()].as_chunks_mut::<LANES>();
    for (d, v) in db.iter_mut().zip(sb) {
        *d = <f32 as Lane>::store(s, <f16 as Lane>::load(s, v));
    }
    st.convert_to_f32_slice(dt);
}

/// `dst = src` rounded to nearest even, 16 elements per `vcvtps2ph` (the tail by `half`, the
/// same rounding): `Kernel::f32_to_f16` on AVX-512, as [`f16_to_f32`].
#[inline(always)]
pub fn f32_to_f16(s: V4, src: &[f32], dst: &mut [f16]) {
    use half::slice::HalfFloatSliceExt;
    let (sb, st) = src.as_chunks::<LANES>();
    let (db, dt) = dst[..src.len()].as_chunks_mut::<LANES>();
    for (d, v) in db.iter_mut().zip(sb) {
        *d = <f16 as Lane>::store(s, <f32 as Lane>::load(s, v));
    }
    dt.convert_from_f32_slice(st);
}

/// `h = x + residual` over float16 elements, 16 at a time: widened by `vcvtph2ps`, added in
/// float32, rounded once by `vcvtps2ph` (the tail element by element): `math::add_into`'s bits.
/// The fused residual add's on AVX-512 (through blocks on the stack it took the float16 forward
/// at 16384x128 to 1.1-1.3x the add then our norm).
#[inline(always)]
pub fn add_f16(s: V4, x: &[f16], residual: &[f16], h: &mut [f16]) {
    let f = s.avx512f;
    let (xb, xt) = x.as_chunks::<LANES>();
    let (rb, rt) = residual[..x.len()].as_chunks::<LANES>();
    let (hb, ht) = h[..x.len()].as_chunks_mut::<LANES>();
    for ((o, a), b) in hb.iter_mut().zip(xb).zip(rb) {
        *o = f16::store(s, f._mm512_add_ps(f16::load(s, a), f16::load(s, b)));
    }
    for ((o, a), b) in ht.iter_mut().zip(xt).zip(rt) {
        *o = f16::from_f32(a.to_f32() + b.to_f32());
    }
}

/// The forward pass over `rstd.len()` consecutive rows of `n`, as `math::forward_rows` computes
/// it, when x is float32, bfloat16 or float16, the weight one of those and the accumulator
/// float32. Returns false, having written nothing, for any other types.
#[inline(always)]
pub fn forward_rows<'w, T: Element, W: Element + 'w, A: Accum>(
    s: V4,
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [T],
    rstd: &mut [A],
) -> bool {
    if TypeId::of::<A>() != TypeId::of::<f32>() {
        return false;
    }
    match (T::typed(x), T::typed_mut(y)) {
        (Typed::F32(x), TypedMut::F32(y)) => with_weight(s, x, n, w_of, eps, y, rstd),
        (Typed::Bf16(x), TypedMut::Bf16(y)) => with_weight(s, x, n, w_of, eps, y, rstd),
        (Typed::F16(x), TypedMut::F16(y)) => with_weight(s, x, n, w_of, eps, y, rstd),
        _ => false,
    }
}

/// [`forward_rows`] once x's type is known: the weight's.
#[inline(always)]
fn with_weight<'w, X: Lane, W: Element + 'w, A: Accum>(
    s: V4,
    x: &[X],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [X],
    rstd: &mut [A],
) -> bool {
    // W is one type, so every weight row has the kind of an empty one.
    match W::typed(&[]) {
        Typed::F32(_) => {
            rows(s, x, n, typed_rows::<W, f32>(&w_of), eps, y, rstd);
        }
        Typed::Bf16(_) => {
            rows(s, x, n, typed_rows::<W, bf16>(&w_of), eps, y, rstd);
        }
        Typed::F16(_) => {
            rows(s, x, n, typed_rows::<W, f16>(&w_of), eps, y, rstd);
        }
        Typed::Other => return false,
    }
    true
}

/// `w_of`'s rows as the lane type `L`, for a weight type `W` known to be `L`.
#[inline(always)]
fn typed_rows<'w, W: Element + 'w, L: Lane + 'w>(
    w_of: &impl Fn(usize) -> Option<&'w [W]>,
) -> impl Fn(usize) -> Option<&'w [L]> + '_ {
    #[inline(always)]
    move |i| w_of(i).and_then(|w| L::of(W::typed(w)))
}

/// Bytes of x that the forward's rows in flight may span: a group being scaled and the next
/// group being summed. The group's rows are read twice (their sums, then their scaling), and the
/// second read should come from L2 (1-2 MiB a core on the machines measured), beside the lines
/// of y that the scaling fills.
const GROUP_BYTES: usize = 512 * 1024;
/// Most rows per group. Four rows' sums of squares are four independent add chains, and the
/// pass that scales four rows while summing the next four keeps every value in registers; a
/// pass over eight and eight spilled them.
const MAX_GROUP: usize = 4;

/// Rows per group for rows of `n` elements of `size` bytes: [`MAX_GROUP`] if two groups fit in
/// [`GROUP_BYTES`], else 2.
fn group_rows(n: usize, size: usize) -> usize {
    if 2 * MAX_GROUP * n.saturating_mul(size) <= GROUP_BYTES {
        MAX_GROUP
    } else {
        2
    }
}

/// The forward over a chunk's rows, in groups of [`group_rows`] consecutive rows: the first
/// group's sums of squares, then one pass per group that scales it (`y = x * rstd * w`, 32
/// columns of every row at a time, the weight loaded once for the group) while summing the
/// next group's squares ([`scale_rows_summing`]), then the last group scaled alone. The
/// chunk's last rows (fewer than a group) go the same way in groups of 2 and 1.
///
/// Why: with y's lines cold (as in `make bench`, where every variant writes a buffer of its
/// own), re-loading the weight for every row cost about as much as the rest of the scaling; and
/// summing the next rows while storing this group's keeps the loads from memory overlapping the
/// stores, as in `x * c`. See the module's notes for what was measured.
///
/// This and the forward's other group functions are inlined in optimized builds only: in a
/// debug build every inlined temporary keeps a stack slot of its own, and with all of them
/// inlined into one closure the test threads' 2 MiB stacks overflowed. Not inlined, they compute
/// the same bits (the intrinsics run as calls).
#[cfg_attr(not(debug_assertions), inline(always))]
fn rows<'w, X: Lane, W: Lane + 'w, A: Accum>(
    s: V4,
    x: &[X],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [X],
    rstd: &mut [A],
) {
    if n == 0 {
        rstd.fill(A::NAN);
        return;
    }
    let rows = rstd.len();
    let mut first = 0;
    if narrow(n) {
        // Narrow rows in batches of NARROW_BATCH (see `narrow_forward`); the last few go on.
        first = rows / NARROW_BATCH * NARROW_BATCH;
        let span = ..first * n;
        narrow_forward(s, &x[span], n, &w_of, eps, &mut y[span], &mut rstd[..first]);
    }
    // The chunk's rows in groups of the most that fit, then what is left in groups of 2 and 1.
    for g in [group_rows(n, std::mem::size_of::<X>()), 2, 1] {
        let take = (rows - first) / g * g;
        let span = first * n..(first + take) * n;
        let (x, y, rstd) = (
            &x[span.clone()],
            &mut y[span],
            &mut rstd[first..first + take],
        );
        let w_at = |k: usize| w_of(first + k);
        match g {
            MAX_GROUP => chain::<MAX_GROUP, X, W, A>(s, x, n, &w_at, eps, y, rstd),
            2 => chain::<2, X, W, A>(s, x, n, &w_at, eps, y, rstd),
            _ => chain::<1, X, W, A>(s, x, n, &w_at, eps, y, rstd),
        }
        first += take;
    }
}

/// Rows per batch of the narrow-row loops: one row per float64 lane of a vector.
const NARROW_BATCH: usize = 8;
/// Longest rows the narrow-row loops take.
const NARROW_MAX: usize = 256;

/// Whether rows of `n` go through the narrow-row loops: whole vectors (no tail) and at most
/// [`NARROW_MAX`] elements, so a row is one block of its sum (`math::SUM_BLOCK`) and a batch's
/// rows stay in L1 between their two passes.
///
/// Why: a row's sum ends in a compensated total of its 16 float64 lanes, 16 dependent
/// two-sums. For a row of 64 that is more arithmetic than its 4 vectors of squares, and taken
/// row by row (or 4 rows side by side, `VecSum::totals`) it bound the loops: through the
/// kernels alone (`bench/kernel_rows.rs`), rows of 64 took 24 ns each in the forward, against 7
/// for `x * c`. Here 8 rows' lanes are transposed so that each float64 lane holds one row, and
/// the 16 steps run once for the 8 rows.
#[inline(always)]
fn narrow(n: usize) -> bool {
    n > 0 && n.is_multiple_of(LANES) && n <= NARROW_MAX
}

/// The 8x8 transpose of float64 vectors: lane `l` of result `k` is lane `k` of `rows[l]`.
#[inline(always)]
fn transpose8(s: V4, r: [__m512d; 8]) -> [__m512d; 8] {
    let f = s.avx512f;
    let z = f._mm512_setzero_pd();
    // Pairs of rows interleaved: t[2j] holds the even lanes of rows 2j and 2j+1, t[2j+1] the odd.
    let mut t = [z; 8];
    for j in 0..4 {
        t[2 * j] = f._mm512_unpacklo_pd(r[2 * j], r[2 * j + 1]);
        t[2 * j + 1] = f._mm512_unpackhi_pd(r[2 * j], r[2 * j + 1]);
    }
    // Then quadruples: u[j] (j < 4) holds lanes j and j+4 of rows 0-3, u[j + 4] of rows 4-7.
    let quad_lo: __m512i = pulp::cast([0i64, 1, 8, 9, 4, 5, 12, 13]);
    let quad_hi: __m512i = pulp::cast([2i64, 3, 10, 11, 6, 7, 14, 15]);
    let mut u = [z; 8];
    for base in [0, 4] {
        u[base] = f._mm512_permutex2var_pd(t[base], quad_lo, t[base + 2]);
        u[base + 1] = f._mm512_permutex2var_pd(t[base + 1], quad_lo, t[base + 3]);
        u[base + 2] = f._mm512_permutex2var_pd(t[base], quad_hi, t[base + 2]);
        u[base + 3] = f._mm512_permutex2var_pd(t[base + 1], quad_hi, t[base + 3]);
    }
    // Then halves: lane l of all 8 rows.
    let half_lo: __m512i = pulp::cast([0i64, 1, 2, 3, 8, 9, 10, 11]);
    let half_hi: __m512i = pulp::cast([4i64, 5, 6, 7, 12, 13, 14, 15]);
    let mut out = [z; 8];
    for j in 0..4 {
        out[j] = f._mm512_permutex2var_pd(u[j], half_lo, u[j + 4]);
        out[j + 4] = f._mm512_permutex2var_pd(u[j], half_hi, u[j + 4]);
    }
    out
}

/// The totals of 8 rows' sums, each kept as 16 float32 lanes of one block (`q[k]`: row k),
/// in one vector (lane k: row k), with the bits of `VecSum::add` on fresh lanes then
/// `RowSum::total` row by row. A fresh sum's block widens exactly into its float64 lanes
/// (`VecSum::add`) and leaves their error terms 0, so the total's `err += e + lo` is `err += e`
/// here: `e + 0` differs from `e` only for `e = -0`, and adding either zero leaves `err`
/// (which starts at +0 and so is never -0) unchanged.
#[inline(always)]
fn totals8(s: V4, q: [__m512; 8]) -> __m512d {
    let f = s.avx512f;
    let z = f._mm512_setzero_pd();
    let (mut low, mut high) = ([z; 8], [z; 8]);
    for k in 0..8 {
        let halves: [__m256; 2] = pulp::cast(q[k]);
        (low[k], high[k]) = (widen_fresh(s, halves[0]), widen_fresh(s, halves[1]));
    }
    let (low, high) = (transpose8(s, low), transpose8(s, high));
    let (mut sum, mut err) = (z, z);
    for h in low.iter().chain(&high) {
        let (t, e) = two_sum8(s, sum, *h);
        err = f._mm512_add_pd(err, e);
        sum = t;
    }
    // `math::finish_total`: a sum that is not finite is the answer alone.
    let finite = f._mm512_cmp_pd_mask::<_CMP_EQ_OQ>(f._mm512_sub_pd(sum, sum), z);
    f._mm512_mask_blend_pd(finite, sum, f._mm512_add_pd(sum, err))
}

/// `rstd_of(sum, n, eps)` of 8 sums of squares, lane by lane (IEEE division and square root
/// round the same in vectors as in scalars, and so does the narrowing to float32).
#[inline(always)]
fn rstd8(s: V4, sums: __m512d, n: usize, eps: f64) -> [f32; 8] {
    let f = s.avx512f;
    let mean = f._mm512_div_pd(sums, f._mm512_set1_pd(n as f64));
    let root = f._mm512_sqrt_pd(f._mm512_add_pd(mean, f._mm512_set1_pd(eps)));
    pulp::cast(f._mm512_cvtpd_ps(f._mm512_div_pd(f._mm512_set1_pd(1.0), root)))
}

/// The forward over narrow rows (a whole number of batches of [`NARROW_BATCH`]): each batch's
/// sums of squares in float32 lanes as `GroupSums` takes them, their totals side by side
/// ([`totals8`]), rstd, then the batch scaled, re-reading x from L1.
#[cfg_attr(not(debug_assertions), inline(always))]
fn narrow_forward<'w, X: Lane, W: Lane + 'w, A: Accum>(
    s: V4,
    x: &[X],
    n: usize,
    w_of: &impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [X],
    rstd: &mut [A],
) {
    let f = s.avx512f;
    let batch = NARROW_BATCH * n;
    for ((b, (xb, yb)), rb) in x
        .chunks_exact(batch)
        .zip(y.chunks_exact_mut(batch))
        .enumerate()
        .zip(rstd.chunks_exact_mut(NARROW_BATCH))
    {
        let mut q = [f._mm512_setzero_ps(); 8];
        for (q, row) in q.iter_mut().zip(xb.chunks_exact(n)) {
            for c in row.as_chunks::<LANES>().0 {
                *q = add_square(s, *q, c);
            }
        }
        let r = rstd8(s, totals8(s, q), n, eps.to_f64());
        for (k, ((xr, yr), out)) in xb
            .chunks_exact(n)
            .zip(yb.chunks_exact_mut(n))
            .zip(rb.iter_mut())
            .enumerate()
        {
            // rstd is float32 here, so this conversion is exact.
            *out = A::from_f64(r[k] as f64);
            scale_row(s, xr, w_of(b * NARROW_BATCH + k), r[k], yr);
        }
    }
}

/// LayerNorm's forward over `rstd.len()` consecutive rows of `n`, as `layer::forward_rows`
/// computes it, when x is float32, bfloat16 or float16, the weight and bias one of those, the
/// accumulator float32, and a row whole vectors (the rows models use). Returns false, having
/// written nothing, otherwise.
///
/// Narrow rows (see [`narrow`]) in batches of [`NARROW_BATCH`] whose statistics run side by side
/// ([`layer_stats8`]); the others of one block (`math::SUM_BLOCK`; and a batch's rest) one after
/// the other, each row's `y` written in the loop that sums the next row ([`layer_row`]), as the
/// RMS norm's groups overlap the next rows' reads with this group's stores; longer rows one
/// after the other, their sums blocked ([`layer_blocked_stats`]).
///
/// Why: in the portable loops each row's three sums end in a pairwise tree of 16 float64 lanes
/// that LLVM compiled two lanes at a time (at rows of 128, bfloat16, 16384 rows through XLA:
/// the trees and statistics were 30% of the kernel's samples), the applying loop converted
/// bfloat16 16 lanes at a time with a lane-crossing narrowing (35%), and a row's first read
/// waited on memory with nothing else in flight (float32 16384x1024: the load at the head of
/// the sum's loop held 38% of the kernel's samples).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn layer_forward_rows<'w, T: Element, W: Element + 'w, A: Accum>(
    s: V4,
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    b_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [T],
    mean: &mut [A],
    rstd: &mut [A],
) -> bool {
    if TypeId::of::<A>() != TypeId::of::<f32>() || n == 0 || !n.is_multiple_of(LANES) {
        return false;
    }
    // eps is float32 here, so this conversion is exact.
    let eps = eps.to_f64() as f32;
    let stats = (mean, rstd);
    match (T::typed(x), T::typed_mut(y)) {
        (Typed::F32(x), TypedMut::F32(y)) => layer_weights(s, x, n, w_of, b_of, eps, y, stats),
        (Typed::Bf16(x), TypedMut::Bf16(y)) => layer_weights(s, x, n, w_of, b_of, eps, y, stats),
        (Typed::F16(x), TypedMut::F16(y)) => layer_weights(s, x, n, w_of, b_of, eps, y, stats),
        _ => false,
    }
}

/// [`layer_forward_rows`] once x's type is known: the weight's and bias's (one type).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn layer_weights<'w, X: Lane, W: Element + 'w, A: Accum>(
    s: V4,
    x: &[X],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    b_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: f32,
    y: &mut [X],
    stats: (&mut [A], &mut [A]),
) -> bool {
    match W::typed(&[]) {
        Typed::F32(_) => {
            let (w, b) = (typed_rows::<W, f32>(&w_of), typed_rows::<W, f32>(&b_of));
            layer_rows(s, x, n, w, b, eps, y, stats);
        }
        Typed::Bf16(_) => {
            let (w, b) = (typed_rows::<W, bf16>(&w_of), typed_rows::<W, bf16>(&b_of));
            layer_rows(s, x, n, w, b, eps, y, stats);
        }
        Typed::F16(_) => {
            let (w, b) = (typed_rows::<W, f16>(&w_of), typed_rows::<W, f16>(&b_of));
            layer_rows(s, x, n, w, b, eps, y, stats);
        }
        Typed::Other => return false,
    }
    true
}

/// [`layer_forward_rows`] once every type is known.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(debug_assertions), inline(always))]
fn layer_rows<'w, X: Lane, W: Lane + 'w, A: Accum>(
    s: V4,
    x: &[X],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    b_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: f32,
    y: &mut [X],
    (mean, rstd): (&mut [A], &mut [A]),
) {
    let rows = rstd.len();
    // The statistics are float32 here, so their conversions to A are exact.
    let mut record = |i: usize, [m, _, r]: [f32; 3]| {
        (mean[i], rstd[i]) = (A::from_f64(m as f64), A::from_f64(r as f64));
    };
    let mut first = 0;
    if narrow(n) {
        first = rows / NARROW_BATCH * NARROW_BATCH;
        let batch = NARROW_BATCH * n;
        for (b, (xb, yb)) in x[..first * n]
            .chunks_exact(batch)
            .zip(y.chunks_exact_mut(batch))
            .enumerate()
        {
            let [m, d, r] = layer_stats8(s, xb, n, eps as f64);
            for (k, (xr, yr)) in xb.chunks_exact(n).zip(yb.chunks_exact_mut(n)).enumerate() {
                let i = b * NARROW_BATCH + k;
                let stats = [m[k], d[k], r[k]];
                layer_row(s, xr, w_of(i), b_of(i), stats, yr, None);
                record(i, stats);
            }
        }
    }
    if first == rows {
        return;
    }
    if n / LANES > BLOCK_CHUNKS {
        // Rows of many blocks: long enough that the next row's first read need not overlap
        // this one's stores.
        for (i, (xr, yr)) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)).enumerate() {
            let stats = layer_blocked_stats(s, xr, eps);
            layer_row(s, xr, w_of(i), b_of(i), stats, yr, None);
            record(i, stats);
        }
        return;
    }
    let mut sum = row_lanes(s, &x[first * n..][..n]);
    for i in first..rows {
        let xr = &x[i * n..][..n];
        let stats = layer_stats1(s, xr, sum, n, eps);
        let next = x.get((i + 1) * n..(i + 2) * n).filter(|_| i + 1 < rows);
        sum = layer_row(s, xr, w_of(i), b_of(i), stats, &mut y[i * n..][..n], next);
        record(i, stats);
    }
}

/// A row's sum as 16 float32 lanes (as `layer::row_sum` takes it before its total).
#[inline(always)]
fn row_lanes<X: Lane>(s: V4, row: &[X]) -> __m512 {
    let f = s.avx512f;
    let mut q = f._mm512_setzero_ps();
    for c in row.as_chunks::<LANES>().0 {
        q = f._mm512_add_ps(q, X::load(s, c));
    }
    q
}

/// One row's statistics (`[mean, shift, rstd]`) given its sum's lanes, as `layer::stats` takes
/// them: the mean rounded to float32, the sums of `x - mean` and of its square, then
/// `layer::shift_and_rstd`.
#[inline(always)]
fn layer_stats1<X: Lane>(s: V4, row: &[X], sum: __m512, n: usize, eps: f32) -> [f32; 3] {
    let f = s.avx512f;
    let m = (tree1(s, sum) / n as f64) as f32;
    let mv = f._mm512_set1_ps(m);
    let (mut q1, mut q2) = (f._mm512_setzero_ps(), f._mm512_setzero_ps());
    for c in row.as_chunks::<LANES>().0 {
        let d = f._mm512_sub_ps(X::load(s, c), mv);
        q1 = f._mm512_add_ps(q1, d);
        q2 = f._mm512_add_ps(q2, f._mm512_mul_ps(d, d));
    }
    let (d, r) = layer::shift_and_rstd::<f32>(tree1(s, q1), tree1(s, q2), n, eps);
    [m, d, r]
}

/// The statistics of a row of more than one block (as [`layer_stats1`] gives a row of one), as
/// `layer::sums` takes its sums: each block's 16 float32 lanes added into compensated float64
/// lanes ([`VecSum`]), then the row's tail, empty here, as a block of zeros (`RowSum` adds it,
/// so the same operations), totalled by `RowSum::totals`.
#[inline(always)]
fn layer_blocked_stats<X: Lane>(s: V4, row: &[X], eps: f32) -> [f32; 3] {
    let f = s.avx512f;
    let zero = f._mm512_setzero_ps();
    let (chunks, n) = (row.as_chunks::<LANES>().0, row.len());
    let mut sum = VecSum::new(s);
    for block in chunks.chunks(BLOCK_CHUNKS) {
        let mut q = zero;
        for c in block {
            q = f._mm512_add_ps(q, X::load(s, c));
        }
        sum.add(s, q);
    }
    sum.add(s, zero);
    let [total] = VecSum::totals([sum]);
    let m = (total / n as f64) as f32;
    let mv = f._mm512_set1_ps(m);
    let (mut s1, mut s2) = (VecSum::new(s), VecSum::new(s));
    for block in chunks.chunks(BLOCK_CHUNKS) {
        let (mut q1, mut q2) = (zero, zero);
        for c in block {
            let d = f._mm512_sub_ps(X::load(s, c), mv);
            q1 = f._mm512_add_ps(q1, d);
            q2 = f._mm512_add_ps(q2, f._mm512_mul_ps(d, d));
        }
        s1.add(s, q1);
        s2.add(s, q2);
    }
    s1.add(s, zero);
    s2.add(s, zero);
    let [t1, t2] = VecSum::totals([s1, s2]);
    let (d, r) = layer::shift_and_rstd::<f32>(t1, t2, n, eps);
    [m, d, r]
}

/// `layer::tree_total` of one row's 16 float32 lanes: widened (exactly), lane `l` added to
/// lane `l + 8` in one vector addition, then the same pairs as the tree's further levels.
#[inline(always)]
fn tree1(s: V4, q: __m512) -> f64 {
    let f = s.avx512f;
    let halves: [__m256; 2] = pulp::cast(q);
    let v: [f64; 8] =
        pulp::cast(f._mm512_add_pd(f._mm512_cvtps_pd(halves[0]), f._mm512_cvtps_pd(halves[1])));
    ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
}

/// LayerNorm's `y` of one row given its `[mean, shift, rstd]` (`layer::forward_apply`'s
/// operations lane by lane), 32 elements at a time in the lanes [`Lane::load32`] puts them in,
/// the weight and bias loaded into the same lanes; with `next`, that row's sum's lanes summed
/// in the same loop (returned; zeros without it).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn layer_row<X: Lane, W: Lane>(
    s: V4,
    x: &[X],
    w: Option<&[W]>,
    b: Option<&[W]>,
    [m, d, r]: [f32; 3],
    y: &mut [X],
    next: Option<&[X]>,
) -> __m512 {
    let f = s.avx512f;
    let st = [
        f._mm512_set1_ps(m),
        f._mm512_set1_ps(d),
        f._mm512_set1_ps(r),
    ];
    let (x2, xr) = x.as_chunks::<{ 2 * LANES }>();
    let (y2, yr) = y.as_chunks_mut::<{ 2 * LANES }>();
    let (w2, wr) = match w {
        Some(w) => {
            let (w2, wr) = w.as_chunks::<{ 2 * LANES }>();
            (Some(w2), Some(wr))
        }
        None => (None, None),
    };
    let (b2, br) = match b {
        Some(b) => {
            let (b2, br) = b.as_chunks::<{ 2 * LANES }>();
            (Some(b2), Some(br))
        }
        None => (None, None),
    };
    let next = next.map(|v| v.as_chunks::<LANES>().0);
    let mut q = f._mm512_setzero_ps();
    for (p, (ys, xs)) in y2.iter_mut().zip(x2).enumerate() {
        let [x0, x1] = X::load32(s, xs);
        let (w0, w1) = match w2 {
            Some(w2) => {
                let [w0, w1] = X::weight32(s, &w2[p]);
                (Some(w0), Some(w1))
            }
            None => (None, None),
        };
        let (b0, b1) = match b2 {
            Some(b2) => {
                let [b0, b1] = X::weight32(s, &b2[p]);
                (Some(b0), Some(b1))
            }
            None => (None, None),
        };
        *ys = X::store32(s, [layer16(s, x0, st, w0, b0), layer16(s, x1, st, w1, b1)]);
        if let Some(next) = next {
            q = f._mm512_add_ps(q, X::load(s, &next[2 * p]));
            q = f._mm512_add_ps(q, X::load(s, &next[2 * p + 1]));
        }
    }
    // A last 16 (rows are whole vectors), in natural order.
    let (xb, yb) = (xr.as_chunks::<LANES>().0, yr.as_chunks_mut::<LANES>().0);
    if let (Some(xs), Some(ys)) = (xb.first(), yb.first_mut()) {
        let wv = wr.map(|w| W::load(s, &w.as_chunks::<LANES>().0[0]));
        let bv = br.map(|b| W::load(s, &b.as_chunks::<LANES>().0[0]));
        *ys = X::store(s, layer16(s, X::load(s, xs), st, wv, bv));
        if let Some(next) = next {
            q = f._mm512_add_ps(q, X::load(s, &next[2 * x2.len()]));
        }
    }
    q
}

/// `y = ((x - mean) - shift) * rstd * w + b` for 16 lanes (without a weight or a bias, without
/// that factor or term), each operation rounded as `layer::forward_apply` rounds it.
#[inline(always)]
fn layer16(
    s: V4,
    x: __m512,
    [m, d, r]: [__m512; 3],
    w: Option<__m512>,
    b: Option<__m512>,
) -> __m512 {
    let f = s.avx512f;
    let xhat = f._mm512_mul_ps(f._mm512_sub_ps(f._mm512_sub_ps(x, m), d), r);
    let scaled = match w {
        Some(w) => f._mm512_mul_ps(xhat, w),
        None => xhat,
    };
    match b {
        Some(b) => f._mm512_add_ps(scaled, b),
        None => scaled,
    }
}

/// LayerNorm's statistics of 8 narrow rows of `n` (`[mean, shift, rstd]`, lane k: row k), as
/// `layer::stats` takes them: the rows' sums ([`trees8`]), their means rounded to float32,
/// the sums of `x - mean` and of its square, then `layer::shift_and_rstd` lane by lane (IEEE
/// division and square root round the same in vectors as in scalars).
#[inline(always)]
fn layer_stats8<X: Lane>(s: V4, xb: &[X], n: usize, eps: f64) -> [[f32; 8]; 3] {
    let f = s.avx512f;
    let zero = f._mm512_setzero_ps();
    let mut q = [zero; 8];
    for (q, row) in q.iter_mut().zip(xb.chunks_exact(n)) {
        for c in row.as_chunks::<LANES>().0 {
            *q = f._mm512_add_ps(*q, X::load(s, c));
        }
    }
    let count = f._mm512_set1_pd(n as f64);
    let means: [f32; 8] = pulp::cast(f._mm512_cvtpd_ps(f._mm512_div_pd(trees8(s, q), count)));
    let (mut q1, mut q2) = ([zero; 8], [zero; 8]);
    for (k, row) in xb.chunks_exact(n).enumerate() {
        let m = f._mm512_set1_ps(means[k]);
        for c in row.as_chunks::<LANES>().0 {
            let d = f._mm512_sub_ps(X::load(s, c), m);
            q1[k] = f._mm512_add_ps(q1[k], d);
            q2[k] = f._mm512_add_ps(q2[k], f._mm512_mul_ps(d, d));
        }
    }
    let d = f._mm512_div_pd(trees8(s, q1), count);
    let var = f._mm512_sub_pd(f._mm512_div_pd(trees8(s, q2), count), f._mm512_mul_pd(d, d));
    // A negative variance (rounding) is 0; a NaN one stays NaN (the comparison is false).
    let z = f._mm512_setzero_pd();
    let var = f._mm512_mask_blend_pd(f._mm512_cmp_pd_mask::<_CMP_LT_OQ>(var, z), var, z);
    let root = f._mm512_sqrt_pd(f._mm512_add_pd(var, f._mm512_set1_pd(eps)));
    let r = f._mm512_div_pd(f._mm512_set1_pd(1.0), root);
    [
        means,
        pulp::cast(f._mm512_cvtpd_ps(d)),
        pulp::cast(f._mm512_cvtpd_ps(r)),
    ]
}

/// The totals of 8 rows' sums, each kept as 16 float32 lanes of one block (`q[k]`: row k),
/// in one vector (lane k: row k), with the bits of `layer::tree_total` row by row: the lanes
/// widened to float64 (exactly), transposed so that a vector holds one lane of every row, then
/// lane `l` added to lane `l + half`, halving, one vector addition per pair.
#[inline(always)]
fn trees8(s: V4, q: [__m512; 8]) -> __m512d {
    let f = s.avx512f;
    let z = f._mm512_setzero_pd();
    let (mut low, mut high) = ([z; 8], [z; 8]);
    for k in 0..8 {
        let halves: [__m256; 2] = pulp::cast(q[k]);
        (low[k], high[k]) = (f._mm512_cvtps_pd(halves[0]), f._mm512_cvtps_pd(halves[1]));
    }
    // low[j]: lane j of every row; high[j]: lane j + 8.
    let (low, high) = (transpose8(s, low), transpose8(s, high));
    let mut v = [z; 8];
    for j in 0..8 {
        v[j] = f._mm512_add_pd(low[j], high[j]);
    }
    let mut half = 4;
    while half > 0 {
        for j in 0..half {
            v[j] = f._mm512_add_pd(v[j], v[j + half]);
        }
        half /= 2;
    }
    v[0]
}

/// The rows of `x` (a whole number of groups of `G`) as [`rows`] takes them: each group scaled
/// while the next is summed.
#[cfg_attr(not(debug_assertions), inline(always))]
fn chain<'w, const G: usize, X: Lane, W: Lane + 'w, A: Accum>(
    s: V4,
    x: &[X],
    n: usize,
    w_of: &impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    y: &mut [X],
    rstd: &mut [A],
) {
    let group = G * n;
    let groups = rstd.len() / G;
    if groups == 0 {
        return;
    }
    let mut sums = sum_squares_rows::<G, X>(s, &x[..group], n);
    for ((i, yg), rg) in y
        .chunks_exact_mut(group)
        .enumerate()
        .zip(rstd.chunks_exact_mut(G))
    {
        let (xg, w_at) = (&x[i * group..][..group], |k: usize| w_of(i * G + k));
        let next = (i + 1 < groups).then(|| &x[(i + 1) * group..][..group]);
        let (r, w) = group_factors::<G, X, W, A>(w_at, eps, sums, n, rg);
        sums = match (w, next) {
            (Some(w), Some(next)) => scale_rows_summing::<G, X, W>(s, xg, n, w, r, yg, next),
            (w, next) => {
                scale_rows_each::<G, X, W>(s, xg, n, w, w_at, r, yg);
                match next {
                    Some(next) => sum_squares_rows::<G, X>(s, next, n),
                    None => sums,
                }
            }
        };
    }
}

/// A group's rstd (written to `rstd`) and scale factors from its sums of squares, and the
/// weight row its rows share: `Some(None)` if none has a weight, `None` if they differ (a
/// batched weight whose rows change inside the group).
#[inline(always)]
#[allow(clippy::type_complexity)]
fn group_factors<'w, const G: usize, X: Lane, W: Lane + 'w, A: Accum>(
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    sums: [f64; G],
    n: usize,
    rstd: &mut [A],
) -> ([f32; G], Option<Option<&'w [W]>>) {
    for (r, sum) in rstd.iter_mut().zip(sums) {
        *r = rstd_of(sum, n, eps);
    }
    // rstd is float32 here, so the conversions to f32 are exact.
    let r: [f32; G] = std::array::from_fn(|k| rstd[k].to_f64() as f32);
    let first = w_of(0);
    let shared = (1..G).all(|k| match (w_of(k), first) {
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        (None, None) => true,
        _ => false,
    });
    (r, shared.then_some(first))
}

/// A group's rows scaled: together ([`scale_rows`]) when they share a weight row (`Some`),
/// else row by row, each with its own.
#[cfg_attr(not(debug_assertions), inline(always))]
fn scale_rows_each<'w, const G: usize, X: Lane, W: Lane + 'w>(
    s: V4,
    x: &[X],
    n: usize,
    shared: Option<Option<&'w [W]>>,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    r: [f32; G],
    y: &mut [X],
) {
    match shared {
        Some(w) => scale_rows::<G, X, W>(s, x, n, w, r, y),
        None => {
            for (k, (xr, yr)) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)).enumerate() {
                scale_row(s, xr, w_of(k), r[k], yr);
            }
        }
    }
}

/// `math::RowSum` in four vectors: its 16 float64 lanes and their error terms. Adding a block
/// takes the same operations per lane, so [`VecSum::total`] gives `RowSum`'s bits.
#[derive(Clone, Copy)]
struct VecSum {
    hi: [__m512d; 2],
    lo: [__m512d; 2],
    /// No block added yet: the lanes are zero.
    fresh: bool,
}

/// `a + b` and its exact rounding error, lane by lane (`math::two_sum`'s operations).
#[inline(always)]
fn two_sum8(s: V4, a: __m512d, b: __m512d) -> (__m512d, __m512d) {
    let f = s.avx512f;
    let sum = f._mm512_add_pd(a, b);
    let bb = f._mm512_sub_pd(sum, a);
    let err = f._mm512_add_pd(
        f._mm512_sub_pd(a, f._mm512_sub_pd(sum, bb)),
        f._mm512_sub_pd(b, bb),
    );
    (sum, err)
}

/// A block's 8 float32 accumulators added into fresh (zero) float64 lanes: TwoSum's sum of
/// `0 + b`, whose error is 0 where it is read (see [`VecSum::add`]).
#[inline(always)]
fn widen_fresh(s: V4, half: __m256) -> __m512d {
    let f = s.avx512f;
    f._mm512_add_pd(f._mm512_setzero_pd(), f._mm512_cvtps_pd(half))
}

impl VecSum {
    #[inline(always)]
    fn new(s: V4) -> Self {
        let z = s.avx512f._mm512_setzero_pd();
        VecSum {
            hi: [z, z],
            lo: [z, z],
            fresh: true,
        }
    }

    /// Adds a block of 16 float32 accumulators (Knuth's TwoSum per lane, as `RowSum::add`).
    ///
    /// The first block into fresh lanes takes 2 operations per half instead of 7, with the
    /// same bits: TwoSum of `0 + b` is `b` (added to zero, as TwoSum's sum is) with an error
    /// of exactly 0 for finite `b`; where `b` is not finite TwoSum's error is NaN, and never
    /// read: that lane keeps the row's sum non-finite, and `RowSum::total` then returns the sum
    /// alone. Rows of up to `SUM_BLOCK` elements (all of the narrow rows) add one block, so
    /// this was a third of their first pass.
    #[inline(always)]
    fn add(&mut self, s: V4, block: __m512) {
        let f = s.avx512f;
        let halves: [__m256; 2] = pulp::cast(block);
        if self.fresh {
            for (hi, half) in self.hi.iter_mut().zip(halves) {
                *hi = widen_fresh(s, half);
            }
            self.fresh = false;
            return;
        }
        for ((hi, lo), half) in self.hi.iter_mut().zip(&mut self.lo).zip(halves) {
            let (sum, err) = two_sum8(s, *hi, f._mm512_cvtps_pd(half));
            *hi = sum;
            *lo = f._mm512_add_pd(*lo, err);
        }
    }

    /// Adds a row's tail block, `block(tail)` (the tail's terms, one per lane), unless the
    /// tail is empty: TwoSum of `hi + 0` is `hi` with an error of 0 where `hi` is finite, and
    /// where it is not, the error is never read (see [`VecSum::add`]).
    #[inline(always)]
    fn add_tail<X>(&mut self, s: V4, tail: &[X], block: impl FnOnce(&[X]) -> [f32; LANES]) {
        if !tail.is_empty() {
            self.add(s, pulp::cast(block(tail)));
        }
    }

    /// The totals of `G` sums, side by side (`RowSum::totals`).
    #[inline(always)]
    fn totals<const G: usize>(sums: [VecSum; G]) -> [f64; G] {
        RowSum::totals(sums.map(VecSum::row_sum))
    }

    #[inline(always)]
    fn row_sum(self) -> RowSum {
        RowSum::from_lanes(pulp::cast(self.hi), pulp::cast(self.lo))
    }
}

/// `q + v * v` for the 16 lanes `v` of `c`: one step of a row's sum of squares.
#[inline(always)]
fn add_square<X: Lane>(s: V4, q: __m512, c: &[X; LANES]) -> __m512 {
    let f = s.avx512f;
    let v = X::load(s, c);
    f._mm512_add_ps(q, f._mm512_mul_ps(v, v))
}

/// The sums of squares of `G` rows, fed 16 columns of every row at a time, in
/// `math::sum_squares`'s order per row: 16 float32 lanes over each block of `SUM_BLOCK`
/// elements, added into its float64 lanes ([`VecSum`]), then the tail. The rows' add chains are
/// independent, so a loop over them is bound by loads rather than by the latency of one chain.
struct GroupSums<const G: usize> {
    q: [__m512; G],
    sums: [VecSum; G],
    chunks: usize,
}

impl<const G: usize> GroupSums<G> {
    #[inline(always)]
    fn new(s: V4) -> Self {
        GroupSums {
            q: [s.avx512f._mm512_setzero_ps(); G],
            sums: [VecSum::new(s); G],
            chunks: 0,
        }
    }

    /// Adds the 16-lane chunk `c` of every row (`rows[k]`: row k's chunks); chunks come in
    /// order from 0.
    #[inline(always)]
    fn step<X: Lane>(&mut self, s: V4, rows: &[&[[X; LANES]]; G], c: usize) {
        for (q, row) in self.q.iter_mut().zip(rows) {
            *q = add_square(s, *q, &row[c]);
        }
        self.chunks += 1;
        if self.chunks.is_multiple_of(BLOCK_CHUNKS) {
            self.flush(s);
        }
    }

    /// The block's float32 sums into the float64 lanes.
    #[inline(always)]
    fn flush(&mut self, s: V4) {
        for (sum, q) in self.sums.iter_mut().zip(&mut self.q) {
            sum.add(s, *q);
            *q = s.avx512f._mm512_setzero_ps();
        }
    }

    /// The totals, once every whole chunk was added: the last (partial) block, then each row's
    /// tail (its last `n % 16` elements).
    #[inline(always)]
    fn finish<X: Lane>(mut self, s: V4, tails: [&[X]; G]) -> [f64; G] {
        if !self.chunks.is_multiple_of(BLOCK_CHUNKS) {
            self.flush(s);
        }
        for (sum, tail) in self.sums.iter_mut().zip(tails) {
            sum.add_tail(s, tail, tail_squares::<X, f32>);
        }
        VecSum::totals(self.sums)
    }
}

/// The 16-lane chunks and the tails of the `G` consecutive rows of `n` in `x`.
#[inline(always)]
#[allow(clippy::type_complexity)]
fn row_chunks<const G: usize, X: Lane>(x: &[X], n: usize) -> ([&[[X; LANES]]; G], [&[X]; G]) {
    let full = n - n % LANES;
    let rows: [&[X]; G] = std::array::from_fn(|k| &x[k * n..(k + 1) * n]);
    (
        rows.map(|r| r[..full].as_chunks::<LANES>().0),
        rows.map(|r| &r[full..]),
    )
}

/// `sum(x^2)` of each of the `G` consecutive rows of `n` in `x` ([`GroupSums`]).
#[cfg_attr(not(debug_assertions), inline(always))]
fn sum_squares_rows<const G: usize, X: Lane>(s: V4, x: &[X], n: usize) -> [f64; G] {
    let (chunks, tails) = row_chunks::<G, X>(x, n);
    let mut sums = GroupSums::<G>::new(s);
    for c in 0..n / LANES {
        sums.step(s, &chunks, c);
    }
    sums.finish(s, tails)
}

/// `(x * r) * w` (or `x * r`) for 16 elements, as the portable loops take each product.
#[inline(always)]
fn scale16<X: Lane, W: Lane>(
    s: V4,
    x: &[X; LANES],
    w: Option<&[W; LANES]>,
    r: __m512,
) -> [X; LANES] {
    let f = s.avx512f;
    let xr = f._mm512_mul_ps(X::load(s, x), r);
    X::store(
        s,
        match w {
            Some(w) => f._mm512_mul_ps(xr, W::load(s, w)),
            None => xr,
        },
    )
}

/// `y = x * r * w` (or `x * r`) over one row, or one span of a row and of its weight.
#[inline(always)]
fn scale_row<X: Lane, W: Lane>(s: V4, x: &[X], w: Option<&[W]>, r: f32, y: &mut [X]) {
    let rv = s.avx512f._mm512_set1_ps(r);
    let (x2, xr) = x.as_chunks::<{ 2 * LANES }>();
    let (y2, yr) = y.as_chunks_mut::<{ 2 * LANES }>();
    let (xb, xt) = xr.as_chunks::<LANES>();
    let (yb, yt) = yr.as_chunks_mut::<LANES>();
    match w {
        Some(w) => {
            let (w2, wr) = w.as_chunks::<{ 2 * LANES }>();
            let (wb, wt) = wr.as_chunks::<LANES>();
            for ((ys, xs), ws) in y2.iter_mut().zip(x2).zip(w2) {
                *ys = X::scale32(s, X::load32(s, xs), Some(X::weight32(s, ws)), rv);
            }
            for ((ys, xs), ws) in yb.iter_mut().zip(xb).zip(wb) {
                *ys = scale16(s, xs, Some(ws), rv);
            }
            for ((o, &xi), &wi) in yt.iter_mut().zip(xt).zip(wt) {
                *o = X::from_f32(xi.to_f32() * r * wi.to_f32());
            }
        }
        None => {
            for (ys, xs) in y2.iter_mut().zip(x2) {
                *ys = X::scale32(s, X::load32(s, xs), None, rv);
            }
            for (ys, xs) in yb.iter_mut().zip(xb) {
                *ys = scale16::<X, W>(s, xs, None, rv);
            }
            for (o, &xi) in yt.iter_mut().zip(xt) {
                *o = X::from_f32(xi.to_f32() * r);
            }
        }
    }
}

/// [`scale_rows_summing`] with no next rows.
#[cfg_attr(not(debug_assertions), inline(always))]
fn scale_rows<const G: usize, X: Lane, W: Lane>(
    s: V4,
    x: &[X],
    n: usize,
    w: Option<&[W]>,
    r: [f32; G],
    y: &mut [X],
) {
    scale_rows_then::<G, X, W>(s, x, n, w, r, y, |_| {});
}

/// `y = x * r[k] * w` (or `x * r[k]`) over the `G` consecutive rows of `n` in `x`, which share
/// the weight row `w`, while summing the squares of the `G` rows of `next` (as many as x's):
/// 32 columns of every row at a time, the weight loaded once for them all; each row's last
/// columns (under 32) as [`scale_row`] takes them. Returns the next rows' sums of squares.
#[cfg_attr(not(debug_assertions), inline(always))]
fn scale_rows_summing<const G: usize, X: Lane, W: Lane>(
    s: V4,
    x: &[X],
    n: usize,
    w: Option<&[W]>,
    r: [f32; G],
    y: &mut [X],
    next: &[X],
) -> [f64; G] {
    let (chunks, tails) = row_chunks::<G, X>(next, n);
    let mut sums = GroupSums::<G>::new(s);
    // Inlined, so the AVX-512 context reaches it (see `Lane::scale32` on closures).
    scale_rows_then::<G, X, W>(
        s,
        x,
        n,
        w,
        r,
        y,
        #[inline(always)]
        |j| {
            sums.step(s, &chunks, 2 * j);
            sums.step(s, &chunks, 2 * j + 1);
        },
    );
    // The chunk past the last 32 columns, if the rows have one.
    for c in 2 * (n / (2 * LANES))..n / LANES {
        sums.step(s, &chunks, c);
    }
    sums.finish(s, tails)
}

/// The loop of [`scale_rows_summing`]: at each 32 columns `j`, every row's loads, then
/// `between(j)`, then every row's stores.
#[cfg_attr(not(debug_assertions), inline(always))]
fn scale_rows_then<const G: usize, X: Lane, W: Lane>(
    s: V4,
    x: &[X],
    n: usize,
    w: Option<&[W]>,
    r: [f32; G],
    y: &mut [X],
    mut between: impl FnMut(usize),
) {
    let f = s.avx512f;
    let full = n - n % (2 * LANES);
    let mut rv = [f._mm512_setzero_ps(); G];
    for (v, r) in rv.iter_mut().zip(r) {
        *v = f._mm512_set1_ps(r);
    }
    let xs: [&[[X; 2 * LANES]]; G] =
        std::array::from_fn(|k| x[k * n..k * n + full].as_chunks::<{ 2 * LANES }>().0);
    let mut y_rows = y.chunks_exact_mut(n);
    let ys: [&mut [[X; 2 * LANES]]; G] = std::array::from_fn(|_| {
        let row = y_rows.next().expect("G rows of y");
        row[..full].as_chunks_mut::<{ 2 * LANES }>().0
    });
    let ws: Option<&[[W; 2 * LANES]]> = w.map(|w| w[..full].as_chunks::<{ 2 * LANES }>().0);
    for j in 0..full / (2 * LANES) {
        // A match, not `Option::map`: see `Lane::scale32` on closures.
        #[allow(clippy::manual_map)]
        let wv = match ws {
            Some(ws) => Some(X::weight32::<W>(s, &ws[j])),
            None => None,
        };
        // Every load before any store: the rows are a multiple of 64 bytes apart, and a load
        // that follows a store to an address with the same low 12 bits (x and y at the same
        // offset in their pages, which XLA's allocator often gives) waits on it.
        let mut xv = [[f._mm512_setzero_ps(); 2]; G];
        for k in 0..G {
            xv[k] = X::load32(s, &xs[k][j]);
        }
        between(j);
        for k in 0..G {
            ys[k][j] = X::scale32(s, xv[k], wv, rv[k]);
        }
    }
    for (k, (xr, yr)) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)).enumerate() {
        scale_row(s, &xr[full..], w.map(|w| &w[full..]), r[k], &mut yr[full..]);
    }
}

/// Elements of x (and as many of dy) per group of rows in the backward: a group's x and dy
/// (256 KiB in float32) stay in L2 between the first pass (the sums) and the second.
const BACKWARD_GROUP_ELEMENTS: usize = 32 * 1024;
/// Most rows per group (the group's coefficients live on the stack).
const BACKWARD_GROUP_ROWS: usize = 64;

/// A backward's dh (the fused residual add's, where the call has it), and whether a pair of
/// rows' weight-gradient terms are summed before they join the accumulator (see
/// [`backward_rows`]).
pub type Adding<'a, X> = (Option<&'a [X]>, bool);

/// The backward pass with a weight and its gradient over consecutive rows of `n` (as many as
/// `dx` holds), their rstd given or taken from the first pass's sums of squares,
/// as `math::backward_rows_paired` computes it (the same bits: dx, and `acc` gaining the
/// rows' `dy * xhat` a pair at a time, in row order), when x is float32, bfloat16 or float16,
/// the weight one of those and the accumulator float32. Returns false, having written
/// nothing, for any other types. Rows go in groups: the first pass's sums of two rows at a time,
/// then the second pass in column tiles over the group's rows, so a tile of the weight and of
/// the float64 gradient row stays in L1 while every row of the group adds to it. With `dh` (the
/// fused residual add's, as many as `dx`), dx is the norm's gradient plus dh, added in float32
/// before dx's one rounding: `math::backward_row_adding`'s bits; with `paired` false, each row's
/// gradient terms join `acc` alone, in row order (`math::backward_row_adding`'s order too).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_rows<T: Element, W: Element, A: Accum>(
    s: V4,
    x: &[T],
    dy: &[T],
    (dh, paired): Adding<'_, T>,
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [T],
    acc: &mut [A::Wide],
) -> bool {
    if TypeId::of::<A>() != TypeId::of::<f32>() {
        return false;
    }
    let Some(acc) = A::Wide::typed_mut(acc) else {
        return false;
    };
    let dh = (dh.map(T::typed), paired);
    match (T::typed(x), T::typed(dy), T::typed_mut(dx)) {
        (Typed::F32(x), Typed::F32(dy), TypedMut::F32(dx)) => {
            backward_with_weight(s, (x, dy, dh), n, w, rstd, dx, acc)
        }
        (Typed::Bf16(x), Typed::Bf16(dy), TypedMut::Bf16(dx)) => {
            backward_with_weight(s, (x, dy, dh), n, w, rstd, dx, acc)
        }
        (Typed::F16(x), Typed::F16(dy), TypedMut::F16(dx)) => {
            backward_with_weight(s, (x, dy, dh), n, w, rstd, dx, acc)
        }
        _ => false,
    }
}

#[inline(always)]
fn backward_with_weight<X: Lane, W: Element, A: Accum>(
    s: V4,
    (x, dy, (dh, paired)): (&[X], &[X], (Option<Typed<'_>>, bool)),
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [X],
    acc: &mut [f64],
) -> bool {
    let dh = match dh.map(X::of) {
        Some(None) => return false,
        dh => (dh.flatten(), paired),
    };
    match W::typed(w) {
        Typed::F32(w) => backward_groups(s, (x, dy, dh), n, w, rstd, dx, acc),
        Typed::Bf16(w) => backward_groups(s, (x, dy, dh), n, w, rstd, dx, acc),
        Typed::F16(w) => backward_groups(s, (x, dy, dh), n, w, rstd, dx, acc),
        Typed::Other => return false,
    }
    true
}

/// Inlined in optimized builds only, as the forward's [`rows`] (a debug build's frame of every
/// (x, weight) pair inlined into one closure overflowed the test threads' stacks).
#[cfg_attr(not(debug_assertions), inline(always))]
#[allow(clippy::too_many_arguments)]
fn backward_groups<X: Lane, W: Lane, A: Accum>(
    s: V4,
    (x, dy, (dh, paired)): (&[X], &[X], Adding<'_, X>),
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [X],
    acc: &mut [f64],
) {
    if n == 0 {
        return;
    }
    // An even number of rows, so no pair of rows (see `backward_tiles`) straddles two groups.
    let group = (BACKWARD_GROUP_ELEMENTS / n).clamp(2, BACKWARD_GROUP_ROWS) & !1;
    let rows = dx.len() / n;
    let row = |i: usize| i * n..(i + 1) * n;
    for g0 in (0..rows).step_by(group) {
        let g1 = (g0 + group).min(rows);
        let (mut r, mut c) = ([0f32; BACKWARD_GROUP_ROWS], [0f32; BACKWARD_GROUP_ROWS]);
        let mut i = g0;
        if narrow(n) {
            // Narrow rows: batches of 8 (see `narrow_sums`), the last few in pairs below.
            while i + NARROW_BATCH <= g1 {
                let span = i * n..(i + NARROW_BATCH) * n;
                let (rb, cb) = narrow_sums(s, &x[span.clone()], &dy[span], n, w, rstd, i);
                r[i - g0..][..NARROW_BATCH].copy_from_slice(&rb);
                c[i - g0..][..NARROW_BATCH].copy_from_slice(&cb);
                i += NARROW_BATCH;
            }
        }
        let mut factors = |i: usize, sums: (f64, f64)| {
            let (ri, ci) = row_factors(rstd, i, sums, n);
            // A is float32 here, so the conversions are exact.
            (r[i - g0], c[i - g0]) = (ri.to_f64() as f32, ci.to_f64() as f32);
        };
        while i < g1 {
            if i + 1 < g1 {
                let [dot_a, sq_a, dot_b, sq_b] = VecSum::totals(row_sums_pair(
                    s,
                    (&x[row(i)], &dy[row(i)]),
                    (&x[row(i + 1)], &dy[row(i + 1)]),
                    w,
                ));
                factors(i, (dot_a, sq_a));
                factors(i + 1, (dot_b, sq_b));
                i += 2;
            } else {
                let [dot, sq, _, _] =
                    VecSum::totals(row_sums_pair(s, (&x[row(i)], &dy[row(i)]), (&[], &[]), w));
                factors(i, (dot, sq));
                i += 1;
            }
        }
        let span = g0 * n..g1 * n;
        backward_tiles(
            s,
            (&x[span.clone()], &dy[span.clone()]),
            (dh.map(|dh| &dh[span.clone()]), paired),
            n,
            w,
            (&r[..g1 - g0], &c[..g1 - g0]),
            &mut dx[span],
            acc,
        );
    }
}

/// The backward's first pass over a batch of 8 narrow rows (`narrow`), rows `first..` of
/// `rstd`: each row's dot product `sum(g * x)` and sum of squares in float32 lanes as
/// [`row_sums_pair`] takes them, their totals side by side ([`totals8`]; the squares' only when
/// rstd is not given), then each row's `(rstd, c)` as `math::row_factors` takes them, lane by
/// lane.
#[inline(always)]
fn narrow_sums<X: Lane, W: Lane, A: Accum>(
    s: V4,
    x: &[X],
    dy: &[X],
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    first: usize,
) -> ([f32; 8], [f32; 8]) {
    let f = s.avx512f;
    let z = f._mm512_setzero_ps();
    let (mut dots, mut squares) = ([z; 8], [z; 8]);
    let wc = w.as_chunks::<LANES>().0;
    for k in 0..NARROW_BATCH {
        let (xc, dc) = (
            x[k * n..(k + 1) * n].as_chunks::<LANES>().0,
            dy[k * n..(k + 1) * n].as_chunks::<LANES>().0,
        );
        let (mut dot, mut sq) = (z, z);
        for ((xs, ds), ws) in xc.iter().zip(dc).zip(wc) {
            (dot, sq) = sums_step(s, (dot, sq), xs, ds, W::load(s, ws));
        }
        (dots[k], squares[k]) = (dot, sq);
    }
    let r: [f32; 8] = match rstd {
        // A is float32 here, so the conversions are exact.
        Rstd::Given(given) => std::array::from_fn(|k| given[first + k].to_f64() as f32),
        Rstd::FromX(eps) => rstd8(s, totals8(s, squares), n, eps.to_f64()),
    };
    // `math::coefficient`: dot / n * r in float64, rounded once.
    let r64 = f._mm512_cvtps_pd(pulp::cast(r));
    let mean = f._mm512_div_pd(totals8(s, dots), f._mm512_set1_pd(n as f64));
    (r, pulp::cast(f._mm512_cvtpd_ps(f._mm512_mul_pd(mean, r64))))
}

/// `(sum(g * x), sum(x^2))` with `g = dy * w` of two rows (`x`, `dy`) sharing the weight, each
/// in `math::row_sums`'s order, before their totals: `[dot a, squares a, dot b, squares b]`.
/// An empty second row gives zeros for it.
#[inline(always)]
fn row_sums_pair<X: Lane, W: Lane>(
    s: V4,
    a: (&[X], &[X]),
    b: (&[X], &[X]),
    w: &[W],
) -> [VecSum; 4] {
    let f = s.avx512f;
    let (mut sa, mut sb) = (VecSum::new(s), VecSum::new(s));
    let (mut ta, mut tb) = (VecSum::new(s), VecSum::new(s));
    let (wc, wt) = w.as_chunks::<LANES>();
    let (xa, xat) = a.0.as_chunks::<LANES>();
    let (da, dat) = a.1.as_chunks::<LANES>();
    let pair = !b.0.is_empty();
    let (xb, xbt) = b.0.as_chunks::<LANES>();
    let (db, dbt) = b.1.as_chunks::<LANES>();
    for (k, wk) in wc.chunks(BLOCK_CHUNKS).enumerate() {
        let blocks = k * BLOCK_CHUNKS..k * BLOCK_CHUNKS + wk.len();
        let z = f._mm512_setzero_ps();
        let (mut qa, mut qb, mut pa, mut pb) = (z, z, z, z);
        if pair {
            for (((ws, xs), ds), (ys, es)) in wk
                .iter()
                .zip(&xa[blocks.clone()])
                .zip(&da[blocks.clone()])
                .zip(xb[blocks.clone()].iter().zip(&db[blocks.clone()]))
            {
                let wv = W::load(s, ws);
                (qa, pa) = sums_step(s, (qa, pa), xs, ds, wv);
                (qb, pb) = sums_step(s, (qb, pb), ys, es, wv);
            }
            sb.add(s, qb);
            tb.add(s, pb);
        } else {
            for ((ws, xs), ds) in wk.iter().zip(&xa[blocks.clone()]).zip(&da[blocks]) {
                (qa, pa) = sums_step(s, (qa, pa), xs, ds, W::load(s, ws));
            }
        }
        sa.add(s, qa);
        ta.add(s, pa);
    }
    sa.add_tail(s, xat, |xat| tail_dot::<X, W, f32>(xat, dat, wt));
    ta.add_tail(s, xat, tail_squares::<X, f32>);
    sb.add_tail(s, xbt, |xbt| tail_dot::<X, W, f32>(xbt, dbt, wt));
    tb.add_tail(s, xbt, tail_squares::<X, f32>);
    [sa, ta, sb, tb]
}

/// `(dot + (dy * w) * x, sq + x * x)`, lane by lane.
#[inline(always)]
fn sums_step<X: Lane>(
    s: V4,
    (dot, sq): (__m512, __m512),
    x: &[X; LANES],
    dy: &[X; LANES],
    w: __m512,
) -> (__m512, __m512) {
    let f = s.avx512f;
    let (xv, g) = (X::load(s, x), f._mm512_mul_ps(X::load(s, dy), w));
    (
        f._mm512_add_ps(dot, f._mm512_mul_ps(g, xv)),
        f._mm512_add_ps(sq, f._mm512_mul_ps(xv, xv)),
    )
}

/// The second pass of a group's rows, [`TILE`] columns of every row at a time:
/// `dx = r * (dy * w - xhat * c)` (plus dh, where given, before the rounding) and
/// `acc += dy * xhat`, rows paired from the group's first (with `paired`, the pair's float32
/// sum widened once, as `math::backward_rows_paired` adds it, else each row's term alone; a
/// last odd row alone).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_tiles<X: Lane, W: Lane>(
    s: V4,
    (x, dy): (&[X], &[X]),
    (dh, paired): Adding<'_, X>,
    n: usize,
    w: &[W],
    (rstd, c): (&[f32], &[f32]),
    dx: &mut [X],
    acc: &mut [f64],
) {
    let f = s.avx512f;
    let r_of = |i: usize| rstd[i];
    let rows = c.len();
    for t0 in (0..n).step_by(TILE) {
        let cols = t0..(t0 + TILE).min(n);
        let (wb, wt) = w[cols.clone()].as_chunks::<LANES>();
        let (ab, at) = acc[cols.clone()].as_chunks_mut::<LANES>();
        let tile = |i: usize| i * n + cols.start..i * n + cols.end;
        // Row i's dh in this tile: whole vectors and the tail (empty without dh).
        let dh_of = |i: usize| dh.map_or((&[][..], &[][..]), |dh| dh[tile(i)].as_chunks::<LANES>());
        let mut i = 0;
        while i + 1 < rows {
            let (r0, r1, c0, c1) = (r_of(i), r_of(i + 1), c[i], c[i + 1]);
            let (rv0, cv0) = (f._mm512_set1_ps(r0), f._mm512_set1_ps(c0));
            let (rv1, cv1) = (f._mm512_set1_ps(r1), f._mm512_set1_ps(c1));
            let (x0b, x0t) = x[tile(i)].as_chunks::<LANES>();
            let (x1b, x1t) = x[tile(i + 1)].as_chunks::<LANES>();
            let (d0b, d0t) = dy[tile(i)].as_chunks::<LANES>();
            let (d1b, d1t) = dy[tile(i + 1)].as_chunks::<LANES>();
            let ((e0b, e0t), (e1b, e1t)) = (dh_of(i), dh_of(i + 1));
            let (o0, o1) = dx[i * n..(i + 2) * n].split_at_mut(n);
            let (o0b, o0t) = o0[cols.clone()].as_chunks_mut::<LANES>();
            let (o1b, o1t) = o1[cols.clone()].as_chunks_mut::<LANES>();
            for (k, ((((ws, accs), (xs0, xs1)), (ds0, ds1)), (os0, os1))) in wb
                .iter()
                .zip(ab.iter_mut())
                .zip(x0b.iter().zip(x1b))
                .zip(d0b.iter().zip(d1b))
                .zip(o0b.iter_mut().zip(o1b.iter_mut()))
                .enumerate()
            {
                let wv = W::load(s, ws);
                let (h0, d0) = (f._mm512_mul_ps(X::load(s, xs0), rv0), X::load(s, ds0));
                let (h1, d1) = (f._mm512_mul_ps(X::load(s, xs1), rv1), X::load(s, ds1));
                *os0 = plus_dh(s, dx_value(s, h0, d0, wv, rv0, cv0), e0b.get(k));
                *os1 = plus_dh(s, dx_value(s, h1, d1, wv, rv1, cv1), e1b.get(k));
                let (p0, p1) = (f._mm512_mul_ps(d0, h0), f._mm512_mul_ps(d1, h1));
                *accs = if paired {
                    widen_add(s, *accs, f._mm512_add_ps(p0, p1))
                } else {
                    widen_add(s, widen_add(s, *accs, p0), p1)
                };
            }
            for (l, a) in at.iter_mut().enumerate() {
                let wl = wt[l].to_f32();
                let (h0, d0) = (x0t[l].to_f32() * r0, d0t[l].to_f32());
                let (h1, d1) = (x1t[l].to_f32() * r1, d1t[l].to_f32());
                o0t[l] = tail_plus_dh(r0 * (d0 * wl - h0 * c0), e0t.get(l));
                o1t[l] = tail_plus_dh(r1 * (d1 * wl - h1 * c1), e1t.get(l));
                if paired {
                    *a += (d0 * h0 + d1 * h1) as f64;
                } else {
                    *a += (d0 * h0) as f64;
                    *a += (d1 * h1) as f64;
                }
            }
            i += 2;
        }
        if i < rows {
            let (r, c) = (r_of(i), c[i]);
            let (rv, cv) = (f._mm512_set1_ps(r), f._mm512_set1_ps(c));
            let (xb, xt) = x[tile(i)].as_chunks::<LANES>();
            let (db, dt) = dy[tile(i)].as_chunks::<LANES>();
            let (eb, et) = dh_of(i);
            let (ob, ot) = dx[tile(i)].as_chunks_mut::<LANES>();
            for (k, ((((os, xs), ds), ws), accs)) in ob
                .iter_mut()
                .zip(xb)
                .zip(db)
                .zip(wb)
                .zip(ab.iter_mut())
                .enumerate()
            {
                let (h, d) = (f._mm512_mul_ps(X::load(s, xs), rv), X::load(s, ds));
                *os = plus_dh(s, dx_value(s, h, d, W::load(s, ws), rv, cv), eb.get(k));
                *accs = widen_add(s, *accs, f._mm512_mul_ps(d, h));
            }
            for (l, ((((o, &xi), &di), &wi), a)) in ot
                .iter_mut()
                .zip(xt)
                .zip(dt)
                .zip(wt)
                .zip(at.iter_mut())
                .enumerate()
            {
                let h = xi.to_f32() * r;
                let d = di.to_f32();
                *o = tail_plus_dh(r * (d * wi.to_f32() - h * c), et.get(l));
                *a += (d * h) as f64;
            }
        }
    }
}

/// `r * (dy * w - xhat * c)`, in float32.
#[inline(always)]
fn dx_value(s: V4, h: __m512, d: __m512, w: __m512, r: __m512, c: __m512) -> __m512 {
    let f = s.avx512f;
    let g = f._mm512_mul_ps(d, w);
    f._mm512_mul_ps(r, f._mm512_sub_ps(g, f._mm512_mul_ps(h, c)))
}

/// `v` plus dh where the call has it (none: `v` as it is, a negative zero kept), stored as `X`:
/// one rounding either way.
#[inline(always)]
fn plus_dh<X: Lane>(s: V4, v: __m512, dh: Option<&[X; LANES]>) -> [X; LANES] {
    let v = match dh {
        Some(dh) => s.avx512f._mm512_add_ps(v, X::load(s, dh)),
        None => v,
    };
    X::store(s, v)
}

/// [`plus_dh`] of one element (a tile's tail).
#[inline(always)]
fn tail_plus_dh<X: Lane>(v: f32, dh: Option<&X>) -> X {
    X::from_f32(match dh {
        Some(dh) => v + dh.to_f32(),
        None => v,
    })
}

/// `acc + p` for 16 float64 accumulators and 16 float32 terms, each term widened exactly.
#[inline(always)]
fn widen_add(s: V4, acc: [f64; LANES], p: __m512) -> [f64; LANES] {
    let f = s.avx512f;
    let p: [__m256; 2] = pulp::cast(p);
    let mut a: [__m512d; 2] = pulp::cast(acc);
    for (a, p) in a.iter_mut().zip(p) {
        *a = f._mm512_add_pd(*a, f._mm512_cvtps_pd(p));
    }
    pulp::cast(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The F16C conversions give `math`'s scalar conversions' bits: every float16 widened (in
    /// 16 packed lanes and in even and odd lanes), and float32 values every 4099th bit pattern
    /// plus float16's rounding boundaries, ties and subnormals, narrowed.
    #[test]
    fn conversions_match_the_scalar_ones() {
        let Some(s) = V4::try_new() else {
            // Nothing to compare on a CPU without AVX-512 (the loops above never run there);
            // said on stderr so that a run on such a machine does not read as a pass.
            eprintln!("conversions_match_the_scalar_ones: no AVX-512 on this CPU, not checked");
            return;
        };
        s.vectorize(|| {
            let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
            for chunk in halves.chunks_exact(2 * LANES) {
                let chunk: &[f16; 2 * LANES] = chunk.try_into().unwrap();
                let (lo, _) = chunk.as_chunks::<LANES>();
                let packed: [f32; LANES] = pulp::cast(f16::load(s, &lo[0]));
                for (h, got) in lo[0].iter().zip(packed) {
                    assert_eq!(got.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
                }
                let (even, odd) = f16::load_even_odd(s, chunk);
                let (even, odd): ([f32; LANES], [f32; LANES]) = (pulp::cast(even), pulp::cast(odd));
                for i in 0..LANES {
                    assert_eq!(even[i].to_bits(), chunk[2 * i].to_f32().to_bits());
                    assert_eq!(odd[i].to_bits(), chunk[2 * i + 1].to_f32().to_bits());
                }
            }
            let mut floats: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
            for h in (0..=u16::MAX).step_by(7).map(f16::from_bits) {
                // A float16, the points halfway to its neighbours, and one float32 ulp either
                // side of those: the ties and the values just off them.
                let bits = h.to_f32().to_bits();
                for d in [0u32, 1, 0xfff, 0x1000, 0x1001, 0x1fff] {
                    floats.push(f32::from_bits(bits.wrapping_add(d)));
                    floats.push(f32::from_bits(bits.wrapping_sub(d)));
                }
            }
            floats.extend([65504.0, 65519.99, 65520.0, 5.96e-8, 2.98e-8, 2.99e-8, 1e-45]);
            for chunk in floats.chunks_exact(LANES) {
                let chunk: &[f32; LANES] = chunk.try_into().unwrap();
                let got = f16::store(s, pulp::cast(*chunk));
                for (v, h) in chunk.iter().zip(got) {
                    let want = f16::from_f32(*v);
                    assert_eq!(h.to_bits(), want.to_bits(), "{v:e} ({:#010x})", v.to_bits());
                }
            }
        });
    }
}
