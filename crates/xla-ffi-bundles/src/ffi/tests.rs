//! Unit tests of the FFI layer against the fake runtime.

use half::{bf16, f16};

use super::attrs::{AttrValue, Attrs};
use super::bundle::{Bundle, BundleDef, Execute, Instantiate};
use super::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use super::sys::{self, XLA_FFI_DataType as Dt};
use super::*;

mod v0_5;

// ---------------------------------------------------------------------------------------------
// A probe bundle whose signature uses every decoder
// ---------------------------------------------------------------------------------------------

crate::ffi_attrs! {
    struct ProbeAttrs<'a> {
        b: bool,
        i8v: i8,
        i16v: i16,
        i32v: i32,
        i64v: i64,
        u8v: u8,
        u16v: u16,
        u32v: u32,
        u64v: u64,
        f16v: f16,
        bf16v: bf16,
        f32v: f32,
        f64v: f64,
        name: &'a str,
        ints: &'a [i64],
        floats: &'a [f32],
        nested: Attrs<'a>,
        optional: Option<i32>,
    }
}

/// What the probe saw, for the test to inspect.
static SEEN: parking_lot::Mutex<Vec<String>> = parking_lot::Mutex::new(Vec::new());

struct Probe;
impl Bundle for Probe {
    const TARGET: &'static str = "probe";
    type Platform = Host;
    type State = NoState;
}
impl Execute for Probe {
    type Args<'a> = (Buffer<'a, f32>, AnyBuffer<'a>);
    type Rets<'a> = (ResultBuffer<'a, f32>,);
    type Attrs<'a> = ProbeAttrs<'a>;
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (x, any): (Buffer<'_, f32>, AnyBuffer<'_>),
        (y,): (ResultBuffer<'_, f32>,),
        a: ProbeAttrs<'_>,
    ) -> FfiResult<()> {
        for (o, i) in y.data.iter_mut().zip(x.data) {
            *o = i * 2.0;
        }
        let nested_scale = match a.nested.get("scale") {
            Some(Ok(AttrValue::Scalar(Scalar::F32(v)))) => v,
            other => {
                return Err(FfiError::invalid_argument(format!(
                    "nested: {}",
                    other.is_some()
                )))
            }
        };
        SEEN.lock().push(format!(
            "{} {} {} {} {} {} {} {} {} {} {} {} {} {} {:?} {:?} {} {:?} {} {:?}",
            a.b,
            a.i8v,
            a.i16v,
            a.i32v,
            a.i64v,
            a.u8v,
            a.u16v,
            a.u32v,
            a.u64v,
            a.f16v,
            a.bf16v,
            a.f32v,
            a.f64v,
            a.name,
            a.ints,
            a.floats,
            nested_scale,
            a.optional,
            any.dtype(),
            any.dims()
        ));
        Ok(())
    }
}
const PROBE: BundleDef = BundleDef::of::<Probe>().execute().build();

// ---------------------------------------------------------------------------------------------
// A stateful bundle: a scaled copy of float32 rows with a table cached at instantiation
// ---------------------------------------------------------------------------------------------

crate::ffi_attrs! {
    struct ScaleAttrs {
        scale: f32,
        row_len: i64,
    }
}

struct ScaleState {
    live: crate::state::LiveState,
    table: Vec<f32>,
}
crate::state_type!(ScaleState, "rmsnorm_ffi.tests.ScaleState");

struct Scale;
impl Bundle for Scale {
    const TARGET: &'static str = "tests_scale";
    type Platform = Host;
    type State = ScaleState;
}
impl Instantiate for Scale {
    type Attrs<'a> = ScaleAttrs;
    fn instantiate(_: &Context<'_>, a: ScaleAttrs) -> FfiResult<ScaleState> {
        if !a.scale.is_finite() {
            return Err(FfiError::invalid_argument(format!(
                "invalid attribute `scale`: must be finite, got {}",
                a.scale
            )));
        }
        if !(1..=1 << 20).contains(&a.row_len) {
            return Err(FfiError::invalid_argument("invalid attribute `row_len`"));
        }
        Ok(ScaleState {
            live: crate::state::LiveState::register("tests_scale", "rmsnorm_ffi.tests.ScaleState"),
            table: (0..a.row_len).map(|j| a.scale / (j as f32 + 1.0)).collect(),
        })
    }
}
impl Execute for Scale {
    type Args<'a> = (Buffer<'a, f32>,);
    type Rets<'a> = (ResultBuffer<'a, f32>,);
    type Attrs<'a> = ();
    fn execute(
        state: &ScaleState,
        _: &Context<'_>,
        (x,): (Buffer<'_, f32>,),
        (y,): (ResultBuffer<'_, f32>,),
        (): (),
    ) -> FfiResult<()> {
        state.live.record_execution();
        let n = state.table.len();
        if x.dims.last() != Some(&(n as i64)) {
            return Err(FfiError::invalid_argument(format!(
                "last axis is {:?} but the call site was instantiated for row_len={n}",
                x.dims.last()
            )));
        }
        for (yr, xr) in y.data.chunks_mut(n).zip(x.data.chunks(n)) {
            for ((o, i), t) in yr.iter_mut().zip(xr).zip(&state.table) {
                *o = i * t;
            }
        }
        Ok(())
    }
}
const SCALE: BundleDef = BundleDef::of::<Scale>().instantiate().execute().build();

fn probe_attrs(b: FrameBuilder) -> FrameBuilder {
    b.attr("b", OwnedAttr::pred(true))
        .attr("i8v", OwnedAttr::scalar(-8i8))
        .attr("i16v", OwnedAttr::scalar(-16i16))
        .attr("i32v", OwnedAttr::scalar(-32i32))
        .attr("i64v", OwnedAttr::scalar(-64i64))
        .attr("u8v", OwnedAttr::scalar(8u8))
        .attr("u16v", OwnedAttr::scalar(16u16))
        .attr("u32v", OwnedAttr::scalar(32u32))
        .attr("u64v", OwnedAttr::scalar(64u64))
        .attr("f16v", OwnedAttr::scalar(f16::from_f32(0.5)))
        .attr("bf16v", OwnedAttr::scalar(bf16::from_f32(0.25)))
        .attr("f32v", OwnedAttr::scalar(1.5f32))
        .attr("f64v", OwnedAttr::scalar(2.5f64))
        .attr("name", OwnedAttr::string("hello"))
        .attr("ints", OwnedAttr::array(&[1i64, 2, 3]))
        .attr("floats", OwnedAttr::array::<f32>(&[]))
        .attr(
            "nested",
            OwnedAttr::Dict(vec![
                ("scale".into(), OwnedAttr::scalar(3.0f32)),
                (
                    "inner".into(),
                    OwnedAttr::Dict(vec![("deep".into(), OwnedAttr::string("x"))]),
                ),
            ]),
        )
}

fn probe_frame() -> FrameBuilder {
    probe_attrs(
        FrameBuilder::new(Stage::Execute)
            .arg(OwnedBuffer::from_values(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]))
            .arg(OwnedBuffer::from_values(&[3], &[1i32, 2, 3]))
            .ret(OwnedBuffer::zeros(DataType::F32, &[2, 2])),
    )
}

fn execute(def: &BundleDef) -> sys::XLA_FFI_Handler {
    def.handler(Stage::Execute).expect("execute stage")
}

fn call_err(frame: &mut fake::BuiltFrame, def: &BundleDef, stage: Stage) -> (ErrorCode, String) {
    frame
        .call(def.handler(stage).unwrap())
        .expect_err("the call should fail")
}

// ---------------------------------------------------------------------------------------------
// Attributes and buffers
// ---------------------------------------------------------------------------------------------

#[test]
fn decodes_every_attribute_kind_and_typed_buffers() {
    let ctx = FakeContext::new();
    let mut frame = probe_frame().build(&ctx);
    frame.call(execute(&PROBE)).unwrap();
    assert_eq!(frame.result(0).values::<f32>(), vec![2.0, 4.0, 6.0, 8.0]);
    let seen = SEEN
        .lock()
        .iter()
        .find(|s| s.starts_with("true -8"))
        .cloned()
        .unwrap();
    assert_eq!(
        seen,
        "true -8 -16 -32 -64 8 16 32 64 0.5 0.25 1.5 2.5 hello [1, 2, 3] [] 3 None S32 [3]"
    );
}

#[test]
fn optional_attribute_present() {
    let ctx = FakeContext::new();
    let mut frame = probe_frame()
        .attr("optional", OwnedAttr::scalar(7i32))
        .build(&ctx);
    frame.call(execute(&PROBE)).unwrap();
    assert!(SEEN.lock().iter().any(|s| s.contains("Some(7)")));
}

