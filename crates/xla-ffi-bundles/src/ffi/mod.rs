//! The XLA FFI layer: the C ABI mirror ([`sys`]) and a safe, typed layer over it.
//!
//! Only this module (and the GPU driver wrapper) touches raw pointers. Everything above it
//! declares bundles ([`bundle`]), decodes typed arguments, results and attributes ([`buffer`],
//! [`attrs`]), uses the context ([`context`]) and returns [`error::FfiError`]; the
//! [`trampoline`] turns panics and errors into `XLA_FFI_Error`s.
//!
//! # Layers
//!
//! Each module uses only modules of lower layers (no two modules import each other, directly or
//! through a cycle; `tests/ffi_layers.rs` checks every `use` against this list):
//!
//! 1. [`sys`]: the C mirror.
//! 2. leaves: [`error`], [`dtype`], [`stage`], [`platform`], then [`panic`](mod@panic) (panic catching;
//!    it needs only the error type).
//! 3. [`api`] (the checked function table) and [`host`] (the registry a library reports into).
//! 4. [`buffer`], then [`attrs`] (attributes share the list check of buffers).
//! 5. [`types`]: state types, their ids and deleters; [`collectives`]: XLA's collectives
//!    extension (API 0.5).
//! 6. [`context`]: state, stream, device, thread pool, device memory.
//! 7. [`frame`] (a validated call frame and its decoding) and [`parallel`] (loops on XLA's pool).
//! 8. [`metadata`]: the registration-time answer, and what a handler declares about itself.
//! 9. [`trampoline`]: the handler entry every `extern "C"` handler goes through.
//! 10. [`bundle`]: stage traits, the generic entries, bundle declarations, then [`pending`]
//!     (the execute stage of bundles that complete their calls later).
//! 11. [`export`] (a library's table of bundles and state types), then [`library`] (loading and
//!     checking another library's table), then `capsule` (PyCapsules, feature `python`).
//!
//! `fake` (tests only) may use any of them.
#![allow(unsafe_code)]

pub mod api;
pub mod attrs;
pub mod buffer;
pub mod bundle;
#[cfg(feature = "python")]
pub mod capsule;
pub mod collectives;
pub mod context;
pub mod dtype;
pub mod error;
pub mod export;
#[cfg(any(test, feature = "fake-runtime"))]
pub mod fake;
pub mod frame;
pub mod host;
pub mod library;
pub mod metadata;
pub mod panic;
pub mod parallel;
pub mod pending;
pub mod platform;
pub mod stage;
pub mod sys;
#[cfg(test)]
mod tests;
pub mod trampoline;
pub mod types;

pub use attrs::{AttrValue, Attrs, DecodeAttrs, FromAttr, Scalar};
pub use buffer::{
    AliasedArg, AnyBuffer, AnyResult, ArgsView, Arity, Buffer, DeviceBuffer, DeviceResult, InPlace,
    InPlaceBuffer, Operand, RankedBuffer, RankedResult, RemainingArgs, ResultBuffer, ResultList,
};
pub use bundle::{
    Bundle, BundleDef, BundleState, Execute, Initialize, Instantiate, NoState, Prepare, StageTypes,
    Traits,
};
pub use collectives::{Collectives, Communicator, GroupMode, ReplicaGroups};
pub use context::{Context, Extension, Stream};
pub use dtype::{DataType, NativeType};
pub use error::{DecodeErrors, ErrorCode, FfiError, FfiResult};
pub use pending::{ExecuteAsync, Pending};
pub use platform::{Cuda, Device, Host, Platform};
pub use stage::Stage;
pub use types::{StateType, StateTypeRegistration};
