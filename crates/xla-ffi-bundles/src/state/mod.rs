//! State: the live-state registry, workspace pools and the statistics built from them.
//!
//! State *types* (how XLA learns of them and frees them) are FFI concerns and live in
//! [`crate::ffi::types`]; this module holds what a state is made of.

pub mod pool;
pub mod registry;

pub use pool::{Workspace, WorkspacePool, DEFAULT_POOL_CAPACITY};
pub use registry::{snapshot, LiveState, Snapshot, StateSnapshot};