#[test]
fn reports_every_decode_failure_together() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2], &[bf16::ONE, bf16::ONE]))
        .arg(OwnedBuffer::from_values(&[1], &[1i32]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[2]))
        .attr("f32v", OwnedAttr::scalar(0.1f64))
        .attr("bogus", OwnedAttr::scalar(1i32))
        .attr("name", OwnedAttr::String(vec![0xff, 0xfe]))
        .build(&ctx);
    let (code, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert_eq!(code, ErrorCode::InvalidArgument);
    for expected in [
        "probe: [execute] failed to decode the call frame",
        "wrong dtype for argument 0: expected F32, got BF16",
        "wrong type for attribute `f32v`: expected F32 scalar, got F64 scalar 0.1, which F32 \
         cannot hold exactly: pass np.float32(0.1)",
        "unexpected attribute `bogus`",
        "missing attribute `b` (PRED scalar)",
        "missing attribute `ints` (S64 array)",
        "missing attribute `nested` (dictionary)",
        "wrong type for attribute `name`: expected UTF-8 string, got string",
    ] {
        assert!(
            message.contains(expected),
            "missing {expected:?} in {message}"
        );
    }
    assert!(!message.contains("`optional`"), "{message}");
}

#[test]
fn wrong_array_dtype_and_kind() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[1]))
        .attr("ints", OwnedAttr::string("not an array"))
        .attr("nested", OwnedAttr::scalar(1i64))
        .attr("floats", OwnedAttr::array(&[1i32]))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(
        message.contains("attribute `ints`: expected S64 array, got string"),
        "{message}"
    );
    assert!(
        message.contains("attribute `nested`: expected dictionary, got S64 scalar"),
        "{message}"
    );
    assert!(
        message.contains("attribute `floats`: expected F32 array, got S32 array"),
        "{message}"
    );
}

#[test]
fn wrong_operand_counts() {
    let ctx = FakeContext::new();
    let mut frame = probe_attrs(
        FrameBuilder::new(Stage::Execute)
            .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
            .ret(OwnedBuffer::zeros(DataType::F32, &[1]))
            .ret(OwnedBuffer::zeros(DataType::F32, &[1])),
    )
    .build(&ctx);
    let (_, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(
        message.contains("wrong number of arguments: expected 2, got 1"),
        "{message}"
    );
    assert!(
        message.contains("wrong number of results: expected 1, got 2"),
        "{message}"
    );
}

// ---------------------------------------------------------------------------------------------
// Malformed frames
// ---------------------------------------------------------------------------------------------

/// Runs the probe on a frame after `edit`, expecting an error containing `expected`.
fn malformed(expected: &str, edit: impl FnOnce(&mut fake::BuiltFrame)) {
    let ctx = FakeContext::new();
    let mut frame = probe_frame().build(&ctx);
    edit(&mut frame);
    let (code, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(
        message.contains(expected),
        "expected {expected:?} in {message:?}"
    );
    assert_ne!(code, ErrorCode::Unknown);
}

#[test]
fn malformed_call_frame_struct_size() {
    malformed("unexpected XLA_FFI_CallFrame size", |f| {
        f.frame.struct_size = 40
    });
}

#[test]
fn malformed_list_struct_sizes() {
    malformed("unexpected arguments struct size", |f| {
        f.frame.args.struct_size = 8
    });
    malformed("unexpected results struct size", |f| {
        f.frame.rets.struct_size = 0
    });
    malformed("unexpected attributes struct size", |f| {
        f.frame.attrs.struct_size = 1
    });
}

#[test]
fn malformed_counts() {
    malformed("invalid number of arguments: -1", |f| {
        f.frame.args.size = -1
    });
    malformed("invalid number of results: 4294967296", |f| {
        f.frame.rets.size = 1 << 32
    });
    malformed("invalid number of attributes: -5", |f| {
        f.frame.attrs.size = -5
    });
    malformed("2 arguments announced but the lists are null", |f| {
        f.frame.args.args = std::ptr::null_mut()
    });
    malformed("attributes announced but the lists are null", |f| {
        f.frame.attrs.names = std::ptr::null_mut()
    });
}

#[test]
fn malformed_operand_types() {
    malformed("argument 1 has unsupported type 7", |f| f.args.types[1] = 7);
    malformed("result 0 has unsupported type 0", |f| f.rets.types[0] = 0);
    malformed("argument 0 is a null buffer pointer", |f| {
        f.args.ptrs[0] = std::ptr::null_mut()
    });
}

#[test]
fn malformed_buffers() {
    malformed("argument 0: unexpected XLA_FFI_Buffer size", |f| {
        f.args.raw[0].struct_size = 16
    });
    malformed("argument 0 has invalid rank -1", |f| {
        f.args.raw[0].rank = -1
    });
    malformed("argument 1 has invalid rank 1000", |f| {
        f.args.raw[1].rank = 1000
    });
    malformed("argument 0 has rank 2 but no dimensions", |f| {
        f.args.raw[0].dims = std::ptr::null_mut()
    });
    malformed("argument 0 has a negative dimension", |f| {
        f.args.owned[0].dims[1] = -3
    });
    malformed("element count of", |f| {
        f.args.owned[0].dims[0] = i64::MAX;
        f.args.owned[0].dims[1] = 4;
    });
    malformed("result 0 of 16 bytes has a null data pointer", |f| {
        f.rets.raw[0].data = std::ptr::null_mut()
    });
    malformed("argument 0 has unsupported dtype UNKNOWN(99)", |f| {
        f.args.raw[0].dtype = Dt(99)
    });
    malformed("wrong dtype for result 0: expected F32, got F64", |f| {
        f.rets.raw[0].dtype = Dt::F64
    });
    malformed("argument 0 is not aligned for F32", |f| {
        f.args.raw[0].data = f.args.raw[0].data.cast::<u8>().wrapping_add(1).cast()
    });
}

#[test]
fn malformed_aliasing_is_refused() {
    // The probe's result 0 has argument 0's size: the same buffer, named as an undeclared pair.
    malformed("result 0 is argument 0's buffer", |f| {
        f.rets.raw[0].data = f.args.raw[0].data;
    });
    malformed("result 0 overlaps argument 0 in memory", |f| {
        f.rets.raw[0].data = f.args.raw[0].data.cast::<u8>().wrapping_add(4).cast();
    });
    // A result written over another buffer's dimensions would alias a shared slice too.
    malformed("result 0 overlaps argument 0's dimensions in memory", |f| {
        f.rets.raw[0].data = f.args.raw[0].dims.cast();
    });
    malformed("result 0 overlaps its own dimensions", |f| {
        f.rets.raw[0].data = f.rets.raw[0].dims.cast();
    });
    malformed("wrap around the address space", |f| {
        f.args.raw[0].data = (usize::MAX - 8) as *mut std::ffi::c_void;
    });
}

struct Impostor;
impl StateType for Impostor {
    fn registration() -> &'static StateTypeRegistration {
        ScaleState::registration()
    }
}

#[test]
fn a_registration_is_checked_against_its_rust_type() {
    let registration = Impostor::registration();
    let err = registration.check_type::<Impostor>().unwrap_err();
    assert!(
        err.to_string().contains("registered for another Rust type"),
        "{err}"
    );
    registration.check_type::<ScaleState>().unwrap();
}

#[test]
fn malformed_attributes() {
    malformed("attribute 0 has a null name", |f| {
        f.attrs.name_ptrs[0] = std::ptr::null_mut()
    });
    malformed("has unknown type 9", |f| {
        f.attrs.types[3] = sys::XLA_FFI_AttrType(9)
    });
    malformed("is a null pointer", |f| {
        f.attrs.value_ptrs[2] = std::ptr::null_mut()
    });
}

#[test]
fn wrong_stage_is_refused() {
    let ctx = FakeContext::new();
    let mut frame = probe_frame().build(&ctx);
    frame.frame.stage = sys::XLA_FFI_ExecutionStage::INSTANTIATE;
    let (code, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(
        message.contains("this handler is for `execute`, the call is for `instantiate`"),
        "{message}"
    );
    frame.frame.stage = sys::XLA_FFI_ExecutionStage(17);
    let (_, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(message.contains("the call is for `stage 17`"), "{message}");
}

#[test]
fn null_frame_or_api_returns_without_crashing() {
    let handler = execute(&PROBE);
    let ctx = FakeContext::new();
    // A valid call first: the trampoline remembers the process's API table.
    probe_frame().build(&ctx).call(handler).unwrap();
    // SAFETY: the trampoline accepts a null frame.
    let err = fake::take_result(unsafe { handler(std::ptr::null_mut()) }).unwrap_err();
    assert!(err.1.contains("null call frame"), "{err:?}");
    let mut frame = probe_frame().build(&ctx);
    frame.frame.api = std::ptr::null();
    let (_, message) = frame.call(handler).unwrap_err();
    assert!(message.contains("no usable XLA_FFI_Api table"), "{message}");
    assert!(
        frame.result(0).values::<f32>().iter().all(|&v| v == 0.0),
        "nothing ran"
    );
}

#[test]
fn metadata_is_answered_without_an_api_table() {
    // Some XLA versions send the registration-time metadata call with a null `api`.
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame.frame.api = std::ptr::null();
    frame.call(execute(&PROBE)).unwrap();
    let md = frame.metadata().unwrap();
    assert_eq!(
        (md.api_version.major_version, md.api_version.minor_version),
        (0, 3)
    );
}

#[test]
fn old_api_table_reports_missing_functions() {
    // A table that ends before XLA_FFI_State_Get.
    let size = std::mem::offset_of!(sys::XLA_FFI_Api, XLA_FFI_State_Get);
    let ctx = FakeContext::new();
    fake::register_type(ScaleState::registration()).unwrap();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .api(fake::api_with_size(size))
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[1]))
        .build(&ctx);
    let (code, message) = frame.call(execute(&SCALE)).unwrap_err();
    assert_eq!(code, ErrorCode::Unimplemented);
    assert!(
        message.contains("(version 0.3, 112 bytes) ends before XLA_FFI_State_Get"),
        "{message}"
    );
}

// ---------------------------------------------------------------------------------------------
// Metadata
// ---------------------------------------------------------------------------------------------

#[test]
fn metadata_answer_for_stateless_handler() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame.call(execute(&PROBE)).unwrap();
    let md = frame.metadata().unwrap();
    assert_eq!(
        (md.api_version.major_version, md.api_version.minor_version),
        (0, 5)
    );
    assert_eq!(
        md.api_version.struct_size,
        sys::XLA_FFI_Api_Version::STRUCT_SIZE
    );
    assert_eq!(md.traits, 0);
    assert_eq!(md.state_type_id.type_id, 0);
}

