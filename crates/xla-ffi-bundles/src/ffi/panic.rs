//! The one place where panics are caught.
//!
//! Unwinding across an `extern "C"` boundary aborts the process (or worse), so every function
//! XLA calls — handlers (through [`super::trampoline`]), state deleters, thread-pool tasks —
//! runs its body inside [`catch`]. A leaf of the FFI layer: it needs only the error type, so
//! the modules that own such entries (context, types, parallel) can use it without depending
//! on the handler entry above them.

use std::any::Any;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::error::{FfiError, FfiResult};

/// Runs `body`, turning a panic into [`FfiError::Panic`] that names `context`.
pub fn catch<R>(
    context: impl FnOnce() -> String,
    body: impl FnOnce() -> FfiResult<R>,
) -> FfiResult<R> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            // Dropping a payload can itself panic; that second panic is swallowed (and its
            // payload leaked) rather than let it unwind into C.
            if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
                std::mem::forget(again);
            }
            Err(FfiError::Panic {
                context: context(),
                message,
            })
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic payload that is not a string)".to_string()
    }
}

/// Reports an error where the C signature has no way to return one (deleters, tasks). A
/// failed write to stderr is ignored: it must not panic here.
pub fn report_unreturnable<R>(result: FfiResult<R>) {
    if let Err(e) = result {
        let _ = writeln!(std::io::stderr(), "xla-ffi-bundles: {e}");
    }
}
