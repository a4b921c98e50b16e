//! rmsnorm_ffi: stateful XLA FFI handler bundles in Rust, and the RMS norm built on them.
//!
//! - [`ffi`]: the C ABI mirror of `xla/ffi/api/c_api.h` and a safe, typed layer over it
//!   (call frames, buffers, attributes, context, errors, metadata, the panic-catching
//!   trampoline, bundle declarations). The only module with `unsafe` code.
//! - [`state`]: the live-state registry, workspace pools and statistics.
//! - [`handlers`]: the bundles this extension registers.
//! - `python` (feature `python`): the `rmsnorm_ffi._native` extension module.
#![deny(unsafe_code)]

pub mod ffi;
pub mod handlers;
pub mod state;

#[cfg(feature = "python")]
mod python;

/// The README's Rust example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
