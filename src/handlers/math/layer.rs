//! LayerNorm's rows: the statistics of a row, one row of the forward and of the backward, and
//! the loops over many rows that the CPU runs (`cpu`, inside its SIMD context, like the RMS
//! norm's loops in the parent module).
//!
//! Forward: `y = (x - mean) * rstd * w + b`, `rstd = 1 / sqrt(var + eps)`.
//! Backward, with `xhat = (x - mean) * rstd` and `g = dy * w`:
//! `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dw = sum over rows of dy * xhat`,
//! `db = sum over rows of dy`.
//!
//! The variance is never `E[x^2] - E[x]^2`, which loses every digit in float32 when a row's
//! mean is large against its spread (x = 1e4 + N(0, 1)). A row is read three times (it is in
//! cache after the first): its sum gives the mean `m`, rounded once to `A` (the `mean` result);
//! then the deviations `x - m`, exact where x and m are within a factor of two of each other
//! (Sterbenz), give both the variance and `d = mean(x - m)`, the part of the true mean that `m`
//! could not hold, so `var = mean((x - m)^2) - d^2` (a shifted two-pass variance, whose
//! correction term is at most a rounding of m squared), and every use of the centred value is
//! `(x - m) - d`. The backward, given only `m` and `rstd`, takes `d` from x itself in its first
//! pass, with the forward's bits: so a float32 `mean` loses nothing at a mean of 1e6 times the
//! spread, where `x - m` alone would be off by up to half a float32 unit of 1e6 (3% of the
//! spread).
//!
//! Sums are blocked as the RMS norm's ([`RowSum`]: [`LANES`] accumulators in `A` per
//! [`SUM_BLOCK`] elements, added into compensated float64 lanes), so the error does not grow
//! with the row and the bits are the same on every instruction set.

use super::{
    summed_lanes, Accum, Element, RowSum, WideSum, BLOCK_CHUNKS, LANES, NARROW_BATCH, SUM_BLOCK,
};

/// A row's statistics: the mean rounded once to `A` (what the forward returns), the mean of
/// the deviations from it (`d` above), and rstd.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats<A> {
    pub mean: A,
    pub shift: A,
    pub rstd: A,
}

/// Where a backward's per-row statistics come from (the counterpart of the RMS norm's
/// [`super::Rstd`]).
#[derive(Clone, Copy, Debug)]
pub enum Moments<'a, A> {
    /// The forward's `mean` and `rstd`, one per row (the shift is taken from x).
    Given { mean: &'a [A], rstd: &'a [A] },
    /// Taken from the row itself with this eps: the forward's bits.
    FromX(A),
    /// A split row's (`contract::Split::Apply`): the coefficients from the whole row's sums.
    Split(SplitRows<'a, A>),
}

impl<'a, A: Accum> Moments<'a, A> {
    /// The same, for rows `first..`.
    #[inline(always)]
    pub fn from_row(self, first: usize) -> Moments<'a, A> {
        match self {
            Moments::Given { mean, rstd } => Moments::Given {
                mean: &mean[first..],
                rstd: &rstd[first..],
            },
            Moments::Split(rows) => Moments::Split(rows.from_row(first)),
            from_x => from_x,
        }
    }
}

/// The rows of a split call's apply pass (see `contract::Split`): each row's sums over the
/// whole row (every device's slice, all-reduced), `k` per row, and the statistics given with
/// them. Both norms: the RMS norm's rows are LayerNorm's with a mean and shift of zero (and
/// no `mean(g)` term), so one apply pass serves both.
#[derive(Clone, Copy, Debug)]
pub struct SplitRows<'a, A> {
    /// LayerNorm's mean, one per row; `None` for the RMS norm.
    pub mean: Option<&'a [A]>,
    /// A backward's given rstd; `None` in the forward, and in an RMS backward that takes rstd
    /// from its sums (its sum of squares after the dot product).
    pub rstd: Option<&'a [A]>,
    pub sums: &'a [A],
    pub k: usize,
    /// The whole row's length.
    pub full_len: usize,
    pub eps: A,
}

impl<'a, A: Accum> SplitRows<'a, A> {
    /// The same, for rows `first..`.
    #[inline(always)]
    pub fn from_row(self, first: usize) -> SplitRows<'a, A> {
        SplitRows {
            mean: self.mean.map(|m| &m[first..]),
            rstd: self.rstd.map(|r| &r[first..]),
            sums: &self.sums[first * self.k..],
            ..self
        }
    }

    /// Row 0's statistics in the forward: LayerNorm's mean as given and the shift and rstd
    /// from `sum(x - m)` and `sum((x - m)^2)`; the RMS norm's rstd from `sum(x^2)`.
    #[inline(always)]
    pub fn stats(&self) -> Stats<A> {
        let s = &self.sums[..self.k];
        match self.mean {
            Some(mean) => {
                let (shift, rstd) =
                    shift_and_rstd(s[0].to_f64(), s[1].to_f64(), self.full_len, self.eps);
                Stats {
                    mean: mean[0],
                    shift,
                    rstd,
                }
            }
            None => Stats {
                mean: A::ZERO,
                shift: A::ZERO,
                rstd: super::rstd_of(s[0].to_f64(), self.full_len, self.eps),
            },
        }
    }

    /// Row 0's backward coefficients (see [`gradient_of`]); the RMS norm's from `sum(g * x)`
    /// (`c2 = rstd * sum(g * x) / n`, no `mean(g)` term).
    #[inline(always)]
    pub fn gradient(&self) -> Gradient<A> {
        let s = &self.sums[..self.k];
        let r = match self.rstd {
            Some(r) => r[0],
            None => super::rstd_of(s[1].to_f64(), self.full_len, self.eps),
        };
        match self.mean {
            Some(mean) => gradient_of(
                [s[0].to_f64(), s[1].to_f64(), s[2].to_f64()],
                self.full_len,
                mean[0],
                r,
            ),
            None => Gradient {
                mean: A::ZERO,
                shift: A::ZERO,
                rstd: r,
                c1: A::ZERO,
                c2: super::coefficient(s[0].to_f64(), self.full_len, r),
            },
        }
    }
}

