//! The sums passes of a split row (`contract::Split`): when a mesh shards the normalized axis,
//! each device sums its slice of every row, the devices all-reduce those few floats per row,
//! and the apply pass (the forward's and backward's own calls, given the sums: see
//! `math::layer::SplitRows`) writes the device's slice. The sums are taken as the whole-row
//! kernels take theirs (blocked, float64 totals), rounded once to the accumulation dtype.

use super::{weight_rows, workers, BackwardState, CpuAccum, ForwardState};
use crate::handlers::contract::{DtypePair, Float, Split};
use crate::handlers::math::{layer, sum_squares, Accum, Element};
use crate::handlers::operands::{
    backward_sums_operands, sums_operands, BackwardForm, Layout, SumsOperands,
};
use half::{bf16, f16};

use super::plan::{Plan, FORWARD_CHUNK_ELEMENTS};
use super::simd::Kernel;
use xla_ffi_bundles::ffi::parallel::{DisjointChunks, ParallelJobs, MAX_CHUNKS};
use xla_ffi_bundles::ffi::{ArgsView, Context, FfiError, FfiResult, Host, ResultList};

/// Where a sums pass runs: the call site's pool of parallel jobs, XLA's context, and the
/// instruction set.
struct RowJobs<'s, 'c, 'a> {
    jobs: &'s ParallelJobs,
    ctx: &'c Context<'a>,
    kernel: Kernel,
}

impl RowJobs<'_, '_, '_> {
    /// Runs `row(i, sums_i)` for every row `i` of `layout`, writing its `k` sums, in chunks of
    /// rows on XLA's pool (inside `kernel.run`, where the row's loops vectorize). `bytes`: what
    /// the call reads.
    fn each_row<A: Element + Send>(
        &self,
        (layout, k, bytes): (Layout, usize, usize),
        sums: &mut [A],
        row: impl Fn(usize, &mut [A]) + Sync,
    ) -> FfiResult<()> {
        if layout.n == 0 {
            sums.fill(A::default());
            return Ok(());
        }
        let plan = Plan::split(layout.rows, layout.n, FORWARD_CHUNK_ELEMENTS, MAX_CHUNKS);
        let out = DisjointChunks::new(sums, &plan.scaled(k)[..plan.count() + 1])?;
        let kernel = self.kernel;
        let body = |c: usize| {
            let Some(out) = out.take(c) else { return };
            let first = plan.start(c);
            kernel.run(
                #[inline(always)]
                || {
                    for (i, o) in out.chunks_exact_mut(k).enumerate() {
                        row(first + i, o);
                    }
                },
            )
        };
        self.jobs
            .run(self.ctx, plan.count(), workers(self.ctx, bytes), &body)
    }
}

/// The x dtype's types: `T` (x) and `A` (its accumulation dtype).
macro_rules! with_x_types {
    ($pair:expr, |$t:ident, $a:ident| $body:expr) => {{
        macro_rules! bind {
            ($x:ty, $acc:ty) => {{
                type $t = $x;
                type $a = $acc;
                $body
            }};
        }
        match $pair.x {
            Float::F32 => bind!(f32, f32),
            Float::F64 => bind!(f64, f64),
            Float::BF16 => bind!(bf16, f32),
            Float::F16 => bind!(f16, f32),
        }
    }};
}

