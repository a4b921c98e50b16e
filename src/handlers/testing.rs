//! Targets for tests and the stress harness: they exercise the FFI layer, not the math.
//!
//! - `rmsnorm_ffi_testing_stages`: a bundle with all four stages. Each stage counts its calls in
//!   the state; execute writes the counts to its `S32[4]` result. The `panic_in` and `fail_in`
//!   attributes name a stage that panics or returns an error, to prove that both come back to
//!   Python as exceptions and the process lives on.
//! - `rmsnorm_ffi_testing_context`: a stateless bundle whose execute reads the context (XLA's
//!   thread-pool size, device ordinal, run id), runs one task on XLA's thread pool and waits
//!   for it, and writes what it saw to its `S32[4]` result.
//! - `rmsnorm_ffi_testing_attrs`: echoes a description of every attribute it is given.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use crate::ffi::attrs::ArrayAttr;
use crate::ffi::{
    ArgsView, AttrValue, Attrs, Bundle, BundleDef, Context, DataType, Execute, FfiError, FfiResult,
    Initialize, Instantiate, NoState, Prepare, ResultBuffer, ResultList, Scalar, Stage,
};
use crate::state::LiveState;

pub const STAGES_TARGET: &str = "rmsnorm_ffi_testing_stages";
pub const CONTEXT_TARGET: &str = "rmsnorm_ffi_testing_context";

crate::ffi_attrs! {
    /// Which stage misbehaves: "instantiate", "prepare", "initialize", "execute" or "none".
    pub struct StagesAttrs<'a> {
        pub panic_in: &'a str,
        pub fail_in: &'a str,
    }
}

/// Per-call-site state of the stages target: calls per stage.
pub struct StagesState {
    pub live: LiveState,
    calls: [AtomicU64; 4],
}
crate::state_type!(StagesState, "rmsnorm_ffi.testing.StagesState");

impl StagesState {
    fn count(&self, stage: Stage) {
        let index = Stage::ALL.iter().position(|s| *s == stage).unwrap_or(0);
        self.calls[index].fetch_add(1, Ordering::Relaxed);
    }
}

/// Panics or fails if the attributes say this stage should.
fn misbehave(attrs: &StagesAttrs<'_>, stage: Stage) -> FfiResult<()> {
    for name in [attrs.panic_in, attrs.fail_in] {
        if name != "none" && !Stage::ALL.iter().any(|s| s.name() == name) {
            return Err(FfiError::invalid_argument(format!(
                "unknown stage `{name}`: expected instantiate, prepare, initialize, execute or none"
            )));
        }
    }
    if attrs.panic_in == stage.name() {
        panic!("deliberate panic in the {stage} stage");
    }
    if attrs.fail_in == stage.name() {
        return Err(FfiError::failed_precondition(format!(
            "deliberate error in the {stage} stage"
        )));
    }
    Ok(())
}

/// The test targets' results have a fixed length.
fn require_len<T>(data: &[T], len: usize) -> FfiResult<()> {
    if data.len() != len {
        return Err(FfiError::invalid_argument(format!(
            "result 0 must have {len} elements, got {}",
            data.len()
        )));
    }
    Ok(())
}

pub struct Stages;

impl Bundle for Stages {
    const TARGET: &'static str = STAGES_TARGET;
    type State = StagesState;
}

impl Instantiate for Stages {
    type Attrs<'a> = StagesAttrs<'a>;
    fn instantiate(_ctx: &Context<'_>, attrs: StagesAttrs<'_>) -> FfiResult<StagesState> {
        misbehave(&attrs, Stage::Instantiate)?;
        let state = StagesState {
            live: LiveState::register(STAGES_TARGET, "rmsnorm_ffi.testing.StagesState"),
            calls: Default::default(),
        };
        state.count(Stage::Instantiate);
        Ok(state)
    }
}

impl Prepare for Stages {
    type Attrs<'a> = StagesAttrs<'a>;
    fn prepare(state: &StagesState, _ctx: &Context<'_>, attrs: StagesAttrs<'_>) -> FfiResult<()> {
        misbehave(&attrs, Stage::Prepare)?;
        state.count(Stage::Prepare);
        Ok(())
    }
}

impl Initialize for Stages {
    type Args<'a> = ArgsView<'a>;
    type Rets<'a> = ResultList<'a>;
    type Attrs<'a> = StagesAttrs<'a>;
    fn initialize(
        state: &StagesState,
        _ctx: &Context<'_>,
        _args: ArgsView<'_>,
        _rets: ResultList<'_>,
        attrs: StagesAttrs<'_>,
    ) -> FfiResult<()> {
        misbehave(&attrs, Stage::Initialize)?;
        state.count(Stage::Initialize);
        Ok(())
    }
}

impl Execute for Stages {
    type Args<'a> = ();
    type Rets<'a> = (ResultBuffer<'a, i32>,);
    type Attrs<'a> = StagesAttrs<'a>;
    fn execute(
        state: &StagesState,
        _ctx: &Context<'_>,
        (): (),
        (out,): (ResultBuffer<'_, i32>,),
        attrs: StagesAttrs<'_>,
    ) -> FfiResult<()> {
        misbehave(&attrs, Stage::Execute)?;
        state.live.record_execution();
        state.count(Stage::Execute);
        require_len(out.data, 4)?;
        for (o, c) in out.data.iter_mut().zip(&state.calls) {
            *o = c.load(Ordering::Relaxed).min(i32::MAX as u64) as i32;
        }
        Ok(())
    }
}

