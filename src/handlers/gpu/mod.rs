//! RMS norm and LayerNorm on NVIDIA GPUs: the `rmsnorm_fwd` / `rmsnorm_bwd` /
//! `rmsnorm_residual_fwd` bundles for platform CUDA (the same operand contracts as the CPU's,
//! `operands.rs`; the `norm` attribute picks the kernels, whole rows only: a split row's passes
//! are the CPU's).
//!
//! - [`rmsnorm.cu`](kernels::SOURCE): the kernels, stamped per dtype, compiled by NVRTC.
//! - [`driver`]: NVRTC and the driver API, loaded at run time (the only `unsafe` here); generic.
//! - [`kernels`]: the kernel table (names and parameter lists) and the per-capability compile
//!   cache; [`plan`]: the launch shapes and the scratch they use; [`resources`]: the module per
//!   device (shared) and each state's scratch per device.
//!
//! Stages. *Instantiate* (no device, no stream) validates the attributes, and compiles the
//! kernels for the capability of every visible device (cached per process), so a compile error
//! or a missing NVRTC fails compilation of the JAX program, not its first run. *Initialize*
//! (and, if XLA skips it, the first execute on a device, unless the stream is being captured)
//! finds the CUDA device of the call's stream, makes sure the process has the module loaded
//! there, and allocates this call site's weight-gradient scratch, sized from the buffers'
//! shapes; freed by the state's deleter. *Execute* checks the buffers against the attributes
//! and only enqueues kernels on XLA's stream: one launch for the forward, one backward and one
//! finalize for the backward whatever the weight batch; no synchronization, no allocation, no
//! host reads of the arguments, fixed scratch pointers. Hence the bundles declare themselves
//! command-buffer compatible (CUDA graphs).
//!
//! Variants are kernel parameters, not passes: a scale offset (`offset + w`, added to each weight
//! element in the accumulation dtype as it is read) and the fused residual's `dh` (added to dx
//! before its one rounding) cost no launch and no traffic beyond reading dh.
//!
//! The scratch is per device, not per stream: XLA runs one executable's work for a device on
//! that device's compute stream, so calls using the same scratch are ordered by the stream.

pub mod driver;
pub mod kernels;
pub mod plan;
pub mod resources;
pub mod variant;

use super::operands::{
    backward_operands, check_eps, check_norm, check_row_len, check_scale_offset, forward_operands,
    residual_operands, BackwardAttrs, BackwardForm, BackwardOperands, ForwardAttrs, ForwardForm,
    ForwardOperands, Layout, ResidualOperands,
};
use driver::{GpuError, LaunchConfig};
use kernels::Direction;
use resources::DeviceSlots;
use variant::Variant;
use xla_ffi_bundles::ffi::{
    AnyBuffer, ArgsView, Bundle, BundleDef, Context, Cuda, DataType, Execute, FfiError, FfiResult,
    Initialize, Instantiate, ResultList, Stage, Traits,
};
use xla_ffi_bundles::state::LiveState;

use super::contract::{Norm, Split};
pub use super::contract::{BACKWARD_TARGET, FORWARD_TARGET, RESIDUAL_TARGET};

impl From<GpuError> for FfiError {
    fn from(e: GpuError) -> Self {
        match &e {
            GpuError::LibraryNotFound { .. } | GpuError::Symbol { .. } => {
                FfiError::FailedPrecondition(e.to_string())
            }
            GpuError::Unsupported(_) => FfiError::Unimplemented(e.to_string()),
            _ if e.is_out_of_memory() => FfiError::ResourceExhausted(e.to_string()),
            _ => FfiError::Internal(e.to_string()),
        }
    }
}

/// The kernel variant `RMSNORM_FFI_GPU_PLAN` names (a tuning knob, see [`variant`]), read at
/// every instantiate: a bad value fails compilation of the JAX program, naming the knob.
fn variant_from_env() -> FfiResult<Variant> {
    Variant::from_env().map_err(|e| FfiError::invalid_argument(format!("rmsnorm_ffi: {e}")))
}

