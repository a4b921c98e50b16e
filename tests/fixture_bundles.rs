//! The test fixtures' bundles (`tests/fixtures/testing_bundles`) through the fake runtime: a
//! panic in any stage comes back as an error naming the target and stage, and the context
//! offers what the fixture reads. The same source is the library the Python tests register
//! against real XLA (tests/python/test_stages_and_context.py, test_errors.py).

#[allow(dead_code)]
#[path = "fixtures/testing_bundles/src/lib.rs"]
mod testing;

use rmsnorm_ffi::ffi::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use rmsnorm_ffi::ffi::{DataType, ErrorCode, Stage, StateType};
use testing::{StagesState, CONTEXT_BUNDLE, STAGES_BUNDLE};

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
            .ret(OwnedBuffer::zeros(DataType::S32, &[6]))
            .build(&ctx);
        frame
            .call(CONTEXT_BUNDLE.handler(Stage::Execute).unwrap())
            .unwrap();
        assert_eq!(frame.result(0).values::<i32>(), vec![3, 2, 77, 1, 0, 3]);
    }
}

#[test]
fn the_fixture_library_exports_its_three_bundles() {
    // The table `export_library!` builds, read as register_library reads a loaded library's.
    let library = rmsnorm_ffi::ffi::library::read_own(testing::library_table(), "fixture").unwrap();
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
        ]
    );
    assert_eq!(
        library.state_types[0].name,
        StagesState::registration().name()
    );
}