#[test]
fn metadata_answer_is_given_before_any_decoding() {
    // The metadata call has no operands at all; a handler that decoded first would fail.
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame.frame.stage = sys::XLA_FFI_ExecutionStage::INSTANTIATE;
    frame.call(execute(&PROBE)).unwrap();
}

struct Unregistered;
struct UnregisteredState;
crate::state_type!(UnregisteredState, "rmsnorm_ffi.tests.Unregistered");
impl Bundle for Unregistered {
    const TARGET: &'static str = "unregistered";
    type Platform = Host;
    const TRAITS: Traits = Traits::COMMAND_BUFFER_COMPATIBLE;
    type State = UnregisteredState;
}
impl Instantiate for Unregistered {
    type Attrs<'a> = ();
    fn instantiate(_: &Context<'_>, _: ()) -> FfiResult<UnregisteredState> {
        Ok(UnregisteredState)
    }
}
impl Execute for Unregistered {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &UnregisteredState, _: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
        Ok(())
    }
}
const UNREGISTERED: BundleDef = BundleDef::of::<Unregistered>()
    .instantiate()
    .execute()
    .build();

#[test]
fn metadata_of_unregistered_state_type_is_refused() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::metadata().build(&ctx);
    let (code, message) = call_err(&mut frame, &UNREGISTERED, Stage::Instantiate);
    assert_eq!(code, ErrorCode::FailedPrecondition);
    assert!(
        message.contains("Types used by FFI handlers must be registered"),
        "{message}"
    );
    assert!(
        message.contains("rmsnorm_ffi.tests.Unregistered"),
        "{message}"
    );
    // The execute stage creates no state, so its metadata does not name the type.
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame.call(execute(&UNREGISTERED)).unwrap();
    let md = frame.metadata().unwrap();
    assert_eq!(
        md.traits,
        sys::XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
    );
    assert_eq!(md.state_type_id.type_id, 0);
}

#[test]
fn metadata_names_the_registered_state_type() {
    fake::register_type(ScaleState::registration()).unwrap();
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame
        .call(SCALE.handler(Stage::Instantiate).unwrap())
        .unwrap();
    let id = frame.metadata().unwrap().state_type_id.type_id;
    assert!(id > 0);
    assert_eq!(id, ScaleState::registration().type_id());
}

#[test]
fn malformed_metadata_is_refused() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame.metadata.as_mut().unwrap().1.struct_size = 4;
    let (_, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(
        message.contains("unexpected XLA_FFI_Metadata size"),
        "{message}"
    );
    let mut frame = FrameBuilder::metadata().build(&ctx);
    frame.metadata.as_mut().unwrap().0.metadata = std::ptr::null_mut();
    let (_, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(
        message.contains("metadata extension without metadata"),
        "{message}"
    );
}

// ---------------------------------------------------------------------------------------------
// Stateful bundles, panics, context
// ---------------------------------------------------------------------------------------------

fn scale_frame(stage: Stage, x: &[f32], dims: &[i64], row_len: i64) -> FrameBuilder {
    let b = FrameBuilder::new(stage)
        .attr("scale", OwnedAttr::scalar(2.0f32))
        .attr("row_len", OwnedAttr::scalar(row_len));
    match stage {
        Stage::Execute => b
            .arg(OwnedBuffer::from_values(dims, x))
            .ret(OwnedBuffer::zeros(DataType::F32, dims)),
        _ => b,
    }
}

#[test]
fn stateful_bundle_lives_from_instantiate_to_deleter() {
    fake::register_type(ScaleState::registration()).unwrap();
    let ctx = FakeContext::new();
    let mut inst = scale_frame(Stage::Instantiate, &[], &[], 3).build(&ctx);
    inst.call(SCALE.handler(Stage::Instantiate).unwrap())
        .unwrap();
    assert_eq!(ctx.state_count(), 1);
    let state_id = ctx.state::<ScaleState>().unwrap().live.id();
    for _ in 0..3 {
        let mut exec =
            scale_frame(Stage::Execute, &[1.0, 1.0, 3.0, 2.0, 2.0, 6.0], &[2, 3], 3).build(&ctx);
        exec.call(execute(&SCALE)).unwrap();
        assert_eq!(
            exec.result(0).values::<f32>(),
            vec![2.0, 1.0, 2.0, 4.0, 2.0, 4.0]
        );
    }
    let snap = crate::state::snapshot();
    assert_eq!(
        snap.states
            .iter()
            .find(|s| s.id == state_id)
            .unwrap()
            .executions,
        3
    );
    // A row length other than the one instantiated for is refused.
    let mut exec = scale_frame(Stage::Execute, &[1.0; 4], &[4], 3).build(&ctx);
    let (_, message) = exec.call(execute(&SCALE)).unwrap_err();
    assert!(message.contains("instantiated for row_len=3"), "{message}");
    drop(ctx);
    let snap = crate::state::snapshot();
    assert!(
        snap.states.iter().all(|s| s.id != state_id),
        "the deleter ran"
    );
}

#[test]
fn instantiate_validates_attributes() {
    fake::register_type(ScaleState::registration()).unwrap();
    let ctx = FakeContext::new();
    let mut inst = FrameBuilder::new(Stage::Instantiate)
        .attr("scale", OwnedAttr::scalar(f32::NAN))
        .attr("row_len", OwnedAttr::scalar(4i64))
        .build(&ctx);
    let (code, message) = inst
        .call(SCALE.handler(Stage::Instantiate).unwrap())
        .unwrap_err();
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(
        message.contains("invalid attribute `scale`: must be finite, got NaN"),
        "{message}"
    );
    assert_eq!(ctx.state_count(), 0);
    // Executing without a state is an error, not a crash.
    let mut exec = scale_frame(Stage::Execute, &[1.0; 4], &[4], 4).build(&ctx);
    let (_, message) = exec.call(execute(&SCALE)).unwrap_err();
    assert!(
        message.contains("XLA_FFI_State_Get failed: State is not set"),
        "{message}"
    );
}

#[test]
fn state_can_be_set_only_once() {
    fake::register_type(ScaleState::registration()).unwrap();
    let ctx = FakeContext::new();
    let before = crate::state::snapshot();
    for expect_ok in [true, false] {
        let mut inst = scale_frame(Stage::Instantiate, &[], &[], 2).build(&ctx);
        let result = inst.call(SCALE.handler(Stage::Instantiate).unwrap());
        assert_eq!(result.is_ok(), expect_ok, "{result:?}");
    }
    // The refused state was dropped (created 2, one destroyed already).
    let after = crate::state::snapshot();
    assert!(after.destroyed_states > before.destroyed_states);
    assert_eq!(ctx.state_count(), 1);
}

struct MemoryUser;
impl Bundle for MemoryUser {
    const TARGET: &'static str = "memory_user";
    type Platform = Host;
    type State = NoState;
}
impl Execute for MemoryUser {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &NoState, ctx: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
        let a = ctx.allocate(100, 8)?;
        let b = ctx.allocate(10, 4)?;
        assert!(!a.device_ptr().is_null() && a.size() == 100 && b.size() == 10);
        let err = ctx.stream().unwrap_err();
        assert!(
            err.to_string().contains("no stream on this platform"),
            "{err}"
        );
        Ok(())
    }
}
const MEMORY_USER: BundleDef = BundleDef::of::<MemoryUser>().execute().build();

#[test]
fn device_memory_is_returned_and_stream_errors_are_reported() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute).build(&ctx);
    frame.call(execute(&MEMORY_USER)).unwrap();
    assert_eq!(ctx.outstanding_allocations(), 0);
}

// ---------------------------------------------------------------------------------------------
// Panics where C has no error to return: deleters and thread-pool tasks
// ---------------------------------------------------------------------------------------------

struct PanickyDrop;
impl Drop for PanickyDrop {
    fn drop(&mut self) {
        panic!("deliberate panic in a state's drop");
    }
}
crate::state_type!(PanickyDrop, "rmsnorm_ffi.tests.PanickyDrop");

#[test]
fn panicking_deleter_is_contained() {
    let registration = PanickyDrop::registration();
    let raw = Box::into_raw(Box::new(PanickyDrop));
    // SAFETY: `raw` is a live `Box<PanickyDrop>`, deleted once, as XLA would.
    unsafe { super::types::delete_state::<PanickyDrop>(raw.cast()) };
    // SAFETY: a null state is ignored.
    unsafe { super::types::delete_state::<PanickyDrop>(std::ptr::null_mut()) };
    assert_eq!(registration.name(), "rmsnorm_ffi.tests.PanickyDrop");
}

