//! The FFI layer's error type and its mapping to `XLA_FFI_Error`.
//!
//! Handlers return [`FfiError`]; the trampoline turns it into an `XLA_FFI_Error` with the code
//! that [`FfiError::code`] names. Other layers keep their own error types and convert into this
//! one at the boundary (`From` impls live next to those types).

use std::fmt;

use super::sys;

/// The status codes XLA knows (absl's), without `OK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// absl's CANCELLED: the operation was cancelled.
    Cancelled,
    /// absl's UNKNOWN: an unknown error (also any C code this crate does not know).
    Unknown,
    /// absl's INVALID_ARGUMENT: the caller passed an invalid argument.
    InvalidArgument,
    /// absl's DEADLINE_EXCEEDED: the deadline passed before the operation finished.
    DeadlineExceeded,
    /// absl's NOT_FOUND: something requested was not found.
    NotFound,
    /// absl's ALREADY_EXISTS: what was to be created exists already.
    AlreadyExists,
    /// absl's PERMISSION_DENIED: the caller may not do this.
    PermissionDenied,
    /// absl's RESOURCE_EXHAUSTED: a resource (memory, a quota) ran out.
    ResourceExhausted,
    /// absl's FAILED_PRECONDITION: the system is not in the state the operation needs.
    FailedPrecondition,
    /// absl's ABORTED: the operation was aborted, e.g. by a concurrency conflict.
    Aborted,
    /// absl's OUT_OF_RANGE: the operation went past the valid range.
    OutOfRange,
    /// absl's UNIMPLEMENTED: the operation is not implemented or not supported.
    Unimplemented,
    /// absl's INTERNAL: an internal invariant was broken.
    Internal,
    /// absl's UNAVAILABLE: the service is unavailable, usually for a while.
    Unavailable,
    /// absl's DATA_LOSS: unrecoverable data loss or corruption.
    DataLoss,
    /// absl's UNAUTHENTICATED: the caller has no valid credentials.
    Unauthenticated,
}

impl ErrorCode {
    /// The C value of this code.
    pub fn to_raw(self) -> sys::XLA_FFI_Error_Code {
        use sys::XLA_FFI_Error_Code as C;
        match self {
            ErrorCode::Cancelled => C::CANCELLED,
            ErrorCode::Unknown => C::UNKNOWN,
            ErrorCode::InvalidArgument => C::INVALID_ARGUMENT,
            ErrorCode::DeadlineExceeded => C::DEADLINE_EXCEEDED,
            ErrorCode::NotFound => C::NOT_FOUND,
            ErrorCode::AlreadyExists => C::ALREADY_EXISTS,
            ErrorCode::PermissionDenied => C::PERMISSION_DENIED,
            ErrorCode::ResourceExhausted => C::RESOURCE_EXHAUSTED,
            ErrorCode::FailedPrecondition => C::FAILED_PRECONDITION,
            ErrorCode::Aborted => C::ABORTED,
            ErrorCode::OutOfRange => C::OUT_OF_RANGE,
            ErrorCode::Unimplemented => C::UNIMPLEMENTED,
            ErrorCode::Internal => C::INTERNAL,
            ErrorCode::Unavailable => C::UNAVAILABLE,
            ErrorCode::DataLoss => C::DATA_LOSS,
            ErrorCode::Unauthenticated => C::UNAUTHENTICATED,
        }
    }

    /// The code for a C value; unknown values (and `OK`, which is no error) map to `Unknown`.
    pub fn from_raw(raw: sys::XLA_FFI_Error_Code) -> ErrorCode {
        use sys::XLA_FFI_Error_Code as C;
        match raw {
            C::CANCELLED => ErrorCode::Cancelled,
            C::INVALID_ARGUMENT => ErrorCode::InvalidArgument,
            C::DEADLINE_EXCEEDED => ErrorCode::DeadlineExceeded,
            C::NOT_FOUND => ErrorCode::NotFound,
            C::ALREADY_EXISTS => ErrorCode::AlreadyExists,
            C::PERMISSION_DENIED => ErrorCode::PermissionDenied,
            C::RESOURCE_EXHAUSTED => ErrorCode::ResourceExhausted,
            C::FAILED_PRECONDITION => ErrorCode::FailedPrecondition,
            C::ABORTED => ErrorCode::Aborted,
            C::OUT_OF_RANGE => ErrorCode::OutOfRange,
            C::UNIMPLEMENTED => ErrorCode::Unimplemented,
            C::INTERNAL => ErrorCode::Internal,
            C::UNAVAILABLE => ErrorCode::Unavailable,
            C::DATA_LOSS => ErrorCode::DataLoss,
            C::UNAUTHENTICATED => ErrorCode::Unauthenticated,
            _ => ErrorCode::Unknown,
        }
    }
}