/// Compiles the norm's kernels of `variant` for every visible device's capability (instantiate
/// has no device).
fn compile_for_visible_devices(variant: &Variant, norm: Norm) -> FfiResult<()> {
    let cuda = driver::cuda()?;
    let count = cuda.device_count()?;
    if count == 0 {
        return Err(FfiError::failed_precondition(
            "rmsnorm_ffi: the CUDA driver reports no devices",
        ));
    }
    let mut seen = Vec::new();
    for ordinal in 0..count {
        let cc = cuda.capability(ordinal)?;
        if !seen.contains(&cc) {
            kernels::compiled_for(cc, variant, norm)?;
            seen.push(cc);
        }
    }
    Ok(())
}

/// Per-call-site state of the GPU `rmsnorm_fwd` and `rmsnorm_residual_fwd`.
pub struct GpuForwardState {
    pub live: LiveState,
    norm: Norm,
    /// LayerNorm's: the argument after the weight (or x) is a bias.
    has_bias: bool,
    eps: f32,
    /// `Some`: the weight applied is `offset + w`, added inside the kernels in the accumulation
    /// dtype (their `offset` parameter, [`kernels::offset_param`]).
    offset: Option<f32>,
    has_weight: bool,
    row_len: usize,
    /// The plan override read at instantiate (the default plan unless the knob is set).
    variant: Variant,
    devices: DeviceSlots,
}
xla_ffi_bundles::state_type!(GpuForwardState, "rmsnorm_ffi.RmsNormGpuForwardState");

/// Per-call-site state of the GPU `rmsnorm_bwd`.
pub struct GpuBackwardState {
    pub live: LiveState,
    norm: Norm,
    /// LayerNorm's: the call returns the bias's gradient.
    has_bias: bool,
    /// As the forward's: the weight applied is `offset + w`; dweight is still w's gradient.
    offset: Option<f32>,
    /// Calls have a `dh` operand after dy, added to dx before its one rounding (the kernels'
    /// `dh` parameter; see `BackwardAttrs::has_dh`).
    has_dh: bool,
    has_weight: bool,
    row_len: usize,
    /// The backward's share of the plan override (none yet: [`Variant::for_backward`]).
    variant: Variant,
    devices: DeviceSlots,
}
xla_ffi_bundles::state_type!(GpuBackwardState, "rmsnorm_ffi.RmsNormGpuBackwardState");

pub struct GpuForward;
impl Bundle for GpuForward {
    const TARGET: &'static str = FORWARD_TARGET;
    type Platform = Cuda;
    const TRAITS: Traits = Traits::COMMAND_BUFFER_COMPATIBLE;
    type State = GpuForwardState;
}

impl GpuForwardState {
    fn new(target: &'static str, attrs: ForwardAttrs) -> FfiResult<GpuForwardState> {
        let (norm, has_bias) = whole_rows(attrs.norm, attrs.has_bias, attrs.split)?;
        check_eps(attrs.eps)?;
        let row_len = check_row_len(attrs.row_len)?;
        let offset = check_scale_offset(attrs.scale_offset)?;
        let variant = variant_from_env()?;
        compile_for_visible_devices(&variant, norm)?;
        let live = LiveState::register(target, "rmsnorm_ffi.RmsNormGpuForwardState");
        live.set_detail("plan", variant.to_string());
        Ok(GpuForwardState {
            live,
            norm,
            has_bias,
            eps: attrs.eps,
            offset,
            has_weight: attrs.has_weight,
            row_len,
            variant,
            devices: DeviceSlots::default(),
        })
    }
}

impl GpuForwardState {
    /// The operands of the call site's forward calls.
    fn form(&self) -> ForwardForm {
        ForwardForm {
            norm: self.norm,
            has_weight: self.has_weight,
            has_bias: self.has_bias,
            row_len: self.row_len,
            split: None,
        }
    }
}

impl Instantiate for GpuForward {
    type Attrs<'a> = ForwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: ForwardAttrs) -> FfiResult<GpuForwardState> {
        GpuForwardState::new(FORWARD_TARGET, attrs)
    }
}

impl Initialize for GpuForward {
    type Args<'a> = ArgsView<'a, Cuda>;
    type Rets<'a> = ResultList<'a, Cuda>;
    type Attrs<'a> = ();
    fn initialize(
        state: &GpuForwardState,
        ctx: &Context<'_>,
        _args: ArgsView<'_, Cuda>,
        _rets: ResultList<'_, Cuda>,
        (): (),
    ) -> FfiResult<()> {
        forward_slot(state, ctx, Stage::Initialize)?;
        Ok(())
    }
}

