//! rmsnorm_ffi: stateful XLA FFI handler bundles in Rust, and the RMS norm built on them.
//!
//! - [`ffi`]: the C ABI mirror of `xla/ffi/api/c_api.h` and a safe, typed layer over it
//!   (call frames, buffers, attributes, context, errors, metadata, the panic-catching
//!   trampoline, bundle declarations, platforms), in layers that `ffi`'s docs list; and what a
//!   library built on this crate needs to be registered and counted: its exported table
//!   (`export_library!`), the loader that reads one, and the registry hooks. The only module
//!   with `unsafe` code (with the GPU driver wrapper).
//! - [`state`]: the live-state registry (one per process: libraries report into the
//!   extension's), workspace pools and statistics.
//! - [`handlers`]: the bundles this extension registers, under the op contract
//!   ([`handlers::contract`]); examples and test fixtures are libraries of their own.
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
