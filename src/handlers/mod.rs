//! Handlers: the bundles this extension registers, for every platform.

pub mod contract;
pub mod cpu;
pub mod error;
pub mod gpu;
pub mod math;
pub mod operands;

pub use error::HandlerError;

use once_cell::sync::Lazy;

use xla_ffi_bundles::ffi::bundle::check_bundle;
use xla_ffi_bundles::ffi::export::LibraryTable;
use xla_ffi_bundles::ffi::{platform, BundleDef, StateTypeRegistration};

/// Every bundle of the extension, each registered for the platform it names: the RMS norm on
/// the CPU and (where JAX has a CUDA backend) on NVIDIA GPUs, under the op contract's target
/// names, and nothing else (examples and test fixtures are libraries of their own).
pub const BUNDLES: &[BundleDef] = &[
    cpu::FORWARD_BUNDLE,
    cpu::BACKWARD_BUNDLE,
    cpu::RESIDUAL_BUNDLE,
    gpu::FORWARD_BUNDLE,
    gpu::BACKWARD_BUNDLE,
    gpu::RESIDUAL_BUNDLE,
];

/// The platforms this build registers bundles for.
pub const PLATFORMS: &[&str] = &platform::NAMES;

/// The extension's own table, in the format a library exports (`ffi::export`): registration
/// reads the extension and the libraries built on it the same way.
pub static TABLE: Lazy<LibraryTable> = Lazy::new(|| {
    LibraryTable::new(BUNDLES).unwrap_or_else(|e| panic!("the extension's bundles: {e}"))
});

/// The bundles to register for `platform` (as JAX names it: "cpu", "cuda").
pub fn bundles(platform: &str) -> Result<Vec<&'static BundleDef>, HandlerError> {
    let platform = match platform.to_ascii_lowercase().as_str() {
        "host" => "cpu".to_string(),
        other => other.to_string(),
    };
    if !PLATFORMS.contains(&platform.as_str()) {
        return Err(HandlerError::Platform(platform));
    }
    Ok(BUNDLES.iter().filter(|d| d.platform == platform).collect())
}

/// The state types the bundles of `platform` use, each once, in registration order.
pub fn state_types(platform: &str) -> Result<Vec<&'static StateTypeRegistration>, HandlerError> {
    let mut types: Vec<&'static StateTypeRegistration> = Vec::new();
    for def in bundles(platform)? {
        for registration in def.types() {
            if !types.iter().any(|t| t.name() == registration.name()) {
                types.push(registration);
            }
        }
    }
    Ok(types)
}

/// Checks every bundle of every platform (a stateful bundle must make its state).
pub fn check_all() -> Result<(), String> {
    for def in BUNDLES {
        check_bundle(def)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::contract::TARGETS;

    #[test]
    fn registration_lists_are_consistent() {
        super::check_all().unwrap();
        // Every platform has every target of the contract.
        let targets = |platform: &str| -> Vec<&str> {
            let bundles = super::bundles(platform).unwrap();
            bundles.iter().map(|b| b.target).collect()
        };
        assert_eq!(targets("cpu"), TARGETS);
        assert_eq!(targets("cuda"), TARGETS);
        let types = super::state_types("cpu").unwrap();
        let mut names: Vec<_> = types.iter().map(|t| t.name()).collect();
        names.dedup();
        assert_eq!(names.len(), types.len());
        let Err(err) = super::bundles("tpu") else {
            panic!("tpu has no bundles")
        };
        assert_eq!(
            err.to_string(),
            "unsupported platform `tpu` (this build supports: cpu, cuda)"
        );
    }
}