struct Scheduler;
impl Bundle for Scheduler {
    const TARGET: &'static str = "scheduler";
    type Platform = Host;
    type State = NoState;
}
impl Execute for Scheduler {
    type Args<'a> = ArgsView<'a>;
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &NoState, ctx: &Context<'_>, args: ArgsView<'_>, _: (), _: ()) -> FfiResult<()> {
        // A task that panics is contained; a later task still runs.
        ctx.schedule(Box::new(|| panic!("deliberate panic in a task")))?;
        let (sender, receiver) = std::sync::mpsc::channel();
        let count = args.len();
        ctx.schedule(Box::new(move || sender.send(count).unwrap()))?;
        let got = receiver
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap();
        if got != 3 {
            return Err(FfiError::internal(format!("variadic args: {got}")));
        }
        // Variadic arguments are validated one by one on access.
        let dims: Vec<_> = (0..args.len())
            .map(|i| args.get(i).map(|b| b.dims().to_vec()))
            .collect();
        if dims != vec![Ok(vec![1]), Ok(vec![2, 2]), Ok(vec![])] {
            return Err(FfiError::internal(format!("{dims:?}")));
        }
        Ok(())
    }
}
const SCHEDULER: BundleDef = BundleDef::of::<Scheduler>().execute().build();

#[test]
fn panicking_task_is_contained_and_variadic_args_decode() {
    for inline in [true, false] {
        let mut ctx = FakeContext::new();
        ctx.inline_tasks = inline;
        let mut frame = FrameBuilder::new(Stage::Execute)
            .arg(OwnedBuffer::from_values(&[1], &[1u8]))
            .arg(OwnedBuffer::from_values(&[2, 2], &[1.0f64; 4]))
            .arg(OwnedBuffer::from_values::<i16>(&[], &[7]))
            .build(&ctx);
        frame.call(execute(&SCHEDULER)).unwrap();
    }
}

#[test]
fn runtime_version_is_readable() {
    // SAFETY: the fake table is a valid, static `XLA_FFI_Api`.
    let api = unsafe { super::api::Api::from_raw(fake::api()) }.unwrap();
    assert_eq!(api.version(), (0, 5));
    assert!(api.speaks(5) && api.speaks(3));
    // SAFETY: as above.
    let old = unsafe { super::api::Api::from_raw(fake::api_v0_3()) }.unwrap();
    assert_eq!(old.version(), (0, 3));
    assert!(!old.speaks(5));
    // SAFETY: a table too small to create errors is refused, not used.
    let small = unsafe { super::api::Api::from_raw(fake::api_with_size(16)) };
    assert!(small.is_err());
}

struct Duplicate;
crate::state_type!(Duplicate, "rmsnorm_ffi.tests.Duplicate");
struct SameName;
crate::state_type!(SameName, "rmsnorm_ffi.tests.Duplicate");

#[test]
fn a_state_type_name_is_registered_once_as_xla_does() {
    // One registration, twice (as for a second platform): the same id, no error.
    let id = fake::register_type(Duplicate::registration()).unwrap();
    assert_eq!(fake::register_type(Duplicate::registration()), Ok(id));
    // Another type under the same name (another library that did not namespace its names) is
    // refused with XLA's message, and its cell stays unset.
    let (code, message) = fake::register_type(SameName::registration()).unwrap_err();
    assert_eq!(code, ErrorCode::Internal);
    assert_eq!(
        message,
        format!("Type name rmsnorm_ffi.tests.Duplicate already registered with type id {id}")
    );
    assert_eq!(SameName::registration().type_id(), 0);
}

// ---------------------------------------------------------------------------------------------
// What a newcomer hit (issue 44): Python floats for f32, string enums, stage tags, typed ranks
// ---------------------------------------------------------------------------------------------

#[test]
fn float_attributes_take_the_other_width_when_exact_and_name_the_fix_otherwise() {
    use super::attrs::FromAttr;
    let f64_scalar = |v: f64| AttrValue::Scalar(Scalar::F64(v));
    // A Python float arrives as F64: exact values decode as f32, NaN and infinities too.
    assert_eq!(f32::from_attr(f64_scalar(0.5)), Some(0.5));
    assert_eq!(f32::from_attr(f64_scalar(-1e30f32 as f64)), Some(-1e30));
    assert_eq!(
        f32::from_attr(f64_scalar(f64::INFINITY)),
        Some(f32::INFINITY)
    );
    assert!(f32::from_attr(f64_scalar(f64::NAN)).unwrap().is_nan());
    // Rounding, overflow and underflow are refused with the fix in the message.
    for inexact in [0.1, 1e300, 1e-300] {
        assert_eq!(f32::from_attr(f64_scalar(inexact)), None, "{inexact}");
        let message = f32::mismatch(f64_scalar(inexact));
        assert!(
            message.contains(&format!("pass np.float32({inexact})")),
            "{message}"
        );
    }
    // F32 widens to f64 exactly; an integer is still no float.
    assert_eq!(
        f64::from_attr(AttrValue::Scalar(Scalar::F32(0.1))),
        Some(0.1f32 as f64)
    );
    assert_eq!(f32::from_attr(AttrValue::Scalar(Scalar::S32(1))), None);
    assert_eq!(
        f32::mismatch(AttrValue::Scalar(Scalar::S32(7))),
        "expected F32 scalar, got S32 scalar 7"
    );
}

#[test]
fn an_f64_attribute_for_an_f32_field_instantiates_a_state() {
    fake::register_type(ScaleState::registration()).unwrap();
    let ctx = FakeContext::new();
    let mut inst = FrameBuilder::new(Stage::Instantiate)
        .attr("scale", OwnedAttr::scalar(0.75f64))
        .attr("row_len", OwnedAttr::scalar(2i64))
        .build(&ctx);
    inst.call(SCALE.handler(Stage::Instantiate).unwrap())
        .unwrap();
    assert_eq!(ctx.state::<ScaleState>().unwrap().table, vec![0.75, 0.375]);
}

crate::ffi_string_enum! {
    /// How the ranked probe fills its result.
    enum Fill {
        /// A copy of the argument.
        Copy = "copy",
        /// Zeros.
        Zero = "zero",
    }
}

crate::ffi_attrs! {
    struct RankedAttrs {
        fill: Fill,
    }
}

/// Host bundle with typed ranks: matrices in, matrix out, and a shape check of its own.
struct RankedProbe;
impl Bundle for RankedProbe {
    const TARGET: &'static str = "ranked_probe";
    type Platform = Host;
    type State = NoState;
}
impl Execute for RankedProbe {
    type Args<'a> = (RankedBuffer<'a, f32, 2>, RankedBuffer<'a, i32, 1>);
    type Rets<'a> = (RankedResult<'a, f32, 2>,);
    type Attrs<'a> = RankedAttrs;
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (x, _): (RankedBuffer<'_, f32, 2>, RankedBuffer<'_, i32, 1>),
        (y,): (RankedResult<'_, f32, 2>,),
        attrs: RankedAttrs,
    ) -> FfiResult<()> {
        let [_rows, cols] = x.dims;
        if y.dims != x.dims {
            return Err(Operand::Result(0).wrong_shape(format!(
                "expected {:?} like argument 0, got {:?}",
                x.dims, y.dims
            )));
        }
        assert_eq!(x.data.len() as i64 % cols.max(1), 0);
        match attrs.fill {
            Fill::Copy => y.data.copy_from_slice(x.data),
            Fill::Zero => y.data.fill(0.0),
        }
        Ok(())
    }
}
const RANKED_PROBE: BundleDef = BundleDef::of::<RankedProbe>().execute().build();

fn ranked_frame(x_dims: &[i64], y_dims: &[i64], fill: &str) -> FrameBuilder {
    let n = x_dims.iter().product::<i64>() as usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(x_dims, &x))
        .arg(OwnedBuffer::from_values(&[2], &[1i32, 2]))
        .ret(OwnedBuffer::zeros(DataType::F32, y_dims))
        .attr("fill", OwnedAttr::string(fill))
}

#[test]
fn ranked_buffers_decode_with_array_dims_and_string_enums_by_name() {
    let ctx = FakeContext::new();
    let mut frame = ranked_frame(&[2, 3], &[2, 3], "copy").build(&ctx);
    frame.call(execute(&RANKED_PROBE)).unwrap();
    assert_eq!(
        frame.result(0).values::<f32>(),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    assert_eq!(Fill::NAMES, ["copy", "zero"]);
    assert_eq!(
        (Fill::parse("zero"), Fill::Copy.name()),
        (Some(Fill::Zero), "copy")
    );
}

#[test]
fn a_wrong_rank_dtype_or_enum_name_is_reported_with_the_other_decode_errors() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2, 1, 1], &[1.0f32, 2.0]))
        .arg(OwnedBuffer::from_values(&[2], &[1.0f32, 2.0]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[2]))
        .attr("fill", OwnedAttr::string("fsat"))
        .build(&ctx);
    let (code, message) = call_err(&mut frame, &RANKED_PROBE, Stage::Execute);
    assert_eq!(code, ErrorCode::InvalidArgument);
    for expected in [
        "ranked_probe: [execute] failed to decode the call frame",
        "argument 0: expected F32 buffer of rank 2, got F32 buffer of rank 3 (dims [2, 1, 1])",
        "argument 1: expected S32 buffer of rank 1, got F32 buffer of rank 1",
        "result 0: expected F32 buffer of rank 2, got F32 buffer of rank 1",
        "wrong type for attribute `fill`: expected one of \"copy\", \"zero\" (string), got \
         string \"fsat\"",
    ] {
        assert!(
            message.contains(expected),
            "missing {expected:?} in {message}"
        );
    }
}

