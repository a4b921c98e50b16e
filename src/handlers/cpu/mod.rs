//! RMS norm on CPU: the `rmsnorm_fwd` and `rmsnorm_bwd` bundles.
//!
//! Instantiate validates the attributes once and builds the state: the instruction set for
//! this CPU, a pool of parallel-loop slots, and (backward) pools of weight-gradient partial
//! rows. Execute checks the buffers against the attributes, cuts the rows into chunks that
//! depend only on the shape ([`plan`]), and runs them on XLA's intra-op thread pool. After
//! warm-up it allocates nothing.
//!
//! Weights may carry leading batch dimensions that are a prefix of x's (what `jax.vmap` with
//! `vmap_method="broadcast_all"` produces when the weight is mapped too): rows are then split
//! into that many contiguous groups, each with its own weight row and weight-gradient row.

#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod plan;
pub mod simd;
pub mod widen;

use half::{bf16, f16};

use super::contract::{DtypePair, Float, Norm, Split};
pub use super::contract::{BACKWARD_TARGET, FORWARD_TARGET, RESIDUAL_TARGET};
use super::math::{
    add_into, backward_narrow, backward_row_adding, backward_rows, backward_rows_paired,
    forward_narrow, forward_row, forward_rows,
    layer::{self, Moments, SplitRows},
    narrow, offset_weights, Accum, Compensated, Element, Rstd, WideSum,
};
use super::operands::{
    backward_operands, check_eps, check_norm, check_row_len, check_scale_offset, check_split,
    forward_operands, residual_operands, BackwardForm, BackwardOperands, ForwardForm,
    ForwardOperands, Layout, ResidualOperands, SplitInputs,
};
use super::operands::{BackwardAttrs, ForwardAttrs};
use plan::{Plan, FORWARD_CHUNK_ELEMENTS, MAX_BACKWARD_CHUNKS};
use simd::Kernel;
use widen::CpuElement;
use xla_ffi_bundles::ffi::parallel::{DisjointChunks, ParallelJobs, MAX_CHUNKS};
use xla_ffi_bundles::ffi::{
    AnyBuffer, AnyResult, ArgsView, Bundle, BundleDef, Context, Execute, FfiError, FfiResult, Host,
    Instantiate, ResultList,
};
use xla_ffi_bundles::state::{LiveState, WorkspacePool};

use once_cell::sync::OnceCell;

/// Column block of the weight-gradient reduction.
const REDUCE_BLOCK: usize = 1024;

/// Weight-gradient partial rows a backward pass may use for rows of `n`: up to
/// [`MAX_BACKWARD_CHUNKS`], fewer for long rows (at most 16M elements in all, or one row when a
/// single row is longer than that).
fn partial_rows(n: usize) -> usize {
    ((16 << 20) / n.max(1)).clamp(1, MAX_BACKWARD_CHUNKS)
}

/// Per-call-site state of `rmsnorm_fwd`.
pub struct ForwardState {
    pub live: LiveState,
    kernel: Kernel,
    eps: f32,
    has_weight: bool,
    row_len: usize,
    jobs: ParallelJobs,
    /// `Some`: the weight applied is `offset + w` (see `ForwardAttrs::scale_offset`).
    offset: Option<f32>,
    offset_weights: OffsetWeights,
    norm: Norm,
    has_bias: bool,
    /// A split row's pass (`contract::Split`), and the whole row's length.
    split: Option<(Split, usize)>,
}
xla_ffi_bundles::state_type!(ForwardState, "rmsnorm_ffi.RmsNormForwardState");

/// Per-call-site state of `rmsnorm_bwd`.
pub struct BackwardState {
    pub live: LiveState,
    kernel: Kernel,
    /// Some: calls have no rstd operand and take it from x with this eps (see
    /// `BackwardAttrs::eps`).
    eps: Option<f32>,
    has_weight: bool,
    row_len: usize,
    jobs: ParallelJobs,
    /// Weight-gradient partial rows, one per chunk: float64 sums of float32 terms, and
    /// compensated float64 sums of float64 terms (`math::Accum::Wide`).
    partials_f32: WorkspacePool<f64>,
    partials_f64: WorkspacePool<Compensated>,
    /// As the forward's.
    offset: Option<f32>,
    offset_weights: OffsetWeights,
    /// Calls have a `dh` operand (see `BackwardAttrs::has_dh`).
    has_dh: bool,
    norm: Norm,
    /// Calls return the bias's gradient.
    has_bias: bool,
    /// As the forward's.
    split: Option<(Split, usize)>,
}

/// The weight rows a call with a scale offset applies, `offset + w` in the accumulation dtype
/// (`math::offset_weights`): one pool per accumulation dtype, made on the first such call with
/// that call's weight size (a call site's shapes never change), so that later calls allocate
/// nothing.
#[derive(Default)]
struct OffsetWeights {
    f32: OnceCell<WorkspacePool<f32>>,
    f64: OnceCell<WorkspacePool<f64>>,
}

/// Concurrent calls that can each hold an offset weight buffer without allocating.
const OFFSET_POOL_CAPACITY: usize = 64;

/// What the CPU bundles keep per accumulation dtype.
trait CpuAccum: Accum + CpuElement {
    fn offset_pool(pools: &OffsetWeights) -> &OnceCell<WorkspacePool<Self>>;
    fn partials(state: &BackwardState) -> &WorkspacePool<Self::Wide>;
}

impl CpuAccum for f32 {
    fn offset_pool(pools: &OffsetWeights) -> &OnceCell<WorkspacePool<f32>> {
        &pools.f32
    }
    fn partials(state: &BackwardState) -> &WorkspacePool<f64> {
        &state.partials_f32
    }
}

impl CpuAccum for f64 {
    fn offset_pool(pools: &OffsetWeights) -> &OnceCell<WorkspacePool<f64>> {
        &pools.f64
    }
    fn partials(state: &BackwardState) -> &WorkspacePool<Compensated> {
        &state.partials_f64
    }
}

/// The call's weight `w` (all its rows) in `A`, plus `offset` where there is one, in a buffer
/// of the pool: what the kernels read for a scale offset or a weight they are not built for.
fn weight_rows<'p, W: Element, A: CpuAccum>(
    pools: &'p OffsetWeights,
    w: &[W],
    offset: Option<f32>,
) -> FfiResult<xla_ffi_bundles::state::Workspace<'p, A>> {
    let pool =
        A::offset_pool(pools).get_or_init(|| WorkspacePool::new(w.len(), OFFSET_POOL_CAPACITY));
    if pool.len() != w.len() {
        return Err(FfiError::internal(format!(
            "a call site's weight changed size: {} elements, first {}",
            w.len(),
            pool.len()
        )));
    }
    let mut rows = pool.checkout();
    match offset {
        Some(offset) => offset_weights(w, <A as Accum>::from_f32(offset), &mut rows),
        // No `0 + w`: that would turn a weight of -0.0 into +0.0.
        None => rows.iter_mut().zip(w).for_each(|(o, &v)| *o = A::load(v)),
    }
    Ok(rows)
}