/// What the second pass of a row's backward needs: `xhat = ((x - mean) - shift) * rstd` and
/// `dx = rstd * (g - c1 - xhat * c2)` with `c1 = mean(g)`, `c2 = mean(g * xhat)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gradient<A> {
    pub mean: A,
    pub shift: A,
    pub rstd: A,
    pub c1: A,
    pub c2: A,
}

/// A row's backward coefficients from its first pass's sums `[sum(x - m), sum(g),
/// sum(g * (x - m))]` over `n` elements: `d = mean(x - m)`, `mean(g)`, and
/// `mean(g * xhat) = r * (sum(g * (x - m)) - d * sum(g)) / n`, in float64.
#[inline(always)]
pub fn gradient_of<A: Accum>([s1, sg, sgc]: [f64; 3], n: usize, m: A, r: A) -> Gradient<A> {
    let nf = n as f64;
    let d = A::from_f64(s1 / nf);
    Gradient {
        mean: m,
        shift: d,
        rstd: r,
        c1: A::from_f64(sg / nf),
        c2: A::from_f64((sgc - d.to_f64() * sg) / nf * r.to_f64()),
    }
}

/// `K` sums along a row of `n` elements: `chunk(c)` gives the terms of the `c`-th [`LANES`]
/// elements, lane by lane, and `tail(j)` those of element `j` of the tail after the last whole
/// chunk. Blocked as the RMS norm's sums: per [`SUM_BLOCK`] elements, [`LANES`] accumulators in
/// `A`, each block (and the tail, as a block of its own) added into compensated float64 lanes
/// ([`RowSum`]). A row of one block and a tail is totalled in float64 by a fixed tree instead,
/// its lanes paired level by level: at most 32 terms each far wider than `A`'s rounding, so
/// within a few float64 units, where the compensated chain's 16 dependent steps were most of
/// a short row's time.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // a tail element's index is also its lane
fn sums<A: Accum, const K: usize>(
    n: usize,
    chunk: impl Fn(usize) -> [[A; LANES]; K] + Copy,
    tail: impl Fn(usize) -> [A; K],
) -> [f64; K] {
    let chunks = n / LANES;
    let mut tails = [[A::ZERO; LANES]; K];
    for j in 0..n % LANES {
        let t = tail(j);
        for k in 0..K {
            tails[k][j] = t[k];
        }
    }
    if chunks <= BLOCK_CHUNKS {
        return tree_totals(n, &block::<A, K>(chunk, 0, chunks), &tails);
    }
    let mut out = [RowSum::new(); K];
    for first in (0..chunks).step_by(BLOCK_CHUNKS) {
        let acc = block::<A, K>(chunk, first, (first + BLOCK_CHUNKS).min(chunks));
        for k in 0..K {
            out[k].add(&acc[k]);
        }
    }
    for k in 0..K {
        out[k].add(&tails[k]);
    }
    RowSum::totals(out)
}

/// The `K` lane-wise sums of chunks `first..last` in `A`, one sum after the other: a loop per
/// sum that computes each chunk's terms and keeps its own (the others, pure arithmetic, are
/// dropped by the compiler), so each loop is a plain lane-wise sum that vectorizes across the
/// lanes. All `K` in one loop, LLVM paired the `K` sums of each lane instead (`perf`: a
/// scalar `vsubss`, `vmulss` and `vinsertps` per element of LayerNorm's centred sums in
/// bfloat16); the chunks are a block of at most [`SUM_BLOCK`] elements, read again from L1.
/// The same additions in the same order either way: the same bits. A function, not a closure
/// bound by `let` in [`sums`]: such a closure stayed out of line, compiled for the baseline
/// instruction set outside the SIMD context (`#[inline(always)]` cannot be put on one). `chunk`
/// is taken by value (the callers' closures are `Copy`), so a caller can hand over a closure
/// marked `#[inline(always)]`: a let-bound one, or a reference to one (`Fn for &F`'s shim),
/// stayed out of line in the float16 backward's pieces (`perf`: 1.7 ms against 1.0).
#[inline(always)]
fn block<A: Accum, const K: usize>(
    chunk: impl Fn(usize) -> [[A; LANES]; K],
    first: usize,
    last: usize,
) -> [[A; LANES]; K] {
    let mut acc = [[A::ZERO; LANES]; K];
    for (k, acc) in acc.iter_mut().enumerate() {
        for c in first..last {
            let t = chunk(c)[k];
            for (a, v) in acc.iter_mut().zip(t) {
                *a = *a + v;
            }
        }
    }
    acc
}

/// A chunk in `A`, in a loop of its own: the loads and conversions vectorize there, where
/// converting lane by lane inside a loop that also subtracts and multiplies stayed scalar for
/// half-precision x (`perf`: a `movzwl` and a `vmulss` per element).
#[inline(always)]
fn widen<T: Element, A: Accum>(chunk: &[T; LANES]) -> [A; LANES] {
    let mut v = [A::ZERO; LANES];
    for (o, &x) in v.iter_mut().zip(chunk) {
        *o = A::load(x);
    }
    v
}