/// `rmsnorm_residual_fwd`: `(x, residual, [weight]) -> (y, h, rstd)` with `h = x + residual`
/// rounded to x's dtype (the CPU bundle's bits) and `(y, rstd)` the forward of h, in one kernel
/// that reads x and the residual once and writes h and y. The forward's state, attributes and
/// launch plan.
pub struct GpuResidualForward;
impl Bundle for GpuResidualForward {
    const TARGET: &'static str = RESIDUAL_TARGET;
    type Platform = Cuda;
    const TRAITS: Traits = Traits::COMMAND_BUFFER_COMPATIBLE;
    type State = GpuForwardState;
}

impl Instantiate for GpuResidualForward {
    type Attrs<'a> = ForwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: ForwardAttrs) -> FfiResult<GpuForwardState> {
        GpuForwardState::new(RESIDUAL_TARGET, attrs)
    }
}

impl Initialize for GpuResidualForward {
    type Args<'a> = ArgsView<'a, Cuda>;
    type Rets<'a> = ResultList<'a, Cuda>;
    type Attrs<'a> = ();
    fn initialize(
        state: &GpuForwardState,
        ctx: &Context<'_>,
        _args: ArgsView<'_, Cuda>,
        _rets: ResultList<'_, Cuda>,
        (): (),
    ) -> FfiResult<()> {
        forward_slot(state, ctx, Stage::Initialize)?;
        Ok(())
    }
}

type Slot = std::sync::Arc<once_cell::sync::OnceCell<resources::DeviceSlot>>;

/// A state's resources on the CUDA device of the call's stream (`DeviceSlots::get_or_acquire`).
fn slot_for(
    devices: &DeviceSlots,
    live: &LiveState,
    variant: &Variant,
    norm: Norm,
    ctx: &Context<'_>,
    stage: Stage,
    scratch_bytes: impl FnOnce(usize, usize) -> usize,
) -> FfiResult<Slot> {
    let stream = ctx.stream()?;
    let device = driver::cuda()?.stream_device(stream)?;
    devices.get_or_acquire(live, stream, &device, stage, (variant, norm), scratch_bytes)
}

fn forward_slot(state: &GpuForwardState, ctx: &Context<'_>, stage: Stage) -> FfiResult<Slot> {
    slot_for(
        &state.devices,
        &state.live,
        &state.variant,
        state.norm,
        ctx,
        stage,
        |_, _| 0,
    )
}

pub struct GpuBackward;
impl Bundle for GpuBackward {
    const TARGET: &'static str = BACKWARD_TARGET;
    type Platform = Cuda;
    const TRAITS: Traits = Traits::COMMAND_BUFFER_COMPATIBLE;
    type State = GpuBackwardState;
}

impl Instantiate for GpuBackward {
    type Attrs<'a> = BackwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: BackwardAttrs) -> FfiResult<GpuBackwardState> {
        let (norm, has_bias) = whole_rows(attrs.norm, attrs.has_bias, attrs.split)?;
        let row_len = check_row_len(attrs.row_len)?;
        if let Some(eps) = attrs.eps {
            // The kernels read the forward's statistics; the Python lowering passes them on CUDA.
            return Err(FfiError::invalid_argument(format!(
                "attribute `eps` ({eps}): the CUDA backward takes the forward's statistics as \
                 operands; a backward that takes them itself from x is CPU only"
            )));
        }
        let offset = check_scale_offset(attrs.scale_offset)?;
        let variant = variant_from_env()?.for_backward();
        compile_for_visible_devices(&variant, norm)?;
        let live = LiveState::register(BACKWARD_TARGET, "rmsnorm_ffi.RmsNormGpuBackwardState");
        live.set_detail("plan", variant.to_string());
        Ok(GpuBackwardState {
            live,
            norm,
            has_bias,
            offset,
            has_dh: attrs.has_dh == Some(true),
            has_weight: attrs.has_weight,
            row_len,
            variant,
            devices: DeviceSlots::default(),
        })
    }
}

impl Initialize for GpuBackward {
    type Args<'a> = ArgsView<'a, Cuda>;
    type Rets<'a> = ResultList<'a, Cuda>;
    type Attrs<'a> = ();
    fn initialize(
        state: &GpuBackwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_, Cuda>,
        mut rets: ResultList<'_, Cuda>,
        (): (),
    ) -> FfiResult<()> {
        let ops = backward_operands(&args, &mut rets, backward_form(state))?;
        backward_slot(state, ctx, Stage::Initialize, ops.x.dtype(), ops.layout)?;
        Ok(())
    }
}