/// Runs `$body` with the Rust types of a contract pair as `T` (x), `W` (the weight), `K` (the
/// weight the kernels read) and `A` (the accumulation dtype): one arm per pair, exhaustive, so a
/// dtype added to the contract does not compile until it has a line here.
///
/// The kernels are built for a weight of the accumulation dtype (`K`), and of x's dtype for
/// bfloat16 (whose conversion is a shift): five (x, weight) instances, not sixteen. Any other
/// weight is converted to `A` once per call into a pooled row (`weight_rows`), as a scale
/// offset is: the values every kernel would take from `A::load` of each element, so the same
/// bits, for a pass over the weight's n elements. All sixteen in the kernels took 2.3x the
/// compile time of every build of this crate (the debug tests, the release extension,
/// AddressSanitizer's), about 25 minutes of `make test` on 2 cores. A float16 weight is
/// converted too: float16 rows run through float32's kernels (`widen`), where a float16 weight
/// read in integer conversions for every row took the float16 forward from 0.6 to 1.2 ms at
/// 8192x64 (AVX2).
macro_rules! with_pair_types {
    ($pair:expr, |$t:ident, $w:ident, $k:ident, $a:ident| $body:expr) => {{
        macro_rules! bind {
            ($x:ty, $wt:ty, $kt:ty, $acc:ty) => {{
                type $t = $x;
                type $w = $wt;
                type $k = $kt;
                type $a = $acc;
                $body
            }};
        }
        match ($pair.x, $pair.weight) {
            //                          x     weight  kernels' accumulation
            (Float::F32, Float::F32) => bind!(f32, f32, f32, f32),
            (Float::F32, Float::F64) => bind!(f32, f64, f32, f32),
            (Float::F32, Float::BF16) => bind!(f32, bf16, f32, f32),
            (Float::F32, Float::F16) => bind!(f32, f16, f32, f32),
            (Float::F64, Float::F64) => bind!(f64, f64, f64, f64),
            (Float::F64, Float::F32) => bind!(f64, f32, f64, f64),
            (Float::F64, Float::BF16) => bind!(f64, bf16, f64, f64),
            (Float::F64, Float::F16) => bind!(f64, f16, f64, f64),
            (Float::BF16, Float::BF16) => bind!(bf16, bf16, bf16, f32),
            (Float::BF16, Float::F32) => bind!(bf16, f32, f32, f32),
            (Float::BF16, Float::F64) => bind!(bf16, f64, f32, f32),
            (Float::BF16, Float::F16) => bind!(bf16, f16, f32, f32),
            (Float::F16, Float::F16) => bind!(f16, f16, f32, f32),
            (Float::F16, Float::F32) => bind!(f16, f32, f32, f32),
            (Float::F16, Float::F64) => bind!(f16, f64, f32, f32),
            (Float::F16, Float::BF16) => bind!(f16, bf16, f32, f32),
        }
    }};
}
xla_ffi_bundles::state_type!(BackwardState, "rmsnorm_ffi.RmsNormBackwardState");

pub struct Forward;
impl Bundle for Forward {
    const TARGET: &'static str = FORWARD_TARGET;
    type Platform = Host;
    type State = ForwardState;
}

impl ForwardState {
    fn new(target: &'static str, attrs: ForwardAttrs) -> FfiResult<ForwardState> {
        check_eps(attrs.eps)?;
        let offset = check_scale_offset(attrs.scale_offset)?;
        let (norm, has_bias) = check_norm(attrs.norm, attrs.has_bias)?;
        let row_len = check_row_len(attrs.row_len)?;
        let split = check_split(attrs.split, attrs.full_len, row_len, norm, false)?;
        if split.is_some() && target == RESIDUAL_TARGET {
            return Err(FfiError::invalid_argument(
                "attribute `split`: a split row's residual add is not fused (add first)",
            ));
        }
        Ok(ForwardState {
            split: attrs.split.zip(split),
            norm,
            has_bias,
            offset,
            offset_weights: OffsetWeights::default(),
            live: LiveState::register(target, "rmsnorm_ffi.RmsNormForwardState"),
            kernel: Kernel::detect(),
            eps: attrs.eps,
            has_weight: attrs.has_weight,
            row_len,
            jobs: ParallelJobs::new(),
        })
    }

    fn form(&self) -> ForwardForm {
        ForwardForm {
            norm: self.norm,
            has_weight: self.has_weight,
            has_bias: self.has_bias,
            row_len: self.row_len,
            split: self.split.map(|(s, _)| s),
        }
    }
}

impl Instantiate for Forward {
    type Attrs<'a> = ForwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: ForwardAttrs) -> FfiResult<ForwardState> {
        ForwardState::new(FORWARD_TARGET, attrs)
    }
}

/// The residual add fused with the forward: `h = x + residual` (rounded to x's dtype, as
/// XLA rounds `x + residual`), then the forward of `h`, chunk by chunk, so x and the residual
/// are read from memory once and `h` is read back from cache. Same state and attributes as
/// [`Forward`].
pub struct ResidualForward;
impl Bundle for ResidualForward {
    const TARGET: &'static str = RESIDUAL_TARGET;
    type Platform = Host;
    type State = ForwardState;
}

impl Instantiate for ResidualForward {
    type Attrs<'a> = ForwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: ForwardAttrs) -> FfiResult<ForwardState> {
        ForwardState::new(RESIDUAL_TARGET, attrs)
    }
}

pub struct Backward;
impl Bundle for Backward {
    const TARGET: &'static str = BACKWARD_TARGET;
    type Platform = Host;
    type State = BackwardState;
}

impl Instantiate for Backward {
    type Attrs<'a> = BackwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: BackwardAttrs) -> FfiResult<BackwardState> {
        let row_len = check_row_len(attrs.row_len)?;
        if let Some(eps) = attrs.eps {
            check_eps(eps)?;
        }
        let offset = check_scale_offset(attrs.scale_offset)?;
        let (norm, has_bias) = check_norm(attrs.norm, attrs.has_bias)?;
        let split = check_split(attrs.split, attrs.full_len, row_len, norm, true)?;
        if split.is_some() && norm.centred() && attrs.eps.is_some() {
            return Err(FfiError::invalid_argument(
                "attribute `eps`: a split LayerNorm backward is given the forward's mean and rstd",
            ));
        }
        let partial_len = if attrs.has_weight || has_bias {
            partial_rows(row_len) * row_len * gradient_rows(norm)
        } else {
            0
        };
        Ok(BackwardState {
            live: LiveState::register(BACKWARD_TARGET, "rmsnorm_ffi.RmsNormBackwardState"),
            kernel: Kernel::detect(),
            eps: attrs.eps,
            has_weight: attrs.has_weight,
            row_len,
            jobs: ParallelJobs::new(),
            partials_f32: WorkspacePool::new(partial_len, 64),
            partials_f64: WorkspacePool::new(partial_len, 64),
            offset,
            offset_weights: OffsetWeights::default(),
            has_dh: attrs.has_dh == Some(true),
            norm,
            has_bias,
            split: attrs.split.zip(split),
        })
    }
}

/// Gradient sums a backward keeps per weight element: the weight's, and LayerNorm's bias's
/// after it (kept whether or not the call returns both: see `math::layer::backward_row`).
fn gradient_rows(norm: Norm) -> usize {
    if norm.centred() {
        2
    } else {
        1
    }
}