/// The totals of a row of `n` that is one block at most: its block's lanes and its tail's, each
/// by [`tree_total`] (see `sums`).
#[inline(always)]
fn tree_totals<A: Accum, const K: usize>(
    n: usize,
    acc: &[[A; LANES]; K],
    tails: &[[A; LANES]; K],
) -> [f64; K] {
    let mut out = [0.0; K];
    for k in 0..K {
        // A row of whole chunks has no tail to total (most rows: 64, 128, ...).
        let lanes = summed_lanes(acc[k]);
        out[k] = if n.is_multiple_of(LANES) {
            tree_total(&lanes)
        } else {
            tree_total(&lanes) + tree_total(&tails[k])
        };
    }
    out
}

/// The float64 sum of [`LANES`] accumulators, pairwise in a fixed order (lane `l` with lane
/// `l + half`, halving), so the same bits on every instruction set.
#[inline(always)]
fn tree_total<A: Accum>(acc: &[A; LANES]) -> f64 {
    let mut v = [0.0; LANES];
    for (o, a) in v.iter_mut().zip(acc) {
        *o = a.to_f64();
    }
    let mut half = LANES / 2;
    while half > 0 {
        for l in 0..half {
            v[l] += v[l + half];
        }
        half /= 2;
    }
    v[0]
}

/// The shift and rstd of a row given its rounded mean `m`: from the sums of `x - m` and of its
/// squares.
#[inline(always)]
pub fn centred<T: Element, A: Accum>(x: &[T], m: A, eps: A) -> (A, A) {
    let [s1, s2] = centred_sums::<T, A>(x, m);
    shift_and_rstd(s1, s2, x.len(), eps)
}

/// `d = s1 / n` and `rstd = 1 / sqrt(s2 / n - d^2 + eps)` from a row's sums of `x - m` and of
/// their squares over `n` elements. A NaN variance stays NaN (a NaN or infinite element); a
/// negative one (rounding, for a row of equal elements) is 0.
#[inline(always)]
pub fn shift_and_rstd<A: Accum>(s1: f64, s2: f64, n: usize, eps: A) -> (A, A) {
    let n = n as f64;
    let d = s1 / n;
    let var = s2 / n - d * d;
    let var = if var < 0.0 { 0.0 } else { var };
    (
        A::from_f64(d),
        A::from_f64(1.0 / (var + eps.to_f64()).sqrt()),
    )
}

/// A row's `[sum(x - m), sum((x - m)^2)]`.
#[inline(always)]
pub fn centred_sums<T: Element, A: Accum>(x: &[T], m: A) -> [f64; 2] {
    let (xb, xt) = x.as_chunks::<LANES>();
    sums::<A, 2>(
        x.len(),
        #[inline(always)]
        |c| centred_terms(widen::<T, A>(&xb[c]), m),
        #[inline(always)]
        |j| {
            let d = A::load(xt[j]) - m;
            [d, d * d]
        },
    )
}

/// A chunk's terms of the centred sums: `x - m` and its square.
#[inline(always)]
fn centred_terms<A: Accum>(mut d: [A; LANES], m: A) -> [[A; LANES]; 2] {
    let mut sq = [A::ZERO; LANES];
    for (s, v) in sq.iter_mut().zip(d.iter_mut()) {
        *v = *v - m;
        *s = *v * *v;
    }
    [d, sq]
}

/// Whether a row of `n` is summed block by block ([`RowSum`]) rather than in a tree (see
/// `sums`): the rows [`stats_by_pieces`] takes.
pub fn blocked(n: usize) -> bool {
    n / LANES > BLOCK_CHUNKS
}

/// `sums`' totals for a row of `n` handed over a piece of [`SUM_BLOCK`] elements at a time,
/// from the row's start, in order: `piece(p, last)` loads piece `p` and returns the lane sums of
/// its whole chunks (`block`; `None` where it has none) and, where `last`, its tail's terms
/// (as `sums`' `tail`; zeros otherwise). The same blocks, tail and totals as `sums`, for a
/// blocked row or not: its bits. For float16 rows widened piece by piece (`cpu::widen`).
#[inline(always)]
#[allow(clippy::type_complexity)]
pub fn sums_by_pieces<A: Accum, const K: usize>(
    n: usize,
    mut piece: impl FnMut(usize, bool) -> (Option<[[A; LANES]; K]>, [[A; LANES]; K]),
) -> [f64; K] {
    let pieces = n.div_ceil(SUM_BLOCK);
    let mut blocks = [RowSum::new(); K];
    let mut first = [[A::ZERO; LANES]; K];
    let mut tails = [[A::ZERO; LANES]; K];
    for p in 0..pieces {
        let last = p + 1 == pieces;
        let (acc, t) = piece(p, last);
        if last {
            tails = t;
        }
        if let Some(acc) = acc {
            if blocked(n) {
                for (b, a) in blocks.iter_mut().zip(&acc) {
                    b.add(a);
                }
            } else {
                // One block at most: the first piece's (a row of 2049-2063 has its tail in a
                // second piece), totalled by trees below.
                first = acc;
            }
        }
    }
    if !blocked(n) {
        return tree_totals(n, &first, &tails);
    }
    for (b, t) in blocks.iter_mut().zip(&tails) {
        b.add(t);
    }
    RowSum::totals(blocks)
}