/// The norm and whether it has a bias (`check_norm`), for whole rows: the CUDA kernels take
/// whole rows, and a split row's passes run on the CPU (the Python lowering never sends them
/// here), so a call site with `split` is refused when it is instantiated, naming the attribute.
fn whole_rows(
    norm: Option<Norm>,
    has_bias: Option<bool>,
    split: Option<Split>,
) -> FfiResult<(Norm, bool)> {
    if let Some(split) = split {
        return Err(FfiError::Unimplemented(format!(
            "attribute `split` ({}, {split:?}): the CUDA kernels take whole rows; a split row's \
             passes run on the CPU",
            split.value()
        )));
    }
    Ok(check_norm(norm, has_bias)?)
}

/// The operands of the call site's CUDA backward calls: the statistics always given (the kernels
/// read the forward's), dh when the call site says so.
fn backward_form(state: &GpuBackwardState) -> BackwardForm {
    BackwardForm {
        norm: state.norm,
        has_bias: state.has_bias,
        has_weight: state.has_weight,
        has_rstd: true,
        has_dh: state.has_dh,
        row_len: state.row_len,
        split: None,
    }
}

fn backward_slot(
    state: &GpuBackwardState,
    ctx: &Context<'_>,
    stage: Stage,
    x: DataType,
    layout: Layout,
) -> FfiResult<Slot> {
    let sums = plan::Sums {
        norm: state.norm,
        weight: state.has_weight,
        bias: state.has_bias,
    };
    slot_for(
        &state.devices,
        &state.live,
        &state.variant,
        state.norm,
        ctx,
        stage,
        |sm_count, max_cluster| {
            plan::backward_scratch_bytes(
                x,
                layout.n,
                layout.groups,
                layout.rows_per_group(),
                sm_count,
                sums,
                max_cluster,
            )
        },
    )
}

fn addr(p: *mut std::ffi::c_void) -> u64 {
    p as usize as u64
}

fn missing_kernel(x: DataType, w: Option<DataType>) -> FfiError {
    FfiError::unimplemented(format!(
        "no GPU kernel for x {} with weight {}",
        x.name(),
        w.map_or("none", |w| w.name())
    ))
}

fn weight_ptr(w: &Option<AnyBuffer<'_, Cuda>>) -> u64 {
    w.as_ref().map_or(0, |w| addr(w.device_ptr()))
}

impl Execute for GpuForward {
    type Args<'a> = ArgsView<'a, Cuda>;
    type Rets<'a> = ResultList<'a, Cuda>;
    type Attrs<'a> = ();

    fn execute(
        state: &GpuForwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_, Cuda>,
        mut rets: ResultList<'_, Cuda>,
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        let forward = forward_operands(&args, &mut rets, state.form())?;
        launch_forward(state, ctx, &forward, None)
    }
}

impl Execute for GpuResidualForward {
    type Args<'a> = ArgsView<'a, Cuda>;
    type Rets<'a> = ResultList<'a, Cuda>;
    type Attrs<'a> = ();

    fn execute(
        state: &GpuForwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_, Cuda>,
        mut rets: ResultList<'_, Cuda>,
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        let ResidualOperands {
            forward,
            residual,
            h,
        } = residual_operands(&args, &mut rets, state.form())?;
        let fused = (addr(residual.device_ptr()), addr(h.device_ptr()));
        launch_forward(state, ctx, &forward, Some(fused))
    }
}