/// A forward's sums pass: `sum(x^2)` (the RMS norm), `sum(x)` (LayerNorm), or LayerNorm's
/// `[sum(x - m), sum((x - m)^2)]` given the mean (`CentredSums`).
pub(super) fn forward_sums(
    state: &ForwardState,
    ctx: &Context<'_>,
    args: &ArgsView<'_>,
    rets: &mut ResultList<'_>,
    split: Split,
) -> FfiResult<()> {
    let ops = sums_operands(args, rets, state.norm, split, state.row_len)?;
    let pair: DtypePair = ops.pair;
    let (n, k) = (ops.layout.n, ops.k);
    let jobs = RowJobs {
        jobs: &state.jobs,
        ctx,
        kernel: state.kernel,
    };
    with_x_types!(pair, |T, A| {
        let x = ops.x.as_slice::<T>()?;
        let mean = ops.mean.as_ref().map(|m| m.as_slice::<A>()).transpose()?;
        let sums = ops.sums.into_mut_slice::<A>()?;
        let centred = state.norm.centred();
        let bytes = std::mem::size_of_val(x);
        jobs.each_row(
            (ops.layout, k, bytes),
            sums,
            #[inline(always)]
            |i, o: &mut [A]| {
                let x = &x[i * n..][..n];
                match (mean, centred) {
                    (Some(mean), _) => {
                        let [s1, s2] = layer::centred_sums::<T, A>(x, mean[i]);
                        o[0] = <A as Accum>::from_f64(s1);
                        o[1] = <A as Accum>::from_f64(s2);
                    }
                    (None, true) => o[0] = <A as Accum>::from_f64(layer::row_sum::<T, A>(x)),
                    (None, false) => o[0] = <A as Accum>::from_f64(sum_squares::<T, A>(x)),
                }
            },
        )
    })
}

/// A backward's sums pass (see `contract::Split`): per row, LayerNorm's `[sum(x - m), sum(g),
/// sum(g * (x - m))]`, the RMS norm's `sum(g * x)` (then `sum(x^2)` when it takes rstd from x).
pub(super) fn backward_sums(
    state: &BackwardState,
    ctx: &Context<'_>,
    args: &ArgsView<'_>,
    rets: &mut ResultList<'_>,
    form: BackwardForm,
) -> FfiResult<()> {
    let form = BackwardForm {
        has_dh: false,
        ..form
    };
    let ops = backward_sums_operands(args, rets, form)?;
    let pair: DtypePair = ops.pair;
    let jobs = RowJobs {
        jobs: &state.jobs,
        ctx,
        kernel: state.kernel,
    };
    with_pair_types!(pair, |T, W, _K, A| backward_sums_typed::<T, W, A>(
        state, &jobs, ops
    ))
}

fn backward_sums_typed<T: Element, W: Element, A: CpuAccum>(
    state: &BackwardState,
    jobs: &RowJobs<'_, '_, '_>,
    ops: SumsOperands<'_, '_, Host>,
) -> FfiResult<()> {
    let x = ops.x.as_slice::<T>()?;
    let dy = ops
        .dy
        .as_ref()
        .ok_or_else(|| FfiError::internal("a backward sums pass without dy"))?
        .as_slice::<T>()?;
    let mean = ops.mean.as_ref().map(|m| m.as_slice::<A>()).transpose()?;
    let w = ops
        .w
        .as_ref()
        .map(|w| weight_rows::<W, A>(&state.offset_weights, w.as_slice::<W>()?, state.offset))
        .transpose()?;
    let w = w.as_deref();
    let sums = ops.sums.into_mut_slice::<A>()?;
    let (n, k) = (ops.layout.n, ops.k);
    let per_group = ops.layout.rows_per_group().max(1);
    let bytes = 2 * std::mem::size_of_val(x);
    jobs.each_row(
        (ops.layout, k, bytes),
        sums,
        #[inline(always)]
        |i, o: &mut [A]| {
            let (x, dy) = (&x[i * n..][..n], &dy[i * n..][..n]);
            let w = w.map(|w| &w[(i / per_group) * n..][..n]);
            match mean {
                Some(mean) => {
                    let s = layer::gradient_sums::<T, A, A>(x, w, mean[i], dy);
                    for (o, s) in o.iter_mut().zip(s) {
                        *o = <A as Accum>::from_f64(s);
                    }
                }
                None => {
                    let [_, _, dot] = layer::gradient_sums::<T, A, A>(x, w, A::ZERO, dy);
                    o[0] = <A as Accum>::from_f64(dot);
                    if k == 2 {
                        o[1] = <A as Accum>::from_f64(sum_squares::<T, A>(x));
                    }
                }
            }
        },
    )
}