/// [`stats`] of a row of `n` in `A`, handed over a piece at a time: `load(range, buf)` fills
/// `buf` with the row's elements `range` (pieces of [`SUM_BLOCK`] from the row's start;
/// `scratch` holds one), twice (the mean's pass and the centred sums'), summed by
/// [`sums_by_pieces`]: [`stats`]'s bits. For float16 rows widened piece by piece (`cpu::widen`).
#[inline(always)]
pub fn stats_by_pieces<A: Accum>(
    n: usize,
    eps: A,
    scratch: &mut [A],
    mut load: impl FnMut(std::ops::Range<usize>, &mut [A]),
) -> Stats<A> {
    debug_assert!(n > 0 && scratch.len() >= SUM_BLOCK.min(n));
    let range = |p: usize| p * SUM_BLOCK..((p + 1) * SUM_BLOCK).min(n);
    let [s] = sums_by_pieces::<A, 1>(
        n,
        #[inline(always)]
        |p, last| {
            let piece = &mut scratch[..range(p).len()];
            load(range(p), piece);
            piece_terms::<A, 1>(
                piece,
                last,
                #[inline(always)]
                |x| [x],
                #[inline(always)]
                |v| [v],
            )
        },
    );
    let m = A::from_f64(s / n as f64);
    let [s1, s2] = sums_by_pieces::<A, 2>(
        n,
        #[inline(always)]
        |p, last| {
            let piece = &mut scratch[..range(p).len()];
            load(range(p), piece);
            piece_terms::<A, 2>(
                piece,
                last,
                #[inline(always)]
                |x| centred_terms(x, m),
                #[inline(always)]
                |v| {
                    let d = v - m;
                    [d, d * d]
                },
            )
        },
    );
    let (shift, rstd) = shift_and_rstd(s1, s2, n, eps);
    Stats {
        mean: m,
        shift,
        rstd,
    }
}

/// A piece's part of [`sums_by_pieces`]: the lane sums of its whole chunks' terms (`chunk` of
/// each chunk; `None` without any) and, where `last`, its tail's terms (`tail` of each element).
#[inline(always)]
#[allow(clippy::type_complexity)]
fn piece_terms<A: Accum, const K: usize>(
    piece: &[A],
    last: bool,
    chunk: impl Fn([A; LANES]) -> [[A; LANES]; K],
    tail: impl Fn(A) -> [A; K],
) -> (Option<[[A; LANES]; K]>, [[A; LANES]; K]) {
    let (xb, xt) = piece.as_chunks::<LANES>();
    let acc = if xb.is_empty() {
        None
    } else {
        Some(block::<A, K>(
            #[inline(always)]
            |c| chunk(xb[c]),
            0,
            xb.len(),
        ))
    };
    let mut tails = [[A::ZERO; LANES]; K];
    if last {
        for (j, &v) in xt.iter().enumerate() {
            for (t, v) in tails.iter_mut().zip(tail(v)) {
                t[j] = v;
            }
        }
    }
    (acc, tails)
}

/// [`gradient_sums`] of a row of `n` in `A`, handed over a piece at a time: `load(range, x,
/// dy)` fills `x` and `dy` with the row's elements `range` (as [`stats_by_pieces`]), `w` the
/// row's weight (in `A`, as the CPU hands it over), summed by [`sums_by_pieces`]: its bits.
#[inline(always)]
pub fn gradient_sums_by_pieces<W: Element, A: Accum + Element>(
    n: usize,
    w: Option<&[W]>,
    m: A,
    (xs, dys): (&mut [A], &mut [A]),
    mut load: impl FnMut(std::ops::Range<usize>, &mut [A], &mut [A]),
) -> [f64; 3] {
    let range = |p: usize| p * SUM_BLOCK..((p + 1) * SUM_BLOCK).min(n);
    sums_by_pieces::<A, 3>(
        n,
        #[inline(always)]
        |p, last| {
            let len = range(p).len();
            let (x, dy) = (&mut xs[..len], &mut dys[..len]);
            load(range(p), x, dy);
            let (xb, xt) = x.as_chunks::<LANES>();
            let (db, dt) = dy.as_chunks::<LANES>();
            let w = w.map(|w| &w[range(p)]);
            let wb = w.map(|w| w.as_chunks::<LANES>());
            let acc = if xb.is_empty() {
                None
            } else {
                Some(block::<A, 3>(
                    #[inline(always)]
                    |k| gradient_terms(xb[k], db[k], wb.map(|(wb, _)| &wb[k]), m),
                    0,
                    xb.len(),
                ))
            };
            let mut tails = [[A::ZERO; LANES]; 3];
            if last {
                for j in 0..xt.len() {
                    let t = gradient_tail(xt[j], dt[j], wb.map(|(_, wt)| wt[j]), m);
                    for (tk, v) in tails.iter_mut().zip(t) {
                        tk[j] = v;
                    }
                }
            }
            (acc, tails)
        },
    )
}

/// The mean of a row, rounded once to `A`.
#[inline(always)]
pub fn mean<T: Element, A: Accum>(x: &[T]) -> A {
    A::from_f64(row_sum::<T, A>(x) / x.len() as f64)
}

/// The sum of a row (taken as [`sums`] takes sums).
#[inline(always)]
pub fn row_sum<T: Element, A: Accum>(x: &[T]) -> f64 {
    let (xb, xt) = x.as_chunks::<LANES>();
    let [sum] = sums::<A, 1>(
        x.len(),
        #[inline(always)]
        |c| [widen::<T, A>(&xb[c])],
        #[inline(always)]
        |j| [A::load(xt[j])],
    );
    sum
}

