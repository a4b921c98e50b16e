//! Fuzzed call frames through the fake runtime: random stages, operand counts and types,
//! dtypes, ranks, dims, attribute kinds and names, struct sizes and pointers, fed to every CPU
//! bundle's stages in the order XLA would call them (instantiate, then executions that reuse
//! the state): the extension's, and those of the libraries this repo builds on the crate (the two
//! examples and the test fixtures), whose sources are compiled in here.
//!
//! Errors are the expected outcome for most frames. What must never happen: a crash, a panic
//! escaping the trampoline (that aborts the test process: `extern "C"` entries cannot unwind),
//! or a panic caught by the trampoline (the decoding layer and handlers must return errors,
//! not panic; the message would say "panic in ..."). The random frames only lie in ways the
//! C API lets a decoder detect (bad counts, sizes, ranks, negative or overflowing dims, null
//! or wrapping pointers); a frame whose dims announce more data than its pointer holds is XLA's
//! contract, which no decoder can check, and is not generated.
//!
//! Cases: `PROPTEST_CASES` (default 3000 per property; CI runs the default).

use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[allow(dead_code)]
#[path = "../examples/counter_bundle/src/lib.rs"]
mod counter;
#[allow(dead_code)]
#[path = "../examples/scaled_copy/src/lib.rs"]
mod scaled_copy;
#[allow(dead_code)]
#[path = "fixtures/testing_bundles/src/lib.rs"]
mod testing;

use xla_ffi_bundles::ffi::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use xla_ffi_bundles::ffi::sys::{XLA_FFI_DataType, XLA_FFI_ExecutionStage};
use xla_ffi_bundles::ffi::{BundleDef, DataType, Stage};

const MAX_ELEMENTS: i64 = 4096;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

/// Every host bundle: the extension's, the examples' and the test fixtures'.
fn bundles() -> &'static [BundleDef] {
    static BUNDLES: std::sync::OnceLock<Vec<BundleDef>> = std::sync::OnceLock::new();
    BUNDLES.get_or_init(|| {
        let cpu = rmsnorm_ffi::handlers::bundles("cpu").expect("cpu bundles");
        let mut all: Vec<BundleDef> = cpu.into_iter().copied().collect();
        all.extend([
            counter::COUNTER,
            scaled_copy::BUNDLE,
            scaled_copy::EMA_BUNDLE,
            testing::STAGES_BUNDLE,
            testing::CONTEXT_BUNDLE,
            testing::ATTRS_BUNDLE,
            testing::REVERSE_BUNDLE,
            testing::LISTS_BUNDLE,
            testing::ASYNC_BUNDLE,
        ]);
        all
    })
}

// ---------------------------------------------------------------------------------------------
// Buffers
// ---------------------------------------------------------------------------------------------

/// How a buffer's dims look: honest (small, data allocated to match), or lies the decoder
/// must catch before touching the data.
#[derive(Debug, Clone)]
enum Dims {
    Honest(Vec<i64>),
    Negative(Vec<i64>),
    Overflowing(Vec<i64>),
}

#[derive(Debug, Clone)]
struct BufferSpec {
    dtype: i32,
    dims: Dims,
    /// Random bits for the data (NaN, inf, denormals included).
    fill: u64,
}

fn dtype_raw() -> BoxedStrategy<i32> {
    let valid: Vec<i32> = XLA_FFI_DataType::VALUES.iter().map(|&(_, v)| v).collect();
    prop_oneof![
        // The dtypes the handlers take, most often.
        6 => prop::sample::select(vec![
            DataType::F32.to_raw().0,
            DataType::F64.to_raw().0,
            DataType::BF16.to_raw().0,
            DataType::F16.to_raw().0,
        ]),
        3 => prop::sample::select(valid),
        1 => any::<i32>(),
    ]
    .boxed()
}

fn small_dim() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 0i64..=8,
        2 => prop::sample::select(vec![16i64, 31, 32, 64, 100, 128]),
    ]
}

