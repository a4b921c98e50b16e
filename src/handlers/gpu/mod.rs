//! RMS norm on NVIDIA GPUs: the `rmsnorm_fwd` / `rmsnorm_bwd` bundles for platform CUDA.
//!
//! - [`rmsnorm.cu`](kernels::SOURCE): the kernels, stamped per dtype, compiled by NVRTC.
//! - [`driver`]: NVRTC and the driver API, loaded at run time (the only `unsafe` here).
//! - [`kernels`]: the kernel table, the per-capability compile cache and the launch shapes.
//!
//! Stages. *Instantiate* (no device, no stream) validates the attributes, and compiles the
//! kernels for the capability of every visible device (cached per process), so a compile error
//! or a missing NVRTC fails compilation of the JAX program, not its first run. *Initialize*
//! (and, if XLA skips it, the first execute on a device) loads the module into that device's
//! primary context and allocates the backward's weight-gradient partials, once per device,
//! kept in the state by device ordinal and freed by the state's deleter. *Execute* checks the
//! buffers against the attributes and only enqueues kernels on XLA's stream: no
//! synchronization, no allocation, no host reads of the arguments, fixed scratch pointers.
//! Hence the bundles declare themselves command-buffer compatible (CUDA graphs).
//!
//! The scratch is per device, not per stream: XLA runs one executable's work for a device on
//! that device's compute stream, so calls using the same scratch are ordered by the stream.

pub mod driver;
pub mod kernels;

use std::sync::Arc;

use dashmap::DashMap;
use once_cell::sync::OnceCell;

use super::operands::{
    backward_operands, check_eps, check_row_len, forward_operands, BackwardAttrs, BackwardOperands,
    ForwardAttrs, ForwardOperands,
};
use crate::ffi::{
    ArgsView, Bundle, BundleDef, Context, Cuda, DataType, Execute, FfiError, FfiResult, Initialize,
    Instantiate, ResultList, Traits,
};
use crate::state::LiveState;
use driver::{DeviceModule, GpuError, KernelArgs, LaunchConfig};
use kernels::{Direction, Launch};

pub use super::contract::{BACKWARD_TARGET, FORWARD_TARGET};

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

/// What one device holds for one call site: the loaded module, its scratch, and the backward
/// block limit (resident blocks, bounded by the scratch rows).
struct DeviceResources {
    module: DeviceModule,
    sm_count: usize,
    /// Partial rows (float32-sized) the scratch holds.
    partial_rows: usize,
}

/// Per-device resources, made once per device ordinal.
#[derive(Default)]
struct Devices {
    by_ordinal: DashMap<i32, Arc<OnceCell<DeviceResources>>>,
}

impl Devices {
    fn get_or_load(
        &self,
        ordinal: i32,
        row_len: usize,
        backward: bool,
    ) -> FfiResult<Arc<OnceCell<DeviceResources>>> {
        let cell = match self.by_ordinal.get(&ordinal) {
            Some(c) => c.clone(),
            None => self.by_ordinal.entry(ordinal).or_default().clone(),
        };
        cell.get_or_try_init(|| -> FfiResult<DeviceResources> {
            let cuda = driver::cuda()?;
            let compiled = kernels::compiled_for(cuda.capability(ordinal)?)?;
            let sm_count = cuda.sm_count(ordinal)?.max(1) as usize;
            let partial_rows = kernels::partial_rows(row_len, sm_count);
            let scratch = if backward && row_len > 0 {
                (partial_rows * row_len * 4).max(row_len * 8)
            } else {
                0
            };
            let module = DeviceModule::load(ordinal, &compiled.image(), &kernels::NAMES, scratch)?;
            Ok(DeviceResources {
                module,
                sm_count,
                partial_rows,
            })
        })?;
        Ok(cell)
    }
}

/// Compiles the kernels for every visible device's capability (instantiate has no device).
fn compile_for_visible_devices() -> FfiResult<()> {
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
            kernels::compiled_for(cc)?;
            seen.push(cc);
        }
    }
    Ok(())
}

/// Per-call-site state of the GPU `rmsnorm_fwd`.
pub struct GpuForwardState {
    pub live: LiveState,
    eps: f32,
    has_weight: bool,
    row_len: usize,
    devices: Devices,
}
crate::state_type!(GpuForwardState, "rmsnorm_ffi.RmsNormGpuForwardState");

