//! The handler entry: the body of every `extern "C"` handler XLA calls.
//!
//! [`handle`] does what every handler must do first: check the call frame's size, answer the
//! metadata extension without decoding anything, check the stage, run the stage's body inside
//! [`super::panic::catch`], and turn any error into an `XLA_FFI_Error` carrying the target's
//! name. Only [`super::bundle`]'s generic entries sit above it.

use std::io::Write;
use std::mem::size_of;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use super::api::Api;
use super::error::{FfiError, FfiResult};
use super::frame::Frame;
use super::metadata::{self, HandlerInfo};
use super::panic::catch;
use super::stage::Stage;
use super::sys;

/// The last valid API table seen. XLA has one table per process; a frame that comes without
/// one (some runtimes send the metadata call so) still gets its errors reported through it.
static KNOWN_API: AtomicPtr<sys::XLA_FFI_Api> = AtomicPtr::new(ptr::null_mut());

/// The body of every `extern "C"` handler entry.
///
/// In XLA's order: check the frame's size, answer the metadata extension (before decoding
/// anything, and without needing the API table), check the stage, then run `body`.
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
    let api = unsafe { frame_api(frame) };
    // Errors are reported through the frame's table or, failing that, the last one seen.
    // SAFETY: only tables that passed `Api::from_raw` are stored; XLA's table is static.
    let reporter = api.or_else(|| unsafe { Api::from_raw(KNOWN_API.load(Ordering::Relaxed)) }.ok());
    let result = catch(
        || format!("{} [{}]", info.target, info.stage),
        || {
            // SAFETY: forwarded contract.
            unsafe { check_frame_size(frame) }?;
            // SAFETY: the frame covers `extension_start` (checked above); the chain is XLA's.
            if let Some(extension) = unsafe { metadata::find_extension(frame) } {
                // The frame's own table: one without a table gets the oldest answer, 0.3.
                let runtime = api.map(|api| api.version());
                // SAFETY: `find_extension` returned a metadata extension of this frame.
                return unsafe { metadata::answer(extension, info, runtime) };
            }
            let api = api.ok_or_else(|| {
                FfiError::internal("the call frame has no usable XLA_FFI_Api table")
            })?;
            // SAFETY: forwarded contract; the frame's size was checked above.
            let frame = unsafe { Frame::from_raw(frame, api, info.keeps_stage_state) };
            if frame.stage_raw() != info.stage.to_raw() {
                return Err(FfiError::invalid_argument(format!(
                    "wrong execution stage: this handler is for `{}`, the call is for `{}`",
                    info.stage,
                    match Stage::from_raw(frame.stage_raw()) {
                        Some(s) => s.name().to_string(),
                        // API 0.5's command-buffer recording, which no bundle here handles.
                        None if frame.stage_raw() == sys::v0_5::XLA_FFI_ExecutionStage_RECORD => {
                            "record".to_string()
                        }
                        None => format!("stage {}", frame.stage_raw().0),
                    }
                )));
            }
            body(&frame)
        },
    );
    match (result, reporter) {
        (Ok(()), _) => ptr::null_mut(),
        (Err(e), Some(api)) => api.create_error_raw(e.code(), &report(info, &e)),
        (Err(e), None) => {
            // No table to build an error with: all that can be done is to say so.
            let _ = writeln!(
                std::io::stderr(),
                "xla-ffi-bundles: {} [{}]: {e} (not reported to XLA: no API table)",
                info.target,
                info.stage
            );
            ptr::null_mut()
        }
    }
}

/// The message XLA gets for `error`: the target, then the stage in brackets, as decode errors
/// and panics carry it already ("scale: [execute] x has shape [2, 3] ..."), so that an error a
/// stage returns says which stage of which target raised it.
fn report(info: &HandlerInfo, error: &FfiError) -> String {
    match error {
        FfiError::Decode { .. } | FfiError::Panic { .. } => format!("{}: {error}", info.target),
        _ => format!("{}: [{}] {error}", info.target, info.stage),
    }
}

/// Checks that `frame` is non-null and at least as large as the call frame this crate knows.
///
/// # Safety
/// As for [`handle`].
unsafe fn check_frame_size(frame: *mut sys::XLA_FFI_CallFrame) -> FfiResult<()> {
    if frame.is_null() {
        return Err(FfiError::internal("null call frame"));
    }
    // SAFETY: a non-null frame has a readable `struct_size`.
    let size = unsafe { ptr::addr_of!((*frame).struct_size).read() };
    if size < sys::XLA_FFI_CallFrame::STRUCT_SIZE {
        return Err(FfiError::invalid_argument(format!(
            "unexpected XLA_FFI_CallFrame size: expected at least {}, got {size}; check the \
             installed jaxlib version",
            sys::XLA_FFI_CallFrame::STRUCT_SIZE
        )));
    }
    Ok(())
}

/// The frame's API table, if it has a valid one (remembered for frames that have none).
///
/// # Safety
/// As for [`handle`].
unsafe fn frame_api<'a>(frame: *mut sys::XLA_FFI_CallFrame) -> Option<Api<'a>> {
    if !frame.is_null() {
        // SAFETY: a non-null frame has a readable `struct_size`.
        let size = unsafe { ptr::addr_of!((*frame).struct_size).read() };
        let needed = std::mem::offset_of!(sys::XLA_FFI_CallFrame, api) + size_of::<usize>();
        if size >= needed {
            // SAFETY: the frame is large enough to hold `api` (checked above).
            let raw = unsafe { ptr::addr_of!((*frame).api).read() };
            // SAFETY: a non-null table in a frame is XLA's, valid for the call.
            if let Ok(api) = unsafe { Api::from_raw(raw) } {
                KNOWN_API.store(raw.cast_mut(), Ordering::Relaxed);
                return Some(api);
            }
        }
    }
    None
}