fn honest_dims() -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec(small_dim(), 0..=4).prop_map(|mut dims| {
        // Keep the data small: shrink the largest dim until the product fits.
        while dims.iter().product::<i64>() > MAX_ELEMENTS {
            let i = (0..dims.len()).max_by_key(|&i| dims[i]).unwrap();
            dims[i] /= 2;
        }
        dims
    })
}

fn dims() -> impl Strategy<Value = Dims> {
    prop_oneof![
        8 => honest_dims().prop_map(Dims::Honest),
        // A zero dim makes any other dim harmless: nothing is read.
        1 => (honest_dims(), any::<i64>()).prop_map(|(mut d, big)| {
            d.push(0);
            d.push(big.max(0));
            Dims::Honest(d)
        }),
        1 => (honest_dims(), i64::MIN..0, any::<prop::sample::Index>()).prop_map(|(mut d, neg, at)| {
            let at = at.index(d.len() + 1);
            d.insert(at, neg);
            Dims::Negative(d)
        }),
        1 => prop::sample::select(vec![
            vec![i64::MAX, 3],
            vec![1 << 62, 1 << 62],
            vec![1 << 61, 2],
            vec![3, 1 << 40, 1 << 40],
            vec![i64::MAX],
        ]).prop_map(Dims::Overflowing),
    ]
}

fn buffer() -> impl Strategy<Value = BufferSpec> {
    (dtype_raw(), dims(), any::<u64>()).prop_map(|(dtype, dims, fill)| BufferSpec {
        dtype,
        dims,
        fill,
    })
}

