//! The forward pass, and the backward pass with a weight, of float32 and bfloat16 rows in
//! explicit AVX-512, for the instruction set most of this library's CPU time runs on. The
//! portable loops in `handlers::math` leave the vectorizing to LLVM, which in these loops split
//! accumulators into pieces and re-read the weight from L2 for every row. These loops take the
//! same operations in the same order per lane, so their results are bit-identical to the
//! portable ones (tested on every instruction set), in a different order over memory:
//!
//! 1. the sums of squares (backward: the dot products and the sums of squares) of two rows at
//!    a time: independent add chains, so the loop is bound by loads, not by the latency of one
//!    chain;
//! 2. forward, rows of 2048 and more: one pass per pair of rows that scales it
//!    (`y = x * rstd * w`) while summing the next pair, so the next rows' loads (from L3 or
//!    memory when x was written by whatever ran before) overlap this pair's stores; shorter
//!    rows: all the sums, then each row scaled;
//! 3. backward: the second pass (dx and the weight gradient) in column tiles over a group of
//!    rows, so a tile of the weight and of the float64 gradient row stays in L1 while every row
//!    uses it, and the group's x and dy are re-read from L2.
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
//! also the second read of x.
//!
//! The forward's pass per pair (step 2) replaced a second pass in column tiles over the
//! chunk's rows, which kept a tile of the weight in L1 but started a new 4 KiB page of y every
//! 4 KiB of stores. In `make bench`'s shuffled rounds, where x and y are often cold, it took the
//! float32 forward at 256x4096 and 64x16384 from 1.10-1.30x its floor to 1.00-1.22x (bfloat16:
//! 0.80-0.85x to 0.72-0.75x), measured in one process against the tiled build; in a tight loop,
//! where all of it stays in cache, it was 0-6% slower. Summing one row ahead (one add chain,
//! tried before) had cost the tight loop 15-20%.

use core::any::TypeId;
use core::arch::x86_64::{__m256, __m256i, __m512, __m512d, __m512i, _CMP_UNORD_Q};

use half::bf16;
use pulp::x86::V4;

use crate::handlers::math::{
    row_factors, rstd_of, sum_squares, tail_dot, tail_squares, Accum, Element, RowSum, Rstd, Typed,
    TypedMut, WideSum, BLOCK_CHUNKS, LANES, SUM_BLOCK,
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

    /// `y = (x * r) * w` (or `x * r`) for 32 elements: each element's product as the portable
    /// loops take it, in whichever lanes suit the type.
    #[inline(always)]
    fn scale32<W: Lane>(
        s: V4,
        x: &[Self; 2 * LANES],
        w: Option<&[W; 2 * LANES]>,
        r: __m512,
    ) -> [Self; 2 * LANES] {
        let f = s.avx512f;
        let (xs, _) = x.as_chunks::<LANES>();
        let mut out = [Self::default(); 2 * LANES];
        for (k, (o, xv)) in out
            .as_chunks_mut::<LANES>()
            .0
            .iter_mut()
            .zip(xs)
            .enumerate()
        {
            let xr = f._mm512_mul_ps(Self::load(s, xv), r);
            *o = Self::store(
                s,
                match w {
                    Some(w) => f._mm512_mul_ps(xr, W::load(s, &w.as_chunks::<LANES>().0[k])),
                    None => xr,
                },
            );
        }
        out
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
    fn scale32<W: Lane>(
        s: V4,
        x: &[bf16; 2 * LANES],
        w: Option<&[W; 2 * LANES]>,
        r: __m512,
    ) -> [bf16; 2 * LANES] {
        let f = s.avx512f;
        let (xe, xo) = Self::load_even_odd(s, x);
        let (mut ye, mut yo) = (f._mm512_mul_ps(xe, r), f._mm512_mul_ps(xo, r));
        if let Some(w) = w {
            let (we, wo) = W::load_even_odd(s, w);
            ye = f._mm512_mul_ps(ye, we);
            yo = f._mm512_mul_ps(yo, wo);
        }
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

/// The forward pass over `rstd.len()` consecutive rows of `n`, as `math::forward_rows` computes
/// it, when x is float32 or bfloat16, the weight float32 or bfloat16 and the accumulator
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
            let w = |i| w_of(i).and_then(|w| f32::of(W::typed(w)));
            rows(s, x, n, w, eps, y, rstd);
        }
        Typed::Bf16(_) => {
            let w = |i| w_of(i).and_then(|w| bf16::of(W::typed(w)));
            rows(s, x, n, w, eps, y, rstd);
        }
        Typed::Other => return false,
    }
    true
}