/// Per-call-site state of the GPU `rmsnorm_bwd`.
pub struct GpuBackwardState {
    pub live: LiveState,
    has_weight: bool,
    row_len: usize,
    devices: Devices,
}
crate::state_type!(GpuBackwardState, "rmsnorm_ffi.RmsNormGpuBackwardState");

pub struct GpuForward;
impl Bundle for GpuForward {
    const TARGET: &'static str = FORWARD_TARGET;
    type Platform = Cuda;
    const TRAITS: Traits = Traits::COMMAND_BUFFER_COMPATIBLE;
    type State = GpuForwardState;
}

impl Instantiate for GpuForward {
    type Attrs<'a> = ForwardAttrs;
    fn instantiate(_ctx: &Context<'_>, attrs: ForwardAttrs) -> FfiResult<GpuForwardState> {
        check_eps(attrs.eps)?;
        let row_len = check_row_len(attrs.row_len)?;
        compile_for_visible_devices()?;
        Ok(GpuForwardState {
            live: LiveState::register(FORWARD_TARGET, "rmsnorm_ffi.RmsNormGpuForwardState"),
            eps: attrs.eps,
            has_weight: attrs.has_weight,
            row_len,
            devices: Devices::default(),
        })
    }
}

impl Initialize for GpuForward {
    type Attrs<'a> = ();
    fn initialize(state: &GpuForwardState, ctx: &Context<'_>, (): ()) -> FfiResult<()> {
        let ordinal = ctx.device_ordinal()?;
        state.devices.get_or_load(ordinal, state.row_len, false)?;
        Ok(())
    }
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
        let row_len = check_row_len(attrs.row_len)?;
        compile_for_visible_devices()?;
        Ok(GpuBackwardState {
            live: LiveState::register(BACKWARD_TARGET, "rmsnorm_ffi.RmsNormGpuBackwardState"),
            has_weight: attrs.has_weight,
            row_len,
            devices: Devices::default(),
        })
    }
}

impl Initialize for GpuBackward {
    type Attrs<'a> = ();
    fn initialize(state: &GpuBackwardState, ctx: &Context<'_>, (): ()) -> FfiResult<()> {
        let ordinal = ctx.device_ordinal()?;
        state
            .devices
            .get_or_load(ordinal, state.row_len, state.has_weight)?;
        Ok(())
    }
}

fn addr(p: *mut std::ffi::c_void) -> u64 {
    p as usize as u64
}

fn config(l: &Launch) -> LaunchConfig {
    LaunchConfig {
        grid: (l.grid, 1),
        block: (l.block, 1),
        shared_bytes: l.shared_bytes,
    }
}

