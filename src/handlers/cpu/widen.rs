//! float16 rows through the kernels of a float32 x. The portable loops convert float16 in
//! integer operations (branch-free, so they vectorize on any CPU, but about ten per element
//! each way); F16C converts 8 elements in one instruction. Rather than a second set of loops,
//! rows of up to [`WIDE_BLOCK`] elements are widened to float32 a block of rows at a time on
//! the stack (`half`'s slice conversion: `vcvtph2ps` where the CPU has F16C, see
//! `Kernel::f16_to_f32`), run through the float32 kernels, and y or dx narrowed back
//! (`vcvtps2ph`, to nearest even). A float16 x's kernels take every element into float32
//! exactly and round each result once from float32, so the float32 kernels on the widened rows
//! take the same operations and give the same bits (tested on every instruction set,
//! `cpu::tests`, with planted faults); `half`'s conversions are `math`'s integer ones bit for
//! bit (every half, and floats at every rounding boundary, `cpu::tests`).
//!
//! Both forwards widen longer rows too, row by row, a piece at a time (`forward_long_rows`,
//! `layer_long_rows`; LayerNorm's from 2064 elements, where its sums run block by block). The
//! scalar context keeps the integer conversions (the reference the others are tested against),
//! as do the backward of rows longer than [`WIDE_BLOCK`], LayerNorm's rows of 2049-2063 and
//! split rows. The RMS norm's explicit AVX-512 loops convert float16 themselves
//! (`cpu::avx512`) and come first where they apply.
//!
//! Through XLA (jax 0.10.2, AVX2 without AVX-512), the float16 RMS forward at 8192x64 took
//! 1.56 ms before and 0.65 after (bfloat16: 0.44); `make bench` figures in docs/speed.md.

use half::f16;

use super::forward_chunk;
use super::simd::Kernel;
use crate::handlers::math::{
    add_square_block, forward_scale, layer, rstd_of, tail_squares, Accum, Element, RowSum, Typed,
    TypedMut, LANES, SUM_BLOCK,
};

/// Elements widened at a time: a block of whole rows of up to this many elements, in stack
/// arrays of the accumulation dtype (8 KB each in float32); longer rows a piece of this many at
/// a time, each piece one block of their sums.
pub const WIDE_BLOCK: usize = 2048;

const _: () = assert!(WIDE_BLOCK == SUM_BLOCK);

/// Rows of `n` a forward block holds: at least one (a caller widens rows of up to
/// [`WIDE_BLOCK`]).
fn rows_per_block(n: usize) -> usize {
    (WIDE_BLOCK / n.max(1)).max(1)
}

/// `dst = src` in `A`, exactly: F16C for float16 into float32 where `kernel` has it, else
/// element by element as the kernels load them.
#[inline(always)]
pub fn load_slice<T: Element, A: Accum + CpuElement>(kernel: Kernel, src: &[T], dst: &mut [A]) {
    if let (Typed::F16(s), TypedMut::F32(d)) = (T::typed(src), A::typed_mut(&mut *dst)) {
        if kernel.f16_to_f32(s, d) {
            return;
        }
    }
    for (o, &v) in dst.iter_mut().zip(src) {
        *o = A::load(v);
    }
}

/// `dst = src` rounded to `T` (to nearest even): F16C for float32 into float16 where `kernel`
/// has it, else element by element as the kernels store them.
#[inline(always)]
pub fn store_slice<A: Accum + CpuElement, T: Element>(kernel: Kernel, src: &[A], dst: &mut [T]) {
    if let (Typed::F32(s), TypedMut::F16(d)) = (A::typed(src), T::typed_mut(&mut *dst)) {
        if kernel.f32_to_f16(s, d) {
            return;
        }
    }
    for (o, &v) in dst.iter_mut().zip(src) {
        *o = v.store();
    }
}

/// `f(offset, x, y)` over `x` and `y` a piece of `len` elements at a time: the piece of x
/// loaded into `xw` in `A`, `f` writing y's in `A` into `yw`, y stored back. Runs inside
/// `kernel.run`.
#[inline(always)]
fn by_pieces<T: Element, A: Accum + CpuElement>(
    kernel: Kernel,
    (x, y): (&[T], &mut [T]),
    len: usize,
    (xw, yw): (&mut [A], &mut [A]),
    mut f: impl FnMut(usize, &[A], &mut [A]),
) {
    for (p, (xp, yp)) in x.chunks(len).zip(y.chunks_mut(len)).enumerate() {
        let len_p = xp.len();
        load_slice(kernel, xp, &mut xw[..len_p]);
        f(p * len, &xw[..len_p], &mut yw[..len_p]);
        store_slice(kernel, &yw[..len_p], yp);
    }
}

