//! An example stateful bundle in a library of its own: a scaled copy with a table cached in
//! the instantiate stage.
//!
//! `y[..., j] = x[..., j] * scale / (j + 1)`. The instantiate stage validates the attributes once
//! and builds the per-column table and a workspace pool; the execute stage reuses both on every
//! call, from any number of threads. Half-precision rows are widened into a pooled f32
//! workspace, scaled there, and narrowed into the result, so executions allocate nothing after
//! warm-up. It exists to prove the FFI layer and state registry against real XLA, and as the
//! smallest complete example of a stateful bundle with any-dtype buffers and a workspace pool.
//! The library exports its table with `export_library!` (last line); `scaled_copy.py` next to
//! this crate registers it with `rmsnorm_ffi.register_library` and calls it.
//!
//! A second target, `ema_update`, is the smallest in-place update: `average = decay * average +
//! (1 - decay) * x`, written over `average`'s own buffer (an [`InPlaceBuffer`] result aliasing
//! an [`AliasedArg`]); under `jit` with the average donated, XLA copies nothing.
#![deny(unsafe_code)]

use half::{bf16, f16};

use xla_ffi_bundles::ffi::{
    AliasedArg, AnyBuffer, AnyResult, Buffer, Bundle, BundleDef, Context, DataType, Execute,
    FfiError, FfiResult, Host, InPlaceBuffer, Instantiate, NativeType, NoState, Operand,
};
use xla_ffi_bundles::state::{LiveState, WorkspacePool, DEFAULT_POOL_CAPACITY};

/// The target name.
pub const TARGET: &str = "scaled_copy";
/// Longest row the example accepts (keeps the cached table small).
pub const MAX_ROW_LEN: i64 = 1 << 24;
const DTYPES: [DataType; 3] = [DataType::F32, DataType::BF16, DataType::F16];

xla_ffi_bundles::ffi_attrs! {
    /// Attributes of `scaled_copy`.
    pub struct ScaledCopyAttrs {
        /// The factor; finite.
        pub scale: f32,
        /// Length of the last axis, which sizes the table (instantiate sees no buffers).
        pub row_len: i64,
    }
}

/// Per-call-site state.
pub struct ScaledCopyState {
    pub live: LiveState,
    table: Vec<f32>,
    rows: WorkspacePool<f32>,
}
xla_ffi_bundles::state_type!(ScaledCopyState, "scaled_copy.ScaledCopyState");

/// The bundle type.
pub struct ScaledCopy;

impl Bundle for ScaledCopy {
    const TARGET: &'static str = TARGET;
    type Platform = Host;
    type State = ScaledCopyState;
}

impl Instantiate for ScaledCopy {
    type Attrs<'a> = ScaledCopyAttrs;

    fn instantiate(_ctx: &Context<'_>, attrs: ScaledCopyAttrs) -> FfiResult<ScaledCopyState> {
        if !attrs.scale.is_finite() {
            return Err(FfiError::attribute(
                "scale",
                format!("must be finite, got {}", attrs.scale),
            ));
        }
        if !(1..=MAX_ROW_LEN).contains(&attrs.row_len) {
            return Err(FfiError::attribute(
                "row_len",
                format!("must be in 1..={MAX_ROW_LEN}, got {}", attrs.row_len),
            ));
        }
        let n = attrs.row_len as usize;
        let table = (0..n).map(|j| attrs.scale / (j as f32 + 1.0)).collect();
        Ok(ScaledCopyState {
            live: LiveState::register(TARGET, "scaled_copy.ScaledCopyState"),
            table,
            rows: WorkspacePool::new(n, DEFAULT_POOL_CAPACITY),
        })
    }
}