/// One accumulator row of `n` per chunk, from the start of `scratch`.
fn per_chunk_rows<A>(
    scratch: &mut [A],
    chunks: usize,
    n: usize,
) -> FfiResult<DisjointChunks<'_, A>> {
    let bounds: [usize; MAX_CHUNKS + 1] = std::array::from_fn(|c| c.min(chunks) * n);
    let len = chunks * n;
    if scratch.len() < len {
        return Err(FfiError::internal(format!(
            "workspace of {} for {chunks} rows of {n}",
            scratch.len()
        )));
    }
    DisjointChunks::new(&mut scratch[..len], &bounds[..chunks + 1])
}

/// Caps the threads a call uses (`RMSNORM_FFI_NUM_THREADS`, read once); unset: XLA's pool size.
static THREAD_CAP: once_cell::sync::Lazy<Option<usize>> = once_cell::sync::Lazy::new(|| {
    std::env::var("RMSNORM_FFI_NUM_THREADS")
        .ok()?
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
});

/// Bytes a call reads and writes up to which it runs on the calling thread alone. Such a call's
/// operands are usually in the calling core's L2 (the op before it just wrote them there), and
/// chunks handed to another core pull them across: through XLA, in a loop of forward and
/// backward like a training step (float32, 2 cores with 2 MiB of L2 each, 3 runs each), one
/// thread against two took 37-38 us against 46-49 for the forward of 1408x64 (0.7 MiB),
/// 127-131 against 149-156 at 4096x64 (2 MiB), but 417-433 against 223-231 at 8192x64 (4 MiB);
/// forward and backward of 4096x64 (the backward moves 3 MiB) 501-557 against 451-459.
/// Chunks still follow the shape's plan, so the results are the same bits either way.
pub const INLINE_BYTES: usize = 2 << 20;

/// A call's work in the bytes [`INLINE_BYTES`] was measured in (the float32 RMS norm's): `arrays`
/// arrays of x's `elements`, each element counted at least as a float32 one, and LayerNorm's
/// forward twice the RMS norm's. A half-precision element costs about what a float32 one does
/// (its conversions take the place of the bytes it saves), and LayerNorm's forward about twice
/// the RMS norm's (a second pass over the row and a bias): `bench/kernel_rows.rs`, 8192x64, one
/// thread, AVX-512, forward 17.8 / 20.3 / 17.3 ns per row (float32, bfloat16, float16),
/// LayerNorm's 41.5 / 50.5 / 48.7. Counted in bytes, a half-precision or LayerNorm call ran on
/// one thread where its float32 RMS twin ran on two (LayerNorm's bfloat16 forward at 8192x64:
/// 1.43x Flax's time).
fn work_bytes<T>(elements: usize, arrays: usize, layer: bool) -> usize {
    elements * std::mem::size_of::<T>().max(4) * arrays * if layer { 2 } else { 1 }
}

/// Threads a call that moves `bytes` may use: XLA's intra-op pool size (the calling thread is
/// one of them), or 1 up to [`INLINE_BYTES`].
fn workers(ctx: &Context<'_>, bytes: usize) -> usize {
    if bytes <= INLINE_BYTES {
        return 1;
    }
    let pool = ctx
        .num_threads()
        .map(|n| n.clamp(1, 256) as usize)
        .unwrap_or(1);
    THREAD_CAP.map_or(pool, |cap| pool.min(cap))
}

impl Execute for Forward {
    type Args<'a> = ArgsView<'a>;
    type Rets<'a> = ResultList<'a>;
    type Attrs<'a> = ();

    fn execute(
        state: &ForwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_>,
        mut rets: ResultList<'_>,
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        if let Some((split @ (Split::Sums | Split::CentredSums), _)) = state.split {
            return split::forward_sums(state, ctx, &args, &mut rets, split);
        }
        let ops = forward_operands(&args, &mut rets, state.form())?;
        forward_dispatch(state, ctx, ops, None)
    }
}

impl Execute for ResidualForward {
    type Args<'a> = ArgsView<'a>;
    type Rets<'a> = ResultList<'a>;
    type Attrs<'a> = ();

    fn execute(
        state: &ForwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_>,
        mut rets: ResultList<'_>,
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        let ResidualOperands {
            forward,
            residual,
            h,
        } = residual_operands(&args, &mut rets, state.form())?;
        forward_dispatch(state, ctx, forward, Some((residual, h)))
    }
}

/// The residual operand and the `h` result of a fused call.
type Residual<'a, 'r> = Option<(AnyBuffer<'a>, AnyResult<'r>)>;

fn forward_dispatch(
    state: &ForwardState,
    ctx: &Context<'_>,
    ops: ForwardOperands<'_, '_, Host>,
    res: Residual<'_, '_>,
) -> FfiResult<()> {
    let ForwardOperands {
        x,
        w,
        b,
        y,
        mean,
        rstd,
        pair,
        layout,
        split,
    } = ops;
    let call = ForwardCall { state, ctx, layout };
    let out = ForwardOut { y, mean, rstd };
    with_pair_types!(pair, |T, W, K, A| call.typed::<T, W, K, A>(
        x,
        (w, b),
        out,
        res,
        split.as_ref()
    ))
}

/// The forward pass over one chunk's `rstd.len()` consecutive rows of `n`, in the loops that
/// are fastest for this instruction set and these types (all bit-identical). Runs inside
/// `kernel.run`.
#[inline(always)]
pub fn forward_chunk<'w, T: CpuElement, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    eps: A,
    y: &mut [T],
    rstd: &mut [A],
) {
    #[cfg(target_arch = "x86_64")]
    if let Kernel::Avx512(v4) = kernel {
        if avx512::forward_rows::<T, W, A>(v4, x, n, w_of, eps, y, rstd) {
            return;
        }
    }
    // float16 through float32's loops where F16C converts it (bit-identical: `widen`).
    if T::forward_widened::<W, A>(kernel, x, n, w_of, eps, y, rstd) {
        return;
    }
    // Narrow rows in batches whose totals run side by side, the rest as below (all
    // bit-identical).
    let done = if narrow(n) {
        forward_narrow::<T, W, A>(x, n, w_of, eps, y, rstd)
    } else {
        0
    };
    let (x, y, rstd) = (&x[done * n..], &mut y[done * n..], &mut rstd[done..]);
    let w_of = move |i: usize| w_of(done + i);
    if std::mem::size_of::<T>() == 2 {
        // Half precision is bound by conversions, not memory: overlapping the next row's sum
        // with this row's write pays (bit-identical results).
        forward_rows::<T, W, A>(x, n, w_of, eps, y, rstd);
    } else {
        for (i, ((y_row, r), x_row)) in y
            .chunks_exact_mut(n)
            .zip(rstd.iter_mut())
            .zip(x.chunks_exact(n))
            .enumerate()
        {
            *r = forward_row::<T, W, A>(x_row, w_of(i), eps, y_row);
        }
    }
}

