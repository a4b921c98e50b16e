//! The XLA FFI layer: the C ABI mirror ([`sys`]) and a safe, typed layer over it.
//!
//! Only this module (and the GPU driver wrapper) touches raw pointers. Everything above it
//! declares bundles ([`bundle`]), decodes typed arguments, results and attributes ([`buffer`],
//! [`attrs`]), uses the context ([`context`]) and returns [`error::FfiError`]; the
//! [`trampoline`] turns panics and errors into `XLA_FFI_Error`s.
#![allow(unsafe_code)]

pub mod api;
pub mod attrs;
pub mod buffer;
pub mod bundle;
#[cfg(feature = "python")]
pub mod capsule;
pub mod context;
pub mod dtype;
pub mod error;
pub mod export;
#[cfg(any(test, feature = "fake-runtime"))]
pub mod fake;
pub mod frame;
pub mod metadata;
pub mod parallel;
pub mod sys;
#[cfg(test)]
mod tests;
pub mod trampoline;
pub mod types;

pub use attrs::{AttrValue, Attrs, DecodeAttrs, FromAttr, Scalar};
pub use buffer::{AnyBuffer, AnyResult, ArgsView, Buffer, Operand, ResultBuffer, ResultList};
pub use bundle::{Bundle, BundleDef, Execute, Initialize, Instantiate, Prepare, Traits};
pub use context::{Context, Stage, Stream};
pub use dtype::{DataType, NativeType};
pub use error::{DecodeErrors, ErrorCode, FfiError, FfiResult};
pub use types::{BundleState, NoState, StateType, StateTypeRegistration};
