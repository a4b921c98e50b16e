//! A second, small stateful bundle written with `rmsnorm_ffi`'s FFI layer: a per-call-site
//! counter.
//!
//! `counter()` returns, as an int64 scalar, `start + step * k` where `k` is how many times this
//! call site ran before. The instantiate stage runs once per call site per executable and builds
//! the state: the attributes (validated once) and an atomic count. The execute stage runs on
//! every call, possibly on several threads at once with the same state (XLA takes no lock), so
//! the count is an atomic, not a `Cell`. The state lives until XLA destroys the executable and
//! calls the deleter, which drops it; `Drop` keeps the live/created totals that the test reads.
//!
//! The library exports plain C symbols: `counter_bundle` (the bundle: stage handlers, state
//! type id and info, see `rmsnorm_ffi::ffi::export`) and two statistics functions. Python loads
//! it with ctypes (`counter.py` next to this crate).
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicI64, Ordering};

use rmsnorm_ffi::ffi::{
    Bundle, BundleDef, Context, Execute, FfiError, FfiResult, Instantiate, ResultBuffer,
};

/// The custom-call target name.
pub const TARGET: &str = "counter_bundle_counter";

rmsnorm_ffi::ffi_attrs! {
    /// The attributes of `counter`, seen by every stage.
    pub struct CounterAttrs {
        /// The value of the first call.
        pub start: i64,
        /// Added on every later call; non-zero.
        pub step: i64,
    }
}

/// Totals over the process, for the statistics functions (the state registry of `rmsnorm_ffi`
/// lives in the extension's own copy of the crate, so this library keeps its own).
static CREATED: AtomicI64 = AtomicI64::new(0);
static LIVE: AtomicI64 = AtomicI64::new(0);

/// Per-call-site state, built by the instantiate stage.
pub struct CounterState {
    start: i64,
    step: i64,
    /// Executions so far. Atomic: concurrent executions share the state.
    calls: AtomicI64,
}
rmsnorm_ffi::state_type!(CounterState, "counter_bundle.CounterState");

impl CounterState {
    fn new(start: i64, step: i64) -> CounterState {
        CREATED.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(1, Ordering::Relaxed);
        CounterState {
            start,
            step,
            calls: AtomicI64::new(0),
        }
    }
}

impl Drop for CounterState {
    /// Runs when XLA calls the state's deleter (the executable is gone).
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The bundle type.
pub struct Counter;

impl Bundle for Counter {
    const TARGET: &'static str = TARGET;
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
        Ok(CounterState::new(attrs.start, attrs.step))
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
        let k = state.calls.fetch_add(1, Ordering::Relaxed);
        *value = state.start.wrapping_add(state.step.wrapping_mul(k));
        Ok(())
    }
}

/// The declaration: the stages `Counter` implements.
pub const COUNTER: BundleDef = BundleDef::of::<Counter>().instantiate().execute().build();

rmsnorm_ffi::export_bundle!(counter_bundle, COUNTER);

// The two statistics functions are looked up by name from Python, hence `#[no_mangle]`, which
// the `unsafe_code` lint flags (duplicate symbol names would clash at link time); they contain
// no unsafe code.

/// States made so far (one per call site per compiled executable).
#[allow(unsafe_code)]
#[no_mangle]
pub extern "C" fn counter_bundle_created_states() -> i64 {
    CREATED.load(Ordering::Relaxed)
}

/// States alive now (made and not yet freed by XLA's deleter).
#[allow(unsafe_code)]
#[no_mangle]
pub extern "C" fn counter_bundle_live_states() -> i64 {
    LIVE.load(Ordering::Relaxed)
}
