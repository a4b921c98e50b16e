//! GPU bundle tests that need no GPU: attribute validation and clear errors when the CUDA
//! libraries are missing (through the fake runtime), and the library search itself.

use super::driver::{Cuda, GpuError, Nvrtc, Search};
use super::*;
use xla_ffi_bundles::ffi::fake::{self, FakeContext, OwnedAttr};
use xla_ffi_bundles::ffi::{ErrorCode, Stage};

fn register() {
    fake::register_bundle_types(&[FORWARD_BUNDLE, BACKWARD_BUNDLE, RESIDUAL_BUNDLE]);
}

use fake::instantiate;

fn forward_attrs(eps: f32, row_len: i64) -> Vec<(&'static str, OwnedAttr)> {
    vec![
        ("eps", OwnedAttr::scalar(eps)),
        ("has_weight", OwnedAttr::pred(true)),
        ("row_len", OwnedAttr::scalar(row_len)),
    ]
}

#[test]
fn bundles_are_command_buffer_compatible_and_have_an_initialize_stage() {
    for def in [&FORWARD_BUNDLE, &BACKWARD_BUNDLE, &RESIDUAL_BUNDLE] {
        assert_eq!(def.traits, Traits::COMMAND_BUFFER_COMPATIBLE);
        assert!(def.handler(Stage::Initialize).is_some());
        assert!(def.handler(Stage::Instantiate).is_some());
    }
}

#[test]
fn attributes_are_validated_before_any_library_is_needed() {
    register();
    let ctx = FakeContext::new();
    let (code, msg) = instantiate(&ctx, &FORWARD_BUNDLE, forward_attrs(-1.0, 8)).unwrap_err();
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(msg.contains("invalid attribute `eps`"), "{msg}");
    let (_, msg) = instantiate(&ctx, &FORWARD_BUNDLE, forward_attrs(f32::NAN, 8)).unwrap_err();
    assert!(msg.contains("got NaN"), "{msg}");
    let (code, msg) = instantiate(&ctx, &RESIDUAL_BUNDLE, forward_attrs(-1.0, 8)).unwrap_err();
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(msg.contains("invalid attribute `eps`"), "{msg}");
    let (code, msg) = instantiate(
        &ctx,
        &BACKWARD_BUNDLE,
        vec![
            ("has_weight", OwnedAttr::pred(true)),
            ("row_len", OwnedAttr::scalar(-3i64)),
        ],
    )
    .unwrap_err();
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(msg.contains("invalid attribute `row_len`"), "{msg}");
    // A missing attribute is a decode error naming it.
    let (_, msg) = instantiate(
        &ctx,
        &BACKWARD_BUNDLE,
        vec![("row_len", OwnedAttr::scalar(3i64))],
    )
    .unwrap_err();
    assert!(msg.contains("has_weight"), "{msg}");
    assert_eq!(ctx.state_count(), 0);
}

#[test]
fn instantiate_without_a_driver_fails_with_a_clear_error() {
    if driver::cuda().is_ok() {
        eprintln!("a CUDA driver is present: nothing to check here");
        return;
    }
    register();
    let ctx = FakeContext::new();
    let (code, msg) = instantiate(&ctx, &FORWARD_BUNDLE, forward_attrs(1e-5, 8)).unwrap_err();
    assert_eq!(code, ErrorCode::FailedPrecondition, "{msg}");
    assert!(
        msg.contains("could not load the CUDA driver (libcuda)"),
        "{msg}"
    );
    assert!(msg.contains("libcuda.so.1"), "{msg}");
    assert_eq!(ctx.state_count(), 0);
}

#[test]
fn a_bogus_search_path_gives_a_clear_error_listing_what_was_tried() {
    let search = Search {
        nvrtc: Some("/nonexistent/libnvrtc.so.12".into()),
        libcuda: Some("/nonexistent/libcuda.so.1".into()),
        site_packages: vec!["/nonexistent/site-packages".into()],
        system: false,
    };
    let err = Nvrtc::load(&search).err().expect("no NVRTC there");
    let msg = err.to_string();
    assert!(matches!(err, GpuError::LibraryNotFound { .. }));
    assert!(msg.contains("could not load NVRTC"), "{msg}");
    assert!(
        msg.contains("/nonexistent/libnvrtc.so.12 (absent)"),
        "{msg}"
    );
    assert!(
        msg.contains("/nonexistent/site-packages/nvidia/cu13/lib/libnvrtc.so.13"),
        "{msg}"
    );
    assert!(msg.contains("jax[cuda12]"), "{msg}");
    let err = Cuda::load(&search).err().expect("no libcuda there");
    assert!(err.to_string().contains("/nonexistent/libcuda.so.1"));
    let ffi: FfiError = err.into();
    assert_eq!(ffi.code(), ErrorCode::FailedPrecondition);
}

#[test]
fn nvrtc_from_pip_compiles_the_kernels_when_available() {
    // Exercised fully by tests/gpu_kernels.rs (both norms); here only if the search finds one,
    // the RMS norm's module as the bundles compile it.
    let Ok(nvrtc) = driver::nvrtc() else { return };
    let source = kernels::source_for(&Default::default(), Norm::Rms);
    let compiled = nvrtc.compile(&source, "rmsnorm.cu", "compute_80").unwrap();
    for (name, _) in kernels::table(Norm::Rms) {
        assert!(compiled.ptx.contains(&format!(".entry {name}(")), "{name}");
    }
    assert!(
        !compiled.ptx.contains(".entry layernorm_"),
        "LayerNorm's are a module of their own"
    );
}
