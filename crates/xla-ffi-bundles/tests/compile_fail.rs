//! The host/device split is enforced by the compiler: a bundle for a device platform (CUDA)
//! gets device addresses, and a typed host slice of its buffers does not compile, whether it is
//! asked for in the signature (`Buffer<'a, f32>` as an argument) or in the body (`as_slice`).
//!
//! trybuild compiles each file in `tests/ui/` and compares the compiler's whole output with the
//! `.stderr` file next to it, so a case fails only with the error it documents (our
//! `on_unimplemented` message for the signature, "no method named `as_slice`" for the body);
//! the reference case, identical but for those lines, must compile and run. The expected
//! output is the current stable compiler's: after a toolchain change that only rewords it,
//! regenerate with `TRYBUILD=overwrite cargo test -p xla-ffi-bundles --test compile_fail` and
//! review the diff.

#[test]
fn device_bundles_get_addresses_and_no_host_slices() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/cuda_bundle_with_device_pointers.rs");
    cases.compile_fail("tests/ui/cuda_bundle_with_host_slice_argument.rs");
    cases.compile_fail("tests/ui/cuda_bundle_calls_as_slice.rs");
}

/// XLA:CPU keeps no prepare- or initialize-stage state (its calls for one dereference a null
/// pointer), so declaring one on a host bundle is a compile error where the declaration is a
/// `const`, as every bundle's is; the same declaration on a CUDA bundle compiles.
#[test]
fn stage_states_are_declared_for_device_bundles_only() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/stage_state_declared_for_cuda.rs");
    cases.compile_fail("tests/ui/stage_state_declared_for_host.rs");
}