/// A row's statistics; NaN for an empty row, as `jnp.mean` of nothing.
#[inline(always)]
pub fn stats<T: Element, A: Accum>(x: &[T], eps: A) -> Stats<A> {
    if x.is_empty() {
        return Stats {
            mean: A::NAN,
            shift: A::NAN,
            rstd: A::NAN,
        };
    }
    let m = mean::<T, A>(x);
    let (shift, rstd) = centred::<T, A>(x, m, eps);
    Stats {
        mean: m,
        shift,
        rstd,
    }
}

/// One row of the forward: `y = ((x - m) - d) * rstd * w + b` (without a weight or a bias,
/// without that factor or term); returns the row's statistics. The weight and bias are read as
/// `A::load` reads them (the CPU hands them over in `A`, converted once per call with any scale
/// offset added).
#[inline(always)]
pub fn forward_row<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    b: Option<&[W]>,
    eps: A,
    y: &mut [T],
) -> Stats<A> {
    let s = stats::<T, A>(x, eps);
    forward_apply::<T, W, A>(x, w, b, s, y);
    s
}

/// `y` of one row given its statistics (see [`forward_row`]).
#[inline(always)]
pub fn forward_apply<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    b: Option<&[W]>,
    s: Stats<A>,
    y: &mut [T],
) {
    let (m, d, r) = (s.mean, s.shift, s.rstd);
    let xhat = |v: T| (A::load(v) - m - d) * r;
    // One loop per case, each without branches, so that they vectorize.
    match (w, b) {
        (Some(w), Some(b)) => {
            for (((o, &v), &wi), &bi) in y.iter_mut().zip(x).zip(w).zip(b) {
                *o = (xhat(v) * A::load(wi) + A::load(bi)).store();
            }
        }
        (Some(w), None) => {
            for ((o, &v), &wi) in y.iter_mut().zip(x).zip(w) {
                *o = (xhat(v) * A::load(wi)).store();
            }
        }
        (None, Some(b)) => {
            for ((o, &v), &bi) in y.iter_mut().zip(x).zip(b) {
                *o = (xhat(v) + A::load(bi)).store();
            }
        }
        (None, None) => {
            for (o, &v) in y.iter_mut().zip(x) {
                *o = xhat(v).store();
            }
        }
    }
}

/// The forward over consecutive rows of `n` (`rstd.len()` of them); `w_of(i)` and `b_of(i)` are
/// row `i`'s weight and bias. With `split`, the rows are slices of longer ones, their
/// statistics from the whole rows' sums (both norms: see [`SplitRows`]); else LayerNorm's own.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn forward_rows<'w, T: Element, W: Element + 'w, A: Accum>(
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    b_of: impl Fn(usize) -> Option<&'w [W]>,
    eps: A,
    split: Option<SplitRows<'_, A>>,
    y: &mut [T],
    mut mean: Option<&mut [A]>,
    rstd: &mut [A],
) {
    if n == 0 {
        mean.iter_mut().for_each(|m| m.fill(A::NAN));
        rstd.fill(A::NAN);
        return;
    }
    // Narrow rows in batches whose statistics run side by side (the same bits), the rest below.
    let mut done = 0;
    if split.is_none() && super::narrow(n) {
        let batch = NARROW_BATCH * n;
        for ((xb, yb), rb) in x
            .chunks_exact(batch)
            .zip(y.chunks_exact_mut(batch))
            .zip(rstd.chunks_exact_mut(NARROW_BATCH))
        {
            let stats = batch_stats::<T, A>(xb, n, eps);
            for (k, ((xr, yr), s)) in xb
                .chunks_exact(n)
                .zip(yb.chunks_exact_mut(n))
                .zip(&stats)
                .enumerate()
            {
                forward_apply::<T, W, A>(xr, w_of(done + k), b_of(done + k), *s, yr);
            }
            for (r, s) in rb.iter_mut().zip(&stats) {
                *r = s.rstd;
            }
            if let Some(mean) = mean.as_deref_mut() {
                for (m, s) in mean[done..].iter_mut().zip(&stats) {
                    *m = s.mean;
                }
            }
            done += NARROW_BATCH;
        }
    }
    let rows = y.chunks_exact_mut(n).zip(x.chunks_exact(n));
    for (i, ((y, x), r)) in rows.zip(rstd.iter_mut()).enumerate().skip(done) {
        let s = match split {
            Some(split) => {
                let s = split.from_row(i).stats();
                forward_apply::<T, W, A>(x, w_of(i), b_of(i), s, y);
                s
            }
            None => forward_row::<T, W, A>(x, w_of(i), b_of(i), eps, y),
        };
        if let Some(mean) = mean.as_deref_mut() {
            mean[i] = s.mean;
        }
        *r = s.rstd;
    }
}

