#![doc = include_str!("../README.md")]
//!
//! ## Modules
//!
//! - [`ffi`]: the C ABI mirror of `xla/ffi/api/c_api.h` and a safe, typed layer over it
//!   (call frames, buffers, attributes, context, errors, metadata, the panic-catching
//!   trampoline, bundle declarations, platforms, loops on XLA's thread pool), in layers that
//!   `ffi`'s docs list; and what a library of bundles needs to be registered and counted: its
//!   exported table ([`export_library!`]), the loader that reads one, and the registry hooks.
//!   The only module with `unsafe` code.
//! - [`state`]: the live-state registry (one per process: libraries report into the host
//!   extension's), workspace pools and statistics.
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod ffi;
pub mod state;

/// This crate's version: what a library's exported table records, and what a host compares
/// (with [`ffi::export::LIBRARY_ABI_VERSION`]) before it registers the library's bundles.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
