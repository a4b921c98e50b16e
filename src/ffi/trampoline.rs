//! The one place where panics are caught, and the entry every handler goes through.
//!
//! Unwinding across an `extern "C"` boundary aborts the process (or worse), so every function XLA
//! calls — handlers, state deleters, thread-pool tasks — runs its body inside [`catch`]. For
//! handlers, [`handle`] also does what every handler must do first: check the call frame's
//! size, answer the metadata extension without decoding anything, check the stage, and turn
//! any error into an `XLA_FFI_Error` carrying the target's name.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::api::Api;
use super::context::Stage;
use super::error::{FfiError, FfiResult};
use super::frame::Frame;
use super::metadata;
use super::sys;
use super::types::StateTypeRegistration;

/// Runs `body`, turning a panic into [`FfiError::Panic`] that names `context`.
pub fn catch<R>(
    context: impl FnOnce() -> String,
    body: impl FnOnce() -> FfiResult<R>,
) -> FfiResult<R> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => Err(FfiError::Panic {
            context: context(),
            message: panic_message(payload.as_ref()),
        }),
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

/// Reports an error where the C signature has no way to return one (deleters, tasks).
pub fn report_unreturnable<R>(result: FfiResult<R>) {
    if let Err(e) = result {
        eprintln!("rmsnorm_ffi: {e}");
    }
}

/// What the trampoline knows about the handler it runs.
#[derive(Clone, Copy)]
pub struct HandlerInfo {
    pub target: &'static str,
    pub stage: Stage,
    pub traits: sys::XLA_FFI_Handler_Traits,
    /// The state type this handler creates (instantiate stages of stateful bundles).
    pub creates_state: Option<&'static StateTypeRegistration>,
}

/// The body of every `extern "C"` handler entry.
///
/// # Safety
/// `frame` must be null or a call frame as XLA passes it: readable for its `struct_size`, with
/// lists and pointers valid for the duration of the call.
pub unsafe fn handle(
    frame: *mut sys::XLA_FFI_CallFrame,
    info: &HandlerInfo,
    body: impl FnOnce(&Frame<'_>) -> FfiResult<()>,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: forwarded contract.
    let api = match unsafe { frame_api(frame) } {
        Ok(api) => api,
        Err(e) => {
            // Without an API table there is no way to build an error for XLA.
            eprintln!("rmsnorm_ffi: {} [{}]: {e}", info.target, info.stage);
            return ptr::null_mut();
        }
    };
    let result = catch(
        || format!("{} [{}]", info.target, info.stage),
        || {
            // SAFETY: forwarded contract; `api` came from this frame.
            let frame = unsafe { Frame::from_raw(frame, api) }?;
            // SAFETY: the frame's extension chain is XLA's.
            if let Some(extension) = unsafe { metadata::find_extension(frame.raw()) } {
                // SAFETY: `find_extension` returned a metadata extension of this frame.
                return unsafe { metadata::answer(extension, info) };
            }
            if frame.stage_raw() != info.stage.to_raw() {
                return Err(FfiError::invalid_argument(format!(
                    "wrong execution stage: this handler is for `{}`, the call is for `{}`",
                    info.stage,
                    Stage::from_raw(frame.stage_raw())
                        .map(|s| s.name().to_string())
                        .unwrap_or_else(|| format!("stage {}", frame.stage_raw().0))
                )));
            }
            body(&frame)
        },
    );
    match result {
        Ok(()) => ptr::null_mut(),
        Err(e) => api.create_error_raw(e.code(), &format!("{}: {e}", info.target)),
    }
}

/// The API table of a frame, checking that the frame is large enough to hold it.
///
/// # Safety
/// As for [`handle`].
unsafe fn frame_api<'a>(frame: *mut sys::XLA_FFI_CallFrame) -> FfiResult<Api<'a>> {
    if frame.is_null() {
        return Err(FfiError::internal("null call frame"));
    }
    // SAFETY: a non-null frame has a readable `struct_size`.
    let size = unsafe { ptr::addr_of!((*frame).struct_size).read() };
    let needed = std::mem::offset_of!(sys::XLA_FFI_CallFrame, api) + std::mem::size_of::<usize>();
    if size < needed {
        return Err(FfiError::internal(format!(
            "call frame of {size} bytes is too small to hold the API table"
        )));
    }
    // SAFETY: the frame is large enough to hold `api` (checked above); the table is XLA's.
    unsafe { Api::from_raw(ptr::addr_of!((*frame).api).read()) }
}
