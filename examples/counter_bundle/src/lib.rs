//! A stateful bundle in a crate of its own, written with `rmsnorm_ffi`'s FFI layer: a
//! per-call-site counter.
//!
//! `counter()` returns, as an int64 scalar, `start + step * k` where `k` is how many times this
//! call site ran before. The instantiate stage runs once per call site per executable and builds
//! the state: the attributes (validated once) and an atomic count. The execute stage runs on
//! every call, possibly on several threads at once with the same state (XLA takes no lock), so
//! the count is an atomic, not a `Cell`. The state lives until XLA destroys the executable and
//! calls the deleter, which drops it.
//!
//! The library exports one C symbol, its table of bundles and state types
//! (`xla_ffi_bundles::export_library!`); `rmsnorm_ffi.register_library(path)` reads it and
//! registers everything in it (`counter.py` next to this crate). The state's `LiveState`
//! reports into the registry of the `rmsnorm_ffi` extension that registered the library, so
//! `rmsnorm_ffi.stats()` counts these states and executions too.
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicI64, Ordering};

use xla_ffi_bundles::ffi::{
    Bundle, BundleDef, Context, Execute, FfiError, FfiResult, Host, Instantiate, ResultBuffer,
};
use xla_ffi_bundles::state::LiveState;

/// The custom-call target name (namespaced: target names are process-wide).
pub const TARGET: &str = "counter_bundle_counter";
/// The state type's name in XLA's process-wide registry (namespaced likewise).
pub const STATE_TYPE: &str = "counter_bundle.CounterState";

xla_ffi_bundles::ffi_attrs! {
    /// The attributes of `counter`, seen by every stage.
    pub struct CounterAttrs {
        /// The value of the first call.
        pub start: i64,
        /// Added on every later call; non-zero.
        pub step: i64,
    }
}

/// Per-call-site state, built by the instantiate stage.
pub struct CounterState {
    /// Its entry in the live-state registry (removed when XLA drops the state).
    live: LiveState,
    start: i64,
    step: i64,
    /// Executions so far. Atomic: concurrent executions share the state.
    calls: AtomicI64,
}
xla_ffi_bundles::state_type!(CounterState, STATE_TYPE);

/// The bundle type.
pub struct Counter;

impl Bundle for Counter {
    const TARGET: &'static str = TARGET;
    /// XLA:CPU: its result is host memory, which execute writes through a slice.
    type Platform = Host;
    type State = CounterState;
}

impl Instantiate for Counter {
    type Attrs<'a> = CounterAttrs;

    /// Validates the attributes once: an error here fails compilation, naming the attribute.
    fn instantiate(_ctx: &Context<'_>, attrs: CounterAttrs) -> FfiResult<CounterState> {
        if attrs.step == 0 {
            return Err(FfiError::invalid_argument(
                "counter: attribute `step` must be non-zero",
            ));
        }
        Ok(CounterState {
            live: LiveState::register(TARGET, STATE_TYPE),
            start: attrs.start,
            step: attrs.step,
            calls: AtomicI64::new(0),
        })
    }
}

impl Execute for Counter {
    /// No arguments; one int64 scalar result.
    type Args<'a> = ();
    type Rets<'a> = (ResultBuffer<'a, i64>,);
    /// The attributes were checked and stored at instantiate; execute ignores them.
    type Attrs<'a> = ();

    fn execute(
        state: &CounterState,
        _ctx: &Context<'_>,
        (): (),
        (out,): (ResultBuffer<'_, i64>,),
        (): (),
    ) -> FfiResult<()> {
        let [value] = out.data else {
            return Err(FfiError::invalid_argument(format!(
                "counter: result 0 must be a scalar, got dims {:?}",
                out.dims
            )));
        };
        state.live.record_execution();
        let k = state.calls.fetch_add(1, Ordering::Relaxed);
        *value = state.start.wrapping_add(state.step.wrapping_mul(k));
        Ok(())
    }
}

/// The declaration: the stages `Counter` implements.
pub const COUNTER: BundleDef = BundleDef::of::<Counter>().instantiate().execute().build();

// The library's one exported symbol: its table (here of one bundle; list them all).
xla_ffi_bundles::export_library!(COUNTER);