#[test]
fn errors_a_stage_returns_carry_the_stage_like_decode_errors() {
    let ctx = FakeContext::new();
    let mut frame = ranked_frame(&[2, 3], &[3, 2], "zero").build(&ctx);
    let (code, message) = call_err(&mut frame, &RANKED_PROBE, Stage::Execute);
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert_eq!(
        message,
        "ranked_probe: [execute] wrong shape for result 0: expected [2, 3] like argument 0, got \
         [3, 2]"
    );
    // Instantiate's own errors too.
    fake::register_type(ScaleState::registration()).unwrap();
    let mut inst = scale_frame(Stage::Instantiate, &[], &[], 0).build(&ctx);
    let (_, message) = call_err(&mut inst, &SCALE, Stage::Instantiate);
    assert_eq!(
        message,
        "tests_scale: [instantiate] invalid attribute `row_len`"
    );
}

/// Device bundle with typed ranks: addresses typed like the elements.
struct DeviceProbe;
impl Bundle for DeviceProbe {
    const TARGET: &'static str = "device_probe";
    type Platform = Cuda;
    type State = NoState;
}
impl Execute for DeviceProbe {
    type Args<'a> = (DeviceBuffer<'a, Cuda, bf16, 3>,);
    type Rets<'a> = (DeviceResult<'a, Cuda, f32, 1>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (x,): (DeviceBuffer<'_, Cuda, bf16, 3>,),
        (y,): (DeviceResult<'_, Cuda, f32, 1>,),
        (): (),
    ) -> FfiResult<()> {
        let [a, b, c] = x.dims;
        let seen = format!(
            "{a}x{b}x{c} {} -> {:?} {} {}",
            x.element_count(),
            y.dims,
            y.element_count(),
            !x.device_ptr().is_null() && !y.device_ptr().is_null()
        );
        SEEN.lock().push(seen);
        Ok(())
    }
}
const DEVICE_PROBE: BundleDef = BundleDef::of::<DeviceProbe>().execute().build();

#[test]
fn device_buffers_are_checked_for_dtype_and_rank_at_decode() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::zeros(DataType::BF16, &[1, 2, 3]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[5]))
        .build(&ctx);
    frame.call(execute(&DEVICE_PROBE)).unwrap();
    assert!(SEEN.lock().iter().any(|s| s == "1x2x3 6 -> [5] 5 true"));
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::zeros(DataType::F32, &[1, 2, 3]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[5, 1]))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &DEVICE_PROBE, Stage::Execute);
    for expected in [
        "argument 0: expected BF16 buffer of rank 3, got F32 buffer of rank 3",
        "result 0: expected F32 buffer of rank 1, got F32 buffer of rank 2",
    ] {
        assert!(
            message.contains(expected),
            "missing {expected:?} in {message}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// In-place results (input_output_aliases)
// ---------------------------------------------------------------------------------------------

/// `acc += x` in place: argument 0 is the accumulator, result 0 its buffer.
struct Accumulate;
impl Bundle for Accumulate {
    const TARGET: &'static str = "accumulate";
    type Platform = Host;
    type State = NoState;
}
impl Execute for Accumulate {
    type Args<'a> = (AliasedArg<'a>, Buffer<'a, f32>);
    type Rets<'a> = (InPlaceBuffer<'a, f32, 0>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (acc, x): (AliasedArg<'_>, Buffer<'_, f32>),
        (out,): (InPlaceBuffer<'_, f32, 0>,),
        (): (),
    ) -> FfiResult<()> {
        if acc.dims() != x.dims {
            return Err(x_operand_shape(acc.dims(), x.dims));
        }
        for (o, v) in out.data.iter_mut().zip(x.data) {
            *o += v;
        }
        Ok(())
    }
}
const ACCUMULATE: BundleDef = BundleDef::of::<Accumulate>().execute().build();

fn x_operand_shape(want: &[i64], got: &[i64]) -> FfiError {
    Operand::Argument(1).wrong_shape(format!("expected {want:?} like argument 0, got {got:?}"))
}

/// The same update declared wrongly: argument 0 also taken as a readable buffer.
struct ReadsTheAliasedArgument;
impl Bundle for ReadsTheAliasedArgument {
    const TARGET: &'static str = "reads_the_aliased_argument";
    type Platform = Host;
    type State = NoState;
}
impl Execute for ReadsTheAliasedArgument {
    type Args<'a> = (Buffer<'a, f32>, Buffer<'a, f32>);
    type Rets<'a> = (InPlace<'a, 0>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        _: (Buffer<'_, f32>, Buffer<'_, f32>),
        _: (InPlace<'_, 0>,),
        (): (),
    ) -> FfiResult<()> {
        unreachable!("decoding refuses the pair")
    }
}
const READS_THE_ALIASED_ARGUMENT: BundleDef =
    BundleDef::of::<ReadsTheAliasedArgument>().execute().build();

/// Arguments taken as a list (any of them viewable) with an in-place result.
struct ListedArguments;
impl Bundle for ListedArguments {
    const TARGET: &'static str = "listed_arguments";
    type Platform = Host;
    type State = NoState;
}
impl Execute for ListedArguments {
    type Args<'a> = ArgsView<'a>;
    type Rets<'a> = (InPlace<'a, 0>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        _: ArgsView<'_>,
        _: (InPlace<'_, 0>,),
        (): (),
    ) -> FfiResult<()> {
        unreachable!("decoding refuses the pair")
    }
}
const LISTED_ARGUMENTS: BundleDef = BundleDef::of::<ListedArguments>().execute().build();

/// A device update in place: the address it gets is the argument's.
struct DeviceInPlace;
impl Bundle for DeviceInPlace {
    const TARGET: &'static str = "device_in_place";
    type Platform = Cuda;
    type State = NoState;
}
impl Execute for DeviceInPlace {
    type Args<'a> = (AliasedArg<'a, Cuda>,);
    type Rets<'a> = (InPlace<'a, 0, Cuda>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (arg,): (AliasedArg<'_, Cuda>,),
        (out,): (InPlace<'_, 0, Cuda>,),
        (): (),
    ) -> FfiResult<()> {
        SEEN.lock().push(format!(
            "in place {:#x} {:?} {}",
            out.device_ptr() as usize,
            arg.dims(),
            InPlace::<'_, 0, Cuda>::ARGUMENT
        ));
        Ok(())
    }
}
const DEVICE_IN_PLACE: BundleDef = BundleDef::of::<DeviceInPlace>().execute().build();

fn accumulate_frame() -> FrameBuilder {
    FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]))
        .arg(OwnedBuffer::from_values(
            &[2, 2],
            &[10.0f32, 20.0, 30.0, 40.0],
        ))
}

#[test]
fn an_in_place_result_updates_the_argument_it_aliases() {
    let ctx = FakeContext::new();
    let mut frame = accumulate_frame().ret_in_place_of(0).build(&ctx);
    assert_eq!(frame.rets.raw[0].data, frame.args.raw[0].data);
    frame.call(execute(&ACCUMULATE)).unwrap();
    assert_eq!(frame.result(0).values::<f32>(), [11.0, 22.0, 33.0, 44.0]);
    // The handler's own errors still come through.
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2], &[1.0f32, 2.0]))
        .arg(OwnedBuffer::from_values(&[1, 2], &[1.0f32, 2.0]))
        .ret_in_place_of(0)
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &ACCUMULATE, Stage::Execute);
    assert!(message.contains("wrong shape for argument 1"), "{message}");
}

#[test]
fn an_in_place_result_the_call_site_does_not_alias_is_refused() {
    let ctx = FakeContext::new();
    let mut frame = accumulate_frame()
        .ret(OwnedBuffer::zeros(DataType::F32, &[2, 2]))
        .build(&ctx);
    let (code, message) = call_err(&mut frame, &ACCUMULATE, Stage::Execute);
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(
        message.contains(
            "result 0 is declared in place over argument 0, but the call site passes two \
             separate buffers: declare the pair where the call is made \
             (jax.ffi.ffi_call(..., input_output_aliases={0: 0}))"
        ),
        "{message}"
    );
    // Another dtype or shape than the argument's.
    let mut frame = accumulate_frame()
        .ret(OwnedBuffer::zeros(DataType::F32, &[4]))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &ACCUMULATE, Stage::Execute);
    assert!(
        message.contains("but they differ: argument 0 is F32 [2, 2], result 0 F32 [4]"),
        "{message}"
    );
}