/// Decode failures of one call frame, collected so that all of them are reported together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodeErrors {
    messages: Vec<String>,
}

impl DecodeErrors {
    /// No failures yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one failure, e.g. "wrong dtype for argument 0: expected F32, got BF16".
    pub fn push(&mut self, message: impl Into<String>) {
        self.messages.push(message.into());
    }

    /// Whether nothing failed.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The recorded failures, in the order they were found.
    pub fn messages(&self) -> &[String] {
        &self.messages
    }

    /// `Ok(())` when nothing failed, else the collected failures as an error.
    pub fn into_result(self, stage: &'static str) -> Result<(), FfiError> {
        if self.messages.is_empty() {
            Ok(())
        } else {
            Err(FfiError::Decode {
                stage,
                errors: self,
            })
        }
    }
}

impl fmt::Display for DecodeErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.messages.join("; "))
    }
}

/// Everything that can go wrong in the FFI layer or in a handler, as XLA will see it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FfiError {
    /// The call frame did not match the handler's signature; every mismatch is listed.
    #[error("[{stage}] failed to decode the call frame: {errors}")]
    Decode {
        /// The stage being decoded ("execute", ...).
        stage: &'static str,
        /// Every mismatch found.
        errors: DecodeErrors,
    },
    /// A value was well-formed but not acceptable (an attribute out of range, a shape mismatch).
    #[error("{0}")]
    InvalidArgument(String),
    /// The runtime is not in a state where this can work (e.g. a state type not registered).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A resource (memory, a workspace) could not be had.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The operation is not supported (a dtype, a platform).
    #[error("{0}")]
    Unimplemented(String),
    /// A call into the XLA API failed; `message` is what XLA said.
    #[error("XLA call {call} failed: {message}")]
    Runtime {
        /// The API function called, e.g. `XLA_FFI_State_Get`.
        call: &'static str,
        /// The runtime's code for it: API 0.5 runtimes say it (`XLA_FFI_Error_GetDetails`),
        /// 0.3 runtimes do not (`Unknown`).
        code: ErrorCode,
        /// XLA's message.
        message: String,
    },
    /// A handler panicked; the panic was caught at the boundary.
    #[error("panic in {context}: {message}")]
    Panic {
        /// What was running: the target and stage, or the deleter or task.
        context: String,
        /// The panic's message, if its payload is a string.
        message: String,
    },
    /// A bug or a broken invariant.
    #[error("{0}")]
    Internal(String),
}

impl FfiError {
    /// The XLA status code this error is reported with.
    pub fn code(&self) -> ErrorCode {
        match self {
            FfiError::Decode { .. } | FfiError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            FfiError::FailedPrecondition(_) => ErrorCode::FailedPrecondition,
            FfiError::ResourceExhausted(_) => ErrorCode::ResourceExhausted,
            FfiError::Unimplemented(_) => ErrorCode::Unimplemented,
            FfiError::Runtime { code, .. } => *code,
            FfiError::Panic { .. } | FfiError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// An invalid-argument error for attribute `name`: "invalid attribute `eps`: ...".
    pub fn attribute(name: &str, problem: impl fmt::Display) -> Self {
        FfiError::InvalidArgument(format!("invalid attribute `{name}`: {problem}"))
    }

    /// An [`FfiError::InvalidArgument`] with `message`.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        FfiError::InvalidArgument(message.into())
    }

    /// An [`FfiError::FailedPrecondition`] with `message`.
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        FfiError::FailedPrecondition(message.into())
    }

    /// An [`FfiError::Internal`] with `message`.
    pub fn internal(message: impl Into<String>) -> Self {
        FfiError::Internal(message.into())
    }

    /// An [`FfiError::Unimplemented`] with `message`.
    pub fn unimplemented(message: impl Into<String>) -> Self {
        FfiError::Unimplemented(message.into())
    }
}

/// Result type of the FFI layer and of handlers.
pub type FfiResult<T> = Result<T, FfiError>;

/// Messages from the typed views (`as_slice` and friends) are invalid-argument errors.
impl From<String> for FfiError {
    fn from(message: String) -> Self {
        FfiError::InvalidArgument(message)
    }
}
