//! The test fixtures' bundles (`tests/fixtures/testing_bundles`) through the fake runtime: a
//! panic in any stage comes back as an error naming the target and stage, and the context
//! offers what the fixture reads. The same source is the library the Python tests register
//! against real XLA (tests/python/test_stages_and_context.py, test_errors.py).

#[allow(dead_code)]
#[path = "fixtures/testing_bundles/src/lib.rs"]
mod testing;

use testing::{
    ReverseState, StagesState, CONTEXT_BUNDLE, REVERSE_BUNDLE, REVERSE_TARGET, STAGES_BUNDLE,
};
use xla_ffi_bundles::ffi::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use xla_ffi_bundles::ffi::{DataType, ErrorCode, Stage, StateType};
use xla_ffi_bundles::state::snapshot;

#[test]
fn panics_in_every_stage_become_errors() {
    fake::register_type(StagesState::registration()).unwrap();
    for stage in Stage::ALL {
        let ctx = FakeContext::new();
        let frame = |s: Stage| {
            let b = FrameBuilder::new(s)
                .attr("panic_in", OwnedAttr::string(stage.name()))
                .attr("fail_in", OwnedAttr::string("none"));
            if s == Stage::Execute {
                b.ret(OwnedBuffer::zeros(DataType::S32, &[4]))
            } else {
                b
            }
        };
        let mut errors = Vec::new();
        for s in Stage::ALL {
            let mut f = frame(s).build(&ctx);
            if let Err(e) = f.call(STAGES_BUNDLE.handler(s).unwrap()) {
                errors.push((s, e));
            }
        }
        let (failed_stage, (code, message)) = errors.first().cloned().unwrap();
        assert_eq!(failed_stage, stage);
        assert_eq!(code, ErrorCode::Internal);
        assert!(
            message.contains(&format!(
                "panic in rmsnorm_ffi_testing_stages [{stage}]: deliberate panic in the {stage} stage"
            )),
            "{message}"
        );
    }
}

#[test]
fn context_queries_and_thread_pool() {
    for inline in [false, true] {
        let mut ctx = FakeContext::new();
        ctx.inline_tasks = inline;
        ctx.num_threads = 3;
        ctx.device_ordinal = 2;
        ctx.run_id = 77;
        let mut frame = FrameBuilder::new(Stage::Execute)
            .ret(OwnedBuffer::zeros(DataType::S32, &[9]))
            .build(&ctx);
        frame
            .call(CONTEXT_BUNDLE.handler(Stage::Execute).unwrap())
            .unwrap();
        assert_eq!(
            frame.result(0).values::<i32>()[..8],
            [3, 2, 77, 1, 0, 5, 0, 0]
        );
    }
}

#[test]
fn the_context_probe_sees_what_api_0_5_offers_and_nothing_on_0_3() {
    let mut ctx = FakeContext::new();
    ctx.attach_collectives((0, 2));
    ctx.set_custom_options(&[
        ("a".into(), OwnedAttr::scalar(1i32)),
        ("b".into(), OwnedAttr::string("x")),
    ]);
    for (api, expected) in [
        (fake::api(), [0, 5, 1, 2]),
        (fake::api_v0_3(), [0, 3, 0, -1]),
    ] {
        let mut frame = FrameBuilder::new(Stage::Execute)
            .api(api)
            .ret(OwnedBuffer::zeros(DataType::S32, &[9]))
            .build(&ctx);
        frame
            .call(CONTEXT_BUNDLE.handler(Stage::Execute).unwrap())
            .unwrap();
        assert_eq!(frame.result(0).values::<i32>()[4..8], expected);
    }
}

