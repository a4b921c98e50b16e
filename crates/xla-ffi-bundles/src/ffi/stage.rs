//! The four execution stages of a handler bundle, as XLA numbers and JAX names them.
//!
//! A leaf of the FFI layer (it needs only [`super::sys`]): the context, the call frame, the
//! trampoline and the bundle declarations all speak of stages.

use std::fmt;

use super::sys;

/// One execution stage of a handler bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Once per call site per executable, with attributes and context only: makes the state.
    Instantiate,
    /// Before each execution, to request resources.
    Prepare,
    /// Before each execution, after resources were acquired.
    Initialize,
    /// Every call: runs the operation.
    Execute,
}

impl Stage {
    /// Every stage, in the order XLA runs them.
    pub const ALL: [Stage; 4] = [
        Stage::Instantiate,
        Stage::Prepare,
        Stage::Initialize,
        Stage::Execute,
    ];

    /// The C value of this stage.
    pub fn to_raw(self) -> sys::XLA_FFI_ExecutionStage {
        match self {
            Stage::Instantiate => sys::XLA_FFI_ExecutionStage::INSTANTIATE,
            Stage::Prepare => sys::XLA_FFI_ExecutionStage::PREPARE,
            Stage::Initialize => sys::XLA_FFI_ExecutionStage::INITIALIZE,
            Stage::Execute => sys::XLA_FFI_ExecutionStage::EXECUTE,
        }
    }

    /// The stage of a C value; `None` for a value this crate does not know.
    pub fn from_raw(raw: sys::XLA_FFI_ExecutionStage) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.to_raw() == raw)
    }

    /// The name JAX uses for the stage in `register_ffi_target`'s dict.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Instantiate => "instantiate",
            Stage::Prepare => "prepare",
            Stage::Initialize => "initialize",
            Stage::Execute => "execute",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