/// LayerNorm's forward over one chunk's consecutive rows of `n` (`layer::forward_rows`): on
/// AVX-512 rows of whole vectors in explicit loops (`avx512::layer_forward_rows`), elsewhere
/// float16 through float32's loops where F16C converts it (`widen`); all bit-identical. Runs
/// inside `kernel.run`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn layer_forward_chunk<'w, T: CpuElement, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    b_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    eps: A,
    split: Option<SplitRows<'_, A>>,
    y: &mut [T],
    mean: Option<&mut [A]>,
    rstd: &mut [A],
) {
    match (split, mean) {
        (None, Some(mean)) => {
            #[cfg(target_arch = "x86_64")]
            if let Kernel::Avx512(v4) = kernel {
                if avx512::layer_forward_rows::<T, W, A>(v4, x, n, w_of, b_of, eps, y, mean, rstd) {
                    return;
                }
            }
            if !T::layer_forward_widened::<W, A>(kernel, x, n, w_of, b_of, eps, y, mean, rstd) {
                layer::forward_rows::<T, W, A>(x, n, w_of, b_of, eps, None, y, Some(mean), rstd)
            }
        }
        (split, mean) => {
            layer::forward_rows::<T, W, A>(x, n, w_of, b_of, eps, split, y, mean, rstd)
        }
    }
}

/// The backward pass over one chunk's consecutive rows of `n` that share the weight row `w`,
/// adding their weight-gradient terms into `acc`: two rows per loop (see `math`), in the loops
/// that are fastest for this instruction set and these types (all bit-identical). Runs inside
/// `kernel.run`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn backward_chunk<T: Element, W: Element, A: Accum>(
    kernel: Kernel,
    x: &[T],
    dy: &[T],
    n: usize,
    w: &[W],
    rstd: Rstd<'_, A>,
    dx: &mut [T],
    acc: &mut [A::Wide],
) {
    #[cfg(target_arch = "x86_64")]
    if let Kernel::Avx512(v4) = kernel {
        if avx512::backward_rows::<T, W, A>(v4, x, dy, (None, true), n, w, rstd, dx, acc) {
            return;
        }
    }
    // Narrow rows in batches whose totals run side by side, the rest in pairs (all
    // bit-identical: a batch pairs its rows as the pairs below do).
    let done = if narrow(n) {
        backward_narrow::<T, W, A>(x, dy, n, w, rstd, dx, acc)
    } else {
        0
    };
    let (x, dy, dx) = (&x[done * n..], &dy[done * n..], &mut dx[done * n..]);
    backward_rows_paired::<T, W, A>(x, dy, n, w, rstd.from_row(done), dx, acc)
}

/// A forward's statistics results: LayerNorm's mean (`None` for the RMS norm) and rstd; and a
/// split row's sums, from which they come.
struct Stats<'a, A> {
    mean: Option<&'a mut [A]>,
    rstd: &'a mut [A],
    split: Option<SplitRows<'a, A>>,
}

struct ForwardCall<'s, 'c, 'a> {
    state: &'s ForwardState,
    ctx: &'c Context<'a>,
    layout: Layout,
}

/// The results of a forward call: y and the statistics.
struct ForwardOut<'r> {
    y: AnyResult<'r>,
    mean: Option<AnyResult<'r>>,
    rstd: AnyResult<'r>,
}

impl ForwardCall<'_, '_, '_> {
    /// The call's buffers as slices of its pair's types; with a scale offset, or a weight the
    /// kernels are not built for (`K` is not `W`), the weight converted to `offset + w` or `w`
    /// in `A` first (the kernels then read it as an `A` weight). LayerNorm's weight and bias
    /// are always converted (its loops are built for `A` weights only).
    fn typed<T: CpuElement, W: Element, K: Element, A: CpuAccum>(
        &self,
        x: AnyBuffer<'_>,
        (w, b): (Option<AnyBuffer<'_>>, Option<AnyBuffer<'_>>),
        out: ForwardOut<'_>,
        res: Residual<'_, '_>,
        split: Option<&SplitInputs<'_, Host>>,
    ) -> FfiResult<()> {
        let x = x.as_slice::<T>()?;
        let y = out.y.into_mut_slice::<T>()?;
        let rstd = out.rstd.into_mut_slice::<A>()?;
        let mean = out.mean.map(|m| m.into_mut_slice::<A>()).transpose()?;
        let res = match res {
            Some((r, h)) => Some((r.as_slice::<T>()?, h.into_mut_slice::<T>()?)),
            None => None,
        };
        let offset = self.state.offset;
        let pools = &self.state.offset_weights;
        let split = match (split, self.state.split) {
            (Some(inputs), Some((_, full_len))) => Some(SplitRows {
                mean: inputs
                    .mean
                    .as_ref()
                    .map(|m| m.as_slice::<A>())
                    .transpose()?,
                rstd: None,
                sums: inputs.sums.as_slice::<A>()?,
                k: inputs.k,
                full_len,
                eps: <A as Accum>::from_f32(self.state.eps),
            }),
            _ => None,
        };
        if mean.is_some() || split.is_some() {
            // LayerNorm's loops, and a split row's of either norm.
            let w = w
                .map(|w| weight_rows::<W, A>(pools, w.as_slice::<W>()?, offset))
                .transpose()?;
            let b = b
                .map(|b| weight_rows::<W, A>(pools, b.as_slice::<W>()?, None))
                .transpose()?;
            let stats = Stats { mean, rstd, split };
            return self.run::<T, A, A>(x, (w.as_deref(), b.as_deref()), y, stats, res);
        }
        let stats = Stats {
            mean: None,
            rstd,
            split: None,
        };
        match w {
            Some(w) if offset.is_some() || !same_type::<W, K>() => {
                let w = w.as_slice::<W>()?;
                let rows = weight_rows::<W, A>(pools, w, offset)?;
                self.run::<T, A, A>(x, (Some(&rows), None), y, stats, res)
            }
            // No weight, or one of K's dtype.
            w => {
                let w = w.map(|w| w.as_slice::<K>()).transpose()?;
                self.run::<T, K, A>(x, (w, None), y, stats, res)
            }
        }
    }

    fn run<T: CpuElement, W: Element, A: CpuAccum>(
        &self,
        x: &[T],
        (w, b): (Option<&[W]>, Option<&[W]>),
        y: &mut [T],
        Stats { mean, rstd, split }: Stats<'_, A>,
        res: Option<(&[T], &mut [T])>,
    ) -> FfiResult<()> {
        let Layout { rows, n, .. } = self.layout;
        if n == 0 {
            rstd.fill(A::NAN);
            if let Some(mean) = mean {
                mean.fill(A::NAN);
            }
            return Ok(());
        }
        // x read and y written, and with a residual, the residual read and h written.
        let arrays = if res.is_some() { 4 } else { 2 };
        let bytes = work_bytes::<T>(x.len(), arrays, mean.is_some());
        let plan = Plan::split(rows, n, FORWARD_CHUNK_ELEMENTS, MAX_CHUNKS);
        let element_bounds = &plan.scaled(n)[..plan.count() + 1];
        let y_chunks = DisjointChunks::new(y, element_bounds)?;
        let rstd_chunks = DisjointChunks::new(rstd, plan.bounds())?;
        let mean_chunks = mean
            .map(|m| DisjointChunks::new(m, plan.bounds()))
            .transpose()?;
        let (residual, h_chunks) = match res {
            Some((r, h)) => (Some(r), Some(DisjointChunks::new(h, element_bounds)?)),
            None => (None, None),
        };
        let eps = <A as Accum>::from_f32(self.state.eps);
        let per_group = self.layout.rows_per_group().max(1);
        let kernel = self.state.kernel;
        let body = |c: usize| {
            let (Some(y), Some(rstd)) = (y_chunks.take(c), rstd_chunks.take(c)) else {
                return;
            };
            let mean = match &mean_chunks {
                Some(chunks) => match chunks.take(c) {
                    Some(mean) => Some(mean),
                    None => return,
                },
                None => None,
            };
            let first = plan.start(c);
            let split = split.map(|s| s.from_row(first));
            let span = first * n..(first + rstd.len()) * n;
            // The fused residual add writes this chunk's h, which the norm then reads (from
            // cache) in place of x.
            let h = match (residual, h_chunks.as_ref()) {
                (Some(r), Some(h_chunks)) => match h_chunks.take(c) {
                    Some(h) => Some((&r[span.clone()], h)),
                    None => return,
                },
                _ => None,
            };
            kernel.run(
                #[inline(always)]
                || {
                    let x_rows: &[T] = match h {
                        Some((r, h)) => {
                            // float16 widened where F16C converts it (`widen`), the same bits.
                            if !T::add_widened::<A>(kernel, &x[span.clone()], r, h) {
                                add_into::<T, A>(&x[span.clone()], r, h);
                            }
                            h
                        }
                        None => &x[span.clone()],
                    };
                    let row =
                        |i: usize| ((first + i) / per_group) * n..((first + i) / per_group + 1) * n;
                    let w_of = |i: usize| w.map(|w| &w[row(i)]);
                    if mean.is_some() || split.is_some() {
                        let b_of = |i: usize| b.map(|b| &b[row(i)]);
                        layer_forward_chunk::<T, W, A>(
                            kernel, x_rows, n, w_of, b_of, eps, split, y, mean, rstd,
                        )
                    } else {
                        forward_chunk::<T, W, A>(kernel, x_rows, n, w_of, eps, y, rstd)
                    }
                },
            )
        };
        self.state
            .jobs
            .run(self.ctx, plan.count(), workers(self.ctx, bytes), &body)
    }
}