#[test]
fn an_in_place_result_needs_its_argument_hidden_from_the_handler() {
    let ctx = FakeContext::new();
    for def in [&READS_THE_ALIASED_ARGUMENT, &LISTED_ARGUMENTS] {
        let mut frame = accumulate_frame().ret_in_place_of(0).build(&ctx);
        let (_, message) = call_err(&mut frame, def, Stage::Execute);
        assert!(
            message.contains(
                "result 0 is declared in place over argument 0, but the handler also takes \
                 argument 0 as a readable buffer: take it as AliasedArg"
            ),
            "{message}"
        );
    }
}

#[test]
fn an_aliased_pair_the_bundle_does_not_declare_is_named_not_decoded() {
    let ctx = FakeContext::new();
    // The probe takes a plain result: aliased by the call site, it is refused with the fix.
    let mut frame = probe_attrs(
        FrameBuilder::new(Stage::Execute)
            .arg(OwnedBuffer::from_values(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]))
            .arg(OwnedBuffer::from_values(&[3], &[1i32, 2, 3]))
            .ret_in_place_of(0),
    )
    .build(&ctx);
    let (_, message) = call_err(&mut frame, &PROBE, Stage::Execute);
    assert!(
        message.contains(
            "result 0 is argument 0's buffer: the call site aliases them (input_output_aliases); \
             a handler that updates it in place takes result 0 as InPlace<0> and argument 0 as \
             AliasedArg"
        ),
        "{message}"
    );
    // An in-place result may overlap its own argument only: the other argument here is the
    // same memory (a readable slice of it would alias the writable one).
    let mut frame = accumulate_frame().ret_in_place_of(0).build(&ctx);
    frame.args.raw[1].data = frame.args.raw[0].data;
    let (_, message) = call_err(&mut frame, &ACCUMULATE, Stage::Execute);
    assert!(
        message.contains("result 0 is argument 1's buffer"),
        "{message}"
    );
    // An argument index past the list.
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .ret_in_place_of(0)
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &ACCUMULATE, Stage::Execute);
    assert!(
        message.contains("wrong number of arguments: expected 2, got 1"),
        "{message}"
    );
}

#[test]
fn a_device_result_in_place_is_the_arguments_address() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .device_arg(DataType::BF16, &[4, 8], 0x7000_0000)
        .ret_in_place_of(0)
        .build(&ctx);
    frame.call(execute(&DEVICE_IN_PLACE)).unwrap();
    assert!(SEEN
        .lock()
        .iter()
        .any(|s| s == "in place 0x70000000 [4, 8] 0"));
    let mut frame = FrameBuilder::new(Stage::Execute)
        .device_arg(DataType::BF16, &[4, 8], 0x7000_0000)
        .device_ret(DataType::BF16, &[4, 8], 0x7100_0000)
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &DEVICE_IN_PLACE, Stage::Execute);
    assert!(message.contains("two separate buffers"), "{message}");
}

// ---------------------------------------------------------------------------------------------
// Argument and result lists: optional, remaining, any number; nested and integer-enum attributes
// ---------------------------------------------------------------------------------------------

crate::ffi_int_enum! {
    /// How [`Lists`] reduces.
    enum Reduce {
        Sum = 0,
        Max = 7,
    }
}

crate::ffi_attrs! {
    /// A dictionary nested in [`ListsAttrs`].
    struct Scaling {
        factor: f32,
        reduce: Reduce,
    }
}

crate::ffi_attrs! {
    struct ListsAttrs {
        scaling: Scaling,
        bias: Option<f32>,
    }
}

/// `out[0] = reduce(x, rest...) * factor (+ bias if the optional argument is given)`; the
/// optional result, if present, gets the number of remaining arguments.
struct Lists;
impl Bundle for Lists {
    const TARGET: &'static str = "lists";
    type Platform = Host;
    type State = NoState;
}
impl Execute for Lists {
    type Args<'a> = (Buffer<'a, f32>, Option<Buffer<'a, f32>>, RemainingArgs<'a>);
    type Rets<'a> = (ResultBuffer<'a, f32>, Option<ResultBuffer<'a, i32>>);
    type Attrs<'a> = ListsAttrs;
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (x, bias, rest): Self::Args<'_>,
        (out, count): Self::Rets<'_>,
        attrs: ListsAttrs,
    ) -> FfiResult<()> {
        for (i, o) in out.data.iter_mut().enumerate() {
            let mut acc = x.data[i];
            for k in 0..rest.len() {
                let v = rest.decode::<Buffer<'_, f32>>(k)?.data[i];
                acc = match attrs.scaling.reduce {
                    Reduce::Sum => acc + v,
                    Reduce::Max => acc.max(v),
                };
            }
            *o = acc * attrs.scaling.factor
                + bias.map_or(0.0, |b| b.data[i])
                + attrs.bias.unwrap_or(0.0);
        }
        if let Some(count) = count {
            count.data[0] = rest.len() as i32;
        }
        Ok(())
    }
}
const LISTS: BundleDef = BundleDef::of::<Lists>().execute().build();

fn scaling(factor: f32, reduce: OwnedAttr) -> OwnedAttr {
    OwnedAttr::Dict(vec![
        ("factor".into(), OwnedAttr::scalar(factor)),
        ("reduce".into(), reduce),
    ])
}

fn lists_frame(args: &[[f32; 2]], with_count: bool, reduce: OwnedAttr) -> FrameBuilder {
    let mut b = FrameBuilder::new(Stage::Execute);
    for a in args {
        b = b.arg(OwnedBuffer::from_values(&[2], a));
    }
    b = b.ret(OwnedBuffer::zeros(DataType::F32, &[2]));
    if with_count {
        b = b.ret(OwnedBuffer::zeros(DataType::S32, &[1]));
    }
    b.attr("scaling", scaling(2.0, reduce))
}

#[test]
fn optional_and_remaining_operands_decode_by_position() {
    let ctx = FakeContext::new();
    // x alone: no bias, no remaining arguments, no count.
    let mut frame = lists_frame(&[[1.0, 2.0]], false, OwnedAttr::scalar(0i64)).build(&ctx);
    frame.call(execute(&LISTS)).unwrap();
    assert_eq!(frame.result(0).values::<f32>(), [2.0, 4.0]);
    // x, bias, then three remaining ones, summed; the optional count result present. The enum
    // value comes as an S32 here (np.int32), as an S64 above (a Python int).
    let args = [[1.0, 2.0], [0.5, 0.5], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]];
    let mut frame = lists_frame(&args, true, OwnedAttr::scalar(0i32)).build(&ctx);
    frame.call(execute(&LISTS)).unwrap();
    assert_eq!(frame.result(0).values::<f32>(), [14.5, 16.5]);
    assert_eq!(frame.result(1).values::<i32>(), [3]);
    // Max, by its value 7 as a U8.
    let mut frame = lists_frame(&args, true, OwnedAttr::scalar(7u8)).build(&ctx);
    frame.call(execute(&LISTS)).unwrap();
    assert_eq!(frame.result(0).values::<f32>(), [6.5, 6.5]);
}

#[test]
fn lists_name_what_is_missing_or_extra() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .attr("scaling", scaling(1.0, OwnedAttr::scalar(0i64)))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &LISTS, Stage::Execute);
    assert!(
        message.contains("wrong number of arguments: expected at least 1, got 0"),
        "{message}"
    );
    assert!(
        message.contains("wrong number of results: expected 1 to 2, got 0"),
        "{message}"
    );
    // A remaining argument of the wrong dtype is the handler's error, naming the call's index.
    let mut frame = lists_frame(&[[1.0, 2.0], [0.0, 0.0]], false, OwnedAttr::scalar(0i64))
        .arg(OwnedBuffer::from_values(&[2], &[1i32, 2]))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &LISTS, Stage::Execute);
    assert!(
        message.contains("wrong dtype for argument 2: expected F32, got S32"),
        "{message}"
    );
}

#[test]
fn nested_dictionaries_and_integer_enums_report_inside_the_dictionary() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2], &[1.0f32, 2.0]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[2]))
        .attr(
            "scaling",
            OwnedAttr::Dict(vec![
                ("reduce".into(), OwnedAttr::scalar(3i64)),
                ("extra".into(), OwnedAttr::pred(true)),
            ]),
        )
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &LISTS, Stage::Execute);
    for expected in [
        "wrong type for attribute `scaling`: in the dictionary: ",
        "unexpected attribute `extra` (expected: factor, reduce)",
        "missing attribute `factor` (F32 scalar)",
        "wrong type for attribute `reduce`: expected one of 0 (Sum), 7 (Max) (integer), got S64 \
         scalar 3",
    ] {
        assert!(
            message.contains(expected),
            "missing {expected:?} in {message}"
        );
    }
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2], &[1.0f32, 2.0]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[2]))
        .attr("scaling", OwnedAttr::scalar(1.0f32))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &LISTS, Stage::Execute);
    assert!(
        message
            .contains("wrong type for attribute `scaling`: expected dictionary, got F32 scalar 1"),
        "{message}"
    );
    assert_eq!(Reduce::from_value(7), Some(Reduce::Max));
    assert_eq!((Reduce::Sum.value(), Reduce::VALUES.len()), (0, 2));
}

