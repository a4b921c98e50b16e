//! The handlers' error type, mapped to XLA status codes at the FFI boundary.

use xla_ffi_bundles::ffi::{DataType, FfiError, Operand};

/// What a handler can reject.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HandlerError {
    #[error("wrong dtype for {operand}: expected {expected}, got {got}")]
    Dtype {
        operand: Operand,
        expected: String,
        got: DataType,
    },
    #[error("wrong shape for {operand}: {problem}")]
    Shape { operand: Operand, problem: String },
    #[error("invalid attribute `{name}`: {problem}")]
    Attribute { name: &'static str, problem: String },
    #[error("unsupported platform `{0}` (this build supports: cpu, cuda)")]
    Platform(String),
}

impl HandlerError {
    /// A dtype error listing the accepted dtypes.
    pub fn dtype(operand: Operand, accepted: &[DataType], got: DataType) -> Self {
        HandlerError::Dtype {
            operand,
            expected: DataType::describe_accepted(accepted),
            got,
        }
    }

    pub fn shape(operand: Operand, problem: impl Into<String>) -> Self {
        HandlerError::Shape {
            operand,
            problem: problem.into(),
        }
    }

    pub fn attribute(name: &'static str, problem: impl Into<String>) -> Self {
        HandlerError::Attribute {
            name,
            problem: problem.into(),
        }
    }
}

impl From<HandlerError> for FfiError {
    fn from(e: HandlerError) -> Self {
        match e {
            HandlerError::Platform(_) => FfiError::Unimplemented(e.to_string()),
            _ => FfiError::InvalidArgument(e.to_string()),
        }
    }
}
