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
#![deny(unsafe_code)]

use xla_ffi_bundles::ffi::{
    Bundle, BundleDef, Context, Execute, FfiError, FfiResult, Host, Instantiate, RankedBuffer,
    RankedResult,
};
use xla_ffi_bundles::state::LiveState;

/// The custom-call target (namespaced: target names are process-wide).
pub const TARGET: &str = "my_ops_scale";
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
        let live = LiveState::register(TARGET, STATE_TYPE);
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

xla_ffi_bundles::export_library!(SCALE);
