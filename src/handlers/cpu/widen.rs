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
//! `layer_long_rows`, `layer::sums_by_pieces` taking its sums as `layer::sums` does). The
//! scalar context keeps the integer conversions (the reference the others are tested against),
//! as do split rows. Both backwards widen rows longer than [`WIDE_BLOCK`] a piece at a time
//! too (`backward_long_rows`, `layer_backward_long_rows`), and the fused residual add widens
//! (`add_widened`). The RMS norm's explicit AVX-512 loops convert float16 themselves
//! (`cpu::avx512`, the fused residual's backward with dh and its add too) and come first where
//! they apply; on AVX-512 the slice conversions here are inlined `vcvtph2ps`/`vcvtps2ph`
//! (`Kernel::f16_to_f32`).
//!
//! Through XLA (jax 0.10.2, AVX2 without AVX-512), the float16 RMS forward at 8192x64 took
//! 1.56 ms before and 0.65 after (bfloat16: 0.44); `make bench` figures in docs/speed.md.

use half::f16;

use super::forward_chunk;
use super::simd::Kernel;
use crate::handlers::math::layer::Moments;
use crate::handlers::math::{
    add_row_sums, add_square_block, adding_second_pass, backward_pair_second_pass,
    backward_second_pass, forward_scale, layer, row_factors, rstd_of, tail_squares, Accum, Element,
    RowSum, Rstd, Typed, TypedMut, LANES, SUM_BLOCK,
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

/// LayerNorm's forward over float16 rows longer than [`WIDE_BLOCK`], row by row, each row
/// widened a piece of [`WIDE_BLOCK`] elements at a time three times: for the mean, the centred sums (`layer::stats_by_pieces`: [`layer::stats`]'s
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

/// The RMS norm's backward over float16 rows longer than [`WIDE_BLOCK`] (as many as `dx`
/// holds), each row widened a piece of [`WIDE_BLOCK`] elements at a time twice: for its
/// first-pass sums (each piece one of their blocks, `math::add_row_sums`, so `row_sums`'s bits),
/// then for dx and the weight gradient (`math`'s second passes, element by element, dx narrowed
/// back piece by piece). Rows as `math::backward_rows` takes them: in pairs when there is an
/// accumulator (the pair's terms summed before they join it), else one by one. With `dh`, row
/// by row as `math::backward_row_adding` (dh widened and added before dx's one rounding, each
/// row's term added to the accumulator alone). Out of line, as [`in_blocks`], with a
/// `kernel.run` per row or pair; six arrays of [`WIDE_BLOCK`] on the stack (48 KB in float32).
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn backward_long_rows<'w, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    (x, dy, dh): (&[f16], &[f16], Option<&[f16]>),
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    rstd: Rstd<'_, A>,
    dx: &mut [f16],
    mut acc: Option<&mut [A::Wide]>,
) {
    let [mut x0, mut x1, mut d0, mut d1, mut o0, mut o1] = [[A::ZERO; WIDE_BLOCK]; 6];
    let rows = dx.len() / n;
    let mut i = 0;
    while i < rows {
        let pair = dh.is_none() && acc.is_some() && i + 1 < rows;
        kernel.run(
            #[inline(always)]
            || {
                let row = |i: usize| (&x[i * n..][..n], &dy[i * n..][..n], w_of(i));
                let (r0, c0) = long_row_factors(kernel, row(i), rstd.from_row(i), &mut x0, &mut d0);
                let (r1, c1) = if pair {
                    long_row_factors(kernel, row(i + 1), rstd.from_row(i + 1), &mut x1, &mut d1)
                } else {
                    (A::ZERO, A::ZERO)
                };
                for at in (0..n).step_by(WIDE_BLOCK) {
                    let len = WIDE_BLOCK.min(n - at);
                    let piece = |i: usize| i * n + at..i * n + at + len;
                    let wp = |i: usize| w_of(i).map(|w| &w[at..][..len]);
                    load_slice(kernel, &x[piece(i)], &mut x0[..len]);
                    load_slice(kernel, &dy[piece(i)], &mut d0[..len]);
                    let (xp, dp, op) = (&x0[..len], &d0[..len], &mut o0[..len]);
                    match (acc.as_deref_mut().map(|a| &mut a[at..][..len]), dh) {
                        (Some(a), None) if pair => {
                            load_slice(kernel, &x[piece(i + 1)], &mut x1[..len]);
                            load_slice(kernel, &dy[piece(i + 1)], &mut d1[..len]);
                            backward_pair_second_pass::<A, W, A>(
                                (xp, &x1[..len]),
                                (wp(i), wp(i + 1)),
                                (r0, r1),
                                (c0, c1),
                                (dp, &d1[..len]),
                                (op, &mut o1[..len]),
                                a,
                            );
                            store_slice(kernel, &o1[..len], &mut dx[piece(i + 1)]);
                        }
                        (a, Some(dh)) => {
                            load_slice(kernel, &dh[piece(i)], &mut x1[..len]);
                            let hp = &x1[..len];
                            adding_second_pass::<A, W, A>(xp, wp(i), r0, c0, dp, hp, op, a);
                        }
                        (a, None) => backward_second_pass::<A, W, A>(xp, wp(i), r0, c0, dp, op, a),
                    }
                    store_slice(kernel, &o0[..len], &mut dx[piece(i)]);
                }
            },
        );
        i += if pair { 2 } else { 1 };
    }
}