/// The statistics of a batch of [`NARROW_BATCH`] narrow rows of `n` (see [`super::narrow`]):
/// the rows' sums, their means, their centred sums, then their shifts and rstd, each in a loop
/// of its own, so that the float64 divisions and square roots of the 8 rows run side by side;
/// row by row they were a serial chain per row (perf, AVX2, bfloat16 8192x64 forward: the
/// scalar `vcvtsd2ss`, `vmulsd` and divisions of the statistics were the top samples). The same
/// operations per row as [`stats`], so the same bits. (The caller applies them in its own loop:
/// handed a closure to apply, the float16 forward ran that closure out of line, for the
/// baseline instruction set, at 3.9 ms against 2.0.)
#[inline(always)]
fn batch_stats<T: Element, A: Accum>(xb: &[T], n: usize, eps: A) -> [Stats<A>; NARROW_BATCH] {
    let mut sums = [0f64; NARROW_BATCH];
    for (s, row) in sums.iter_mut().zip(xb.chunks_exact(n)) {
        *s = row_sum::<T, A>(row);
    }
    let mut means = [A::ZERO; NARROW_BATCH];
    for (m, &s) in means.iter_mut().zip(&sums) {
        *m = A::from_f64(s / n as f64);
    }
    let mut centred = [[0f64; 2]; NARROW_BATCH];
    for ((c, row), &m) in centred.iter_mut().zip(xb.chunks_exact(n)).zip(&means) {
        *c = centred_sums::<T, A>(row, m);
    }
    let mut stats = [Stats {
        mean: A::ZERO,
        shift: A::ZERO,
        rstd: A::ZERO,
    }; NARROW_BATCH];
    for ((s, &[s1, s2]), &m) in stats.iter_mut().zip(&centred).zip(&means) {
        let (shift, rstd) = shift_and_rstd(s1, s2, n, eps);
        *s = Stats {
            mean: m,
            shift,
            rstd,
        };
    }
    stats
}

/// One row of the backward (row 0 of `moments`): writes `dx` (plus `dh` before it is rounded,
/// the fused residual's backward) and, with `acc`, adds this row's `dy * xhat` to its first `n`
/// sums (the weight's gradient) and, where it holds `2n`, `dy` to the next `n` (the bias's).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_row<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    moments: Moments<'_, A>,
    dy: &[T],
    dh: Option<&[T]>,
    dx: &mut [T],
    acc: Option<&mut [A::Wide]>,
) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let (m, r) = match moments {
        Moments::Given { mean, rstd } => (mean[0], rstd[0]),
        Moments::FromX(eps) => {
            let s = stats::<T, A>(x, eps);
            (s.mean, s.rstd)
        }
        Moments::Split(rows) => {
            return backward_apply::<T, W, A>(x, w, rows.gradient(), dy, dh, dx, acc);
        }
    };
    let g = gradient_of(gradient_sums::<T, W, A>(x, w, m, dy), n, m, r);
    backward_apply::<T, W, A>(x, w, g, dy, dh, dx, acc);
}

/// A row's first backward pass: `[sum(x - m), sum(g), sum(g * (x - m))]` with `g = dy * w`
/// (or `dy`); the first is the shift, with the forward's bits.
#[inline(always)]
pub fn gradient_sums<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    m: A,
    dy: &[T],
) -> [f64; 3] {
    let (xb, xt) = x.as_chunks::<LANES>();
    let (db, dt) = dy.as_chunks::<LANES>();
    let wb = w.map(|w| w.as_chunks::<LANES>());
    sums::<A, 3>(
        x.len(),
        #[inline(always)]
        |k| gradient_terms(xb[k], db[k], wb.map(|(wb, _)| &wb[k]), m),
        #[inline(always)]
        |j| gradient_tail(xt[j], dt[j], wb.map(|(_, wt)| wt[j]), m),
    )
}

/// A chunk's terms of [`gradient_sums`]: `x - m`, `g = dy * w` (or `dy`) and `g * (x - m)`.
#[inline(always)]
fn gradient_terms<T: Element, W: Element, A: Accum>(
    x: [T; LANES],
    dy: [T; LANES],
    w: Option<&[W; LANES]>,
    m: A,
) -> [[A; LANES]; 3] {
    let mut c = widen::<T, A>(&x);
    let mut g = widen::<T, A>(&dy);
    if let Some(w) = w {
        for (g, w) in g.iter_mut().zip(widen::<W, A>(w)) {
            *g = *g * w;
        }
    }
    let mut gc = [A::ZERO; LANES];
    for ((o, c), &g) in gc.iter_mut().zip(c.iter_mut()).zip(&g) {
        *c = *c - m;
        *o = g * *c;
    }
    [c, g, gc]
}

/// A tail element's terms of [`gradient_sums`] (as [`gradient_terms`]).
#[inline(always)]
fn gradient_tail<T: Element, W: Element, A: Accum>(x: T, dy: T, w: Option<W>, m: A) -> [A; 3] {
    let g = A::load(dy);
    let g = w.map_or(g, |w| g * A::load(w));
    let c = A::load(x) - m;
    [c, g, g * c]
}

/// A row's second backward pass given its coefficients (see [`backward_row`]).
#[inline(always)]
pub fn backward_apply<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    g: Gradient<A>,
    dy: &[T],
    dh: Option<&[T]>,
    dx: &mut [T],
    acc: Option<&mut [A::Wide]>,
) {
    let n = x.len();
    let (dw, db) = match acc {
        Some(acc) => {
            let (dw, db) = acc.split_at_mut(n);
            (Some(dw), (db.len() >= n).then(|| &mut db[..n]))
        }
        None => (None, None),
    };
    backward_apply_parts::<T, W, A>(x, w, g, dy, dh, dx, (dw, db));
}

/// A row's (or a piece's) weight-gradient sums and bias-gradient sums, where a call has them.
pub type GradientSums<'a, A> = (
    Option<&'a mut [<A as Accum>::Wide]>,
    Option<&'a mut [<A as Accum>::Wide]>,
);