pub const STAGES_BUNDLE: BundleDef = BundleDef::of::<Stages>()
    .instantiate()
    .prepare()
    .initialize()
    .execute()
    .build();

pub struct ContextProbe;

impl Bundle for ContextProbe {
    const TARGET: &'static str = CONTEXT_TARGET;
    type State = NoState;
}

impl Execute for ContextProbe {
    type Args<'a> = ();
    type Rets<'a> = (ResultBuffer<'a, i32>,);
    type Attrs<'a> = ();
    fn execute(
        _state: &NoState,
        ctx: &Context<'_>,
        (): (),
        (out,): (ResultBuffer<'_, i32>,),
        (): (),
    ) -> FfiResult<()> {
        require_len(out.data, 4)?;
        let (sender, receiver) = mpsc::channel();
        ctx.schedule(Box::new(move || {
            let _ = sender.send(std::thread::current().id());
        }))?;
        let task_ran = receiver.recv_timeout(Duration::from_secs(30)).is_ok();
        out.data[0] = ctx.num_threads()?.clamp(0, i32::MAX as i64) as i32;
        out.data[1] = ctx.device_ordinal()?;
        // The run id is an arbitrary i64; its low 31 bits are enough to tell runs apart.
        out.data[2] = (ctx.run_id()? & 0x7fff_ffff) as i32;
        out.data[3] = task_ran as i32;
        Ok(())
    }
}

pub const CONTEXT_BUNDLE: BundleDef = BundleDef::of::<ContextProbe>().execute().build();

pub const ATTRS_TARGET: &str = "rmsnorm_ffi_testing_attrs";

/// Echoes its attributes: execute writes a description of every attribute (name, kind, value,
/// recursively through dictionaries) as UTF-8 into its `U8[n]` result, zero-padded. This proves
/// that the decoding layer reads XLA's real encoding of every attribute kind, not only the fake
/// runtime's.
pub struct AttrsEcho;

impl Bundle for AttrsEcho {
    const TARGET: &'static str = ATTRS_TARGET;
    type State = NoState;
}

impl Execute for AttrsEcho {
    type Args<'a> = ();
    type Rets<'a> = (ResultBuffer<'a, u8>,);
    type Attrs<'a> = Attrs<'a>;
    fn execute(
        _state: &NoState,
        _ctx: &Context<'_>,
        (): (),
        (out,): (ResultBuffer<'_, u8>,),
        attrs: Attrs<'_>,
    ) -> FfiResult<()> {
        let text = describe(attrs)?;
        if text.len() > out.data.len() {
            return Err(FfiError::invalid_argument(format!(
                "the description needs {} bytes, the result has {}",
                text.len(),
                out.data.len()
            )));
        }
        out.data.fill(0);
        out.data[..text.len()].copy_from_slice(text.as_bytes());
        Ok(())
    }
}

/// `name=kind:value` entries separated by `;`, dictionaries in braces.
pub fn describe(attrs: Attrs<'_>) -> FfiResult<String> {
    let mut parts = Vec::with_capacity(attrs.len());
    for i in 0..attrs.len() {
        let name = String::from_utf8_lossy(attrs.name(i)?).into_owned();
        let value = match attrs.value(i)? {
            AttrValue::Scalar(s) => format!("{}:{}", s.dtype(), scalar_text(s)),
            AttrValue::String(bytes) => format!("string:{}", String::from_utf8_lossy(bytes)),
            AttrValue::Dictionary(d) => format!("dict:{{{}}}", describe(d)?),
            AttrValue::Array(a) => format!("{}[{}]:{}", a.dtype(), a.len(), array_text(&a)?),
        };
        parts.push(format!("{name}={value}"));
    }
    Ok(parts.join(";"))
}

fn scalar_text(s: Scalar) -> String {
    match s {
        Scalar::Pred(v) => v.to_string(),
        Scalar::S8(v) => v.to_string(),
        Scalar::S16(v) => v.to_string(),
        Scalar::S32(v) => v.to_string(),
        Scalar::S64(v) => v.to_string(),
        Scalar::U8(v) => v.to_string(),
        Scalar::U16(v) => v.to_string(),
        Scalar::U32(v) => v.to_string(),
        Scalar::U64(v) => v.to_string(),
        Scalar::F16(v) => v.to_string(),
        Scalar::BF16(v) => v.to_string(),
        Scalar::F32(v) => v.to_string(),
        Scalar::F64(v) => v.to_string(),
        Scalar::Other(d) => format!("<{d}>"),
    }
}

fn join<T: ToString>(values: &[T]) -> String {
    values
        .iter()
        .map(T::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn array_text(a: &ArrayAttr<'_>) -> FfiResult<String> {
    Ok(match a.dtype() {
        DataType::S8 => join(a.as_slice::<i8>()?),
        DataType::S16 => join(a.as_slice::<i16>()?),
        DataType::S32 => join(a.as_slice::<i32>()?),
        DataType::S64 => join(a.as_slice::<i64>()?),
        DataType::U8 => join(a.as_slice::<u8>()?),
        DataType::U16 => join(a.as_slice::<u16>()?),
        DataType::U32 => join(a.as_slice::<u32>()?),
        DataType::U64 => join(a.as_slice::<u64>()?),
        DataType::F16 => join(a.as_slice::<half::f16>()?),
        DataType::BF16 => join(a.as_slice::<half::bf16>()?),
        DataType::F32 => join(a.as_slice::<f32>()?),
        DataType::F64 => join(a.as_slice::<f64>()?),
        other => format!("<{other}>"),
    })
}

pub const ATTRS_BUNDLE: BundleDef = BundleDef::of::<AttrsEcho>().execute().build();