/// LayerNorm's backward over float16 rows longer than [`WIDE_BLOCK`] (as many as `dx` holds),
/// row by row as `layer::backward_rows`, each row widened a piece of [`WIDE_BLOCK`] at a time:
/// for its statistics where they come from x (`layer::stats_by_pieces`), its first-pass sums
/// (`layer::gradient_sums_by_pieces`), then dx (dh added before its one rounding) and the
/// weight's and bias's gradient sums (`layer::backward_apply_parts`), dx narrowed back piece
/// by piece: `layer::backward_row`'s bits. Out of line, with a `kernel.run` per row; four arrays
/// of [`WIDE_BLOCK`] on the stack.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn layer_backward_long_rows<'w, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    (x, dy, dh): (&[f16], &[f16], Option<&[f16]>),
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    moments: Moments<'_, A>,
    dx: &mut [f16],
    mut acc: Option<&mut [A::Wide]>,
) {
    let [mut xw, mut dw, mut hw, mut ow] = [[A::ZERO; WIDE_BLOCK]; 4];
    for (i, dx) in dx.chunks_exact_mut(n).enumerate() {
        kernel.run(
            #[inline(always)]
            || {
                let (xr, dr, w) = (&x[i * n..][..n], &dy[i * n..][..n], w_of(i));
                let g = match moments.from_row(i) {
                    Moments::Split(rows) => rows.gradient(),
                    Moments::Given { mean, rstd } => {
                        layer_gradient(kernel, (xr, dr, w), mean[0], rstd[0], (&mut xw, &mut dw))
                    }
                    Moments::FromX(eps) => {
                        let s = layer::stats_by_pieces::<A>(
                            n,
                            eps,
                            &mut xw,
                            #[inline(always)]
                            |range, piece| load_slice(kernel, &xr[range], piece),
                        );
                        layer_gradient(kernel, (xr, dr, w), s.mean, s.rstd, (&mut xw, &mut dw))
                    }
                };
                for at in (0..n).step_by(WIDE_BLOCK) {
                    let range = at..(at + WIDE_BLOCK).min(n);
                    let len = range.len();
                    load_slice(kernel, &xr[range.clone()], &mut xw[..len]);
                    load_slice(kernel, &dr[range.clone()], &mut dw[..len]);
                    let hp = if let Some(dh) = dh {
                        load_slice(kernel, &dh[i * n..][range.clone()], &mut hw[..len]);
                        Some(&hw[..len])
                    } else {
                        None
                    };
                    let sums = match acc.as_deref_mut() {
                        Some(a) => {
                            let (aw, ab) = a.split_at_mut(n);
                            let ab = (ab.len() >= n).then(|| &mut ab[range.clone()]);
                            (Some(&mut aw[range.clone()]), ab)
                        }
                        None => (None, None),
                    };
                    let wp = w.map(|w| &w[range.clone()]);
                    let (xp, dp, op) = (&xw[..len], &dw[..len], &mut ow[..len]);
                    layer::backward_apply_parts::<A, W, A>(xp, wp, g, dp, hp, op, sums);
                    store_slice(kernel, &ow[..len], &mut dx[range]);
                }
            },
        );
    }
}

