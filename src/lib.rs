//! rmsnorm_ffi: the RMS norm for JAX, as stateful XLA FFI handler bundles built on the
//! [`xla_ffi_bundles`] framework (crates/xla-ffi-bundles).
//!
//! - [`handlers`]: the bundles this extension registers, under the op contract
//!   ([`handlers::contract`]): the math, the CPU kernels (SIMD, XLA's thread pool) and the CUDA
//!   path (kernels, NVRTC, the driver wrapper: with the framework's FFI layer, the only code
//!   with `unsafe`); examples and test fixtures are libraries of their own.
//! - `python` (feature `python`): the `rmsnorm_ffi._native` extension module.
#![deny(unsafe_code)]

pub mod handlers;

#[cfg(feature = "python")]
mod python;

/// The Rust examples of docs/bundles.md, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/bundles.md")]
pub struct BundlesDocDoctests;