/// Optional before required: refused at decode with the rule.
struct OutOfOrder;
impl Bundle for OutOfOrder {
    const TARGET: &'static str = "out_of_order";
    type Platform = Host;
    type State = NoState;
}
impl Execute for OutOfOrder {
    type Args<'a> = (Option<AnyBuffer<'a>>, AnyBuffer<'a>);
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &NoState, _: &Context<'_>, _: Self::Args<'_>, (): (), (): ()) -> FfiResult<()> {
        unreachable!("decoding refuses the signature")
    }
}
const OUT_OF_ORDER: BundleDef = BundleDef::of::<OutOfOrder>().execute().build();

#[test]
fn a_signature_with_optional_before_required_is_refused() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &OUT_OF_ORDER, Stage::Execute);
    assert!(
        message.contains("the handler's arguments are declared out of order"),
        "{message}"
    );
}

/// Writes each result's index into it: any number of results.
struct Many;
impl Bundle for Many {
    const TARGET: &'static str = "many";
    type Platform = Host;
    type State = NoState;
}
impl Execute for Many {
    type Args<'a> = ();
    type Rets<'a> = ResultList<'a>;
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _: &Context<'_>,
        (): (),
        mut rets: ResultList<'_>,
        (): (),
    ) -> FfiResult<()> {
        for i in (0..rets.len()).rev() {
            let r = rets.take(i).expect("each result once");
            r.into_mut_slice::<i32>()?[0] = i as i32;
            assert!(rets.take(i).is_none(), "taken twice");
        }
        assert!(rets.take(rets.len()).is_none());
        Ok(())
    }
}
const MANY: BundleDef = BundleDef::of::<Many>().execute().build();

#[test]
fn a_result_list_takes_any_number_of_results() {
    let ctx = FakeContext::new();
    for count in [0, 8, 9, 64, 65, 300] {
        let mut b = FrameBuilder::new(Stage::Execute);
        for _ in 0..count {
            b = b.ret(OwnedBuffer::zeros(DataType::S32, &[1]));
        }
        let mut frame = b.build(&ctx);
        frame.call(execute(&MANY)).unwrap();
        for i in 0..count {
            assert_eq!(frame.result(i).values::<i32>(), [i as i32]);
        }
    }
    // Still validated together at decode: two results of one buffer.
    let mut frame = FrameBuilder::new(Stage::Execute)
        .ret(OwnedBuffer::zeros(DataType::S32, &[1]))
        .ret(OwnedBuffer::zeros(DataType::S32, &[1]))
        .build(&ctx);
    frame.rets.raw[1].data = frame.rets.raw[0].data;
    let (_, message) = call_err(&mut frame, &MANY, Stage::Execute);
    assert!(message.contains("result 0 overlaps result 1"), "{message}");
}

// ---------------------------------------------------------------------------------------------
// Asynchronous execution
// ---------------------------------------------------------------------------------------------

crate::ffi_attrs! {
    struct AsyncAttrs {
        scale: f32,
        /// 0: completed on another thread; 1: failed in start; 2: panics in the completion;
        /// 3: dropped on another thread; 4: panics in start; 5: completed in start.
        mode: i64,
    }
}

/// `y = x * scale`, computed after the handler returned.
struct AsyncScale;
impl Bundle for AsyncScale {
    const TARGET: &'static str = "async_scale";
    type Platform = Host;
    type State = NoState;
}
impl pending::ExecuteAsync for AsyncScale {
    type Args<'a> = (Buffer<'a, f32>,);
    type Rets<'a> = (ResultBuffer<'a, f32>,);
    type Attrs<'a> = AsyncAttrs;
    fn start(_: &NoState, _: &Context<'_>, attrs: AsyncAttrs, call: Pending<Self>) {
        let scale = attrs.scale;
        let work = move |(x,): (Buffer<'_, f32>,), (y,): (ResultBuffer<'_, f32>,)| {
            if attrs.mode == 2 {
                panic!("deliberate panic in a completion");
            }
            for (o, v) in y.data.iter_mut().zip(x.data) {
                *o = v * scale;
            }
            Ok(())
        };
        match attrs.mode {
            1 => call.fail(FfiError::attribute("scale", "refused by start")),
            3 => drop(std::thread::spawn(move || drop(call))),
            4 => panic!("deliberate panic in start"),
            5 => call.complete(work),
            _ => drop(std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(5));
                call.complete(work)
            })),
        }
    }
}
const ASYNC_SCALE: BundleDef = BundleDef::of::<AsyncScale>().execute_async().build();

fn async_frame(x: &[f32], y_len: i64, mode: i64) -> FrameBuilder {
    FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[x.len() as i64], x))
        .ret(OwnedBuffer::zeros(DataType::F32, &[y_len]))
        .attr("scale", OwnedAttr::scalar(3.0f32))
        .attr("mode", OwnedAttr::scalar(mode))
}

#[test]
fn an_async_call_completes_after_its_handler_returned() {
    let ctx = FakeContext::new();
    for mode in [0, 5] {
        let mut frame = async_frame(&[1.0, 2.0, 3.0], 3, mode).build(&ctx);
        frame.call(execute(&ASYNC_SCALE)).unwrap();
        assert_eq!(frame.result(0).values::<f32>(), [3.0, 6.0, 9.0]);
    }
    // Many at once from many threads, each its own frame.
    std::thread::scope(|s| {
        for t in 0..8 {
            let ctx = &ctx;
            s.spawn(move || {
                for i in 0..20 {
                    let x = [t as f32, i as f32];
                    let mut frame = async_frame(&x, 2, 0).build(ctx);
                    frame.call(execute(&ASYNC_SCALE)).unwrap();
                    assert_eq!(frame.result(0).values::<f32>(), [x[0] * 3.0, x[1] * 3.0]);
                }
            });
        }
    });
}

#[test]
fn an_async_calls_errors_come_back_through_its_future() {
    let ctx = FakeContext::new();
    let expect = |mode: i64, y_len: i64, expected: &str| {
        let mut frame = async_frame(&[1.0, 2.0], y_len, mode).build(&ctx);
        let (_, message) = call_err(&mut frame, &ASYNC_SCALE, Stage::Execute);
        assert!(
            message.contains(expected),
            "mode {mode}: {expected:?} not in {message}"
        );
    };
    expect(
        1,
        2,
        "async_scale: [execute, completion] invalid attribute `scale`: refused by start",
    );
    expect(
        2,
        2,
        "panic in async_scale [execute, completion]: deliberate panic in a completion",
    );
    expect(3, 2, "dropped without being completed");
    expect(4, 2, "dropped without being completed");
    // Decoding happens in the completion, with the usual messages.
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[2], &[1i32, 2]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[2]))
        .attr("scale", OwnedAttr::scalar(3.0f32))
        .attr("mode", OwnedAttr::scalar(0i64))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &ASYNC_SCALE, Stage::Execute);
    assert!(
        message.contains("[execute, completion] failed to decode the call frame")
            && message.contains("wrong dtype for argument 0: expected F32, got S32"),
        "{message}"
    );
    // An attribute error is the handler's own, before any future.
    let mut frame = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(&[1], &[1.0f32]))
        .ret(OwnedBuffer::zeros(DataType::F32, &[1]))
        .attr("scale", OwnedAttr::scalar(3.0f32))
        .build(&ctx);
    let (_, message) = call_err(&mut frame, &ASYNC_SCALE, Stage::Execute);
    assert!(message.contains("missing attribute `mode`"), "{message}");
}

// ---------------------------------------------------------------------------------------------
// State at prepare and initialize, and user data
// ---------------------------------------------------------------------------------------------

/// The prepare stage's state: registered in the live-state registry like an instantiate state.
struct PrepareScratch {
    live: crate::state::LiveState,
    value: i32,
}
crate::state_type!(PrepareScratch, "rmsnorm_ffi.tests.PrepareScratch");

/// The initialize stage's state, made from the prepare stage's.
struct InitializeScratch {
    doubled: i32,
}
crate::state_type!(InitializeScratch, "rmsnorm_ffi.tests.InitializeScratch");

/// User data: what each execute saw (per context, so tests in parallel do not mix), and the
/// prepare states' registry ids.
#[derive(Default)]
struct StageTally {
    seen: parking_lot::Mutex<Vec<(i32, i32)>>,
    prepare_ids: parking_lot::Mutex<Vec<u64>>,
}
crate::state_type!(StageTally, "rmsnorm_ffi.tests.StageTally");

const STAGE_STATES_TARGET: &str = "stage_states";

crate::ffi_attrs! {
    /// What execute asks for that it must not get: "" (nothing), "execute" (the execute
    /// stage's state), "set" (to set a state from execute).
    struct StageStatesAttrs<'a> {
        misuse: &'a str,
    }
}