#[test]
fn the_reverse_bundle_and_its_broken_variants_one_execution_at_a_time() {
    // One thread: every variant computes `scale * x[..., ::-1]` except `history` on its 16th
    // execution; only `leaky` leaves its state registered after the deleter ran. (The race of
    // `shared_scratch` needs concurrent executions: tests/python/test_stress_api.py.)
    fake::register_type(ReverseState::registration()).unwrap();
    let live = || {
        snapshot()
            .states
            .iter()
            .filter(|s| s.target == REVERSE_TARGET)
            .count()
    };
    let x: Vec<f32> = (0..8).map(|v| v as f32).collect();
    for variant in ["pooled", "shared_scratch", "history", "leaky"] {
        let before = live();
        {
            let ctx = FakeContext::new();
            let attrs = |b: FrameBuilder| {
                b.attr("row_len", OwnedAttr::scalar(4i64))
                    .attr("scale", OwnedAttr::scalar(2.0f32))
                    .attr("variant", OwnedAttr::string(variant))
            };
            attrs(FrameBuilder::new(Stage::Instantiate))
                .build(&ctx)
                .call(REVERSE_BUNDLE.handler(Stage::Instantiate).unwrap())
                .unwrap();
            for k in 0..16 {
                let mut frame = attrs(FrameBuilder::new(Stage::Execute))
                    .arg(OwnedBuffer::from_values(&[2, 4], &x))
                    .ret(OwnedBuffer::zeros(DataType::F32, &[2, 4]))
                    .build(&ctx);
                frame
                    .call(REVERSE_BUNDLE.handler(Stage::Execute).unwrap())
                    .unwrap();
                let mut want = vec![6.0f32, 4.0, 2.0, 0.0, 14.0, 12.0, 10.0, 8.0];
                if variant == "history" && k == 15 {
                    want[0] += 1.0;
                }
                assert_eq!(
                    frame.result(0).values::<f32>(),
                    want,
                    "{variant}, execution {k}"
                );
            }
            assert_eq!(live(), before + 1, "{variant}");
        } // dropping the context runs the deleter
        let leaked = if variant == "leaky" { 1 } else { 0 };
        assert_eq!(live(), before + leaked, "{variant}");
    }
}

#[test]
fn the_reverse_bundle_refuses_bad_attributes() {
    fake::register_type(ReverseState::registration()).unwrap();
    for (row_len, scale, variant, problem) in [
        (
            4i64,
            1.0f32,
            "pooled!",
            "attribute `variant`: expected pooled, shared_scratch",
        ),
        (0, 1.0, "pooled", "attribute `row_len`: must be in 1..="),
        (4, f32::NAN, "pooled", "attribute `scale`: must be finite"),
    ] {
        let ctx = FakeContext::new();
        let error = FrameBuilder::new(Stage::Instantiate)
            .attr("row_len", OwnedAttr::scalar(row_len))
            .attr("scale", OwnedAttr::scalar(scale))
            .attr("variant", OwnedAttr::string(variant))
            .build(&ctx)
            .call(REVERSE_BUNDLE.handler(Stage::Instantiate).unwrap())
            .unwrap_err();
        assert!(error.1.contains(problem), "{}", error.1);
    }
}

#[test]
fn the_fixture_library_exports_its_seven_bundles() {
    // The table `export_library!` builds, read as register_library reads a loaded library's.
    let library =
        xla_ffi_bundles::ffi::library::read_own(testing::library_table(), "fixture").unwrap();
    let bundles: Vec<_> = library
        .bundles
        .iter()
        .map(|b| (b.target.as_str(), b.platform, b.stages.len(), b.state_type))
        .collect();
    assert_eq!(
        bundles,
        [
            ("rmsnorm_ffi_testing_stages", "cpu", 4, Some(0)),
            ("rmsnorm_ffi_testing_context", "cpu", 1, None),
            ("rmsnorm_ffi_testing_attrs", "cpu", 1, None),
            ("rmsnorm_ffi_testing_reverse", "cpu", 2, Some(1)),
            ("rmsnorm_ffi_testing_lists", "cpu", 1, None),
            ("rmsnorm_ffi_testing_async", "cpu", 2, Some(2)),
            ("rmsnorm_ffi_testing_stage_state", "cpu", 1, None),
        ]
    );
    assert_eq!(
        library.state_types[0].name,
        StagesState::registration().name()
    );
    // The stage-state probe's user-data type: in the table's list, though no bundle has it as
    // its state, so that register_library gives it to XLA.
    let types: Vec<&str> = library
        .state_types
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(types.len(), 4);
    assert_eq!(types[3], "rmsnorm_ffi.testing.ProbeUserData");
}