/// [`backward_apply`] with the weight's gradient sums and the bias's (where the call has them)
/// in slices of their own, element by element: a row may be handed over a piece at a time
/// (`cpu::widen`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_apply_parts<T: Element, W: Element, A: Accum>(
    x: &[T],
    w: Option<&[W]>,
    g: Gradient<A>,
    dy: &[T],
    dh: Option<&[T]>,
    dx: &mut [T],
    (dw, db): GradientSums<'_, A>,
) {
    let Gradient {
        mean: m,
        shift: d,
        rstd: r,
        c1,
        c2,
    } = g;
    let xhat = |v: T| (A::load(v) - m - d) * r;
    let dx_of = |v: T, g: A| r * (g - c1 - xhat(v) * c2);
    // One loop per case, each without branches, so that they vectorize.
    match (w, dh) {
        (Some(w), Some(dh)) => {
            for (((o, &v), (&dv, &wv)), &hv) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)).zip(dh) {
                *o = (dx_of(v, A::load(dv) * A::load(wv)) + A::load(hv)).store();
            }
        }
        (Some(w), None) => {
            for ((o, &v), (&dv, &wv)) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)) {
                *o = dx_of(v, A::load(dv) * A::load(wv)).store();
            }
        }
        (None, Some(dh)) => {
            for (((o, &v), &dv), &hv) in dx.iter_mut().zip(x).zip(dy).zip(dh) {
                *o = (dx_of(v, A::load(dv)) + A::load(hv)).store();
            }
        }
        (None, None) => {
            for ((o, &v), &dv) in dx.iter_mut().zip(x).zip(dy) {
                *o = dx_of(v, A::load(dv)).store();
            }
        }
    }
    match (dw, db) {
        (Some(dw), Some(db)) => {
            for (((aw, ab), &v), &dv) in dw.iter_mut().zip(db.iter_mut()).zip(x).zip(dy) {
                let gy = A::load(dv);
                *aw = aw.add((gy * xhat(v)).to_f64());
                *ab = ab.add(gy.to_f64());
            }
        }
        (Some(dw), None) => {
            for ((aw, &v), &dv) in dw.iter_mut().zip(x).zip(dy) {
                *aw = aw.add((A::load(dv) * xhat(v)).to_f64());
            }
        }
        (None, db) => {
            for (ab, &dv) in db.into_iter().flatten().zip(dy) {
                *ab = ab.add(A::load(dv).to_f64());
            }
        }
    }
}