impl Execute for Backward {
    type Args<'a> = ArgsView<'a>;
    type Rets<'a> = ResultList<'a>;
    type Attrs<'a> = ();

    fn execute(
        state: &BackwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_>,
        mut rets: ResultList<'_>,
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        let form = BackwardForm {
            norm: state.norm,
            has_bias: state.has_bias,
            has_weight: state.has_weight,
            has_rstd: state.eps.is_none(),
            has_dh: state.has_dh,
            row_len: state.row_len,
            split: state.split.map(|(s, _)| s),
        };
        if form.split == Some(Split::Sums) {
            return split::backward_sums(state, ctx, &args, &mut rets, form);
        }
        let ops = backward_operands(&args, &mut rets, form)?;
        let call = BackwardCall {
            state,
            ctx,
            layout: ops.layout,
        };
        let pair: DtypePair = ops.pair;
        with_pair_types!(pair, |T, W, K, A| call.typed::<T, W, K, A>(ops))
    }
}

/// Whether `T` and `U` are one type: x's dtype and its accumulation dtype (float32, float64:
/// the kernels' dx is then the unrounded gradient), a weight's and the kernels' weight.
fn same_type<T: 'static, U: 'static>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>()
}

/// The read-only operands of a backward call, sliced row range by row range.
#[derive(Clone, Copy)]
struct BackwardInputs<'a, T, W, A> {
    x: &'a [T],
    dy: &'a [T],
    /// Given (an operand), or taken from x by the first pass (`math::Rstd`).
    rstd: Rstd<'a, A>,
    w: Option<&'a [W]>,
    /// The gradient added to dx before it is rounded (the fused residual's backward).
    dh: Option<&'a [T]>,
    n: usize,
    rows_per_group: usize,
    kernel: Kernel,
    /// LayerNorm's statistics (`None` for the RMS norm): then the rows run through
    /// `math::layer`, and a gradient accumulator row holds the weight's sums and the bias's.
    moments: Option<Moments<'a, A>>,
}

/// The longest rows a half-precision backward widens (see [`BackwardInputs::widened`]: two
/// rows at a time at least, on the stack, three arrays in the accumulation dtype: 48 KB for
/// float32); longer ones run as they are.
use widen::WIDE_BLOCK;