impl BufferSpec {
    fn build(&self) -> OwnedBuffer {
        let dtype = XLA_FFI_DataType(self.dtype);
        let (dims, bytes) = match &self.dims {
            Dims::Honest(d) => {
                let count = d.iter().product::<i64>() as usize;
                let bytes = DataType::from_raw(dtype).bytes_for(count).unwrap_or(0);
                (d.clone(), bytes)
            }
            Dims::Negative(d) | Dims::Overflowing(d) => (d.clone(), 0),
        };
        // xorshift from the seed: cheap, and covers every bit pattern.
        let mut s = self.fill | 1;
        let data = (0..bytes.div_ceil(8).max(1))
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            })
            .collect();
        OwnedBuffer {
            dtype,
            dims,
            data,
            bytes,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attributes
// ---------------------------------------------------------------------------------------------

fn attr_name() -> BoxedStrategy<String> {
    prop_oneof![
        6 => prop::sample::select(vec!["eps", "has_weight", "row_len", "scale", "panic_in", "fail_in"])
            .prop_map(str::to_string),
        1 => "[a-z_]{0,12}",
        1 => any::<Vec<u8>>().prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
    .boxed()
}

fn leaf_attr() -> impl Strategy<Value = OwnedAttr> {
    prop_oneof![
        // Scalars: 16 bytes of storage, enough for any dtype the value may claim.
        4 => (dtype_raw(), prop::collection::vec(any::<u8>(), 16))
            .prop_map(|(d, bytes)| OwnedAttr::Scalar(XLA_FFI_DataType(d), bytes)),
        2 => prop::sample::select(vec![0.0f32, 1e-5, -1.0, f32::NAN, f32::INFINITY, 1e30])
            .prop_map(OwnedAttr::scalar),
        2 => prop::sample::select(vec![0i64, 1, 4, 16, 64, 128, -1, i64::MAX, 1 << 26, (1 << 26) + 1])
            .prop_map(OwnedAttr::scalar),
        1 => any::<bool>().prop_map(OwnedAttr::pred),
        2 => (dtype_raw(), 0usize..8, any::<u8>())
            .prop_map(|(d, len, b)| OwnedAttr::Array(XLA_FFI_DataType(d), len, vec![b; len * 16])),
        // Strings: never a stage name, so the test bundle's deliberate panics stay off.
        2 => prop::sample::select(vec!["none", "", "sometimes", "EXECUTE", "instantiate "])
            .prop_map(OwnedAttr::string),
        1 => any::<Vec<u8>>().prop_map(OwnedAttr::String),
    ]
}

fn attr_value() -> BoxedStrategy<OwnedAttr> {
    leaf_attr()
        .prop_recursive(2, 8, 4, |inner| {
            prop::collection::vec((attr_name(), inner), 0..4).prop_map(OwnedAttr::Dict)
        })
        .boxed()
}

/// The attributes a target really takes, with values that may be out of range.
fn honest_attrs(target: &str) -> BoxedStrategy<Vec<(String, OwnedAttr)>> {
    let eps = prop::sample::select(vec![1e-5f32, 0.0, -1.0, f32::NAN]).prop_map(OwnedAttr::scalar);
    let row_len = prop::sample::select(vec![0i64, 1, 3, 4, 8, 16, 64, 128, -2, 1 << 27])
        .prop_map(OwnedAttr::scalar);
    let flag = any::<bool>().prop_map(OwnedAttr::pred);
    match target {
        // The fused residual forward takes the forward's attributes.
        "rmsnorm_fwd" | "rmsnorm_residual_fwd" => (eps, flag, row_len)
            .prop_map(|(e, w, n)| {
                vec![
                    ("eps".into(), e),
                    ("has_weight".into(), w),
                    ("row_len".into(), n),
                ]
            })
            .boxed(),
        "rmsnorm_bwd" => (flag, row_len)
            .prop_map(|(w, n)| vec![("has_weight".into(), w), ("row_len".into(), n)])
            .boxed(),
        "scaled_copy" => (
            prop::sample::select(vec![1.5f32, 0.0, f32::NAN]).prop_map(OwnedAttr::scalar),
            row_len,
        )
            .prop_map(|(s, n)| vec![("scale".into(), s), ("row_len".into(), n)])
            .boxed(),
        "counter_bundle_counter" => (any::<i64>(), prop::sample::select(vec![1i64, -3, 0]))
            .prop_map(|(start, step)| {
                vec![
                    ("start".into(), OwnedAttr::scalar(start)),
                    ("step".into(), OwnedAttr::scalar(step)),
                ]
            })
            .boxed(),
        "rmsnorm_ffi_testing_reverse" => (
            row_len,
            prop::sample::select(vec![0.5f32, f32::NAN]).prop_map(OwnedAttr::scalar),
            prop::sample::select(vec![
                "pooled",
                "shared_scratch",
                "history",
                "leaky",
                "other",
            ])
            .prop_map(OwnedAttr::string),
        )
            .prop_map(|(n, s, v)| {
                vec![
                    ("row_len".into(), n),
                    ("scale".into(), s),
                    ("variant".into(), v),
                ]
            })
            .boxed(),
        "rmsnorm_ffi_testing_stages" => Just(vec![
            ("panic_in".into(), OwnedAttr::string("none")),
            ("fail_in".into(), OwnedAttr::string("none")),
        ])
        .boxed(),
        _ => Just(vec![]).boxed(),
    }
}

fn attrs(target: &'static str) -> impl Strategy<Value = Vec<(String, OwnedAttr)>> {
    let random = prop::collection::vec((attr_name(), attr_value()), 0..5);
    prop_oneof![
        3 => honest_attrs(target),
        1 => (honest_attrs(target), random.clone()).prop_map(|(mut a, extra)| {
            a.extend(extra);
            a
        }),
        1 => random,
    ]
}

// ---------------------------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------------------------

/// Edits a built frame the way a broken runtime might, within what a decoder can detect.
#[derive(Debug, Clone)]
enum Mutation {
    None,
    FrameSize(usize),
    ArgsSize(usize),
    RetsSize(usize),
    AttrsSize(usize),
    BufferSize(usize),
    ArgCount(i64),
    RetCount(i64),
    AttrCount(i64),
    NullArgList,
    NullRetList,
    NullAttrNames,
    ArgType(i32),
    NullArg,
    Rank(i64),
    NullDims,
    MisalignedDims,
    NullData,
    WrappingData,
    AliasResultOnArgument,
    Stage(i32),
    NullApi,
    OldApi(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let size = prop::sample::select(vec![0usize, 1, 8, 16, 24, 40, 1 << 20]);
    let bad_count = prop_oneof![i64::MIN..0, Just(1i64 << 16 | 1), Just(i64::MAX)];
    prop_oneof![
        20 => Just(Mutation::None),
        1 => size.clone().prop_map(Mutation::FrameSize),
        1 => size.clone().prop_map(Mutation::ArgsSize),
        1 => size.clone().prop_map(Mutation::RetsSize),
        1 => size.clone().prop_map(Mutation::AttrsSize),
        1 => size.prop_map(Mutation::BufferSize),
        1 => bad_count.clone().prop_map(Mutation::ArgCount),
        1 => bad_count.clone().prop_map(Mutation::RetCount),
        1 => bad_count.prop_map(Mutation::AttrCount),
        1 => Just(Mutation::NullArgList),
        1 => Just(Mutation::NullRetList),
        1 => Just(Mutation::NullAttrNames),
        1 => any::<i32>().prop_map(Mutation::ArgType),
        1 => Just(Mutation::NullArg),
        1 => prop_oneof![i64::MIN..0, 65i64..=i64::MAX].prop_map(Mutation::Rank),
        1 => Just(Mutation::NullDims),
        1 => Just(Mutation::MisalignedDims),
        1 => Just(Mutation::NullData),
        1 => Just(Mutation::WrappingData),
        1 => Just(Mutation::AliasResultOnArgument),
        1 => any::<i32>().prop_map(Mutation::Stage),
        1 => Just(Mutation::NullApi),
        1 => (0usize..400).prop_map(Mutation::OldApi),
    ]
}

#[derive(Debug, Clone)]
struct FrameSpec {
    args: Vec<BufferSpec>,
    rets: Vec<BufferSpec>,
    attrs: Vec<(String, OwnedAttr)>,
    mutation: Mutation,
}

/// Arguments and results: the target's own layout ((rows, n) data, (n) weight, (rows) rstd)
/// with random dtypes most of the time, or anything.
fn operands() -> impl Strategy<Value = (Vec<BufferSpec>, Vec<BufferSpec>)> {
    let shaped = (0i64..6, 0i64..40, any::<u64>()).prop_flat_map(|(rows, n, fill)| {
        let like = prop::sample::select(vec![vec![rows, n], vec![n], vec![rows], vec![n + 1]]);
        let spec = (dtype_raw(), like)
            .prop_map(move |(dtype, d)| BufferSpec {
                dtype,
                dims: Dims::Honest(d),
                fill,
            })
            .boxed();
        (
            prop::collection::vec(spec.clone(), 0..=4),
            prop::collection::vec(spec, 0..=3),
        )
    });
    prop_oneof![
        3 => shaped,
        1 => (prop::collection::vec(buffer(), 0..=5), prop::collection::vec(buffer(), 0..=4)),
    ]
}

fn frame(target: &'static str) -> impl Strategy<Value = FrameSpec> {
    (operands(), attrs(target), mutation()).prop_map(|((args, rets), attrs, mutation)| FrameSpec {
        args,
        rets,
        attrs,
        mutation,
    })
}

impl FrameSpec {
    fn build(&self, stage: Stage, ctx: &FakeContext) -> fake::BuiltFrame {
        let mut builder = FrameBuilder::new(stage);
        for a in &self.args {
            builder = builder.arg(a.build());
        }
        for r in &self.rets {
            builder = builder.ret(r.build());
        }
        for (name, value) in &self.attrs {
            builder = builder.attr(name, value.clone());
        }
        if let Mutation::OldApi(size) = self.mutation {
            builder = builder.api(fake::api_with_size(size));
        }
        let mut f = builder.build(ctx);
        let first_arg = f.args.raw.first_mut();
        match self.mutation.clone() {
            Mutation::None | Mutation::OldApi(_) => {}
            Mutation::FrameSize(s) => f.frame.struct_size = s,
            Mutation::ArgsSize(s) => f.frame.args.struct_size = s,
            Mutation::RetsSize(s) => f.frame.rets.struct_size = s,
            Mutation::AttrsSize(s) => f.frame.attrs.struct_size = s,
            Mutation::BufferSize(s) => {
                if let Some(b) = first_arg {
                    b.struct_size = s;
                }
            }
            Mutation::ArgCount(n) => f.frame.args.size = n,
            Mutation::RetCount(n) => f.frame.rets.size = n,
            Mutation::AttrCount(n) => f.frame.attrs.size = n,
            Mutation::NullArgList => f.frame.args.args = std::ptr::null_mut(),
            Mutation::NullRetList => f.frame.rets.rets = std::ptr::null_mut(),
            Mutation::NullAttrNames => f.frame.attrs.names = std::ptr::null_mut(),
            Mutation::ArgType(t) => {
                if let Some(t0) = f.args.types.first_mut() {
                    *t0 = t;
                }
            }
            Mutation::NullArg => {
                if let Some(p) = f.args.ptrs.first_mut() {
                    *p = std::ptr::null_mut();
                }
            }
            Mutation::Rank(r) => {
                if let Some(b) = first_arg {
                    b.rank = r;
                }
            }
            Mutation::NullDims => {
                if let Some(b) = first_arg {
                    if b.rank > 0 {
                        b.dims = std::ptr::null_mut();
                    }
                }
            }
            Mutation::MisalignedDims => {
                if let Some(b) = first_arg {
                    if b.rank > 0 {
                        b.dims = b.dims.cast::<u8>().wrapping_add(1).cast();
                    }
                }
            }
            Mutation::NullData => {
                if let Some(b) = first_arg {
                    b.data = std::ptr::null_mut();
                }
            }
            Mutation::WrappingData => {
                // Only where the data is longer than the room left before the end of the
                // address space, so the decoder must refuse it.
                if let (Some(b), Some(owned)) = (first_arg, f.args.owned.first()) {
                    if owned.bytes > 8 {
                        b.data = (usize::MAX - 7) as *mut std::ffi::c_void;
                    }
                }
            }
            Mutation::AliasResultOnArgument => {
                let arg = f.args.owned.first().map(|o| o.bytes).unwrap_or(0);
                let ret = f.rets.owned.first().map(|o| o.bytes).unwrap_or(0);
                if arg > 0 && ret > 0 {
                    f.rets.raw[0].data = f.args.raw[0].data;
                }
            }
            Mutation::Stage(s) => f.frame.stage = XLA_FFI_ExecutionStage(s),
            Mutation::NullApi => f.frame.api = std::ptr::null(),
        }
        f
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

static SUCCEEDED: AtomicUsize = AtomicUsize::new(0);
static REFUSED: AtomicUsize = AtomicUsize::new(0);

/// An outcome is fine when it is success or an error that is not a caught panic.
fn check_outcome(
    target: &str,
    stage: Stage,
    outcome: Result<(), (xla_ffi_bundles::ffi::ErrorCode, String)>,
) {
    match &outcome {
        Ok(()) => SUCCEEDED.fetch_add(1, Ordering::Relaxed),
        Err(_) => REFUSED.fetch_add(1, Ordering::Relaxed),
    };
    if let Err((_, message)) = outcome {
        // The trampoline reports a caught panic as "panic in <target> [<stage>]: ...".
        assert!(
            !message.contains(&format!("panic in {target}")),
            "{target} [{}]: a panic was caught: {message}",
            stage.name()
        );
        assert!(!message.is_empty(), "{target}: an error without a message");
    }
}

fn register_types() {
    fake::register_bundle_types(bundles());
}

/// One call site's life for bundle `index`: instantiate, then up to three executions.
fn call_site(index: usize, instantiate: &FrameSpec, executions: &[FrameSpec], threads: i64) {
    let def = &bundles()[index];
    let ctx = FakeContext::with_threads(threads);
    if let Some(handler) = def.handler(Stage::Instantiate) {
        let mut f = instantiate.build(Stage::Instantiate, &ctx);
        check_outcome(def.target, Stage::Instantiate, f.call(handler));
    }
    for spec in executions {
        for stage in [Stage::Prepare, Stage::Initialize, Stage::Execute] {
            if let Some(handler) = def.handler(stage) {
                let mut f = spec.build(stage, &ctx);
                check_outcome(def.target, stage, f.call(handler));
            }
        }
    }
    // Dropping the context deletes the state with its deleter, as XLA does.
}

fn for_each_bundle(run: impl Fn(usize, &'static str, &mut TestRunner)) {
    register_types();
    for (index, def) in bundles().iter().enumerate() {
        let mut runner = TestRunner::new(Config {
            cases: cases(),
            failure_persistence: None,
            ..Config::default()
        });
        run(index, def.target, &mut runner);
    }
}

#[test]
fn random_call_sites_never_panic_or_crash() {
    for_each_bundle(|index, target, runner| {
        let strategy = (
            frame(target),
            prop::collection::vec(frame(target), 1..=3),
            1i64..=4,
        );
        runner
            .run(&strategy, |(inst, execs, threads)| {
                call_site(index, &inst, &execs, threads);
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{target}: {e}"));
    });
    eprintln!(
        "fuzzed frames: {} ran, {} refused with an error",
        SUCCEEDED.load(Ordering::Relaxed),
        REFUSED.load(Ordering::Relaxed)
    );
}

#[test]
fn metadata_frames_with_random_sizes_are_answered_or_refused() {
    for_each_bundle(|index, target, runner| {
        let def = &bundles()[index];
        let strategy = (
            prop::sample::select(vec![0usize, 8, 16, 24, 32, 40, 48, 1 << 20]),
            prop::sample::select(vec![0usize, 8, 16, 24, 32, 40, 1 << 20]),
            any::<bool>(),
        );
        runner
            .run(&strategy, |(extension_size, metadata_size, null_api)| {
                let ctx = FakeContext::new();
                let mut builder = FrameBuilder::metadata();
                if null_api {
                    builder = builder.api(std::ptr::null());
                }
                let mut f = builder.build(&ctx);
                if let Some(m) = f.metadata.as_mut() {
                    m.0.extension_base.struct_size = extension_size;
                    m.1.struct_size = metadata_size;
                }
                for (stage, handler) in def.stages() {
                    check_outcome(target, stage, f.call(handler));
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{target}: {e}"));
    });
}

#[test]
fn the_check_sees_a_caught_panic() {
    // The property above is only as good as its detector: a deliberate panic in the test
    // bundle's execute stage must trip it.
    register_types();
    let def = bundles()
        .iter()
        .find(|d| d.target == "rmsnorm_ffi_testing_stages")
        .expect("test bundle");
    let ctx = FakeContext::new();
    let spec = |panic_in: &str| FrameSpec {
        args: vec![],
        rets: vec![BufferSpec {
            dtype: DataType::S32.to_raw().0,
            dims: Dims::Honest(vec![4]),
            fill: 1,
        }],
        attrs: vec![
            ("panic_in".into(), OwnedAttr::string(panic_in)),
            ("fail_in".into(), OwnedAttr::string("none")),
        ],
        mutation: Mutation::None,
    };
    let mut f = spec("none").build(Stage::Instantiate, &ctx);
    check_outcome(
        def.target,
        Stage::Instantiate,
        f.call(def.handler(Stage::Instantiate).unwrap()),
    );
    let mut f = spec("execute").build(Stage::Execute, &ctx);
    let outcome = f.call(def.handler(Stage::Execute).unwrap());
    let tripped = std::panic::catch_unwind(|| check_outcome(def.target, Stage::Execute, outcome));
    assert!(tripped.is_err(), "a caught panic went unnoticed");
}