/// Enqueues the forward kernel on the call's stream, or with `fused = Some((residual, h))` the
/// fused residual-add kernel, whose parameters are the forward's with the residual after x
/// and h after y (LayerNorm's: the bias after the weight, the mean before rstd). The vectorized
/// kernel when every pointer it loads or stores allows it.
fn launch_forward(
    state: &GpuForwardState,
    ctx: &Context<'_>,
    ops: &ForwardOperands<'_, '_, Cuda>,
    fused: Option<(u64, u64)>,
) -> FfiResult<()> {
    let layout = ops.layout;
    if layout.rows == 0 {
        return Ok(());
    }
    let cell = forward_slot(state, ctx, Stage::Execute)?;
    let slot = cell
        .get()
        .ok_or_else(|| FfiError::internal("device not loaded"))?;
    let layer = state.norm == Norm::Layer;
    let xd = ops.x.dtype();
    // The kernel's weight dtype: the pair's (LayerNorm without a weight: its bias's).
    let wd = (ops.w.is_some() || ops.b.is_some()).then(|| ops.pair.weight());
    let (xp, wp, bp, yp, rp) = (
        addr(ops.x.device_ptr()),
        weight_ptr(&ops.w),
        weight_ptr(&ops.b),
        addr(ops.y.device_ptr()),
        addr(ops.rstd.device_ptr()),
    );
    let mp = ops.mean.as_ref().map_or(0, |m| addr(m.device_ptr()));
    let (direction, vectorized) = match fused {
        None => (
            Direction::Forward,
            plan::can_vectorize(xd, layout.n, &[xp, wp, bp, yp]),
        ),
        Some((resp, hp)) => (
            Direction::Residual,
            plan::can_vectorize(xd, layout.n, &[xp, resp, wp, bp, yp, hp]),
        ),
    };
    let vectorized = layout.n > 0 && vectorized;
    let index = kernels::kernel_index(state.norm, direction, xd, wd, vectorized)
        .ok_or_else(|| missing_kernel(xd, wd))?;
    let launch = plan::forward_launch(
        xd,
        layout.n,
        layout.rows,
        vectorized,
        &state.variant,
        slot.sm_count,
    );
    let config = LaunchConfig {
        grid: launch.grid,
        block: (launch.block, 1),
        shared_bytes: launch.shared_bytes,
        cluster: 1,
    };
    let mut call = slot.module.launch(index, config)?.ptr("x", xp);
    if let Some((resp, _)) = fused {
        call = call.ptr("residual", resp);
    }
    call = call.ptr("w", wp);
    if layer {
        call = call.ptr("b", bp);
    }
    call = call.ptr("y", yp);
    if let Some((_, hp)) = fused {
        call = call.ptr("h", hp);
    }
    if layer {
        call = call.ptr("mean", mp);
    }
    call.ptr("rstd", rp)
        .i64("rows", layout.rows as i64)
        .i32("n", layout.n as i32)
        .i32("team", launch.team as i32)
        .f32("eps", state.eps)
        .f32("offset", kernels::offset_param(state.offset))
        .i64("rows_per_group", layout.rows_per_group().max(1) as i64)
        .enqueue(ctx.stream()?)?;
    Ok(())
}

impl Execute for GpuBackward {
    type Args<'a> = ArgsView<'a, Cuda>;
    type Rets<'a> = ResultList<'a, Cuda>;
    type Attrs<'a> = ();