/// Rows at least this long take the pipelined pass of [`rows`]. In shorter rows a pair's
/// scaling waits on the float64 totals, square roots and divisions of the step before, which
/// little else overlaps: the pipelined pass was 3-7% slower there at rows of 512 and 1024, and
/// 8-15% faster from 2048 up (`make bench`'s shuffled rounds, both in one process).
const PIPELINE_MIN_ROW: usize = SUM_BLOCK;

/// The forward over a chunk's rows. Rows of [`PIPELINE_MIN_ROW`] and more, in pairs: the sums
/// of squares of the first pair, then one pass per pair that scales it while summing the next
/// pair ([`scale_pair_summing_pair`]), then the last pair on its own. Shorter rows: every
/// pair's sums, then every row scaled. An odd last row is summed and scaled on its own.
#[inline(always)]
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
    let row = |i: usize| &x[i * n..(i + 1) * n];
    let pairs = rows / 2;
    let pipelined = n >= PIPELINE_MIN_ROW;
    for p in 0..if pipelined { pairs.min(1) } else { pairs } {
        let (a, b) = sum_squares_pair(s, row(2 * p), row(2 * p + 1));
        rstd[2 * p] = rstd_of(a, n, eps);
        rstd[2 * p + 1] = rstd_of(b, n, eps);
    }
    if rows % 2 == 1 {
        rstd[rows - 1] = rstd_of(sum_squares::<X, f32>(row(rows - 1)), n, eps);
    }
    // rstd is float32 here, so the conversions to f32 are exact.
    if !pipelined {
        for (i, ((xr, yr), r)) in x
            .chunks_exact(n)
            .zip(y.chunks_exact_mut(n))
            .zip(rstd.iter())
            .enumerate()
        {
            scale_row(s, xr, w_of(i), r.to_f64() as f32, yr);
        }
        return;
    }
    for p in 0..pairs {
        let i = 2 * p;
        let (y0, y1) = y[i * n..(i + 2) * n].split_at_mut(n);
        let r = [rstd[i].to_f64() as f32, rstd[i + 1].to_f64() as f32];
        let w = [w_of(i), w_of(i + 1)];
        if p + 1 < pairs {
            let next = [row(i + 2), row(i + 3)];
            let (a, b) = scale_pair_summing_pair(s, [row(i), row(i + 1)], w, r, [y0, y1], next);
            rstd[i + 2] = rstd_of(a, n, eps);
            rstd[i + 3] = rstd_of(b, n, eps);
        } else {
            scale_row(s, row(i), w[0], r[0], y0);
            scale_row(s, row(i + 1), w[1], r[1], y1);
        }
    }
    if rows % 2 == 1 {
        let i = rows - 1;
        scale_row(s, row(i), w_of(i), rstd[i].to_f64() as f32, &mut y[i * n..]);
    }
}

/// `math::RowSum` in four vectors: its 16 float64 lanes and their error terms. Adding a block
/// takes the same operations per lane, so [`VecSum::total`] gives `RowSum`'s bits.
#[derive(Clone, Copy)]
struct VecSum {
    hi: [__m512d; 2],
    lo: [__m512d; 2],
}

impl VecSum {
    #[inline(always)]
    fn new(s: V4) -> Self {
        let z = s.avx512f._mm512_setzero_pd();
        VecSum {
            hi: [z, z],
            lo: [z, z],
        }
    }

    /// Adds a block of 16 float32 accumulators (Knuth's TwoSum per lane, as `RowSum::add`).
    #[inline(always)]
    fn add(&mut self, s: V4, block: __m512) {
        let f = s.avx512f;
        let halves: [__m256; 2] = pulp::cast(block);
        for ((hi, lo), half) in self.hi.iter_mut().zip(&mut self.lo).zip(halves) {
            let (a, b) = (*hi, f._mm512_cvtps_pd(half));
            let sum = f._mm512_add_pd(a, b);
            let bb = f._mm512_sub_pd(sum, a);
            let err = f._mm512_add_pd(
                f._mm512_sub_pd(a, f._mm512_sub_pd(sum, bb)),
                f._mm512_sub_pd(b, bb),
            );
            *hi = sum;
            *lo = f._mm512_add_pd(*lo, err);
        }
    }