/// Runs `rows` over `x` and `y` (whole rows of `n`, at most [`WIDE_BLOCK`]) a block of rows at
/// a time: x loaded into `A` on the stack, `rows(x, y, first row)` with y in `A`, y stored back.
/// Out of line, with its own `kernel.run`: the kernels inside run in a frame of their own
/// (inlined beside x's own kernels they doubled an unoptimized build's frame, past a test
/// thread's stack, in the backward), in `kernel`'s context.
#[inline(never)]
fn in_blocks<T: Element, A: Accum + CpuElement>(
    kernel: Kernel,
    x: &[T],
    y: &mut [T],
    n: usize,
    mut rows: impl FnMut(&[A], &mut [A], usize),
) {
    let per_block = rows_per_block(n);
    let mut xw = [A::ZERO; WIDE_BLOCK];
    let mut yw = [A::ZERO; WIDE_BLOCK];
    kernel.run(
        #[inline(always)]
        || {
            let pieces = (x, y);
            let scratch = (&mut xw[..], &mut yw[..]);
            by_pieces(
                kernel,
                pieces,
                per_block * n,
                scratch,
                #[inline(always)]
                |at, xb, yb| rows(xb, yb, at / n),
            )
        },
    )
}

/// The RMS norm's forward over float16 rows longer than [`WIDE_BLOCK`], row by row, each row
/// widened a piece of [`WIDE_BLOCK`] elements at a time twice: once for its sum of squares
/// (each piece is one of the sum's blocks, `math::add_square_block`, the row's tail last, so
/// the sum is `math::sum_squares`'s), once to scale it (`math::forward_scale`, y narrowed back
/// piece by piece). Out of line, as [`in_blocks`], with a `kernel.run` per row.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn forward_long_rows<'w, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    x: &[f16],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    eps: A,
    y: &mut [f16],
    rstd: &mut [A],
) {
    let mut xw = [A::ZERO; WIDE_BLOCK];
    let mut yw = [A::ZERO; WIDE_BLOCK];
    for (i, ((xr, yr), r)) in x
        .chunks_exact(n)
        .zip(y.chunks_exact_mut(n))
        .zip(rstd.iter_mut())
        .enumerate()
    {
        kernel.run(
            #[inline(always)]
            || {
                let mut sum = RowSum::new();
                let pieces = xr.chunks(WIDE_BLOCK);
                let last = pieces.len() - 1;
                for (p, piece) in pieces.enumerate() {
                    let xp = &mut xw[..piece.len()];
                    load_slice(kernel, piece, xp);
                    let (chunks, tail) = xp.as_chunks::<LANES>();
                    add_square_block::<A, A>(&mut sum, chunks);
                    if p == last {
                        sum.add(&tail_squares::<A, A>(tail));
                    }
                }
                *r = rstd_of(sum.total(), n, eps);
                let (w, r) = (w_of(i), *r);
                let scratch = (&mut xw[..], &mut yw[..]);
                by_pieces(
                    kernel,
                    (xr, yr),
                    WIDE_BLOCK,
                    scratch,
                    #[inline(always)]
                    |at, xp, yp| {
                        let wp = w.map(|w| &w[at..][..xp.len()]);
                        forward_scale::<A, W, A>(xp, wp, r, yp)
                    },
                );
            },
        );
    }
}

/// LayerNorm's forward over float16 rows whose sums run block by block (`layer::blocked`: over
/// 2063 elements), row by row, each row widened a piece of [`WIDE_BLOCK`] elements at a time
/// three times: for the mean, the centred sums (`layer::stats_by_pieces`: [`layer::stats`]'s
/// bits) and y (`layer::forward_apply`, narrowed back piece by piece), as [`forward_long_rows`].
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn layer_long_rows<'w, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    x: &[f16],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    b_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    eps: A,
    y: &mut [f16],
    mean: &mut [A],
    rstd: &mut [A],
) {
    let mut xw = [A::ZERO; WIDE_BLOCK];
    let mut yw = [A::ZERO; WIDE_BLOCK];
    let rows = x.chunks_exact(n).zip(y.chunks_exact_mut(n));
    for (i, ((xr, yr), (m, r))) in rows.zip(mean.iter_mut().zip(rstd.iter_mut())).enumerate() {
        kernel.run(
            #[inline(always)]
            || {
                let s = layer::stats_by_pieces::<A>(
                    n,
                    eps,
                    &mut xw,
                    #[inline(always)]
                    |range, piece| load_slice(kernel, &xr[range], piece),
                );
                (*m, *r) = (s.mean, s.rstd);
                let (w, b) = (w_of(i), b_of(i));
                let scratch = (&mut xw[..], &mut yw[..]);
                by_pieces(
                    kernel,
                    (xr, yr),
                    WIDE_BLOCK,
                    scratch,
                    #[inline(always)]
                    |at, xp, yp| {
                        let wp = w.map(|w| &w[at..][..xp.len()]);
                        let bp = b.map(|b| &b[at..][..xp.len()]);
                        layer::forward_apply::<A, W, A>(xp, wp, bp, s, yp)
                    },
                );
            },
        );
    }
}

