//! `my_ops_scale`: `y[i, j] = x[i, j] * scale / (j + 1)` for a float32 matrix `x`, a stateful
//! bundle whose instantiate stage validates the attributes once and caches the table of factors,
//! shared by every execution of its call site (on any thread), and freed with the executable.
//! Its buffers are typed with their rank (`RankedBuffer<'a, f32, 2>`): a call with another
//! dtype or rank fails before `execute` runs, naming the argument.
//!
//! From Python, once the library is registered (`rmsnorm_ffi.register_library(path)`):
//!
//! ```text
//! call = jax.ffi.ffi_call("my_ops_scale", jax.ShapeDtypeStruct(x.shape, x.dtype))
//! y = call(x, scale=2.0, row_len=np.int64(x.shape[-1]))   # a float F32 holds exactly, or np.float32
//! ```
//!
//! `my_ops_scale_add` updates a buffer in place with the same table: `acc[i, j] += x[i, j] *
//! scale / (j + 1)`, its result being `acc`'s own buffer (`InPlaceBuffer` over an `AliasedArg`).
//! Donated under `jit`, `acc` is updated without a copy:
//!
//! ```text
//! add = jax.ffi.ffi_call("my_ops_scale_add", jax.ShapeDtypeStruct(acc.shape, acc.dtype),
//!                        input_output_aliases={0: 0})
//! step = jax.jit(lambda acc, x: add(acc, x, scale=2.0, row_len=np.int64(128)), donate_argnums=0)
//! ```
#![deny(unsafe_code)]

use xla_ffi_bundles::ffi::{
    AliasedArg, Bundle, BundleDef, Context, Execute, FfiError, FfiResult, Host, InPlaceBuffer,
    Instantiate, RankedBuffer, RankedResult,
};
use xla_ffi_bundles::state::LiveState;

/// The custom-call target (namespaced: target names are process-wide).
pub const TARGET: &str = "my_ops_scale";
/// The in-place target.
pub const ADD_TARGET: &str = "my_ops_scale_add";
/// The state type's name in XLA's process-wide registry (namespaced likewise).
pub const STATE_TYPE: &str = "my_ops.ScaleState";

xla_ffi_bundles::ffi_attrs! {
    /// The attributes every stage of `my_ops_scale` sees.
    pub struct ScaleAttrs {
        /// The factor of column 0.
        pub scale: f32,
        /// The length of the rows (the last axis of x), known at instantiation.
        pub row_len: i64,
    }
}

/// Per-call-site state, built once by instantiate.
pub struct ScaleState {
    /// The state's entry in the host's live-state registry (`rmsnorm_ffi.stats()`).
    live: LiveState,
    /// `scale / (j + 1)` for every column `j`.
    table: Vec<f32>,
}
xla_ffi_bundles::state_type!(ScaleState, "my_ops.ScaleState");

/// The bundle: its target, platform and state.
pub struct Scale;

impl Bundle for Scale {
    const TARGET: &'static str = TARGET;
    type Platform = Host;
    type State = ScaleState;
}

impl Instantiate for Scale {
    type Attrs<'a> = ScaleAttrs;

    fn instantiate(_ctx: &Context<'_>, attrs: ScaleAttrs) -> FfiResult<ScaleState> {
        ScaleState::new(TARGET, attrs)
    }
}

impl ScaleState {
    /// Validates the attributes and builds the table, for either target.
    fn new(target: &'static str, attrs: ScaleAttrs) -> FfiResult<ScaleState> {
        if !attrs.scale.is_finite() {
            return Err(FfiError::attribute(
                "scale",
                format!("must be finite, got {}", attrs.scale),
            ));
        }
        if !(1..=1 << 24).contains(&attrs.row_len) {
            return Err(FfiError::attribute(
                "row_len",
                format!("must be in 1..=2^24, got {}", attrs.row_len),
            ));
        }
        let table = (0..attrs.row_len)
            .map(|j| attrs.scale / (j as f32 + 1.0))
            .collect();
        let live = LiveState::register(target, STATE_TYPE);
        // Shown in this state's entry of `rmsnorm_ffi.stats()["states"]`.
        live.set_detail("row_len", attrs.row_len.to_string());
        Ok(ScaleState { live, table })
    }
}

impl Execute for Scale {
    type Args<'a> = (RankedBuffer<'a, f32, 2>,);
    type Rets<'a> = (RankedResult<'a, f32, 2>,);
    type Attrs<'a> = ();

    fn execute(
        state: &ScaleState,
        _ctx: &Context<'_>,
        (x,): (RankedBuffer<'_, f32, 2>,),
        (y,): (RankedResult<'_, f32, 2>,),
        (): (),
    ) -> FfiResult<()> {
        let n = state.table.len();
        let [_rows, cols] = x.dims;
        if cols != n as i64 || y.dims != x.dims {
            // Reported as "my_ops_scale: [execute] x has shape ...".
            return Err(FfiError::invalid_argument(format!(
                "x has shape {:?} and y {:?}, but the call site was instantiated for rows of {n}",
                x.dims, y.dims
            )));
        }
        state.live.record_execution();
        for (yr, xr) in y.data.chunks_mut(n).zip(x.data.chunks(n)) {
            for ((out, value), factor) in yr.iter_mut().zip(xr).zip(&state.table) {
                *out = value * factor;
            }
        }
        Ok(())
    }
}

/// The bundle as XLA registers it: the stages `Scale` implements.
pub const SCALE: BundleDef = BundleDef::of::<Scale>().instantiate().execute().build();

/// The in-place bundle: the same state type, `acc += x * table` over `acc`'s buffer.
pub struct ScaleAdd;

impl Bundle for ScaleAdd {
    const TARGET: &'static str = ADD_TARGET;
    type Platform = Host;
    type State = ScaleState;
}

impl Instantiate for ScaleAdd {
    type Attrs<'a> = ScaleAttrs;

    fn instantiate(_ctx: &Context<'_>, attrs: ScaleAttrs) -> FfiResult<ScaleState> {
        ScaleState::new(ADD_TARGET, attrs)
    }
}

impl Execute for ScaleAdd {
    /// `acc` (no view of it here: it is read and written through the result) and `x`.
    type Args<'a> = (AliasedArg<'a>, RankedBuffer<'a, f32, 2>);
    /// `acc`'s own buffer; the call site aliases it (`input_output_aliases={0: 0}`).
    type Rets<'a> = (InPlaceBuffer<'a, f32, 0>,);
    type Attrs<'a> = ();

    fn execute(
        state: &ScaleState,
        _ctx: &Context<'_>,
        (acc, x): Self::Args<'_>,
        (out,): Self::Rets<'_>,
        (): (),
    ) -> FfiResult<()> {
        let n = state.table.len();
        if acc.dims() != x.dims || x.dims[1] != n as i64 {
            return Err(FfiError::invalid_argument(format!(
                "acc has shape {:?} and x {:?}, but they must be the same, with rows of {n}",
                acc.dims(),
                x.dims
            )));
        }
        state.live.record_execution();
        for (ar, xr) in out.data.chunks_mut(n).zip(x.data.chunks(n)) {
            for ((a, value), factor) in ar.iter_mut().zip(xr).zip(&state.table) {
                *a += value * factor;
            }
        }
        Ok(())
    }
}

/// The in-place bundle as XLA registers it.
pub const SCALE_ADD: BundleDef = BundleDef::of::<ScaleAdd>().instantiate().execute().build();

xla_ffi_bundles::export_library!(SCALE, SCALE_ADD);
