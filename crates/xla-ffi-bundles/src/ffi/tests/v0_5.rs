//! API 0.5 through the fake runtime: the version a handler reports, error codes read back,
//! extension lookup, the collectives extension and custom options, each against a 0.5 table
//! and a 0.3 one (what jaxlib 0.12 and 0.10 hand a handler).

use super::super::api::Api;
use super::super::collectives::{GroupMode, ReplicaGroups};
use super::super::context::Context;
use super::super::error::{ErrorCode, FfiError};
use super::super::fake::{self, FakeContext, FrameBuilder, OwnedAttr};
use super::super::metadata::reported_minor;
use super::super::stage::Stage;
use super::super::sys;
use super::{execute, PROBE};

/// A context of `stage` for `ctx` under the table `api`.
fn context(api: *const sys::XLA_FFI_Api, ctx: &FakeContext, stage: Stage) -> Context<'_> {
    // SAFETY: the fake's tables live for the process.
    let api = unsafe { Api::from_raw(api) }.unwrap();
    Context::new(api, ctx.as_raw(), stage, true)
}

#[test]
fn handlers_report_the_newest_version_both_they_and_the_runtime_speak() {
    for (minor, expected) in [(1, 3), (3, 3), (4, 3), (5, 5), (6, 5)] {
        assert_eq!(reported_minor(Some((0, minor))), expected, "0.{minor}");
    }
    // Another major version says itself whether it takes 0.3.
    assert_eq!(reported_minor(Some((1, 0))), 3);
    assert_eq!(reported_minor(None), 3);
    let ctx = FakeContext::new();
    for (api, expected) in [(fake::api(), 5), (fake::api_v0_3(), 3)] {
        let mut frame = FrameBuilder::metadata().api(api).build(&ctx);
        frame.call(execute(&PROBE)).unwrap();
        let version = frame.metadata().unwrap().api_version;
        assert_eq!(
            (version.major_version, version.minor_version),
            (0, expected)
        );
    }
}

#[test]
fn runtime_errors_keep_their_code_where_the_runtime_says_it() {
    for (api, code) in [
        (fake::api(), ErrorCode::NotFound),
        (fake::api_v0_3(), ErrorCode::Unknown),
    ] {
        // SAFETY: the fake's tables live for the process.
        let api = unsafe { Api::from_raw(api) }.unwrap();
        let raw = api.create_error_raw(ErrorCode::NotFound, "gone");
        match api.take_error("XLA_FFI_Test", raw) {
            FfiError::Runtime {
                call,
                code: got,
                message,
            } => assert_eq!(
                (call, got, message.as_str()),
                ("XLA_FFI_Test", code, "gone")
            ),
            other => panic!("{other:?}"),
        }
    }
}

/// Two groups of two devices, as a handler would keep them in its state.
fn groups() -> ReplicaGroups {
    ReplicaGroups::new(&[&[0, 1], &[2, 3]])
}

#[test]
fn a_communicator_is_requested_in_prepare_and_handed_out_in_execute() {
    let mut ctx = FakeContext::new();
    ctx.attach_collectives((0, 2));
    let prepare = context(fake::api(), &ctx, Stage::Prepare);
    let collectives = prepare.collectives().unwrap().expect("attached");
    assert_eq!(collectives.version(), (0, 2));
    collectives
        .request_communicator(GroupMode::CrossReplica, &groups(), 7)
        .unwrap();
    collectives
        .request_communicator(
            GroupMode::FlattenedId,
            &ReplicaGroups::new(&[&[0, 1, 2, 3]]),
            8,
        )
        .unwrap();
    let requests = ctx.collectives().requests.lock().clone();
    assert_eq!(
        requests,
        [
            (0, vec![vec![0, 1], vec![2, 3]], 7),
            (3, vec![vec![0, 1, 2, 3]], 8)
        ]
    );
    for stage in [Stage::Initialize, Stage::Execute] {
        let collectives = context(fake::api(), &ctx, stage)
            .collectives()
            .unwrap()
            .unwrap();
        let second = collectives
            .communicator(
                GroupMode::FlattenedId,
                &ReplicaGroups::new(&[&[0, 1, 2, 3]]),
                8,
            )
            .unwrap();
        assert_eq!(
            second.as_raw() as usize,
            2,
            "the second request's communicator"
        );
        // Groups that were never requested: the runtime's error, with its code (API 0.5).
        let err = collectives
            .communicator(GroupMode::CrossReplica, &groups(), 9)
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::NotFound, "{err}");
        assert!(err.to_string().contains("no clique was requested"), "{err}");
    }
}

