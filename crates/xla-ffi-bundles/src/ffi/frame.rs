//! A validated call frame and the decoding of a handler's signature from it.

use std::ptr;

use super::api::Api;
use super::attrs::{Attrs, DecodeAttrs};
use super::buffer::{ArgsView, DecodeArgs, DecodeRets, RetsView};
use super::context::Context;
use super::error::{DecodeErrors, FfiError, FfiResult};
use super::platform::Platform;
use super::stage::Stage;
use super::sys;

/// One call frame, checked to be at least as large as the struct this crate knows. Only the
/// fields up to `attrs` (the header's `STRUCT_SIZE`) are ever read.
pub struct Frame<'a> {
    raw: *mut sys::XLA_FFI_CallFrame,
    stage: sys::XLA_FFI_ExecutionStage,
    args: &'a sys::XLA_FFI_Args,
    rets: &'a sys::XLA_FFI_Rets,
    attrs: &'a sys::XLA_FFI_Attrs,
    context: Context<'a>,
}

impl<'a> Frame<'a> {
    /// # Safety
    /// `raw` must be non-null, readable for at least `XLA_FFI_CallFrame::STRUCT_SIZE` bytes
    /// (the trampoline checks its `struct_size`), as XLA passes it, for `'a`.
    pub(crate) unsafe fn from_raw(
        raw: *mut sys::XLA_FFI_CallFrame,
        api: Api<'a>,
        keeps_stage_state: bool,
    ) -> Self {
        // SAFETY: every field read lies within STRUCT_SIZE (caller's contract).
        unsafe {
            let stage = ptr::addr_of!((*raw).stage).read();
            let ctx = ptr::addr_of!((*raw).ctx).read();
            Frame {
                raw,
                stage,
                args: &*ptr::addr_of!((*raw).args),
                rets: &*ptr::addr_of!((*raw).rets),
                attrs: &*ptr::addr_of!((*raw).attrs),
                context: Context::new(
                    api,
                    ctx,
                    Stage::from_raw(stage).unwrap_or(Stage::Execute),
                    keeps_stage_state,
                ),
            }
        }
    }

    pub(crate) fn stage_raw(&self) -> sys::XLA_FFI_ExecutionStage {
        self.stage
    }

    /// The raw argument and result lists, for a call completed after its handler returns
    /// (`pending`), which copies them: XLA reuses the frame once the handler returns.
    pub(crate) fn raw_lists(&self) -> (&'a sys::XLA_FFI_Args, &'a sys::XLA_FFI_Rets) {
        (self.args, self.rets)
    }

    /// Hands `future` to the runtime as this call's completion (the frame's `future` field).
    ///
    /// # Safety
    /// The runtime's API table must provide futures (then its call frame has the field, which
    /// lies past the `struct_size` it announces); the handler must then return no error.
    pub(crate) unsafe fn set_future(&self, future: *mut sys::XLA_FFI_Future) {
        // SAFETY: the frame is XLA's, writable for the call, and has the field (caller's
        // contract); the handler writes it as ffi.h's encoding of `ffi::Future` does.
        unsafe { ptr::addr_of_mut!((*self.raw).future).write(future) }
    }

    /// The execution context of this call.
    pub fn context(&self) -> &Context<'a> {
        &self.context
    }

    fn stage_name(&self) -> &'static str {
        self.context.stage().name()
    }

    fn args<P: Platform>(&self, errors: &mut DecodeErrors) -> Option<ArgsView<'a, P>> {
        // SAFETY: the argument list is XLA's, valid for the call.
        unsafe { ArgsView::new(self.args) }
            .map_err(|e| errors.push(e))
            .ok()
    }

    fn attrs(&self, errors: &mut DecodeErrors) -> Option<Attrs<'a>> {
        // SAFETY: the attribute list is XLA's, valid for the call.
        unsafe { Attrs::from_raw(self.attrs) }
            .map_err(|e| errors.push(e))
            .ok()
    }

    /// Decodes only the attributes (instantiate, prepare and initialize stages).
    pub fn decode_attrs<A: DecodeAttrs<'a>>(&self) -> FfiResult<A> {
        let mut errors = DecodeErrors::new();
        let attrs = self
            .attrs(&mut errors)
            .and_then(|a| A::decode(a, &mut errors));
        finish(self.stage_name(), errors, attrs)
    }

    /// Decodes arguments, results and attributes (buffers of platform `P`), reporting every
    /// failure at once.
    pub fn decode_all<
        P: Platform,
        A: DecodeArgs<'a, P>,
        R: DecodeRets<'a, P>,
        T: DecodeAttrs<'a>,
    >(
        &self,
    ) -> FfiResult<(A, R, T)> {
        let mut errors = DecodeErrors::new();
        let args_view = self.args::<P>(&mut errors);
        let args = args_view.and_then(|v| A::decode(v, &mut errors));
        let rets = args_view.and_then(|args_view| {
            // SAFETY: the result list is XLA's, valid for the call.
            unsafe { RetsView::new(self.rets, args_view) }
                .map(|v| v.hiding(A::hides_data))
                .map_err(|e| errors.push(e))
                .ok()
                .and_then(|v| R::decode(v, &mut errors))
        });
        let attrs = self
            .attrs(&mut errors)
            .and_then(|a| T::decode(a, &mut errors));
        let all = match (args, rets, attrs) {
            (Some(a), Some(r), Some(t)) => Some((a, r, t)),
            _ => None,
        };
        finish(self.stage_name(), errors, all)
    }
}

fn finish<T>(stage: &'static str, errors: DecodeErrors, value: Option<T>) -> FfiResult<T> {
    errors.into_result(stage)?;
    value.ok_or_else(|| FfiError::internal(format!("[{stage}] decoding failed without a message")))
}