    #[inline(always)]
    fn total(self) -> f64 {
        RowSum::from_lanes(pulp::cast(self.hi), pulp::cast(self.lo)).total()
    }
}

/// `q + v * v` for the 16 lanes `v` of `c`: one step of a row's sum of squares.
#[inline(always)]
fn add_square<X: Lane>(s: V4, q: __m512, c: &[X; LANES]) -> __m512 {
    let f = s.avx512f;
    let v = X::load(s, c);
    f._mm512_add_ps(q, f._mm512_mul_ps(v, v))
}

/// `sum(x^2)` of rows `a` and `b` (of one length), each in `math::sum_squares`'s order.
#[inline(always)]
fn sum_squares_pair<X: Lane>(s: V4, a: &[X], b: &[X]) -> (f64, f64) {
    let f = s.avx512f;
    let (mut sa, mut sb) = (VecSum::new(s), VecSum::new(s));
    let (ac, at) = a.as_chunks::<LANES>();
    let (bc, bt) = b.as_chunks::<LANES>();
    for (ka, kb) in ac.chunks(BLOCK_CHUNKS).zip(bc.chunks(BLOCK_CHUNKS)) {
        let (mut qa, mut qb) = (f._mm512_setzero_ps(), f._mm512_setzero_ps());
        for (ca, cb) in ka.iter().zip(kb) {
            qa = add_square(s, qa, ca);
            qb = add_square(s, qb, cb);
        }
        sa.add(s, qa);
        sb.add(s, qb);
    }
    sa.add(s, pulp::cast(tail_squares::<X, f32>(at)));
    sb.add(s, pulp::cast(tail_squares::<X, f32>(bt)));
    (sa.total(), sb.total())
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
                *ys = X::scale32(s, xs, Some(ws), rv);
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
                *ys = X::scale32::<W>(s, xs, None, rv);
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

/// Scales rows `cur` (`y = x * r * w`) into `out` while summing the squares of rows `next`, in
/// one pass: the next rows' loads, which often come from L3 or memory (the rows were written
/// by whatever ran before), overlap the current rows' stores, where two passes left each
/// waiting on its own traffic. The sums are [`sum_squares_pair`]'s, block by block, so they
/// give its bits. Returns the next rows' sums of squares.
#[inline(always)]
fn scale_pair_summing_pair<X: Lane, W: Lane>(
    s: V4,
    cur: [&[X]; 2],
    w: [Option<&[W]>; 2],
    r: [f32; 2],
    out: [&mut [X]; 2],
    next: [&[X]; 2],
) -> (f64, f64) {
    let n = cur[0].len();
    let full = n - n % LANES;
    let [y0, y1] = out;
    let (mut sa, mut sb) = (VecSum::new(s), VecSum::new(s));
    for e0 in (0..full).step_by(SUM_BLOCK) {
        let cols = e0..(e0 + SUM_BLOCK).min(full);
        let x = cur.map(|x| &x[cols.clone()]);
        let y = [&mut y0[cols.clone()], &mut y1[cols.clone()]];
        let next = next.map(|x| &x[cols.clone()]);
        let (qa, qb) = match w {
            [Some(w0), Some(w1)] => {
                let w = [Some(&w0[cols.clone()]), Some(&w1[cols.clone()])];
                scale_block_summing(s, x, w, r, y, next)
            }
            _ => scale_block_summing::<X, W>(s, x, [None, None], r, y, next),
        };
        sa.add(s, qa);
        sb.add(s, qb);
    }
    let tail_w = w.map(|w| w.map(|w| &w[full..]));
    scale_row(s, &cur[0][full..], tail_w[0], r[0], &mut y0[full..]);
    scale_row(s, &cur[1][full..], tail_w[1], r[1], &mut y1[full..]);
    sa.add(s, pulp::cast(tail_squares::<X, f32>(&next[0][full..])));
    sb.add(s, pulp::cast(tail_squares::<X, f32>(&next[1][full..])));
    (sa.total(), sb.total())
}

/// `q + x^2` for 32 elements, as two 16-lane steps of a row's sum of squares.
#[inline(always)]
fn add_squares32<X: Lane>(s: V4, q: __m512, c: &[X; 2 * LANES]) -> __m512 {
    let (c, _) = c.as_chunks::<LANES>();
    add_square(s, add_square(s, q, &c[0]), &c[1])
}

/// One block of [`scale_pair_summing_pair`] (at most `SUM_BLOCK` elements, a multiple of
/// `LANES`): both rows scaled and both next rows' squares added, 32 elements of each at a time.
/// `w` is both `Some` or both `None`. Returns the block's float32 sums of the next rows.
#[inline(always)]
fn scale_block_summing<X: Lane, W: Lane>(
    s: V4,
    x: [&[X]; 2],
    w: [Option<&[W]>; 2],
    r: [f32; 2],
    y: [&mut [X]; 2],
    next: [&[X]; 2],
) -> (__m512, __m512) {
    let f = s.avx512f;
    let rv = [f._mm512_set1_ps(r[0]), f._mm512_set1_ps(r[1])];
    let (mut qa, mut qb) = (f._mm512_setzero_ps(), f._mm512_setzero_ps());
    let [y0, y1] = y;
    let (x0, x0r) = x[0].as_chunks::<{ 2 * LANES }>();
    let (x1, x1r) = x[1].as_chunks::<{ 2 * LANES }>();
    let (y0, y0r) = y0.as_chunks_mut::<{ 2 * LANES }>();
    let (y1, y1r) = y1.as_chunks_mut::<{ 2 * LANES }>();
    let (na, nar) = next[0].as_chunks::<{ 2 * LANES }>();
    let (nb, nbr) = next[1].as_chunks::<{ 2 * LANES }>();
    let rows = y0.iter_mut().zip(y1).zip(x0.iter().zip(x1));
    let sums = na.iter().zip(nb);
    match w {
        [Some(w0), Some(w1)] => {
            let (w0, _) = w0.as_chunks::<{ 2 * LANES }>();
            let (w1, _) = w1.as_chunks::<{ 2 * LANES }>();
            for ((((y0, y1), (x0, x1)), (w0, w1)), (a, b)) in rows.zip(w0.iter().zip(w1)).zip(sums)
            {
                *y0 = X::scale32(s, x0, Some(w0), rv[0]);
                *y1 = X::scale32(s, x1, Some(w1), rv[1]);
                qa = add_squares32(s, qa, a);
                qb = add_squares32(s, qb, b);
            }
        }
        _ => {
            for (((y0, y1), (x0, x1)), (a, b)) in rows.zip(sums) {
                *y0 = X::scale32::<W>(s, x0, None, rv[0]);
                *y1 = X::scale32::<W>(s, x1, None, rv[1]);
                qa = add_squares32(s, qa, a);
                qb = add_squares32(s, qb, b);
            }
        }
    }
    // A block of an odd number of 16-lane chunks (the row's last) ends with one of them.
    if !x0r.is_empty() {
        let w = w.map(|w| w.map(|w| &w[w.len() - LANES..]));
        scale_row(s, x0r, w[0], r[0], y0r);
        scale_row(s, x1r, w[1], r[1], y1r);
        qa = add_square(s, qa, &nar.as_chunks::<LANES>().0[0]);
        qb = add_square(s, qb, &nbr.as_chunks::<LANES>().0[0]);
    }
    (qa, qb)
}

/// Elements of x (and as many of dy) per group of rows in the backward: a group's x and dy
/// (256 KiB in float32) stay in L2 between the first pass (the sums) and the second.
const BACKWARD_GROUP_ELEMENTS: usize = 32 * 1024;
/// Most rows per group (the group's coefficients live on the stack).
const BACKWARD_GROUP_ROWS: usize = 64;

/// The backward pass with a weight and its gradient over consecutive rows of `n` (as many as
/// `dx` holds), their rstd given or taken from the first pass's sums of squares,
/// as `math::backward_rows_paired` computes it (the same bits: dx, and `acc` gaining the
/// rows' `dy * xhat` a pair at a time, in row order), when x is float32 or bfloat16, the
/// weight float32 or bfloat16 and the accumulator float32. Returns false, having written
/// nothing, for any other types. Rows go in groups: the first pass's sums of two rows at a time,
/// then the second pass in column tiles over the group's rows, so a tile of the weight and of
/// the float64 gradient row stays in L1 while every row of the group adds to it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_rows<T: Element, W: Element, A: Accum>(
    s: V4,
    x: &[T],
    dy: &[T],
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
    match (T::typed(x), T::typed(dy), T::typed_mut(dx)) {
        (Typed::F32(x), Typed::F32(dy), TypedMut::F32(dx)) => {
            backward_with_weight(s, x, dy, n, w, rstd, dx, acc)
        }
        (Typed::Bf16(x), Typed::Bf16(dy), TypedMut::Bf16(dx)) => {
            backward_with_weight(s, x, dy, n, w, rstd, dx, acc)
        }
        _ => false,
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_with_weight<X: Lane, W: Element, A: Accum>(
    s: V4,
    x: &[X],
    dy: &[X],
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [X],
    acc: &mut [f64],
) -> bool {
    match W::typed(w) {
        Typed::F32(w) => backward_groups(s, x, dy, n, w, rstd, dx, acc),
        Typed::Bf16(w) => backward_groups(s, x, dy, n, w, rstd, dx, acc),
        Typed::Other => return false,
    }
    true
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_groups<X: Lane, W: Lane, A: Accum>(
    s: V4,
    x: &[X],
    dy: &[X],
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
        let mut factors = |i: usize, sums: (f64, f64)| {
            let (ri, ci) = row_factors(rstd, i, sums, n);
            // A is float32 here, so the conversions are exact.
            (r[i - g0], c[i - g0]) = (ri.to_f64() as f32, ci.to_f64() as f32);
        };
        let mut i = g0;
        while i < g1 {
            if i + 1 < g1 {
                let (a, b) = row_sums_pair(
                    s,
                    (&x[row(i)], &dy[row(i)]),
                    (&x[row(i + 1)], &dy[row(i + 1)]),
                    w,
                );
                factors(i, a);
                factors(i + 1, b);
                i += 2;
            } else {
                let (a, _) = row_sums_pair(s, (&x[row(i)], &dy[row(i)]), (&[], &[]), w);
                factors(i, a);
                i += 1;
            }
        }
        let span = g0 * n..g1 * n;
        backward_tiles(
            s,
            (&x[span.clone()], &dy[span.clone()]),
            n,
            w,
            (&r[..g1 - g0], &c[..g1 - g0]),
            &mut dx[span],
            acc,
        );
    }
}

/// `(sum(g * x), sum(x^2))` with `g = dy * w` of two rows (`x`, `dy`) sharing the weight, each
/// in `math::row_sums`'s order. An empty second row gives zeros for it.
#[inline(always)]
fn row_sums_pair<X: Lane, W: Lane>(
    s: V4,
    a: (&[X], &[X]),
    b: (&[X], &[X]),
    w: &[W],
) -> ((f64, f64), (f64, f64)) {
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
    sa.add(s, pulp::cast(tail_dot::<X, W, f32>(xat, dat, wt)));
    ta.add(s, pulp::cast(tail_squares::<X, f32>(xat)));
    if !pair {
        return ((sa.total(), ta.total()), (0.0, 0.0));
    }
    sb.add(s, pulp::cast(tail_dot::<X, W, f32>(xbt, dbt, wt)));
    tb.add(s, pulp::cast(tail_squares::<X, f32>(xbt)));
    ((sa.total(), ta.total()), (sb.total(), tb.total()))
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
/// `dx = r * (dy * w - xhat * c)` and `acc += dy * xhat`, rows paired from the group's first
/// (the pair's float32 sum widened once, as `math::backward_rows_paired` adds it; a last odd
/// row alone).
#[inline(always)]
fn backward_tiles<X: Lane, W: Lane>(
    s: V4,
    (x, dy): (&[X], &[X]),
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
        let mut i = 0;
        while i + 1 < rows {
            let (r0, r1, c0, c1) = (r_of(i), r_of(i + 1), c[i], c[i + 1]);
            let (rv0, cv0) = (f._mm512_set1_ps(r0), f._mm512_set1_ps(c0));
            let (rv1, cv1) = (f._mm512_set1_ps(r1), f._mm512_set1_ps(c1));
            let (x0b, x0t) = x[tile(i)].as_chunks::<LANES>();
            let (x1b, x1t) = x[tile(i + 1)].as_chunks::<LANES>();
            let (d0b, d0t) = dy[tile(i)].as_chunks::<LANES>();
            let (d1b, d1t) = dy[tile(i + 1)].as_chunks::<LANES>();
            let (o0, o1) = dx[i * n..(i + 2) * n].split_at_mut(n);
            let (o0b, o0t) = o0[cols.clone()].as_chunks_mut::<LANES>();
            let (o1b, o1t) = o1[cols.clone()].as_chunks_mut::<LANES>();
            for ((((ws, accs), (xs0, xs1)), (ds0, ds1)), (os0, os1)) in wb
                .iter()
                .zip(ab.iter_mut())
                .zip(x0b.iter().zip(x1b))
                .zip(d0b.iter().zip(d1b))
                .zip(o0b.iter_mut().zip(o1b.iter_mut()))
            {
                let wv = W::load(s, ws);
                let (h0, d0) = (f._mm512_mul_ps(X::load(s, xs0), rv0), X::load(s, ds0));
                let (h1, d1) = (f._mm512_mul_ps(X::load(s, xs1), rv1), X::load(s, ds1));
                *os0 = dx_step(s, h0, d0, wv, rv0, cv0);
                *os1 = dx_step(s, h1, d1, wv, rv1, cv1);
                let p = f._mm512_add_ps(f._mm512_mul_ps(d0, h0), f._mm512_mul_ps(d1, h1));
                *accs = widen_add(s, *accs, p);
            }
            for (l, a) in at.iter_mut().enumerate() {
                let wl = wt[l].to_f32();
                let (h0, d0) = (x0t[l].to_f32() * r0, d0t[l].to_f32());
                let (h1, d1) = (x1t[l].to_f32() * r1, d1t[l].to_f32());
                o0t[l] = X::from_f32(r0 * (d0 * wl - h0 * c0));
                o1t[l] = X::from_f32(r1 * (d1 * wl - h1 * c1));
                *a += (d0 * h0 + d1 * h1) as f64;
            }
            i += 2;
        }
        if i < rows {
            let (r, c) = (r_of(i), c[i]);
            let (rv, cv) = (f._mm512_set1_ps(r), f._mm512_set1_ps(c));
            let (xb, xt) = x[tile(i)].as_chunks::<LANES>();
            let (db, dt) = dy[tile(i)].as_chunks::<LANES>();
            let (ob, ot) = dx[tile(i)].as_chunks_mut::<LANES>();
            for ((((os, xs), ds), ws), accs) in
                ob.iter_mut().zip(xb).zip(db).zip(wb).zip(ab.iter_mut())
            {
                let (h, d) = (f._mm512_mul_ps(X::load(s, xs), rv), X::load(s, ds));
                *os = dx_step(s, h, d, W::load(s, ws), rv, cv);
                *accs = widen_add(s, *accs, f._mm512_mul_ps(d, h));
            }
            for ((((o, &xi), &di), &wi), a) in
                ot.iter_mut().zip(xt).zip(dt).zip(wt).zip(at.iter_mut())
            {
                let h = xi.to_f32() * r;
                let d = di.to_f32();
                *o = X::from_f32(r * (d * wi.to_f32() - h * c));
                *a += (d * h) as f64;
            }
        }
    }
}

/// `r * (dy * w - xhat * c)`, stored as `X`.
#[inline(always)]
fn dx_step<X: Lane>(s: V4, h: __m512, d: __m512, w: __m512, r: __m512, c: __m512) -> [X; LANES] {
    let f = s.avx512f;
    let g = f._mm512_mul_ps(d, w);
    X::store(
        s,
        f._mm512_mul_ps(r, f._mm512_sub_ps(g, f._mm512_mul_ps(h, c))),
    )
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