/// The backward over consecutive rows of `n` (as many as `dx` holds), row by row; `w_of(i)` is
/// row `i`'s weight, `acc` the rows' `2n` gradient sums (see [`backward_row`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_rows<'w, T: Element, W: Element + 'w, A: Accum>(
    x: &[T],
    dy: &[T],
    dh: Option<&[T]>,
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]>,
    moments: Moments<'_, A>,
    dx: &mut [T],
    mut acc: Option<&mut [A::Wide]>,
) {
    if n == 0 {
        return;
    }
    for (i, dx) in dx.chunks_exact_mut(n).enumerate() {
        let row = i * n..(i + 1) * n;
        backward_row::<T, W, A>(
            &x[row.clone()],
            w_of(i),
            moments.from_row(i),
            &dy[row.clone()],
            dh.map(|dh| &dh[row]),
            dx,
            acc.as_deref_mut(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values `centre + spread * u`, u in [-1, 1).
    fn row(n: usize, seed: u64, centre: f64, spread: f64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (centre + spread * ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)) as f32
            })
            .collect()
    }

    /// float64 forward of the float32 row: (y, mean, rstd).
    fn reference(x: &[f32], w: &[f32], b: &[f32], eps: f64) -> (Vec<f64>, f64, f64) {
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let r = 1.0 / (var + eps).sqrt();
        let y = x
            .iter()
            .zip(w.iter().zip(b))
            .map(|(&v, (&wi, &bi))| (v as f64 - mean) * r * wi as f64 + bi as f64)
            .collect();
        (y, mean, r)
    }

    /// The largest error of `y` against `want`, in float32 units of the row's largest |y|
    /// (normalized outputs are O(1), so this is the error relative to the result's scale).
    fn error(y: &[f32], want: &[f64]) -> f64 {
        error_at(y, want, want.iter().fold(0f64, |m, v| m.max(v.abs())))
    }

    /// [`error`] in units of `scale`'s float32 eps.
    fn error_at(y: &[f32], want: &[f64], scale: f64) -> f64 {
        let ulp = scale * f32::EPSILON as f64;
        y.iter()
            .zip(want)
            .map(|(&a, &b)| (a as f64 - b).abs() / ulp)
            .fold(0.0, f64::max)
    }

    /// `E[x^2] - E[x]^2` in float32: the variance a LayerNorm must not use (planted here to
    /// prove the accuracy bound below catches it).
    fn naive_forward(x: &[f32], eps: f32) -> Vec<f32> {
        let n = x.len() as f32;
        let mean = x.iter().sum::<f32>() / n;
        let var = (x.iter().map(|v| v * v).sum::<f32>() / n - mean * mean).max(0.0);
        let r = 1.0 / (var + eps).sqrt();
        x.iter().map(|v| (v - mean) * r).collect()
    }

    /// Bound on the errors, in float32 units of the result's scale (measured: at most 4.1 for
    /// the forward, at n = 65536 with mean 1e4, and 3.7 for the backward, over the rows below).
    const FORWARD_BOUND: f64 = 8.0;

    #[test]
    fn the_forward_is_within_a_few_ulps_of_float64_even_at_large_means() {
        for n in [1usize, 3, 16, 100, 1024, 4097, 1 << 16] {
            for (centre, spread) in [(0.0, 1.0), (3.0, 0.5), (1e4, 1.0), (1e6, 1.0), (-1e6, 10.0)] {
                let x = row(n, n as u64, centre, spread);
                let w = row(n, 7, 1.0, 0.5);
                let b = row(n, 9, 0.0, 0.5);
                let mut y = vec![0f32; n];
                let s = forward_row::<f32, f32, f32>(&x, Some(&w), Some(&b), 1e-5, &mut y);
                let (want, mean, r) = reference(&x, &w, &b, 1e-5);
                if n == 1 {
                    // One element: its deviation is 0, y the bias.
                    assert_eq!(y, b);
                    continue;
                }
                let e = error(&y, &want);
                assert!(e <= FORWARD_BOUND, "n={n} mean {centre}: {e} ulps");
                // The mean's error: its rounding, and the float32 block sums' against the
                // spread.
                let tol = (mean.abs() + spread) * f32::EPSILON as f64;
                assert!(
                    (s.mean as f64 - mean).abs() <= tol,
                    "n={n} mean {centre}: mean"
                );
                assert!(
                    (s.rstd as f64 - r).abs() <= 4.0 * r * f32::EPSILON as f64,
                    "rstd"
                );
            }
        }
    }

    #[test]
    fn a_planted_naive_variance_fails_the_same_bound() {
        let x = row(4096, 3, 1e4, 1.0);
        let (want, _, _) = reference(&x, &vec![1.0; 4096], &[0.0; 4096], 1e-5);
        let e = error(&naive_forward(&x, 1e-5), &want);
        assert!(
            e > 1000.0 * FORWARD_BOUND,
            "the planted fault gave only {e} ulps"
        );
    }

    #[test]
    fn the_backward_matches_float64_and_takes_the_forwards_bits_either_way() {
        for n in [2usize, 17, 1024, 5000] {
            for centre in [0.0, 1e4, 1e6] {
                let x = row(n, 11, centre, 1.0);
                let w = row(n, 12, 1.0, 0.5);
                let dy = row(n, 13, 0.0, 1.0);
                let mut y = vec![0f32; n];
                let s = forward_row::<f32, f32, f32>(&x, Some(&w), None, 1e-5, &mut y);
                let mut dx = vec![0f32; n];
                let mut acc = vec![0f64; 2 * n];
                let given = Moments::Given {
                    mean: &[s.mean],
                    rstd: &[s.rstd],
                };
                backward_row::<f32, f32, f32>(
                    &x,
                    Some(&w),
                    given,
                    &dy,
                    None,
                    &mut dx,
                    Some(&mut acc),
                );
                let mut dx2 = vec![0f32; n];
                let mut acc2 = vec![0f64; 2 * n];
                backward_row::<f32, f32, f32>(
                    &x,
                    Some(&w),
                    Moments::FromX(1e-5),
                    &dy,
                    None,
                    &mut dx2,
                    Some(&mut acc2),
                );
                assert_eq!(dx, dx2, "n={n}: given statistics and statistics from x");
                assert_eq!(acc, acc2);
                // float64: dx = r * (g - mean(g) - xhat * mean(g * xhat)).
                let (_, mean, r) = reference(&x, &w, &vec![0.0; n], 1e-5);
                let nf = n as f64;
                let xhat: Vec<f64> = x.iter().map(|&v| (v as f64 - mean) * r).collect();
                let g: Vec<f64> = dy
                    .iter()
                    .zip(&w)
                    .map(|(&d, &wi)| d as f64 * wi as f64)
                    .collect();
                let mg = g.iter().sum::<f64>() / nf;
                let mgx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / nf;
                let want: Vec<f64> = g
                    .iter()
                    .zip(&xhat)
                    .map(|(gi, h)| r * (gi - mg - h * mgx))
                    .collect();
                // In units of the terms' scale, r * max |g| (dx itself can cancel to ~0: at
                // n = 2 it is 0).
                let scale = r * g.iter().fold(0f64, |m, v| m.max(v.abs()));
                let e = error_at(&dx, &want, scale);
                assert!(
                    e <= FORWARD_BOUND,
                    "n={n} mean {centre}: dx off by {e} ulps"
                );
                for i in 0..n {
                    assert!(
                        (acc[i] - dy[i] as f64 * xhat[i]).abs() <= 1e-5 * (1.0 + xhat[i].abs())
                    );
                    assert_eq!(acc[n + i], dy[i] as f64);
                }
            }
        }
    }

    #[test]
    fn empty_and_non_finite_rows() {
        let s = stats::<f32, f32>(&[], 1e-5);
        assert!(s.mean.is_nan() && s.rstd.is_nan());
        let mut y = [0f32; 3];
        forward_row::<f32, f32, f32>(&[1.0, f32::NAN, 2.0], None::<&[f32]>, None, 1e-5, &mut y);
        assert!(y.iter().all(|v| v.is_nan()));
        forward_row::<f32, f32, f32>(
            &[1.0, f32::INFINITY, 2.0],
            None::<&[f32]>,
            None,
            1e-5,
            &mut y,
        );
        assert!(y.iter().all(|v| v.is_nan()));
        // A constant row: variance 0, y = 0 (not NaN), rstd = 1/sqrt(eps).
        let s = forward_row::<f32, f32, f32>(&[5.0; 3], None::<&[f32]>, None, 1e-4, &mut y);
        assert_eq!(y, [0.0; 3]);
        assert!((s.rstd - 100.0).abs() < 1e-3);
    }
}