struct StageStates;
impl Bundle for StageStates {
    const TARGET: &'static str = STAGE_STATES_TARGET;
    type Platform = Cuda;
    type State = NoState;
}
impl Prepare for StageStates {
    type Attrs<'a> = ();
    fn prepare(_: &NoState, ctx: &Context<'_>, _: ()) -> FfiResult<()> {
        let state = ctx.set_stage_state(PrepareScratch {
            live: crate::state::LiveState::register(
                STAGE_STATES_TARGET,
                "rmsnorm_ffi.tests.PrepareScratch",
            ),
            value: 7,
        })?;
        ctx.user_data::<StageTally>()?
            .prepare_ids
            .lock()
            .push(state.live.id());
        Ok(())
    }
}
impl Initialize for StageStates {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn initialize(_: &NoState, ctx: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
        let prepared = ctx.stage_state::<PrepareScratch>(Stage::Prepare)?;
        ctx.set_stage_state(InitializeScratch {
            doubled: 2 * prepared.value,
        })?;
        Ok(())
    }
}
impl Execute for StageStates {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = StageStatesAttrs<'a>;
    fn execute(
        _: &NoState,
        ctx: &Context<'_>,
        _: (),
        _: (),
        attrs: StageStatesAttrs<'_>,
    ) -> FfiResult<()> {
        match attrs.misuse {
            "execute" => {
                ctx.stage_state::<PrepareScratch>(Stage::Execute)?;
            }
            "set" => {
                ctx.set_stage_state(InitializeScratch { doubled: 0 })?;
            }
            _ => {}
        }
        let prepared = ctx.stage_state::<PrepareScratch>(Stage::Prepare)?;
        let initialized = ctx.stage_state::<InitializeScratch>(Stage::Initialize)?;
        ctx.user_data::<StageTally>()?
            .seen
            .lock()
            .push((prepared.value, initialized.doubled));
        Ok(())
    }
}
const STAGE_STATES: BundleDef = BundleDef::of::<StageStates>()
    .prepare()
    .prepare_state::<PrepareScratch>()
    .initialize()
    .initialize_state::<InitializeScratch>()
    .execute()
    .user_data::<StageTally>()
    .build();

/// Runs `stage` of `def` in `ctx` with `attrs`.
fn run_stage(
    ctx: &FakeContext,
    def: &BundleDef,
    stage: Stage,
    attrs: &[(&str, OwnedAttr)],
) -> Result<(), (ErrorCode, String)> {
    let mut builder = FrameBuilder::new(stage);
    for (name, value) in attrs {
        builder = builder.attr(name, value.clone());
    }
    builder.build(ctx).call(def.handler(stage).unwrap())
}

#[test]
fn stage_states_live_for_one_execution_and_count_in_the_registry() {
    fake::register_bundle_types(&[STAGE_STATES]);
    let ctx = FakeContext::new();
    ctx.set_user_data(StageTally::default());
    let none = [("misuse", OwnedAttr::string(""))];
    for execution in 0..3 {
        run_stage(&ctx, &STAGE_STATES, Stage::Prepare, &[]).unwrap();
        run_stage(&ctx, &STAGE_STATES, Stage::Initialize, &[]).unwrap();
        run_stage(&ctx, &STAGE_STATES, Stage::Execute, &none).unwrap();
        // This execution's prepare state is live in the registry until the execution ends.
        let tally_ids = {
            let tally = ctx_tally(&ctx);
            let ids = tally.prepare_ids.lock().clone();
            assert_eq!(ids.len(), execution + 1);
            ids
        };
        let live = |id: u64| crate::state::snapshot().states.iter().any(|s| s.id == id);
        assert!(live(*tally_ids.last().unwrap()));
        assert_eq!(ctx.state_count(), 2);
        ctx.end_execution();
        assert_eq!(ctx.state_count(), 0);
        assert!(
            tally_ids.iter().all(|id| !live(*id)),
            "a prepare state outlived its execution"
        );
    }
    assert_eq!(*ctx_tally(&ctx).seen.lock(), vec![(7, 14); 3]);
}

/// The tally the context holds as user data.
fn ctx_tally(ctx: &FakeContext) -> &StageTally {
    ctx.user_data::<StageTally>()
        .expect("the test attached a tally")
}

#[test]
fn stage_states_are_refused_where_xla_keeps_none() {
    fake::register_bundle_types(&[STAGE_STATES]);
    let ctx = FakeContext::new();
    ctx.set_user_data(StageTally::default());
    run_stage(&ctx, &STAGE_STATES, Stage::Prepare, &[]).unwrap();
    // A second prepare in the same execution: XLA keeps one state per stage.
    let (code, message) = run_stage(&ctx, &STAGE_STATES, Stage::Prepare, &[]).unwrap_err();
    assert_eq!(code, ErrorCode::FailedPrecondition, "{message}");
    assert!(message.contains("State is already set"), "{message}");
    // Execute reads prepare's state but has none of its own; the wrapper says so before XLA
    // (whose fake here would say "null pointer") is asked.
    run_stage(&ctx, &STAGE_STATES, Stage::Initialize, &[]).unwrap();
    for misuse in ["execute", "set"] {
        let attrs = [("misuse", OwnedAttr::string(misuse))];
        let (code, message) = run_stage(&ctx, &STAGE_STATES, Stage::Execute, &attrs).unwrap_err();
        assert_eq!(code, ErrorCode::InvalidArgument, "{misuse}: {message}");
        assert!(
            message.contains("execute-stage state"),
            "{misuse}: {message}"
        );
        assert!(!message.contains("null pointer"), "{misuse}: {message}");
    }
    // Once the execution ended, execute finds no prepare state.
    ctx.end_execution();
    let attrs = [("misuse", OwnedAttr::string(""))];
    let (code, message) = run_stage(&ctx, &STAGE_STATES, Stage::Execute, &attrs).unwrap_err();
    assert_eq!(code, ErrorCode::FailedPrecondition, "{message}");
    assert!(
        message.contains("no `rmsnorm_ffi.tests.PrepareScratch` state from the prepare stage")
            && message.contains("State is not set"),
        "{message}"
    );
}

#[test]
fn missing_user_data_is_xla_s_error_with_the_type_named() {
    fake::register_bundle_types(&[STAGE_STATES]);
    let ctx = FakeContext::new();
    let (code, message) = run_stage(&ctx, &STAGE_STATES, Stage::Prepare, &[]).unwrap_err();
    assert_eq!(code, ErrorCode::FailedPrecondition, "{message}");
    assert!(
        message.contains("no user data of type `rmsnorm_ffi.tests.StageTally`")
            && message.contains("not found in execution context"),
        "{message}"
    );
    // The prepare state was set before the user data was asked for, and is freed at the end.
    ctx.end_execution();
    assert_eq!(ctx.state_count(), 0);
}

/// A host bundle that asks for a prepare-stage state: XLA:CPU keeps none (there the call
/// would be a null dereference), so the context refuses.
struct HostStageState;
impl Bundle for HostStageState {
    const TARGET: &'static str = "host_stage_state";
    type Platform = Host;
    type State = NoState;
}
impl Execute for HostStageState {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &NoState, ctx: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
        ctx.stage_state::<PrepareScratch>(Stage::Prepare)
            .map(|_| ())
    }
}
const HOST_STAGE_STATE: BundleDef = BundleDef::of::<HostStageState>().execute().build();

#[test]
fn a_host_bundle_gets_no_stage_state() {
    fake::register_bundle_types(&[STAGE_STATES]);
    let ctx = FakeContext::new();
    let (code, message) = run_stage(&ctx, &HOST_STAGE_STATE, Stage::Execute, &[]).unwrap_err();
    assert_eq!(code, ErrorCode::FailedPrecondition, "{message}");
    assert!(
        message.contains(
            "host_stage_state: [execute] cannot get the prepare-stage state: XLA keeps none for \
             this bundle (XLA:CPU"
        ),
        "{message}"
    );
    // Nor does XLA:GPU for a bundle it may record into a command buffer.
    let (code, message) = run_stage(&ctx, &GRAPH_STAGE_STATE, Stage::Execute, &[]).unwrap_err();
    assert_eq!(code, ErrorCode::FailedPrecondition, "{message}");
    assert!(
        message.contains("graph_stage_state: [execute] cannot get the prepare-stage state"),
        "{message}"
    );
}

/// A CUDA bundle that XLA may record into a command buffer, where it passes no stage states.
struct GraphStageState;
impl Bundle for GraphStageState {
    const TARGET: &'static str = "graph_stage_state";
    const TRAITS: Traits = Traits::COMMAND_BUFFER_COMPATIBLE;
    type Platform = Cuda;
    type State = NoState;
}
impl Execute for GraphStageState {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &NoState, ctx: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
        ctx.stage_state::<PrepareScratch>(Stage::Prepare)
            .map(|_| ())
    }
}
const GRAPH_STAGE_STATE: BundleDef = BundleDef::of::<GraphStageState>().execute().build();

#[test]
fn declared_stage_types_are_registered_with_the_bundle() {
    let names: Vec<&str> = STAGE_STATES.types().iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "rmsnorm_ffi.tests.PrepareScratch",
            "rmsnorm_ffi.tests.InitializeScratch",
            "rmsnorm_ffi.tests.StageTally"
        ]
    );
    // In a library's table too, though no bundle names them as its state.
    let table = export::LibraryTable::new(&[STAGE_STATES, SCALE]).unwrap();
    let library = library::read_own(&table, "in-process").unwrap();
    let in_table: Vec<&str> = library
        .state_types
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(
        in_table,
        [
            "rmsnorm_ffi.tests.PrepareScratch",
            "rmsnorm_ffi.tests.InitializeScratch",
            "rmsnorm_ffi.tests.StageTally",
            "rmsnorm_ffi.tests.ScaleState"
        ]
    );
    assert_eq!(library.bundles[0].state_type, None);
    assert_eq!(library.bundles[1].state_type, Some(3));
}