#[test]
fn communicators_are_requested_and_got_only_in_their_stages() {
    let mut ctx = FakeContext::new();
    ctx.attach_collectives((0, 2));
    let execute = context(fake::api(), &ctx, Stage::Execute)
        .collectives()
        .unwrap()
        .unwrap();
    let err = execute
        .request_communicator(GroupMode::CrossReplica, &groups(), 7)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::FailedPrecondition);
    assert!(
        err.to_string()
            .contains("for the prepare stage, not execute"),
        "{err}"
    );
    let prepare = context(fake::api(), &ctx, Stage::Prepare)
        .collectives()
        .unwrap()
        .unwrap();
    let err = prepare
        .communicator(GroupMode::CrossReplica, &groups(), 7)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("for the initialize or execute stage, not prepare"),
        "{err}"
    );
    assert!(ctx.collectives().requests.lock().is_empty());
}

#[test]
fn no_collectives_where_none_is_attached_or_the_runtime_is_older() {
    let mut ctx = FakeContext::new();
    let none = context(fake::api(), &ctx, Stage::Prepare);
    assert!(none.collectives().unwrap().is_none());
    assert!(none.find_extension(12345).unwrap().is_none());
    ctx.attach_collectives((0, 2));
    let found = context(fake::api(), &ctx, Stage::Prepare)
        .find_extension(sys::v0_5::XLA_FFI_Extension_Collectives)
        .unwrap()
        .expect("attached");
    assert_eq!(found.id().extension_type, 129);
    // A 0.3 runtime has no extensions: none, not an error.
    let old = context(fake::api_v0_3(), &ctx, Stage::Prepare);
    assert!(old.collectives().unwrap().is_none());
    assert!(old.custom_options().unwrap().is_none());
}

#[test]
fn collectives_of_another_major_version_are_refused() {
    let mut ctx = FakeContext::new();
    ctx.attach_collectives((1, 0));
    let err = context(fake::api(), &ctx, Stage::Prepare)
        .collectives()
        .err()
        .expect("refused");
    assert_eq!(err.code(), ErrorCode::Unimplemented);
    assert!(
        err.to_string()
            .contains("version 1.0; this crate speaks 0.2"),
        "{err}"
    );
}

#[test]
fn custom_options_are_a_dictionary_empty_when_none_were_passed() {
    let mut ctx = FakeContext::new();
    let options = context(fake::api(), &ctx, Stage::Execute)
        .custom_options()
        .unwrap()
        .expect("a 0.5 runtime");
    assert!(options.is_empty());
    ctx.set_custom_options(&[
        ("tile".to_string(), OwnedAttr::scalar(64i64)),
        ("mode".to_string(), OwnedAttr::string("fast")),
    ]);
    let options = context(fake::api(), &ctx, Stage::Execute)
        .custom_options()
        .unwrap()
        .unwrap();
    assert_eq!(options.len(), 2);
    // Sorted by name, as XLA passes attributes.
    assert_eq!(options.name(0).unwrap(), b"mode");
    assert_eq!(options.name(1).unwrap(), b"tile");
}

#[test]
fn a_0_5_function_is_refused_by_version_not_only_by_size() {
    // A 0.3 runtime's table, even one as long as 0.5's, has no 0.5 functions; a 0.5 one has.
    let full = sys::v0_5::XLA_FFI_Api::STRUCT_SIZE;
    // SAFETY: the fake's tables live for the process.
    let current = unsafe { Api::from_raw(fake::api_with_version(full, 5)) }.unwrap();
    assert!(super::super::api::api_fn!(current, v0_5, XLA_FFI_CustomOptions_Get).is_ok());
    for api in [fake::api_v0_3(), fake::api_with_version(full, 3)] {
        // SAFETY: as above.
        let api = unsafe { Api::from_raw(api) }.unwrap();
        let found = super::super::api::api_fn!(api, v0_5, XLA_FFI_CustomOptions_Get);
        let err = found.expect_err("refused");
        assert_eq!(err.code(), ErrorCode::Unimplemented);
        assert!(
            err.to_string()
                .contains("XLA_FFI_CustomOptions_Get is XLA FFI API 0.5's; the runtime speaks 0.3"),
            "{err}"
        );
    }
}

#[test]
fn a_record_stage_call_is_refused_by_name() {
    let ctx = FakeContext::new();
    let mut frame = FrameBuilder::new(Stage::Execute).build(&ctx);
    frame.frame.stage = sys::v0_5::XLA_FFI_ExecutionStage_RECORD;
    let (code, message) = frame.call(execute(&PROBE)).unwrap_err();
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(
        message.contains("this handler is for `execute`, the call is for `record`"),
        "{message}"
    );
}