impl<T: CpuElement, W: Element, A: CpuAccum> BackwardInputs<'_, T, W, A> {
    /// Rows `first..` (as many as `dx_rows` holds) on `kernel`, with dh added to dx where the
    /// call has it, rounded once.
    #[inline(always)]
    fn run_rows(
        &self,
        kernel: Kernel,
        first: usize,
        dx_rows: &mut [T],
        mut acc: Option<&mut [A::Wide]>,
    ) {
        // The RMS norm's rows with dh on AVX-512: its explicit loops add dh themselves, before
        // dx's one rounding (widened instead, a bfloat16 16384x128 fused residual gradient took
        // 1.3x the time of the backward and a separate add).
        if self.dh.is_some()
            && self.moments.is_none()
            && kernel.run(
                #[inline(always)]
                || self.explicit_adding(kernel, first, dx_rows, acc.as_deref_mut()),
            )
        {
            return;
        }
        // float16 rows longer than a widened block, a piece at a time (`widen`).
        if self.n > WIDE_BLOCK {
            let n = self.n;
            let span = first * n..first * n + dx_rows.len();
            let w_of = |i: usize| {
                self.w
                    .map(|w| &w[((first + i) / self.rows_per_group) * n..][..n])
            };
            let inputs = (
                &self.x[span.clone()],
                &self.dy[span.clone()],
                self.dh.map(|dh| &dh[span]),
            );
            let rstd = self.rstd.from_row(first);
            let acc = acc.as_deref_mut();
            let widened = match self.moments {
                Some(moments) => {
                    let moments = moments.from_row(first);
                    T::layer_backward_long_widened(kernel, inputs, n, w_of, moments, dx_rows, acc)
                }
                None => T::backward_long_widened(kernel, inputs, n, w_of, rstd, dx_rows, acc),
            };
            if widened {
                return;
            }
        }
        // float16 through float32's loops where F16C converts it (`widen`), but the RMS
        // norm's on AVX-512, whose explicit loops convert it themselves; split rows as they are.
        let f16c = T::backward_widens(kernel, self.n)
            && match self.moments {
                Some(moments) => !matches!(moments, Moments::Split(_)),
                None => !kernel.has_avx512(),
            };
        if let Some(moments) = self.moments {
            if f16c {
                return self.widened(kernel, first, dx_rows, acc);
            }
            return kernel.run(
                #[inline(always)]
                || self.layer_rows(moments, first, dx_rows, acc),
            );
        }
        match self.dh {
            Some(_) if !same_type::<T, A>() && self.n <= WIDE_BLOCK => {
                self.widened(kernel, first, dx_rows, acc)
            }
            None if f16c => self.widened(kernel, first, dx_rows, acc),
            _ => kernel.run(
                #[inline(always)]
                || self.rows_from(first, dx_rows, acc),
            ),
        }
    }

    /// Blocks of rows widened to `A` on the stack and run through the kernels of an `A` x
    /// (whose dx is the unrounded norm gradient), then dx = round(that + dh), one rounding:
    /// half precision with dh (row by row, `math::backward_row_adding`, took 1.4-1.6x the time
    /// of the plain backward and a separate add at rows of 64-128), and float16 where F16C
    /// converts it (`widen`). The `A` kernels run in their own frame (`run_rows` of `A`, the
    /// instance an `A` x uses): inlined beside this x's they would double an unoptimized
    /// build's frame, past a test thread's 2 MiB stack.
    #[inline(never)]
    fn widened(
        &self,
        kernel: Kernel,
        first: usize,
        dx_rows: &mut [T],
        mut acc: Option<&mut [A::Wide]>,
    ) {
        let n = self.n;
        if n == 0 {
            return;
        }
        // Blocks of an even number of rows (two at least): the kernels take rows in pairs whose
        // weight-gradient terms are summed before they join the accumulator, so a block must
        // not cut a pair.
        let per_block = (2 * WIDE_BLOCK / n) & !1;
        let mut x = [A::ZERO; 2 * WIDE_BLOCK];
        let mut dy = [A::ZERO; 2 * WIDE_BLOCK];
        let mut dx = [A::ZERO; 2 * WIDE_BLOCK];
        let count = dx_rows.len() / n;
        let mut done = 0;
        while done < count {
            let row = first + done;
            // A block stays within one weight row's group.
            let in_group = self.rows_per_group - row % self.rows_per_group;
            let rows = per_block.min(count - done).min(in_group);
            let (len, span) = (rows * n, row * n..(row + rows) * n);
            // The conversions in `kernel.run` too, where they vectorize (outside it, scalar
            // conversions were 14% of a bfloat16 16384x128 backward's profile).
            kernel.run(
                #[inline(always)]
                || {
                    widen::load_slice(kernel, &self.x[span.clone()], &mut x[..len]);
                    widen::load_slice(kernel, &self.dy[span.clone()], &mut dy[..len]);
                },
            );
            let group = row / self.rows_per_group;
            let wide = BackwardInputs::<A, W, A> {
                x: &x[..len],
                dy: &dy[..len],
                rstd: self.rstd.from_row(row),
                w: self.w.map(|w| &w[group * n..][..n]),
                dh: None,
                n,
                rows_per_group: rows,
                kernel: self.kernel,
                moments: self.moments.map(|m| m.from_row(row)),
            };
            wide.run_rows(kernel, 0, &mut dx[..len], acc.as_deref_mut());
            let out = &mut dx_rows[done * n..][..len];
            kernel.run(
                #[inline(always)]
                || {
                    if let Some(dh) = self.dh {
                        // dy's block is free now: dh widened into it, added before the one
                        // rounding.
                        widen::load_slice(kernel, &dh[span], &mut dy[..len]);
                        for (g, &h) in dx[..len].iter_mut().zip(&dy[..len]) {
                            *g = *g + h;
                        }
                    }
                    widen::store_slice(kernel, &dx[..len], out);
                },
            );
            done += rows;
        }
    }

    /// The RMS norm's rows `first..` (as many as `dx_rows` holds) in the explicit AVX-512 loops
    /// (`avx512::backward_rows`), dh added before dx's one rounding; false, having written
    /// nothing, where those loops do not apply: another instruction set, no dh, no weight or no
    /// gradient sums, rows of two weight groups, types they are not built for. Runs inside
    /// `kernel.run`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn explicit_adding(
        &self,
        kernel: Kernel,
        first: usize,
        dx_rows: &mut [T],
        acc: Option<&mut [A::Wide]>,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let (Kernel::Avx512(v4), Some(dh), Some(acc)) = (kernel, self.dh, acc) {
            let n = self.n.max(1);
            let count = dx_rows.len() / n;
            if let Some(w) = self.shared_weight(first, count) {
                let span = first * self.n..(first + count) * self.n;
                let (x, dy, dh) = (&self.x[span.clone()], &self.dy[span.clone()], &dh[span]);
                let rstd = self.rstd.from_row(first);
                // The weight-gradient terms in the order of the paths elsewhere: in pairs as
                // the float32 kernels add them (half precision widened up to a block), each
                // row's alone where half precision's longer rows go row by row (`rows_from`,
                // `widen`).
                let paired = self.n <= WIDE_BLOCK || same_type::<T, A>();
                return avx512::backward_rows::<T, W, A>(
                    v4,
                    x,
                    dy,
                    (Some(dh), paired),
                    self.n,
                    w,
                    rstd,
                    dx_rows,
                    acc,
                );
            }
        }
        false
    }

    /// The weight row of rows `first..first + count`, where the call has a weight and they
    /// share one row of it (one group).
    #[inline(always)]
    fn shared_weight(&self, first: usize, count: usize) -> Option<&[W]> {
        let group = |i: usize| i / self.rows_per_group;
        let one_group = count == 0 || group(first) == group(first + count - 1);
        let w = self.w?;
        one_group.then(|| &w[group(first) * self.n..][..self.n])
    }

    /// LayerNorm's rows `first..` (as many as `dx_rows` holds), dh added before dx is rounded.
    #[inline(always)]
    fn layer_rows(
        &self,
        moments: Moments<'_, A>,
        first: usize,
        dx_rows: &mut [T],
        acc: Option<&mut [A::Wide]>,
    ) {
        let n = self.n;
        if n == 0 {
            return;
        }
        let span = first * n..(first + dx_rows.len() / n) * n;
        let w_of = |i: usize| {
            self.w
                .map(|w| &w[((first + i) / self.rows_per_group) * n..][..n])
        };
        layer::backward_rows::<T, W, A>(
            &self.x[span.clone()],
            &self.dy[span.clone()],
            self.dh.map(|dh| &dh[span]),
            n,
            w_of,
            moments.from_row(first),
            dx_rows,
            acc,
        );
    }

    /// Rows `first..` (as many as `dx_rows` holds), with dh added to dx where the call has it.
    #[inline(always)]
    fn rows_from(&self, first: usize, dx_rows: &mut [T], mut acc: Option<&mut [A::Wide]>) {
        let n = self.n;
        if n == 0 {
            return;
        }
        let count = dx_rows.len() / n;
        let span = first * n..(first + count) * n;
        let rstd = self.rstd.from_row(first);
        let w_of = |i: usize| {
            self.w
                .map(|w| &w[((first + i) / self.rows_per_group) * n..][..n])
        };
        // x in the accumulation dtype: the kernels' dx is the unrounded norm gradient itself,
        // so adding dh to it afterwards (from cache) rounds once, the bits of
        // `math::backward_row_adding` at the kernels' speed. (The kernels are inlined here
        // once: twice made the debug build's frame overflow a test thread's stack.)
        match self.dh {
            Some(dh) if !same_type::<T, A>() => {
                // Half precision, rows longer than WIDE_BLOCK (`run_rows` widens shorter
                // ones, and float16's longer ones where F16C converts it): row by row, dx
                // rounded once after dh is added.
                for (i, dx) in dx_rows.chunks_exact_mut(n).enumerate() {
                    let row = (first + i) * n..(first + i + 1) * n;
                    backward_row_adding::<T, W, A>(
                        &self.x[row.clone()],
                        w_of(i),
                        rstd.from_row(i),
                        &self.dy[row.clone()],
                        &dh[row],
                        dx,
                        acc.as_deref_mut(),
                    );
                }
            }
            dh => {
                self.kernel_rows(first, dx_rows, acc);
                if let Some(dh) = dh {
                    for (o, &h) in dx_rows.iter_mut().zip(&dh[span]) {
                        *o = (A::load(*o) + A::load(h)).store();
                    }
                }
            }
        }
    }

    /// [`Self::rows_from`] without dh: two rows per loop when they share one weight row and
    /// accumulate its gradient (`math::backward_rows_paired`), else row by row.
    #[inline(always)]
    fn kernel_rows(&self, first: usize, dx_rows: &mut [T], acc: Option<&mut [A::Wide]>) {
        let n = self.n;
        let count = dx_rows.len() / n;
        let span = first * n..(first + count) * n;
        let rstd = self.rstd.from_row(first);
        let w_of = |i: usize| {
            self.w
                .map(|w| &w[((first + i) / self.rows_per_group) * n..][..n])
        };
        let mut acc = acc;
        if let (Some(w), Some(acc)) = (self.shared_weight(first, count), acc.as_deref_mut()) {
            let (x, dy) = (&self.x[span.clone()], &self.dy[span]);
            return backward_chunk::<T, W, A>(self.kernel, x, dy, n, w, rstd, dx_rows, acc);
        }
        backward_rows::<T, W, A>(
            &self.x[span.clone()],
            &self.dy[span],
            n,
            w_of,
            rstd,
            dx_rows,
            acc,
        );
    }
}