/// A float16 LayerNorm row's backward coefficients given its mean and rstd
/// (`layer::gradient_of`), its first-pass sums taken a piece at a time widened into `xw` and
/// `dw` (`layer::gradient_sums_by_pieces`).
#[inline(always)]
fn layer_gradient<W: Element, A: Accum + CpuElement>(
    kernel: Kernel,
    (x, dy, w): (&[f16], &[f16], Option<&[W]>),
    m: A,
    r: A,
    scratch: (&mut [A], &mut [A]),
) -> layer::Gradient<A> {
    let sums = layer::gradient_sums_by_pieces::<W, A>(
        x.len(),
        w,
        m,
        scratch,
        #[inline(always)]
        |range, xp, dp| {
            load_slice(kernel, &x[range.clone()], xp);
            load_slice(kernel, &dy[range], dp);
        },
    );
    layer::gradient_of(sums, x.len(), m, r)
}

/// A float16 row's `(rstd, c)` (`math::row_factors`, row 0 of `rstd`) from its first-pass sums,
/// the row widened into `xw` and `dw` a piece of [`WIDE_BLOCK`] at a time, each piece one block
/// of the sums (`math::add_row_sums`): `math::row_sums`'s bits.
#[inline(always)]
fn long_row_factors<W: Element, A: Accum + CpuElement>(
    kernel: Kernel,
    (x, dy, w): (&[f16], &[f16], Option<&[W]>),
    rstd: Rstd<'_, A>,
    xw: &mut [A],
    dw: &mut [A],
) -> (A, A) {
    let n = x.len();
    let mut sums = (RowSum::new(), RowSum::new());
    let pieces = n.div_ceil(WIDE_BLOCK);
    for p in 0..pieces {
        let at = p * WIDE_BLOCK..((p + 1) * WIDE_BLOCK).min(n);
        let len = at.len();
        load_slice(kernel, &x[at.clone()], &mut xw[..len]);
        load_slice(kernel, &dy[at.clone()], &mut dw[..len]);
        let wp = w.map(|w| &w[at]);
        add_row_sums::<A, W, A>(&mut sums, &xw[..len], wp, &dw[..len], p + 1 == pieces);
    }
    row_factors(rstd, 0, (sums.0.total(), sums.1.total()), n)
}