fn missing_kernel(x: DataType, w: Option<DataType>) -> FfiError {
    FfiError::unimplemented(format!(
        "no GPU kernel for x {} with weight {}",
        x.name(),
        w.map_or("none", |w| w.name())
    ))
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
        let ForwardOperands {
            x,
            w,
            y,
            rstd,
            layout,
            ..
        } = forward_operands(&args, &mut rets, state.has_weight, state.row_len)?;
        if layout.rows == 0 {
            return Ok(());
        }
        let stream = ctx.stream()?;
        let ordinal = ctx.device_ordinal()?;
        let cell = state.devices.get_or_load(ordinal, state.row_len, false)?;
        let dev = cell
            .get()
            .ok_or_else(|| FfiError::internal("device not loaded"))?;
        let wd = w.as_ref().map(|w| w.dtype());
        let (xp, wp, yp, rp) = (
            addr(x.device_ptr()),
            w.as_ref().map_or(0, |w| addr(w.device_ptr())),
            addr(y.device_ptr()),
            addr(rstd.device_ptr()),
        );
        let vectorized = layout.n > 0 && kernels::can_vectorize(x.dtype(), layout.n, &[xp, wp, yp]);
        let index = kernels::kernel_index(Direction::Forward, x.dtype(), wd, vectorized)
            .ok_or_else(|| missing_kernel(x.dtype(), wd))?;
        let launch = kernels::forward_launch(x.dtype(), layout.n, layout.rows, vectorized);
        let rows_per_group = layout.rows_per_group().max(1);
        dev.module.launch(
            index,
            config(&launch),
            stream,
            KernelArgs::Forward {
                x: xp,
                w: wp,
                y: yp,
                rstd: rp,
                rows: layout.rows as i64,
                n: layout.n as i32,
                team: launch.team as i32,
                eps: state.eps,
                rows_per_group: rows_per_group as i64,
            },
        )?;
        Ok(())
    }
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
            rstd,
            dy,
            dx,
            dw,
            pair,
            layout,
        } = backward_operands(&args, &mut rets, state.has_weight, state.row_len)?;
        let acc = pair.accumulation();
        let n = layout.n;
        if n == 0 || (layout.rows == 0 && dw.is_none()) {
            return Ok(());
        }
        let stream = ctx.stream()?;
        let ordinal = ctx.device_ordinal()?;
        let cell = state
            .devices
            .get_or_load(ordinal, state.row_len, state.has_weight)?;
        let dev = cell
            .get()
            .ok_or_else(|| FfiError::internal("device not loaded"))?;
        let wd = w.as_ref().map(|w| w.dtype());
        let xs = kernels::size_of(x.dtype());
        let (xp, wp, rp, dyp, dxp) = (
            addr(x.device_ptr()),
            w.as_ref().map_or(0, |w| addr(w.device_ptr())),
            addr(rstd.device_ptr()),
            addr(dy.device_ptr()),
            addr(dx.device_ptr()),
        );
        let dwp = dw.as_ref().map_or(0, |d| addr(d.device_ptr()));
        let vectorized = kernels::can_vectorize(x.dtype(), n, &[xp, wp, dyp, dxp]);
        let index = kernels::kernel_index(Direction::Backward, x.dtype(), wd, vectorized)
            .ok_or_else(|| missing_kernel(x.dtype(), wd))?;
        // Blocks: resident ones (one 512-thread block per SM, by the kernel's launch bounds),
        // within the scratch rows (half as many float64 rows).
        let (scratch, _) = dev.module.scratch();
        let scratch_rows = dev.partial_rows * 4 / kernels::size_of(acc);
        let max_blocks = if dw.is_some() {
            dev.sm_count.min(scratch_rows)
        } else {
            dev.sm_count
        };
        // One weight row per group: each group is its own launch pair on the same stream,
        // which orders their uses of the scratch.
        let per_group = layout.rows_per_group();
        for g in 0..layout.groups {
            let row0 = (g * per_group) as u64;
            let launch = kernels::backward_launch(x.dtype(), n, per_group, vectorized, max_blocks);
            let w_off = (g * n * wd.map_or(0, kernels::size_of)) as u64;
            if per_group > 0 {
                dev.module.launch(
                    index,
                    config(&launch),
                    stream,
                    KernelArgs::Backward {
                        x: xp + row0 * (n * xs) as u64,
                        w: if wp == 0 { 0 } else { wp + w_off },
                        rstd: rp + row0 * kernels::size_of(acc) as u64,
                        dy: dyp + row0 * (n * xs) as u64,
                        dx: dxp + row0 * (n * xs) as u64,
                        partial: if dw.is_some() { scratch } else { 0 },
                        rows: per_group as i64,
                        n: n as i32,
                        team: launch.team as i32,
                        chunk: launch.chunk,
                    },
                )?;
            }
            if let Some(wd) = wd {
                let fin = kernels::finalize_index(acc, wd)
                    .ok_or_else(|| missing_kernel(acc, Some(wd)))?;
                let blocks = if per_group > 0 { launch.grid as i32 } else { 0 };
                dev.module.launch(
                    fin,
                    LaunchConfig {
                        grid: (n.div_ceil(32) as u32, 1),
                        block: (32, 8),
                        shared_bytes: 0,
                    },
                    stream,
                    KernelArgs::Finalize {
                        partial: scratch,
                        blocks,
                        n: n as i32,
                        dw: dwp + w_off,
                    },
                )?;
            }
        }
        Ok(())
    }
}

pub const FORWARD_BUNDLE: BundleDef = BundleDef::of::<GpuForward>()
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