/// An element type as the CPU kernels take it: float16 may go through float32's kernels (the
/// module's doc); every other type runs its own, and the default methods decline.
pub trait CpuElement: Element {
    /// The RMS norm's forward over rows of `n` (as `forward_chunk`), widened; false, having
    /// written nothing, where this type, `kernel` or `n` do not widen.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn forward_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        _kernel: Kernel,
        _x: &[Self],
        _n: usize,
        _w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        _eps: A,
        _y: &mut [Self],
        _rstd: &mut [A],
    ) -> bool {
        false
    }

    /// LayerNorm's forward over whole rows (as `layer::forward_rows` without a split),
    /// widened; false, having written nothing, where this type, `kernel` or `n` do not widen.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn layer_forward_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        _kernel: Kernel,
        _x: &[Self],
        _n: usize,
        _w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        _b_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        _eps: A,
        _y: &mut [Self],
        _mean: &mut [A],
        _rstd: &mut [A],
    ) -> bool {
        false
    }

    /// Whether a backward over rows of `n` on `kernel` goes through the accumulation dtype's
    /// kernels (`BackwardInputs::widened`) when it has no dh to add.
    #[inline(always)]
    fn backward_widens(_kernel: Kernel, _n: usize) -> bool {
        false
    }
}

impl CpuElement for f32 {}
impl CpuElement for f64 {}
impl CpuElement for half::bf16 {}

/// Whether float16 rows of `n` widen on `kernel`.
fn f16_widens(kernel: Kernel, n: usize) -> bool {
    kernel.has_f16c() && (1..=WIDE_BLOCK).contains(&n)
}

impl CpuElement for f16 {
    #[inline(always)]
    fn forward_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        kernel: Kernel,
        x: &[f16],
        n: usize,
        w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        eps: A,
        y: &mut [f16],
        rstd: &mut [A],
    ) -> bool {
        if kernel.has_f16c() && n > WIDE_BLOCK {
            forward_long_rows::<W, A>(kernel, x, n, w_of, eps, y, rstd);
            return true;
        }
        if !f16_widens(kernel, n) {
            return false;
        }
        // `inline(always)`: a closure left out of line is compiled for the baseline instruction
        // set, outside `kernel`'s context.
        in_blocks::<f16, A>(
            kernel,
            x,
            y,
            n,
            #[inline(always)]
            |xw, yw, first| {
                let rstd = &mut rstd[first..first + xw.len() / n];
                let w_of = move |i: usize| w_of(first + i);
                forward_chunk::<A, W, A>(kernel, xw, n, w_of, eps, yw, rstd)
            },
        );
        true
    }

    #[inline(always)]
    fn layer_forward_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        kernel: Kernel,
        x: &[f16],
        n: usize,
        w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        b_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        eps: A,
        y: &mut [f16],
        mean: &mut [A],
        rstd: &mut [A],
    ) -> bool {
        if kernel.has_f16c() && layer::blocked(n) {
            layer_long_rows::<W, A>(kernel, x, n, w_of, b_of, eps, y, mean, rstd);
            return true;
        }
        if !f16_widens(kernel, n) {
            return false;
        }
        // `inline(always)`: a closure left out of line is compiled for the baseline instruction
        // set, outside `kernel`'s context.
        in_blocks::<f16, A>(
            kernel,
            x,
            y,
            n,
            #[inline(always)]
            |xw, yw, first| {
                let rows = first..first + xw.len() / n;
                let w_of = move |i: usize| w_of(first + i);
                let b_of = move |i: usize| b_of(first + i);
                let (mean, rstd) = (&mut mean[rows.clone()], &mut rstd[rows]);
                layer::forward_rows::<A, W, A>(xw, n, w_of, b_of, eps, None, yw, Some(mean), rstd)
            },
        );
        true
    }

    #[inline(always)]
    fn backward_widens(kernel: Kernel, n: usize) -> bool {
        f16_widens(kernel, n)
    }
}