/// `h = x + residual` over float16 rows, a piece of [`WIDE_BLOCK`] at a time: both widened to
/// `A`, added, h rounded once (`math::add_into`'s bits: the conversions are exact, or round to
/// nearest even, as its element-by-element ones). Out of line, with its own `kernel.run`, as
/// [`in_blocks`]: two arrays on the stack, outside the forward's frame.
#[inline(never)]
fn add_widened<A: Accum + CpuElement>(kernel: Kernel, x: &[f16], residual: &[f16], h: &mut [f16]) {
    let mut xw = [A::ZERO; WIDE_BLOCK];
    let mut rw = [A::ZERO; WIDE_BLOCK];
    kernel.run(
        #[inline(always)]
        || {
            let pieces = x.chunks(WIDE_BLOCK).zip(residual.chunks(WIDE_BLOCK));
            for ((xp, rp), hp) in pieces.zip(h.chunks_mut(WIDE_BLOCK)) {
                let len = xp.len();
                load_slice(kernel, xp, &mut xw[..len]);
                load_slice(kernel, rp, &mut rw[..len]);
                for (a, &b) in xw[..len].iter_mut().zip(&rw[..len]) {
                    *a = *a + b;
                }
                store_slice(kernel, &xw[..len], hp);
            }
        },
    )
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

    /// LayerNorm's backward over rows longer than [`WIDE_BLOCK`] (as `layer::backward_rows`),
    /// widened; false, having written nothing, where this type, `kernel` or `n` do not widen.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn layer_backward_long_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        _kernel: Kernel,
        _inputs: (&[Self], &[Self], Option<&[Self]>),
        _n: usize,
        _w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        _moments: Moments<'_, A>,
        _dx: &mut [Self],
        _acc: Option<&mut [A::Wide]>,
    ) -> bool {
        false
    }

    /// `h = x + residual` (as `math::add_into`), widened; false, having written nothing, where
    /// this type or `kernel` do not widen.
    #[inline(always)]
    fn add_widened<A: Accum + CpuElement>(
        _kernel: Kernel,
        _x: &[Self],
        _residual: &[Self],
        _h: &mut [Self],
    ) -> bool {
        false
    }

    /// The RMS norm's backward over rows longer than [`WIDE_BLOCK`] (as `math::backward_rows`,
    /// or `math::backward_row_adding` row by row with dh), widened; false, having written
    /// nothing, where this type, `kernel`, `n` or the call do not widen.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn backward_long_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        _kernel: Kernel,
        _inputs: (&[Self], &[Self], Option<&[Self]>),
        _n: usize,
        _w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        _rstd: Rstd<'_, A>,
        _dx: &mut [Self],
        _acc: Option<&mut [A::Wide]>,
    ) -> bool {
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
        if kernel.has_f16c() && n > WIDE_BLOCK {
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

    #[inline(always)]
    fn layer_backward_long_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        kernel: Kernel,
        inputs: (&[f16], &[f16], Option<&[f16]>),
        n: usize,
        w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        moments: Moments<'_, A>,
        dx: &mut [f16],
        acc: Option<&mut [A::Wide]>,
    ) -> bool {
        if !kernel.has_f16c() || n <= WIDE_BLOCK {
            return false;
        }
        layer_backward_long_rows::<W, A>(kernel, inputs, n, w_of, moments, dx, acc);
        true
    }

    #[inline(always)]
    fn add_widened<A: Accum + CpuElement>(
        kernel: Kernel,
        x: &[f16],
        residual: &[f16],
        h: &mut [f16],
    ) -> bool {
        // AVX-512: one loop converting 16 elements each way, no blocks (`avx512::add_f16`).
        #[cfg(target_arch = "x86_64")]
        if let Kernel::Avx512(v4) = kernel {
            kernel.run(
                #[inline(always)]
                || super::avx512::add_f16(v4, x, residual, h),
            );
            return true;
        }
        if !kernel.has_f16c() {
            return false;
        }
        add_widened::<A>(kernel, x, residual, h);
        true
    }

    #[inline(always)]
    fn backward_long_widened<'w, W: Element + 'w, A: Accum + CpuElement>(
        kernel: Kernel,
        inputs: (&[f16], &[f16], Option<&[f16]>),
        n: usize,
        w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
        rstd: Rstd<'_, A>,
        dx: &mut [f16],
        acc: Option<&mut [A::Wide]>,
    ) -> bool {
        // Without dh, AVX-512's explicit loops convert float16 themselves (`cpu::avx512`).
        let avx512_loops = inputs.2.is_none() && kernel.has_avx512();
        if !kernel.has_f16c() || n <= WIDE_BLOCK || avx512_loops {
            return false;
        }
        backward_long_rows::<W, A>(kernel, inputs, n, w_of, rstd, dx, acc);
        true
    }
}