impl Execute for ScaledCopy {
    type Args<'a> = (AnyBuffer<'a>,);
    type Rets<'a> = (AnyResult<'a>,);
    type Attrs<'a> = ();

    fn execute(
        state: &ScaledCopyState,
        _ctx: &Context<'_>,
        (x,): (AnyBuffer<'_>,),
        (y,): (AnyResult<'_>,),
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        check_operands(state, &x, &y)?;
        match x.dtype() {
            DataType::F32 => scale_f32(state, x.as_slice()?, y.into_mut_slice()?),
            DataType::BF16 => {
                scale_via_workspace::<bf16>(state, x.as_slice()?, y.into_mut_slice()?)
            }
            DataType::F16 => scale_via_workspace::<f16>(state, x.as_slice()?, y.into_mut_slice()?),
            other => return Err(x.operand().wrong_dtype(&DTYPES, other)),
        }
        Ok(())
    }
}

fn check_operands(state: &ScaledCopyState, x: &AnyBuffer<'_>, y: &AnyResult<'_>) -> FfiResult<()> {
    if !DTYPES.contains(&x.dtype()) {
        return Err(x.operand().wrong_dtype(&DTYPES, x.dtype()));
    }
    if y.dtype() != x.dtype() {
        return Err(Operand::Result(0).wrong_dtype(&[x.dtype()], y.dtype()));
    }
    if y.dims() != x.dims() {
        return Err(Operand::Result(0).wrong_shape(format!(
            "expected {:?} like argument 0, got {:?}",
            x.dims(),
            y.dims()
        )));
    }
    let row_len = state.table.len() as i64;
    match x.dims().last() {
        Some(&n) if n == row_len => Ok(()),
        Some(&n) => Err(x.operand().wrong_shape(format!(
            "last axis has {n} elements but the call site was instantiated for row_len={row_len}"
        ))),
        None => Err(x
            .operand()
            .wrong_shape("a scalar has no rows; expected rank >= 1")),
    }
}

fn scale_f32(state: &ScaledCopyState, x: &[f32], y: &mut [f32]) {
    let n = state.table.len();
    for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
        for ((yo, &xi), &t) in yr.iter_mut().zip(xr).zip(&state.table) {
            *yo = xi * t;
        }
    }
}

/// Half-precision element types the example widens to f32.
trait Half: NativeType {
    fn widen(self) -> f32;
    fn narrow(v: f32) -> Self;
}
impl Half for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Half for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(v: f32) -> Self {
        f16::from_f32(v)
    }
}

fn scale_via_workspace<T: Half>(state: &ScaledCopyState, x: &[T], y: &mut [T]) {
    let n = state.table.len();
    let mut row = state.rows.checkout();
    for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
        for ((w, &xi), &t) in row.iter_mut().zip(xr).zip(&state.table) {
            *w = xi.widen() * t;
        }
        for (yo, &w) in yr.iter_mut().zip(row.iter()) {
            *yo = T::narrow(w);
        }
    }
}

/// The bundle: instantiate + execute.
pub const BUNDLE: BundleDef = BundleDef::of::<ScaledCopy>()
    .instantiate()
    .execute()
    .build();

/// The in-place target's name.
pub const EMA_TARGET: &str = "ema_update";

xla_ffi_bundles::ffi_attrs! {
    /// Attributes of `ema_update`.
    pub struct EmaAttrs {
        /// The weight of the old average; in [0, 1].
        pub decay: f32,
    }
}

/// `average = decay * average + (1 - decay) * x`, in place over argument 0 (float32).
pub struct EmaUpdate;

impl Bundle for EmaUpdate {
    const TARGET: &'static str = EMA_TARGET;
    type Platform = Host;
    type State = NoState;
}

impl Execute for EmaUpdate {
    /// The average (aliased by the result: no view of it here) and the new values.
    type Args<'a> = (AliasedArg<'a>, Buffer<'a, f32>);
    /// The average's own buffer: its old values on entry, the new ones on return.
    type Rets<'a> = (InPlaceBuffer<'a, f32, 0>,);
    type Attrs<'a> = EmaAttrs;

    fn execute(
        _: &NoState,
        _ctx: &Context<'_>,
        (average, x): (AliasedArg<'_>, Buffer<'_, f32>),
        (out,): (InPlaceBuffer<'_, f32, 0>,),
        attrs: EmaAttrs,
    ) -> FfiResult<()> {
        let decay = attrs.decay;
        if !(0.0..=1.0).contains(&decay) {
            return Err(FfiError::attribute(
                "decay",
                format!("must be in [0, 1], got {decay}"),
            ));
        }
        if x.dims != average.dims() {
            return Err(Operand::Argument(1).wrong_shape(format!(
                "expected {:?} like argument 0 (the average), got {:?}",
                average.dims(),
                x.dims
            )));
        }
        for (a, &v) in out.data.iter_mut().zip(x.data) {
            *a = decay * *a + (1.0 - decay) * v;
        }
        Ok(())
    }
}

/// The in-place bundle: execute only (no state to build).
pub const EMA_BUNDLE: BundleDef = BundleDef::of::<EmaUpdate>().execute().build();

// The library's one exported symbol: its table.
xla_ffi_bundles::export_library!(BUNDLE, EMA_BUNDLE);