    fn execute(
        state: &GpuBackwardState,
        ctx: &Context<'_>,
        args: ArgsView<'_, Cuda>,
        mut rets: ResultList<'_, Cuda>,
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        let BackwardOperands {
            x,
            w,
            mean,
            rstd,
            dy,
            dh,
            dx,
            dw,
            db,
            pair,
            layout,
            ..
        } = backward_operands(&args, &mut rets, backward_form(state))?;
        let n = layout.n;
        let sums = plan::Sums {
            norm: state.norm,
            weight: dw.is_some(),
            bias: db.is_some(),
        };
        if n == 0 || (layout.rows == 0 && (sums.rows() == 0 || layout.groups == 0)) {
            return Ok(());
        }
        let rstd = rstd.ok_or_else(|| FfiError::internal("CUDA backward without rstd"))?;
        let layer = state.norm == Norm::Layer;
        let mean = match (layer, mean) {
            (false, _) => 0,
            (true, Some(m)) => addr(m.device_ptr()),
            (true, None) => return Err(FfiError::internal("CUDA LayerNorm backward without mean")),
        };
        let cell = backward_slot(state, ctx, Stage::Execute, x.dtype(), layout)?;
        let slot = cell
            .get()
            .ok_or_else(|| FfiError::internal("device not loaded"))?;
        let stream = ctx.stream()?;
        let acc = pair.accumulation();
        // The kernel's weight dtype: the pair's (LayerNorm without a weight: its bias's).
        let wd = (w.is_some() || db.is_some()).then(|| pair.weight());
        let (xp, wp, rp, dyp, dxp) = (
            addr(x.device_ptr()),
            weight_ptr(&w),
            addr(rstd.device_ptr()),
            addr(dy.device_ptr()),
            addr(dx.device_ptr()),
        );
        let dhp = dh.as_ref().map_or(0, |d| addr(d.device_ptr()));
        let vectorized = plan::can_vectorize(x.dtype(), n, &[xp, wp, dyp, dhp, dxp]);
        let per_group = layout.rows_per_group();
        let launch = plan::backward_launch(
            x.dtype(),
            n,
            layout.groups,
            per_group,
            vectorized,
            slot.sm_count,
            sums,
            slot.max_cluster,
        );
        let (scratch, scratch_bytes) = slot.scratch();
        let layout_of_scratch = plan::backward_scratch(x.dtype(), n, &launch, sums);
        let partial =
            |wanted: bool, offset: usize| if wanted { scratch + offset as u64 } else { 0 };
        let partial_w = partial(sums.weight, 0);
        let partial_b = partial(sums.bias, layout_of_scratch.bias_offset);
        if per_group > 0 {
            let needed = layout_of_scratch.bytes;
            if needed > scratch_bytes {
                return Err(FfiError::internal(format!(
                    "rmsnorm_bwd: the launch needs {needed} scratch bytes, the call site holds \
                     {scratch_bytes} (shapes changed since initialize?)"
                )));
            }
            let index = if launch.cluster > 1 {
                kernels::cluster_index(x.dtype(), wd)
            } else {
                kernels::kernel_index(state.norm, Direction::Backward, x.dtype(), wd, vectorized)
            }
            .ok_or_else(|| missing_kernel(x.dtype(), wd))?;
            let config = LaunchConfig {
                grid: launch.grid,
                block: (launch.block, 1),
                shared_bytes: launch.shared_bytes,
                cluster: launch.cluster,
            };
            let mut call = slot.module.launch(index, config)?.ptr("x", xp).ptr("w", wp);
            if layer {
                call = call.ptr("mean", mean);
            }
            call = call
                .ptr("rstd", rp)
                .ptr("dy", dyp)
                .ptr("dh", dhp)
                .ptr("dx", dxp)
                .ptr("partial", partial_w);
            if layer {
                call = call.ptr("partial_b", partial_b);
            } else {
                let dots = if launch.cluster > 1 {
                    scratch + layout_of_scratch.dots_offset as u64
                } else {
                    0
                };
                call = call.ptr("dots", dots);
            }
            call.i32("n", n as i32)
                .i32("team", launch.team as i32)
                .f32("offset", kernels::offset_param(state.offset))
                .i64("chunk", launch.chunk)
                .i64("rows_per_group", per_group as i64)
                .i64("blocks_per_group", launch.blocks_per_group as i64)
                .enqueue(stream)?;
        }
        // One finalize per gradient (the weight's, the bias's), each of its own partial rows.
        for (grad, rows) in [(&dw, partial_w), (&db, partial_b)] {
            let (Some(grad), Some(wd)) = (grad, wd) else {
                continue;
            };
            let fin = kernels::finalize_index(state.norm, acc, wd)
                .ok_or_else(|| missing_kernel(acc, Some(wd)))?;
            let blocks = if per_group > 0 {
                launch.blocks_per_group as i32
            } else {
                0
            };
            let grid = (n.div_ceil(32) * layout.groups).min(i32::MAX as usize) as u32;
            slot.module
                .launch(
                    fin,
                    LaunchConfig {
                        grid,
                        block: (32, 8),
                        shared_bytes: 0,
                        cluster: 1,
                    },
                )?
                .ptr("partial", rows)
                .i32("blocks", blocks)
                .i32("n", n as i32)
                .i32("narrow", plan::narrow_partials(x.dtype(), &launch) as i32)
                .ptr("dw", addr(grad.device_ptr()))
                .enqueue(stream)?;
        }
        Ok(())
    }
}

pub const FORWARD_BUNDLE: BundleDef = BundleDef::of::<GpuForward>()
    .instantiate()
    .initialize()
    .execute()
    .build();
pub const RESIDUAL_BUNDLE: BundleDef = BundleDef::of::<GpuResidualForward>()
    .instantiate()
    .initialize()
    .execute()
    .build();
pub const BACKWARD_BUNDLE: BundleDef = BundleDef::of::<GpuBackward>()
    .instantiate()
    .initialize()
    .execute()
    .build();

#[cfg(test)]
mod tests;