struct BackwardCall<'s, 'c, 'a> {
    state: &'s BackwardState,
    ctx: &'c Context<'a>,
    layout: Layout,
}

/// The typed operands of a backward call: the weight read as `W`, its gradient written as `D`
/// (the same type, but where the weight was converted: `offset + w` or `w` in `A`, for a scale
/// offset or a weight the kernels are not built for).
struct BackwardSlices<'a, T, W, A, D> {
    x: &'a [T],
    w: Option<&'a [W]>,
    rstd: Rstd<'a, A>,
    dy: &'a [T],
    dh: Option<&'a [T]>,
    dx: &'a mut [T],
    dw: Option<&'a mut [D]>,
    /// LayerNorm's: its statistics, and the bias's gradient where the call returns it.
    moments: Option<Moments<'a, A>>,
    db: Option<&'a mut [D]>,
}

impl<'a, T, W, A, D> BackwardSlices<'a, T, W, A, D> {
    fn new(
        x: &'a [T],
        w: Option<&'a [W]>,
        rstd: Rstd<'a, A>,
        dy: &'a [T],
        dh: Option<&'a [T]>,
        dx: &'a mut [T],
        dw: Option<&'a mut [D]>,
    ) -> Self {
        BackwardSlices {
            x,
            w,
            rstd,
            dy,
            dh,
            dx,
            dw,
            moments: None,
            db: None,
        }
    }
}

