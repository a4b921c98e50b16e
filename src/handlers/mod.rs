//! Handlers: the bundles this extension registers, per platform.

pub mod cpu;
pub mod error;
pub mod gpu;
pub mod math;
pub mod operands;
pub mod scaled_copy;
pub mod testing;

pub use error::HandlerError;

use crate::ffi::bundle::check_bundle;
use crate::ffi::{BundleDef, StateTypeRegistration};

const CPU_BUNDLES: &[BundleDef] = &[
    cpu::FORWARD_BUNDLE,
    cpu::BACKWARD_BUNDLE,
    cpu::RESIDUAL_BUNDLE,
    scaled_copy::BUNDLE,
    testing::STAGES_BUNDLE,
    testing::CONTEXT_BUNDLE,
    testing::ATTRS_BUNDLE,
];

/// The RMS norm on NVIDIA GPUs (registered only where JAX has a CUDA backend).
const CUDA_BUNDLES: &[BundleDef] = &[
    gpu::FORWARD_BUNDLE,
    gpu::BACKWARD_BUNDLE,
    gpu::RESIDUAL_BUNDLE,
];

/// The platforms this build registers bundles for.
pub const PLATFORMS: &[&str] = &["cpu", "cuda"];

/// The bundles to register for `platform` (as JAX names it: "cpu", "cuda").
pub fn bundles(platform: &str) -> Result<&'static [BundleDef], HandlerError> {
    match platform.to_ascii_lowercase().as_str() {
        "cpu" | "host" => Ok(CPU_BUNDLES),
        "cuda" => Ok(CUDA_BUNDLES),
        _ => Err(HandlerError::Platform(platform.to_string())),
    }
}

/// The state types the bundles of `platform` use, each once, in registration order.
pub fn state_types(platform: &str) -> Result<Vec<&'static StateTypeRegistration>, HandlerError> {
    let mut types: Vec<&'static StateTypeRegistration> = Vec::new();
    for def in bundles(platform)? {
        if let Some(registration) = (def.state)() {
            if !types.iter().any(|t| t.name() == registration.name()) {
                types.push(registration);
            }
        }
    }
    Ok(types)
}

/// Checks every bundle of every platform (a stateful bundle must make its state).
pub fn check_all() -> Result<(), String> {
    for platform in PLATFORMS {
        for def in bundles(platform).map_err(|e| e.to_string())? {
            check_bundle(def)?;
        }
    }
    Ok(())
}