impl BackwardCall<'_, '_, '_> {
    /// The call's buffers as slices of its pair's types, the weight converted to
    /// `offset + w` or `w` in `A` for a scale offset or a weight the kernels are not built for
    /// (as the forward's); the gradient is still `w`'s, in `W`.
    fn typed<T: CpuElement, W: Element, K: Element, A: CpuAccum>(
        &self,
        ops: BackwardOperands<'_, '_, Host>,
    ) -> FfiResult<()> {
        let rstd = match (&ops.rstd, self.state.eps) {
            (Some(rstd), _) => Rstd::Given(rstd.as_slice::<A>()?),
            (None, Some(eps)) => Rstd::FromX(<A as Accum>::from_f32(eps)),
            (None, None) => return Err(FfiError::internal("a backward with neither rstd nor eps")),
        };
        let x = ops.x.as_slice::<T>()?;
        let dy = ops.dy.as_slice::<T>()?;
        let dh = ops.dh.map(|dh| dh.as_slice::<T>()).transpose()?;
        let dx = ops.dx.into_mut_slice::<T>()?;
        let partials = A::partials(self.state);
        let offset = self.state.offset;
        if let (Some(inputs), Some((_, full_len))) = (&ops.split, self.state.split) {
            // A split row's apply pass, both norms through LayerNorm's loops (see
            // `layer::SplitRows`): the weight in `A`, the gradients this device's rows' sums
            // in `A` too (the caller all-reduces them before they are rounded).
            let split = SplitRows {
                mean: ops.mean.map(|m| m.as_slice::<A>()).transpose()?,
                rstd: match rstd {
                    Rstd::Given(r) => Some(r),
                    Rstd::FromX(_) => None,
                },
                sums: inputs.sums.as_slice::<A>()?,
                k: inputs.k,
                full_len,
                eps: <A as Accum>::from_f32(self.state.eps.unwrap_or(0.0)),
            };
            let pools = &self.state.offset_weights;
            let w = ops
                .w
                .map(|w| weight_rows::<W, A>(pools, w.as_slice::<W>()?, offset))
                .transpose()?;
            let dw = ops.dw.map(|dw| dw.into_mut_slice::<A>()).transpose()?;
            let mut slices = BackwardSlices::new(x, w.as_deref(), rstd, dy, dh, dx, dw);
            slices.moments = Some(Moments::Split(split));
            slices.db = ops.db.map(|db| db.into_mut_slice::<A>()).transpose()?;
            return self.run::<T, A, A, A>(slices, partials);
        }
        if self.state.norm.centred() {
            // LayerNorm: the weight always in `A` (its loops are built for `A` weights only),
            // the gradients in the weight's dtype (or the bias's, without a weight).
            let moments = match (ops.mean, rstd) {
                (Some(mean), Rstd::Given(rstd)) => Moments::Given {
                    mean: mean.as_slice::<A>()?,
                    rstd,
                },
                (None, Rstd::FromX(eps)) => Moments::FromX(eps),
                _ => return Err(FfiError::internal("a LayerNorm backward given rstd alone")),
            };
            let pools = &self.state.offset_weights;
            let w = ops
                .w
                .map(|w| weight_rows::<W, A>(pools, w.as_slice::<W>()?, offset))
                .transpose()?;
            let dw = ops.dw.map(|dw| dw.into_mut_slice::<W>()).transpose()?;
            let mut slices = BackwardSlices::new(x, w.as_deref(), rstd, dy, dh, dx, dw);
            slices.moments = Some(moments);
            slices.db = ops.db.map(|db| db.into_mut_slice::<W>()).transpose()?;
            return self.run::<T, A, A, W>(slices, partials);
        }
        match ops.w {
            Some(w) if offset.is_some() || !same_type::<W, K>() => {
                let w = w.as_slice::<W>()?;
                let rows = weight_rows::<W, A>(&self.state.offset_weights, w, offset)?;
                let dw = ops.dw.map(|dw| dw.into_mut_slice::<W>()).transpose()?;
                let slices = BackwardSlices::new(x, Some(&rows[..]), rstd, dy, dh, dx, dw);
                self.run::<T, A, A, W>(slices, partials)
            }
            // No weight, or one of K's dtype (its gradient too).
            w => {
                let w = w.map(|w| w.as_slice::<K>()).transpose()?;
                let dw = ops.dw.map(|dw| dw.into_mut_slice::<K>()).transpose()?;
                let slices = BackwardSlices::new(x, w, rstd, dy, dh, dx, dw);
                self.run::<T, K, A, K>(slices, partials)
            }
        }
    }

    fn run<T: CpuElement, W: Element, A: CpuAccum, D: Element>(
        &self,
        slices: BackwardSlices<'_, T, W, A, D>,
        partials: &WorkspacePool<A::Wide>,
    ) -> FfiResult<()> {
        let Layout { rows, n, groups } = self.layout;
        let BackwardSlices {
            x,
            w,
            rstd,
            dy,
            dh,
            dx,
            dw,
            moments,
            db,
        } = slices;
        let kernel = self.state.kernel;
        // x and dy read, dx written (the weight and its gradient are one row each).
        let workers = workers(self.ctx, work_bytes::<T>(x.len(), 3, false));
        let rows_per_group = self.layout.rows_per_group().max(1);
        let inputs = BackwardInputs {
            x,
            dy,
            rstd,
            w,
            dh,
            n,
            rows_per_group,
            kernel,
            moments,
        };
        // Gradient sums per weight element (the weight's, then LayerNorm's bias's), and the
        // gradients the call returns with the column of their sums.
        let width = n * gradient_rows(self.state.norm);
        let mut grads = [dw.map(|dw| (0, dw)), db.map(|db| (n, db))];

        if grads.iter().all(Option::is_none) {
            // No weight: only dx, rows in any chunks.
            if n == 0 {
                return Ok(());
            }
            let plan = Plan::split(rows, n, FORWARD_CHUNK_ELEMENTS, MAX_CHUNKS);
            let dx_chunks = DisjointChunks::new(dx, &plan.scaled(n)[..plan.count() + 1])?;
            let body = |c: usize| {
                let Some(dx) = dx_chunks.take(c) else { return };
                inputs.run_rows(kernel, plan.start(c), dx, None);
            };
            return self.state.jobs.run(self.ctx, plan.count(), workers, &body);
        };

        if n == 0 {
            return Ok(());
        }
        if rows == 0 {
            for (_, out) in grads.iter_mut().flatten() {
                out.fill(D::default());
            }
            return Ok(());
        }
        let mut scratch = partials.checkout();
        if groups > 1 {
            // One weight row per group: chunks are whole groups, each group's gradient is
            // summed over its rows in order, and no cross-chunk reduction is needed.
            let per_group = self.layout.rows_per_group();
            let plan = Plan::split(
                groups,
                per_group * n,
                FORWARD_CHUNK_ELEMENTS,
                partial_rows(n),
            );
            let dx_chunks =
                DisjointChunks::new(dx, &plan.scaled(per_group * n)[..plan.count() + 1])?;
            let bounds = &plan.scaled(n)[..plan.count() + 1];
            let [g0, g1] = grads;
            let out_chunks = [
                g0.map(|(col, out)| DisjointChunks::new(out, bounds).map(|o| (col, o)))
                    .transpose()?,
                g1.map(|(col, out)| DisjointChunks::new(out, bounds).map(|o| (col, o)))
                    .transpose()?,
            ];
            let acc_chunks = per_chunk_rows(&mut scratch, plan.count(), width)?;
            let body = |c: usize| {
                let (Some(dx), Some(acc)) = (dx_chunks.take(c), acc_chunks.take(c)) else {
                    return;
                };
                let mut outs = [None, None];
                for (slot, chunks) in outs.iter_mut().zip(&out_chunks) {
                    if let Some((col, chunks)) = chunks {
                        let Some(out) = chunks.take(c) else { return };
                        *slot = Some((*col, out));
                    }
                }
                let first_group = plan.start(c);
                for (gi, dx_group) in dx.chunks_exact_mut(per_group * n).enumerate() {
                    acc.fill(A::Wide::default());
                    let first_row = (first_group + gi) * per_group;
                    inputs.run_rows(kernel, first_row, dx_group, Some(&mut *acc));
                    for (col, out) in outs.iter_mut().flatten() {
                        let sums = &acc[*col..][..n];
                        for (o, &a) in out[gi * n..][..n].iter_mut().zip(sums) {
                            *o = D::from_f64(a.value());
                        }
                    }
                }
            };
            return self.state.jobs.run(self.ctx, plan.count(), workers, &body);
        }

        // One weight row: each chunk sums its rows' contributions into its own partial row,
        // then the partial rows are added in chunk order, column block by column block.
        let plan = Plan::backward(rows, n, partial_rows(n));
        let chunks = plan.count();
        {
            let dx_chunks = DisjointChunks::new(dx, &plan.scaled(n)[..chunks + 1])?;
            let acc_chunks = per_chunk_rows(&mut scratch, chunks, width)?;
            let body = |c: usize| {
                let (Some(dx), Some(acc)) = (dx_chunks.take(c), acc_chunks.take(c)) else {
                    return;
                };
                acc.fill(A::Wide::default());
                inputs.run_rows(kernel, plan.start(c), dx, Some(acc));
            };
            self.state.jobs.run(self.ctx, chunks, workers, &body)?;
        }
        let partial = &scratch[..chunks * width];
        for (offset, out) in grads.into_iter().flatten() {
            let blocks = Plan::split(n, 1, REDUCE_BLOCK, MAX_CHUNKS);
            let out_chunks = DisjointChunks::new(out, blocks.bounds())?;
            let body = |b: usize| {
                let Some(out) = out_chunks.take(b) else {
                    return;
                };
                let first = offset + blocks.start(b);
                kernel.run(
                    #[inline(always)]
                    || {
                        // Partial rows are added in chunk order, REDUCE_BLOCK columns at a time,
                        // in a stack buffer: contiguous loads that vectorize. (A block of the
                        // plan can be wider than REDUCE_BLOCK for long rows: the plan has at
                        // most MAX_CHUNKS blocks.)
                        let mut buffer = [A::Wide::default(); REDUCE_BLOCK];
                        for (k, out) in out.chunks_mut(REDUCE_BLOCK).enumerate() {
                            let col = first + k * REDUCE_BLOCK;
                            let sum = &mut buffer[..out.len()];
                            sum.fill(A::Wide::default());
                            for c in 0..chunks {
                                let row = &partial[c * width + col..][..sum.len()];
                                for (s, &p) in sum.iter_mut().zip(row) {
                                    *s = s.merge(p);
                                }
                            }
                            for (o, &s) in out.iter_mut().zip(sum.iter()) {
                                *o = D::from_f64(s.value());
                            }
                        }
                    },
                )
            };
            self.state
                .jobs
                .run(self.ctx, blocks.count(), workers, &body)?;
        }
        Ok(())
    }
}

pub const FORWARD_BUNDLE: BundleDef = BundleDef::of::<Forward>().instantiate().execute().build();
pub const RESIDUAL_BUNDLE: BundleDef = BundleDef::of::<ResidualForward>()
    .instantiate()
    .execute()
    .build();
pub const BACKWARD_BUNDLE: BundleDef = BundleDef::of::<Backward>().instantiate().execute().build();

mod split;
#[cfg(test)]
mod tests;
